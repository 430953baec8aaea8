// Package lifecycle owns the sandbox state machine: the states a sandbox is observed in,
// the verbs that change what it should be, which verb is legal from which state, which
// operations a state completes, and the planner that turns what is observed (the
// sandbox row and the host's facts) into the next step a node takes.
//
// It does no I/O. The API asks it whether a verb is legal, the controller which
// sandboxes a rule applies to, the store which desired states revoke tokens, and the
// node what to do next; nothing else encodes a transition. Recovery after a crash is
// the planner's answer to an observed in-between state: every in-between state names
// its transition (Transition), so a start is never mistaken for a create nor a restore
// for a boot, and no answer deletes or replaces a disk, snapshot or journal that holds
// user data unless the sandbox is being deleted.
package lifecycle

import (
	"fmt"
	"slices"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
)

// Resting states: a sandbox stays in them until something asks for a change.
var resting = []string{api.StateRunning, api.StatePaused, api.StateSuspended, api.StateStopped, api.StateFailed, api.StateDeleted}

// Desired states a verb can ask for.
var desirable = []string{api.StateRunning, api.StatePaused, api.StateSuspended, api.StateStopped, api.StateDeleted}

// IsResting reports whether state is a resting state (not pending or in-between).
func IsResting(state string) bool { return slices.Contains(resting, state) }

// IsDesirable reports whether state can be a desired state.
func IsDesirable(state string) bool { return slices.Contains(desirable, state) }

// States lists every observed state, in the order a sandbox meets them.
func States() []string {
	return []string{api.StatePending, api.StateCreating, api.StateStarting, api.StateRunning, api.StatePausing,
		api.StatePaused, api.StateResuming, api.StateSuspending, api.StateSuspended, api.StateRestoring,
		api.StateStopping, api.StateStopped, api.StateDeleting, api.StateDeleted, api.StateFailed}
}

// IsState reports whether s is an observed state.
func IsState(s string) bool { return slices.Contains(States(), s) }

// Verb is a lifecycle request: the desired state it records and the observed states it
// may start from.
type Verb struct {
	Kind    string
	Desired string
	From    []string
}

var verbs = map[string]Verb{
	api.OpPause:   {api.OpPause, api.StatePaused, []string{api.StateRunning}},
	api.OpResume:  {api.OpResume, api.StateRunning, []string{api.StatePaused}},
	api.OpSuspend: {api.OpSuspend, api.StateSuspended, []string{api.StateRunning, api.StatePaused}},
	api.OpRestore: {api.OpRestore, api.StateRunning, []string{api.StateSuspended}},
	api.OpStop:    {api.OpStop, api.StateStopped, []string{api.StateRunning, api.StatePaused, api.StateSuspended}},
	api.OpStart:   {api.OpStart, api.StateRunning, []string{api.StateStopped}},
	api.OpWake:    {api.OpWake, api.StateRunning, []string{api.StatePaused, api.StateSuspended, api.StateStopped, api.StateRunning}},
	// Clone keeps the source's desired state; the source must have memory to copy.
	api.OpClone: {api.OpClone, "", []string{api.StateRunning, api.StatePaused, api.StateSuspended}},
}

// snapshotVerb is the taking of a named snapshot: like a clone, it keeps the source's
// desired state and needs its memory. It is not a VerbOf: it records no intent on
// the sandbox (the snapshot row is the request, see Facts.PendingSnapshots).
var snapshotVerb = Verb{api.OpSnapshot, "", []string{api.StateRunning, api.StatePaused, api.StateSuspended}}

// SnapshotVerb returns the verb a named snapshot asks of its source (for Check).
func SnapshotVerb() Verb { return snapshotVerb }

// VerbOf returns the verb of an operation kind that changes a sandbox's state
// (pause, resume, suspend, restore, stop, start, wake, clone).
func VerbOf(kind string) (Verb, bool) {
	v, ok := verbs[kind]
	return v, ok
}

