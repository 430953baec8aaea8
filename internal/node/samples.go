package node

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/guest/agentclient"
	"github.com/spacedev/space/internal/guest/envdpb"
	"github.com/spacedev/space/internal/runtime"
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
//
// A question to an agent wakes its sandbox (under gVisor a few milliseconds of the
// sandbox's CPU each time, most of what an idle sandbox costs). Where the runtime reads
// an instance's CPU time on the host (runtime.CPUTimer), the node reads that every round
// instead, takes the sample's CPU use from it, and asks the agent only when the sandbox
// used more than busyShare of a CPU since the last look, or its last answer is
// askEvery old: an idle sandbox is left alone, and its memory figures are at most
// askEvery old.

// Sampling parameters.
const (
	compactEvery  = time.Minute
	sampleTimeout = 2 * time.Second
	sampleWorkers = 8
	// busyShare is the share of one CPU above which a sandbox has done something since
	// the last look and its agent is asked (0.2 %: 10 ms of CPU in a 5 s round; an
	// idle gVisor sandbox uses about 0.03 %, one question to its agent 2–10 ms).
	busyShare = 0.002
	// askEvery is how old an agent's last answer may grow before it is asked anyway.
	askEvery = time.Minute
)

// hostLook is what the node keeps of a sandbox between samples when its runtime reads
// CPU time on the host.
type hostLook struct {
	cpu   time.Duration      // the instance's CPU time at the last look (after any question)
	at    time.Time          // when
	asked time.Time          // when its agent last answered
	last  store.MetricSample // that answer
}

// sampleCounts counts the samples taken by asking agents and from the host alone.
type sampleCounts struct{ agent, host atomic.Int64 }

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

// sample takes one sandbox's sample: from the host alone when its runtime reads CPU
// time and the sandbox has been idle since its agent last answered (see above), else
// from its agent. CPU use is scaled to the sandbox's own CPUs (the agent measures
// against the CPUs its kernel shows, which under gVisor are the host's), memory is
// bounded by the sandbox's memory limit.
func (n *Node) sample(ctx context.Context, sb *store.Sandbox) (store.MetricSample, bool) {
	ctx, cancel := context.WithTimeout(ctx, sampleTimeout)
	defer cancel()
	timer, _ := n.rt.(runtime.CPUTimer)
	var (
		prev   hostLook
		seen   bool
		cpu    time.Duration
		now    time.Time
		hostOK bool
	)
	if timer != nil {
		n.mu.Lock()
		prev, seen = n.looked[sb.ID]
		n.mu.Unlock()
		var err error
		cpu, err = timer.CPUTime(ctx, sb.ID)
		now, hostOK = time.Now(), err == nil
		if err != nil {
			n.log.Debug("host cpu time", "sandbox", sb.ID, "err", err)
		}
		// A count lower than before is a new instance (a restore): ask.
		seen = seen && hostOK && cpu >= prev.cpu
		if seen && now.Sub(prev.asked) < askEvery && !busy(cpu-prev.cpu, now.Sub(prev.at)) {
			out := prev.last
			out.CPUPct = hostCPUPct(cpu-prev.cpu, now.Sub(prev.at), sb.Spec.CPU)
			out.DiskUsed = n.diskUsed(ctx, sb)
			n.look(sb.ID, hostLook{cpu: cpu, at: now, asked: prev.asked, last: prev.last})
			n.sampledBy.host.Add(1)
			return out, true
		}
	}
	var m agentMetrics
	if err := n.agent(sb.ID).GetJSON(ctx, envdpb.Prefix+"/metrics", &m, agentclient.MaxSmallReply); err != nil {
		n.log.Debug("sample sandbox", "sandbox", sb.ID, "err", err)
		return store.MetricSample{}, false
	}
	n.sampledBy.agent.Add(1)
	out := store.MetricSample{SandboxID: sb.ID, Resolution: int(store.SamplePeriod / time.Second),
		CPUPct: store.ScaleCPU(m.CPUUsedPct, m.CPUCount, sb.Spec.CPU), MemCache: max(m.MemCache, 0),
		MemUsed: min(max(m.MemUsed, 0), int64(sb.Spec.MemoryMB)<<20), DiskUsed: n.diskUsed(ctx, sb)}
	if hostOK {
		if seen {
			out.CPUPct = hostCPUPct(cpu-prev.cpu, now.Sub(prev.at), sb.Spec.CPU)
		}
		// The next look counts from after this question: its cost is the node's, not
		// the sandbox's.
		if after, err := timer.CPUTime(ctx, sb.ID); err == nil && after >= cpu {
			at := time.Now()
			n.look(sb.ID, hostLook{cpu: after, at: at, asked: at, last: out})
		}
	}
	return out, true
}

// look keeps a sandbox's host reading, unless it stopped meanwhile (dropAgent).
func (n *Node) look(id string, l hostLook) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.ready[id] {
		n.looked[id] = l
	}
}

// diskUsed is the sandbox's disk use from the store's accounting, else as last measured.
func (n *Node) diskUsed(ctx context.Context, sb *store.Sandbox) int64 {
	if u, ok := n.disk.(usageReader); ok {
		if du, err := u.SandboxUsage(ctx, sb.ID); err == nil {
			return du.UsedBytes
		}
	}
	return sb.DiskExclusiveBytes
}

// busy tells whether used CPU time over elapsed wall time is more than busyShare of a CPU.
func busy(used, elapsed time.Duration) bool {
	return float64(used) > busyShare*float64(elapsed)
}

// hostCPUPct is CPU time used over elapsed wall time as a percentage of the sandbox's
// CPUs, at most 100.
func hostCPUPct(used, elapsed time.Duration, cpus int) float64 {
	if elapsed <= 0 {
		return 0
	}
	return min(max(100*float64(used)/(float64(elapsed)*float64(max(cpus, 1))), 0), 100)
}
