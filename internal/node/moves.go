package node

import (
	"context"
	"encoding/json"
	"fmt"
	"path/filepath"
	"sync"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/artifact"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/ids"
	"github.com/spacedev/space/internal/runtime"
	"github.com/spacedev/space/internal/store"
)

// Snapshots in the fleet's registry (Config.Artifacts) and sandboxes moving between
// nodes (docs/operations.md, "When a node dies" and "Drain").
//
// A node with a registry pushes every suspend snapshot (disk increment + checkpoint)
// in the background once the suspend is reported — a suspend takes no longer than
// without a registry — and records its digest on the sandbox (store.RecordSnapshotPush)
// while the sandbox is still suspended at that generation. A wake on the same node
// cancels a push in flight (its snapshot is stale the moment the sandbox runs again);
// a push that fails is tried again by later reconciles (pushRetry apart). A sandbox
// moving off this node (a drain) has its snapshot pushed the same way; the controller
// re-homes it once the digest is recorded, or, when the push fails, the node wakes it
// here again (store.AbortMove) and the drain reports it.
//
// A sandbox re-homed onto this node (its old node died, or was drained) arrives
// suspended with its snapshot's digest and nothing on this host: fetchMoved pulls the
// snapshot and makes the sandbox's disk and checkpoint from it (O(1) copies of the
// pulled artifact), then the planner restores it as any suspended sandbox. A pull that
// fails (registry unreachable, out of disk) sends the sandbox back where it was.

// pushRetry is how long a failed push waits before a reconcile tries again.
const pushRetry = 30 * time.Second

// pushJobs tracks the snapshot pushes in flight, one per sandbox.
type pushJobs struct {
	mu     sync.Mutex
	jobs   map[string]*pushJob
	failed map[string]time.Time // last failure, to space out retries
}

type pushJob struct {
	gen    int64
	cancel context.CancelFunc
	done   chan struct{}
}

// begin registers a new job of key, cancelled with parent or by its cancel; p.mu is
// held.
func (p *pushJobs) begin(parent context.Context, key string) (context.Context, context.CancelFunc, *pushJob) {
	if p.jobs == nil {
		p.jobs, p.failed = map[string]*pushJob{}, map[string]time.Time{}
	}
	ctx, cancel := context.WithCancel(parent)
	j := &pushJob{cancel: cancel, done: make(chan struct{})}
	p.jobs[key] = j
	return ctx, cancel, j
}

// finish ends job j of key: it is no longer in flight, and a failure (not a
// cancellation) is remembered to space out retries.
func (p *pushJobs) finish(key string, j *pushJob, failed bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.jobs[key] == j {
		delete(p.jobs, key)
	}
	if failed {
		p.failed[key] = time.Now()
	} else {
		delete(p.failed, key)
	}
}

// snapshotTag is the registry tag of a sandbox's suspend snapshot at a generation.
func snapshotTag(id string, gen int64) string { return fmt.Sprintf("%s-g%d", id, gen) }

// pushMeta is what a pushed snapshot records about where it came from.
type pushMeta struct {
	Sandbox        string `json:"sandbox"`
	Node           string `json:"node"`
	Runtime        string `json:"runtime"`
	RuntimeVersion string `json:"runtime_version"`
	Agent          string `json:"agent"`
}

// pushLater pushes the suspend snapshot of sandbox id in the background, unless a push
// is in flight or failed less than pushRetry ago (force: a move waits for it, try now).
func (n *Node) pushLater(id string, force bool) {
	if n.cfg.Artifacts == nil {
		return
	}
	p := &n.pushes
	p.mu.Lock()
	if _, ok := p.jobs[id]; ok {
		p.mu.Unlock()
		return
	}
	if t, ok := p.failed[id]; ok && !force && time.Since(t) < pushRetry {
		p.mu.Unlock()
		return
	}
	ctx, cancel, j := p.begin(n.work, id)
	p.mu.Unlock()
	n.wg.Add(1)
	go func() {
		defer n.wg.Done()
		defer close(j.done)
		defer cancel()
		moving, err := n.pushSnapshot(ctx, id)
		p.finish(id, j, err != nil && ctx.Err() == nil)
		if err != nil && ctx.Err() == nil {
			n.log.Warn("push of suspend snapshot failed", "sandbox", id, "err", err)
			if moving {
				n.abortMove(ctx, id, fmt.Sprintf("could not move off node %s: push its snapshot: %v; it runs here again", n.cfg.Name, err))
			}
		}
	}()
}

