package e2e

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
	"github.com/spacedev/space/internal/guest/rundirs"
	"github.com/spacedev/space/internal/store"
)

// counter is a python process that keeps state only in memory and prints it.
const counter = `python3 -u -c "
import time
n = 0
while True:
    n += 1
    print(n)
    time.sleep(0.05)
"`

func (s *srv) verb(t testing.TB, id, verb string) *api.Operation {
	t.Helper()
	op, err := s.C.LifecycleAndWait(ctx(t, 3*time.Minute), id, verb)
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", verb, id, err, s.Log())
	}
	return op
}

func (s *srv) state(t testing.TB, id string) *api.Sandbox {
	t.Helper()
	sb, err := s.C.GetSandbox(ctx(t, time.Minute), id)
	if err != nil {
		t.Fatal(err)
	}
	return sb
}

// lastLine returns the last complete line of s as a number.
func lastNumber(s string) int {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	n, _ := strconv.Atoi(lines[len(lines)-1])
	return n
}

// TestPauseSuspendWake follows one process through pause/resume and suspend/wake: its
// memory state survives, the attach stream continues where it stopped (no byte lost or
// repeated), files survive, old tokens die, and the clock is right afterwards.
func TestPauseSuspendWake(t *testing.T) {
	s := start(t, options{})
	sb := s.create(t, api.CreateSandboxRequest{})
	c := ctx(t, 4*time.Minute)
	if _, err := s.C.WriteFile(c, sb.ID, "/root/before.txt", strings.NewReader("kept"), client.FileOptions{}); err != nil {
		t.Fatal(err)
	}
	sess, err := s.C.CreateSession(c, sb.ID, api.CreateSessionRequest{Command: counter})
	if err != nil {
		t.Fatal(err)
	}
	var out syncBuffer
	st, err := s.C.Attach(c, sess, "")
	if err != nil {
		t.Fatal(err)
	}
	last := ""
	for lastNumber(out.String()) < 20 {
		ev, err := st.Next()
		if err != nil {
			t.Fatal(err)
		}
		if ev.Name == api.EventStdout {
			out.Write(decodeOutput(t, ev.Data))
			last = ev.ID
		}
	}
	st.Close()

	// Pause: the process does not advance.
	s.verb(t, sb.ID, "pause")
	if got := s.state(t, sb.ID); got.State != api.StatePaused {
		t.Fatalf("after pause: %s", got.State)
	}
	if p, err := s.C.GetProcess(c, sb.ID, sess.PID); err != nil || p.State != api.ProcRunning {
		t.Fatalf("counter after pause and automatic wake: %+v %v", p, err)
	}
	if got := s.state(t, sb.ID); got.State != api.StateRunning {
		t.Fatalf("listing processes did not wake the paused sandbox: %s", got.State)
	}

	// Suspend: memory to disk, resources freed, tokens revoked.
	s.verb(t, sb.ID, "suspend")
	got := s.state(t, sb.ID)
	if got.State != api.StateSuspended || got.StatusReason == "" || got.StatusAt == nil {
		t.Fatalf("after suspend: %+v", got)
	}
	if slices.Contains(s.runscIDs(), sb.ID) {
		t.Fatal("a suspended sandbox still has a runsc container")
	}
	if code, _ := status(t, "GET", sess.AttachURL+"?follow=0", sess.Token, nil); code != 401 {
		t.Fatalf("token after suspend: %d", code)
	}
	time.Sleep(2 * time.Second) // let wall-clock time pass while suspended (checked below)
	s.verb(t, sb.ID, "wake")

	// The stream continues exactly where it stopped, and the counter kept its memory.
	sess2, err := s.C.CreateSession(c, sb.ID, api.CreateSessionRequest{PID: sess.PID})
	if err != nil {
		t.Fatal(err)
	}
	st, err = s.C.Attach(c, sess2, last)
	if err != nil {
		t.Fatal(err)
	}
	for len(strings.Split(out.String(), "\n")) < 80 {
		ev, err := st.Next()
		if err != nil {
			t.Fatal(err)
		}
		if ev.Name == api.EventStdout {
			out.Write(decodeOutput(t, ev.Data))
		}
	}
	st.Close()
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	for i, l := range lines {
		if l != strconv.Itoa(i+1) {
			t.Fatalf("line %d is %q: the stream lost, repeated or restarted output", i+1, l)
		}
	}
	outFile, _, _ := s.exec(t, sb.ID, "cat", "/root/before.txt")
	if outFile != "kept" {
		t.Fatalf("file after wake: %q", outFile)
	}
	dateOut, _, _ := s.exec(t, sb.ID, "date", "+%s")
	guest, _ := strconv.ParseInt(strings.TrimSpace(dateOut), 10, 64)
	if d := time.Now().Unix() - guest; d < -2 || d > 2 {
		t.Fatalf("clock after wake is off by %d s", d)
	}
}

