package node

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/artifact"
	"github.com/spacedev/space/internal/crash"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/store"
)

// Named snapshots (docs/lifecycle.md, "Named snapshots"): a sandbox's memory and disk
// captured once and kept in the node's store under snapshots/<id>/{checkpoint,disk},
// outside the sandbox's volume, so the sandbox may be deleted and the snapshot stays.
//
// Taking one is a step of the source's worker (lifecycle.TakeSnapshots): the source is
// checkpointed and restored exactly as for its clones (checkpointSource), into a batch
// directory inside its own volume, so that a crash meanwhile is recovered by the
// source's plan (lifecycle.RestoreLeft) like any clone preparation. The snapshot's files
// are then copied (reflinks, O(1) per file) into a temporary directory, completed,
// renamed into snapshots/ with one rename, and only then is the row made ready — in the
// transaction that completes its operation. A crash anywhere before that leaves the row
// creating: the source's next plan takes it again. A row is never ready without its
// files, and files without a row are removed by reconcileSnapshots.
//
// A sandbox created from a snapshot (its spec names it) is made by the create step:
// its disk is an O(1) copy of the snapshot's and it restores from the snapshot's
// memory image with a fresh identity, as a clone does. While such a sandbox is pending
// or creating, the snapshot cannot be deleted (the service refuses with a conflict).

// snapshotBatch names the clone batch directory that a source's named snapshots are
// captured in (sandboxes/<id>/clones/<snapshotBatch>).
const snapshotBatch = "named-snapshot"

// snapshotMeta is snapshots/<id>/snapshot.json: what the files are, for operators and
// for moving snapshots between nodes later.
type snapshotMeta struct {
	ID             string            `json:"id"`
	Source         string            `json:"source_sandbox"`
	TemplateRef    string            `json:"template"`
	TemplateDigest string            `json:"template_digest,omitempty"`
	Runtime        string            `json:"runtime"`
	RuntimeVersion string            `json:"runtime_version"`
	Spec           store.SandboxSpec `json:"spec"`
	TakenAt        time.Time         `json:"taken_at"`
}

// takeSnapshots captures the source's memory and disk once for every named snapshot
// of it that waits, and publishes each. A failure fails those snapshots (their rows
// go, their operations say why); the source itself comes back as it was, or is left
// to its plan's recovery exactly as a clone source would be.
func (n *Node) takeSnapshots(ctx context.Context, src *store.Sandbox) {
	pending, err := n.st.SnapshotsPending(ctx, src.ID)
	if err != nil || len(pending) == 0 {
		return
	}
	start := time.Now()
	var todo []*store.Snapshot
	for _, sn := range pending {
		if sn.NodeID != n.cfg.ID {
			n.failSnapshots(ctx, []*store.Snapshot{sn}, errors.New("the snapshot was to be taken on another node"))
			continue
		}
		// Published before a crash: only its row is left to update.
		if dir, err := n.disk.SnapshotDir(sn.ID); err == nil && n.disk.IsComplete(filepath.Join(dir, "checkpoint")) {
			n.snapshotReady(ctx, sn, dir, 0)
			continue
		}
		todo = append(todo, sn)
	}
	if len(todo) == 0 {
		return
	}
	snap, err := n.snapshotter()
	if err != nil {
		n.failSnapshots(ctx, todo, err)
		return
	}
	// Each snapshot holds a memory image: it must fit above the reserve.
	if err := n.disk.CheckSpace(int64(len(todo)) * n.checkpointRoom(src)); err != nil {
		n.failSnapshots(ctx, todo, err)
		return
	}
	root, err := n.diskPath(src.ID)
	if err != nil {
		n.failSnapshots(ctx, todo, err)
		return
	}
	batch, err := n.disk.CloneBatchDir(src.ID, snapshotBatch)
	if err != nil {
		n.failSnapshots(ctx, todo, err)
		return
	}
	// Whatever an earlier, interrupted capture left is stale.
	if err := n.disk.RemoveAll(ctx, batch); err != nil {
		n.failSnapshots(ctx, todo, err)
		return
	}
	memDir, diskCopy := filepath.Join(batch, "checkpoint"), filepath.Join(batch, "disk")
	var memBytes int64
	if src.State == api.StateSuspended {
		cp, err := n.disk.CheckpointDir(src.ID)
		if err != nil || !n.disk.IsComplete(cp) {
			n.failSnapshots(ctx, todo, errors.New("the source's suspend snapshot is missing"))
			return
		}
		memDir, diskCopy = cp, root
		memBytes = dirBytes(cp)
	} else {
		restored, err := n.checkpointSource(ctx, snap, src, root, memDir, diskCopy)
		if err != nil {
			n.failSnapshots(ctx, todo, err)
			if restored {
				_ = n.disk.RemoveAll(context.WithoutCancel(ctx), batch)
			}
			return
		}
		defer func() { _ = n.disk.RemoveAll(context.WithoutCancel(ctx), batch) }()
	}
	crash.Point("snapshot.captured")
	// The disk's size is what the source wrote beyond its template (its volume's
	// exclusive use, less a suspend snapshot counted as memory already).
	diskBytes := max(src.DiskExclusiveBytes-memBytes, 0)
	published := make(map[*store.Snapshot]string, len(todo))
	for _, sn := range todo {
		dir, err := n.publishSnapshot(ctx, sn, src, memDir, diskCopy)
		if err != nil {
			if n.work.Err() != nil {
				return // shutting down: taken again at the next start
			}
			n.failSnapshots(ctx, []*store.Snapshot{sn}, err)
			continue
		}
		published[sn] = dir
	}
	// The capture is gone from the source before any snapshot is reported ready (from
	// a suspended source nothing was captured there: batch is already empty).
	_ = n.disk.RemoveAll(context.WithoutCancel(ctx), batch)
	for _, sn := range todo {
		if dir, ok := published[sn]; ok && n.snapshotReady(ctx, sn, dir, diskBytes) {
			n.pushNamedLater(sn.ID, src.TemplateDigest, dir)
		}
	}
	n.log.Info("named snapshots taken", "source", src.ID, "snapshots", len(todo), "took", time.Since(start).Round(time.Millisecond))
}

