package conformance

import (
	"context"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/internal/guest/agentclient"
	"github.com/spacedev/space/internal/guest/wire"
	"github.com/spacedev/space/internal/runtime"
)

func decodeJSON(data []byte, v any) error { return json.Unmarshal(data, v) }

func (s *suite) testHealth(t *testing.T, c *agentclient.Client) {
	h, err := c.Health(s.ctx(t, opTimeout))
	if err != nil {
		t.Fatal(err)
	}
	if h.BootID == "" || h.Generation != 0 {
		t.Errorf("health of a fresh agent: %+v", h)
	}
	if d := time.Since(h.Time); d > time.Minute || d < -time.Minute {
		t.Errorf("agent clock off by %v", d)
	}
}

// testExec: a program's output and exit code come back.
func (s *suite) testExec(t *testing.T, c *agentclient.Client) {
	ctx := s.ctx(t, opTimeout)
	stdout, stderr, exit := run(t, ctx, c, wire.ProcessSpec{Argv: []string{"python3", "-c", "print(6*7)"}})
	if stdout != "42\n" || stderr != "" || exit.ExitCode == nil || *exit.ExitCode != 0 {
		t.Errorf("python3 -c print(6*7): stdout %q stderr %q exit %+v", stdout, stderr, exit)
	}
	_, stderr, exit = run(t, ctx, c, wire.ProcessSpec{Argv: []string{"sh", "-c", "echo oops >&2; exit 3"}})
	if stderr != "oops\n" || exit.ExitCode == nil || *exit.ExitCode != 3 {
		t.Errorf("sh exit 3: stderr %q exit %+v", stderr, exit)
	}
	stdout, _, _ = run(t, ctx, c, wire.ProcessSpec{Argv: []string{"id", "-un"}, User: "user"})
	if stdout != "user\n" {
		t.Errorf("id -un as user: %q", stdout)
	}
}

// testStreamed: output arrives while the program runs, not when it ends.
func (s *suite) testStreamed(t *testing.T, c *agentclient.Client) {
	ctx := s.ctx(t, opTimeout)
	const code = "import time\nfor i in range(5):\n    print('line', i, flush=True)\n    time.sleep(0.3)\n"
	pi, err := c.StartProcess(ctx, wire.ProcessSpec{Argv: []string{"python3", "-c", code}})
	if err != nil {
		t.Fatal(err)
	}
	out, err := c.Output(ctx, pi.PID, 0, true)
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	var got strings.Builder
	var firstAt, exitAt time.Time
	frames := 0
	for exitAt.IsZero() {
		f, err := out.Next()
		if err != nil {
			t.Fatalf("output: %v (so far %q)", err, got.String())
		}
		switch f.Type {
		case wire.FrameStdout:
			if firstAt.IsZero() {
				firstAt = time.Now()
			}
			frames++
			got.Write(f.Payload)
		case wire.FrameExit:
			exitAt = time.Now()
		}
	}
	want := "line 0\nline 1\nline 2\nline 3\nline 4\n"
	if got.String() != want {
		t.Errorf("output %q, want %q", got.String(), want)
	}
	if frames < 3 || exitAt.Sub(firstAt) < 600*time.Millisecond {
		t.Errorf("output not streamed: %d frames, first %v before the exit", frames, exitAt.Sub(firstAt))
	}
}

