package node

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/crash"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/guest/agentclient"
	"github.com/spacedev/space/internal/guest/wire"
	"github.com/spacedev/space/internal/lifecycle"
	"github.com/spacedev/space/internal/runtime"
	"github.com/spacedev/space/internal/store"
)

// The steps the lifecycle planner asks for. Each records its transition with the
// in-between state before it touches anything (so that a crash at any instant is
// recovered as that transition, see lifecycle.Plan), and reports the state it reached.

// snapshotter returns the runtime's snapshot support.
func (n *Node) snapshotter() (runtime.Snapshotter, error) {
	s, ok := n.rt.(runtime.Snapshotter)
	if !ok {
		return nil, fault.New(fault.Conflict, "runtime %s cannot pause or snapshot sandboxes", n.info.Name)
	}
	return s, nil
}

// outcome is where a transition ended, and what it cost the user when it succeeded in
// a lesser way (a restore that had to boot from the disk, say).
type outcome struct {
	state string
	note  string
	// identityGen, when not 0, is the identity generation the agent took in the step
	// (a claimed pool member's owner identity): recorded with the resulting state.
	identityGen int64
}

// transition runs one lifecycle step: it reports the in-between state of t, runs fn,
// and reports the resulting state; on error it reports what the sandbox really is now
// and fails the operations.
func (n *Node) transition(ctx context.Context, sb *store.Sandbox, t lifecycle.Transition, reason string, fn func() (outcome, error)) error {
	start := time.Now()
	n.marks.begin(sb.ID)
	during := lifecycle.During(t)
	crash.Point(string(t) + ".begin")
	sb, err := n.record(ctx, sb, store.Observed{State: during, ObservedGeneration: sb.ObservedGeneration, Error: sb.Error, Transition: t,
		Progress: during})
	if err != nil {
		n.marks.take(sb.ID)
		return err
	}
	n.marks.mark(sb.ID, "recorded")
	crash.Point(string(t) + ".recorded")
	out, err := fn()
	if err != nil {
		if n.work.Err() != nil {
			return err // shutting down: the next start recovers the recorded transition
		}
		sb = n.report(ctx, sb, store.Observed{State: out.state, ObservedGeneration: sb.Generation, Error: joinNonEmpty(lossError(out.note), err.Error())})
		n.finishOps(ctx, sb, err, out.note)
		return err
	}
	crash.Point(string(t) + ".acted")
	sb = n.report(ctx, sb, store.Observed{State: out.state, ObservedGeneration: sb.Generation, Reason: reason, Error: lossError(out.note),
		IdentityGeneration: out.identityGen})
	n.marks.mark(sb.ID, "reported")
	crash.Point(string(t) + ".reported")
	n.finishOps(ctx, sb, nil, out.note)
	n.log.Info("sandbox "+out.state, "sandbox", sb.ID, "transition", t, "took", time.Since(start).Round(time.Millisecond))
	n.measureLater(sb.ID)
	return nil
}

