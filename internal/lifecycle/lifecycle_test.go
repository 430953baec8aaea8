package lifecycle

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
)

// TestCheckEveryStateAndVerb is the verb table: for every settled state and every verb,
// whether the API accepts it.
func TestCheckEveryStateAndVerb(t *testing.T) {
	legal := map[string][]string{ // verb -> states it may start from
		api.OpPause:   {api.StateRunning},
		api.OpResume:  {api.StatePaused},
		api.OpSuspend: {api.StateRunning, api.StatePaused},
		api.OpRestore: {api.StateSuspended},
		api.OpStop:    {api.StateRunning, api.StatePaused, api.StateSuspended},
		api.OpStart:   {api.StateStopped},
		api.OpWake:    {api.StatePaused, api.StateSuspended, api.StateStopped, api.StateRunning},
		api.OpClone:   {api.StateRunning, api.StatePaused, api.StateSuspended},
	}
	if got := Verbs(); !slices.Equal(got, sortedKeys(legal)) {
		t.Fatalf("Verbs() = %v, want %v", got, sortedKeys(legal))
	}
	for _, kind := range Verbs() {
		v, _ := VerbOf(kind)
		for _, state := range States() {
			sb := Sandbox{ID: "sb", State: state, Desired: state, Generation: 3, ObservedGeneration: 3}
			if !IsDesirable(state) {
				sb.Desired = api.StateRunning
			}
			err := Check(sb, v)
			want := slices.Contains(legal[kind], state)
			if state == api.StateDeleted {
				sb.Deleted = true
			}
			if (err == nil) != want {
				t.Errorf("%s from %s: err=%v, want legal=%v", kind, state, err, want)
			}
			if err != nil && !fault.Is(err, fault.Conflict) {
				t.Errorf("%s from %s: %v is not a conflict", kind, state, err)
			}
			// In flight (observed generation behind): nothing is legal.
			sb.ObservedGeneration = 2
			if err := Check(sb, v); err == nil {
				t.Errorf("%s from %s in flight: accepted", kind, state)
			}
			// Deleted or being deleted: nothing is legal.
			sb.ObservedGeneration, sb.Desired = 3, api.StateDeleted
			if err := Check(sb, v); err == nil || !strings.Contains(err.Error(), "deleted") {
				t.Errorf("%s of a deleted sandbox from %s: %v", kind, state, err)
			}
		}
	}
	if _, ok := VerbOf("explode"); ok {
		t.Fatal("unknown verb known")
	}
}

func sortedKeys[V any](m map[string]V) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

func TestCheckMessages(t *testing.T) {
	clone, _ := VerbOf(api.OpClone)
	err := Check(Sandbox{ID: "x", State: api.StateStopped, Desired: api.StateStopped, Generation: 1, ObservedGeneration: 1}, clone)
	if err == nil || !strings.Contains(err.Error(), "no memory to clone") {
		t.Fatalf("clone of stopped: %v", err)
	}
	if fault.RetryAfterOf(err) != 0 {
		t.Error("a clone of a stopped sandbox says it passes on its own")
	}
	pause, _ := VerbOf(api.OpPause)
	err = Check(Sandbox{ID: "x", State: api.StateFailed, Desired: api.StateRunning, Error: "boom", Generation: 1, ObservedGeneration: 1}, pause)
	if err == nil || !strings.Contains(err.Error(), "boom") {
		t.Fatalf("pause of failed: %v", err)
	}
	// A transition in flight: a conflict that passes on its own.
	err = Check(Sandbox{ID: "x", State: api.StateSuspending, Desired: api.StateSuspended, Generation: 2, ObservedGeneration: 1}, clone)
	if !fault.Is(err, fault.Conflict) || !strings.Contains(err.Error(), "wait for that to finish") || fault.RetryAfterOf(err) != InFlightRetry {
		t.Fatalf("clone during a suspend: %v (retry after %v)", err, fault.RetryAfterOf(err))
	}
	wake, _ := VerbOf(api.OpWake)
	if !AlreadyThere(Sandbox{State: api.StateRunning}, wake) || AlreadyThere(Sandbox{State: api.StatePaused}, wake) {
		t.Fatal("AlreadyThere")
	}
	if AlreadyThere(Sandbox{State: api.StateRunning}, clone) {
		t.Fatal("clone is never already there")
	}
}