// stopPush cancels a push in flight for a sandbox and waits for it to end (its files
// are about to change or go).
func (n *Node) stopPush(id string) {
	p := &n.pushes
	p.mu.Lock()
	j, ok := p.jobs[id]
	if ok {
		delete(p.jobs, id)
	}
	delete(p.failed, id)
	p.mu.Unlock()
	if ok {
		j.cancel()
		<-j.done
	}
}

// pushSnapshot pushes sandbox id's suspend snapshot and records its digest. It
// reports whether the sandbox is moving off this node (its move waits for the push).
func (n *Node) pushSnapshot(ctx context.Context, id string) (bool, error) {
	start := time.Now()
	sb, err := n.st.GetSandbox(ctx, id)
	if err != nil {
		return false, err
	}
	moving := sb.MoveFrom == n.cfg.ID
	if sb.NodeID != n.cfg.ID || sb.State != api.StateSuspended || sb.SnapshotDigest != "" || sb.TemplateDigest == "" {
		return false, nil
	}
	gen := sb.ObservedGeneration
	disk, err := n.diskPath(id)
	if err != nil {
		return moving, err
	}
	cp, err := n.disk.CheckpointDir(id)
	if err != nil {
		return moving, err
	}
	meta, err := json.Marshal(pushMeta{Sandbox: id, Node: n.cfg.Name, Runtime: n.info.Name,
		RuntimeVersion: n.info.Version, Agent: n.agentHash})
	if err != nil {
		return moving, err
	}
	a, err := n.cfg.Artifacts.PushSnapshot(ctx, artifact.SnapshotSource{ID: snapshotTag(id, gen),
		Release: sb.TemplateDigest, Disk: disk, Checkpoint: cp, Agent: n.checkpointAgent(ctx, cp), Meta: meta})
	if err != nil {
		return moving, err
	}
	ok, err := n.st.RecordSnapshotPush(context.WithoutCancel(ctx), id, n.cfg.ID, gen, a.Digest)
	if err != nil {
		return moving, err
	}
	n.log.Info("suspend snapshot pushed", "sandbox", id, "digest", a.Digest, "recorded", ok,
		"uploaded", a.Uploaded, "took", time.Since(start).Round(time.Millisecond))
	return moving, nil
}

// pushIfMissing starts the push of a suspended sandbox's snapshot when none is
// recorded (a push that failed, or one cut off by a restart).
func (n *Node) pushIfMissing(sb *store.Sandbox) {
	if n.cfg.Artifacts == nil || sb.State != api.StateSuspended || sb.SnapshotDigest != "" ||
		sb.ObservedGeneration < sb.Generation || sb.DesiredState != api.StateSuspended {
		return
	}
	cp, err := n.disk.CheckpointDir(sb.ID)
	if err != nil || !n.disk.IsComplete(cp) || !n.hasDisk(sb.ID) {
		return
	}
	n.pushLater(sb.ID, false)
}

// needsFetch reports whether sb was re-homed onto this node and its snapshot is not
// here yet.
func (n *Node) needsFetch(sb *store.Sandbox) bool {
	if sb.State != api.StateSuspended || sb.MoveFrom == "" || sb.SnapshotDigest == "" ||
		sb.DesiredState == api.StateDeleted {
		return false
	}
	cp, err := n.disk.CheckpointDir(sb.ID)
	return err != nil || !n.disk.IsComplete(cp) || !n.hasDisk(sb.ID)
}

