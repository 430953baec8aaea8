package node

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/lifecycle"
	"github.com/spacedev/space/internal/runtime"
	"github.com/spacedev/space/internal/store"
)

// reconcile drives one sandbox toward its desired state: it observes the sandbox (its
// row and the host), asks the lifecycle planner for the next step, takes it, and
// repeats until the planner answers Nothing. It returns true when the sandbox no longer
// exists on this node.
func (n *Node) reconcile(ctx context.Context, id string) bool {
	defer n.recovered(id)
	for range maxStepsPerKick {
		select {
		case <-n.stopping:
			// Shutting down: no new step. What is recorded is recovered at the next start.
			return false
		default:
		}
		sb, err := n.st.GetSandbox(ctx, id)
		if fault.Is(err, fault.NotFound) {
			n.cleanupLocal(ctx, id)
			return true
		}
		if err != nil {
			if ctx.Err() == nil {
				n.log.Warn("load sandbox", "sandbox", id, "err", err)
			}
			return false
		}
		if sb.NodeID != n.cfg.ID || sb.DeletedAt != nil {
			n.cleanupLocal(ctx, id)
			return true
		}
		if n.needsFetch(sb) && !n.fetchMoved(ctx, sb) {
			return false // sent back where it was (moves.go)
		}
		facts, err := n.observe(ctx, sb)
		if err != nil {
			if ctx.Err() == nil {
				n.log.Warn("observe sandbox", "sandbox", id, "err", err)
			}
			return false
		}
		a := lifecycle.Plan(facts)
		if a.Step == lifecycle.Nothing {
			if sb.State == api.StateRunning && facts.Instance == lifecycle.InstanceRunning {
				n.serving(sb)
				n.noteIdleTimeout(sb.ID, sb.IdleTimeout)
				n.pollAgentActivity(ctx, sb.ID)
			}
			n.pushIfMissing(sb)
			if facts.Instance == lifecycle.InstanceRunning && n.checkpointDue(sb) {
				n.periodicCheckpoint(ctx, sb)
			}
			return false
		}
		n.log.Debug("plan", "sandbox", id, "state", sb.State, "desired", sb.DesiredState, "step", a.Step)
		progressed := n.execute(ctx, sb, a)
		if a.Step == lifecycle.Delete && progressed {
			return true
		}
		if !progressed || n.work.Err() != nil {
			return false
		}
	}
	return false
}

// recovered ends the wait of requests for a sandbox found without its instance at
// start-up (Node.recovering): its worker has taken every step it could.
func (n *Node) recovered(id string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	delete(n.recovering, id)
}

// observe gathers the facts the planner needs about a sandbox: its row, and what the
// runtime and the disk show. It fails when the runtime cannot say (then nothing is
// done: a transient error must never look like a lost instance).
func (n *Node) observe(ctx context.Context, sb *store.Sandbox) (lifecycle.Facts, error) {
	f := lifecycle.Facts{
		State: sb.State, Desired: sb.DesiredState, Generation: sb.Generation, ObservedGeneration: sb.ObservedGeneration,
		Transition: sb.Transition, CloneOf: sb.CloneOf, CloneReady: sb.CloneReady,
		NeedsIdentity: sb.ClaimedAt != nil && sb.IdentityGeneration == 0,
		Parked:        parked(sb),
	}
	pending, err := n.st.PendingWork(ctx, sb.ID, sb.ObservedGeneration)
	if err != nil {
		return f, err
	}
	f.OpenOps = pending.OpenOps
	if sb.State == api.StatePending || sb.State == api.StateDeleted {
		return f, nil
	}
	st, err := n.rt.Status(ctx, sb.ID)
	switch {
	case errors.Is(err, runtime.ErrNotFound):
		f.Instance = lifecycle.NoInstance
	case err != nil:
		return f, err
	case st == runtime.StatusRunning:
		f.Instance = lifecycle.InstanceRunning
	case st == runtime.StatusPaused:
		f.Instance = lifecycle.InstancePaused
	default:
		f.Instance = lifecycle.InstanceStopped
	}
	if dir, err := n.disk.CheckpointDir(sb.ID); err == nil {
		f.Checkpoint = n.disk.IsComplete(dir)
	}
	f.CloneCheckpoint = n.cloneCheckpoint(sb.ID) != ""
	f.Disk = n.hasDisk(sb.ID)
	if sb.State == api.StateRunning || sb.State == api.StatePaused || sb.State == api.StateSuspended {
		f.PendingClones, f.PendingSnapshots = pending.Clones, pending.Snapshots
	}
	return f, nil
}