// testFiles: files written through the agent are read back, listed and seen by
// programs; ownership follows the user.
func (s *suite) testFiles(t *testing.T, c *agentclient.Client) {
	ctx := s.ctx(t, opTimeout)
	content := strings.Repeat("space conformance\n", 1000)
	ei, err := c.WriteFile(ctx, "conf/data.txt", strings.NewReader(content), agentclient.WriteOptions{User: "user", Mode: 0o640})
	if err != nil {
		t.Fatal(err)
	}
	if ei.Path != "/home/user/conf/data.txt" || ei.Size != int64(len(content)) || ei.Owner != "user" || ei.Mode != 0o640 {
		t.Errorf("written entry: %+v", ei)
	}
	rc, size, err := c.ReadFile(ctx, "/home/user/conf/data.txt", agentclient.ReadOptions{})
	if err != nil {
		t.Fatal(err)
	}
	data, err := io.ReadAll(rc)
	rc.Close()
	if err != nil || string(data) != content || size != int64(len(content)) {
		t.Errorf("read back %d bytes (size %d), %v", len(data), size, err)
	}
	entries, err := c.List(ctx, "/home/user/conf", "", 1)
	if err != nil || len(entries) != 1 || entries[0].Name != "data.txt" {
		t.Errorf("list: %+v %v", entries, err)
	}
	if got := python(t, ctx, c, "print(len(open('/home/user/conf/data.txt').read()))"); got != strconv.Itoa(len(content))+"\n" {
		t.Errorf("a program sees %q bytes", got)
	}
}

// testLimits: the instance has the memory and CPUs it was created with.
func (s *suite) testLimits(t *testing.T, c *agentclient.Client) {
	ctx := s.ctx(t, opTimeout)
	// Through a program: the files API takes a file's size from stat, 0 in /proc.
	meminfo := python(t, ctx, c, "print(open('/proc/meminfo').read())")
	var totalKB int64
	for _, line := range strings.Split(meminfo, "\n") {
		if v, ok := strings.CutPrefix(line, "MemTotal:"); ok {
			totalKB, _ = strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
		}
	}
	limitKB := int64(s.f.MemoryMB) << 10
	// A VM's kernel keeps some of its RAM for itself; nothing may exceed the limit.
	if totalKB > limitKB || totalKB < limitKB*3/4 {
		t.Errorf("MemTotal %d kB, want about %d kB (%d MiB)", totalKB, limitKB, s.f.MemoryMB)
	}
	got, err := strconv.Atoi(strings.TrimSpace(python(t, ctx, c, "import os; print(len(os.sched_getaffinity(0)))")))
	if err != nil || (got != s.f.CPU && !s.f.CPUIsQuota) || got < s.f.CPU {
		t.Errorf("CPUs usable: %d (%v), want %d", got, err, s.f.CPU)
	}
	s.notes = append(s.notes, "MemTotal "+strconv.FormatInt(totalKB>>10, 10)+" MiB for "+strconv.Itoa(s.f.MemoryMB)+" MiB")
}

// testPauseResume: a paused instance runs no code; it continues where it was.
func (s *suite) testPauseResume(t *testing.T, spec runtime.Spec, c *agentclient.Client) {
	snap := s.rt.(runtime.Snapshotter)
	ctx := s.ctx(t, opTimeout)
	pid := startCounter(t, ctx, c)
	defer c.Signal(ctx, pid, "KILL")
	before, err := c.GetProcess(ctx, pid)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if err := snap.Pause(ctx, spec.ID); err != nil {
		t.Fatal(err)
	}
	s.timings["pause"] = time.Since(start)
	if st, err := s.rt.Status(ctx, spec.ID); err != nil || st != runtime.StatusPaused {
		t.Errorf("Status while paused: %v %v", st, err)
	}
	// The observation window: unpaused, the counter would print ~15 lines in it.
	const window = 1500 * time.Millisecond
	time.Sleep(window)
	start = time.Now()
	if err := snap.Resume(ctx, spec.ID); err != nil {
		t.Fatal(err)
	}
	s.timings["resume"] = time.Since(start)
	after, err := c.GetProcess(ctx, pid)
	if err != nil {
		t.Fatal(err)
	}
	if st, err := s.rt.Status(ctx, spec.ID); err != nil || st != runtime.StatusRunning {
		t.Errorf("Status after resume: %v %v", st, err)
	}
	// Each line is a number and a newline: at most a few can be printed around the
	// pause (between the two GetProcess calls and the pause/resume calls).
	lines := (after.Written - before.Written) / 3
	if lines > 5 {
		t.Errorf("counter printed about %d lines across a %v pause: the instance was not paused", lines, window)
	}
	nums := counterOutput(t, ctx, c, pid)
	checkSequence(t, nums)
}