// fetchMoved pulls the snapshot of a sandbox re-homed onto this node and makes its
// disk and checkpoint from it. On failure the sandbox goes back where it was
// (store.AbortMove) with the reason; it reports whether the sandbox is ready here.
func (n *Node) fetchMoved(ctx context.Context, sb *store.Sandbox) bool {
	start := time.Now()
	n.progress(ctx, sb, "pulling its snapshot from the registry onto node "+n.cfg.Name)
	err := n.materialize(ctx, sb)
	if err != nil {
		if n.work.Err() != nil {
			return false
		}
		_ = n.cleanupLocal(context.WithoutCancel(ctx), sb.ID)
		n.abortMove(ctx, sb.ID, fmt.Sprintf("could not wake on node %s: %v; it stays suspended where it was", n.cfg.Name, err))
		return false
	}
	n.log.Info("moved sandbox's snapshot pulled", "sandbox", sb.ID, "digest", sb.SnapshotDigest,
		"took", time.Since(start).Round(time.Millisecond))
	n.marks.mark(sb.ID, "pulled")
	return true
}

func (n *Node) materialize(ctx context.Context, sb *store.Sandbox) error {
	if n.cfg.Artifacts == nil {
		return fault.New(fault.Unavailable, "node %s has no registry (space serve --registry) to pull the snapshot from", n.cfg.Name)
	}
	if err := n.materializeFrom(ctx, sb); err != nil {
		return err
	}
	// The sandbox has its own disk and checkpoint now; the pulled copy served only it.
	n.dropPulled(ctx, sb.SnapshotDigest)
	return nil
}

func (n *Node) materializeFrom(ctx context.Context, sb *store.Sandbox) error {
	n.pulledUse.RLock()
	defer n.pulledUse.RUnlock()
	if err := n.cleanupLocal(ctx, sb.ID); err != nil {
		return err
	}
	if err := n.disk.CheckSpace(n.checkpointRoom(sb)); err != nil {
		return err
	}
	snap, err := n.cfg.Artifacts.PullSnapshot(ctx, "", sb.SnapshotDigest)
	if err != nil {
		return fmt.Errorf("pull its snapshot: %w", err)
	}
	var meta pushMeta
	if json.Unmarshal(snap.Meta, &meta) == nil && meta.Runtime != "" && meta.Runtime != n.info.Name {
		return fault.New(fault.Conflict, "its snapshot was taken by runtime %s; this node runs %s", meta.Runtime, n.info.Name)
	}
	if err := n.installPulledAgent(ctx, snap); err != nil {
		return err
	}
	if _, err := n.createDiskFrom(ctx, sb.ID, snap.Disk); err != nil {
		return fmt.Errorf("disk from its snapshot: %w", err)
	}
	if err := n.limitDisk(ctx, sb); err != nil {
		return err
	}
	cp, err := n.disk.CheckpointDir(sb.ID)
	if err != nil {
		return err
	}
	if err := n.disk.CopyTree(ctx, snap.Checkpoint, cp); err != nil {
		return fmt.Errorf("checkpoint from its snapshot: %w", err)
	}
	return n.disk.MarkComplete(cp)
}

// abortMove sends a sandbox whose move cannot go on back where it was.
func (n *Node) abortMove(ctx context.Context, id, why string) {
	ctx = context.WithoutCancel(ctx)
	n.log.Warn("sandbox move aborted", "sandbox", id, "why", why)
	if _, err := n.st.AbortMove(ctx, id, why, ids.Operation()); err != nil {
		n.log.Warn("abort move", "sandbox", id, "err", err)
	}
}

// finishMove records, once a moved sandbox runs here, that its move is over, its
// downtime and (in its status reason) the move (store.FinishMove); it returns that
// note ("" when the sandbox was not moving).
func (n *Node) finishMove(ctx context.Context, sb *store.Sandbox) string {
	if sb.MoveFrom == "" {
		return ""
	}
	ms, note, err := n.st.FinishMove(context.WithoutCancel(ctx), sb.ID, n.cfg.ID)
	if err != nil {
		n.log.Warn("record move", "sandbox", sb.ID, "err", err)
		return ""
	}
	if ms >= 0 {
		n.log.Info("sandbox moved here", "sandbox", sb.ID, "from", sb.MoveFrom, "downtime_ms", ms)
	}
	return note
}