// cloneCheckpoint returns a complete checkpoint left in one of the sandbox's clone
// batches by an interrupted clone preparation ("" if none).
func (n *Node) cloneCheckpoint(id string) string {
	dir, err := n.disk.SandboxDir(id)
	if err != nil {
		return ""
	}
	batches, _ := filepath.Glob(filepath.Join(dir, "clones", "*", "checkpoint"))
	for _, cp := range batches {
		if n.disk.IsComplete(cp) {
			return cp
		}
	}
	return ""
}

// execute takes one planned step. It reports whether the step made progress (a step
// that waits for something else, or that was cut short by shutdown, did not).
func (n *Node) execute(ctx context.Context, sb *store.Sandbox, a lifecycle.Action) bool {
	var err error
	switch a.Step {
	case lifecycle.Create:
		err = n.create(ctx, sb)
	case lifecycle.WaitClone:
		n.waitClone(ctx, sb)
		return false
	case lifecycle.StartClone:
		err = n.startClone(ctx, sb)
	case lifecycle.PrepareClones:
		n.prepareClones(ctx, sb)
	case lifecycle.TakeSnapshots:
		n.takeSnapshots(ctx, sb)
	case lifecycle.Pause:
		err = n.pause(ctx, sb)
	case lifecycle.Resume:
		err = n.resume(ctx, sb)
	case lifecycle.Suspend:
		err = n.suspend(ctx, sb)
	case lifecycle.Restore:
		err = n.restore(ctx, sb)
	case lifecycle.Stop:
		err = n.stop(ctx, sb)
	case lifecycle.Start:
		err = n.start(ctx, sb)
	case lifecycle.Delete:
		err = n.delete(ctx, sb)
	case lifecycle.Adopt:
		err = n.adopt(ctx, sb, a.State)
	case lifecycle.RestoreLeft:
		err = n.restoreLeft(ctx, sb)
	case lifecycle.Reboot:
		err = n.reboot(ctx, sb, a.Note)
	case lifecycle.Settle:
		n.settle(ctx, sb, a)
	case lifecycle.Resolve:
		n.resolve(ctx, sb, a)
	case lifecycle.FinishOps:
		var failErr error
		if sb.State != sb.DesiredState {
			failErr = errors.New(joinNonEmpty("the sandbox is "+sb.State, sb.Error))
		}
		n.finishOps(ctx, sb, failErr, "")
	}
	if n.work.Err() != nil {
		return false // shutting down: the next start resumes from what was recorded
	}
	if errors.Is(err, errNotRecorded) {
		// Nothing was done; the next pass (the database's return starts one) tries again.
		n.log.Warn("lifecycle step waits for the database", "sandbox", sb.ID, "step", a.Step, "err", err)
		return false
	}
	if err != nil {
		n.log.Error("lifecycle step failed", "sandbox", sb.ID, "step", a.Step, "from", sb.State, "to", sb.DesiredState, "err", err)
	}
	return true
}

// errNotRecorded is what a step returns when it could not record the transition it
// was about to make (the database was away): it did nothing, and the sandbox waits for
// the next pass.
var errNotRecorded = errors.New("the transition could not be recorded; nothing was done")

// record records a transition before the node acts on it (write-ahead: recovery reads
// the recorded transition against what the host shows). Unlike report, it fails when
// the record does not land (errNotRecorded), and then the step must not act: a row that
// still shows the state before the transition, beside a host that shows the one after,
// misleads the planner (a sandbox woken while PostgreSQL restarted, still recorded
// suspended, had no snapshot any more and was taken for one that lost its memory).
func (n *Node) record(ctx context.Context, sb *store.Sandbox, o store.Observed) (*store.Sandbox, error) {
	got, err := n.st.ReportObserved(context.WithoutCancel(ctx), sb.ID, n.cfg.ID, o)
	if err != nil {
		return sb, fmt.Errorf("%w: %s: %w", errNotRecorded, o.Transition, err)
	}
	return got, nil
}