// create builds the sandbox's disk and starts it: restored from the template's base
// snapshot when one fits, else booted. A previous attempt cut off by a crash is cleaned
// up first (nobody has had the sandbox yet), so create is safe to repeat. A warm-pool
// member (desired paused) is paused once it runs.
func (n *Node) create(ctx context.Context, sb *store.Sandbox) error {
	n.log.Info("creating sandbox", "sandbox", sb.ID, "template", sb.TemplateRef)
	n.marks.begin(sb.ID)
	crash.Point("create.begin")
	sb, err := n.record(ctx, sb, store.Observed{State: api.StateCreating, ObservedGeneration: sb.ObservedGeneration, Transition: lifecycle.TCreate,
		Progress: "creating on node " + n.cfg.Name})
	if err != nil {
		n.marks.take(sb.ID)
		return err
	}
	n.marks.mark(sb.ID, "recorded")
	crash.Point("create.recorded")
	if err := n.cleanupLocal(ctx, sb.ID); err != nil {
		n.log.Warn("clean up an earlier create attempt", "sandbox", sb.ID, "err", err)
	}
	path := "boot"
	err = n.disk.CheckSpace(0)
	var digest string
	switch {
	case err != nil:
	case sb.Spec.Snapshot != "":
		digest = sb.TemplateDigest
		path, err = n.startFromSnapshot(ctx, sb)
	default:
		n.releaseUse.RLock() // the release stays until the disk is made from it
		if digest, err = n.resolveTemplate(ctx, sb); err == nil {
			path, err = n.startNew(ctx, sb, digest)
		}
		n.releaseUse.RUnlock()
	}
	if err == nil && sb.DesiredState == api.StatePaused {
		// A warm-pool member: warm it, then park it.
		n.warmMember(ctx, sb)
		err = n.park(ctx, sb)
	}
	if err != nil {
		if n.work.Err() != nil {
			return err // shutting down: the next start makes it again
		}
		n.log.Error("create sandbox failed", "sandbox", sb.ID, "err", err)
		n.cleanupLocal(ctx, sb.ID)
		sb = n.report(ctx, sb, store.Observed{State: api.StateFailed, ObservedGeneration: sb.Generation, Error: err.Error(), TemplateDigest: digest})
		n.finishOps(ctx, sb, err, "")
		return err
	}
	state := api.StateRunning
	if sb.DesiredState == api.StatePaused {
		state = api.StatePaused
	}
	crash.Point("create.acted")
	sb = n.report(ctx, sb, store.Observed{State: state, ObservedGeneration: sb.Generation, StartPath: path, TemplateDigest: digest})
	n.marks.mark(sb.ID, "reported")
	crash.Point("create.reported")
	n.finishOps(ctx, sb, nil, "")
	n.log.Info("sandbox "+state, "sandbox", sb.ID, "start_path", path)
	n.measureLater(sb.ID)
	return nil
}

// park takes a warm-pool member out of service until it is claimed: its instance is
// paused, or, on a runtime where pausing and resuming cost more than an idle instance
// (runtime.Caps.ParkRunning), left running and only marked not ready. Either way the
// member is recorded paused (lifecycle.Facts.Parked).
func (n *Node) park(ctx context.Context, sb *store.Sandbox) error {
	if n.parksRunning(sb) {
		n.setReady(sb.ID, false)
		return nil
	}
	return n.pauseInstance(ctx, sb.ID)
}

// parksRunning reports whether sb, an unclaimed warm-pool member, waits with its
// instance running on this node's runtime.
func (n *Node) parksRunning(sb *store.Sandbox) bool {
	return n.info.Caps.ParkRunning && parked(sb)
}

// parked reports whether sb is a warm-pool member nobody has claimed yet.
func parked(sb *store.Sandbox) bool { return sb.PoolKey != "" && sb.ClaimedAt == nil }

// pauseInstance freezes a running instance's vCPUs.
func (n *Node) pauseInstance(ctx context.Context, id string) error {
	snap, err := n.snapshotter()
	if err != nil {
		return err
	}
	if err := snap.Pause(ctx, id); err != nil {
		return fmt.Errorf("pause: %w", err)
	}
	n.setReady(id, false)
	return nil
}