// noteMove appends a move's note to the message of the operation that woke the
// sandbox (once it is finished).
func (n *Node) noteMove(ctx context.Context, sb *store.Sandbox, note string) {
	if err := n.st.NoteWakeOperation(context.WithoutCancel(ctx), sb.ID, note); err != nil {
		n.log.Warn("note move on operation", "sandbox", sb.ID, "err", err)
	}
}

// prepareMove makes sure, while a sandbox moving off this node still runs, that the
// release its snapshot's disk is an increment on is in the registry: the snapshot push
// after the checkpoint then uploads only what the sandbox changed, and the move's
// downtime does not include a release upload. A failure is left to the push.
func (n *Node) prepareMove(ctx context.Context, sb *store.Sandbox) {
	if n.cfg.Artifacts == nil || sb.TemplateDigest == "" || n.info.Disk == runtime.DiskExt4 || !n.disk.HasRelease(sb.TemplateDigest) {
		return
	}
	start := time.Now()
	if _, err := n.cfg.Artifacts.PushRelease(ctx, sb.TemplateDigest); err != nil {
		n.log.Warn("push the release of a moving sandbox", "sandbox", sb.ID, "release", sb.TemplateDigest, "err", err)
		return
	}
	n.log.Info("release of a moving sandbox is in the registry", "sandbox", sb.ID, "release", sb.TemplateDigest,
		"took", time.Since(start).Round(time.Millisecond))
}

// Periodic checkpoints (a sandbox's checkpoint_interval): the sandbox's worker, when
// it finds the sandbox running and its last checkpoint older than the interval,
// checkpoints it as for its clones (checkpointSource: a pause of about a second; a
// crash meanwhile is recovered like an interrupted clone preparation), keeps a copy of
// the checkpoint and disk, and pushes them in the background; the digest and the
// checkpoint's time are recorded on the sandbox (store.RecordCheckpointPush). If the
// node dies, the controller restores the sandbox elsewhere from it
// (store.Tx.restoreFromCheckpoints).

// checkpointDue reports whether a running sandbox's periodic checkpoint is due.
func (n *Node) checkpointDue(sb *store.Sandbox) bool {
	if n.cfg.Artifacts == nil || sb.Spec.CheckpointInterval <= 0 || sb.State != api.StateRunning ||
		sb.DesiredState != api.StateRunning || sb.ObservedGeneration < sb.Generation || sb.TemplateDigest == "" {
		return false
	}
	every := time.Duration(sb.Spec.CheckpointInterval) * time.Second
	p := &n.pushes
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, busy := p.jobs[periodicKey(sb.ID)]; busy {
		return false
	}
	if t, ok := p.failed[periodicKey(sb.ID)]; ok && time.Since(t) < every {
		return false
	}
	// The first one comes an interval after the sandbox started running.
	last := sb.CheckpointAt
	if last == nil {
		last = sb.StatusChangedAt
	}
	// A sandbox that moved here (restored from its last checkpoint, or live from a
	// snapshot pushed on its way) is as recent as that: its next one is an interval on.
	if sb.MovedAt != nil && (last == nil || sb.MovedAt.After(*last)) {
		last = sb.MovedAt
	}
	if last == nil {
		return true
	}
	if time.Since(*last) < every {
		n.kickAt(sb.ID, every-time.Since(*last))
		return false
	}
	return true
}

// kickAt kicks a sandbox's worker after d (once per sandbox at a time).
func (n *Node) kickAt(id string, d time.Duration) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.brief == nil {
		n.brief = map[string]bool{}
	}
	key := "kick/" + id
	if n.brief[key] {
		return
	}
	n.brief[key] = true
	time.AfterFunc(d+100*time.Millisecond, func() {
		n.mu.Lock()
		delete(n.brief, key)
		n.mu.Unlock()
		n.kick(id)
	})
}

// setBrief marks a sandbox as paused for a moment by the node (Agent waits for it).
func (n *Node) setBrief(id string, on bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.brief == nil {
		n.brief = map[string]bool{}
	}
	if on {
		n.brief[id] = true
	} else {
		delete(n.brief, id)
	}
}