func TestFinishEveryKindAndDesired(t *testing.T) {
	kinds := []string{api.OpCreate, api.OpDelete, api.OpStart, api.OpStop, api.OpPause, api.OpResume,
		api.OpSuspend, api.OpRestore, api.OpWake, api.OpClone}
	for _, desired := range desirable {
		for _, kind := range kinds {
			for _, failErr := range []error{nil, errors.New("disk on fire")} {
				o := Finish(kind, desired, failErr, "")
				switch {
				case !Completes(desired, kind):
					if o.State != api.OpFailed || o.Message != "superseded" {
						t.Errorf("%s at %s: %+v, want superseded", kind, desired, o)
					}
				case failErr != nil:
					if o.State != api.OpFailed || o.Error != "disk on fire" {
						t.Errorf("%s at %s failing: %+v", kind, desired, o)
					}
				default:
					if o.State != api.OpSucceeded {
						t.Errorf("%s at %s: %+v", kind, desired, o)
					}
				}
			}
		}
	}
	o := Finish(api.OpWake, api.StateRunning, nil, LostSnapshot)
	if o.State != api.OpSucceeded || !strings.Contains(o.Message, "memory was lost") {
		t.Fatalf("a success that cost memory must say so: %+v", o)
	}
}

func TestRevokesAndWakes(t *testing.T) {
	for _, d := range desirable {
		want := d == api.StateDeleted || d == api.StateSuspended || d == api.StateStopped
		if RevokesTokens(d) != want {
			t.Errorf("RevokesTokens(%s)", d)
		}
		if NeedsWake(d) != (d == api.StatePaused || d == api.StateSuspended || d == api.StateStopped) {
			t.Errorf("NeedsWake(%s)", d)
		}
	}
}

func TestTransitionOf(t *testing.T) {
	for tr, st := range during {
		got, err := TransitionOf(st, tr)
		if err != nil || got != tr {
			t.Errorf("TransitionOf(%s, %s) = %s, %v", st, tr, got, err)
		}
		if During(tr) != st {
			t.Errorf("During(%s) = %s", tr, During(tr))
		}
	}
	if got, _ := TransitionOf(api.StateStarting, TNone); got != TStart {
		t.Errorf("starting without a record is a start, got %s", got)
	}
	if got, _ := TransitionOf(api.StateCreating, TNone); got != TCreate {
		t.Errorf("creating without a record is a create, got %s", got)
	}
	if _, err := TransitionOf(api.StateStarting, TCreate); err == nil {
		t.Error("a create recorded with state starting must be refused")
	}
	if got, _ := TransitionOf(api.StateRunning, TCloneSource); got != TCloneSource {
		t.Errorf("clone source: %s", got)
	}
	for _, s := range States() {
		inBetween := s == api.StatePending
		for _, d := range during {
			inBetween = inBetween || d == s
		}
		if IsResting(s) == inBetween {
			t.Errorf("IsResting(%s) = %v", s, IsResting(s))
		}
	}
	if IsState("bogus") || !IsState(api.StateStarting) {
		t.Error("IsState")
	}
}