// checkpoint is the state the checkpoint case leaves for the clone case.
type checkpoint struct {
	dir     string
	src     runtime.Spec // the checkpointed instance (destroyed; its disk is the checkpoint's)
	counter int          // pid of the counter running in it
}

// testCheckpointRestore: a program's memory state and the files written before a
// checkpoint survive Checkpoint and Restore onto a copy of the disk; the restored agent
// takes its new identity.
func (s *suite) testCheckpointRestore(t *testing.T, src runtime.Spec, c *agentclient.Client) checkpoint {
	snap := s.rt.(runtime.Snapshotter)
	ctx := s.ctx(t, opTimeout)
	pid := startCounter(t, ctx, c)
	if _, err := c.WriteFile(ctx, "/root/before.txt", strings.NewReader("written before the checkpoint"), agentclient.WriteOptions{}); err != nil {
		t.Fatal(err)
	}
	seen := counterOutput(t, ctx, c, pid)

	dir, err := s.store.CheckpointDir(src.ID)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	s.quiesce(t, src, c)
	start := time.Now()
	if err := snap.Checkpoint(ctx, src.ID, dir); err != nil {
		t.Fatalf("Checkpoint: %v\n%s", err, s.diagnose(src))
	}
	s.timings["checkpoint"] = time.Since(start)
	var size int64
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		if fi, err := e.Info(); err == nil {
			size += fi.Size()
		}
	}
	s.notes = append(s.notes, "checkpoint size "+strconv.FormatInt(size>>20, 10)+" MiB")
	if st, err := s.rt.Status(ctx, src.ID); err != nil || st != runtime.StatusStopped {
		t.Errorf("Status after Checkpoint: %v %v, want stopped", st, err)
	}
	s.destroy(t, src)

	dst := s.copyRoot(t, src, "rest")
	start = time.Now()
	if err := snap.Restore(ctx, dst, dir); err != nil {
		t.Fatalf("Restore: %v\n%s", err, s.diagnose(dst))
	}
	s.timings["restore call"] = time.Since(start)
	s.track(dst)
	rc := s.client(dst.ID)
	h := s.resume(t, dst, rc, identity(1, dst.ID))
	s.timings["restore to agent with new identity"] = time.Since(start)
	if h.Generation != 1 {
		t.Errorf("generation after restore: %d", h.Generation)
	}
	s.rss("restored instance", dst)

	pi, err := rc.GetProcess(ctx, pid)
	if err != nil || pi.State != wire.StateRunning {
		t.Fatalf("counter after restore: %+v %v", pi, err)
	}
	// The counter goes on from where it was: its output continues the numbers printed
	// before the checkpoint, without a restart.
	deadline := time.Now().Add(opTimeout)
	var nums []int
	for {
		nums = counterOutput(t, ctx, rc, pid)
		if len(nums) > len(seen)+3 || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond) // polling the process's output
	}
	checkSequence(t, nums)
	if len(nums) <= len(seen)+3 {
		t.Errorf("counter did not continue after restore: %d numbers before, %d after", len(seen), len(nums))
	}
	if got := readFile(t, ctx, rc, "/root/before.txt"); got != "written before the checkpoint" {
		t.Errorf("file written before the checkpoint: %q", got)
	}
	s.destroy(t, dst)
	return checkpoint{dir: dir, src: src, counter: pid}
}

func readFile(t *testing.T, ctx context.Context, c *agentclient.Client, path string) string {
	t.Helper()
	rc, _, err := c.ReadFile(ctx, path, agentclient.ReadOptions{})
	if err != nil {
		t.Fatalf("read %s: %v", path, err)
	}
	defer rc.Close()
	data, err := io.ReadAll(rc)
	if err != nil {
		t.Fatalf("read %s: %v", path, err)
	}
	return string(data)
}

