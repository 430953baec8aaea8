package node_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
	"github.com/spacedev/space/internal/node"
	"github.com/spacedev/space/internal/runtime"
	"github.com/spacedev/space/internal/spacetest"
	"github.com/spacedev/space/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return c
}

// setRow rewrites a sandbox's row as a crash at some instant would have left it.
func setRow(t *testing.T, s *spacetest.Space, id, set string, args ...any) {
	t.Helper()
	conn, err := s.Store.Connect(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(ctx(t), `UPDATE sandboxes SET `+set+` WHERE id=$1`, append([]any{id}, args...)...); err != nil {
		t.Fatal(err)
	}
}

func get(t *testing.T, s *spacetest.Space, id string) *api.Sandbox {
	t.Helper()
	sb, err := s.C.GetSandbox(ctx(t), id)
	if err != nil {
		t.Fatal(err)
	}
	return sb
}

// marker writes a file on the sandbox's disk and returns a check that it is intact.
func marker(t *testing.T, s *spacetest.Space, id string) func() {
	t.Helper()
	root, err := s.Disk.SandboxRoot(id)
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(root, "marker")
	if err := os.WriteFile(p, []byte(id), 0o644); err != nil {
		t.Fatal(err)
	}
	return func() {
		t.Helper()
		if b, err := os.ReadFile(p); err != nil || string(b) != id {
			t.Fatalf("the sandbox's disk lost its data: %q %v", b, err)
		}
	}
}

func run(t *testing.T, s *spacetest.Space, id, cmd string) string {
	t.Helper()
	var out bytes.Buffer
	code, err := s.C.Exec(ctx(t), id, api.CreateSessionRequest{Command: cmd}, client.Output{Stdout: &out, Stderr: &out})
	if err != nil || code != 0 {
		t.Fatalf("%s: %d %v %s", cmd, code, err, out.String())
	}
	return out.String()
}

func TestRestartAdoptsRunningSandboxes(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	sb := s.Create(api.CreateSandboxRequest{})
	before, _ := s.Runtime.List(ctx(t))
	s.StopNode()
	s.StartNode()
	s.Eventually(30*time.Second, "the node to serve the sandbox again", func() bool {
		_, err := s.C.ListProcesses(ctx(t), sb.ID)
		return err == nil
	})
	after, _ := s.Runtime.List(ctx(t))
	if len(before) != 1 || len(after) != 1 {
		t.Fatalf("instances before %v after %v", before, after)
	}
	if got := get(t, s, sb.ID); got.State != api.StateRunning || got.Error != "" {
		t.Fatalf("after restart: %+v", got)
	}
	run(t, s, sb.ID, "true")
}

// A running sandbox whose instance vanished is booted again from its disk, and says
// that it lost its memory and processes.
func TestLostInstanceIsRebootedAndSaysSo(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	sb := s.Create(api.CreateSandboxRequest{})
	intact := marker(t, s, sb.ID)
	if err := s.Runtime.Kill(sb.ID); err != nil {
		t.Fatal(err)
	}
	s.Eventually(30*time.Second, "the lost instance to be booted again", func() bool {
		got := get(t, s, sb.ID)
		return got.State == api.StateRunning && strings.Contains(got.Error, "memory and processes were lost")
	})
	intact()
	run(t, s, sb.ID, "true")
}

// A sandbox that should run but that the node finds without its instance when it
// starts (the host rebooted) is still recorded running until its worker's first pass:
// a command sent then waits while the node boots it again from its disk, and runs,
// instead of being told that the sandbox does not run (until 2026-12-07: 409).
func TestRequestsWaitForASandboxBootedAfterARestart(t *testing.T) {
	var hold atomic.Bool
	entered, release := make(chan struct{}, 1), make(chan struct{})
	s := spacetest.Start(t, spacetest.Options{FailCreate: func(string) error {
		if hold.Load() {
			select {
			case entered <- struct{}{}:
			default:
			}
			<-release
		}
		return nil
	}})
	var once sync.Once
	t.Cleanup(func() { once.Do(func() { close(release) }) }) // before the node's stop
	sb := s.Create(api.CreateSandboxRequest{})
	s.StopNode()
	if err := s.Runtime.Kill(sb.ID); err != nil {
		t.Fatal(err)
	}
	hold.Store(true)
	s.StartNode()
	select {
	case <-entered: // the boot is under way, and held
	case <-time.After(30 * time.Second):
		t.Fatal("the node did not boot the sandbox again")
	}
	if got := get(t, s, sb.ID); got.State != api.StateRunning && got.State != api.StateStarting {
		t.Fatalf("while it is booted again: %+v", got)
	}
	done := make(chan string, 1)
	go func() {
		var out bytes.Buffer
		code, err := s.C.Exec(ctx(t), sb.ID, api.CreateSessionRequest{Command: "echo ran"}, client.Output{Stdout: &out, Stderr: &out})
		done <- fmt.Sprintf("%d %v %s", code, err, out.String())
	}()
	select {
	case got := <-done:
		t.Fatalf("a command during the boot was answered before the boot ended: %s", got)
	case <-time.After(300 * time.Millisecond): // it waits (an answer would come in milliseconds)
	}
	once.Do(func() { close(release) })
	select {
	case got := <-done:
		if got != "0 <nil> ran\n" {
			t.Fatalf("a command sent during the boot: %s", got)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("a command sent during the boot got no answer")
	}
}

// A wake whose restored agent dies at once (given another binary than its own, say)
// falls back to booting the sandbox from its disk as soon as its instance is seen
// stopped, saying that its memory was lost, instead of waiting out AgentReadyTimeout
// (here a minute, as by default; the wake must be done in well under it).
func TestRestoreWhoseAgentDiesBootsAtOnce(t *testing.T) {
	var die atomic.Bool
	s := spacetest.Start(t, spacetest.Options{
		DieAfterRestore: func(string) bool { return die.Load() },
		Node:            func(c *node.Config) { c.AgentReadyTimeout = time.Minute },
	})
	sb := s.Create(api.CreateSandboxRequest{})
	intact := marker(t, s, sb.ID)
	c, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if op, err := s.C.LifecycleAndWait(c, sb.ID, api.OpSuspend); err != nil || op.State != api.OpSucceeded {
		t.Fatalf("suspend: %+v %v", op, err)
	}
	die.Store(true)
	op, err := s.C.LifecycleAndWait(c, sb.ID, api.OpWake)
	if err != nil || op.State != api.OpSucceeded {
		t.Fatalf("wake: %+v %v", op, err)
	}
	got := get(t, s, sb.ID)
	if got.State != api.StateRunning || !strings.Contains(got.Error, "lost") {
		t.Fatalf("after the wake: %+v", got)
	}
	intact()
	run(t, s, sb.ID, "true")
}

// An interrupted start (a crash between recording "starting" and the boot) is resumed
// as a start: the disk is kept, never remade as for a create.
func TestInterruptedStartKeepsTheDisk(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	sb := s.Create(api.CreateSandboxRequest{})
	op, err := s.C.Lifecycle(ctx(t), sb.ID, api.OpStop)
	if err != nil {
		t.Fatal(err)
	}
	s.WaitOp(op.ID, api.OpSucceeded)
	intact := marker(t, s, sb.ID)
	s.StopNode()
	// The start was recorded and the node died right after reporting "starting".
	op, err = s.C.Lifecycle(ctx(t), sb.ID, api.OpStart)
	if err != nil {
		t.Fatal(err)
	}
	setRow(t, s, sb.ID, `state='starting', transition='start'`)
	s.StartNode()
	s.WaitOp(op.ID, api.OpSucceeded)
	got := get(t, s, sb.ID)
	if got.State != api.StateRunning || got.Error != "" {
		t.Fatalf("after the interrupted start: %+v", got)
	}
	intact()
}

// A restore that completed but could not be recorded is adopted as it is: the
// instance (its memory) is kept, never rebooted.
func TestInterruptedRestoreIsAdopted(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	sb := s.Create(api.CreateSandboxRequest{})
	op, err := s.C.Lifecycle(ctx(t), sb.ID, api.OpSuspend)
	if err != nil {
		t.Fatal(err)
	}
	s.WaitOp(op.ID, api.OpSucceeded)
	op, err = s.C.Lifecycle(ctx(t), sb.ID, api.OpWake)
	if err != nil {
		t.Fatal(err)
	}
	s.WaitOp(op.ID, api.OpSucceeded)
	pids := instancePIDs(t, s)
	s.StopNode()
	// The database never heard the restore finish.
	setRow(t, s, sb.ID, `state='restoring', transition='restore', observed_generation=observed_generation-1`)
	s.StartNode()
	s.Eventually(30*time.Second, "the restored sandbox to be adopted", func() bool {
		return get(t, s, sb.ID).State == api.StateRunning
	})
	if got := get(t, s, sb.ID); got.Error != "" {
		t.Fatalf("adopted with an error: %+v", got)
	}
	if after := instancePIDs(t, s); after[sb.ID] != pids[sb.ID] {
		t.Fatalf("the instance was replaced (pid %d -> %d): its memory is lost", pids[sb.ID], after[sb.ID])
	}
}

func instancePIDs(t *testing.T, s *spacetest.Space) map[string]int {
	t.Helper()
	out := map[string]int{}
	insts, err := s.Runtime.List(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	for _, in := range insts {
		out[in.ID] = s.Runtime.PID(in.ID)
	}
	return out
}

// A suspend interrupted before its checkpoint completed leaves the sandbox running
// (its agent thawed), then the suspend is tried again.
func TestInterruptedSuspendIsRetried(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	sb := s.Create(api.CreateSandboxRequest{})
	s.StopNode()
	op, err := s.C.Lifecycle(ctx(t), sb.ID, api.OpSuspend)
	if err != nil {
		t.Fatal(err)
	}
	setRow(t, s, sb.ID, `state='suspending', transition='suspend'`)
	s.StartNode()
	s.WaitOp(op.ID, api.OpSucceeded)
	if got := get(t, s, sb.ID); got.State != api.StateSuspended {
		t.Fatalf("after retry: %+v", got)
	}
}

// A paused sandbox whose instance is gone is stopped and says it lost its memory; a
// wake boots it.
func TestLostPausedSandboxStops(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	sb := s.Create(api.CreateSandboxRequest{})
	op, err := s.C.Lifecycle(ctx(t), sb.ID, api.OpPause)
	if err != nil {
		t.Fatal(err)
	}
	s.WaitOp(op.ID, api.OpSucceeded)
	if st, _ := s.Runtime.Status(ctx(t), sb.ID); st != runtime.StatusPaused {
		t.Fatalf("instance %s", st)
	}
	_ = s.Runtime.Destroy(ctx(t), sb.ID)
	s.Eventually(30*time.Second, "the loss to be recorded", func() bool {
		got := get(t, s, sb.ID)
		return got.State == api.StateStopped && strings.Contains(got.Error, "lost")
	})
	op, err = s.C.Lifecycle(ctx(t), sb.ID, api.OpWake)
	if err != nil {
		t.Fatal(err)
	}
	s.WaitOp(op.ID, api.OpSucceeded)
}

// A failing create undoes itself and fails its operation with the reason.
func TestFailedCreateUndoes(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{FailCreate: func(string) error { return os.ErrPermission }})
	sb, err := s.C.CreateSandbox(ctx(t), api.CreateSandboxRequest{}, "")
	if err != nil {
		t.Fatal(err)
	}
	op, err := s.C.WaitOperation(ctx(t), sb.Operation.ID)
	if err != nil || op.State != api.OpFailed || !strings.Contains(op.Error, "permission") {
		t.Fatalf("op %+v %v", op, err)
	}
	if got := get(t, s, sb.ID); got.State != api.StateFailed {
		t.Fatalf("sandbox %+v", got)
	}
	if ids, _ := s.Disk.ListSandboxes(); len(ids) != 0 {
		t.Fatalf("disks left: %v", ids)
	}
}