// TestStopStartAndIllegal covers stop/start and the transitions that must be refused.
func TestStopStartAndIllegal(t *testing.T) {
	s := start(t, options{})
	sb := s.create(t, api.CreateSandboxRequest{})
	c := ctx(t, 3*time.Minute)
	s.C.WriteFile(c, sb.ID, "/root/disk.txt", strings.NewReader("on disk"), client.FileOptions{})
	conflict := func(id, verb string) {
		t.Helper()
		_, err := s.C.Lifecycle(c, id, verb)
		if ce, ok := err.(*client.Error); !ok || ce.Status != 409 || ce.Message == "" {
			t.Fatalf("%s in state %s: %v, want 409", verb, s.state(t, id).State, err)
		}
	}
	conflict(sb.ID, "resume")
	conflict(sb.ID, "restore")
	conflict(sb.ID, "start")
	s.verb(t, sb.ID, "stop")
	if got := s.state(t, sb.ID); got.State != api.StateStopped {
		t.Fatalf("after stop: %s", got.State)
	}
	conflict(sb.ID, "pause")
	if _, err := s.C.Clone(c, sb.ID, api.CloneRequest{}); err == nil || err.(*client.Error).Status != 409 || !strings.Contains(err.Error(), "stopped") {
		t.Fatalf("clone of a stopped sandbox: %v", err)
	}
	s.verb(t, sb.ID, "start")
	out, _, _ := s.exec(t, sb.ID, "cat", "/root/disk.txt")
	if out != "on disk" || s.state(t, sb.ID).StartPath == "" {
		t.Fatalf("after start: %q", out)
	}
	// Wake of a running sandbox succeeds at once; of a deleted one is a conflict.
	if op := s.verb(t, sb.ID, "wake"); op.State != api.OpSucceeded {
		t.Fatalf("wake running: %+v", op)
	}
	op, _ := s.C.DeleteSandbox(c, sb.ID)
	s.C.WaitOperation(c, op.ID)
	conflict(sb.ID, "wake")
	assertGone(t, s, sb.ID)
}

// TestClones clones a running sandbox twice and a suspended one once: the clones have the
// source's memory and files, their own entropy, and share the disk.
func TestClones(t *testing.T) {
	s := start(t, options{})
	src := s.create(t, api.CreateSandboxRequest{})
	c := ctx(t, 4*time.Minute)
	s.C.WriteFile(c, src.ID, "/root/shared.txt", strings.NewReader("from the source"), client.FileOptions{})
	sess, _ := s.C.CreateSession(c, src.ID, api.CreateSessionRequest{Command: counter})
	st, _ := s.C.Attach(c, sess, "")
	st.Next()
	st.Close()

	clones, err := s.C.Clone(c, src.ID, api.CloneRequest{Count: 2})
	if err != nil || len(clones) != 2 {
		t.Fatalf("clone: %v %v", clones, err)
	}
	seen := map[string]bool{}
	for _, cl := range clones {
		op, err := s.C.WaitOperation(c, cl.Operation.ID)
		if err != nil || op.State != api.OpSucceeded {
			t.Fatalf("clone %s: %+v %v\n%s", cl.ID, op, err, s.Log())
		}
		got := s.state(t, cl.ID)
		if got.CloneOf != src.ID || got.State != api.StateRunning {
			t.Fatalf("clone: %+v", got)
		}
		out, _, _ := s.exec(t, cl.ID, "cat", "/root/shared.txt")
		if out != "from the source" {
			t.Fatalf("clone's file: %q", out)
		}
		// The in-memory counter process came along and keeps counting.
		p, err := s.C.GetProcess(c, cl.ID, sess.PID)
		if err != nil || p.State != api.ProcRunning {
			t.Fatalf("counter in clone: %+v %v", p, err)
		}
		rnd, _, _ := s.exec(t, cl.ID, "sh", "-c", "head -c 16 /dev/urandom | od -An -tx1")
		if seen[rnd] {
			t.Fatal("two clones read the same bytes from /dev/urandom")
		}
		seen[rnd] = true
		// A clone's own writes do not reach the source.
		s.C.WriteFile(c, cl.ID, "/root/shared.txt", strings.NewReader("changed in "+cl.ID), client.FileOptions{})
	}
	if out, _, _ := s.exec(t, src.ID, "cat", "/root/shared.txt"); out != "from the source" {
		t.Fatalf("source's file after the clones wrote theirs: %q", out)
	}
	if p, err := s.C.GetProcess(c, src.ID, sess.PID); err != nil || p.State != api.ProcRunning {
		t.Fatalf("source's counter after cloning: %+v %v", p, err)
	}
	// Clone a suspended sandbox.
	s.verb(t, src.ID, "suspend")
	more, err := s.C.Clone(c, src.ID, api.CloneRequest{Count: 1})
	if err != nil {
		t.Fatal(err)
	}
	if op, err := s.C.WaitOperation(c, more[0].Operation.ID); err != nil || op.State != api.OpSucceeded {
		t.Fatalf("clone of suspended: %+v %v", op, err)
	}
	if s.state(t, src.ID).State != api.StateSuspended {
		t.Fatal("cloning a suspended sandbox woke it")
	}
	if out, _, _ := s.exec(t, more[0].ID, "cat", "/root/shared.txt"); out != "from the source" {
		t.Fatalf("clone of suspended: %q", out)
	}
	got := s.state(t, more[0].ID)
	if got.DiskBytes > 64<<20 {
		t.Fatalf("a fresh clone uses %d bytes of its own", got.DiskBytes)
	}
}

