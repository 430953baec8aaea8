package lifecycle

import (
	"github.com/spacedev/space/api"
)

// Instance is what the runtime reports about a sandbox's instance on its node.
type Instance string

// Instance facts.
const (
	NoInstance      Instance = ""        // the runtime knows no instance
	InstanceRunning Instance = "running" // running (its agent may still be quiesced)
	InstancePaused  Instance = "paused"  // vCPUs frozen, memory resident
	InstanceStopped Instance = "stopped" // exists but not running (crashed, or halfway made)
)

// Facts is what a node observes about one of its sandboxes: the row it reads from the
// database and what it finds on its host.
type Facts struct {
	State              string
	Desired            string
	Generation         int64
	ObservedGeneration int64
	// Transition is what the node recorded it was doing (TNone when resting).
	Transition Transition
	// CloneOf and CloneReady describe a clone: its source and whether the source has
	// prepared its memory image and disk.
	CloneOf    string
	CloneReady bool
	// PendingClones: clones of this sandbox wait for it to prepare their snapshot.
	PendingClones bool
	// PendingSnapshots: named snapshots of this sandbox wait to be taken.
	PendingSnapshots bool
	// NeedsIdentity: a claimed warm-pool member that has not received its owner's
	// identity yet.
	NeedsIdentity bool
	// Parked: a warm-pool member nobody has claimed. It is recorded paused, and on a
	// runtime that parks members running (runtime.Caps.ParkRunning) its instance runs.
	Parked bool
	// OpenOps: operations the sandbox's observed generation has reached are still
	// open (a crash came between the report of a state and their completion).
	OpenOps bool

	Instance Instance
	// Checkpoint: a complete suspend checkpoint (memory image) of the sandbox exists.
	Checkpoint bool
	// CloneCheckpoint: a complete checkpoint left by an interrupted clone preparation
	// exists (the source's memory at that moment).
	CloneCheckpoint bool
	// Disk: the sandbox's disk exists.
	Disk bool
}

// Step is one thing a node does to a sandbox.
type Step string

// Steps.
const (
	// Nothing: the sandbox is where it should be (or its last attempt failed and it
	// waits for a new request).
	Nothing Step = "nothing"
	// Create makes the disk from the template and starts the sandbox. Only for a
	// sandbox no user has had yet: it first removes what an interrupted attempt left.
	Create Step = "create"
	// WaitClone: a clone whose source has not prepared its snapshot yet (wake the source).
	WaitClone Step = "wait-clone"
	// StartClone restores a clone from the memory image and disk its source prepared.
	StartClone Step = "start-clone"
	// PrepareClones checkpoints the sandbox once for its pending clones and restores it.
	PrepareClones Step = "prepare-clones"
	// TakeSnapshots checkpoints the sandbox once for its pending named snapshots (as
	// PrepareClones does) and keeps its memory and disk as each snapshot's files.
	TakeSnapshots Step = "take-snapshots"
	Pause         Step = "pause"
	Resume        Step = "resume"
	Suspend       Step = "suspend"
	Restore       Step = "restore"
	Stop          Step = "stop"
	Start         Step = "start"
	Delete        Step = "delete"
	// Adopt: an instance survived an interrupted transition (or a restart). Make sure
	// its agent serves with a current identity (resuming it if it is still quiesced),
	// bring the instance to Action.State (pausing or unpausing it), then report it. If the agent cannot be brought back, the node reports
	// the instance lost and plans again.
	Adopt Step = "adopt"
	// RestoreLeft restores a running sandbox whose instance vanished from the complete
	// checkpoint an interrupted clone preparation left (its memory at that moment).
	RestoreLeft Step = "restore-left"
	// Reboot boots a sandbox that should run but lost its instance from its disk. Its
	// memory and processes are lost; Action.Note says so.
	Reboot Step = "reboot"
	// Settle reports Action.State at the sandbox's generation and finishes its open
	// operations (failing them with Action.Error when it is set). Action.Note, when
	// set, records what the sandbox lost.
	Settle Step = "settle"
	// FinishOps completes the operations a settled sandbox reached but did not
	// complete: they succeed if the sandbox is where they asked it to be, else fail
	// with what the sandbox says.
	FinishOps Step = "finish-ops"
	// Resolve reports Action.State without acting on the sandbox's intent (an
	// interrupted transition is resolved to what the host shows; the next plan acts on
	// the intent). Action.Note, when set, records what the sandbox lost.
	Resolve Step = "resolve"
)