// publishSnapshot copies a captured memory image and disk into the snapshot's own
// directory: made complete in a temporary directory, then renamed into place.
func (n *Node) publishSnapshot(ctx context.Context, sn *store.Snapshot, src *store.Sandbox, memDir, disk string) (string, error) {
	final, err := n.disk.SnapshotDir(sn.ID)
	if err != nil {
		return "", err
	}
	tmp, err := n.disk.TempDir("snapshot")
	if err != nil {
		return "", err
	}
	defer func() { _ = n.disk.RemoveAll(context.WithoutCancel(ctx), tmp) }() // nothing left after the rename
	cp := filepath.Join(tmp, "checkpoint")
	if err := n.disk.CopyTree(ctx, memDir, cp); err != nil {
		return "", fmt.Errorf("copy the memory image: %w", err)
	}
	crash.Point("snapshot.memory")
	if err := n.disk.CopyDisk(ctx, disk, filepath.Join(tmp, "disk"), true); err != nil {
		return "", fmt.Errorf("copy the disk: %w", err)
	}
	meta, _ := json.MarshalIndent(snapshotMeta{ID: sn.ID, Source: src.ID, TemplateRef: src.TemplateRef,
		TemplateDigest: src.TemplateDigest, Runtime: n.info.Name, RuntimeVersion: n.info.Version, Spec: sn.Spec,
		TakenAt: time.Now().UTC()}, "", "  ")
	if err := os.WriteFile(filepath.Join(tmp, "snapshot.json"), meta, 0o600); err != nil {
		return "", err
	}
	if err := n.disk.MarkComplete(cp); err != nil {
		return "", err
	}
	if err := os.MkdirAll(filepath.Dir(final), 0o700); err != nil {
		return "", err
	}
	if err := os.Rename(tmp, final); err != nil {
		return "", fmt.Errorf("publish snapshot: %w", err)
	}
	crash.Point("snapshot.published")
	return final, nil
}

// snapshotReady makes a published snapshot ready (with its operation), or removes its
// files when it was deleted meanwhile. It reports whether the snapshot is ready.
func (n *Node) snapshotReady(ctx context.Context, sn *store.Snapshot, dir string, diskBytes int64) bool {
	size := dirBytes(filepath.Join(dir, "checkpoint")) + diskBytes
	ok, err := n.st.SnapshotReady(context.WithoutCancel(ctx), sn.ID, size)
	if err != nil {
		n.log.Warn("record snapshot ready; retried at the next reconcile", "snapshot", sn.ID, "err", err)
		return false
	}
	if !ok {
		// Deleted while it was taken: the snapshot loop removes it (kicked now).
		n.kickSnapshots()
		return false
	}
	n.log.Info("named snapshot ready", "snapshot", sn.ID, "name", sn.Name, "source", sn.SourceSandbox, "bytes", size)
	return true
}

