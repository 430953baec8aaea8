package crashtest_test

import (
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
)

// world is what a scenario made: the sandboxes it watches, the process it expects to
// survive in the first one (pid 0: none), and the operations its action started.
type world struct {
	ids  []string
	pid  int
	ops  []string
	keep bool // the scenario's outcome keeps memory: the process must survive unless a loss is recorded
	// noLoss: nothing may record a loss of memory (PostgreSQL died, the host did not:
	// every instance and snapshot is still there).
	noLoss bool
	// snaps are named snapshots the scenario made or acts on (checkSnapshots).
	snaps []string
	// done, when set, says whether the action has ended (for actions without an
	// operation, like deleting a snapshot).
	done func() bool
	// late, when set, completes the world for an action whose request got no answer
	// (the server died at the armed point before its response left): it finds what the
	// action made once the server answers again (lateOps).
	late func(w *world) error
}

// lateOps adds the operation of an action whose request got no answer to the world's
// operations, once the server answers again.
func lateOps(t *testing.T, s *server, w *world) {
	t.Helper()
	if w.late == nil {
		return
	}
	late := w.late
	w.late = nil
	if err := late(w); err != nil {
		t.Fatal(err)
	}
}

// unanswered handles a request of an action that got no answer: the node acts on an
// action once it is committed, which may be before the api's answer has left, so a
// point taken then kills the server first. The test fails unless the server died;
// otherwise find, run once the server is back, completes the world.
func unanswered(t *testing.T, s *server, w *world, what string, err error, find func(w *world) error) {
	t.Helper()
	if !s.died(10 * time.Second) {
		t.Fatalf("%s: %v", what, err)
	}
	w.late = func(w *world) error {
		if ferr := find(w); ferr != nil {
			return fmt.Errorf("%s (the server died answering it: %v): %w", what, err, ferr)
		}
		return nil
	}
}

// untilAvailable calls f again while it fails with 503 (the database going away and
// coming back: the embedded PostgreSQL restarts within seconds), for up to a minute, as
// a careful client does. In the pgkill walk a point that work in the background passes
// can kill PostgreSQL while the act's own request runs (seen once, for a create, on a
// loaded machine). The client itself repeats these writes for a while under one
// Idempotency-Key; this loop goes on beyond that with a new call, so a new key unless
// the caller passes one (a create). A 503 means the request's transaction failed; only
// one whose commit was cut off took effect, which a verb sent again here meets as a 409
// (the verb is in flight), a create as the same sandbox (its key), and a clone or
// snapshot would make twice.
func untilAvailable(t *testing.T, f func() error) error {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		err := f()
		var ce *client.Error
		if err == nil || !errors.As(err, &ce) || ce.Status != http.StatusServiceUnavailable || time.Now().After(deadline) {
			return err
		}
		t.Logf("sent again after: %v", err)
		time.Sleep(200 * time.Millisecond) // PostgreSQL restarting
	}
}

// newestOp returns the newest operation of sandbox id created since (less a second of
// slack), other than its create.
func newestOp(t *testing.T, s *server, id string, since time.Time) (string, error) {
	ops, err := s.C.SandboxOperations(ctx(t, time.Minute), id)
	if err != nil {
		return "", err
	}
	for _, o := range ops {
		if !o.CreatedAt.Before(since.Add(-time.Second)) && o.Kind != api.OpCreate {
			return o.ID, nil
		}
	}
	return "", fmt.Errorf("no operation of sandbox %s since %s", id, since.Format(time.RFC3339Nano))
}

// scenario is one transition: a setup that brings sandboxes to the state it starts
// from, and the action that runs the transition.
type scenario struct {
	name  string
	setup func(t *testing.T, s *server) *world
	act   func(t *testing.T, s *server, w *world)
	// fresh runs each point on a new server (the scenario changes server-wide state,
	// like a warm pool, that the next point would find done).
	fresh bool
}

