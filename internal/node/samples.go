package node

import (
	"context"
	"sync"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/guest/agentclient"
	"github.com/spacedev/space/internal/guest/envdpb"
	"github.com/spacedev/space/internal/storage"
	"github.com/spacedev/space/internal/store"
)

// Resource samples (docs/operations.md, "Sandbox metrics"): every store.SamplePeriod the node
// asks the agent of each of its running sandboxes for its use (envd's /metrics: CPU
// since the last sample, memory) and reads the sandbox's disk use from the store's
// accounting, and stores one row per sandbox in one statement. Every minute it ages
// the samples of its sandboxes (store.CompactMetrics): the history of a sandbox is kept
// for its life and bounded. What a sandbox may use (its cpu, memory_mb and disk_mb) is
// not sampled: readers take it from the sandbox's spec.

// Sampling parameters.
const (
	compactEvery  = time.Minute
	sampleTimeout = 2 * time.Second
	sampleWorkers = 8
)

// agentMetrics is envd's /metrics body (internal/guest/agent), the fields the node uses.
type agentMetrics struct {
	CPUCount   int     `json:"cpu_count"`
	CPUUsedPct float64 `json:"cpu_used_pct"`
	MemUsed    int64   `json:"mem_used"`
	MemCache   int64   `json:"mem_cache"`
}

// usageReader is the store's live disk accounting (btrfs quotas: no cost to read).
type usageReader interface {
	SandboxUsage(ctx context.Context, id string) (storage.DiskUsage, error)
}

// runSamples samples the node's running sandboxes until ctx ends.
func (n *Node) runSamples(ctx context.Context) error {
	t := time.NewTicker(store.SamplePeriod)
	defer t.Stop()
	lastCompact := time.Now()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		n.sampleMetrics(ctx)
		if time.Since(lastCompact) >= compactEvery {
			lastCompact = time.Now()
			if err := n.st.CompactMetrics(ctx, n.cfg.ID, time.Now()); err != nil && ctx.Err() == nil {
				n.log.Warn("age metrics", "err", err)
			}
		}
	}
}

// sampleMetrics takes one sample of every running sandbox of the node and stores them.
func (n *Node) sampleMetrics(ctx context.Context) {
	list, err := n.st.ListSandboxes(ctx, store.SandboxFilter{NodeID: n.cfg.ID, States: []string{api.StateRunning}})
	if err != nil {
		if ctx.Err() == nil {
			n.log.Warn("list sandboxes to sample", "err", err)
		}
		return
	}
	start := time.Now()
	var (
		mu  sync.Mutex
		out []store.MetricSample
		wg  sync.WaitGroup
	)
	sem := make(chan struct{}, sampleWorkers)
	now := time.Now().UTC().Truncate(time.Second)
	for _, sb := range list {
		n.mu.Lock()
		ready := n.ready[sb.ID]
		n.mu.Unlock()
		if !ready {
			continue
		}
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			m, ok := n.sample(ctx, sb)
			if !ok {
				return
			}
			m.At = now
			mu.Lock()
			out = append(out, m)
			mu.Unlock()
		}()
	}
	wg.Wait()
	sampled := time.Since(start)
	if err := n.st.InsertMetrics(ctx, out); err != nil && ctx.Err() == nil {
		n.log.Warn("store metrics", "err", err)
	}
	if len(out) > 0 {
		n.log.Debug("sampled sandboxes", "count", len(out), "sample", sampled.Round(time.Microsecond),
			"total", time.Since(start).Round(time.Microsecond))
	}
}

// sample asks one sandbox's agent for its use. CPU use is scaled to the sandbox's own
// CPUs (the agent measures against the CPUs its kernel shows, which under gVisor are
// the host's), memory is bounded by the sandbox's memory limit.
func (n *Node) sample(ctx context.Context, sb *store.Sandbox) (store.MetricSample, bool) {
	ctx, cancel := context.WithTimeout(ctx, sampleTimeout)
	defer cancel()
	var m agentMetrics
	if err := n.agent(sb.ID).GetJSON(ctx, envdpb.Prefix+"/metrics", &m, agentclient.MaxSmallReply); err != nil {
		n.log.Debug("sample sandbox", "sandbox", sb.ID, "err", err)
		return store.MetricSample{}, false
	}
	out := store.MetricSample{SandboxID: sb.ID, Resolution: int(store.SamplePeriod / time.Second),
		CPUPct: store.ScaleCPU(m.CPUUsedPct, m.CPUCount, sb.Spec.CPU), MemCache: max(m.MemCache, 0),
		MemUsed: min(max(m.MemUsed, 0), int64(sb.Spec.MemoryMB)<<20), DiskUsed: sb.DiskExclusiveBytes}
	if u, ok := n.disk.(usageReader); ok {
		if du, err := u.SandboxUsage(ctx, sb.ID); err == nil {
			out.DiskUsed = du.UsedBytes
		}
	}
	return out, true
}
