package node

import (
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/spacedev/space/internal/storage"
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

// storeSpace is the part of the store that measures its space (*storage.Store).
type storeSpace interface {
	Space() ([]storage.FSSpace, error)
}

// RegisterMetrics registers the node's own gauges and counters on reg, labelled with
// the node's name (docs/operations.md, "Node metrics"). Their values are what the
// node's loops last learnt: scraping queries neither PostgreSQL nor the runtime.
func (n *Node) RegisterMetrics(reg prometheus.Registerer) {
	labels := prometheus.Labels{"node": n.cfg.Name}
	read := func(fn func(h *healthState) float64) func() float64 {
		return func() float64 {
			n.health.mu.Lock()
			defer n.health.mu.Unlock()
			return fn(&n.health)
		}
	}
	b2f := func(b bool) float64 {
		if b {
			return 1
		}
		return 0
	}
	reg.MustRegister(
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "space_node_up", ConstLabels: labels,
			Help: "1 while the node is registered, heartbeating, its runtime answers, its store is above its disk reserve and it is not shutting down (GET /healthz also pings PostgreSQL)."},
			read(func(h *healthState) float64 {
				return b2f(h.registered && h.fenced == "" && h.hbErr == "" && h.runtimeErr == "" && h.diskLow == "" && !h.stopping)
			})),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "space_node_heartbeat_age_seconds", ConstLabels: labels,
			Help: "Seconds since the node last recorded a heartbeat in PostgreSQL."},
			read(func(h *healthState) float64 {
				if h.hbOK.IsZero() {
					return 0
				}
				return time.Since(h.hbOK).Seconds()
			})),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "space_node_heartbeat_failures_total", ConstLabels: labels,
			Help: "Heartbeats that failed (PostgreSQL unreachable, or the node fenced)."},
			read(func(h *healthState) float64 { return float64(h.hbFailures) })),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "space_node_fenced", ConstLabels: labels,
			Help: "1 once the node learnt it was fenced (it stops)."},
			read(func(h *healthState) float64 { return b2f(h.fenced != "") })),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "space_node_runtime_up", ConstLabels: labels,
			Help: "1 when the last runtime probe (listing its instances) succeeded."},
			read(func(h *healthState) float64 { return b2f(h.registered && h.runtimeErr == "") })),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "space_node_disk_low", ConstLabels: labels,
			Help: "1 while the store is at its disk reserve (creates, wakes and snapshots are refused)."},
			read(func(h *healthState) float64 { return b2f(h.diskLow != "") })),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "space_node_epoch", ConstLabels: labels,
			Help: "The node's registration epoch (it grows at each start and each fencing)."},
			func() float64 { return float64(n.currentEpoch()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "space_node_oom_kills_total", ConstLabels: labels,
			Help: "Processes that sandboxes' agents ended because their sandbox neared its host memory limit (runtimes without an OOM killer inside: gVisor)."},
			func() float64 { return float64(n.oomKills.Load()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "space_node_sandboxes_ready", ConstLabels: labels,
			Help: "Sandboxes on this node whose agent answers."},
			func() float64 {
				n.mu.Lock()
				defer n.mu.Unlock()
				c := 0
				for _, ok := range n.ready {
					if ok {
						c++
					}
				}
				return float64(c)
			}),
	)
	for source, c := range map[string]*atomic.Int64{"agent": &n.sampledBy.agent, "host": &n.sampledBy.host} {
		reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "space_node_metric_samples_total",
			ConstLabels: prometheus.Labels{"node": n.cfg.Name, "source": source},
			Help:        "Resource samples of running sandboxes taken by asking their agent, or from the host alone (the sandbox idle since, its agent left alone)."},
			func() float64 { return float64(c.Load()) }))
	}
	if sp, ok := n.disk.(storeSpace); ok {
		space := func(free bool) func() float64 {
			return func() float64 {
				fss, err := sp.Space()
				if err != nil || len(fss) == 0 {
					return 0
				}
				if free {
					return float64(fss[0].FreeBytes)
				}
				return float64(fss[0].TotalBytes)
			}
		}
		reg.MustRegister(
			prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "space_node_store_bytes", ConstLabels: labels,
				Help: "Size of the node's btrfs store."}, space(false)),
			prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "space_node_store_free_bytes", ConstLabels: labels,
				Help: "Free space of the node's btrfs store (what unprivileged writers may use)."}, space(true)),
		)
	}
}