// create makes a sandbox, writes the disk marker and, if proc, starts a long process.
func create(t *testing.T, s *server, proc bool) (string, int) {
	t.Helper()
	// As a client should: a create that met PostgreSQL restarting (a pgkill point taken
	// late, by work that went on after the last check) answers 503 and is sent again
	// under the same idempotency key, so it is made once.
	c := ctx(t, time.Minute)
	key := fmt.Sprintf("walk-%d", time.Now().UnixNano())
	var sb *api.Sandbox
	var err error
	for {
		sb, err = s.C.CreateSandbox(c, api.CreateSandboxRequest{}, key)
		var ae *client.Error
		if err == nil || !errors.As(err, &ae) || ae.Status != http.StatusServiceUnavailable || c.Err() != nil {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	if op, err := s.C.WaitOperation(c, sb.Operation.ID); err != nil || op.State != api.OpSucceeded {
		t.Fatalf("create: %+v %v", op, err)
	}
	if err := os.WriteFile(s.markerPath(sb.ID), []byte(sb.ID), 0o644); err != nil {
		t.Fatal(err)
	}
	if !proc {
		return sb.ID, 0
	}
	sess, err := s.C.CreateSession(ctx(t, time.Minute), sb.ID, api.CreateSessionRequest{Command: "sleep 3600"})
	if err != nil {
		t.Fatal(err)
	}
	st, err := s.C.Attach(ctx(t, time.Minute), sess, "")
	if err != nil {
		t.Fatal(err)
	}
	st.Close() // the attach started it; it runs on
	return sb.ID, sess.PID
}

// verb asks for a lifecycle verb and returns its operation.
func verb(t *testing.T, s *server, id, v string) string {
	t.Helper()
	op, err := s.C.Lifecycle(ctx(t, time.Minute), id, v)
	if err != nil {
		t.Fatalf("%s: %v", v, err)
	}
	return op.ID
}

// settle waits for an operation to end (setup steps must succeed).
func settle(t *testing.T, s *server, op string) {
	t.Helper()
	got, err := s.C.WaitOperation(ctx(t, time.Minute), op)
	if err != nil || got.State != api.OpSucceeded {
		t.Fatalf("setup operation %s: %+v %v", op, got, err)
	}
}

func scenarios() []scenario {
	running := func(t *testing.T, s *server) *world {
		id, pid := create(t, s, true)
		return &world{ids: []string{id}, pid: pid}
	}
	withVerbs := func(proc bool, verbs ...string) func(t *testing.T, s *server) *world {
		return func(t *testing.T, s *server) *world {
			id, pid := create(t, s, proc)
			for _, v := range verbs {
				settle(t, s, verb(t, s, id, v))
			}
			return &world{ids: []string{id}, pid: pid}
		}
	}
	act := func(v string, keep bool) func(t *testing.T, s *server, w *world) {
		return func(t *testing.T, s *server, w *world) {
			w.keep = keep
			id, since := w.ids[0], time.Now()
			var op *api.Operation
			sent := 0
			err := untilAvailable(t, func() (err error) {
				sent++
				op, err = s.C.Lifecycle(ctx(t, time.Minute), id, v)
				return err
			})
			if err == nil {
				w.ops = append(w.ops, op.ID)
				return
			}
			var ce *client.Error
			if sent > 1 && errors.As(err, &ce) && ce.Status == http.StatusConflict {
				// The request that met the database going away had committed before its
				// answer failed: the verb is in flight, and this is its operation.
				found, ferr := newestOp(t, s, id, since)
				if ferr != nil {
					t.Fatalf("%s sent again after a 503: %v; %v", v, err, ferr)
				}
				w.ops = append(w.ops, found)
				return
			}
			unanswered(t, s, w, v, err, func(w *world) error {
				op, err := newestOp(t, s, id, since)
				w.ops = append(w.ops, op)
				return err
			})
		}
	}
	withSnapshot := func(t *testing.T, s *server) *world {
		id, _ := create(t, s, false)
		sn, err := s.C.CreateSnapshotAndWait(ctx(t, time.Minute), id, api.CreateSnapshotRequest{})
		if err != nil {
			t.Fatalf("setup snapshot: %v", err)
		}
		return &world{ids: []string{id}, snaps: []string{sn.ID}}
	}
	return []scenario{
		{name: "create", setup: func(t *testing.T, s *server) *world { return &world{} },
			act: func(t *testing.T, s *server, w *world) {
				// Sent again on a 503 with the same idempotency key (untilAvailable). The
				// in-process node can take the point, and kill the server, before the
				// create's answer is out: then it is sent again, with the key, once the
				// server is back, and answers with the sandbox the first one recorded.
				key := "walk-" + strconv.FormatInt(time.Now().UnixNano(), 36)
				send := func(w *world) error {
					var sb *api.Sandbox
					err := untilAvailable(t, func() (err error) {
						sb, err = s.C.CreateSandbox(ctx(t, time.Minute), api.CreateSandboxRequest{}, key)
						return err
					})
					if err == nil {
						w.ids, w.ops = []string{sb.ID}, []string{sb.Operation.ID}
					}
					return err
				}
				if err := send(w); err != nil {
					unanswered(t, s, w, "create", err, send)
				}
			}},
		{name: "stop", setup: running, act: act(api.OpStop, false)},
		{name: "start", setup: withVerbs(false, api.OpStop), act: act(api.OpStart, false)},
		{name: "pause", setup: running, act: act(api.OpPause, true)},
		{name: "resume", setup: withVerbs(true, api.OpPause), act: act(api.OpResume, true)},
		// The fake runtime keeps no memory across a checkpoint (its restore starts a
		// fresh agent): memory across suspend, wake and clone is walked on gVisor.
		{name: "suspend", setup: running, act: act(api.OpSuspend, false)},
		{name: "wake", setup: withVerbs(false, api.OpSuspend), act: act(api.OpWake, false)},
		{name: "clone", setup: running, act: func(t *testing.T, s *server, w *world) {
			src := w.ids[0]
			var clones []api.Sandbox
			err := untilAvailable(t, func() (err error) {
				clones, err = s.C.Clone(ctx(t, time.Minute), src, api.CloneRequest{Count: 1})
				return err
			})
			if err != nil {
				unanswered(t, s, w, "clone", err, func(w *world) error {
					list, err := s.C.ListSandboxes(ctx(t, time.Minute), client.ListOptions{})
					if err != nil {
						return err
					}
					for _, sb := range list {
						if sb.CloneOf != src {
							continue
						}
						ops, err := s.C.SandboxOperations(ctx(t, time.Minute), sb.ID)
						if err != nil || len(ops) == 0 {
							return fmt.Errorf("operations of clone %s: %d, %v", sb.ID, len(ops), err)
						}
						w.ids = append(w.ids, sb.ID)
						w.ops = append(w.ops, ops[0].ID)
						return nil
					}
					return fmt.Errorf("no clone of %s", src)
				})
				return
			}
			w.ids = append(w.ids, clones[0].ID)
			w.ops = append(w.ops, clones[0].Operation.ID)
		}},
		// Named snapshots: taken (the source is checkpointed as for a clone), used to
		// create a sandbox, deleted.
		{name: "snapshot", setup: running, act: func(t *testing.T, s *server, w *world) {
			var sn *api.Snapshot
			err := untilAvailable(t, func() (err error) {
				sn, err = s.C.CreateSnapshot(ctx(t, time.Minute), w.ids[0], api.CreateSnapshotRequest{})
				return err
			})
			if err != nil {
				unanswered(t, s, w, "snapshot", err, func(w *world) error {
					list, err := s.C.ListSnapshots(ctx(t, time.Minute), client.SnapshotListOptions{Sandbox: w.ids[0]})
					if err != nil {
						return err
					}
					if len(list) == 0 {
						return fmt.Errorf("no snapshot of %s", w.ids[0])
					}
					id := list[0].ID
					w.snaps = append(w.snaps, id)
					// Its operation is not known (a list does not carry it): the capture
					// ends when the snapshot leaves creating (seen once in CI: checked
					// while the recovered capture still ran).
					w.done = func() bool {
						sn, err := s.C.GetSnapshot(ctx(t, 5*time.Second), id)
						return client.IsNotFound(err) || err == nil && sn.State != api.SnapshotCreating
					}
					return nil
				})
				return
			}
			w.snaps = append(w.snaps, sn.ID)
			w.ops = append(w.ops, sn.Operation.ID)
		}},
		{name: "from-snapshot", setup: withSnapshot, act: func(t *testing.T, s *server, w *world) {
			key := "walk-" + strconv.FormatInt(time.Now().UnixNano(), 36)
			var sb *api.Sandbox
			err := untilAvailable(t, func() (err error) {
				sb, err = s.C.CreateSandbox(ctx(t, time.Minute), api.CreateSandboxRequest{Snapshot: w.snaps[0]}, key)
				return err
			})
			if err != nil {
				t.Fatal(err)
			}
			w.ids = append(w.ids, sb.ID)
			w.ops = append(w.ops, sb.Operation.ID)
		}},
		{name: "snapshot-rm", setup: withSnapshot, act: func(t *testing.T, s *server, w *world) {
			id := w.snaps[0]
			retry := false
			if _, err := s.C.DeleteSnapshot(ctx(t, time.Minute), id); err != nil {
				// The point can be taken before the answer is sent: the server dies
				// under the request, and the client retries once it is back.
				if !s.died(10 * time.Second) {
					t.Fatal(err)
				}
				retry = true
			}
			w.done = func() bool {
				_, err := s.C.GetSnapshot(ctx(t, 5*time.Second), id)
				if err == nil && retry && s.running() {
					_, _ = s.C.DeleteSnapshot(ctx(t, 5*time.Second), id)
				}
				return client.IsNotFound(err)
			}
		}},
		{name: "delete", setup: running, act: func(t *testing.T, s *server, w *world) {
			id := w.ids[0]
			var op *api.Operation
			err := untilAvailable(t, func() (err error) {
				op, err = s.C.DeleteSandbox(ctx(t, time.Minute), id)
				return err
			})
			if err == nil {
				w.ops = append(w.ops, op.ID)
				return
			}
			// The node acts on the delete once it is committed, which may be before the
			// answer left (seen once in CI, at delete.recorded). Sent again once the
			// server is back: a sandbox still being deleted gets a delete operation that
			// ends with the first; one already deleted is a 404, and the world checks it
			// rests deleted.
			unanswered(t, s, w, "delete", err, func(w *world) error {
				op, err := s.C.DeleteSandbox(ctx(t, time.Minute), id)
				if client.IsNotFound(err) {
					return nil
				}
				if err == nil {
					w.ops = append(w.ops, op.ID)
				}
				return err
			})
		}},
		{name: "pool", fresh: true, setup: func(t *testing.T, s *server) *world { return &world{} },
			act: func(t *testing.T, s *server, w *world) {
				// The server may die anywhere from here: filling the pool (which can begin
				// before the PUT is answered: a client then sets it again, a PUT is
				// idempotent), claiming from it (a client retries with its idempotency key
				// and gets the first answer).
				deadline := time.Now().Add(converge)
				for {
					_, err := s.C.SetPool(ctx(t, time.Minute), api.SetPoolRequest{Template: "base", Size: 1})
					if err == nil {
						break
					}
					if !s.died(10*time.Second) || time.Now().After(deadline) {
						t.Fatal(err)
					}
					s.disarm()
					s.start()
				}
				for time.Now().Before(deadline) {
					if s.exited() {
						s.disarm()
						s.start()
					}
					pools, err := s.C.ListPools(ctx(t, time.Minute))
					if err == nil && len(pools) == 1 && pools[0].Ready == 1 {
						break
					}
					time.Sleep(100 * time.Millisecond)
				}
				for time.Now().Before(deadline) {
					sb, err := s.C.CreateSandbox(ctx(t, time.Minute), api.CreateSandboxRequest{}, "walk-claim")
					if err == nil {
						w.ids, w.ops = []string{sb.ID}, []string{sb.Operation.ID}
						return
					}
					if !s.died(10 * time.Second) {
						t.Fatal(err)
					}
					s.disarm()
					s.start()
				}
				t.Fatal("no sandbox claimed from the pool")
			}},
	}
}

// TestCrashWalk kills space serve (kill -9) at every crash point each transition
// passes, restarts it and checks the invariants.
func TestCrashWalk(t *testing.T) { walk(t, "kill") }

// TestPostgresCrashWalk kills the embedded PostgreSQL at every crash point each
// transition passes (space supervises it and carries on) and checks the invariants.
func TestPostgresCrashWalk(t *testing.T) { walk(t, "pgkill") }

func walk(t *testing.T, action string) {
	total := 0
	// PostgreSQL dying at a point is met by the same code whichever transition passed
	// it (the store's retries, the supervisor's restart): the pgkill walk takes each
	// point once, in the first transition that passes it. The kill walk takes every
	// point of every transition (a server restart is cheap, and what recovery does
	// depends on the transition).
	walked := map[string]bool{}
	for _, sc := range scenarios() {
		t.Run(sc.name, func(t *testing.T) {
			s := newServer(t, action == "pgkill")
			s.start()
			// Discover the points the transition passes.
			w := sc.setup(t, s)
			s.clearPoints()
			sc.act(t, s, w)
			waitOps(t, s, w)
			points := s.points()
			if len(points) == 0 {
				t.Fatalf("the %s transition passed no crash point", sc.name)
			}
			t.Logf("%s passes %d points: %s", sc.name, len(points), strings.Join(points, " "))
			for _, p := range points {
				if action == "pgkill" {
					if walked[p] {
						continue
					}
					walked[p] = true
				}
				total++
				if sc.fresh {
					s = newServer(t, action == "pgkill")
				}
				once := filepath.Join(s.dataDir, "once-"+action+"-"+p)
				// The server of the point before goes on (restarted if the point
				// killed it): the arm file names the point to take.
				s.disarm()
				if s.exited() {
					s.start()
				}
				w := sc.setup(t, s)
				s.arm(p, action, once)
				sc.act(t, s, w)
				// Wait until the point acts (its once-file appears) or the transition
				// ends without passing it.
				hit := false
				deadline := time.Now().Add(converge)
				for time.Now().Before(deadline) {
					if _, err := os.Stat(once); err == nil {
						hit = true
						break
					}
					if action == "kill" && s.exited() || opsDone(s, w) {
						break
					}
					time.Sleep(20 * time.Millisecond)
				}
				if action == "kill" && hit {
					// A fresh scenario's act restarts the server itself when the point
					// is taken during the act; taken after it (the act's last call
					// returned first), the process the test watches is the one dying.
					if (!sc.fresh || s.isPID(onceTaker(t, once))) && !s.died(converge) {
						t.Fatalf("%s: the server did not die at the point", p)
					}
					if s.exited() {
						s.disarm()
						s.start()
					}
				}
				s.disarm()
				if !hit {
					if action == "kill" {
						t.Errorf("%s at %s: the point was not reached again", action, p)
						continue
					}
					// With PostgreSQL killed at an earlier point, a later run may take
					// another path: whatever it took must still converge.
					t.Logf("%s at %s: the point was not reached in this run", action, p)
				}
				w.noLoss = action == "pgkill"
				if !checkWorld(t, s, w, sc.name+"@"+p) {
					return
				}
			}
		})
	}
	t.Logf("%s walk: %d crash points", action, total)
}

// onceTaker returns the pid of the process that took a crash point's action, from its
// once-file ("point pid\n", complete once it ends with a newline).
func onceTaker(t *testing.T, once string) int {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		b, err := os.ReadFile(once)
		if err == nil && strings.HasSuffix(string(b), "\n") {
			f := strings.Fields(string(b))
			if len(f) == 2 {
				if pid, err := strconv.Atoi(f[1]); err == nil {
					return pid
				}
			}
			t.Fatalf("once-file %s: %q", once, b)
		}
		if time.Now().After(deadline) {
			t.Fatalf("once-file %s incomplete after 10 s: %q %v", once, b, err)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// opsDone reports whether every operation of the world has ended (false while the
// server does not answer).
func opsDone(s *server, w *world) bool {
	if w.done != nil && !w.done() {
		return false
	}
	for _, op := range w.ops {
		got, err := s.C.GetOperation(ctx(s.t, 5*time.Second), op)
		if err != nil || !got.Done() {
			return false
		}
	}
	return true
}

// waitOps waits until every operation of the world has ended.
func waitOps(t *testing.T, s *server, w *world) {
	t.Helper()
	deadline := time.Now().Add(converge)
	for w.done != nil && !w.done() {
		if time.Now().After(deadline) {
			t.Fatal("the action did not finish")
		}
		time.Sleep(20 * time.Millisecond)
	}
	for _, op := range w.ops {
		got, err := s.C.WaitOperation(ctx(t, converge), op)
		if err != nil || !got.Done() {
			t.Fatalf("operation %s did not end: %+v %v", op, got, err)
		}
	}
}

var lossRe = regexp.MustCompile(`lost`)

// checkWorld checks the invariants after recovery. It reports false after a failure.
func checkWorld(t *testing.T, s *server, w *world, where string) bool {
	t.Helper()
	fail := func(format string, args ...any) bool {
		t.Errorf(where+": "+format, args...)
		return false
	}
	lateOps(t, s, w)
	// Every operation ends, within the deadline.
	for _, op := range w.ops {
		got, err := s.C.WaitOperation(ctx(t, converge), op)
		if err != nil {
			return fail("operation %s: %v", op, err)
		}
		if !got.Done() {
			return fail("operation %s (%s) still %s after recovery: %s", op, got.Kind, got.State, got.Message)
		}
	}
	deadline := time.Now().Add(converge)
	var sbs []*api.Sandbox
	for {
		sbs = sbs[:0]
		settled := true
		for _, id := range w.ids {
			sb, err := s.C.GetSandbox(ctx(t, time.Minute), id)
			if err != nil {
				return fail("sandbox %s: %v", id, err)
			}
			sbs = append(sbs, sb)
			if !resting(sb.State) || sb.State != sb.DesiredState && sb.State != api.StateFailed && sb.State != api.StateStopped {
				settled = false
			}
		}
		if settled || time.Now().After(deadline) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	for i, sb := range sbs {
		if !resting(sb.State) {
			return fail("sandbox %s stays %s (desired %s)", sb.ID, sb.State, sb.DesiredState)
		}
		// Its disk is intact, unless it was deleted (or never made).
		if sb.State != api.StateDeleted && sb.State != api.StateFailed && (i == 0 && w.pid != 0 || i == 0 && len(w.ids) == 1) {
			if _, err := os.Stat(filepath.Dir(s.markerPath(sb.ID))); err == nil {
				b, err := os.ReadFile(s.markerPath(sb.ID))
				if err != nil && w.pid != 0 {
					return fail("sandbox %s lost its disk data: %v", sb.ID, err)
				}
				// A clone's disk is its source's: the marker names the source (or its own).
				if err == nil && string(b) != sb.ID && sb.CloneOf == "" {
					return fail("sandbox %s's disk marker says %q", sb.ID, b)
				}
			} else if sb.State == api.StateRunning || sb.State == api.StateStopped {
				return fail("sandbox %s (%s) has no disk", sb.ID, sb.State)
			}
		}
		// A failed sandbox says why.
		if sb.State == api.StateFailed && sb.Error == "" {
			return fail("sandbox %s failed without saying why", sb.ID)
		}
		if w.noLoss && lossRe.MatchString(sb.Error) {
			return fail("sandbox %s recorded a loss though only PostgreSQL died: %s", sb.ID, sb.Error)
		}
	}
	// Memory: a process survives where the state says memory was kept.
	if w.keep && w.pid != 0 && len(sbs) > 0 && sbs[0].State == api.StateRunning && !lossRe.MatchString(sbs[0].Error) {
		procs, err := s.C.ListProcesses(ctx(t, time.Minute), sbs[0].ID)
		if err != nil {
			return fail("processes: %v", err)
		}
		alive := false
		for _, p := range procs {
			alive = alive || p.PID == w.pid && p.State == api.ProcRunning
		}
		if !alive {
			return fail("sandbox %s runs without loss recorded, but its process %d is gone", sbs[0].ID, w.pid)
		}
	}
	// A succeeded operation tells the truth about what it cost.
	for _, op := range w.ops {
		got, _ := s.C.GetOperation(ctx(t, time.Minute), op)
		for _, sb := range sbs {
			if got != nil && got.SandboxID == sb.ID && got.State == api.OpSucceeded && lossRe.MatchString(sb.Error) &&
				strings.Contains(sb.Error, time.Now().UTC().Format("2006-01-02")) && !strings.Contains(got.Message, "lost") &&
				got.Kind != api.OpStop && got.Kind != api.OpDelete && got.Kind != api.OpSuspend && got.Kind != api.OpPause {
				t.Logf("%s: note: operation %s succeeded (%s) and the sandbox recorded a loss: %s", where, got.Kind, got.Message, sb.Error)
			}
		}
	}
	if !checkSnapshots(t, s, w, where) {
		return false
	}
	// Nothing leaks: instances only for sandboxes with memory, disks only for live ones.
	// The states are read again on every look: another world's sandbox (a clone being
	// started, checked after this one) may still be on its way.
	deadline = time.Now().Add(30 * time.Second)
	for {
		live := map[string]string{}
		list, err := s.C.ListSandboxes(ctx(t, time.Minute), client.ListOptions{})
		if err != nil {
			return fail("list: %v", err)
		}
		for _, sb := range list {
			live[sb.ID] = sb.State
		}
		for _, sb := range sbs {
			if sb.State != api.StateDeleted {
				live[sb.ID] = sb.State
			}
		}
		var leaks []string
		for _, id := range s.instances() {
			if st, ok := live[id]; ok && (st == api.StateRunning || st == api.StatePaused) || strings.HasPrefix(id, "bs") || isPoolMember(s, id) {
				continue
			}
			leaks = append(leaks, "instance "+id+" ("+live[id]+")")
		}
		for _, id := range s.disks() {
			if _, ok := live[id]; ok || isPoolMember(s, id) {
				continue
			}
			leaks = append(leaks, "disk "+id)
		}
		if len(leaks) == 0 {
			break
		}
		if time.Now().After(deadline) {
			return fail("leaked: %s", strings.Join(leaks, ", "))
		}
		time.Sleep(200 * time.Millisecond)
	}
	return true
}

// isPoolMember reports whether id is a warm-pool member (hidden from listings).
func isPoolMember(s *server, id string) bool {
	_, err := s.C.GetSandbox(ctx(s.t, time.Minute), id)
	var ce *client.Error
	return errors.As(err, &ce) && ce.Status == 404 // hidden from users
}

func resting(state string) bool {
	return slices.Contains([]string{api.StateRunning, api.StatePaused, api.StateSuspended, api.StateStopped,
		api.StateFailed, api.StateDeleted}, state)
}

// checkSnapshots checks the world's named snapshots after recovery: each is ready with
// complete files, or gone (its operation failed, or it was deleted); none stays in
// between; and no snapshot files exist without their snapshot.
func checkSnapshots(t *testing.T, s *server, w *world, where string) bool {
	t.Helper()
	fail := func(format string, args ...any) bool {
		t.Errorf(where+": "+format, args...)
		return false
	}
	if w.done != nil {
		deadline := time.Now().Add(converge)
		for !w.done() {
			if time.Now().After(deadline) {
				return fail("the action did not finish after recovery")
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	for _, id := range w.snaps {
		sn, err := s.C.GetSnapshot(ctx(t, time.Minute), id)
		switch {
		case client.IsNotFound(err):
			continue
		case err != nil:
			return fail("snapshot %s: %v", id, err)
		case sn.State != api.SnapshotReady:
			return fail("snapshot %s stays %s", id, sn.State)
		}
		if _, err := os.Stat(filepath.Join(s.dataDir, "fakestore", "snapshots", id, "checkpoint", "complete")); err != nil {
			return fail("snapshot %s is ready without its files: %v", id, err)
		}
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		var leaks []string
		ents, _ := os.ReadDir(filepath.Join(s.dataDir, "fakestore", "snapshots"))
		for _, e := range ents {
			if _, err := s.C.GetSnapshot(ctx(t, time.Minute), e.Name()); client.IsNotFound(err) {
				leaks = append(leaks, "snapshot files "+e.Name())
			}
		}
		if len(leaks) == 0 {
			return true
		}
		if time.Now().After(deadline) {
			return fail("leaked: %s", strings.Join(leaks, ", "))
		}
		time.Sleep(200 * time.Millisecond)
	}
}
