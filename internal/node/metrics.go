package node

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// OperationMetrics observes lifecycle operation latencies (an OpObserver).
type OperationMetrics struct {
	hist *prometheus.HistogramVec
}

// NewOperationMetrics registers the operation latency histogram.
func NewOperationMetrics(reg *prometheus.Registry) *OperationMetrics {
	h := prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "space_operation_duration_seconds",
		Help:    "Lifecycle operation latency (request to completion) by kind and result.",
		Buckets: prometheus.ExponentialBuckets(0.01, 2, 14),
	}, []string{"kind", "result"})
	reg.MustRegister(h)
	return &OperationMetrics{hist: h}
}

// Observe records one finished operation.
func (o *OperationMetrics) Observe(kind, result string, d time.Duration) {
	if o != nil {
		o.hist.WithLabelValues(kind, result).Observe(d.Seconds())
	}
}