// report records observed state, logging failures (the next resync retries).
func (n *Node) report(ctx context.Context, sb *store.Sandbox, o store.Observed) *store.Sandbox {
	got, err := n.st.ReportObserved(context.WithoutCancel(ctx), sb.ID, n.cfg.ID, o)
	if err != nil {
		n.log.Warn("report observed state", "sandbox", sb.ID, "err", err)
		return sb
	}
	return got
}

// progress updates the message of the sandbox's open operations.
func (n *Node) progress(ctx context.Context, sb *store.Sandbox, msg string) {
	_ = n.st.ProgressSandboxOperations(context.WithoutCancel(ctx), sb.ID, sb.Generation, msg)
}

// finishOps completes the sandbox's open operations up to its generation, as the
// state machine says (lifecycle.Finish): those that asked for the state it reached
// succeed (or fail with failErr), others are superseded. note says what the outcome
// cost the user, if anything.
func (n *Node) finishOps(ctx context.Context, sb *store.Sandbox, failErr error, note string) {
	ctx = context.WithoutCancel(ctx)
	marks := n.marks.take(sb.ID)
	ops, err := n.st.OpenOperations(ctx, sb.ID)
	if err != nil {
		n.log.Warn("list operations", "sandbox", sb.ID, "err", err)
		return
	}
	for _, op := range ops {
		if op.TargetGeneration > sb.Generation {
			continue
		}
		o := lifecycle.Finish(op.Kind, sb.DesiredState, failErr, note)
		if err := n.st.UpdateOperation(ctx, op.ID, o.State, o.Message, o.Error, marks...); err != nil {
			n.log.Warn("finish operation", "op", op.ID, "err", err)
			continue
		}
		if fn := n.opDone.Load(); fn != nil {
			(*fn)(op.ID)
		}
		n.cfg.Metrics.Observe(op.Kind, o.State, time.Since(op.CreatedAt))
	}
}

// lossError is the sandbox error that records a loss: when and what.
func lossError(note string) string {
	if note == "" {
		return ""
	}
	return time.Now().UTC().Format(time.RFC3339) + ": " + note
}

// settle reports the planner's state at the sandbox's generation and finishes its
// operations: they fail with a.Error, or succeed (saying what a.Note lost).
func (n *Node) settle(ctx context.Context, sb *store.Sandbox, a lifecycle.Action) {
	errMsg := a.Error
	if a.Note != "" {
		errMsg = joinNonEmpty(lossError(a.Note), errMsg)
	}
	if errMsg == "" && a.State == sb.State {
		errMsg = sb.Error // keep what the sandbox says already
	}
	sb = n.report(ctx, sb, store.Observed{State: a.State, ObservedGeneration: sb.Generation, Error: errMsg})
	var failErr error
	if a.Error != "" {
		failErr = errors.New(a.Error)
	}
	n.finishOps(ctx, sb, failErr, a.Note)
}

// resolve reports what an interrupted transition (or a lost instance) left, without
// acting on the intent: the next plan does. What no longer belongs to that state (a
// leftover instance of a stopped or suspended sandbox) is removed.
func (n *Node) resolve(ctx context.Context, sb *store.Sandbox, a lifecycle.Action) {
	if a.State == api.StateStopped || a.State == api.StateSuspended {
		n.dropAgent(sb.ID)
		_ = n.rt.Destroy(ctx, sb.ID)
	}
	errMsg := sb.Error
	if a.Note != "" {
		errMsg = lossError(a.Note)
		n.log.Warn("sandbox lost state", "sandbox", sb.ID, "now", a.State, "why", a.Note)
	}
	n.log.Info("resolved interrupted transition", "sandbox", sb.ID, "was", sb.State, "now", a.State)
	gen := sb.ObservedGeneration
	if a.State == sb.DesiredState {
		gen = sb.Generation
	}
	sb = n.report(ctx, sb, store.Observed{State: a.State, ObservedGeneration: gen, Error: errMsg})
	if a.State == sb.DesiredState {
		n.finishOps(ctx, sb, nil, a.Note)
	}
}

func joinNonEmpty(a, b string) string {
	switch {
	case a == "":
		return b
	case b == "":
		return a
	default:
		return a + "; " + b
	}
}
