package e2b

import (
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/service"
)

// sandboxMetric is E2B's SandboxMetric. CPU count, memory total and disk total are the
// sandbox's limits (its cpu, memory_mb and disk_mb), as on E2B, not the host's.
type sandboxMetric struct {
	Timestamp     time.Time `json:"timestamp"`
	TimestampUnix int64     `json:"timestampUnix"`
	CPUCount      int       `json:"cpuCount"`
	CPUUsedPct    float64   `json:"cpuUsedPct"`
	MemUsed       int64     `json:"memUsed"`
	MemTotal      int64     `json:"memTotal"`
	MemCache      int64     `json:"memCache"`
	DiskUsed      int64     `json:"diskUsed"`
	DiskTotal     int64     `json:"diskTotal"`
}

func metricJSON(m api.MetricSample) sandboxMetric {
	return sandboxMetric{Timestamp: m.Time.UTC(), TimestampUnix: m.Time.Unix(), CPUCount: m.CPUCount, CPUUsedPct: m.CPUUsedPct,
		MemUsed: m.MemUsed, MemTotal: m.MemTotal, MemCache: m.MemCache, DiskUsed: m.DiskUsed, DiskTotal: m.DiskTotal}
}

// unixParam reads an optional unix-seconds query parameter.
func unixParam(r *http.Request, name string) (time.Time, error) {
	s := r.URL.Query().Get(name)
	if s == "" {
		return time.Time{}, nil
	}
	v, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return time.Time{}, fault.New(fault.Invalid, "%s must be unix seconds", name)
	}
	return time.Unix(v, 0), nil
}

// metrics handles GET /sandboxes/{id}/metrics?start=&end= (unix seconds): the
// sandbox's samples in the range, oldest first, from the history its node keeps
// (every 5 s while it runs, averaged as they age; see docs/operations.md). A sandbox
// that runs but has no sample yet gets one taken now.
func (g *Gateway) metrics(w http.ResponseWriter, r *http.Request, p *service.Principal) error {
	start, err := unixParam(r, "start")
	if err != nil {
		return err
	}
	end, err := unixParam(r, "end")
	if err != nil {
		return err
	}
	if !end.IsZero() {
		end = end.Add(time.Second - time.Nanosecond) // the whole second asked for
	}
	sb, err := g.live(r.Context(), p, r.PathValue("id"))
	if err != nil {
		return err
	}
	if !start.IsZero() && !end.IsZero() && end.Before(start) {
		writeJSON(w, http.StatusOK, []sandboxMetric{})
		return nil
	}
	_, samples, err := g.api.Metrics(r.Context(), p, sb.ID, start, end)
	if err != nil {
		return err
	}
	out := make([]sandboxMetric, 0, len(samples))
	for _, m := range samples {
		out = append(out, metricJSON(m))
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}

// manyMetrics handles GET /sandboxes/metrics?sandbox_ids=a,b: the latest sample of
// each running sandbox (of the last minute).
func (g *Gateway) manyMetrics(w http.ResponseWriter, r *http.Request, p *service.Principal) error {
	out := map[string]sandboxMetric{}
	since := time.Now().Add(-time.Minute)
	for _, id := range strings.Split(r.URL.Query().Get("sandbox_ids"), ",") {
		if id = strings.TrimSpace(id); id == "" {
			continue
		}
		sb, err := g.live(r.Context(), p, id)
		if fault.Is(err, fault.NotFound) {
			continue
		}
		if err != nil {
			return err
		}
		if paused(sb) || sb.State != api.StateRunning {
			continue
		}
		if _, samples, err := g.api.Metrics(r.Context(), p, sb.ID, since, time.Time{}); err == nil && len(samples) > 0 {
			out[id] = metricJSON(samples[len(samples)-1])
		}
	}
	writeJSON(w, http.StatusOK, map[string]any{"sandboxes": out})
	return nil
}