// TestPlanTable is the planner's spec, case by case.
func TestPlanTable(t *testing.T) {
	const (
		R  = api.StateRunning
		P  = api.StatePaused
		S  = api.StateSuspended
		St = api.StateStopped
		D  = api.StateDeleted
	)
	cases := []struct {
		name string
		f    Facts
		want Action
	}{
		{"new sandbox", Facts{State: api.StatePending, Desired: R, Generation: 1}, Action{Step: Create}},
		{"new clone, source not ready", Facts{State: api.StatePending, Desired: R, CloneOf: "src", Generation: 1}, Action{Step: WaitClone}},
		{"new clone, ready", Facts{State: api.StatePending, Desired: R, CloneOf: "src", CloneReady: true, Generation: 1}, Action{Step: StartClone}},
		{"interrupted create is made again", Facts{State: api.StateCreating, Transition: TCreate, Desired: R, Generation: 1, Instance: InstanceRunning, Disk: true}, Action{Step: Create}},
		{"interrupted clone that runs is adopted", Facts{State: api.StateCreating, Transition: TClone, CloneOf: "src", CloneReady: true, Desired: R, Generation: 1, Instance: InstanceRunning, Disk: true}, Action{Step: Adopt, State: R}},
		{"interrupted clone restores again", Facts{State: api.StateCreating, Transition: TClone, CloneOf: "src", CloneReady: true, Desired: R, Generation: 1, Disk: true}, Action{Step: StartClone}},
		{"pool member created", Facts{State: api.StateCreating, CloneOf: "src", CloneReady: true, Desired: P, Generation: 1, Instance: InstanceRunning}, Action{Step: Adopt, State: P}},
		// A start is never mistaken for a create: its disk is never remade.
		{"interrupted start, instance up", Facts{State: api.StateStarting, Transition: TStart, Desired: R, Generation: 4, ObservedGeneration: 3, Instance: InstanceRunning, Disk: true}, Action{Step: Adopt, State: R}},
		{"interrupted start, no instance", Facts{State: api.StateStarting, Transition: TStart, Desired: R, Generation: 4, ObservedGeneration: 3, Disk: true}, Action{Step: Start}},
		{"interrupted start, no disk", Facts{State: api.StateStarting, Desired: R, Generation: 4, ObservedGeneration: 3}, Action{Step: Settle, State: api.StateFailed, Error: "the sandbox's disk is missing"}},
		{"interrupted pause, paused", Facts{State: api.StatePausing, Desired: P, Generation: 2, ObservedGeneration: 1, Instance: InstancePaused, Disk: true}, Action{Step: Resolve, State: P}},
		{"interrupted pause, running", Facts{State: api.StatePausing, Desired: P, Generation: 2, ObservedGeneration: 1, Instance: InstanceRunning, Disk: true}, Action{Step: Adopt, State: R}},
		{"interrupted pause, gone", Facts{State: api.StatePausing, Desired: P, Generation: 2, ObservedGeneration: 1, Disk: true}, Action{Step: Resolve, State: St, Note: LostInstance}},
		{"interrupted resume, running", Facts{State: api.StateResuming, Desired: R, Generation: 2, ObservedGeneration: 1, Instance: InstanceRunning, NeedsIdentity: true}, Action{Step: Adopt, State: R}},
		{"interrupted resume, still paused", Facts{State: api.StateResuming, Desired: R, Generation: 2, ObservedGeneration: 1, Instance: InstancePaused}, Action{Step: Resolve, State: P}},
		{"interrupted resume, gone", Facts{State: api.StateResuming, Desired: R, Generation: 2, ObservedGeneration: 1, Disk: true}, Action{Step: Reboot, Note: LostInstance}},
		{"interrupted suspend, checkpoint complete", Facts{State: api.StateSuspending, Desired: S, Generation: 2, ObservedGeneration: 1, Checkpoint: true, Disk: true}, Action{Step: Resolve, State: S}},
		{"interrupted suspend, instance up", Facts{State: api.StateSuspending, Desired: S, Generation: 2, ObservedGeneration: 1, Instance: InstanceRunning, Disk: true}, Action{Step: Adopt, State: R}},
		{"interrupted suspend, gone", Facts{State: api.StateSuspending, Desired: S, Generation: 2, ObservedGeneration: 1, Disk: true}, Action{Step: Resolve, State: St, Note: LostCheckpoint}},
		// A restore that ran is adopted, never rebooted.
		{"interrupted restore, instance up", Facts{State: api.StateRestoring, Desired: R, Generation: 3, ObservedGeneration: 2, Instance: InstanceRunning, Disk: true}, Action{Step: Adopt, State: R}},
		{"interrupted restore, checkpoint", Facts{State: api.StateRestoring, Desired: R, Generation: 3, ObservedGeneration: 2, Checkpoint: true, Disk: true}, Action{Step: Restore}},
		{"interrupted restore, nothing left", Facts{State: api.StateRestoring, Desired: R, Generation: 3, ObservedGeneration: 2, Disk: true}, Action{Step: Reboot, Note: LostSnapshot}},
		{"interrupted stop", Facts{State: api.StateStopping, Desired: St, Generation: 2, ObservedGeneration: 1, Instance: InstanceRunning, Disk: true}, Action{Step: Stop}},
		{"interrupted delete", Facts{State: api.StateDeleting, Desired: D, Generation: 2, ObservedGeneration: 1}, Action{Step: Delete}},
		{"delete wins over everything", Facts{State: api.StateRestoring, Desired: D, Generation: 2, Checkpoint: true, Disk: true}, Action{Step: Delete}},
		{"running as desired", Facts{State: R, Desired: R, Generation: 1, ObservedGeneration: 1, Instance: InstanceRunning, Disk: true}, Action{Step: Nothing}},
		{"wake of running settles", Facts{State: R, Desired: R, Generation: 2, ObservedGeneration: 1, Instance: InstanceRunning, Disk: true}, Action{Step: Settle, State: R}},
		{"running lost its instance", Facts{State: R, Desired: R, Generation: 1, ObservedGeneration: 1, Disk: true}, Action{Step: Reboot, Note: LostInstance}},
		{"running lost instance, clone checkpoint left", Facts{State: R, Desired: R, Generation: 1, ObservedGeneration: 1, CloneCheckpoint: true, Disk: true}, Action{Step: RestoreLeft}},
		{"clone source interrupted, instance up", Facts{State: R, Desired: R, Transition: TCloneSource, Generation: 1, ObservedGeneration: 1, Instance: InstanceRunning, Disk: true}, Action{Step: Adopt, State: R}},
		{"clone source interrupted while paused for its checkpoint", Facts{State: R, Desired: R, Transition: TCloneSource, Generation: 1, ObservedGeneration: 1, Instance: InstancePaused, Disk: true}, Action{Step: Adopt, State: R}},
		{"paused clone source interrupted, instance resumed", Facts{State: P, Desired: P, Transition: TCloneSource, Generation: 1, ObservedGeneration: 1, Instance: InstanceRunning, Disk: true}, Action{Step: Adopt, State: P}},
		{"running lost instance and disk", Facts{State: R, Desired: R, Generation: 1, ObservedGeneration: 1}, Action{Step: Settle, State: api.StateFailed, Error: "the sandbox's disk is missing", Note: LostInstance}},
		{"paused lost its instance", Facts{State: P, Desired: P, Generation: 1, ObservedGeneration: 1, Disk: true}, Action{Step: Resolve, State: St, Note: LostInstance}},
		{"running but paused on host", Facts{State: R, Desired: R, Generation: 1, ObservedGeneration: 1, Instance: InstancePaused, Disk: true}, Action{Step: Resolve, State: P}},
		{"paused but running on host", Facts{State: P, Desired: P, Generation: 1, ObservedGeneration: 1, Instance: InstanceRunning, Disk: true}, Action{Step: Resolve, State: R}},
		// A warm-pool member waits running where the runtime parks members running.
		{"parked member running", Facts{State: P, Desired: P, Generation: 1, ObservedGeneration: 1, Instance: InstanceRunning, Disk: true, Parked: true}, Action{Step: Nothing}},
		{"parked member paused", Facts{State: P, Desired: P, Generation: 1, ObservedGeneration: 1, Instance: InstancePaused, Disk: true, Parked: true}, Action{Step: Nothing}},
		{"parked member lost its instance", Facts{State: P, Desired: P, Generation: 1, ObservedGeneration: 1, Disk: true, Parked: true}, Action{Step: Resolve, State: St, Note: LostInstance}},
		{"claimed parked member resumes", Facts{State: P, Desired: R, Generation: 2, ObservedGeneration: 1, Instance: InstanceRunning, Disk: true, NeedsIdentity: true}, Action{Step: Resume}},
		{"suspended lost its snapshot", Facts{State: S, Desired: S, Generation: 1, ObservedGeneration: 1, Disk: true}, Action{Step: Resolve, State: St, Note: LostSnapshot}},
		{"wake of suspended without snapshot boots", Facts{State: S, Desired: R, Generation: 2, ObservedGeneration: 1, Disk: true}, Action{Step: Reboot, Note: LostSnapshot}},
		{"pending clones first", Facts{State: R, Desired: S, Generation: 2, ObservedGeneration: 1, PendingClones: true, Instance: InstanceRunning, Disk: true}, Action{Step: PrepareClones}},
		{"clones before snapshots", Facts{State: R, Desired: R, Generation: 1, ObservedGeneration: 1, PendingClones: true, PendingSnapshots: true, Instance: InstanceRunning, Disk: true}, Action{Step: PrepareClones}},
		{"pending snapshots of running", Facts{State: R, Desired: S, Generation: 2, ObservedGeneration: 1, PendingSnapshots: true, Instance: InstanceRunning, Disk: true}, Action{Step: TakeSnapshots}},
		{"pending snapshots of paused", Facts{State: P, Desired: P, Generation: 1, ObservedGeneration: 1, PendingSnapshots: true, Instance: InstancePaused, Disk: true}, Action{Step: TakeSnapshots}},
		{"pending snapshots of suspended", Facts{State: S, Desired: S, Generation: 1, ObservedGeneration: 1, PendingSnapshots: true, Checkpoint: true, Disk: true}, Action{Step: TakeSnapshots}},
		{"pending snapshots of stopped wait for the node to fail them", Facts{State: St, Desired: St, Generation: 1, ObservedGeneration: 1, PendingSnapshots: true, Disk: true}, Action{Step: Nothing}},
		{"pending snapshots: recovery first", Facts{State: R, Desired: R, Transition: TCloneSource, Generation: 1, ObservedGeneration: 1, PendingSnapshots: true, CloneCheckpoint: true, Disk: true}, Action{Step: RestoreLeft}},
		{"pending snapshots: delete wins", Facts{State: R, Desired: D, Generation: 2, ObservedGeneration: 1, PendingSnapshots: true, Instance: InstanceRunning, Disk: true}, Action{Step: Delete}},
		{"pause", Facts{State: R, Desired: P, Generation: 2, ObservedGeneration: 1, Instance: InstanceRunning, Disk: true}, Action{Step: Pause}},
		{"resume", Facts{State: P, Desired: R, Generation: 2, ObservedGeneration: 1, Instance: InstancePaused, Disk: true}, Action{Step: Resume}},
		{"suspend", Facts{State: P, Desired: S, Generation: 2, ObservedGeneration: 1, Instance: InstancePaused, Disk: true}, Action{Step: Suspend}},
		{"restore", Facts{State: S, Desired: R, Generation: 2, ObservedGeneration: 1, Checkpoint: true, Disk: true}, Action{Step: Restore}},
		{"stop", Facts{State: S, Desired: St, Generation: 2, ObservedGeneration: 1, Checkpoint: true, Disk: true}, Action{Step: Stop}},
		{"stop of running that lost instance", Facts{State: R, Desired: St, Generation: 2, ObservedGeneration: 1, Disk: true}, Action{Step: Stop}},
		{"start", Facts{State: St, Desired: R, Generation: 2, ObservedGeneration: 1, Disk: true}, Action{Step: Start}},
		{"stopped cannot suspend", Facts{State: St, Desired: S, Generation: 2, ObservedGeneration: 1, Disk: true}, Action{Step: Settle, State: St, Error: "its memory was lost: the sandbox stopped before its memory could be saved; its disk is kept (start or wake it)"}},
		{"failed attempt waits", Facts{State: P, Desired: R, Generation: 2, ObservedGeneration: 2, Instance: InstancePaused, Disk: true}, Action{Step: Nothing}},
		{"failed sandbox waits", Facts{State: api.StateFailed, Desired: R, Generation: 2, ObservedGeneration: 1}, Action{Step: Nothing}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if got := Plan(c.f); got != c.want {
				t.Fatalf("Plan(%+v)\n got %+v\nwant %+v", c.f, got, c.want)
			}
		})
	}
}