// startNew makes the disk of a new sandbox and starts it, from the release's base
// snapshot when one fits (start path "snapshot"), else by booting ("boot").
func (n *Node) startNew(ctx context.Context, sb *store.Sandbox, digest string) (string, error) {
	sb.TemplateDigest = digest
	// A VM's snapshot holds its devices: a base snapshot (made without a NIC) does not
	// restore into a VM with one, so networked VMs boot.
	vmNet := sb.Spec.Network != nil && n.info.Caps.Network == runtime.NetworkTap
	startKey := fmt.Sprintf("%s/%dcpu-%dmb", digest, sb.Spec.CPU, sb.Spec.MemoryMB)
	began := time.Now()
	snap, dir, ok := n.baseSnapshotFor(digest, sb.Spec)
	if ok && !sb.Spec.FreshBoot && !vmNet {
		// startpath.go: a base snapshot is used while restores measure no slower than boots.
		if use, why := n.starts.useSnapshot(startKey); !use {
			ok = false
			n.log.Info("booting instead of restoring the base snapshot", "sandbox", sb.ID, "why", why)
		}
	}
	if ok && !sb.Spec.FreshBoot && !vmNet {
		root, err := n.createDiskFrom(ctx, sb.ID, filepath.Join(dir, "disk"))
		if err == nil {
			err = n.limitDisk(ctx, sb)
		}
		if err == nil {
			n.marks.mark(sb.ID, "disk")
			if err = n.restoreFrom(ctx, snap, sb, filepath.Join(dir, "checkpoint"), root); err == nil {
				n.marks.mark(sb.ID, "restored")
				n.starts.record(startKey, "snapshot", time.Since(began))
				return "snapshot", nil
			}
		}
		n.log.Warn("restore from base snapshot failed; booting", "sandbox", sb.ID, "err", err)
		n.cleanupLocal(ctx, sb.ID)
		began = time.Now()
	}
	root, err := n.createDisk(ctx, sb.ID, digest)
	if err != nil {
		return "", fmt.Errorf("create disk: %w", err)
	}
	if err := n.limitDisk(ctx, sb); err != nil {
		return "", fmt.Errorf("limit disk: %w", err)
	}
	crash.Point("create.disk")
	n.marks.mark(sb.ID, "disk")
	if err := n.boot(ctx, sb, root); err != nil {
		return "", err
	}
	n.starts.record(startKey, "boot", time.Since(began))
	if !vmNet {
		n.ensureBaseSnapshotLater(digest, sb.Spec)
	}
	return "boot", nil
}

