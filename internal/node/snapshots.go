package node

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/crash"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/ids"
	"github.com/spacedev/space/internal/lifecycle"
	"github.com/spacedev/space/internal/runtime"
	"github.com/spacedev/space/internal/store"
	"golang.org/x/sync/errgroup"
)

// Base snapshots: a release's booted, idle sandbox saved once per runtime, runtime
// version and size class, so that new sandboxes restore instead of booting. They live
// in the node's store under templates/<hex>/snapshots/<key>/{disk,checkpoint}.

// baseKey names the base snapshot of a size class for this node's runtime.
func (n *Node) baseKey(spec store.SandboxSpec) string {
	return fmt.Sprintf("%s%dcpu-%dmb", n.baseKeyPrefix(), spec.CPU, spec.MemoryMB)
}

// baseKeyPrefix is what the keys of this node's base snapshots start with: its runtime,
// the runtime's version and its agent build. The agent binary is part of the snapshot's
// memory: a new agent gets new snapshots.
func (n *Node) baseKeyPrefix() string {
	v := strings.Map(func(r rune) rune {
		if r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '.' || r == '-' {
			return r
		}
		return '_'
	}, n.info.Version)
	return fmt.Sprintf("%s-%s-agent%s-", n.info.Name, v, n.agentHash[:8])
}

// baseSnapshots returns the directory holding a release's base snapshots
// (templates/<hex>/snapshots) and the keys of those in it (none when it is missing).
func (n *Node) baseSnapshots(digest string) (string, []string, error) {
	one, err := n.disk.BaseSnapshotDir(digest, "any")
	if err != nil {
		return "", nil, err
	}
	dir := filepath.Dir(one)
	ents, err := os.ReadDir(dir)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return "", nil, err
	}
	var keys []string
	for _, e := range ents {
		if e.IsDir() {
			keys = append(keys, e.Name())
		}
	}
	return dir, keys, nil
}

// pruneBaseSnapshots removes the base snapshots this node never restores again: those
// of another runtime, runtime version or agent build (baseKeyPrefix), which an upgrade
// leaves behind, one per release and size class, each a checkpoint of a booted sandbox
// and a read-only copy of its disk (on btrfs mostly shared with the release: the 17 a
// development node had gathered held 41 MiB of its store, 2026-12-07; a VM's memory
// image is larger). It runs from the node's
// hourly pass, the first an hour after the node started: a restore the previous process
// began from one may still be reading it. Each goes out of the way with one rename
// (RemoveLater); a release being removed meanwhile takes its snapshots with it.
func (n *Node) pruneBaseSnapshots(ctx context.Context) {
	rels, err := n.disk.ListReleases()
	if err != nil {
		n.log.WarnContext(ctx, "list releases", "err", err)
		return
	}
	n.releaseUse.RLock()
	defer n.releaseUse.RUnlock()
	prefix := n.baseKeyPrefix()
	for _, r := range rels {
		dir, keys, err := n.baseSnapshots(r.Digest)
		if err != nil {
			continue
		}
		for _, key := range keys {
			if ctx.Err() != nil {
				return
			}
			if strings.HasPrefix(key, prefix) {
				continue
			}
			if err := n.disk.RemoveLater(ctx, filepath.Join(dir, key)); err != nil {
				n.log.WarnContext(ctx, "remove a base snapshot of another build", "dir", filepath.Join(dir, key), "err", err)
				continue
			}
			n.log.InfoContext(ctx, "removed a base snapshot of another space build or runtime version", "digest", r.Digest, "key", key)
		}
	}
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
	// Made without a network, whatever the sandbox that asked for it has: gVisor
	// reconfigures its netstack from the namespace a restore runs in.
	spec.Network = nil
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
	crash.Point("basesnap.checkpointed")
	_ = n.rt.Destroy(ctx, sb.ID)
	// A base snapshot outlives this boot of the host: durable before it is published.
	if err := n.disk.MarkComplete(filepath.Join(tmp, "checkpoint")); err != nil {
		return err
	}
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
	crash.Point("basesnap.published")
	n.log.Info("base snapshot ready", "digest", digest, "key", n.baseKey(spec), "took", time.Since(start).Round(time.Millisecond))
	return nil
}