// TestPlanNeverTouchesUserData walks every combination of state, desired state,
// transition record and host facts: no answer remakes, deletes or reboots over what
// holds user data, and every in-between state is acted on (never left as it is).
func TestPlanNeverTouchesUserData(t *testing.T) {
	instances := []Instance{NoInstance, InstanceRunning, InstancePaused, InstanceStopped}
	transitions := []Transition{TNone, TCreate, TClone, TStart, TPause, TResume, TSuspend, TRestore, TStop, TDelete, TCloneSource}
	n := 0
	for _, state := range States() {
		for _, desired := range desirable {
			for _, tr := range transitions {
				for _, inst := range instances {
					for bits := range 64 {
						f := Facts{State: state, Desired: desired, Transition: tr, Instance: inst,
							Generation: 5, ObservedGeneration: int64(4 + bits&1),
							Checkpoint: bits&2 != 0, CloneCheckpoint: bits&4 != 0, Disk: bits&8 != 0,
							PendingClones: bits&16 != 0, NeedsIdentity: bits&32 != 0, PendingSnapshots: bits&16 != 0 && bits&1 != 0}
						if state == api.StateDeleted {
							continue
						}
						n++
						a := Plan(f)
						where := fmt.Sprintf("%+v -> %+v", f, a)
						switch a.Step {
						case Delete:
							if desired != api.StateDeleted {
								t.Fatalf("deletes without a delete request: %s", where)
							}
						case Create:
							// Only a sandbox nobody had: never after it was ever running.
							if state != api.StatePending && state != api.StateCreating {
								t.Fatalf("remakes the disk of an existing sandbox: %s", where)
							}
						case Reboot, Start:
							if !f.Disk {
								t.Fatalf("boots without a disk: %s", where)
							}
							if a.Step == Reboot && a.Note == "" {
								t.Fatalf("a reboot that loses memory must say so: %s", where)
							}
							if a.Step == Reboot && (f.Instance == InstanceRunning || f.Instance == InstancePaused) && state != api.StateSuspended {
								t.Fatalf("reboots over a live instance: %s", where)
							}
							// A checkpoint is the sandbox's memory only while it is suspended
							// (or being suspended or restored); elsewhere it is stale.
							if a.Step == Reboot && f.Checkpoint && (state == api.StateSuspended || state == api.StateSuspending || state == api.StateRestoring) {
								t.Fatalf("reboots although a checkpoint exists: %s", where)
							}
						case Nothing:
							if !IsResting(state) {
								t.Fatalf("leaves an in-between state: %s", where)
							}
						case Resolve, Settle, Adopt:
							if a.State == "" || !IsResting(a.State) {
								t.Fatalf("reports a non-resting state: %s", where)
							}
						}
						if a.Note != "" && a.Step == Settle && a.State != api.StateFailed {
							t.Fatalf("a loss is resolved, not settled as a success: %s", where)
						}
					}
				}
			}
		}
	}
	t.Logf("%d combinations", n)
}

