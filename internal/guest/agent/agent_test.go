package agent_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/guest/agent"
	"github.com/spacedev/space/internal/guest/agentclient"
	"github.com/spacedev/space/internal/guest/agentlink"
	"github.com/spacedev/space/internal/guest/wire"
)

// testReaper is the one reaper of this test binary, shared by every agent the tests
// start (there must be one per OS process). Set once in TestMain.
var testReaper *agent.Reaper

func TestMain(m *testing.M) {
	agent.MaybeRunGate() // gated processes re-execute this test binary
	r, err := agent.NewReaper(agent.ReaperConfig{})
	if err != nil {
		fmt.Fprintln(os.Stderr, "reaper:", err)
		os.Exit(1)
	}
	testReaper = r
	code := m.Run()
	r.Close()
	os.Exit(code)
}

func needRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (switching users, chown)")
	}
}

func needTools(t *testing.T, tools ...string) {
	t.Helper()
	for _, tool := range tools {
		// LookPath only inspects PATH; nothing is started (the reaper owns children).
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("needs %s in PATH", tool)
		}
	}
}

func testLogger() *slog.Logger {
	if os.Getenv("AGENT_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.DiscardHandler)
}

// testEnv is a running agent and a client for it.
type testEnv struct {
	a      *agent.Agent
	c      *agentclient.Client
	dir    string // world-traversable scratch directory
	sock   string
	runDir string
	home   string // home of the test user "user" (uid 4242)
}

// tempDir makes a directory that other users can traverse (t.TempDir's parent is
// private to root, so processes run as another user could not reach it), with a
// short path (unix socket paths are limited to 108 bytes).
func tempDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "agt")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// startAgent runs an agent on a unix socket. The agent resolves users from a copy of
// the host's passwd/group plus "user" (uid/gid 4242) whose home is in the scratch dir.
func startAgent(t *testing.T, mod func(*agent.Config)) *testEnv {
	t.Helper()
	needTools(t, "sh")
	dir := tempDir(t)
	etc := filepath.Join(dir, "etc")
	home := filepath.Join(dir, "home", "user")
	for _, d := range []string{etc, home} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if os.Geteuid() == 0 {
		if err := os.Chown(home, 4242, 4242); err != nil {
			t.Fatal(err)
		}
	}
	for name, extra := range map[string]string{
		"passwd": "user:x:4242:4242:Test User:" + home + ":/bin/sh\n",
		"group":  "user:x:4242:\nextra:x:4343:user\n",
	} {
		host, err := os.ReadFile("/etc/" + name)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(etc, name), append(host, extra...), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	env := &testEnv{dir: dir, home: home, runDir: filepath.Join(dir, "run")}
	env.sock = filepath.Join(env.runDir, wire.AgentSocketName)
	cfg := agent.Config{
		Listen:    "unix:" + env.sock,
		Reaper:    testReaper,
		Logger:    testLogger(),
		EtcDir:    etc,
		StateDir:  filepath.Join(dir, "state"),
		StopGrace: 2 * time.Second,
		Version:   "test",
	}
	if mod != nil {
		mod(&cfg)
	}
	a, err := agent.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	env.a = a
	dial := agentclient.DialUnix(env.sock)
	if path, ok := strings.CutPrefix(cfg.Listen, "connect:"); ok {
		// The agent connects to the host: listen as the node does (gvisor link.go).
		dial = hostLink(t, path)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	env.c = agentclient.New(dial)
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("agent Run: %v", err)
		}
		env.c.CloseIdleConnections()
	})
	wctx, wcancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer wcancel()
	if _, err := env.c.WaitReady(wctx); err != nil {
		t.Fatal(err)
	}
	return env
}