// TestCommandsRideOutCloneCheckpoints runs commands back to back while the sandbox is
// cloned three times. Each clone checkpoints the source: its agent is quiesced (it
// closes its transport), the source is paused, saved and resumed. A command under way
// when that begins reaches the agent first; one that arrives meanwhile waits for the
// source to be back. None fails, and each prints exactly its own output.
func TestCommandsRideOutCloneCheckpoints(t *testing.T) {
	s := start(t, options{})
	src := s.create(t, api.CreateSandboxRequest{})
	c := ctx(t, 4*time.Minute)
	stop := make(chan struct{})
	var ran atomic.Int64
	var slowest atomic.Int64
	errs := make(chan error, 2)
	var wg sync.WaitGroup
	for w := range 2 {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				var out bytes.Buffer
				began := time.Now()
				x, err := s.C.Run(c, src.ID, api.ExecRequest{Argv: []string{"echo", strconv.Itoa(w), strconv.Itoa(i)}}, client.Output{Stdout: &out})
				if err == nil && (x.ExitCode == nil || *x.ExitCode != 0 || out.String() != fmt.Sprintf("%d %d\n", w, i)) {
					err = fmt.Errorf("exit %+v, output %q", x, out.String())
				}
				if err != nil {
					errs <- fmt.Errorf("command %d of worker %d: %w", i, w, err)
					return
				}
				if d := time.Since(began).Milliseconds(); d > slowest.Load() {
					slowest.Store(d)
				}
				ran.Add(1)
			}
		})
	}
	for k := range 3 {
		before := ran.Load()
		clones, err := s.C.Clone(c, src.ID, api.CloneRequest{Count: 1})
		if err != nil || len(clones) != 1 {
			t.Fatalf("clone %d: %v %v", k, clones, err)
		}
		if op, err := s.C.WaitOperation(c, clones[0].Operation.ID); err != nil || op.State != api.OpSucceeded {
			t.Fatalf("clone %d: %+v %v\n%s", k, op, err, s.Log())
		}
		waitFor(t, time.Minute, "commands to go on after the clone", func() bool {
			select {
			case err := <-errs:
				t.Fatalf("%v\n%s", err, s.Log())
			default:
			}
			return ran.Load() >= before+4
		})
	}
	close(stop)
	wg.Wait()
	select {
	case err := <-errs:
		t.Fatalf("%v\n%s", err, s.Log())
	default:
	}
	t.Logf("%d commands ran during 3 clones; the slowest took %d ms", ran.Load(), slowest.Load())
}