// Action is the planner's answer: one step and what to report with it.
type Action struct {
	Step  Step
	State string // the state to report (Settle, Resolve, Adopt)
	// Error fails the sandbox's open operations with this reason (Settle).
	Error string
	// Note says what the sandbox lost (memory, processes) and why; the node records it
	// in the sandbox's error with the time, and in the operations it completes.
	Note string
}

// Loss notes.
const (
	LostInstance   = "its memory and processes were lost: its instance vanished (host reboot, runtime crash or kill)"
	LostCheckpoint = "its memory was lost: its instance stopped before the checkpoint was complete"
	LostSnapshot   = "its memory was lost: its suspend snapshot is missing"
)

// Plan returns the next step for a sandbox, given what its node observes. It is pure:
// the node executes the step, observes again and plans again until Nothing.
func Plan(f Facts) Action {
	if f.State == api.StateDeleted {
		return Action{Step: Nothing}
	}
	if f.Desired == api.StateDeleted {
		return Action{Step: Delete}
	}
	if a, ok := recoverInBetween(f); ok {
		return a
	}
	if a, ok := checkResting(f); ok {
		return a
	}
	settled := f.ObservedGeneration >= f.Generation
	if f.State == api.StateFailed {
		if settled && f.OpenOps {
			return Action{Step: FinishOps}
		}
		return Action{Step: Nothing}
	}
	// A source prepares its pending clones first, whatever its desired state.
	if f.PendingClones && (f.State == api.StateRunning || f.State == api.StatePaused || f.State == api.StateSuspended) {
		return Action{Step: PrepareClones}
	}
	// Then its pending named snapshots (a stopped source has no memory: its node
	// fails them).
	if f.PendingSnapshots && (f.State == api.StateRunning || f.State == api.StatePaused || f.State == api.StateSuspended) {
		return Action{Step: TakeSnapshots}
	}
	if f.State == f.Desired {
		if !settled {
			return Action{Step: Settle, State: f.State}
		}
		if f.OpenOps {
			return Action{Step: FinishOps}
		}
		return Action{Step: Nothing}
	}
	if settled {
		if f.OpenOps {
			return Action{Step: FinishOps}
		}
		return Action{Step: Nothing} // the last attempt at this intent failed; wait for a new one
	}
	switch {
	case f.Desired == api.StatePaused && f.State == api.StateRunning:
		return Action{Step: Pause}
	case f.Desired == api.StateRunning && f.State == api.StatePaused:
		return Action{Step: Resume}
	case f.Desired == api.StateSuspended && (f.State == api.StateRunning || f.State == api.StatePaused):
		return Action{Step: Suspend}
	case f.Desired == api.StateRunning && f.State == api.StateSuspended:
		return Action{Step: Restore}
	case f.Desired == api.StateStopped && (f.State == api.StateRunning || f.State == api.StatePaused || f.State == api.StateSuspended):
		return Action{Step: Stop}
	case f.Desired == api.StateRunning && f.State == api.StateStopped:
		return Action{Step: Start}
	case f.State == api.StateStopped && (f.Desired == api.StateSuspended || f.Desired == api.StatePaused):
		// E.g. a crash during a suspend lost the memory: the sandbox is stopped now and
		// cannot become suspended. Settle the intent as failed; the state is what it is.
		return Action{Step: Settle, State: api.StateStopped,
			Error: "its memory was lost: the sandbox stopped before its memory could be saved; its disk is kept (start or wake it)"}
	default:
		return Action{Step: Settle, State: f.State, Error: "cannot go from " + f.State + " to " + f.Desired}
	}
}

