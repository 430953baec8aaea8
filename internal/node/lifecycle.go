package node

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/guest/agentclient"
	"github.com/spacedev/space/internal/guest/wire"
	"github.com/spacedev/space/internal/runtime"
	"github.com/spacedev/space/internal/store"
)

// Operation kinds that a sandbox reaching each desired state completes.
var completes = map[string][]string{
	api.StateRunning:   {api.OpCreate, api.OpResume, "restore", api.OpStart, api.OpWake, api.OpClone},
	api.StatePaused:    {api.OpPause, api.OpCreate},
	api.StateSuspended: {api.OpSuspend},
	api.StateStopped:   {api.OpStop},
	api.StateDeleted:   {api.OpDelete},
}

// snapshotter returns the runtime's snapshot support.
func (n *Node) snapshotter() (runtime.Snapshotter, error) {
	s, ok := n.rt.(runtime.Snapshotter)
	if !ok {
		return nil, fault.New(fault.Conflict, "runtime %s cannot pause or snapshot sandboxes", n.info.Name)
	}
	return s, nil
}

// Disks: a root filesystem directory (gVisor) or an ext4 image (VM runtimes).

func (n *Node) diskPath(id string) (string, error) {
	if n.info.Disk == runtime.DiskExt4 {
		return n.disk.SandboxDisk(id)
	}
	return n.disk.SandboxRoot(id)
}

func (n *Node) createDisk(ctx context.Context, id, digest string) (string, error) {
	if n.info.Disk == runtime.DiskExt4 {
		return n.disk.CreateSandboxDisk(ctx, id, digest, 0)
	}
	return n.disk.CreateSandboxRoot(ctx, id, digest)
}

// createDiskFrom makes sandbox id's disk an O(1) copy of src (a snapshot's disk).
func (n *Node) createDiskFrom(ctx context.Context, id, src string) (string, error) {
	dst, err := n.diskPath(id)
	if err != nil {
		return "", err
	}
	if err := n.disk.CopyDisk(ctx, src, dst, false); err != nil {
		return "", err
	}
	return dst, nil
}

// converge moves a sandbox that exists toward its desired state (paused, suspended,
// stopped or running).
func (n *Node) converge(ctx context.Context, sb *store.Sandbox) {
	switch sb.State {
	case api.StatePending, api.StateCreating:
		if sb.CloneOf != "" {
			n.createClone(ctx, sb)
		} else {
			n.create(ctx, sb)
		}
		return
	case api.StatePausing, api.StateResuming, api.StateSuspending, api.StateRestoring, api.StateStopping:
		sb = n.recoverTransition(ctx, sb)
	}
	if sb.State == api.StateFailed {
		return
	}
	// A source prepares its pending clones first, whatever its desired state.
	if sb.State == api.StateRunning || sb.State == api.StatePaused || sb.State == api.StateSuspended {
		sb = n.prepareClones(ctx, sb)
	}
	if sb.State == sb.DesiredState {
		if sb.State == api.StateRunning {
			n.ensureRunning(ctx, sb)
		}
		if sb.ObservedGeneration < sb.Generation {
			sb = n.report(ctx, sb, store.Observed{State: sb.State, ObservedGeneration: sb.Generation, Error: sb.Error})
		}
		n.finishOps(ctx, sb, nil)
		return
	}
	if sb.ObservedGeneration >= sb.Generation {
		return // the last attempt at this intent failed; wait for a new one
	}
	var err error
	switch {
	case sb.DesiredState == api.StatePaused && sb.State == api.StateRunning:
		err = n.pause(ctx, sb)
	case sb.DesiredState == api.StateRunning && sb.State == api.StatePaused:
		err = n.resume(ctx, sb)
	case sb.DesiredState == api.StateSuspended && (sb.State == api.StateRunning || sb.State == api.StatePaused):
		err = n.suspend(ctx, sb)
	case sb.DesiredState == api.StateRunning && sb.State == api.StateSuspended:
		err = n.restore(ctx, sb)
	case sb.DesiredState == api.StateStopped:
		err = n.stop(ctx, sb)
	case sb.DesiredState == api.StateRunning && sb.State == api.StateStopped:
		err = n.start(ctx, sb)
	default:
		// E.g. a crash during a suspend lost the memory: the sandbox is stopped now and
		// cannot become suspended. Settle the intent as failed; the state is what it is.
		err = fmt.Errorf("cannot go from %s to %s", sb.State, sb.DesiredState)
		if sb.State == api.StateStopped && sb.DesiredState == api.StateSuspended {
			err = fmt.Errorf("the sandbox stopped before its memory could be saved; its disk is kept (start or wake it)")
		}
		sb = n.report(ctx, sb, store.Observed{State: sb.State, ObservedGeneration: sb.Generation, Error: err.Error()})
		n.finishOps(ctx, sb, err)
	}
	if err != nil && n.work.Err() == nil {
		n.log.Error("lifecycle transition failed", "sandbox", sb.ID, "from", sb.State, "to", sb.DesiredState, "err", err)
	}
}