// TestIdleSuspendAndAutoWake lets a sandbox idle past its timeout: it is suspended with
// a reason, and a request that needs it running wakes it (unless told not to).
func TestIdleSuspendAndAutoWake(t *testing.T) {
	s := start(t, options{})
	sb := s.create(t, api.CreateSandboxRequest{IdleTimeout: "2s"})
	busy := s.create(t, api.CreateSandboxRequest{IdleTimeout: "6s"})
	c := ctx(t, 3*time.Minute)
	// busy keeps printing: process output is activity.
	sess, _ := s.C.CreateSession(c, busy.ID, api.CreateSessionRequest{Command: "while true; do echo tick; sleep 0.5; done"})
	st, _ := s.C.Attach(c, sess, "")
	st.Next()
	st.Close()
	waitFor(t, time.Minute, "the idle sandbox to be suspended", func() bool {
		return s.state(t, sb.ID).State == api.StateSuspended
	})
	got := s.state(t, sb.ID)
	if !strings.Contains(got.StatusReason, "idle") || got.StatusAt == nil {
		t.Fatalf("suspended sandbox: reason %q at %v", got.StatusReason, got.StatusAt)
	}
	if b := s.state(t, busy.ID); b.State != api.StateRunning {
		t.Fatalf("a sandbox printing output was suspended: %+v", b)
	}
	// ?wake=false: no automatic wake.
	if code, body := status(t, "GET", s.URL+"/v1/sandboxes/"+sb.ID+"/processes?wake=false", s.Key, nil); code != 409 {
		t.Fatalf("processes?wake=false on a suspended sandbox: %d %s", code, body)
	}
	// Exec wakes it.
	out, _, code := s.exec(t, sb.ID, "echo", "woke")
	if code != 0 || out != "woke\n" {
		t.Fatalf("exec on a suspended sandbox: %d %q", code, out)
	}
	if s.state(t, sb.ID).State != api.StateRunning {
		t.Fatal("not running after an automatic wake")
	}
}

// TestWarmPool claims from a pool of 5 with 20 concurrent creates: all succeed, the five
// ready members are claimed (and a member the pool refilled meanwhile may serve a later
// create), none twice; the pool refills and is hidden from listings; moving the
// template's tag drains it.
func TestWarmPool(t *testing.T) {
	s := start(t, options{})
	c := ctx(t, 5*time.Minute)
	// Warm up: the first create builds the base snapshot the pool restores from.
	first := s.create(t, api.CreateSandboxRequest{})
	if _, err := s.C.SetPool(c, api.SetPoolRequest{Template: "base", Size: 5}); err != nil {
		t.Fatal(err)
	}
	ready := func() int {
		pools, err := s.C.ListPools(c)
		if err != nil || len(pools) != 1 {
			t.Fatalf("pools: %v %v", pools, err)
		}
		return pools[0].Ready
	}
	waitFor(t, 3*time.Minute, "the pool to fill", func() bool { return ready() == 5 })
	if list, _ := s.C.ListSandboxes(c, client.ListOptions{}); len(list) != 1 || list[0].ID != first.ID {
		t.Fatalf("pool members are listed: %d sandboxes", len(list))
	}
	var mu sync.Mutex
	var got []*api.Sandbox
	var wg sync.WaitGroup
	errs := make(chan error, 20)
	for i := 0; i < 20; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			sb, err := s.C.CreateAndWait(c, api.CreateSandboxRequest{Env: map[string]string{"N": strconv.Itoa(i)}})
			if err != nil {
				errs <- err
				return
			}
			mu.Lock()
			got = append(got, sb)
			mu.Unlock()
		}(i)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	ids := map[string]bool{}
	fromPool := 0
	for _, sb := range got {
		if ids[sb.ID] {
			t.Fatalf("sandbox %s was handed out twice", sb.ID)
		}
		ids[sb.ID] = true
		if sb.StartPath == "pool" {
			fromPool++
		}
	}
	// The refill starts with the first claim: once a create takes a few hundred
	// milliseconds less than a member's restore and warm command, a refilled member
	// can be ready before the last of the twenty creates is placed.
	if len(got) != 20 || fromPool < 5 {
		t.Fatalf("%d sandboxes, %d from the pool; want 20 and at least 5", len(got), fromPool)
	}
	// A claimed member carries its owner's environment, and it ran the template's warm
	// command (python3 -c pass, docs/templates.md) before it was parked.
	for _, sb := range got {
		if sb.StartPath == "pool" {
			out, _, _ := s.exec(t, sb.ID, "sh", "-c", "echo $N")
			if strings.TrimSpace(out) == "" {
				t.Fatalf("pool sandbox %s lacks its env", sb.ID)
			}
			procs, err := s.C.ListProcesses(c, sb.ID)
			if err != nil {
				t.Fatal(err)
			}
			warmed := false
			for _, p := range procs {
				if strings.Join(p.Argv, " ") == "/usr/bin/python3 -c pass" && p.State == api.ProcExited && p.ExitCode != nil && *p.ExitCode == 0 {
					warmed = true
				}
			}
			if !warmed {
				t.Fatalf("pool sandbox %s shows no warm command that exited 0: %+v", sb.ID, procs)
			}
			break
		}
	}
	waitFor(t, 3*time.Minute, "the pool to refill", func() bool { return ready() == 5 })

	// Move base:latest to another release: the pool drains its old members.
	st, err := store.Open(c, store.Config{URL: s.DBURL, Logger: discard()})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	fake := "sha256:" + strings.Repeat("ab", 32)
	if err := st.PutRelease(c, &store.Release{Digest: fake, Name: "base"}, "latest", ""); err != nil {
		t.Fatal(err)
	}
	st.Notify(c, store.ChannelController, "")
	waitFor(t, time.Minute, "the old pool members to drain", func() bool {
		members, _ := st.PoolMembers(c, store.PoolKey("default", "base:latest", 1, 512))
		for _, m := range members {
			if m.TemplateDigest != fake {
				return false
			}
		}
		return true
	})
	s.C.SetPool(c, api.SetPoolRequest{Template: "base", Size: 0})
}