func testCtx(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// result is everything an output stream delivered.
type result struct {
	stdout, stderr, all []byte
	started             bool
	startPID            int
	exit                *wire.Exit
	gaps                []gapFrame
	heartbeats          int
	firstDataOffset     int64
	endOffset           int64
}

type gapFrame struct{ offset, dropped int64 }

// consume reads an output stream to its end, checking offsets are contiguous.
func consume(t *testing.T, s *agentclient.OutputStream, from int64) result {
	t.Helper()
	defer s.Close()
	r := result{firstDataOffset: -1}
	pos := from
	for {
		f, err := s.Next()
		if errors.Is(err, io.EOF) {
			r.endOffset = pos
			return r
		}
		if err != nil {
			t.Fatalf("output stream: %v", err)
		}
		switch f.Type {
		case wire.FrameStart:
			var st wire.Start
			if err := json.Unmarshal(f.Payload, &st); err != nil {
				t.Fatalf("start frame: %v", err)
			}
			if r.started || len(r.all) > 0 {
				t.Fatalf("start frame after output or twice")
			}
			r.started, r.startPID = true, st.PID
		case wire.FrameStdout, wire.FrameStderr:
			if !r.started {
				t.Fatalf("output before the start frame")
			}
			if f.Offset != pos {
				t.Fatalf("frame at offset %d, want %d", f.Offset, pos)
			}
			if r.firstDataOffset < 0 {
				r.firstDataOffset = f.Offset
			}
			if f.Type == wire.FrameStdout {
				r.stdout = append(r.stdout, f.Payload...)
			} else {
				r.stderr = append(r.stderr, f.Payload...)
			}
			r.all = append(r.all, f.Payload...)
			pos += int64(len(f.Payload))
		case wire.FrameGap:
			dropped := int64(binary.BigEndian.Uint64(f.Payload))
			if f.Offset != pos+dropped {
				t.Fatalf("gap frame offset %d, want %d+%d", f.Offset, pos, dropped)
			}
			r.gaps = append(r.gaps, gapFrame{f.Offset, dropped})
			pos = f.Offset
		case wire.FrameExit:
			var ex wire.Exit
			if err := json.Unmarshal(f.Payload, &ex); err != nil {
				t.Fatalf("exit frame: %v", err)
			}
			r.exit = &ex
		case wire.FrameHeartbeat:
			r.heartbeats++
		default:
			t.Fatalf("unknown frame type %d", f.Type)
		}
	}
}

// run starts spec and follows its output to the exit.
func (e *testEnv) run(t *testing.T, spec wire.ProcessSpec) (wire.ProcessInfo, result) {
	t.Helper()
	ctx := testCtx(t, 30*time.Second)
	pi, err := e.c.StartProcess(ctx, spec)
	if err != nil {
		t.Fatalf("start %v: %v", spec.Argv, err)
	}
	s, err := e.c.Output(ctx, pi.PID, 0, true)
	if err != nil {
		t.Fatal(err)
	}
	r := consume(t, s, 0)
	if r.exit == nil {
		t.Fatalf("%v: no exit frame", spec.Argv)
	}
	return pi, r
}

func exitCode(t *testing.T, ex *wire.Exit) int {
	t.Helper()
	if ex == nil || ex.ExitCode == nil {
		t.Fatalf("no exit code in %+v", ex)
	}
	return *ex.ExitCode
}

func wantAgentError(t *testing.T, err error, status int, code string) {
	t.Helper()
	var ae *agentclient.Error
	if !errors.As(err, &ae) {
		t.Fatalf("got %v, want agent error %d %s", err, status, code)
	}
	if ae.Status != status || (code != "" && ae.Code != code) {
		t.Fatalf("got %d %s (%s), want %d %s", ae.Status, ae.Code, ae.Message, status, code)
	}
}

func TestExitCodesAndStreams(t *testing.T) {
	e := startAgent(t, nil)
	pi, r := e.run(t, wire.ProcessSpec{Argv: []string{"sh", "-c", "echo out; echo err >&2; exit 3"}})
	if got := exitCode(t, r.exit); got != 3 {
		t.Fatalf("exit code %d", got)
	}
	if string(r.stdout) != "out\n" || string(r.stderr) != "err\n" || !r.started || r.startPID != pi.PID {
		t.Fatalf("stdout %q stderr %q started %v pid %d/%d", r.stdout, r.stderr, r.started, r.startPID, pi.PID)
	}
	if pi.PID <= 1 || pi.State != wire.StateRunning || pi.StartedAt == nil {
		t.Fatalf("process info %+v", pi)
	}
	got, err := e.c.GetProcess(testCtx(t, 5*time.Second), pi.PID)
	if err != nil {
		t.Fatal(err)
	}
	if got.State != wire.StateExited || got.ExitCode == nil || *got.ExitCode != 3 || got.EndedAt == nil || got.Written != 8 {
		t.Fatalf("after exit: %+v", got)
	}
	// A child that exits before the agent finishes recording its start must still end
	// up exited, with its start before its end.
	for i := 0; i < 50; i++ {
		pi, r := e.run(t, wire.ProcessSpec{Argv: []string{"true"}})
		if exitCode(t, r.exit) != 0 || len(r.all) != 0 {
			t.Fatalf("true: %+v", r)
		}
		got, err := e.c.GetProcess(testCtx(t, 5*time.Second), pi.PID)
		if err != nil {
			t.Fatal(err)
		}
		if got.State != wire.StateExited || got.StartedAt == nil || got.EndedAt == nil || got.EndedAt.Before(*got.StartedAt) {
			t.Fatalf("true, run %d: %+v", i, got)
		}
	}
	_, err = e.c.GetProcess(testCtx(t, 5*time.Second), 999999)
	wantAgentError(t, err, 404, wire.ErrCodeProcessNotFound)
}

func TestEnvCwdUser(t *testing.T) {
	needRoot(t)
	e := startAgent(t, nil)
	ctx := testCtx(t, 10*time.Second)
	if err := e.c.SetIdentity(ctx, wire.Identity{Generation: 1, Env: map[string]string{"SANDBOX": "s", "OVER": "identity"}}); err != nil {
		t.Fatal(err)
	}
	script := `echo "$(id -u) $(id -g) $(id -G)"; echo "$HOME|$USER|$LOGNAME|$PATH"; echo "$SANDBOX $OVER $X"; pwd`
	_, r := e.run(t, wire.ProcessSpec{
		Argv: []string{"sh", "-c", script},
		User: "user",
		Env:  map[string]string{"OVER": "spec", "X": "1"},
	})
	want := fmt.Sprintf("4242 4242 4242 4343\n%s|user|user|/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\ns spec 1\n%s\n", e.home, e.home)
	if string(r.all) != want || exitCode(t, r.exit) != 0 {
		t.Fatalf("got %q (stderr %q), want %q", r.all, r.stderr, want)
	}
	// nobody from the host's passwd: home /nonexistent does not exist, so cwd is /.
	_, r = e.run(t, wire.ProcessSpec{Argv: []string{"sh", "-c", "id -un; pwd"}, User: "nobody", Cwd: ""})
	if string(r.all) != "nobody\n/\n" {
		t.Fatalf("nobody: %q", r.all)
	}
	// Relative cwd is relative to the home.
	if err := os.Mkdir(filepath.Join(e.home, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	_, r = e.run(t, wire.ProcessSpec{Argv: []string{"pwd"}, User: "user", Cwd: "sub"})
	if string(r.all) != filepath.Join(e.home, "sub")+"\n" {
		t.Fatalf("relative cwd: %q", r.all)
	}
	_, err := e.c.StartProcess(ctx, wire.ProcessSpec{Argv: []string{"true"}, User: "nosuchuser"})
	wantAgentError(t, err, 400, wire.ErrCodeUnknownUser)
	_, err = e.c.StartProcess(ctx, wire.ProcessSpec{Argv: []string{"true"}, Cwd: "/nonexistent/dir"})
	wantAgentError(t, err, 400, wire.ErrCodeBadRequest)
	_, err = e.c.StartProcess(ctx, wire.ProcessSpec{})
	wantAgentError(t, err, 400, wire.ErrCodeBadRequest)
}

func TestExecFailures(t *testing.T) {
	e := startAgent(t, nil)
	ctx := testCtx(t, 10*time.Second)
	_, err := e.c.StartProcess(ctx, wire.ProcessSpec{Argv: []string{"no-such-program-x"}})
	wantAgentError(t, err, 400, wire.ErrCodeExecFailed)

	notExec := filepath.Join(e.dir, "script")
	if err := os.WriteFile(notExec, []byte("#!/bin/sh\necho hi\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		argv []string
		code int
		msg  string
	}{
		{[]string{"no-such-program-x"}, 127, "not found"},
		{[]string{"/no/such/program"}, 127, "no such file"},
		{[]string{notExec}, 126, "permission denied"},
	} {
		pi, err := e.c.StartProcess(ctx, wire.ProcessSpec{Argv: tc.argv, Gated: true})
		if err != nil {
			t.Fatal(err)
		}
		if err := e.c.Start(ctx, pi.PID); err != nil {
			t.Fatal(err)
		}
		s, err := e.c.Output(ctx, pi.PID, 0, true)
		if err != nil {
			t.Fatal(err)
		}
		r := consume(t, s, 0)
		if exitCode(t, r.exit) != tc.code || !strings.Contains(r.exit.Error, tc.msg) {
			t.Errorf("%v: exit %+v, want code %d and %q", tc.argv, r.exit, tc.code, tc.msg)
		}
		if info, err := e.c.Proc(pi.PID, pi.UID).Info(ctx); err != nil || info.Error != r.exit.Error {
			t.Errorf("%v: process record %+v %v, want the exit's error", tc.argv, info, err)
		}
	}
}

func TestGatedStart(t *testing.T) {
	needRoot(t)
	// No heartbeat could unblock an attach that waits for a first frame.
	e := startAgent(t, func(c *agent.Config) { c.HeartbeatInterval = time.Hour })
	ctx := testCtx(t, 20*time.Second)
	pi, err := e.c.StartProcess(ctx, wire.ProcessSpec{
		// It runs for a second, so that the second start below meets it running (without
		// the sleep it had once exited already: CI, 2026-12-07).
		Argv:  []string{"sh", "-c", `echo first; echo "second $(id -u)" >&2; sleep 1; echo third`},
		Gated: true,
		User:  "user",
		Tag:   "t1",
	})
	if err != nil {
		t.Fatal(err)
	}
	if pi.State != wire.StateCreated || pi.StartedAt != nil || pi.Tag != "t1" {
		t.Fatalf("gated process: %+v", pi)
	}
	// Attach before the program runs; nothing may be missed.
	s, err := e.c.Output(ctx, pi.PID, 0, true)
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan result, 1)
	go func() { got <- consume(t, s, 0) }()
	if cur, err := e.c.GetProcess(ctx, pi.PID); err != nil || cur.State != wire.StateCreated || cur.Written != 0 {
		t.Fatalf("before start: %+v, %v", cur, err)
	}
	if err := e.c.Start(ctx, pi.PID); err != nil {
		t.Fatal(err)
	}
	if err := e.c.Start(ctx, pi.PID); err != nil {
		t.Fatalf("second start: %v", err)
	}
	r := <-got
	if !r.started || r.startPID != pi.PID || r.firstDataOffset != 0 {
		t.Fatalf("start %v pid %d first offset %d", r.started, r.startPID, r.firstDataOffset)
	}
	if string(r.stdout) != "first\nthird\n" || string(r.stderr) != "second 4242\n" || exitCode(t, r.exit) != 0 || r.exit.Error != "" {
		t.Fatalf("stdout %q stderr %q exit %+v", r.stdout, r.stderr, r.exit)
	}
	err = e.c.Start(ctx, pi.PID)
	wantAgentError(t, err, 409, "")

	// A gated process killed before it starts never runs and reports the signal.
	pi, err = e.c.StartProcess(ctx, wire.ProcessSpec{Argv: []string{"sh", "-c", "echo never"}, Gated: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := e.c.Signal(ctx, pi.PID, "KILL"); err != nil {
		t.Fatal(err)
	}
	s, err = e.c.Output(ctx, pi.PID, 0, true)
	if err != nil {
		t.Fatal(err)
	}
	r = consume(t, s, 0)
	if r.started || len(r.all) != 0 || r.exit == nil || r.exit.Signal != "SIGKILL" {
		t.Fatalf("killed gate: %+v", r)
	}
}

// follower collects a followed output stream in the background.
type follower struct {
	mu   sync.Mutex
	buf  bytes.Buffer
	res  chan result
	cond chan struct{}
}

func follow(t *testing.T, c *agentclient.Client, pid int) *follower {
	t.Helper()
	s, err := c.Output(testCtx(t, 30*time.Second), pid, 0, true)
	if err != nil {
		t.Fatal(err)
	}
	f := &follower{res: make(chan result, 1), cond: make(chan struct{}, 1)}
	go func() {
		defer s.Close()
		var r result
		for {
			fr, err := s.Next()
			if err != nil {
				f.res <- r
				return
			}
			switch fr.Type {
			case wire.FrameStdout, wire.FrameStderr:
				f.mu.Lock()
				f.buf.Write(fr.Payload)
				f.mu.Unlock()
				select {
				case f.cond <- struct{}{}:
				default:
				}
			case wire.FrameExit:
				var ex wire.Exit
				_ = json.Unmarshal(fr.Payload, &ex)
				r.exit = &ex
			}
		}
	}()
	return f
}

// waitFor waits until the output contains s (count times).
func (f *follower) waitFor(t *testing.T, s string, count int) {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for {
		f.mu.Lock()
		n := strings.Count(f.buf.String(), s)
		f.mu.Unlock()
		if n >= count {
			return
		}
		select {
		case <-f.cond:
		case <-deadline:
			f.mu.Lock()
			defer f.mu.Unlock()
			t.Fatalf("output never contained %q x%d: %q", s, count, f.buf.String())
		}
	}
}

func TestPTY(t *testing.T) {
	needTools(t, "tty", "stty")
	e := startAgent(t, nil)
	ctx := testCtx(t, 20*time.Second)
	_, r := e.run(t, wire.ProcessSpec{Argv: []string{"sh", "-c", "tty; stty size; echo $TERM"}, PTY: &wire.Size{Rows: 24, Cols: 80}})
	out := string(r.stdout)
	if !strings.Contains(out, "/dev/pts/") || !strings.Contains(out, "24 80") || !strings.Contains(out, "xterm-256color") || len(r.stderr) != 0 {
		t.Fatalf("pty output %q stderr %q", out, r.stderr)
	}

	pi, err := e.c.StartProcess(ctx, wire.ProcessSpec{Argv: []string{"sh"}, PTY: &wire.Size{Rows: 24, Cols: 80}})
	if err != nil {
		t.Fatal(err)
	}
	if !pi.PTY || !pi.Stdin {
		t.Fatalf("info %+v", pi)
	}
	f := follow(t, e.c, pi.PID)
	if err := e.c.WriteStdin(ctx, pi.PID, strings.NewReader("stty size\n"), false); err != nil {
		t.Fatal(err)
	}
	f.waitFor(t, "24 80", 1)
	if err := e.c.Resize(ctx, pi.PID, wire.Size{Rows: 30, Cols: 100}); err != nil {
		t.Fatal(err)
	}
	if err := e.c.WriteStdin(ctx, pi.PID, strings.NewReader("stty size\n"), false); err != nil {
		t.Fatal(err)
	}
	f.waitFor(t, "30 100", 1)
	// eof on a terminal sends ^D: the shell exits.
	if err := e.c.WriteStdin(ctx, pi.PID, nil, true); err != nil {
		t.Fatal(err)
	}
	res := <-f.res
	if exitCode(t, res.exit) != 0 {
		t.Fatalf("shell exit %+v", res.exit)
	}
	err = e.c.Resize(ctx, pi.PID, wire.Size{Rows: 1, Cols: 1})
	wantAgentError(t, err, 409, "")

	plain, err := e.c.StartProcess(ctx, wire.ProcessSpec{Argv: []string{"true"}})
	if err != nil {
		t.Fatal(err)
	}
	err = e.c.Resize(ctx, plain.PID, wire.Size{Rows: 10, Cols: 10})
	wantAgentError(t, err, 409, wire.ErrCodeNotPTY)
}

func TestStdin(t *testing.T) {
	needTools(t, "cat")
	e := startAgent(t, nil)
	ctx := testCtx(t, 20*time.Second)
	pi, err := e.c.StartProcess(ctx, wire.ProcessSpec{Argv: []string{"cat"}, Stdin: true})
	if err != nil {
		t.Fatal(err)
	}
	f := follow(t, e.c, pi.PID)
	if err := e.c.WriteStdin(ctx, pi.PID, strings.NewReader("hello "), false); err != nil {
		t.Fatal(err)
	}
	f.waitFor(t, "hello ", 1)
	big := bytes.Repeat([]byte("0123456789abcdef"), 1<<16) // 1 MiB, more than a pipe holds
	if err := e.c.WriteStdin(ctx, pi.PID, io.MultiReader(bytes.NewReader(big), strings.NewReader("world")), true); err != nil {
		t.Fatal(err)
	}
	res := <-f.res
	f.mu.Lock()
	got := f.buf.Bytes()
	f.mu.Unlock()
	if !bytes.Equal(got, append(append([]byte("hello "), big...), "world"...)) || exitCode(t, res.exit) != 0 {
		t.Fatalf("cat echoed %d bytes, exit %+v", len(got), res.exit)
	}
	err = e.c.WriteStdin(ctx, pi.PID, strings.NewReader("late"), false)
	wantAgentError(t, err, 409, wire.ErrCodeStdinUnavailable)

	noStdin, err := e.c.StartProcess(ctx, wire.ProcessSpec{Argv: []string{"cat"}})
	if err != nil {
		t.Fatal(err)
	}
	err = e.c.WriteStdin(ctx, noStdin.PID, strings.NewReader("x"), false)
	wantAgentError(t, err, 409, wire.ErrCodeStdinUnavailable)
	// cat on /dev/null exits at once.
	s, err := e.c.Output(ctx, noStdin.PID, 0, true)
	if err != nil {
		t.Fatal(err)
	}
	if r := consume(t, s, 0); exitCode(t, r.exit) != 0 {
		t.Fatalf("cat </dev/null: %+v", r.exit)
	}
}

// A program that never reads its stdin must not pin a stdin request beyond the
// client's deadline, for a pipe or a terminal.
func TestStdinNotRead(t *testing.T) {
	needTools(t, "sleep")
	e := startAgent(t, nil)
	ctx := testCtx(t, 10*time.Second)
	for _, spec := range []wire.ProcessSpec{
		{Argv: []string{"sleep", "100"}, Stdin: true},
		{Argv: []string{"sleep", "100"}, PTY: &wire.Size{Rows: 24, Cols: 80}},
	} {
		pi, err := e.c.StartProcess(ctx, spec)
		if err != nil {
			t.Fatal(err)
		}
		wctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
		err = e.c.WriteStdin(wctx, pi.PID, bytes.NewReader(make([]byte, 8<<20)), false)
		cancel()
		if err == nil {
			t.Fatalf("pty=%v: 8 MiB written to a program that does not read", spec.PTY != nil)
		}
		// The agent gave up on that write too: stdin is usable again (an empty write
		// only succeeds once the earlier request let go of the stdin).
		for {
			wctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
			err := e.c.WriteStdin(wctx, pi.PID, nil, false)
			cancel()
			if err == nil {
				break
			}
			if ctx.Err() != nil {
				t.Fatalf("pty=%v: stdin still held by the abandoned request", spec.PTY != nil)
			}
		}
		// The process can be stopped and reports its exit.
		if err := e.c.Signal(ctx, pi.PID, "KILL"); err != nil {
			t.Fatal(err)
		}
		s, err := e.c.Output(ctx, pi.PID, 0, true)
		if err != nil {
			t.Fatal(err)
		}
		if r := consume(t, s, 0); r.exit == nil || r.exit.Signal != "SIGKILL" {
			t.Fatalf("pty=%v: exit %+v", spec.PTY != nil, r.exit)
		}
	}
}

func TestStdinStallTimeout(t *testing.T) {
	needTools(t, "sleep")
	e := startAgent(t, func(c *agent.Config) { c.StdinStallTimeout = 300 * time.Millisecond })
	ctx := testCtx(t, 10*time.Second)
	pi, err := e.c.StartProcess(ctx, wire.ProcessSpec{Argv: []string{"sleep", "100"}, Stdin: true})
	if err != nil {
		t.Fatal(err)
	}
	// The client waits; the agent answers once the process has read nothing for 300 ms.
	err = e.c.WriteStdin(ctx, pi.PID, bytes.NewReader(make([]byte, 8<<20)), false)
	wantAgentError(t, err, 409, wire.ErrCodeStdinStalled)
	if err := e.c.Signal(ctx, pi.PID, "KILL"); err != nil {
		t.Fatal(err)
	}
}

func TestSignals(t *testing.T) {
	needTools(t, "sleep")
	e := startAgent(t, nil)
	ctx := testCtx(t, 20*time.Second)
	for _, tc := range []struct{ sig, want string }{
		{"TERM", "SIGTERM"}, {"sigint", "SIGINT"}, {"9", "SIGKILL"}, {"SIGUSR1", "SIGUSR1"},
	} {
		pi, err := e.c.StartProcess(ctx, wire.ProcessSpec{Argv: []string{"sleep", "100"}})
		if err != nil {
			t.Fatal(err)
		}
		err = e.c.Signal(ctx, pi.PID, "BOGUS")
		wantAgentError(t, err, 400, wire.ErrCodeUnknownSignal)
		if err := e.c.Signal(ctx, pi.PID, tc.sig); err != nil {
			t.Fatal(err)
		}
		s, err := e.c.Output(ctx, pi.PID, 0, true)
		if err != nil {
			t.Fatal(err)
		}
		r := consume(t, s, 0)
		if r.exit == nil || r.exit.Signal != tc.want || r.exit.ExitCode != nil {
			t.Fatalf("signal %s: exit %+v", tc.sig, r.exit)
		}
		err = e.c.Signal(ctx, pi.PID, "TERM")
		wantAgentError(t, err, 409, "")
	}
	// The whole group gets the signal: the shell's child too.
	pi, err := e.c.StartProcess(ctx, wire.ProcessSpec{Argv: []string{"sh", "-c", "sleep 100; echo after"}})
	if err != nil {
		t.Fatal(err)
	}
	if err := e.c.Signal(ctx, pi.PID, "TERM"); err != nil {
		t.Fatal(err)
	}
	s, err := e.c.Output(ctx, pi.PID, 0, true)
	if err != nil {
		t.Fatal(err)
	}
	if r := consume(t, s, 0); r.exit.Signal != "SIGTERM" || len(r.all) != 0 {
		t.Fatalf("group signal: %+v %q", r.exit, r.all)
	}
}

func TestTimeout(t *testing.T) {
	needTools(t, "sleep")
	e := startAgent(t, nil)
	start := time.Now()
	pi, r := e.run(t, wire.ProcessSpec{Argv: []string{"sh", "-c", "echo go; sleep 100"}, TimeoutMs: 300})
	if r.exit.Signal != "SIGKILL" || !r.exit.TimedOut || string(r.stdout) != "go\n" {
		t.Fatalf("exit %+v output %q", r.exit, r.all)
	}
	// The process's record says so too.
	if info, err := e.c.Proc(pi.PID, pi.UID).Info(testCtx(t, 10*time.Second)); err != nil || !info.TimedOut || info.Signal != "SIGKILL" {
		t.Fatalf("process after its timeout: %+v %v", info, err)
	}
	if d := time.Since(start); d < 300*time.Millisecond || d > 10*time.Second {
		t.Fatalf("timeout took %v", d)
	}
}

// seqOutput is what `seq 1 n` prints.
func seqOutput(n int) []byte {
	var b bytes.Buffer
	for i := 1; i <= n; i++ {
		fmt.Fprintf(&b, "%d\n", i)
	}
	return b.Bytes()
}

func TestOutputReplay(t *testing.T) {
	needTools(t, "seq")
	e := startAgent(t, func(c *agent.Config) { c.JournalBytes = 32 << 20 })
	ctx := testCtx(t, 30*time.Second)
	const n = 1000000
	want := seqOutput(n)
	pi, r := e.run(t, wire.ProcessSpec{Argv: []string{"seq", "1", fmt.Sprint(n)}})
	if !bytes.Equal(r.stdout, want) || len(r.gaps) != 0 {
		t.Fatalf("live stream: %d bytes (want %d), gaps %v", len(r.stdout), len(want), r.gaps)
	}
	for _, from := range []int64{0, 1, 1234567, int64(len(want)) - 1} {
		s, err := e.c.Output(ctx, pi.PID, from, false)
		if err != nil {
			t.Fatal(err)
		}
		r := consume(t, s, from)
		if r.firstDataOffset != from || !bytes.Equal(r.all, want[from:]) || r.exit == nil {
			t.Fatalf("replay from %d: first offset %d, %d bytes, exit %v", from, r.firstDataOffset, len(r.all), r.exit)
		}
	}
	s, err := e.c.Output(ctx, pi.PID, int64(len(want)), true)
	if err != nil {
		t.Fatal(err)
	}
	if r := consume(t, s, int64(len(want))); len(r.all) != 0 || r.exit == nil || !r.started {
		t.Fatalf("from end: %+v", r)
	}
	_, err = e.c.Output(ctx, pi.PID, int64(len(want))+1, false)
	wantAgentError(t, err, 400, wire.ErrCodeOffsetBeyondEnd)

	// follow=0 on a running process returns what exists, without an exit frame.
	sl, err := e.c.StartProcess(ctx, wire.ProcessSpec{Argv: []string{"sh", "-c", "echo x; exec sleep 100"}})
	if err != nil {
		t.Fatal(err)
	}
	f := follow(t, e.c, sl.PID)
	f.waitFor(t, "x\n", 1)
	s, err = e.c.Output(ctx, sl.PID, 0, false)
	if err != nil {
		t.Fatal(err)
	}
	if r := consume(t, s, 0); string(r.all) != "x\n" || r.exit != nil {
		t.Fatalf("snapshot of running process: %q %+v", r.all, r.exit)
	}
	if err := e.c.Signal(ctx, sl.PID, "KILL"); err != nil {
		t.Fatal(err)
	}
	<-f.res
}

func TestGapOnTinyJournal(t *testing.T) {
	needTools(t, "seq")
	e := startAgent(t, func(c *agent.Config) { c.JournalBytes = 4096 })
	ctx := testCtx(t, 30*time.Second)
	want := seqOutput(100000)
	pi, err := e.c.StartProcess(ctx, wire.ProcessSpec{Argv: []string{"seq", "1", "100000"}})
	if err != nil {
		t.Fatal(err)
	}
	// Wait for the exit without reading output.
	s, err := e.c.Output(ctx, pi.PID, 0, true)
	if err != nil {
		t.Fatal(err)
	}
	consume(t, s, 0)
	info, err := e.c.GetProcess(ctx, pi.PID)
	if err != nil {
		t.Fatal(err)
	}
	if info.Written != int64(len(want)) || info.Retained != info.Written-4096 {
		t.Fatalf("written %d retained %d", info.Written, info.Retained)
	}
	s, err = e.c.Output(ctx, pi.PID, 0, true)
	if err != nil {
		t.Fatal(err)
	}
	r := consume(t, s, 0)
	if len(r.gaps) != 1 || r.gaps[0].offset != info.Retained || r.gaps[0].dropped != info.Retained {
		t.Fatalf("gaps %+v, want one at %d", r.gaps, info.Retained)
	}
	if !bytes.Equal(r.all, want[info.Retained:]) || r.exit == nil {
		t.Fatalf("after gap: %d bytes, exit %v", len(r.all), r.exit)
	}
}

// heapSampler records the largest HeapInuse seen until stopped.
func heapSampler() (stop func() uint64) {
	var mu sync.Mutex
	var peak uint64
	done := make(chan struct{})
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		t := time.NewTicker(20 * time.Millisecond)
		defer t.Stop()
		for {
			var ms runtime.MemStats
			runtime.ReadMemStats(&ms)
			mu.Lock()
			peak = max(peak, ms.HeapInuse)
			mu.Unlock()
			select {
			case <-done:
				return
			case <-t.C:
			}
		}
	}()
	return func() uint64 {
		close(done)
		<-finished
		mu.Lock()
		defer mu.Unlock()
		return peak
	}
}

func TestBackPressure(t *testing.T) {
	needTools(t, "head")
	e := startAgent(t, nil) // 8 MiB journal
	ctx := testCtx(t, 60*time.Second)
	const total = 500 << 20
	runtime.GC()
	stop := heapSampler()
	pi, err := e.c.StartProcess(ctx, wire.ProcessSpec{Argv: []string{"head", "-c", "500M", "/dev/zero"}})
	if err != nil {
		t.Fatal(err)
	}
	// A follower that does not read: the agent must keep draining the process.
	stalled, err := e.c.Output(ctx, pi.PID, 0, true)
	if err != nil {
		t.Fatal(err)
	}
	defer stalled.Close()
	// Wait for the exit through a second, reading stream that starts at the end.
	var info wire.ProcessInfo
	for {
		info, err = e.c.GetProcess(ctx, pi.PID)
		if err != nil {
			t.Fatal(err)
		}
		if info.State == wire.StateExited {
			break
		}
		s, err := e.c.Output(ctx, pi.PID, info.Written, true)
		if err != nil {
			t.Fatal(err)
		}
		// Skips ahead whenever it falls behind; ends with the exit frame.
		for {
			f, err := s.Next()
			if err != nil {
				t.Fatal(err)
			}
			if f.Type == wire.FrameExit {
				break
			}
		}
		s.Close()
	}
	peak := stop()
	if info.Written != total || exitCode(t, &wire.Exit{ExitCode: info.ExitCode}) != 0 {
		t.Fatalf("written %d, exit %+v", info.Written, info)
	}
	t.Logf("peak HeapInuse %d MiB while 500 MiB went through an 8 MiB journal", peak>>20)
	if peak > 96<<20 {
		t.Fatalf("heap grew to %d MiB", peak>>20)
	}
	// The stalled follower resumes: some early bytes, one gap, the tail, the exit.
	r := consume(t, stalled, 0)
	if len(r.gaps) == 0 || r.exit == nil || r.endOffset != total {
		t.Fatalf("stalled reader: %d gaps, exit %v, end %d", len(r.gaps), r.exit, r.endOffset)
	}
}

func TestRetention(t *testing.T) {
	e := startAgent(t, func(c *agent.Config) { c.Retention = 300 * time.Millisecond })
	ctx := testCtx(t, 20*time.Second)
	pi, _ := e.run(t, wire.ProcessSpec{Argv: []string{"true"}})
	list, err := e.c.ListProcesses(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(list) != 1 || list[0].PID != pi.PID || list[0].State != wire.StateExited {
		t.Fatalf("list %+v", list)
	}
	for {
		_, err := e.c.GetProcess(ctx, pi.PID)
		if agentclient.StatusOf(err) == 404 {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		select {
		case <-ctx.Done():
			t.Fatal("exited process never forgotten")
		case <-time.After(20 * time.Millisecond): // polling interval, not a readiness guess
		}
	}

	e2 := startAgent(t, func(c *agent.Config) { c.MaxExited = 2 })
	var pids []int
	for i := 0; i < 4; i++ {
		pi, _ := e2.run(t, wire.ProcessSpec{Argv: []string{"true"}})
		pids = append(pids, pi.PID)
	}
	// A running process is never pruned (it must still run when the list is taken).
	pi, err = e2.c.StartProcess(ctx, wire.ProcessSpec{Argv: []string{"sleep", "100"}})
	if err != nil {
		t.Fatal(err)
	}
	defer e2.c.Signal(ctx, pi.PID, "KILL")
	list, err = e2.c.ListProcesses(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var got []int
	for _, p := range list {
		got = append(got, p.PID)
	}
	if len(list) != 3 || list[0].PID != pids[2] || list[1].PID != pids[3] || list[2].PID != pi.PID {
		t.Fatalf("retained %v, want the last two exited %v and %d", got, pids[2:], pi.PID)
	}
}

func TestIdentityAndHealth(t *testing.T) {
	e := startAgent(t, nil)
	ctx := testCtx(t, 10*time.Second)
	h0, err := e.c.Health(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if h0.Generation != 0 || h0.BootID == "" || h0.Version != "test" {
		t.Fatalf("health %+v", h0)
	}
	// Health polling is not activity.
	h1, err := e.c.Health(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !h1.LastActivity.Equal(h0.LastActivity) {
		t.Fatalf("health changed last activity")
	}
	hostname, err := os.Hostname()
	if err != nil {
		t.Fatal(err)
	}
	seed := bytes.Repeat([]byte{7}, 32)
	// The hostname is the current one: applying it must not change the test machine.
	if err := e.c.SetIdentity(ctx, wire.Identity{Generation: 3, Seed: seed, UnixNano: time.Now().UnixNano(), Env: map[string]string{"ID_VAR": "x"}, Hostname: hostname}); err != nil {
		t.Fatal(err)
	}
	h2, err := e.c.Health(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if h2.Generation != 3 || !h2.LastActivity.After(h0.LastActivity) || h2.BootID != h0.BootID {
		t.Fatalf("after identity: %+v", h2)
	}
	_, r := e.run(t, wire.ProcessSpec{Argv: []string{"sh", "-c", "echo $ID_VAR"}})
	if string(r.all) != "x\n" {
		t.Fatalf("default env: %q", r.all)
	}
	err = e.c.SetIdentity(ctx, wire.Identity{Generation: 2})
	wantAgentError(t, err, 409, wire.ErrCodeStaleGeneration)
}

func TestHeartbeat(t *testing.T) {
	needTools(t, "sleep")
	e := startAgent(t, func(c *agent.Config) { c.HeartbeatInterval = 50 * time.Millisecond })
	_, r := e.run(t, wire.ProcessSpec{Argv: []string{"sleep", "0.4"}})
	if r.heartbeats < 2 {
		t.Fatalf("%d heartbeats in 0.4 s at 50 ms", r.heartbeats)
	}
}

// TestNoStartWhileFrozen: while user code is frozen for a checkpoint the agent starts
// nothing (a process started then would run through the checkpoint, and its fork held
// the listener gVisor cannot save); it says so with 503 "quiesced", and starts again
// once a new identity thaws the sandbox.
func TestNoStartWhileFrozen(t *testing.T) {
	e := startAgent(t, nil)
	ctx := testCtx(t, 30*time.Second)
	if err := e.c.SetIdentity(ctx, wire.Identity{Generation: 1}); err != nil {
		t.Fatal(err)
	}
	if err := e.c.Quiesce(ctx, true); err != nil {
		t.Fatal(err)
	}
	before, err := e.c.ListProcesses(ctx)
	if err != nil {
		t.Fatal(err)
	}
	_, err = e.c.StartProcess(ctx, wire.ProcessSpec{Argv: []string{"true"}})
	if err == nil || !strings.Contains(err.Error(), "being checkpointed") {
		t.Fatalf("start while frozen: %v", err)
	}
	if after, err := e.c.ListProcesses(ctx); err != nil || len(after) != len(before) {
		t.Fatalf("processes after a refused start: %v %v; before: %v", after, err, before)
	}
	if err := e.c.SetIdentity(ctx, wire.Identity{Generation: 2}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.c.StartProcess(ctx, wire.ProcessSpec{Argv: []string{"true"}}); err != nil {
		t.Fatalf("start after the thaw: %v", err)
	}
}

func TestQuiesceResume(t *testing.T) {
	e := startAgent(t, nil)
	ctx := testCtx(t, 30*time.Second)
	if err := e.c.SetIdentity(ctx, wire.Identity{Generation: 1}); err != nil {
		t.Fatal(err)
	}
	script := `i=0; while [ $i -lt 30 ]; do echo line$i; i=$((i+1)); sleep 0.01; done`
	pi, err := e.c.StartProcess(ctx, wire.ProcessSpec{Argv: []string{"sh", "-c", script}})
	if err != nil {
		t.Fatal(err)
	}
	// A follower is cut off by the quiesce.
	s, err := e.c.Output(ctx, pi.PID, 0, true)
	if err != nil {
		t.Fatal(err)
	}
	if err := e.c.Quiesce(ctx, false); err != nil {
		t.Fatal(err)
	}
	for {
		f, err := s.Next()
		if err != nil {
			break // cut by the quiesce
		}
		if f.Type == wire.FrameExit {
			t.Fatal("process finished before the quiesce cut its follower")
		}
	}
	s.Close()
	// The agent signals that it holds no connection any more (a checkpoint may start).
	if err := agentclient.WaitQuiesced(ctx, e.runDir); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(e.sock); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("socket file still present after quiesce: %v", err)
	}
	if _, err := e.c.Health(testCtx(t, time.Second)); err == nil {
		t.Fatal("agent answered while quiesced")
	}
	// A stale generation does not resume it; a newer one does.
	if err := agentclient.WriteResume(e.runDir, wire.Identity{Generation: 1}); err != nil {
		t.Fatal(err)
	}
	if err := agentclient.WriteResume(e.runDir, wire.Identity{Generation: 2, UnixNano: time.Now().UnixNano(), Env: map[string]string{"R": "1"}}); err != nil {
		t.Fatal(err)
	}
	h, err := e.c.WaitReady(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if h.Generation != 2 {
		t.Fatalf("generation %d after resume", h.Generation)
	}
	for _, name := range []string{wire.ResumeFileName, wire.QuiescedFileName} {
		if _, err := os.Stat(filepath.Join(e.runDir, name)); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("%s left behind: %v", name, err)
		}
	}
	// The process kept running and its output kept being journaled.
	s, err = e.c.Output(ctx, pi.PID, 0, true)
	if err != nil {
		t.Fatal(err)
	}
	r := consume(t, s, 0)
	var want bytes.Buffer
	for i := 0; i < 30; i++ {
		fmt.Fprintf(&want, "line%d\n", i)
	}
	if string(r.all) != want.String() || exitCode(t, r.exit) != 0 {
		t.Fatalf("output across quiesce: %q", r.all)
	}
	// And the agent can quiesce again.
	if err := e.c.Quiesce(ctx, false); err != nil {
		t.Fatal(err)
	}
	if err := agentclient.WaitQuiesced(ctx, e.runDir); err != nil {
		t.Fatal(err)
	}
	if err := agentclient.WriteResume(e.runDir, wire.Identity{Generation: 3}); err != nil {
		t.Fatal(err)
	}
	if h, err := e.c.WaitReady(ctx); err != nil || h.Generation != 3 {
		t.Fatalf("second resume: %+v %v", h, err)
	}
}

// TestQuiescedMarkerAppearsClosed: the quiesced marker's name appears only once the
// file is written and closed (renamed into place). The host checkpoints as soon as it
// sees the name; a marker the agent still held open was saved as an open file, and a
// clone's restore, whose run directory starts empty, could not re-open it.
func TestQuiescedMarkerAppearsClosed(t *testing.T) {
	e := startAgent(t, nil)
	ctx := testCtx(t, 30*time.Second)
	if err := e.c.SetIdentity(ctx, wire.Identity{Generation: 1}); err != nil {
		t.Fatal(err)
	}
	fd, err := unix.InotifyInit1(unix.IN_NONBLOCK | unix.IN_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	if _, err := unix.InotifyAddWatch(fd, e.runDir, unix.IN_CREATE|unix.IN_MOVED_TO|unix.IN_CLOSE_WRITE); err != nil {
		t.Fatal(err)
	}
	if err := e.c.Quiesce(ctx, false); err != nil {
		t.Fatal(err)
	}
	if err := agentclient.WaitQuiesced(ctx, e.runDir); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 64<<10)
	n, err := unix.Read(fd, buf)
	if err != nil {
		t.Fatal(err)
	}
	var seen []string
	for off := 0; off+unix.SizeofInotifyEvent <= n; {
		ev := (*unix.InotifyEvent)(unsafe.Pointer(&buf[off]))
		name := strings.TrimRight(string(buf[off+unix.SizeofInotifyEvent:off+unix.SizeofInotifyEvent+int(ev.Len)]), "\x00")
		off += unix.SizeofInotifyEvent + int(ev.Len)
		kind := map[uint32]string{unix.IN_CREATE: "create", unix.IN_MOVED_TO: "moved-to", unix.IN_CLOSE_WRITE: "closed"}[ev.Mask&(unix.IN_CREATE|unix.IN_MOVED_TO|unix.IN_CLOSE_WRITE)]
		seen = append(seen, kind+" "+name)
	}
	marker := wire.QuiescedFileName
	i := slices.Index(seen, "moved-to "+marker)
	if i < 0 || slices.Contains(seen, "create "+marker) || !slices.Contains(seen[:i], "closed "+marker+".tmp") {
		t.Fatalf("the marker's name must appear by a rename of a closed file; events: %q", seen)
	}
	if err := agentclient.WriteResume(e.runDir, wire.Identity{Generation: 2}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.c.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
}

func TestShutdownStopsProcesses(t *testing.T) {
	needTools(t, "sleep")
	dir := tempDir(t)
	sock := filepath.Join(dir, "a.sock")
	a, err := agent.New(agent.Config{Listen: "unix:" + sock, Reaper: testReaper, Logger: testLogger(), StopGrace: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	c := agentclient.New(agentclient.DialUnix(sock))
	defer c.CloseIdleConnections()
	tctx := testCtx(t, 20*time.Second)
	if _, err := c.WaitReady(tctx); err != nil {
		t.Fatal(err)
	}
	var pids []int
	for _, spec := range []wire.ProcessSpec{
		{Argv: []string{"sleep", "100"}},
		{Argv: []string{"sh", "-c", `trap "" TERM; sleep 100`}}, // needs SIGKILL
		{Argv: []string{"sleep", "100"}, Gated: true},           // never started
	} {
		pi, err := c.StartProcess(tctx, spec)
		if err != nil {
			t.Fatal(err)
		}
		pids = append(pids, pi.PID)
	}
	start := time.Now()
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("shutdown took %v", d)
	}
	for _, pid := range pids {
		// Reaped: the pid no longer exists (or was reused by an unrelated process, which
		// /proc/PID/stat's parent would show; not ours).
		if data, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid)); err == nil && strings.Contains(string(data), "sleep") {
			t.Errorf("process %d still running: %q", pid, data)
		}
	}
	if _, err := os.Lstat(sock); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("socket left behind: %v", err)
	}
}

// hostLink listens on path as the node does for an agent that connects to it
// (agentlink.Host) and returns a dialer of connections to the agent.
func hostLink(t *testing.T, path string) func(ctx context.Context) (net.Conn, error) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	h := agentlink.NewHost(ln, slog.New(slog.DiscardHandler), agentlink.Keys{})
	t.Cleanup(h.Close)
	return h.Dial
}

// TestQuiesceResumeConnected: the quiesce and resume of an agent that connects to the
// host (gVisor since 2026-12-06): the quiesce closes its connection, and after the
// resume file it connects again with the new identity, as many times as asked.
func TestQuiesceResumeConnected(t *testing.T) {
	e := startAgent(t, func(c *agent.Config) {
		c.Listen = "connect:" + filepath.Join(filepath.Dir(c.StateDir), "run", wire.NodeSocketName)
	})
	ctx := testCtx(t, 30*time.Second)
	for gen := int64(2); gen <= 3; gen++ {
		if err := e.c.QuiesceClosing(ctx, e.runDir); err != nil {
			t.Fatal(err)
		}
		e.c.CloseIdleConnections()
		if _, err := e.c.Health(testCtx(t, 500*time.Millisecond)); err == nil {
			t.Fatal("agent answered while quiesced")
		}
		if err := agentclient.WriteResume(e.runDir, wire.Identity{Generation: gen, UnixNano: time.Now().UnixNano()}); err != nil {
			t.Fatal(err)
		}
		if h, err := e.c.WaitReady(ctx); err != nil || h.Generation != gen {
			t.Fatalf("after resume %d: %+v %v", gen, h, err)
		}
	}
}