// transition runs one lifecycle step: it reports the intermediate state, runs fn, and
// reports the resulting state; on error it reports what the sandbox really is now and
// fails the operations.
func (n *Node) transition(ctx context.Context, sb *store.Sandbox, during, reason string, fn func() (string, error)) error {
	start := time.Now()
	sb = n.report(ctx, sb, store.Observed{State: during, ObservedGeneration: sb.ObservedGeneration, Error: sb.Error})
	n.progress(ctx, sb, during)
	state, err := fn()
	if err != nil {
		if n.work.Err() != nil {
			return err // shutting down: the next start resumes from the intermediate state
		}
		sb = n.report(ctx, sb, store.Observed{State: state, ObservedGeneration: sb.Generation, Error: err.Error()})
		n.finishOps(ctx, sb, err)
		return err
	}
	sb = n.report(ctx, sb, store.Observed{State: state, ObservedGeneration: sb.Generation, Reason: reason})
	n.finishOps(ctx, sb, nil)
	n.log.Info("sandbox "+state, "sandbox", sb.ID, "took", time.Since(start).Round(time.Millisecond))
	n.measureLater(sb.ID)
	return nil
}

func (n *Node) pause(ctx context.Context, sb *store.Sandbox) error {
	snap, err := n.snapshotter()
	if err != nil {
		return n.transition(ctx, sb, api.StatePausing, "", func() (string, error) { return api.StateRunning, err })
	}
	return n.transition(ctx, sb, api.StatePausing, "", func() (string, error) {
		if err := snap.Pause(ctx, sb.ID); err != nil {
			return api.StateRunning, fmt.Errorf("pause: %w", err)
		}
		n.setReady(sb.ID, false)
		return api.StatePaused, nil
	})
}

func (n *Node) resume(ctx context.Context, sb *store.Sandbox) error {
	snap, err := n.snapshotter()
	if err != nil {
		return err
	}
	return n.transition(ctx, sb, api.StateResuming, "", func() (string, error) {
		if err := snap.Resume(ctx, sb.ID); err != nil {
			return api.StatePaused, fmt.Errorf("resume: %w", err)
		}
		// A claimed warm-pool member gets its owner's identity now.
		if sb.ClaimedAt != nil && sb.IdentityGeneration == 0 {
			if err := n.waitAgent(ctx, sb.ID, n.cfg.AgentReadyTimeout); err != nil {
				return api.StateFailed, err
			}
			if err := n.setIdentity(ctx, sb); err != nil {
				return api.StateFailed, fmt.Errorf("identity: %w", err)
			}
		}
		n.setReady(sb.ID, true)
		return api.StateRunning, nil
	})
}

// suspend saves memory and device state next to the disk and frees the runtime's
// resources.
func (n *Node) suspend(ctx context.Context, sb *store.Sandbox) error {
	snap, err := n.snapshotter()
	if err != nil {
		return n.transition(ctx, sb, api.StateSuspending, "", func() (string, error) { return sb.State, err })
	}
	wasPaused := sb.State == api.StatePaused
	return n.transition(ctx, sb, api.StateSuspending, sb.StatusReason, func() (string, error) {
		dir, err := n.disk.CheckpointDir(sb.ID)
		if err != nil {
			return api.StateFailed, err
		}
		if err := n.disk.RemoveAll(ctx, dir); err != nil {
			return sb.State, err
		}
		if wasPaused {
			if err := snap.Resume(ctx, sb.ID); err != nil {
				return api.StatePaused, fmt.Errorf("resume before suspend: %w", err)
			}
		}
		if err := n.checkpoint(ctx, snap, sb.ID, dir); err != nil {
			return n.afterFailedCheckpoint(ctx, sb, dir, err)
		}
		_ = n.rt.Destroy(ctx, sb.ID)
		n.dropAgent(sb.ID)
		return api.StateSuspended, nil
	})
}