// TestCrashDuringLifecycle kills space serve in the middle of a suspend, a wake and a
// clone: after a restart each operation has completed or failed cleanly, the sandbox is
// in a consistent state, and nothing leaks.
func TestCrashDuringLifecycle(t *testing.T) {
	s := start(t, options{})
	sb := s.create(t, api.CreateSandboxRequest{})
	c := ctx(t, 5*time.Minute)
	s.C.WriteFile(c, sb.ID, "/root/f", strings.NewReader("x"), client.FileOptions{})

	killDuring := func(verb, during string) *api.Operation {
		t.Helper()
		op, err := s.C.Lifecycle(c, sb.ID, verb)
		if err != nil {
			t.Fatal(err)
		}
		waitFor(t, time.Minute, "state "+during, func() bool {
			got := s.state(t, sb.ID)
			return got.State == during || got.State == got.DesiredState
		})
		s.Kill()
		s.Restart()
		done, err := s.C.WaitOperation(c, op.ID)
		if err != nil {
			t.Fatal(err)
		}
		return done
	}
	op := killDuring("suspend", api.StateSuspending)
	got := s.state(t, sb.ID)
	if op.State == api.OpSucceeded && got.State != api.StateSuspended || op.State == api.OpFailed && got.State == api.StateSuspending {
		t.Fatalf("after a crash during suspend: op %+v, sandbox %s", op, got.State)
	}
	switch got.State {
	case api.StateStopped: // the crash lost the memory mid-checkpoint; the disk is kept
		s.verb(t, sb.ID, "start")
		s.verb(t, sb.ID, "suspend")
	case api.StateRunning:
		s.verb(t, sb.ID, "suspend")
	}
	op = killDuring("wake", api.StateRestoring)
	if op.State != api.OpSucceeded || s.state(t, sb.ID).State != api.StateRunning {
		t.Fatalf("after a crash during wake: op %+v, sandbox %s", op, s.state(t, sb.ID).State)
	}
	if out, _, _ := s.exec(t, sb.ID, "cat", "/root/f"); out != "x" {
		t.Fatalf("file after crash and wake: %q", out)
	}
	clones, err := s.C.Clone(c, sb.ID, api.CloneRequest{Count: 2})
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, time.Minute, "the clone to start", func() bool {
		cl := s.state(t, clones[0].ID)
		return cl.State != api.StatePending
	})
	s.Kill()
	s.Restart()
	for _, cl := range clones {
		op, err := s.C.WaitOperation(c, cl.Operation.ID)
		if err != nil {
			t.Fatal(err)
		}
		got := s.state(t, cl.ID)
		if op.State == api.OpSucceeded && got.State != api.StateRunning || op.State == api.OpFailed && got.State != api.StateFailed {
			t.Fatalf("clone after a crash: op %+v, sandbox %+v", op, got)
		}
	}
	if got := s.state(t, sb.ID); got.State != api.StateRunning {
		t.Fatalf("clone source after a crash: %s", got.State)
	}
	// Everything deleted leaves nothing behind; an orphan directory is reclaimed at start.
	all := append([]string{sb.ID}, clones[0].ID, clones[1].ID)
	for _, id := range all {
		op, _ := s.C.DeleteSandbox(c, id)
		s.C.WaitOperation(c, op.ID)
	}
	orphan := filepath.Join(s.DataDir, "store", "sandboxes", "orphanfromcrash")
	os.MkdirAll(orphan, 0o755)
	s.Stop()
	s.Restart()
	waitFor(t, time.Minute, "the orphan to be reclaimed", func() bool {
		_, err := os.Stat(orphan)
		return os.IsNotExist(err)
	})
	for _, id := range all {
		assertGone(t, s, id)
	}
	ents, _ := os.ReadDir(filepath.Join(s.DataDir, "store", "sandboxes"))
	if len(ents) != 0 {
		var names []string
		for _, e := range ents {
			names = append(names, e.Name())
		}
		t.Fatalf("sandbox storage left: %v", names)
	}
}