// boot starts the runtime instance on root and waits for its agent.
func (n *Node) boot(ctx context.Context, sb *store.Sandbox, root string) error {
	dir := n.stateDir(sb.ID)
	n.dropAgent(sb.ID)
	if err := os.RemoveAll(dir); err != nil {
		return err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	att, err := n.attachNetwork(ctx, sb)
	if err != nil {
		return err
	}
	if err := n.rt.Create(ctx, n.spec(sb, root, att)); err != nil {
		return fmt.Errorf("start %s instance: %w", n.info.Name, err)
	}
	crash.Point("boot.instance")
	n.marks.mark(sb.ID, "instance")
	if _, err := n.waitAgent(ctx, sb.ID, n.cfg.AgentReadyTimeout); err != nil {
		return err
	}
	n.marks.mark(sb.ID, "agent")
	if err := n.setIdentity(ctx, sb); err != nil {
		return fmt.Errorf("give sandbox its identity: %w", err)
	}
	n.marks.mark(sb.ID, "identity")
	crash.Point("boot.identity")
	if err := n.configureGuestNetwork(ctx, sb.ID, att); err != nil {
		return err
	}
	if err := n.runTemplateStart(ctx, sb); err != nil {
		return err
	}
	n.serving(sb)
	return nil
}

// start boots a stopped sandbox from its disk.
func (n *Node) start(ctx context.Context, sb *store.Sandbox) error {
	return n.transition(ctx, sb, lifecycle.TStart, "", func() (outcome, error) {
		if err := n.disk.CheckSpace(0); err != nil {
			return outcome{state: api.StateStopped}, err
		}
		root, err := n.diskPath(sb.ID)
		if err != nil {
			return outcome{state: api.StateFailed}, err
		}
		if _, err := os.Stat(root); err != nil {
			return outcome{state: api.StateFailed}, fmt.Errorf("disk missing: %w", err)
		}
		if err := n.boot(ctx, sb, root); err != nil {
			_ = n.rt.Destroy(ctx, sb.ID)
			n.dropAgent(sb.ID)
			return outcome{state: api.StateStopped}, err
		}
		return outcome{state: api.StateRunning}, nil
	})
}

// reboot boots a sandbox that lost its instance from its disk, recording the loss. It
// is a start (recorded as one), so a crash meanwhile never remakes the disk.
func (n *Node) reboot(ctx context.Context, sb *store.Sandbox, note string) error {
	n.log.Warn("sandbox lost its memory; booting it again from its disk", "sandbox", sb.ID, "why", note)
	n.dropAgent(sb.ID)
	_ = n.rt.Destroy(ctx, sb.ID)
	n.cancelSync(sb.ID)
	if dir, err := n.disk.CheckpointDir(sb.ID); err == nil {
		_ = n.disk.RemoveAll(ctx, dir) // stale: the disk moves on from here
	}
	return n.transition(ctx, sb, lifecycle.TStart, "", func() (outcome, error) {
		root, err := n.diskPath(sb.ID)
		if err != nil {
			return outcome{state: api.StateFailed, note: note}, err
		}
		if err := n.boot(ctx, sb, root); err != nil {
			_ = n.rt.Destroy(ctx, sb.ID)
			n.dropAgent(sb.ID)
			return outcome{state: api.StateStopped, note: note}, fmt.Errorf("boot from disk: %w", err)
		}
		return outcome{state: api.StateRunning, note: note + "; booted again from its disk"}, nil
	})
}

func (n *Node) pause(ctx context.Context, sb *store.Sandbox) error {
	return n.transition(ctx, sb, lifecycle.TPause, "", func() (outcome, error) {
		if err := n.pauseInstance(ctx, sb.ID); err != nil {
			return outcome{state: api.StateRunning}, err
		}
		return outcome{state: api.StatePaused}, nil
	})
}

func (n *Node) resume(ctx context.Context, sb *store.Sandbox) error {
	snap, err := n.snapshotter()
	if err != nil {
		return err
	}
	return n.transition(ctx, sb, lifecycle.TResume, "", func() (outcome, error) {
		if err := snap.Resume(ctx, sb.ID); err != nil {
			return outcome{state: api.StatePaused}, fmt.Errorf("resume: %w", err)
		}
		n.marks.mark(sb.ID, "resumed")
		// A claimed warm-pool member gets its owner's identity now; its generation is
		// recorded with the running state (a crash before that gives it a fresh one
		// again: the claim still needs an identity).
		var gen int64
		if sb.ClaimedAt != nil && sb.IdentityGeneration == 0 {
			if _, err := n.waitAgent(ctx, sb.ID, n.cfg.AgentReadyTimeout); err != nil {
				return outcome{state: api.StateFailed}, err
			}
			n.marks.mark(sb.ID, "agent")
			id := n.identity(sb)
			if err := n.agent(sb.ID).SetIdentity(ctx, id); err != nil {
				return outcome{state: api.StateFailed}, fmt.Errorf("identity: %w", err)
			}
			gen = id.Generation
			n.marks.mark(sb.ID, "identity")
		}
		n.serving(sb)
		return outcome{state: api.StateRunning, identityGen: gen}, nil
	})
}

// suspend saves memory and device state next to the disk and frees the runtime's
// resources.
func (n *Node) suspend(ctx context.Context, sb *store.Sandbox) error {
	snap, err := n.snapshotter()
	if err != nil {
		return n.transition(ctx, sb, lifecycle.TSuspend, "", func() (outcome, error) { return outcome{state: sb.State}, err })
	}
	wasPaused := sb.State == api.StatePaused
	moving := sb.MoveFrom == n.cfg.ID
	n.cancelSync(sb.ID)
	defer func() {
		// With a registry the snapshot is pushed once the suspend is reported, in the
		// background (moves.go); a move off this node waits for it.
		n.pushLater(sb.ID, moving)
	}()
	return n.transition(ctx, sb, lifecycle.TSuspend, sb.StatusReason, func() (outcome, error) {
		// The snapshot holds the sandbox's memory: it must fit above the reserve.
		if err := n.disk.CheckSpace(n.checkpointRoom(sb)); err != nil {
			return outcome{state: sb.State}, err
		}
		dir, err := n.disk.CheckpointDir(sb.ID)
		if err != nil {
			return outcome{state: api.StateFailed}, err
		}
		if err := n.disk.RemoveAll(ctx, dir); err != nil {
			return outcome{state: sb.State}, err
		}
		if wasPaused {
			if err := snap.Resume(ctx, sb.ID); err != nil {
				return outcome{state: api.StatePaused}, fmt.Errorf("resume before suspend: %w", err)
			}
		}
		if moving {
			n.prepareMove(ctx, sb)
			// A move's downtime starts now: the sandbox stops running for its checkpoint.
			_ = n.st.MarkMoveDowntimeStart(ctx, sb.ID, n.cfg.ID)
		}
		if err := n.checkpoint(ctx, snap, sb.ID, dir); err != nil {
			return n.afterFailedCheckpoint(ctx, sb, dir, err)
		}
		_ = n.rt.Destroy(ctx, sb.ID)
		n.dropAgent(sb.ID)
		n.marks.mark(sb.ID, "destroyed")
		crash.Point("suspend.destroyed")
		// Written, not yet durable: the fsync runs once the suspend is reported
		// (durability.go).
		n.syncLater(sb.ID, dir)
		return outcome{state: api.StateSuspended}, nil
	})
}

// checkpoint quiesces the agent, saves the instance into dir and marks it written: it
// is complete until the host reboots (storage MarkWritten). A caller that keeps it
// longer makes it durable (MarkComplete, or syncLater).
func (n *Node) checkpoint(ctx context.Context, snap runtime.Snapshotter, id, dir string) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	// Requests on their way to the agent get there first; new ones wait (gate.go).
	defer n.holdAgent(ctx, id)()
	if err := n.quiesce(ctx, id); err != nil {
		return err
	}
	n.marks.mark(id, "quiesced")
	crash.Point("checkpoint.quiesced")
	if err := snap.Checkpoint(ctx, id, dir); err != nil {
		return fmt.Errorf("checkpoint: %w", err)
	}
	n.marks.mark(id, "checkpointed")
	crash.Point("checkpoint.saved")
	if err := n.disk.MarkWritten(dir); err != nil {
		return err
	}
	crash.Point("checkpoint.marked")
	return nil
}