// checkpoint quiesces the agent, saves the instance into dir and marks it complete.
func (n *Node) checkpoint(ctx context.Context, snap runtime.Snapshotter, id, dir string) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	// The agent freezes user processes until its next identity; under gVisor it also
	// closes its host socket (runsc cannot checkpoint one) and later reads its identity
	// from a resume file, while VM transports stay up across a restore.
	path := "/v1/quiesce?transport=keep"
	if n.info.Details["agent_resume"] == "file" {
		path = "/v1/quiesce"
	}
	if err := n.agentJSON(ctx, id, http.MethodPost, path, nil, nil); err != nil {
		return fmt.Errorf("quiesce agent: %w", err)
	}
	n.dropAgent(id)
	if n.info.Details["agent_resume"] == "file" {
		wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		err := agentclient.WaitQuiesced(wctx, filepath.Join(n.stateDir(id), "run"))
		cancel()
		if err != nil {
			return err
		}
	}
	if err := snap.Checkpoint(ctx, id, dir); err != nil {
		return fmt.Errorf("checkpoint: %w", err)
	}
	return n.disk.MarkComplete(dir)
}

// afterFailedCheckpoint reports what a sandbox is after a failed checkpoint: running
// again if its instance survived (the agent is told to resume), else stopped (its disk
// is intact, its memory is lost).
func (n *Node) afterFailedCheckpoint(ctx context.Context, sb *store.Sandbox, dir string, cause error) (string, error) {
	_ = n.disk.RemoveAll(ctx, dir)
	if st, err := n.rt.Status(ctx, sb.ID); err == nil && st == runtime.StatusRunning {
		if err := n.resumeAgent(ctx, sb); err == nil {
			n.setReady(sb.ID, true)
			return api.StateRunning, cause
		}
	}
	_ = n.rt.Destroy(ctx, sb.ID)
	n.dropAgent(sb.ID)
	return api.StateStopped, fmt.Errorf("%w (the sandbox is stopped; its disk is kept, its memory was lost)", cause)
}

// restore brings a suspended sandbox back from its checkpoint; without a usable
// checkpoint it boots from the disk (wake takes whichever path works).
func (n *Node) restore(ctx context.Context, sb *store.Sandbox) error {
	return n.transition(ctx, sb, api.StateRestoring, "", func() (string, error) {
		dir, err := n.disk.CheckpointDir(sb.ID)
		if err != nil {
			return api.StateFailed, err
		}
		root, err := n.diskPath(sb.ID)
		if err != nil {
			return api.StateFailed, err
		}
		snap, serr := n.snapshotter()
		if serr == nil && n.disk.IsComplete(dir) {
			err = n.restoreFrom(ctx, snap, sb, dir, root)
			if err == nil {
				_ = n.disk.RemoveAll(ctx, dir)
				return api.StateRunning, nil
			}
			n.log.Warn("restore from checkpoint failed; booting from disk", "sandbox", sb.ID, "err", err)
		}
		_ = n.disk.RemoveAll(ctx, dir)
		if err := n.boot(ctx, sb, root); err != nil {
			return api.StateStopped, err
		}
		return api.StateRunning, nil
	})
}

// restoreFrom starts the instance from a checkpoint on disk root and gives the agent a
// fresh identity before user processes continue.
func (n *Node) restoreFrom(ctx context.Context, snap runtime.Snapshotter, sb *store.Sandbox, dir, root string) error {
	n.dropAgent(sb.ID)
	_ = n.rt.Destroy(ctx, sb.ID)
	state := n.stateDir(sb.ID)
	if err := os.RemoveAll(state); err != nil {
		return err
	}
	if err := os.MkdirAll(state, 0o700); err != nil {
		return err
	}
	if err := snap.Restore(ctx, n.spec(sb, root), dir); err != nil {
		return fmt.Errorf("restore: %w", err)
	}
	if err := n.resumeAgent(ctx, sb); err != nil {
		_ = n.rt.Destroy(ctx, sb.ID)
		return err
	}
	n.setReady(sb.ID, true)
	return nil
}