// TestStartPaths checks the recorded start path: boot first, then snapshot once the
// base snapshot exists, and that sandboxes from one snapshot do not share entropy.
func TestStartPaths(t *testing.T) {
	s := start(t, options{})
	first := s.create(t, api.CreateSandboxRequest{})
	if first.StartPath != "boot" {
		t.Fatalf("first sandbox start path %q", first.StartPath)
	}
	var a, b *api.Sandbox
	waitFor(t, 2*time.Minute, "a create from the base snapshot", func() bool {
		sb := s.create(t, api.CreateSandboxRequest{})
		if sb.StartPath != "snapshot" {
			return false
		}
		if a == nil {
			a = sb
			return false
		}
		b = sb
		return true
	})
	ra, _, _ := s.exec(t, a.ID, "sh", "-c", "head -c 16 /dev/urandom | od -An -tx1")
	rb, _, _ := s.exec(t, b.ID, "sh", "-c", "head -c 16 /dev/urandom | od -An -tx1")
	if ra == rb {
		t.Fatal("two sandboxes restored from one snapshot read the same random bytes")
	}
	out, _, code := s.exec(t, b.ID, "python3", "-c", "print(6*7)")
	if code != 0 || out != "42\n" {
		t.Fatalf("exec in a snapshot-started sandbox: %d %q", code, out)
	}
}

// TestRunIsMemory: /run is a tmpfs (an eighth of the memory) that starts with the
// template's directories, as a booted Linux machine's: a server's unix socket there (here
// through Debian's /var/run link) is saved by a suspend and answers after the wake, and
// a boot starts /run afresh.
func TestRunIsMemory(t *testing.T) {
	s := start(t, options{})
	sb := s.create(t, api.CreateSandboxRequest{})
	ping := pingSocket("/run/app.sock")
	out, _, code := s.exec(t, sb.ID, "bash", "-c", `stat -f -c %T /run; stat -c '%a %U' /run/lock; df -m --output=size /run | tail -1; `+
		`test -e /run/space/`+rundirs.FileName+` && echo manifest left; `+pongServer("/var/run/app.sock", "/run/app.sock"))
	if want := "tmpfs\n1777\nroot\n64\npong\n"; code != 0 || strings.Join(strings.Fields(out), "\n")+"\n" != want {
		t.Fatalf("/run in a 512 MiB sandbox, and a server on a socket there: %d %q, want %q", code, out, want)
	}
	// The socket is the Sentry's: the suspend saves it, and the server answers after the wake.
	s.verb(t, sb.ID, api.OpSuspend)
	if st := s.state(t, sb.ID); st.State != api.StateSuspended {
		t.Fatalf("suspend with a socket in /run: %+v", st)
	}
	if out, _, code := s.exec(t, sb.ID, "python3", "-c", ping); code != 0 || out != "pong\n" {
		t.Fatalf("the server after the wake: %d %q", code, out)
	}
	// A boot starts /run afresh, with the template's directories again.
	if _, _, code := s.exec(t, sb.ID, "touch", "/run/left"); code != 0 {
		t.Fatal("touch /run/left")
	}
	s.verb(t, sb.ID, api.OpStop)
	s.verb(t, sb.ID, api.OpStart)
	if out, _, code := s.exec(t, sb.ID, "bash", "-c", "ls -A /run | sort | tr '\n' ' '; stat -c %a /run/lock"); code != 0 || out != "lock mount space 1777\n" {
		t.Fatalf("/run after a stop and start: %d %q", code, out)
	}
}