// TestPlanConverges runs the planner against a model of a node: each step changes the
// facts as the node would (a failure injected at every step in turn), and from every
// starting point the sandbox reaches a resting state within a few steps.
func TestPlanConverges(t *testing.T) {
	for _, state := range States() {
		if state == api.StateDeleted || state == api.StateFailed {
			continue
		}
		for _, desired := range desirable {
			for _, inst := range []Instance{NoInstance, InstanceRunning, InstancePaused} {
				for _, cp := range []bool{false, true} {
					for failAt := -1; failAt < 4; failAt++ {
						f := Facts{State: state, Desired: desired, Instance: inst, Checkpoint: cp, Disk: true,
							Generation: 2, ObservedGeneration: 1, PendingSnapshots: failAt%2 == 0}
						steps := 0
						for ; steps < 8; steps++ {
							a := Plan(f)
							if a.Step == Nothing {
								break
							}
							f = model(f, a, steps == failAt)
						}
						if steps == 8 || !IsResting(f.State) {
							t.Fatalf("from %s (desired %s, instance %q, checkpoint %v, fail at %d): stuck at %+v",
								state, desired, inst, cp, failAt, f)
						}
						if f.State == desired || f.State == api.StateDeleted {
							continue
						}
						if f.ObservedGeneration < f.Generation {
							t.Fatalf("from %s: rests at %s (desired %s) without settling the intent", state, f.State, desired)
						}
					}
				}
			}
		}
	}
}