// resumeAgent ends a quiesce: the agent gets a new identity (fresh entropy, the host's
// clock, the sandbox's environment) and then lets user processes continue. gVisor's
// agent learns it from a resume file in its run directory (it cannot hold a host socket
// across a checkpoint); others over their transport.
func (n *Node) resumeAgent(ctx context.Context, sb *store.Sandbox) error {
	id := n.identity(sb)
	if n.info.Details["agent_resume"] == "file" {
		run := filepath.Join(n.stateDir(sb.ID), "run")
		if err := os.MkdirAll(run, 0o700); err != nil {
			return err
		}
		if err := agentclient.WriteResume(run, id); err != nil {
			return err
		}
		if err := n.waitAgent(ctx, sb.ID, n.cfg.AgentReadyTimeout); err != nil {
			return err
		}
		return n.waitGeneration(ctx, sb.ID, id.Generation)
	}
	if err := n.waitAgent(ctx, sb.ID, n.cfg.AgentReadyTimeout); err != nil {
		return err
	}
	return n.agentJSON(ctx, sb.ID, http.MethodPost, "/v1/identity", id, nil)
}

// waitGeneration waits until the agent reports identity generation gen.
func (n *Node) waitGeneration(ctx context.Context, id string, gen int64) error {
	ctx, cancel := context.WithTimeout(ctx, n.cfg.AgentReadyTimeout)
	defer cancel()
	for {
		var h wire.Health
		if err := n.agentJSON(ctx, id, http.MethodGet, "/v1/health", nil, &h); err == nil && h.Generation >= gen {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("agent did not take its new identity: %w", ctx.Err())
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// stop powers the sandbox off; its disk is kept, its memory (and any checkpoint) not.
func (n *Node) stop(ctx context.Context, sb *store.Sandbox) error {
	return n.transition(ctx, sb, api.StateStopping, sb.StatusReason, func() (string, error) {
		n.dropAgent(sb.ID)
		if err := n.rt.Destroy(ctx, sb.ID); err != nil {
			return sb.State, fmt.Errorf("stop: %w", err)
		}
		if dir, err := n.disk.CheckpointDir(sb.ID); err == nil {
			_ = n.disk.RemoveAll(ctx, dir)
		}
		return api.StateStopped, nil
	})
}

// start boots a stopped sandbox from its disk.
func (n *Node) start(ctx context.Context, sb *store.Sandbox) error {
	return n.transition(ctx, sb, api.StateCreating, "", func() (string, error) {
		root, err := n.diskPath(sb.ID)
		if err != nil {
			return api.StateFailed, err
		}
		if _, err := os.Stat(root); err != nil {
			return api.StateFailed, fmt.Errorf("disk missing: %w", err)
		}
		if err := n.boot(ctx, sb, root); err != nil {
			_ = n.rt.Destroy(ctx, sb.ID)
			n.dropAgent(sb.ID)
			return api.StateStopped, err
		}
		return api.StateRunning, nil
	})
}

// recoverTransition settles a sandbox found in an intermediate state after a restart:
// it reports what the runtime shows, so converge can retry the transition.
func (n *Node) recoverTransition(ctx context.Context, sb *store.Sandbox) *store.Sandbox {
	st, err := n.rt.Status(ctx, sb.ID)
	exists := err == nil
	var now string
	switch {
	case exists && st == runtime.StatusPaused:
		now = api.StatePaused
	case exists && st == runtime.StatusRunning:
		now = api.StateRunning
		if sb.State == api.StateSuspending || sb.State == api.StateRestoring {
			// The agent may be quiesced: tell it to continue.
			if err := n.resumeAgent(ctx, sb); err != nil {
				n.log.Warn("recover: agent did not resume; restarting it from disk", "sandbox", sb.ID, "err", err)
				_ = n.rt.Destroy(ctx, sb.ID)
				now = api.StateStopped
			}
		}
	default:
		now = api.StateStopped
		if dir, err := n.disk.CheckpointDir(sb.ID); err == nil && n.disk.IsComplete(dir) {
			now = api.StateSuspended
		} else if err == nil {
			_ = n.disk.RemoveAll(ctx, dir)
		}
		_ = n.rt.Destroy(ctx, sb.ID)
	}
	n.log.Info("recovered interrupted transition", "sandbox", sb.ID, "was", sb.State, "now", now)
	if now == api.StateRunning {
		n.setReady(sb.ID, true)
	}
	return n.report(ctx, sb, store.Observed{State: now, ObservedGeneration: sb.ObservedGeneration, Error: sb.Error})
}

func (n *Node) setReady(id string, ready bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if ready {
		n.ready[id] = true
	} else {
		delete(n.ready, id)
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
