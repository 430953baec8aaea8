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

// pollAgentActivity counts process output since the last look as activity.
func (n *Node) pollAgentActivity(ctx context.Context, id string) {
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
