package node

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/ids"
	"github.com/spacedev/space/internal/runtime"
	"github.com/spacedev/space/internal/store"
)

// Base snapshots: a release's booted, idle sandbox saved once per runtime, runtime
// version and size class, so that new sandboxes restore instead of booting. They live
// in the node's store under templates/<hex>/snapshots/<key>/{disk,checkpoint}.

// baseKey names the base snapshot of a size class for this node's runtime.
func (n *Node) baseKey(spec store.SandboxSpec) string {
	v := strings.Map(func(r rune) rune {
		if r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '.' || r == '-' {
			return r
		}
		return '_'
	}, n.info.Version)
	// The agent binary is part of the snapshot's memory: a new agent gets new snapshots.
	return fmt.Sprintf("%s-%s-agent%s-%dcpu-%dmb", n.info.Name, v, n.agentHash[:8], spec.CPU, spec.MemoryMB)
}

// baseSnapshotFor returns the complete base snapshot that fits a new sandbox.
func (n *Node) baseSnapshotFor(digest string, spec store.SandboxSpec) (runtime.Snapshotter, string, bool) {
	snap, err := n.snapshotter()
	if err != nil || n.cfg.NoBaseSnapshots {
		return nil, "", false
	}
	dir, err := n.disk.BaseSnapshotDir(digest, n.baseKey(spec))
	if err != nil || !n.disk.IsComplete(filepath.Join(dir, "checkpoint")) {
		return nil, "", false
	}
	return snap, dir, true
}

// snapshotJobs dedups background base snapshot builds.
type snapshotJobs struct {
	mu      sync.Mutex
	running map[string]bool
}

// ensureBaseSnapshotLater builds the base snapshot of a release and size class in the
// background if it is missing.
func (n *Node) ensureBaseSnapshotLater(digest string, spec store.SandboxSpec) {
	if _, err := n.snapshotter(); err != nil || n.cfg.NoBaseSnapshots {
		return
	}
	key := digest + "/" + n.baseKey(spec)
	n.snapJobs.mu.Lock()
	if n.snapJobs.running == nil {
		n.snapJobs.running = map[string]bool{}
	}
	if n.snapJobs.running[key] {
		n.snapJobs.mu.Unlock()
		return
	}
	n.snapJobs.running[key] = true
	n.snapJobs.mu.Unlock()
	n.wg.Add(1)
	go func() {
		defer n.wg.Done()
		defer func() {
			n.snapJobs.mu.Lock()
			delete(n.snapJobs.running, key)
			n.snapJobs.mu.Unlock()
		}()
		if _, _, ok := n.baseSnapshotFor(digest, spec); ok {
			return
		}
		if err := n.buildBaseSnapshot(n.work, digest, spec); err != nil && n.work.Err() == nil {
			n.log.Warn("base snapshot failed", "digest", digest, "err", err)
		}
	}()
}

// buildBaseSnapshot boots a throwaway instance of the release, waits for its agent,
// checkpoints it and publishes disk + checkpoint as the base snapshot.
func (n *Node) buildBaseSnapshot(ctx context.Context, digest string, spec store.SandboxSpec) (err error) {
	snap, err := n.snapshotter()
	if err != nil {
		return err
	}
	start := time.Now()
	final, err := n.disk.BaseSnapshotDir(digest, n.baseKey(spec))
	if err != nil {
		return err
	}
	tmp, err := n.disk.TempDir("base-snapshot")
	if err != nil {
		return err
	}
	defer func() { _ = n.disk.RemoveAll(context.WithoutCancel(ctx), tmp) }()
	sb := &store.Sandbox{ID: "bs" + ids.Secret(18), TemplateDigest: digest, Spec: spec}
	defer func() { n.cleanupLocal(context.WithoutCancel(ctx), sb.ID) }()
	root, err := n.createDisk(ctx, sb.ID, digest)
	if err != nil {
		return err
	}
	if err := n.boot(ctx, sb, root); err != nil {
		return err
	}
	if err := n.checkpoint(ctx, snap, sb.ID, filepath.Join(tmp, "checkpoint")); err != nil {
		return err
	}
	_ = n.rt.Destroy(ctx, sb.ID)
	if err := n.disk.CopyDisk(ctx, root, filepath.Join(tmp, "disk"), true); err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(final), 0o755); err != nil {
		return err
	}
	if err := os.Rename(tmp, final); err != nil {
		if n.disk.IsComplete(filepath.Join(final, "checkpoint")) {
			return nil // another build won
		}
		return err
	}
	n.log.Info("base snapshot ready", "digest", digest, "key", n.baseKey(spec), "took", time.Since(start).Round(time.Millisecond))
	return nil
}