// prepareClones snapshots a source once for its pending clones and gives each clone
// its own copy-on-write disk and memory image. A running source keeps running (it is
// checkpointed and restored, a pause of well under a second); while it is, it records
// the clone-source transition, so that a crash meanwhile brings it back from that very
// checkpoint (lifecycle.RestoreLeft) rather than losing its memory.
func (n *Node) prepareClones(ctx context.Context, src *store.Sandbox) {
	pending, err := n.st.ClonesPending(ctx, src.ID)
	if err != nil || len(pending) == 0 {
		return
	}
	snap, err := n.snapshotter()
	if err != nil {
		n.failClones(ctx, pending, err)
		return
	}
	start := time.Now()
	batch, err := n.disk.CloneBatchDir(src.ID, pending[0].CloneBatch)
	if err != nil {
		n.failClones(ctx, pending, err)
		return
	}
	root, err := n.diskPath(src.ID)
	if err != nil {
		n.failClones(ctx, pending, err)
		return
	}
	// Whatever an earlier, interrupted preparation left is stale.
	if err := n.disk.RemoveAll(ctx, batch); err != nil {
		n.failClones(ctx, pending, err)
		return
	}
	memDir := filepath.Join(batch, "checkpoint")
	diskCopy := filepath.Join(batch, "disk")
	if src.State == api.StateSuspended {
		cp, err := n.disk.CheckpointDir(src.ID)
		if err != nil || !n.disk.IsComplete(cp) {
			n.failClones(ctx, pending, fmt.Errorf("the source's snapshot is missing"))
			return
		}
		memDir, diskCopy = cp, root
	} else {
		// The source's memory image comes first: with no room for it, the clones fail
		// at once, saying so, and the source is not touched (a full store made the
		// checkpoint fail half-way, with the file system's error).
		if err := n.disk.CheckSpace(n.checkpointRoom(src)); err != nil {
			n.failClones(ctx, pending, err)
			return
		}
		restored, err := n.checkpointSource(ctx, snap, src, root, memDir, diskCopy)
		if errors.Is(err, errNotRecorded) {
			// Nothing was done: the clones wait for the next pass.
			n.log.Warn("clone preparation waits for the database", "source", src.ID, "err", err)
			return
		}
		if err != nil {
			n.failClones(ctx, pending, err)
			if !restored {
				return
			}
		}
		if err != nil {
			_ = n.disk.RemoveAll(context.WithoutCancel(ctx), batch)
			return
		}
	}
	defer func() {
		if src.State != api.StateSuspended {
			_ = n.disk.RemoveAll(context.WithoutCancel(ctx), batch)
		}
	}()
	// The clones are prepared a few at a time: each is a disk snapshot, a reflinked
	// memory image and a row, mostly waiting on the store (10–25 ms each here), and each
	// starts as soon as it is ready.
	var g errgroup.Group
	g.SetLimit(clonePrepareWorkers)
	for _, c := range pending {
		g.Go(func() error {
			if err := n.prepareClone(ctx, c, memDir, diskCopy); err != nil {
				n.failClones(ctx, []*store.Sandbox{c}, err)
				return nil
			}
			crash.Point("clone.prepared")
			if err := n.st.SetCloneReady(ctx, c.ID); err != nil {
				n.log.Warn("mark clone ready", "sandbox", c.ID, "err", err)
			}
			return nil
		})
	}
	_ = g.Wait()
	n.log.Info("clone snapshot prepared", "source", src.ID, "clones", len(pending), "took", time.Since(start).Round(time.Millisecond))
}

// clonePrepareWorkers bounds how many clones of a batch are prepared at once.
const clonePrepareWorkers = 4

// checkpointSource checkpoints a running (or paused) clone source into memDir, copies
// its disk to diskCopy and brings it back as it was. It reports whether the source is
// back (restored is false only when it is left to recovery: a failed restore keeps the
// checkpoint complete, so the source's next plan restores it from there).
func (n *Node) checkpointSource(ctx context.Context, snap runtime.Snapshotter, src *store.Sandbox, root, memDir, diskCopy string) (restored bool, err error) {
	wasPaused := src.State == api.StatePaused
	// The data plane's requests meanwhile wait for the source to be back (gate.go).
	defer n.pauseBriefly(ctx, src.ID)()
	crash.Point("clone.source.begin")
	if _, err := n.record(ctx, src, store.Observed{State: src.State, ObservedGeneration: src.ObservedGeneration, Error: src.Error, Transition: lifecycle.TCloneSource}); err != nil {
		return true, err
	}
	crash.Point("clone.source.recorded")
	back := func() {
		n.report(ctx, src, store.Observed{State: src.State, ObservedGeneration: src.ObservedGeneration, Error: src.Error})
	}
	if wasPaused {
		if err := snap.Resume(ctx, src.ID); err != nil {
			back()
			return true, err
		}
	}
	if live, ok := snap.(runtime.LiveCheckpointer); ok {
		return n.checkpointSourceLive(ctx, snap, live, src, root, memDir, diskCopy, back)
	}
	if err := n.checkpoint(ctx, snap, src.ID, memDir); err != nil {
		return n.sourceCheckpointFailed(ctx, src, memDir, wasPaused, err)
	}
	// The source is stopped now: its disk matches the checkpoint.
	crash.Point("clone.source.checkpointed")
	derr := n.disk.CopyDisk(ctx, root, diskCopy, true)
	crash.Point("clone.source.disk-copied")
	var rerr error
	for range 3 {
		if rerr = n.restoreFrom(ctx, snap, src, memDir, root); rerr == nil || n.work.Err() != nil {
			break
		}
		n.log.Warn("restoring a clone source failed; trying again", "sandbox", src.ID, "err", rerr)
	}
	if rerr != nil {
		// The checkpoint stays complete and the transition recorded: the source's next
		// plan restores it from there (or, if that keeps failing, boots its disk).
		return false, fmt.Errorf("restore the source after its snapshot: %w", rerr)
	}
	crash.Point("clone.source.restored")
	// The checkpoint is older than the source from now on: never restore it again.
	if err := n.disk.Unmark(memDir); err != nil {
		n.log.Warn("retire clone checkpoint", "sandbox", src.ID, "err", err)
	}
	if wasPaused {
		_ = n.pauseInstance(ctx, src.ID)
	}
	back()
	crash.Point("clone.source.back")
	return true, derr
}

