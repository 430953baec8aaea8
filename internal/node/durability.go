package node

import (
	"context"
	"sync"

	"github.com/spacedev/space/internal/crash"
)

// Durability of suspend checkpoints. A suspend is reported once its checkpoint is
// written (storage MarkWritten: whole in the host's page cache, complete on this boot
// of the host); fsyncing a checkpoint costs about as long as writing it again, so it
// runs after the report, in the background, and marks the checkpoint complete for good.
// A crash of space meanwhile loses nothing (the page cache survives it, and the next
// start syncs what it finds written: syncWrittenLater); a crash of the host before the
// sync finishes loses the memory, which the next plan records as a lost snapshot, as
// for any checkpoint that is not complete (docs/lifecycle.md, "Durability").

// pendingSyncs tracks the background syncs of checkpoints by sandbox. The zero value
// is ready to use.
type pendingSyncs struct {
	mu sync.Mutex
	m  map[string]*pendingSync
}

type pendingSync struct {
	cancel    context.CancelFunc // stops the write-back between chunks
	cancelled bool
}

// syncLater makes sandbox id's written checkpoint in dir durable in the background. A
// later cancelSync (the checkpoint is restored, removed or replaced) keeps it from
// marking a directory it no longer owns.
func (n *Node) syncLater(id, dir string) {
	ctx, cancel := context.WithCancel(n.work)
	p := &pendingSync{cancel: cancel}
	n.syncs.mu.Lock()
	if old := n.syncs.m[id]; old != nil {
		old.cancelled = true
		old.cancel()
	}
	if n.syncs.m == nil {
		n.syncs.m = map[string]*pendingSync{}
	}
	n.syncs.m[id] = p
	n.syncs.mu.Unlock()
	n.wg.Add(1)
	go func() {
		defer n.wg.Done()
		defer cancel()
		// The fsyncs run unlocked (a wake meanwhile cancels and goes on at once, and
		// the write-back stops: a restored checkpoint is removed, its pages need never
		// reach the disk); only the marker is written under the lock, so it never lands
		// in a directory that was taken over.
		err := n.disk.Sync(ctx, dir)
		n.syncs.mu.Lock()
		defer n.syncs.mu.Unlock()
		if n.syncs.m[id] == p {
			delete(n.syncs.m, id)
		}
		if p.cancelled || n.work.Err() != nil {
			return
		}
		if err == nil {
			err = n.disk.MarkComplete(dir) // everything is synced: only the marker is new
		}
		if err != nil {
			n.log.Warn("make suspend snapshot durable; it stays complete until the host reboots", "sandbox", id, "err", err)
			return
		}
		crash.Point("suspend.durable")
	}()
}

// cancelSync stops a background sync of sandbox id's checkpoint from marking it
// complete. It returns at once.
func (n *Node) cancelSync(id string) {
	n.syncs.mu.Lock()
	defer n.syncs.mu.Unlock()
	if p := n.syncs.m[id]; p != nil {
		p.cancelled = true
		p.cancel()
		delete(n.syncs.m, id)
	}
}

// syncWrittenLater makes durable a suspended sandbox's checkpoint that a crash of the
// node left written but not synced (called when the node adopts its sandboxes).
func (n *Node) syncWrittenLater(id string) {
	dir, err := n.disk.CheckpointDir(id)
	if err != nil || !n.disk.IsComplete(dir) || n.disk.IsDurable(dir) {
		return
	}
	n.syncLater(id, dir)
}
