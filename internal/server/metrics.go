package server

import (
	"context"
	"net/http"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/spacedev/space/internal/store"
)

// apiMetrics are the control plane's Prometheus metrics.
type apiMetrics struct {
	requests *prometheus.HistogramVec
}

// sandboxCollector reports live sandboxes by state, read from the database at scrape time.
type sandboxCollector struct {
	st   *store.Store
	desc *prometheus.Desc
}

func (c *sandboxCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c *sandboxCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	counts, err := c.st.CountSandboxesByState(ctx)
	if err != nil {
		ch <- prometheus.NewInvalidMetric(c.desc, err)
		return
	}
	for state, n := range counts {
		ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(n), state)
	}
}

func newAPIMetrics(reg *prometheus.Registry, st *store.Store) *apiMetrics {
	m := &apiMetrics{
		requests: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "space_http_request_duration_seconds",
			Help:    "Control-plane HTTP request latency by route pattern and status.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2.5, 12),
		}, []string{"route", "code"}),
	}
	reg.MustRegister(m.requests)
	reg.MustRegister(&sandboxCollector{st: st, desc: prometheus.NewDesc("space_sandboxes",
		"Live sandboxes by observed state.", []string{"state"}, nil)})
	return m
}

type statusRecorder struct {
	http.ResponseWriter
	code int
}

func (s *statusRecorder) WriteHeader(code int) {
	if s.code == 0 {
		s.code = code
	}
	s.ResponseWriter.WriteHeader(code)
}

func (s *statusRecorder) Unwrap() http.ResponseWriter { return s.ResponseWriter }

// instrument records request latencies by route pattern (never by raw path, so ids do
// not explode the label space).
func (m *apiMetrics) instrument(mux *http.ServeMux) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		rec := &statusRecorder{ResponseWriter: w}
		mux.ServeHTTP(rec, r)
		_, pattern := mux.Handler(r)
		if rec.code == 0 {
			rec.code = http.StatusOK
		}
		m.requests.WithLabelValues(pattern, strconv.Itoa(rec.code)).Observe(time.Since(start).Seconds())
	})
}
