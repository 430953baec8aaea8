package node

import (
	"context"
	"errors"
	"time"
)

// Touch records activity on a sandbox (data-plane requests, attached streams, process
// output); flushActivity writes it to the database for idle detection.
func (n *Node) Touch(id string) {
	n.mu.Lock()
	n.active[id] = time.Now()
	n.mu.Unlock()
}

// flushActivity records the sandboxes touched since the last flush.
func (n *Node) flushActivity(ctx context.Context) {
	n.mu.Lock()
	var touched []string
	for id, t := range n.active {
		if !t.IsZero() {
			touched = append(touched, id)
			n.active[id] = time.Time{}
		}
	}
	n.mu.Unlock()
	if err := n.st.TouchSandboxes(ctx, touched); err != nil && ctx.Err() == nil {
		n.log.Warn("record activity", "err", err)
	}
}

// pollOutputActivity asks every running agent when its processes last wrote output.
func (n *Node) pollOutputActivity(ctx context.Context) {
	n.mu.Lock()
	ready := make([]string, 0, len(n.ready))
	for id := range n.ready {
		ready = append(ready, id)
	}
	n.mu.Unlock()
	for _, id := range ready {
		n.pollAgentActivity(ctx, id)
	}
}

// activityEvery is how often the node asks a sandbox's agent whether its processes
// wrote output: often enough to keep idle detection within 5 % of the sandbox's idle
// timeout (every activityPoll for timeouts up to 40 s), and at least once a minute.
// Every question wakes the sandbox: an idle gVisor sandbox used 4.4 ms of CPU a second
// while it was asked every 2 s, and 0.26 ms left alone (docs/benchmarks.md).
func activityEvery(idle time.Duration) time.Duration {
	if idle <= 0 {
		return maxActivityPoll // never suspended: the activity is only shown
	}
	return min(max(idle/20, activityPoll), maxActivityPoll)
}

// noteIdleTimeout records a running sandbox's idle timeout for activityEvery.
func (n *Node) noteIdleTimeout(id string, idle time.Duration) {
	n.mu.Lock()
	n.idleOf[id] = idle
	n.mu.Unlock()
}

// pollAgentActivity counts process output since the last look as activity, unless the
// agent was asked more recently than its sandbox's idle timeout needs (activityEvery).
func (n *Node) pollAgentActivity(ctx context.Context, id string) {
	n.mu.Lock()
	every := activityPoll
	if idle, ok := n.idleOf[id]; ok {
		every = activityEvery(idle)
	}
	// Half a poll period of slack: the poll loop's ticks come every activityPoll.
	if last, ok := n.polled[id]; ok && time.Since(last) < every-activityPoll/2 {
		n.mu.Unlock()
		return
	}
	n.polled[id] = time.Now()
	n.mu.Unlock()
	hctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	h, err := n.agent(id).Health(hctx)
	if err != nil {
		return
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if h.LastActivity.After(n.seenOutput[id]) {
		if !n.seenOutput[id].IsZero() {
			n.active[id] = time.Now()
		}
		n.seenOutput[id] = h.LastActivity
	}
}

// measureLater queues a disk usage measurement. Measuring walks the sandbox's extents
// (btrfs filesystem du), which costs CPU: it runs in the background every few seconds
// rather than on the path of a create or a transition.
func (n *Node) measureLater(id string) {
	n.mu.Lock()
	n.toMeasure[id] = true
	n.mu.Unlock()
}

// measureQueued measures the sandboxes queued by measureLater.
func (n *Node) measureQueued(ctx context.Context) {
	n.mu.Lock()
	ids := make([]string, 0, len(n.toMeasure))
	for id := range n.toMeasure {
		ids = append(ids, id)
	}
	clear(n.toMeasure)
	n.mu.Unlock()
	for _, id := range ids {
		if ctx.Err() != nil {
			return
		}
		n.measureDisk(ctx, id)
	}
}

// measureDisk records the sandbox's exclusive disk usage.
func (n *Node) measureDisk(ctx context.Context, id string) {
	b, err := n.disk.ExclusiveBytes(ctx, id)
	if err != nil {
		if !errors.Is(err, context.Canceled) {
			n.log.Debug("measure disk", "sandbox", id, "err", err)
		}
		return
	}
	_ = n.st.SetDiskBytes(context.WithoutCancel(ctx), id, b)
}