func periodicKey(id string) string { return "cp/" + id }

// periodicCheckpoint checkpoints a running sandbox and pushes the checkpoint in the
// background.
func (n *Node) periodicCheckpoint(ctx context.Context, sb *store.Sandbox) {
	every := time.Duration(sb.Spec.CheckpointInterval) * time.Second
	defer n.kickAt(sb.ID, every)
	key := periodicKey(sb.ID)
	fail := func(err error) {
		n.log.Warn("periodic checkpoint failed", "sandbox", sb.ID, "err", err)
		n.pushes.mu.Lock()
		if n.pushes.failed == nil {
			n.pushes.jobs, n.pushes.failed = map[string]*pushJob{}, map[string]time.Time{}
		}
		n.pushes.failed[key] = time.Now()
		n.pushes.mu.Unlock()
	}
	snap, err := n.snapshotter()
	if err != nil {
		fail(err)
		return
	}
	root, err := n.diskPath(sb.ID)
	if err != nil {
		fail(err)
		return
	}
	batch, err := n.disk.CloneBatchDir(sb.ID, "periodic")
	if err != nil {
		fail(err)
		return
	}
	if err := n.disk.RemoveAll(ctx, batch); err != nil {
		fail(err)
		return
	}
	memDir, diskCopy := filepath.Join(batch, "checkpoint"), filepath.Join(batch, "disk")
	at := time.Now()
	_, err = n.checkpointSource(ctx, snap, sb, root, memDir, diskCopy)
	if err != nil {
		_ = n.disk.RemoveAll(context.WithoutCancel(ctx), batch)
		fail(err)
		return
	}
	// checkpointSource retired memDir (it must never restore the sandbox here again):
	// the copy that travels is complete on its own.
	tmp, err := n.disk.TempDir("periodic")
	if err == nil {
		err = n.disk.CopyTree(ctx, memDir, filepath.Join(tmp, "checkpoint"))
		if err == nil {
			err = n.disk.MarkComplete(filepath.Join(tmp, "checkpoint"))
		}
	}
	_ = n.disk.RemoveAll(ctx, memDir)
	if err != nil {
		_ = n.disk.RemoveAll(context.WithoutCancel(ctx), batch)
		if tmp != "" {
			_ = n.disk.RemoveAll(context.WithoutCancel(ctx), tmp)
		}
		fail(err)
		return
	}
	n.log.Info("periodic checkpoint taken", "sandbox", sb.ID, "took", time.Since(at).Round(time.Millisecond))
	p := &n.pushes
	p.mu.Lock()
	pctx, cancel, j := p.begin(n.work, key)
	p.mu.Unlock()
	n.wg.Add(1)
	go func() {
		defer n.wg.Done()
		defer close(j.done)
		defer cancel()
		defer func() {
			_ = n.disk.RemoveAll(context.WithoutCancel(pctx), tmp)
			_ = n.disk.RemoveAll(context.WithoutCancel(pctx), diskCopy)
		}()
		start := time.Now()
		cpDir := filepath.Join(tmp, "checkpoint")
		a, err := n.cfg.Artifacts.PushSnapshot(pctx, artifact.SnapshotSource{ID: fmt.Sprintf("%s-cp%d", sb.ID, at.Unix()),
			Release: sb.TemplateDigest, Disk: diskCopy, Checkpoint: cpDir, Agent: n.checkpointAgent(pctx, cpDir)})
		ok := false
		if err == nil {
			ok, err = n.st.RecordCheckpointPush(context.WithoutCancel(pctx), sb.ID, n.cfg.ID, a.Digest, at)
		}
		p.finish(key, j, err != nil && pctx.Err() == nil)
		if err != nil {
			if pctx.Err() == nil {
				n.log.Warn("push of periodic checkpoint failed", "sandbox", sb.ID, "err", err)
			}
			return
		}
		n.log.Info("periodic checkpoint pushed", "sandbox", sb.ID, "digest", a.Digest, "recorded", ok,
			"uploaded", a.Uploaded, "took", time.Since(start).Round(time.Millisecond))
	}()
}