// model applies a step to facts the way a node does; fail makes the step fail and
// leave the host as it was.
func model(f Facts, a Action, fail bool) Facts {
	settle := func(state string) Facts {
		f.State, f.ObservedGeneration, f.Transition = state, f.Generation, TNone
		return f
	}
	if fail {
		switch a.Step {
		case Create, StartClone:
			return settle(api.StateFailed)
		case Pause, Resume, Stop, Start, Restore, Reboot, RestoreLeft:
			// A failed transition reports the state the host shows.
			switch f.Instance {
			case InstanceRunning:
				return settle(api.StateRunning)
			case InstancePaused:
				return settle(api.StatePaused)
			}
			if f.Checkpoint && a.Step == Restore {
				return settle(api.StateSuspended)
			}
			return settle(api.StateStopped)
		}
	}
	switch a.Step {
	case Create, StartClone, Start, Reboot, RestoreLeft:
		f.Instance, f.Disk = InstanceRunning, true
		if f.Desired == api.StatePaused && a.Step != Start && a.Step != Reboot {
			f.Instance = InstancePaused
			return settle(api.StatePaused)
		}
		return settle(api.StateRunning)
	case WaitClone:
		f.CloneReady = true
		return f
	case PrepareClones:
		f.PendingClones = false
		return f
	case TakeSnapshots:
		f.PendingSnapshots = false
		return f
	case Pause:
		f.Instance = InstancePaused
		return settle(api.StatePaused)
	case Resume:
		f.Instance = InstanceRunning
		return settle(api.StateRunning)
	case Suspend:
		f.Instance, f.Checkpoint = NoInstance, true
		return settle(api.StateSuspended)
	case Restore:
		f.Instance, f.Checkpoint = InstanceRunning, false
		return settle(api.StateRunning)
	case Stop:
		f.Instance, f.Checkpoint = NoInstance, false
		return settle(api.StateStopped)
	case Delete:
		f.Instance, f.Checkpoint, f.Disk = NoInstance, false, false
		return settle(api.StateDeleted)
	case Adopt:
		if a.State == api.StatePaused {
			f.Instance = InstancePaused
		}
		f.State, f.Transition = a.State, TNone
		return f
	case Resolve:
		f.State, f.Transition = a.State, TNone
		if a.State == api.StateStopped {
			f.Instance = NoInstance
		}
		return f
	case Settle:
		return settle(a.State)
	}
	return f
}