// prepareClones snapshots a source once for its pending clones and gives each clone
// its own copy-on-write disk and memory image. The source keeps running (it is
// checkpointed and restored, a pause of well under a second).
func (n *Node) prepareClones(ctx context.Context, src *store.Sandbox) *store.Sandbox {
	pending, err := n.st.ClonesPending(ctx, src.ID)
	if err != nil || len(pending) == 0 {
		return src
	}
	snap, err := n.snapshotter()
	if err != nil {
		n.failClones(ctx, pending, err)
		return src
	}
	start := time.Now()
	batch, err := n.disk.CloneBatchDir(src.ID, pending[0].CloneBatch)
	if err != nil {
		n.failClones(ctx, pending, err)
		return src
	}
	defer func() { _ = n.disk.RemoveAll(context.WithoutCancel(ctx), batch) }()
	root, err := n.diskPath(src.ID)
	if err != nil {
		n.failClones(ctx, pending, err)
		return src
	}
	memDir := filepath.Join(batch, "checkpoint")
	diskCopy := filepath.Join(batch, "disk")
	if src.State == api.StateSuspended {
		cp, err := n.disk.CheckpointDir(src.ID)
		if err == nil && n.disk.IsComplete(cp) {
			memDir = cp
			diskCopy = root
		} else {
			n.failClones(ctx, pending, fmt.Errorf("the source's snapshot is missing"))
			return src
		}
	} else {
		wasPaused := src.State == api.StatePaused
		if wasPaused {
			if err := snap.Resume(ctx, src.ID); err != nil {
				n.failClones(ctx, pending, err)
				return src
			}
		}
		if err := n.checkpoint(ctx, snap, src.ID, memDir); err != nil {
			st, cerr := n.afterFailedCheckpoint(ctx, src, memDir, err)
			n.failClones(ctx, pending, cerr)
			return n.report(ctx, src, store.Observed{State: st, ObservedGeneration: src.ObservedGeneration, Error: src.Error})
		}
		// The source is stopped now: its disk matches the checkpoint.
		derr := n.disk.CopyDisk(ctx, root, diskCopy, true)
		if err := n.restoreFrom(ctx, snap, src, memDir, root); err != nil {
			n.log.Error("restoring a clone source failed; booting it from disk", "sandbox", src.ID, "err", err)
			if berr := n.boot(ctx, src, root); berr != nil {
				src = n.report(ctx, src, store.Observed{State: api.StateStopped, ObservedGeneration: src.ObservedGeneration, Error: "restore after clone snapshot: " + berr.Error()})
			}
		}
		if wasPaused {
			_ = snap.Pause(ctx, src.ID)
			n.setReady(src.ID, false)
		}
		if derr != nil {
			n.failClones(ctx, pending, derr)
			return src
		}
	}
	for _, c := range pending {
		if err := n.prepareClone(ctx, c, memDir, diskCopy); err != nil {
			n.failClones(ctx, []*store.Sandbox{c}, err)
			continue
		}
		if err := n.st.SetCloneReady(ctx, c.ID); err != nil {
			n.log.Warn("mark clone ready", "sandbox", c.ID, "err", err)
		}
	}
	n.log.Info("clone snapshot prepared", "source", src.ID, "clones", len(pending), "took", time.Since(start).Round(time.Millisecond))
	return src
}