// TestListeningAgentRefusesDiskSocket: a sandbox started before 2026-12-06, whose agent
// listens (runsc --host-uds=create; a failpoints build with
// SPACE_TEST_GVISOR_AGENT_LISTENS=1 starts its sandboxes so, internal/runtime/gvisor),
// makes a unix socket bound on its disk a host socket gVisor cannot save. Its agent
// refuses the quiesce: the suspend fails with an error that names the socket and its
// program, a clone fails the same way, and the sandbox runs on with its processes and
// memory (before 2026-12-03 runsc's failed checkpoint took the instance down). Once
// the program is gone it suspends, and wakes with its listening agent. The idle
// suspender asks again after a refusal, once per idle timeout; a command that comes
// during one of those attempts runs, and once the program is gone the next attempt
// suspends the sandbox. (These were TestSuspendRefusedForDiskSocket and
// TestIdleSuspendAfterRefusal, for every sandbox until the agent connected to the node.)
func TestListeningAgentRefusesDiskSocket(t *testing.T) {
	s := start(t, options{Failpoints: true, Env: []string{"SPACE_TEST_GVISOR_AGENT_LISTENS=1"}})
	sb := s.create(t, api.CreateSandboxRequest{})
	idle := s.create(t, api.CreateSandboxRequest{IdleTimeout: "2s"})
	idlePid := s.diskListener(t, idle.ID)
	if _, _, code := s.exec(t, sb.ID, "bash", "-c", "echo kept > /dev/shm/kept"); code != 0 {
		t.Fatal("write /dev/shm/kept")
	}
	pid := s.diskListener(t, sb.ID)
	c := ctx(t, 4*time.Minute)
	op, err := s.C.LifecycleAndWait(c, sb.ID, api.OpSuspend)
	if err == nil || op == nil || !strings.Contains(op.Error, "/root/app.sock") || !strings.Contains(op.Error, "python3") {
		t.Fatalf("suspend with a socket on the disk: %+v %v", op, err)
	}
	t.Logf("refused: %s", op.Error)
	clones, err := s.C.Clone(c, sb.ID, api.CloneRequest{Count: 1})
	if err != nil || len(clones) != 1 {
		t.Fatalf("clone: %v %v", clones, err)
	}
	if cop, err := s.C.WaitOperation(c, clones[0].Operation.ID); err != nil || cop.State != api.OpFailed || !strings.Contains(cop.Error, "/root/app.sock") {
		t.Errorf("clone with a socket on the disk: %+v %v", cop, err)
	}
	waitFor(t, time.Minute, "the sandbox to run on", func() bool { return s.state(t, sb.ID).State == api.StateRunning })
	if got, _, code := s.exec(t, sb.ID, "bash", "-c", "cat /dev/shm/kept && kill -0 "+pid+" && echo alive"); code != 0 || got != "kept\nalive\n" {
		t.Fatalf("after the refused suspend the sandbox lost its memory or processes: %d %q\n%s", code, got, s.Log())
	}
	if _, _, code := s.exec(t, sb.ID, "bash", "-c", "kill "+pid+"; while kill -0 "+pid+" 2>/dev/null; do sleep 0.05; done"); code != 0 {
		t.Fatal("end the listener")
	}
	s.verb(t, sb.ID, api.OpSuspend)
	if st := s.state(t, sb.ID); st.State != api.StateSuspended {
		t.Fatalf("after the listener ended: %s", st.State)
	}
	if got, _, code := s.exec(t, sb.ID, "cat", "/dev/shm/kept"); code != 0 || got != "kept\n" {
		t.Fatalf("after the wake: %d %q", code, got)
	}

	// The idle sandbox, refused meanwhile. Watched through the store: the API's reads
	// count as activity.
	db, err := store.Open(c, store.Config{URL: s.DBURL, Logger: discard()})
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	state := func() *store.Sandbox {
		got, err := db.GetSandbox(c, idle.ID)
		if err != nil {
			t.Fatal(err)
		}
		return got
	}
	refusals := func() int {
		ops, err := db.SandboxOperations(c, idle.ID, 100)
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for _, op := range ops {
			if op.Kind == api.OpSuspend && op.State == api.OpFailed && strings.Contains(op.Error, "/root/app.sock") {
				n++
			}
		}
		return n
	}
	waitFor(t, time.Minute, "two idle suspends to be refused", func() bool { return refusals() >= 2 })
	if st := state(); st.State != api.StateRunning && st.State != api.StateSuspending {
		t.Fatalf("after the refusals: %s", st.State)
	}
	// This command may come during another attempt: it waits for it and runs.
	if _, _, code := s.exec(t, idle.ID, "bash", "-c", "kill "+idlePid+"; while kill -0 "+idlePid+" 2>/dev/null; do sleep 0.05; done"); code != 0 {
		t.Fatal("end the idle sandbox's listener")
	}
	waitFor(t, time.Minute, "the idle suspender to suspend the sandbox", func() bool { return state().State == api.StateSuspended })
	t.Logf("%d idle refusals, then suspended: %q", refusals(), state().StatusReason)
}