// sourceCheckpointFailed settles a clone source whose checkpoint failed with cause:
// what afterFailedCheckpoint finds it to be (paused again if it was), reported.
func (n *Node) sourceCheckpointFailed(ctx context.Context, src *store.Sandbox, memDir string, wasPaused bool, cause error) (bool, error) {
	out, cerr := n.afterFailedCheckpoint(ctx, src, memDir, cause)
	if out.state == api.StateRunning && wasPaused {
		_ = n.pauseInstance(ctx, src.ID)
		out.state = api.StatePaused
	}
	n.report(ctx, src, store.Observed{State: out.state, ObservedGeneration: src.ObservedGeneration, Error: joinNonEmpty(lossError(out.note), src.Error)})
	return true, cerr
}

// checkpointSourceLive is checkpointSource on a runtime that checkpoints without
// stopping: the source is quiesced and paused, checkpointed, its disk copied while it
// is still paused (so the copy matches the memory image), and resumed: it never stops,
// so it needs no restore. The source's instance is running when called (a paused
// source was resumed for its agent's quiesce; it is paused again at the end).
func (n *Node) checkpointSourceLive(ctx context.Context, snap runtime.Snapshotter, live runtime.LiveCheckpointer, src *store.Sandbox, root, memDir, diskCopy string, back func()) (restored bool, err error) {
	wasPaused := src.State == api.StatePaused
	failed := func(cause error) (bool, error) {
		_ = snap.Resume(ctx, src.ID) // paused by us, or not: afterFailedCheckpoint looks
		return n.sourceCheckpointFailed(ctx, src, memDir, wasPaused, cause)
	}
	if err := os.MkdirAll(memDir, 0o700); err != nil {
		return failed(err)
	}
	if err := n.quiesce(ctx, src.ID); err != nil {
		return failed(err)
	}
	crash.Point("checkpoint.quiesced")
	if err := snap.Pause(ctx, src.ID); err != nil {
		return failed(fmt.Errorf("pause: %w", err))
	}
	crash.Point("clone.source.paused")
	if err := live.CheckpointPaused(ctx, src.ID, memDir); err != nil {
		return failed(fmt.Errorf("checkpoint: %w", err))
	}
	// Complete while it matches the paused source: if the instance vanished now, the
	// next plan would restore the source from it (lifecycle.RestoreLeft).
	if err := n.disk.MarkWritten(memDir); err != nil {
		return failed(err)
	}
	crash.Point("clone.source.checkpointed")
	derr := n.disk.CopyDisk(ctx, root, diskCopy, true)
	crash.Point("clone.source.disk-copied")
	// From the resume on, the checkpoint is older than the source: never restore it.
	if err := n.disk.Unmark(memDir); err != nil {
		return failed(fmt.Errorf("retire clone checkpoint: %w", err))
	}
	if err := snap.Resume(ctx, src.ID); err != nil {
		// The source is still what the checkpoint holds: leave it to recovery, which
		// restores it from there.
		rerr := fmt.Errorf("resume the source after its snapshot: %w", err)
		if merr := n.disk.MarkWritten(memDir); merr != nil {
			return failed(errors.Join(rerr, merr))
		}
		n.dropAgent(src.ID)
		_ = n.rt.Destroy(ctx, src.ID)
		return false, rerr
	}
	crash.Point("clone.source.resumed")
	if err := n.resumeAgent(ctx, src); err != nil {
		return failed(fmt.Errorf("resume the source's agent: %w", err))
	}
	n.serving(src)
	if wasPaused {
		_ = n.pauseInstance(ctx, src.ID)
	}
	back()
	crash.Point("clone.source.back")
	return true, derr
}