// afterFailedCheckpoint reports what a sandbox is after a failed checkpoint: running
// again if its instance survived (the agent is told to resume), else stopped (its disk
// is intact, its memory is lost).
func (n *Node) afterFailedCheckpoint(ctx context.Context, sb *store.Sandbox, dir string, cause error) (outcome, error) {
	_ = n.disk.RemoveAll(ctx, dir)
	if agentclient.CodeOf(cause) == wire.ErrCodeCannotCheckpoint {
		// The agent refused the quiesce (a socket gVisor cannot save, sockets.go in
		// package agent): it froze nothing in the end and kept its transport and its
		// identity; the sandbox runs on as it was.
		n.serving(sb)
		return outcome{state: api.StateRunning}, cause
	}
	if st, err := n.rt.Status(ctx, sb.ID); err == nil && st == runtime.StatusRunning {
		if err := n.resumeAgent(ctx, sb); err == nil {
			n.serving(sb)
			return outcome{state: api.StateRunning}, cause
		}
	}
	_ = n.rt.Destroy(ctx, sb.ID)
	n.dropAgent(sb.ID)
	return outcome{state: api.StateStopped, note: lifecycle.LostCheckpoint}, fmt.Errorf("%w (the sandbox is stopped; its disk is kept, its memory was lost)", cause)
}