// pushNamedLater pushes a ready named snapshot (its memory and disk) to the registry in
// the background and records its digest, so that a sandbox can be created from it on
// another node when this one is dead (startFromSnapshot). Without a registry it does
// nothing; a failed push is logged (the snapshot stays usable here).
func (n *Node) pushNamedLater(id, release, dir string) {
	if n.cfg.Artifacts == nil || release == "" {
		return
	}
	n.wg.Add(1)
	go func() {
		defer n.wg.Done()
		start := time.Now()
		cp := filepath.Join(dir, "checkpoint")
		a, err := n.cfg.Artifacts.PushSnapshot(n.work, artifact.SnapshotSource{ID: "named-" + id, Release: release,
			Disk: filepath.Join(dir, "disk"), Checkpoint: cp, Agent: n.checkpointAgent(n.work, cp)})
		if err == nil {
			_, err = n.st.RecordSnapshotArtifact(context.WithoutCancel(n.work), id, a.Digest)
		}
		if err != nil {
			if n.work.Err() == nil {
				n.log.Warn("push of named snapshot failed; it can be used on this node only", "snapshot", id, "err", err)
			}
			return
		}
		n.log.Info("named snapshot pushed", "snapshot", id, "digest", a.Digest, "uploaded", a.Uploaded,
			"took", time.Since(start).Round(time.Millisecond))
	}()
}

// failSnapshots removes what snapshots that cannot be taken left and fails them.
func (n *Node) failSnapshots(ctx context.Context, list []*store.Snapshot, cause error) {
	ctx = context.WithoutCancel(ctx)
	for _, sn := range list {
		n.log.Error("named snapshot failed", "snapshot", sn.ID, "source", sn.SourceSandbox, "err", cause)
		if err := n.removeSnapshotFiles(ctx, sn.ID); err != nil {
			n.log.Warn("remove snapshot files", "snapshot", sn.ID, "err", err)
			continue // the row stays creating: tried again later
		}
		if err := n.st.FailSnapshot(ctx, sn.ID, "snapshot of "+sn.SourceSandbox+": "+cause.Error()); err != nil {
			n.log.Warn("fail snapshot", "snapshot", sn.ID, "err", err)
		}
	}
}

func (n *Node) removeSnapshotFiles(ctx context.Context, id string) error {
	dir, err := n.disk.SnapshotDir(id)
	if err != nil {
		return err
	}
	return n.disk.RemoveAll(ctx, dir)
}

// kickSnapshots asks the snapshot loop to reconcile now.
func (n *Node) kickSnapshots() {
	select {
	case n.snapKick <- struct{}{}:
	default:
	}
}

// runSnapshots reconciles the node's named snapshots when kicked and every resync.
func (n *Node) runSnapshots(ctx context.Context) error {
	t := time.NewTicker(n.cfg.Resync)
	defer t.Stop()
	for {
		n.reconcileSnapshots(ctx)
		select {
		case <-ctx.Done():
			return nil
		case <-n.snapKick:
		case <-t.C:
		}
	}
}

// reconcileSnapshots removes the snapshots asked to be deleted (files, then row),
// fails those whose source can no longer be captured, wakes the sources of the others,
// and removes files that belong to no snapshot (left by a crash between the removal of
// files and of the row, or by a failed capture).
func (n *Node) reconcileSnapshots(ctx context.Context) {
	// Files first, rows second: files listed here had their row before they existed, so
	// files without a row now are leftovers, never a capture in progress.
	dirs, err := n.disk.ListSnapshotDirs()
	if err != nil {
		n.log.Warn("list snapshot files", "err", err)
		return
	}
	list, err := n.st.NodeSnapshots(ctx, n.cfg.ID)
	if err != nil {
		if ctx.Err() == nil {
			n.log.Warn("list snapshots", "err", err)
		}
		return
	}
	known := map[string]bool{}
	for _, sn := range list {
		known[sn.ID] = true
		switch sn.State {
		case api.SnapshotDeleting:
			if err := n.removeSnapshotFiles(ctx, sn.ID); err != nil {
				n.log.Warn("remove snapshot files", "snapshot", sn.ID, "err", err)
				continue
			}
			crash.Point("snapshot.removed")
			if err := n.st.DeleteSnapshotRow(ctx, sn.ID); err != nil {
				n.log.Warn("delete snapshot row", "snapshot", sn.ID, "err", err)
				continue
			}
			n.log.Info("named snapshot deleted", "snapshot", sn.ID, "name", sn.Name)
		case api.SnapshotCreating:
			n.checkPendingSnapshot(ctx, sn)
		case api.SnapshotReady:
			if dir, err := n.disk.SnapshotDir(sn.ID); err == nil && !n.disk.IsComplete(filepath.Join(dir, "checkpoint")) {
				n.log.Error("the files of a ready snapshot are missing; sandboxes cannot be created from it", "snapshot", sn.ID)
			}
		}
	}
	for _, id := range dirs {
		if !known[id] {
			n.log.Warn("removing the files of no snapshot", "snapshot", id)
			if err := n.removeSnapshotFiles(ctx, id); err != nil {
				n.log.Warn("remove snapshot files", "snapshot", id, "err", err)
			}
		}
	}
}

