package e2e

import (
	"bufio"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
	"github.com/spacedev/space/internal/crash"
)

// TestCrashWalkKeepsMemory is the crash walk (internal/crashtest) on gVisor, where a
// checkpoint keeps memory: space is killed (kill -9) at each crash point of suspend,
// wake and clone, restarted, and a process started before the transition must still
// run afterwards unless the sandbox says it lost its memory — and a loss is only
// acceptable where the snapshot was not complete yet.
func TestCrashWalkKeepsMemory(t *testing.T) {
	dir := t.TempDir()
	crashLog, arm := filepath.Join(dir, "crash.log"), filepath.Join(dir, "crash.arm")
	// The server logs every point it passes and acts only at the one the arm file
	// names, while it exists.
	logEnv := []string{"SPACE_CRASH_LOG=" + crashLog, "SPACE_CRASH_ARM=" + arm}
	s := start(t, options{Failpoints: true, Args: []string{"--base-snapshots=false"}, Env: logEnv})
	points := func() []string {
		f, err := os.Open(crashLog)
		if err != nil {
			return nil
		}
		defer f.Close()
		var out []string
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			if p := sc.Text(); p != "" && !slices.Contains(out, p) {
				out = append(out, p)
			}
		}
		return out
	}
	// setup makes a running sandbox with a marker file and a long process.
	setup := func() (string, int) {
		sb := s.create(t, api.CreateSandboxRequest{})
		if _, _, code := s.exec(t, sb.ID, "sh", "-c", "echo kept > /root/marker"); code != 0 {
			t.Fatal("marker")
		}
		sess, err := s.C.CreateSession(ctx(t, time.Minute), sb.ID, api.CreateSessionRequest{Command: "sleep 3600"})
		if err != nil {
			t.Fatal(err)
		}
		st, err := s.C.Attach(ctx(t, time.Minute), sess, "")
		if err != nil {
			t.Fatal(err)
		}
		st.Close()
		return sb.ID, sess.PID
	}
	type step struct {
		name  string
		pre   []string // verbs before the walked one
		verb  string
		clone bool
	}
	for _, sc := range []step{
		{name: "suspend", verb: api.OpSuspend},
		{name: "wake", pre: []string{api.OpSuspend}, verb: api.OpWake},
		{name: "clone", clone: true},
	} {
		// Discover the points of the transition.
		id, _ := setup()
		for _, v := range sc.pre {
			s.verb(t, id, v)
		}
		_ = os.Truncate(crashLog, 0)
		act := func(id string) ([]string, error) {
			if sc.clone {
				clones, err := s.C.Clone(ctx(t, time.Minute), id, api.CloneRequest{Count: 1})
				if err != nil {
					return nil, err
				}
				return []string{clones[0].Operation.ID}, nil
			}
			op, err := s.C.Lifecycle(ctx(t, time.Minute), id, sc.verb)
			if err != nil {
				return nil, err
			}
			return []string{op.ID}, nil
		}
		ops, err := act(id)
		if err != nil {
			t.Fatal(err)
		}
		for _, op := range ops {
			if _, err := s.C.WaitOperation(ctx(t, 2*time.Minute), op); err != nil {
				t.Fatal(err)
			}
		}
		walked := points()
		t.Logf("%s passes %s", sc.name, strings.Join(walked, " "))
		if len(walked) == 0 {
			t.Fatalf("%s: the server logged no crash points", sc.name)
		}
		for _, p := range walked {
			// Only where memory is at stake: the snapshot, the restore, the source's
			// way back.
			if !strings.HasPrefix(p, "checkpoint.") && !strings.HasPrefix(p, "restore.") &&
				!strings.HasPrefix(p, "clone.source.") && !strings.HasPrefix(p, "suspend.destroyed") {
				continue
			}
			// The server goes on from the point before; the arm file names the point
			// (internal/crash), written whole once the setup is done.
			id, pid := setup()
			for _, v := range sc.pre {
				s.verb(t, id, v)
			}
			if err := crash.Arm(arm, p, "kill", filepath.Join(dir, "once-"+sc.name+"-"+p)); err != nil {
				t.Fatal(err)
			}
			ops, err := act(id)
			if err != nil {
				// The point can be taken before the answer is sent (the api hands the
				// request to its in-process node at once): the server dies under the
				// request. Its operations are found once the server is back.
				t.Logf("%s@%s: the request died with the server: %v", sc.name, p, err)
			}
			if !s.WaitExit(2 * time.Minute) {
				t.Fatalf("%s@%s: the point was not reached", sc.name, p)
			}
			if err := crash.Arm(arm, "", "", ""); err != nil {
				t.Fatal(err)
			}
			s.Restart()
			if err != nil {
				// What the request committed before the server died: its operations.
				ops = unansweredOps(t, s, id, sc.clone)
			}
			for _, op := range ops {
				got, err := s.C.WaitOperation(ctx(t, 3*time.Minute), op)
				if err != nil || !got.Done() {
					t.Fatalf("%s@%s: operation %+v %v", sc.name, p, got, err)
				}
			}
			var sb *api.Sandbox
			waitFor(t, 2*time.Minute, "the source to rest", func() bool {
				sb = s.state(t, id)
				return sb.State == sb.DesiredState || sb.State == api.StateStopped || sb.State == api.StateFailed
			})
			// Only a crash between runsc's checkpoint (which ends the instance) and the
			// snapshot's completion marker may cost the memory.
			lost := strings.Contains(sb.Error, "lost")
			if lost && p != "checkpoint.saved" {
				t.Errorf("%s@%s: memory lost although it was kept (running instance or complete snapshot): %s", sc.name, p, sb.Error)
			}
			if sb.State == api.StateSuspended {
				s.verb(t, id, api.OpWake)
			}
			if sb.State == api.StateStopped {
				if !lost {
					t.Errorf("%s@%s: stopped without saying it lost its memory", sc.name, p)
				}
				_, _ = s.C.DeleteSandbox(ctx(t, time.Minute), id)
				continue
			}
			if out, _, _ := s.exec(t, id, "cat", "/root/marker"); strings.TrimSpace(out) != "kept" {
				t.Errorf("%s@%s: the disk lost its data: %q", sc.name, p, out)
			}
			if !lost {
				procs, err := s.C.ListProcesses(ctx(t, time.Minute), id)
				if err != nil {
					t.Fatal(err)
				}
				alive := slices.ContainsFunc(procs, func(pr api.Process) bool { return pr.PID == pid && pr.State == api.ProcRunning })
				if !alive {
					t.Errorf("%s@%s: no loss recorded, but the process %d is gone", sc.name, p, pid)
				}
			}
			if _, err := s.C.DeleteSandbox(ctx(t, time.Minute), id); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// unansweredOps finds the operations a request committed before the server died under
// it: the clones' of source id (clone), else the sandbox's unfinished ones.
func unansweredOps(t *testing.T, s *srv, id string, clone bool) []string {
	t.Helper()
	var ops []string
	waitFor(t, time.Minute, "the request's operations", func() bool {
		ops = nil
		ids := []string{id}
		if clone {
			list, err := s.C.ListSandboxes(ctx(t, time.Minute), client.ListOptions{})
			if err != nil {
				return false
			}
			ids = nil
			for _, sb := range list {
				if sb.CloneOf == id {
					ids = append(ids, sb.ID)
				}
			}
		}
		for _, sid := range ids {
			list, err := s.C.SandboxOperations(ctx(t, time.Minute), sid)
			if err != nil {
				return false
			}
			for _, op := range list {
				if clone || !op.Done() {
					ops = append(ops, op.ID)
				}
			}
		}
		return !clone || len(ops) > 0
	})
	return ops
}

// TestCrashAfterClonePrepared: the server dies after it made the clones' disks and
// memory images but before it marked them ready. After the restart the clones are
// prepared again from a new snapshot of the source and start, with the source's disk.
// Before, the second preparation failed on the first one's disk ("file exists"), and
// so did the clones; a database that went away for the mark did the same.
func TestCrashAfterClonePrepared(t *testing.T) {
	dir := t.TempDir()
	arm := filepath.Join(dir, "crash.arm")
	s := start(t, options{Failpoints: true, Args: []string{"--base-snapshots=false"}, Env: []string{"SPACE_CRASH_ARM=" + arm}})
	sb := s.create(t, api.CreateSandboxRequest{})
	if _, _, code := s.exec(t, sb.ID, "sh", "-c", "echo kept > /root/marker"); code != 0 {
		t.Fatal("marker")
	}
	if err := crash.Arm(arm, "clone.prepared", "kill", filepath.Join(dir, "once")); err != nil {
		t.Fatal(err)
	}
	clones, err := s.C.Clone(ctx(t, time.Minute), sb.ID, api.CloneRequest{Count: 2})
	if err != nil {
		t.Fatal(err)
	}
	if !s.WaitExit(2 * time.Minute) {
		t.Fatal("the point was not reached")
	}
	if err := crash.Arm(arm, "", "", ""); err != nil {
		t.Fatal(err)
	}
	s.Restart()
	for _, c := range clones {
		op, err := s.C.WaitOperation(ctx(t, 3*time.Minute), c.Operation.ID)
		if err != nil || op.State != api.OpSucceeded {
			t.Fatalf("clone %s after the crash: %+v %v", c.ID, op, err)
		}
		if out, _, _ := s.exec(t, c.ID, "cat", "/root/marker"); strings.TrimSpace(out) != "kept" {
			t.Errorf("clone %s: the disk lost its data: %q", c.ID, out)
		}
	}
}