// restore brings a suspended sandbox back from its checkpoint; if the checkpoint does
// not restore it boots from the disk (wake takes whichever path works) and says what
// was lost.
func (n *Node) restore(ctx context.Context, sb *store.Sandbox) error {
	// A push of the snapshot in flight is stale from now on (moves.go), and so is its
	// background sync.
	n.stopPush(sb.ID)
	n.cancelSync(sb.ID)
	moved := ""
	err := n.transition(ctx, sb, lifecycle.TRestore, "", func() (outcome, error) {
		if err := n.disk.CheckSpace(0); err != nil {
			return outcome{state: api.StateSuspended}, err
		}
		dir, err := n.disk.CheckpointDir(sb.ID)
		if err != nil {
			return outcome{state: api.StateFailed}, err
		}
		root, err := n.diskPath(sb.ID)
		if err != nil {
			return outcome{state: api.StateFailed}, err
		}
		snap, serr := n.snapshotter()
		note := lifecycle.LostSnapshot
		if serr == nil && n.disk.IsComplete(dir) {
			err = n.restoreFrom(ctx, snap, sb, dir, root)
			if err == nil {
				// Out of the way at once (a suspend may write a new one there); its
				// space is freed after the wake is reported.
				_ = n.disk.RemoveLater(ctx, dir)
				crash.Point("restore.cleaned")
				moved = n.finishMove(ctx, sb)
				return outcome{state: api.StateRunning}, nil
			}
			if n.work.Err() != nil {
				return outcome{state: api.StateSuspended}, err
			}
			n.log.Warn("restore from checkpoint failed; booting from disk", "sandbox", sb.ID, "err", err)
			note = "its memory was lost: its snapshot did not restore (" + err.Error() + ")"
		}
		_ = n.disk.RemoveAll(ctx, dir)
		if err := n.boot(ctx, sb, root); err != nil {
			return outcome{state: api.StateStopped, note: note}, err
		}
		return outcome{state: api.StateRunning, note: note + "; booted again from its disk"}, nil
	})
	if err == nil && moved != "" {
		n.noteMove(ctx, sb, moved)
	}
	if err != nil {
		// Still suspended on its checkpoint (if that is left): make it durable.
		n.syncWrittenLater(sb.ID)
	}
	return err
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
	att, err := n.attachNetwork(ctx, sb)
	if err != nil {
		return err
	}
	if err := snap.Restore(ctx, n.spec(sb, root, att), dir); err != nil {
		return fmt.Errorf("restore: %w", err)
	}
	n.marks.mark(sb.ID, "instance")
	crash.Point("restore.instance")
	if err := n.resumeAgent(ctx, sb); err != nil {
		_ = n.rt.Destroy(ctx, sb.ID)
		return err
	}
	n.marks.mark(sb.ID, "identity")
	crash.Point("restore.resumed")
	if err := n.configureGuestNetwork(ctx, sb.ID, att); err != nil {
		_ = n.rt.Destroy(ctx, sb.ID)
		return err
	}
	n.serving(sb)
	return nil
}

// stop powers the sandbox off; its disk is kept, its memory (and any checkpoint) not.
func (n *Node) stop(ctx context.Context, sb *store.Sandbox) error {
	n.stopPush(sb.ID)
	n.cancelSync(sb.ID)
	return n.transition(ctx, sb, lifecycle.TStop, sb.StatusReason, func() (outcome, error) {
		n.dropAgent(sb.ID)
		if err := n.rt.Destroy(ctx, sb.ID); err != nil {
			return outcome{state: sb.State}, fmt.Errorf("stop: %w", err)
		}
		crash.Point("stop.destroyed")
		if dir, err := n.disk.CheckpointDir(sb.ID); err == nil {
			_ = n.disk.RemoveAll(ctx, dir)
		}
		return outcome{state: api.StateStopped}, nil
	})
}

// delete destroys the sandbox's instance and storage.
func (n *Node) delete(ctx context.Context, sb *store.Sandbox) error {
	if sb.State != api.StateDeleting {
		sb = n.report(ctx, sb, store.Observed{State: api.StateDeleting, ObservedGeneration: sb.ObservedGeneration, Error: sb.Error, Transition: lifecycle.TDelete})
	}
	crash.Point("delete.recorded")
	if err := n.cleanupLocal(ctx, sb.ID); err != nil {
		if n.work.Err() != nil {
			return err
		}
		n.report(ctx, sb, store.Observed{State: api.StateDeleting, ObservedGeneration: sb.ObservedGeneration, Error: "delete: " + err.Error(), Transition: lifecycle.TDelete})
		n.finishOps(ctx, sb, err, "")
		return err
	}
	crash.Point("delete.cleaned")
	sb = n.report(ctx, sb, store.Observed{State: api.StateDeleted, ObservedGeneration: sb.Generation, Deleted: true, Error: sb.Error})
	n.finishOps(ctx, sb, nil, "")
	n.log.Info("sandbox deleted", "sandbox", sb.ID)
	return nil
}