// Verbs lists the kinds VerbOf knows, sorted.
func Verbs() []string {
	out := make([]string, 0, len(verbs))
	for k := range verbs {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

// Sandbox is what the state machine needs to know about a sandbox row.
type Sandbox struct {
	ID                 string
	State              string
	Desired            string
	Generation         int64
	ObservedGeneration int64
	Deleted            bool
	Error              string
}

// Settled reports whether the node has acted on the sandbox's latest intent (no
// transition in flight). A failed attempt is settled too: its state is what the node
// reported.
func (s Sandbox) Settled() bool { return s.ObservedGeneration >= s.Generation }

// InFlightRetry is the Retry-After of a verb refused because a transition is in flight:
// transitions take from tens of milliseconds to a few seconds.
const InFlightRetry = time.Second

// Check explains, as a fault.Conflict, why verb v cannot be asked of sb now; nil when
// it can. A conflict with a transition in flight passes on its own (fault.Later).
func Check(sb Sandbox, v Verb) error {
	if sb.Deleted || sb.Desired == api.StateDeleted {
		return fault.New(fault.Conflict, "sandbox %s is deleted; it cannot %s", sb.ID, v.Kind)
	}
	if sb.State == api.StateFailed {
		return fault.New(fault.Conflict, "sandbox %s failed (%s); delete it", sb.ID, sb.Error)
	}
	if !sb.Settled() {
		return fault.Later(fault.New(fault.Conflict, "sandbox %s is %s (desired %s); wait for that to finish", sb.ID, sb.State, sb.Desired), InFlightRetry)
	}
	if !slices.Contains(v.From, sb.State) {
		if v.Kind == api.OpClone && sb.State == api.StateStopped {
			return fault.New(fault.Conflict, "cannot clone sandbox %s: it is stopped, so it has no memory to clone; start it first", sb.ID)
		}
		if v.Kind == api.OpSnapshot && sb.State == api.StateStopped {
			return fault.New(fault.Conflict, "cannot snapshot sandbox %s: it is stopped, so it has no memory to capture; start it first", sb.ID)
		}
		return fault.New(fault.Conflict, "cannot %s a sandbox that is %s", v.Kind, sb.State)
	}
	return nil
}

// AlreadyThere reports whether verb v asks for the state sb is already in (a wake of a
// running sandbox): the verb's operation is done at once.
func AlreadyThere(sb Sandbox, v Verb) bool { return v.Desired != "" && sb.State == v.Desired }

// NeedsWake reports whether a sandbox rests in a state that a wake would leave (a
// request that needs it running wakes it first).
func NeedsWake(desired string) bool {
	return desired == api.StatePaused || desired == api.StateSuspended || desired == api.StateStopped
}

// RevokesTokens reports whether asking for desired ends every attachment token issued
// so far: the sandbox's processes stop being reachable (deleted, suspended, stopped).
func RevokesTokens(desired string) bool {
	return desired == api.StateDeleted || desired == api.StateSuspended || desired == api.StateStopped
}

// completes lists the operation kinds that a sandbox reaching each desired state
// completes.
var completes = map[string][]string{
	api.StateRunning:   {api.OpCreate, api.OpResume, api.OpRestore, api.OpStart, api.OpWake, api.OpClone},
	api.StatePaused:    {api.OpPause, api.OpCreate},
	api.StateSuspended: {api.OpSuspend},
	api.StateStopped:   {api.OpStop},
	api.StateDeleted:   {api.OpDelete},
}

// Completes reports whether a sandbox that reached desired completes an operation of
// kind (a create completes when a warm-pool member is parked paused, too).
func Completes(desired, kind string) bool { return slices.Contains(completes[desired], kind) }

// Outcome is how an open operation ends once the node has acted on its generation.
type Outcome struct {
	State   string // api.OpSucceeded or api.OpFailed
	Message string
	Error   string
}

// Finish returns the outcome of an open operation of kind when the node settled the
// sandbox at desired: success, or failure with failErr, or "superseded" when a later
// request asked for something else. note, when not empty, says what the outcome cost
// the user (e.g. memory lost) and becomes part of the message of a success.
func Finish(kind, desired string, failErr error, note string) Outcome {
	switch {
	case !Completes(desired, kind):
		return Outcome{api.OpFailed, "superseded", "superseded by a later request (the sandbox is now to be " + desired + ")"}
	case failErr != nil:
		return Outcome{api.OpFailed, "failed", failErr.Error()}
	case note != "":
		return Outcome{api.OpSucceeded, "done, but " + note, ""}
	default:
		return Outcome{api.OpSucceeded, "done", ""}
	}
}

// Transition names what a node is doing to a sandbox. It is recorded with the
// in-between state (and, for the source of a clone, on the resting state), so that
// after a crash recovery knows which transition to resume or roll back.
type Transition string

// Transitions.
const (
	TNone    Transition = ""
	TCreate  Transition = "create"  // a new disk from the template (or a base snapshot), then start
	TClone   Transition = "clone"   // a clone restored from the memory image its source prepared
	TStart   Transition = "start"   // boot from the sandbox's existing disk
	TPause   Transition = "pause"   // freeze the vCPUs
	TResume  Transition = "resume"  // unfreeze (and, for a claimed pool member, apply its identity)
	TSuspend Transition = "suspend" // checkpoint memory next to the disk, free the instance
	TRestore Transition = "restore" // start from the checkpoint, then a fresh identity
	TStop    Transition = "stop"    // power off, keep the disk
	TDelete  Transition = "delete"  // remove everything
	// TCloneSource marks a source while its memory is checkpointed for its clones: it
	// stays in its resting state, but its instance is stopped and restored meanwhile.
	TCloneSource Transition = "clone-source"
)

// during maps each transition to the in-between state the node reports while doing it.
var during = map[Transition]string{
	TCreate: api.StateCreating, TClone: api.StateCreating, TStart: api.StateStarting,
	TPause: api.StatePausing, TResume: api.StateResuming, TSuspend: api.StateSuspending,
	TRestore: api.StateRestoring, TStop: api.StateStopping, TDelete: api.StateDeleting,
}

// During returns the in-between state reported while t is in progress ("" for a
// transition that keeps the resting state, like TCloneSource).
func During(t Transition) string { return during[t] }

// TransitionOf returns the transition that an in-between state belongs to, using the
// recorded transition when there is one (creating is a create or a clone).
func TransitionOf(state string, recorded Transition) (Transition, error) {
	if recorded != TNone {
		if d := during[recorded]; d != "" && d != state {
			return TNone, fmt.Errorf("recorded transition %s does not match state %s", recorded, state)
		}
		return recorded, nil
	}
	for t, d := range during {
		if d == state && t != TClone {
			return t, nil
		}
	}
	return TNone, nil
}