// testClone: two instances restored from one checkpoint onto two copies of its disk
// both run, are independent, and differ in their randomness once they got their own
// identities.
func (s *suite) testClone(t *testing.T, cp checkpoint) []runtime.Spec {
	snap := s.rt.(runtime.Snapshotter)
	ctx := s.ctx(t, readyTimeout)
	var clones []runtime.Spec
	var clients []*agentclient.Client
	for i, name := range []string{"clonea", "cloneb"} {
		spec := s.copyRoot(t, cp.src, name)
		start := time.Now()
		if err := snap.Restore(ctx, spec, cp.dir); err != nil {
			t.Fatalf("Restore %s: %v\n%s", name, err, s.diagnose(spec))
		}
		s.track(spec)
		c := s.client(spec.ID)
		s.resume(t, spec, c, identity(int64(i+1), spec.ID))
		s.timings["clone restore to agent ("+name+")"] = time.Since(start)
		clones = append(clones, spec)
		clients = append(clients, c)
	}
	var randoms []string
	for i, c := range clients {
		pi, err := c.GetProcess(ctx, cp.counter)
		if err != nil || pi.State != wire.StateRunning {
			t.Errorf("counter in clone %d: %+v %v", i, pi, err)
		}
		randoms = append(randoms, python(t, ctx, c, "import os; print(os.urandom(16).hex())"))
	}
	if randoms[0] == randoms[1] {
		t.Errorf("clones read the same /dev/urandom bytes after their identities: %s", randoms[0])
	}
	// Their disks are independent.
	if _, err := clients[0].WriteFile(ctx, "/root/only-in-a.txt", strings.NewReader("a"), agentclient.WriteOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := clients[1].Stat(ctx, "/root/only-in-a.txt", ""); agentclient.StatusOf(err) != 404 {
		t.Errorf("file written in one clone visible in the other: %v", err)
	}
	return clones
}

// testNodeRestart: a new runtime object over the same host state (what a restarted
// node makes) lists, adopts and reaches a running instance.
func (s *suite) testNodeRestart(t *testing.T, spec runtime.Spec) {
	ctx := s.ctx(t, readyTimeout)
	if c, ok := s.rt.(io.Closer); ok {
		if err := c.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	}
	s.rt = s.f.New(t, s.rootDir)
	list, err := s.rt.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.ContainsFunc(list, func(i runtime.Instance) bool { return i.ID == spec.ID && i.Status == runtime.StatusRunning }) {
		t.Errorf("new runtime's List lacks running %s: %v", spec.ID, list)
	}
	start := time.Now()
	if err := s.rt.Adopt(ctx, spec); err != nil {
		t.Fatalf("Adopt: %v", err)
	}
	c := s.client(spec.ID)
	if _, err := c.WaitReady(ctx); err != nil {
		t.Fatalf("adopted agent: %v", err)
	}
	s.timings["adopt to agent"] = time.Since(start)
	procs, err := c.ListProcesses(ctx)
	if err != nil || len(procs) == 0 {
		t.Errorf("processes of the adopted instance: %v %v", procs, err)
	}
	wrong := spec
	wrong.StateDir = filepath.Join(s.rootDir, "elsewhere")
	if err := s.rt.Adopt(ctx, wrong); err == nil {
		t.Error("Adopt with another StateDir succeeded")
	}
}

// testDestroyAll: destroying every instance leaves nothing; List is empty.
func (s *suite) testDestroyAll(t *testing.T) {
	s.mu.Lock()
	var live []runtime.Spec
	for _, spec := range s.live {
		live = append(live, spec)
	}
	s.mu.Unlock()
	for _, spec := range live {
		start := time.Now()
		s.destroy(t, spec)
		s.timings["destroy"] = time.Since(start)
	}
	list, err := s.rt.List(s.ctx(t, opTimeout))
	if err != nil || len(list) != 0 {
		t.Errorf("List after destroying everything: %v %v", list, err)
	}
	if err := s.rt.Destroy(s.ctx(t, opTimeout), newID("never")); err != nil {
		t.Errorf("Destroy of an unknown id: %v", err)
	}
}