// checkPendingSnapshot fails a snapshot whose source can no longer be captured (it is
// deleted, failed or stopped, or on another node) and wakes the source's worker
// otherwise.
func (n *Node) checkPendingSnapshot(ctx context.Context, sn *store.Snapshot) {
	src, err := n.st.GetSandbox(ctx, sn.SourceSandbox)
	var why string
	switch {
	case fault.Is(err, fault.NotFound) || err == nil && src.DeletedAt != nil:
		why = "the source sandbox was deleted before its snapshot was taken"
	case err != nil:
		return
	case src.NodeID != n.cfg.ID:
		why = "the source sandbox is on another node"
	case noMemory(src):
		why = "the source sandbox is " + src.State + ", so it has no memory to capture"
	}
	if why != "" {
		n.failSnapshots(ctx, []*store.Snapshot{sn}, errors.New(why))
		return
	}
	n.kick(src.ID)
}

// noMemory reports whether src has settled stopped or failed: it has no memory for a
// pending snapshot or clone to capture (a later start boots it afresh).
func noMemory(src *store.Sandbox) bool {
	return src.ObservedGeneration >= src.Generation && src.Transition == "" &&
		(src.State == api.StateFailed || src.State == api.StateStopped)
}

// startFromSnapshot makes a new sandbox's disk from a named snapshot and restores it
// from the snapshot's memory image (with the sandbox's own fresh identity).
func (n *Node) startFromSnapshot(ctx context.Context, sb *store.Sandbox) (string, error) {
	sn, err := n.st.GetSnapshot(ctx, sb.Spec.Snapshot)
	if err != nil {
		return "", fmt.Errorf("snapshot %s: %w", sb.Spec.Snapshot, err)
	}
	if sn.State != api.SnapshotReady {
		return "", fmt.Errorf("snapshot %s is %s", sn.ID, sn.State)
	}
	snap, err := n.snapshotter()
	if err != nil {
		return "", err
	}
	var cp, disk string
	if sn.NodeID == n.cfg.ID {
		dir, err := n.disk.SnapshotDir(sn.ID)
		if err != nil {
			return "", err
		}
		cp, disk = filepath.Join(dir, "checkpoint"), filepath.Join(dir, "disk")
		if !n.disk.IsComplete(cp) {
			return "", fmt.Errorf("the files of snapshot %s are missing on node %s", sn.ID, n.cfg.Name)
		}
	} else {
		// Placed here because the snapshot's node is dead: from the registry.
		digest, err := n.st.SnapshotArtifact(ctx, sn.ID)
		if err != nil {
			return "", err
		}
		if digest == "" || n.cfg.Artifacts == nil {
			return "", fmt.Errorf("snapshot %s is on another node and not in this node's registry", sn.ID)
		}
		// The pulled copy must stay until the restore read it (evictPulled).
		n.pulledUse.RLock()
		defer n.pulledUse.RUnlock()
		pulled, err := n.cfg.Artifacts.PullSnapshot(ctx, "", digest)
		if err != nil {
			return "", fmt.Errorf("pull snapshot %s: %w", sn.ID, err)
		}
		if err := n.installPulledAgent(ctx, pulled); err != nil {
			return "", fmt.Errorf("snapshot %s: %w", sn.ID, err)
		}
		cp, disk = pulled.Checkpoint, pulled.Disk
	}
	if err := n.disk.CheckSpace(n.checkpointRoom(sb)); err != nil {
		return "", err
	}
	root, err := n.createDiskFrom(ctx, sb.ID, disk)
	if err != nil {
		return "", fmt.Errorf("copy the snapshot's disk: %w", err)
	}
	if err := n.limitDisk(ctx, sb); err != nil {
		return "", fmt.Errorf("limit disk: %w", err)
	}
	crash.Point("fromsnapshot.disk")
	if err := n.restoreFrom(ctx, snap, sb, cp, root); err != nil {
		return "", fmt.Errorf("restore from snapshot %s: %w", sn.ID, err)
	}
	return "snapshot", nil
}

// dirBytes is the disk space the regular files under dir take (their allocated
// blocks: a sparse memory image counts what it holds).
func dirBytes(dir string) int64 {
	var n int64
	_ = filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() {
			return nil
		}
		if fi, err := d.Info(); err == nil {
			if st, ok := fi.Sys().(*syscall.Stat_t); ok {
				n += st.Blocks * 512
			} else {
				n += fi.Size()
			}
		}
		return nil
	})
	return n
}