// prepareClone gives one clone its disk and memory image (both O(1) copies).
func (n *Node) prepareClone(ctx context.Context, c *store.Sandbox, memDir, disk string) error {
	if err := n.disk.CheckSpace(n.checkpointRoom(c)); err != nil {
		return err
	}
	// A preparation of this clone that ended before the clone was marked ready (the
	// node died, or the database was away for the mark) left a disk and memory image
	// of an older snapshot of the source: they go, and the clone is made from this one.
	// (Until 2026-12-07 the disk's copy then failed, "file exists", and so did the clone.)
	if dir, err := n.disk.SandboxDir(c.ID); err == nil {
		if _, err := os.Lstat(dir); err == nil {
			n.log.InfoContext(ctx, "a clone's earlier preparation was cut off; it is made again", "sandbox", c.ID)
			if err := n.disk.DeleteSandbox(ctx, c.ID); err != nil {
				return err
			}
		}
	}
	if _, err := n.createDiskFrom(ctx, c.ID, disk); err != nil {
		return err
	}
	if err := n.limitDisk(ctx, c); err != nil {
		return err
	}
	cp, err := n.disk.CheckpointDir(c.ID)
	if err != nil {
		return err
	}
	if err := n.disk.CopyTree(ctx, memDir, cp); err != nil {
		return err
	}
	// The clone starts from it at once: complete on this boot is enough (a clone that
	// has not started when the host reboots fails: startClone).
	return n.disk.MarkWritten(cp)
}

func (n *Node) failClones(ctx context.Context, clones []*store.Sandbox, cause error) {
	for _, c := range clones {
		n.log.Error("clone failed", "sandbox", c.ID, "source", c.CloneOf, "err", cause)
		n.cleanupLocal(ctx, c.ID)
		c = n.report(ctx, c, store.Observed{State: api.StateFailed, ObservedGeneration: c.Generation, Error: "clone: " + cause.Error()})
		n.finishOps(ctx, c, cause, "")
	}
}

// waitClone handles a clone whose source has not prepared its snapshot yet: the
// source's worker is woken, or the clone fails when its source is gone or has settled
// stopped or failed (no memory to clone).
func (n *Node) waitClone(ctx context.Context, sb *store.Sandbox) {
	src, err := n.st.GetSandbox(ctx, sb.CloneOf)
	var why error
	switch {
	case fault.Is(err, fault.NotFound) || err == nil && (src.DeletedAt != nil || src.DesiredState == api.StateDeleted):
		why = fmt.Errorf("the source sandbox %s was deleted", sb.CloneOf)
	case err != nil:
		return
	case noMemory(src):
		// It lost its memory after the clone was asked for (its instance vanished): a
		// clone of it would never be prepared.
		why = fmt.Errorf("the source sandbox %s is %s, so it has no memory to clone", sb.CloneOf, src.State)
	}
	if why != nil {
		n.failClones(ctx, []*store.Sandbox{sb}, why)
		return
	}
	if src.NodeID == n.cfg.ID {
		n.kick(src.ID) // its worker prepares the snapshot
	}
}

// startClone starts a clone from the memory image and disk its source prepared.
func (n *Node) startClone(ctx context.Context, sb *store.Sandbox) error {
	crash.Point("clone.start.begin")
	sb, err := n.record(ctx, sb, store.Observed{State: api.StateCreating, ObservedGeneration: sb.ObservedGeneration, Transition: lifecycle.TClone})
	if err != nil {
		return err
	}
	crash.Point("clone.start.recorded")
	err = func() error {
		snap, err := n.snapshotter()
		if err != nil {
			return err
		}
		cp, err := n.disk.CheckpointDir(sb.ID)
		if err != nil {
			return err
		}
		if !n.disk.IsComplete(cp) {
			return errors.New("its memory image is not complete (written before the host rebooted)")
		}
		root, err := n.diskPath(sb.ID)
		if err != nil {
			return err
		}
		if err := n.restoreFrom(ctx, snap, sb, cp, root); err != nil {
			return err
		}
		if sb.DesiredState == api.StatePaused {
			if err := n.park(ctx, sb); err != nil {
				return err
			}
		}
		return n.disk.RemoveAll(ctx, cp)
	}()
	if err != nil {
		if n.work.Err() != nil {
			return err
		}
		n.failClones(ctx, []*store.Sandbox{sb}, err)
		return err
	}
	state := api.StateRunning
	if sb.DesiredState == api.StatePaused {
		state = api.StatePaused
	}
	crash.Point("clone.start.acted")
	sb = n.report(ctx, sb, store.Observed{State: state, ObservedGeneration: sb.Generation, StartPath: "snapshot"})
	n.finishOps(ctx, sb, nil, "")
	n.log.Info("clone running", "sandbox", sb.ID, "source", sb.CloneOf)
	n.measureLater(sb.ID)
	return nil
}