// diskListener starts a program in sandbox id that listens on /root/app.sock (on the
// sandbox's disk) and returns its pid.
func (s *srv) diskListener(t *testing.T, id string) string {
	t.Helper()
	out, _, code := s.exec(t, id, "bash", "-c",
		`nohup python3 -c 'import socket, time; s = socket.socket(socket.AF_UNIX); s.bind("/root/app.sock"); s.listen(); time.sleep(100000)' >/dev/null 2>&1 & `+
			`for i in $(seq 100); do [ -S /root/app.sock ] && break; sleep 0.05; done; echo $!`)
	pid := strings.TrimSpace(out)
	if code != 0 || pid == "" {
		t.Fatalf("start the listener: %d %q", code, out)
	}
	return pid
}

// pongServer is a shell script that starts a server answering "pong" on the unix
// socket it binds at bind (in the background, from /root/server.py), waits for the
// socket at path (bind, or the same through a link) and pings it there (pingSocket).
func pongServer(bind, path string) string {
	return `cat > /root/server.py <<'EOF'
import socket
s = socket.socket(socket.AF_UNIX)
s.bind("` + bind + `")
s.listen()
while True:
    c, _ = s.accept()
    c.sendall(b"pong\n")
    c.close()
EOF
nohup python3 /root/server.py >/dev/null 2>&1 &
for i in $(seq 100); do [ -S ` + path + ` ] && break; sleep 0.05; done; python3 -c '` + pingSocket(path) + `'`
}

// pingSocket is a python3 program that prints what the unix socket at path answers.
func pingSocket(path string) string {
	return `import socket; s = socket.socket(socket.AF_UNIX); s.connect("` + path + `"); print(s.recv(16).decode().strip())`
}

// TestDiskSocketSurvivesSuspend: a server listening on a unix socket bound on the
// sandbox's disk (/root/app.sock) is saved by an idle suspend and answers after the
// wake, and in a clone. Since 2026-12-06 the agent connects to the node (runsc
// --host-uds=open), so such a socket is the Sentry's; before, it was a host socket,
// gVisor refused to checkpoint it, and the sandbox could not be suspended, cloned or
// snapshotted while it existed.
func TestDiskSocketSurvivesSuspend(t *testing.T) {
	s := start(t, options{})
	sb := s.create(t, api.CreateSandboxRequest{IdleTimeout: "2s"})
	ping := pingSocket("/root/app.sock")
	out, _, code := s.exec(t, sb.ID, "bash", "-c", "echo kept > /dev/shm/kept; "+pongServer("/root/app.sock", "/root/app.sock"))
	if code != 0 || out != "pong\n" {
		t.Fatalf("a server on /root/app.sock: %d %q", code, out)
	}
	// Watched through the store: the API's reads count as activity.
	c := ctx(t, 3*time.Minute)
	db, err := store.Open(c, store.Config{URL: s.DBURL, Logger: discard()})
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	waitFor(t, time.Minute, "the idle suspend", func() bool {
		got, err := db.GetSandbox(c, sb.ID)
		if err != nil {
			t.Fatal(err)
		}
		if got.State == api.StateRunning && got.Error != "" {
			t.Fatalf("the suspend failed: %s", got.Error)
		}
		return got.State == api.StateSuspended
	})
	if out, _, code := s.exec(t, sb.ID, "bash", "-c", "cat /dev/shm/kept; python3 -c '"+ping+"'"); code != 0 || out != "kept\npong\n" {
		t.Fatalf("the server after the wake: %d %q", code, out)
	}
	clones, err := s.C.Clone(c, sb.ID, api.CloneRequest{Count: 1})
	if err != nil || len(clones) != 1 {
		t.Fatalf("clone: %v %v", clones, err)
	}
	if op, err := s.C.WaitOperation(c, clones[0].Operation.ID); err != nil || op.State != api.OpSucceeded {
		t.Fatalf("clone with a socket on the disk: %+v %v", op, err)
	}
	if out, _, code := s.exec(t, clones[0].ID, "python3", "-c", ping); code != 0 || out != "pong\n" {
		t.Fatalf("the server in the clone: %d %q", code, out)
	}
}
