package service

import (
	"context"
	"fmt"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/guest/agentclient"
	"github.com/spacedev/space/internal/guest/envdpb"
	"github.com/spacedev/space/internal/store"
)

// Sandbox metrics (docs/operations.md, "Sandbox metrics"): the node samples its running
// sandboxes every few seconds and keeps a bounded history per sandbox. Totals are the
// sandbox's limits, never the host's.

// maxMetricSamples bounds one answer (a sandbox keeps fewer: see store.CompactMetrics).
const maxMetricSamples = 5000

// Metrics returns a sandbox's samples from start to end (zero: open), oldest first.
// When the range reaches now and the sandbox runs but has no sample in it yet (it just
// started), one is taken now and returned (not kept).
func (s *Service) Metrics(ctx context.Context, p *Principal, id string, start, end time.Time) (*store.Sandbox, []api.MetricSample, error) {
	if !start.IsZero() && !end.IsZero() && end.Before(start) {
		return nil, nil, invalid("end is before start")
	}
	sb, err := s.sandbox(ctx, p, id)
	if err != nil {
		return nil, nil, err
	}
	rows, err := s.st.Metrics(ctx, sb.ID, start, end, maxMetricSamples)
	if err != nil {
		return nil, nil, err
	}
	out := make([]api.MetricSample, 0, len(rows))
	for _, m := range rows {
		out = append(out, metricAPI(sb, m))
	}
	now := time.Now()
	if len(out) == 0 && end.IsZero() || len(out) == 0 && !end.Before(now.Add(-time.Second)) {
		if sb.DeletedAt == nil && sb.State == api.StateRunning && sb.DesiredState == api.StateRunning && !now.Before(start) {
			if m, err := s.sampleNow(ctx, sb); err == nil {
				out = append(out, metricAPI(sb, m))
			} else {
				s.log.Debug("sample sandbox now", "sandbox", sb.ID, "err", err)
			}
		}
	}
	return sb, out, nil
}

// metricAPI converts a stored sample, with the sandbox's limits as totals.
func metricAPI(sb *store.Sandbox, m store.MetricSample) api.MetricSample {
	res := "5s"
	switch {
	case m.Resolution >= 3600:
		res = "1h"
	case m.Resolution >= 60:
		res = "1m"
	case m.Resolution > 0:
		res = fmt.Sprintf("%ds", m.Resolution)
	}
	return api.MetricSample{Time: m.At.UTC(), Resolution: res, CPUCount: sb.Spec.CPU, CPUUsedPct: m.CPUPct,
		MemUsed: m.MemUsed, MemTotal: int64(sb.Spec.MemoryMB) << 20, MemCache: m.MemCache,
		DiskUsed: m.DiskUsed, DiskTotal: int64(sb.Spec.DiskMB) << 20}
}

// sampleNow asks a running sandbox's agent for its use now.
func (s *Service) sampleNow(ctx context.Context, sb *store.Sandbox) (store.MetricSample, error) {
	t, err := s.target(ctx, sb)
	if err != nil {
		return store.MetricSample{}, err
	}
	var m struct {
		CPUCount   int     `json:"cpu_count"`
		CPUUsedPct float64 `json:"cpu_used_pct"`
		MemUsed    int64   `json:"mem_used"`
		MemCache   int64   `json:"mem_cache"`
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	agent, err := s.Agent(ctx, t)
	if err != nil {
		return store.MetricSample{}, err
	}
	if err := agent.GetJSON(ctx, envdpb.Prefix+"/metrics", &m, agentclient.MaxSmallReply); err != nil {
		return store.MetricSample{}, err
	}
	return store.MetricSample{SandboxID: sb.ID, At: time.Now().UTC().Truncate(time.Second), Resolution: int(store.SamplePeriod / time.Second),
		CPUPct: store.ScaleCPU(m.CPUUsedPct, m.CPUCount, sb.Spec.CPU), MemUsed: min(max(m.MemUsed, 0), int64(sb.Spec.MemoryMB)<<20),
		MemCache: max(m.MemCache, 0), DiskUsed: sb.DiskExclusiveBytes}, nil
}
