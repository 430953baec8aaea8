package node

import (
	"context"
	"errors"

	"github.com/spacedev/space/internal/runtime"
	"github.com/spacedev/space/internal/store"
)

// Out of memory. On a runtime whose host may end an instance whole at its memory limit
// (runtime.MemoryWatcher: gVisor, which has no OOM killer inside), the node watches
// each sandbox it serves and, when the sandbox's memory nears the limit, asks its agent
// to end the process holding the most (POST /v1/memory/reclaim), as a guest kernel's
// OOM killer would: the sandbox and its other processes stay. A watch runs while the
// sandbox is served (ready): it starts with serving and stops when the node stops
// serving the sandbox (a pause, a checkpoint, a stop), so a checkpoint's own memory use
// never ends a process. Usage that stays above the threshold and goes on growing is
// reported again (at most once a second), and the next largest process goes. Should
// the memory still reach the limit (a program faster than the reaction, or memory no
// process holds: files in /tmp and /dev/shm, which the runtime bounds to half the
// memory each), the host's OOM killer ends the instance as before and the node
// recovers the sandbox from its disk.

// serving marks sb served (ready for the data plane) and watches its memory.
func (n *Node) serving(sb *store.Sandbox) {
	n.setReady(sb.ID, true)
	n.watchMemory(sb)
}

// watchMemory starts sb's memory watch unless one runs or the runtime has none.
func (n *Node) watchMemory(sb *store.Sandbox) {
	w, ok := n.rt.(runtime.MemoryWatcher)
	if !ok || n.work == nil {
		return
	}
	n.mu.Lock()
	if n.memWatches[sb.ID] != nil || !n.ready[sb.ID] {
		n.mu.Unlock()
		return
	}
	ctx, cancel := context.WithCancel(n.work)
	n.memWatches[sb.ID] = cancel
	n.mu.Unlock()
	// The root lets the runtime write out files the sandbox filled its memory with.
	root, _ := n.diskPath(sb.ID)
	spec, id := n.spec(sb, root, nil), sb.ID
	// The entry stays when the watch ends by itself (its instance gone, or nothing to
	// watch): every new instance is served again after the node stopped serving the old
	// one, which ends the entry, and the reconcile loop's calls to serving do not start
	// a watch again meanwhile.
	go func() {
		defer cancel()
		err := w.WatchMemory(ctx, spec, func(usage, limit int64) { n.relieveMemory(ctx, id, usage, limit) })
		if err != nil && !errors.Is(err, runtime.ErrUnsupported) && ctx.Err() == nil {
			n.log.Warn("cannot watch the sandbox's memory: at its limit the host's OOM killer acts alone", "sandbox", id, "err", err)
		}
	}()
}

// stopMemoryWatchLocked ends sandbox id's memory watch. n.mu is held.
func (n *Node) stopMemoryWatchLocked(id string) {
	if cancel := n.memWatches[id]; cancel != nil {
		cancel()
		delete(n.memWatches, id)
	}
}

// relieveMemory asks the agent of sandbox id to end its largest process.
func (n *Node) relieveMemory(ctx context.Context, id string, usage, limit int64) {
	v, ended, err := n.agent(id).ReclaimMemory(ctx)
	switch {
	case err != nil:
		n.log.Warn("sandbox near its memory limit; its agent did not end a process", "sandbox", id,
			"usage_mib", usage>>20, "limit_mib", limit>>20, "err", err)
	case !ended:
		n.log.Warn("sandbox near its memory limit; its agent found no process to end", "sandbox", id,
			"usage_mib", usage>>20, "limit_mib", limit>>20)
	default:
		n.oomKills.Add(1)
		n.log.Warn("sandbox near its memory limit: its agent ended the largest process", "sandbox", id,
			"usage_mib", usage>>20, "limit_mib", limit>>20, "pid", v.PID, "name", v.Name, "rss_mib", v.RSS>>20)
	}
}