// cleanupLocal removes everything this node holds for a sandbox. Idempotent.
func (n *Node) cleanupLocal(ctx context.Context, id string) error {
	n.stopPush(id)
	n.cancelSync(id)
	n.stopPush(periodicKey(id))
	n.dropAgent(id)
	n.gates.forget(id)
	var errs []error
	if err := n.rt.Destroy(ctx, id); err != nil {
		errs = append(errs, fmt.Errorf("destroy instance: %w", err))
	}
	if err := n.disk.DeleteSandbox(ctx, id); err != nil {
		errs = append(errs, fmt.Errorf("delete storage: %w", err))
	}
	if err := os.RemoveAll(n.stateDir(id)); err != nil {
		errs = append(errs, err)
	}
	if err := n.teardownNetwork(ctx, id); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// adopt takes over an instance that survived an interrupted transition (or a restart):
// its agent is brought back to serving with a current identity and the instance to
// target (running or paused). An instance that cannot be brought back is destroyed:
// the next plan sees its loss.
func (n *Node) adopt(ctx context.Context, sb *store.Sandbox, target string) error {
	root, _ := n.diskPath(sb.ID)
	err := n.rt.Adopt(ctx, n.spec(sb, root, nil))
	if err == nil {
		err = n.reviveInstance(ctx, sb, target)
	}
	if err == nil && sb.Transition == lifecycle.TCloneSource {
		// The source runs on from here: a checkpoint its clone preparation left is
		// older than it now and must never restore it.
		if cp := n.cloneCheckpoint(sb.ID); cp != "" {
			_ = n.disk.Unmark(cp)
		}
	}
	if err != nil {
		if n.work.Err() != nil {
			return err
		}
		n.log.Warn("could not take over the sandbox's instance; it is lost", "sandbox", sb.ID, "err", err)
		n.dropAgent(sb.ID)
		_ = n.rt.Destroy(ctx, sb.ID)
		n.report(ctx, sb, store.Observed{State: sb.State, ObservedGeneration: sb.ObservedGeneration, Error: sb.Error, Transition: sb.Transition})
		return err
	}
	gen := sb.ObservedGeneration
	if target == sb.DesiredState {
		gen = sb.Generation
	}
	sb = n.report(ctx, sb, store.Observed{State: target, ObservedGeneration: gen, Error: sb.Error})
	if target == sb.DesiredState {
		n.finishOps(ctx, sb, nil, "")
	}
	n.log.Info("took over the sandbox's instance", "sandbox", sb.ID, "now", target)
	return nil
}

// reviveInstance brings an adopted instance's agent back and the instance to target.
func (n *Node) reviveInstance(ctx context.Context, sb *store.Sandbox, target string) error {
	st, err := n.rt.Status(ctx, sb.ID)
	if err != nil {
		return err
	}
	if st == runtime.StatusPaused {
		snap, err := n.snapshotter()
		if err != nil {
			return err
		}
		if err := snap.Resume(ctx, sb.ID); err != nil {
			return fmt.Errorf("resume: %w", err)
		}
	}
	if err := n.revive(ctx, sb); err != nil {
		return err
	}
	if sb.ClaimedAt != nil && sb.IdentityGeneration == 0 {
		if err := n.setIdentity(ctx, sb); err != nil {
			return err
		}
	}
	if target == api.StatePaused {
		return n.park(ctx, sb)
	}
	n.serving(sb)
	return nil
}

// restoreLeft restores a sandbox whose instance vanished while it was checkpointed for
// its clones, from that checkpoint (its memory at that moment).
func (n *Node) restoreLeft(ctx context.Context, sb *store.Sandbox) error {
	cp := n.cloneCheckpoint(sb.ID)
	snap, err := n.snapshotter()
	if err == nil && cp == "" {
		err = errors.New("the clone checkpoint is gone")
	}
	if err == nil {
		root, derr := n.diskPath(sb.ID)
		if err = derr; err == nil {
			err = n.restoreFrom(ctx, snap, sb, cp, root)
		}
	}
	if err != nil {
		if n.work.Err() != nil {
			return err
		}
		n.log.Warn("restore from the clone checkpoint failed", "sandbox", sb.ID, "err", err)
		if cp != "" {
			_ = n.disk.Unmark(cp) // the next plan boots it from its disk
		}
		return err
	}
	_ = n.disk.RemoveAll(ctx, filepath.Dir(cp))
	n.log.Info("restored sandbox from its clone checkpoint after a crash", "sandbox", sb.ID)
	state := sb.State
	if sb.State == api.StatePaused {
		if err := n.pauseInstance(ctx, sb.ID); err != nil {
			state = api.StateRunning
		}
	}
	n.report(ctx, sb, store.Observed{State: state, ObservedGeneration: sb.ObservedGeneration, Error: sb.Error})
	return nil
}