// prepareClone gives one clone its disk and memory image (both O(1) copies).
func (n *Node) prepareClone(ctx context.Context, c *store.Sandbox, memDir, disk string) error {
	if _, err := n.createDiskFrom(ctx, c.ID, disk); err != nil {
		return err
	}
	cp, err := n.disk.CheckpointDir(c.ID)
	if err != nil {
		return err
	}
	if err := n.disk.CopyTree(ctx, memDir, cp); err != nil {
		return err
	}
	return n.disk.MarkComplete(cp)
}

func (n *Node) failClones(ctx context.Context, clones []*store.Sandbox, cause error) {
	for _, c := range clones {
		n.log.Error("clone failed", "sandbox", c.ID, "source", c.CloneOf, "err", cause)
		n.cleanupLocal(ctx, c.ID)
		c = n.report(ctx, c, store.Observed{State: api.StateFailed, ObservedGeneration: c.Generation, Error: "clone: " + cause.Error()})
		n.finishOps(ctx, c, cause)
	}
}

// createClone starts a clone from the memory image and disk its source prepared.
func (n *Node) createClone(ctx context.Context, sb *store.Sandbox) {
	if !sb.CloneReady {
		src, err := n.st.GetSandbox(ctx, sb.CloneOf)
		if err != nil || src.DeletedAt != nil || src.DesiredState == api.StateDeleted {
			n.failClones(ctx, []*store.Sandbox{sb}, fmt.Errorf("the source sandbox %s was deleted", sb.CloneOf))
			return
		}
		if src.NodeID == n.cfg.ID {
			n.kick(src.ID) // its worker prepares the snapshot
		}
		return
	}
	sb = n.report(ctx, sb, store.Observed{State: api.StateCreating, ObservedGeneration: sb.ObservedGeneration})
	err := func() error {
		snap, err := n.snapshotter()
		if err != nil {
			return err
		}
		cp, err := n.disk.CheckpointDir(sb.ID)
		if err != nil {
			return err
		}
		root, err := n.diskPath(sb.ID)
		if err != nil {
			return err
		}
		if err := n.restoreFrom(ctx, snap, sb, cp, root); err != nil {
			return err
		}
		return n.disk.RemoveAll(ctx, cp)
	}()
	if err != nil {
		if n.work.Err() != nil {
			return
		}
		n.failClones(ctx, []*store.Sandbox{sb}, err)
		return
	}
	sb = n.report(ctx, sb, store.Observed{State: api.StateRunning, ObservedGeneration: sb.Generation, StartPath: "snapshot"})
	n.finishOps(ctx, sb, nil)
	n.log.Info("clone running", "sandbox", sb.ID, "source", sb.CloneOf)
	n.measureLater(sb.ID)
}

// restoreFromCloneBatch restores a running sandbox whose instance vanished from a
// complete checkpoint left in one of its clone batches. It reports whether it did.
func (n *Node) restoreFromCloneBatch(ctx context.Context, sb *store.Sandbox) bool {
	snap, err := n.snapshotter()
	if err != nil {
		return false
	}
	dir, err := n.disk.SandboxDir(sb.ID)
	if err != nil {
		return false
	}
	batches, _ := filepath.Glob(filepath.Join(dir, "clones", "*", "checkpoint"))
	root, err := n.diskPath(sb.ID)
	if err != nil {
		return false
	}
	for _, cp := range batches {
		if !n.disk.IsComplete(cp) {
			continue
		}
		if err := n.restoreFrom(ctx, snap, sb, cp, root); err != nil {
			n.log.Warn("restore from clone checkpoint failed", "sandbox", sb.ID, "err", err)
			continue
		}
		n.log.Info("restored sandbox from its clone checkpoint after a crash", "sandbox", sb.ID)
		_ = n.disk.RemoveAll(ctx, filepath.Dir(cp))
		return true
	}
	return false
}