// recoverInBetween answers a sandbox found pending or in an in-between state: a new
// sandbox is made; an interrupted transition is resumed or resolved to what the host
// shows. User data (the disk, a complete checkpoint) is never removed here.
func recoverInBetween(f Facts) (Action, bool) {
	t, err := TransitionOf(f.State, f.Transition)
	if err != nil {
		t = TNone
	}
	switch f.State {
	case api.StatePending:
		if f.CloneOf != "" {
			if !f.CloneReady {
				return Action{Step: WaitClone}, true
			}
			return Action{Step: StartClone}, true
		}
		return Action{Step: Create}, true
	case api.StateCreating:
		if t == TClone || f.CloneOf != "" {
			if f.Instance == InstanceRunning || f.Instance == InstancePaused {
				return Action{Step: Adopt, State: createdState(f)}, true
			}
			if !f.CloneReady {
				return Action{Step: WaitClone}, true
			}
			return Action{Step: StartClone}, true
		}
		// A create that did not finish: nobody has used the sandbox yet, so it is made
		// again from the template.
		return Action{Step: Create}, true
	case api.StateStarting:
		switch {
		case f.Instance == InstanceRunning || f.Instance == InstancePaused:
			return Action{Step: Adopt, State: api.StateRunning}, true
		case f.Disk:
			return Action{Step: Start}, true
		default:
			return Action{Step: Settle, State: api.StateFailed, Error: "the sandbox's disk is missing"}, true
		}
	case api.StatePausing:
		switch f.Instance {
		case InstancePaused:
			return Action{Step: Resolve, State: api.StatePaused}, true
		case InstanceRunning:
			return Action{Step: Adopt, State: api.StateRunning}, true
		default:
			return lost(f, LostInstance), true
		}
	case api.StateResuming:
		switch f.Instance {
		case InstancePaused:
			return Action{Step: Resolve, State: api.StatePaused}, true
		case InstanceRunning:
			return Action{Step: Adopt, State: api.StateRunning}, true
		default:
			return lost(f, LostInstance), true
		}
	case api.StateSuspending:
		switch {
		case f.Checkpoint:
			return Action{Step: Resolve, State: api.StateSuspended}, true
		case f.Instance == InstanceRunning:
			// The checkpoint did not complete; the agent may be quiesced: resume it.
			return Action{Step: Adopt, State: api.StateRunning}, true
		case f.Instance == InstancePaused:
			return Action{Step: Resolve, State: api.StatePaused}, true
		default:
			return lost(f, LostCheckpoint), true
		}
	case api.StateRestoring:
		switch {
		case f.Instance == InstanceRunning || f.Instance == InstancePaused:
			// The restore ran; its agent may wait for its identity still.
			return Action{Step: Adopt, State: api.StateRunning}, true
		case f.Checkpoint:
			return Action{Step: Restore}, true
		case f.Desired == api.StateRunning && f.Disk:
			return Action{Step: Reboot, Note: LostSnapshot}, true
		default:
			return lost(f, LostSnapshot), true
		}
	case api.StateStopping:
		return Action{Step: Stop}, true
	case api.StateDeleting:
		// Deletions are not taken back (desired deleted is handled above): a sandbox
		// found deleting with another intent is broken, not deleted behind its back.
		return Action{Step: Settle, State: api.StateFailed, Error: "a deletion of this sandbox was interrupted"}, true
	}
	return Action{}, false
}

// createdState is the state a finished create or clone reports: a warm-pool member
// (desired paused) is parked paused.
func createdState(f Facts) string {
	if f.Desired == api.StatePaused {
		return api.StatePaused
	}
	return api.StateRunning
}

// lost resolves a sandbox whose memory is gone to what is left: its disk (stopped),
// or nothing (failed). A sandbox that should run is booted again from its disk.
func lost(f Facts, note string) Action {
	if !f.Disk {
		return Action{Step: Settle, State: api.StateFailed, Error: "the sandbox's disk is missing", Note: note}
	}
	if f.Desired == api.StateRunning {
		return Action{Step: Reboot, Note: note}
	}
	return Action{Step: Resolve, State: api.StateStopped, Note: note}
}

// checkResting compares a resting sandbox with its instance: one that should have an
// instance and has none lost its memory; a source interrupted while checkpointing for
// its clones is brought back from that checkpoint.
func checkResting(f Facts) (Action, bool) {
	switch f.State {
	case api.StateRunning, api.StatePaused:
		if f.Instance == InstanceRunning || f.Instance == InstancePaused {
			if f.Transition == TCloneSource {
				// Interrupted while checkpointing for clones: the agent may be quiesced,
				// the instance paused for the checkpoint. It goes back to the state it
				// rests in.
				return Action{Step: Adopt, State: f.State}, true
			}
			// A warm-pool member parked running is paused for all but its runtime, until
			// its claim's resume has given it its owner's identity.
			parkedRunning := f.State == api.StatePaused && (f.Parked || f.NeedsIdentity)
			if s := instanceState(f.Instance); s != f.State && !parkedRunning {
				return Action{Step: Resolve, State: s}, true
			}
			return Action{}, false
		}
		if f.CloneCheckpoint {
			return Action{Step: RestoreLeft}, true
		}
		if f.Desired == api.StateStopped && f.State == api.StateRunning && f.ObservedGeneration < f.Generation {
			return Action{}, false // being stopped anyway: Stop clears what is left
		}
		return lost(f, LostInstance), true
	case api.StateSuspended:
		if !f.Checkpoint {
			return lost(f, LostSnapshot), true
		}
	case api.StateStopped:
		if !f.Disk {
			return Action{Step: Settle, State: api.StateFailed, Error: "the sandbox's disk is missing"}, true
		}
	}
	return Action{}, false
}

func instanceState(i Instance) string {
	if i == InstancePaused {
		return api.StatePaused
	}
	return api.StateRunning
}
