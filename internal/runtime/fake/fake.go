// Package fake is a runtime.Runtime for tests that need no root and no isolation: each
// instance is the real space-agent running as a plain host process (as the test's own
// user), so the node, the data plane and the API above it run for real in unit tests.
// It isolates nothing and must never run untrusted code.
//
// What it fakes: users (every account of the sandbox maps to the test's own uid, so the
// agent never switches users), pause (SIGSTOP of the agent), and snapshots: a
// checkpoint ends the instance and a restore starts a fresh agent (memory is not kept;
// the agent's transport survives, as with the VM runtimes, runtime.ResumeByAPI). Tests
// of what memory keeps run against the real runtimes (internal/e2e).
package fake

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/prometheus/procfs"

	"github.com/spacedev/space/internal/runtime"
)

// Config configures the fake runtime.
type Config struct {
	// Dir keeps the instances' records, sockets and home directories.
	Dir string
	// AgentPath is the space-agent binary to run (instances ignore runtime.Spec's).
	AgentPath string
	// FailCreate, when set, is called as Create starts and fails it for the sandbox ids
	// it returns an error for (tests of undo); a test may also block in it (a boot
	// that takes its time).
	FailCreate func(id string) error
	// BeforeCheckpoint, when set, is called as Checkpoint and CheckpointPaused start
	// (tests of requests that come during a suspend block in it; tests count them).
	BeforeCheckpoint func(id string)
	// DieAfterRestore, when set, kills the agent of a restored instance that matches
	// as Restore returns (a restored agent that cannot run: tests of the fallback).
	DieAfterRestore func(id string) bool
	// ParkRunning reports runtime.Caps.ParkRunning (warm-pool members wait running).
	ParkRunning bool
	// CPUTime makes the runtime a runtime.CPUTimer: an instance's CPU time is its
	// agent's and its processes' (reaped ones included). Without it CPUTime fails, as
	// on a runtime that cannot tell, and the node asks the agents.
	CPUTime bool
	// MemoryOverheadMB is what an instance may hold beyond its MemoryMB
	// (runtime.MemoryBounder).
	MemoryOverheadMB int
}

// Runtime runs agents as host processes.
type Runtime struct {
	cfg Config
	mu  sync.Mutex
	// statuses counts the Status calls per instance (StatusCalls).
	statuses sync.Map
	// pressure holds each watched instance's channel for PressMemory.
	pressure sync.Map
}

var (
	_ runtime.Runtime          = (*Runtime)(nil)
	_ runtime.Snapshotter      = (*Runtime)(nil)
	_ runtime.LiveCheckpointer = (*Runtime)(nil)
	_ runtime.CPUTimer         = (*Runtime)(nil)
	_ runtime.MemoryBounder    = (*Runtime)(nil)
	_ runtime.MemoryWatcher    = (*Runtime)(nil)
)

// New prepares the runtime's directory.
func New(cfg Config) (*Runtime, error) {
	if cfg.Dir == "" || cfg.AgentPath == "" {
		return nil, errors.New("fake runtime: Dir and AgentPath are required")
	}
	for _, d := range []string{"instances", "sock", "etc", "home"} {
		if err := os.MkdirAll(filepath.Join(cfg.Dir, d), 0o755); err != nil {
			return nil, err
		}
	}
	if err := writeEtc(filepath.Join(cfg.Dir, "etc"), filepath.Join(cfg.Dir, "home")); err != nil {
		return nil, err
	}
	return &Runtime{cfg: cfg}, nil
}

// writeEtc writes passwd and group files in which every account the platform uses is
// the current user.
func writeEtc(etc, home string) error {
	uid, gid := os.Getuid(), os.Getgid()
	var pw, gr strings.Builder
	for _, name := range []string{"root", "user"} {
		h := filepath.Join(home, name)
		if err := os.MkdirAll(h, 0o755); err != nil {
			return err
		}
		fmt.Fprintf(&pw, "%s:x:%d:%d:%s:%s:/bin/sh\n", name, uid, gid, name, h)
		fmt.Fprintf(&gr, "%s:x:%d:\n", name, gid)
	}
	if err := os.WriteFile(filepath.Join(etc, "passwd"), []byte(pw.String()), 0o644); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(etc, "group"), []byte(gr.String()), 0o644)
}

// record is what the runtime keeps per instance.
type record struct {
	ID     string `json:"id"`
	PID    int    `json:"pid"`
	Socket string `json:"socket"`
}

func (r *Runtime) recordPath(id string) string {
	return filepath.Join(r.cfg.Dir, "instances", id+".json")
}

func (r *Runtime) read(id string) (record, error) {
	var rec record
	data, err := os.ReadFile(r.recordPath(id))
	if errors.Is(err, os.ErrNotExist) {
		return rec, runtime.ErrNotFound
	}
	if err != nil {
		return rec, err
	}
	return rec, json.Unmarshal(data, &rec)
}

// StatusCalls reports how often Status was asked about id: a node observes a sandbox
// before each plan, so a test can wait for a plan to have been carried out.
func (r *Runtime) StatusCalls(id string) int64 {
	n, ok := r.statuses.Load(id)
	if !ok {
		return 0
	}
	return n.(*atomic.Int64).Load()
}

// Info reports the fake runtime.
func (r *Runtime) Info(context.Context) (runtime.Info, error) {
	return runtime.Info{Name: "fake", Disk: runtime.DiskDir, Version: "1",
		Caps: runtime.Caps{AgentResume: runtime.ResumeByAPI, ParkRunning: r.cfg.ParkRunning}, Details: map[string]string{"isolation": "none (tests only)"}}, nil
}

// Create starts the agent for spec.ID.
func (r *Runtime) Create(ctx context.Context, spec runtime.Spec) error {
	if r.cfg.FailCreate != nil {
		if err := r.cfg.FailCreate(spec.ID); err != nil {
			return err
		}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, err := r.read(spec.ID); err == nil {
		return fmt.Errorf("fake create %s: instance already exists", spec.ID)
	}
	return r.start(spec.ID, spec)
}

// start runs a new agent process for id (r.mu held).
func (r *Runtime) start(id string, spec runtime.Spec) error {
	sock := filepath.Join(r.cfg.Dir, "sock", id+".sock")
	_ = os.Remove(sock)
	runDir := filepath.Join(r.cfg.Dir, "sock", id+".run")
	if err := os.MkdirAll(runDir, 0o700); err != nil {
		return err
	}
	cmd := exec.Command(r.cfg.AgentPath)
	env := []string{"SPACE_AGENT_LISTEN=unix:" + sock, "SPACE_AGENT_RUN_DIR=" + runDir,
		"SPACE_AGENT_ETC_DIR=" + filepath.Join(r.cfg.Dir, "etc"), "SPACE_AGENT_LOG_LEVEL=warn",
		"PATH=/usr/local/bin:/usr/bin:/bin"}
	for k, v := range spec.AgentEnv {
		env = append(env, k+"="+v)
	}
	cmd.Env = env
	cmd.Dir = filepath.Join(r.cfg.Dir, "home")
	if logf, err := os.OpenFile(filepath.Join(r.cfg.Dir, "instances", id+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600); err == nil {
		defer logf.Close()
		cmd.Stdout, cmd.Stderr = logf, logf
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if os.Geteuid() == 0 {
		// The agent sets the sandbox's host name: keep the host's own.
		cmd.SysProcAttr.Cloneflags = syscall.CLONE_NEWUTS
	}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("fake create %s: %w", id, err)
	}
	pid := cmd.Process.Pid
	go func() { _ = cmd.Wait() }() // reap it whenever it ends
	data, _ := json.Marshal(record{ID: id, PID: pid, Socket: sock})
	if err := os.WriteFile(r.recordPath(id), data, 0o600); err != nil {
		killTree(pid)
		return err
	}
	return nil
}

// Dial connects to the instance's agent.
func (r *Runtime) Dial(ctx context.Context, id string) (net.Conn, error) {
	rec, err := r.read(id)
	if err != nil {
		return nil, fmt.Errorf("fake dial %s: %w", id, err)
	}
	var d net.Dialer
	return d.DialContext(ctx, "unix", rec.Socket)
}

// Status reports the agent process's state.
func (r *Runtime) Status(_ context.Context, id string) (runtime.Status, error) {
	n, _ := r.statuses.LoadOrStore(id, new(atomic.Int64))
	n.(*atomic.Int64).Add(1)
	rec, err := r.read(id)
	if err != nil {
		return "", err
	}
	return procStatus(rec.PID), nil
}

func procStatus(pid int) runtime.Status {
	data, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return runtime.StatusStopped
	}
	// pid (comm) STATE ...: comm may hold spaces, the state follows the last ')'.
	s := string(data)
	i := strings.LastIndexByte(s, ')')
	if i < 0 || i+2 >= len(s) {
		return runtime.StatusStopped
	}
	switch s[i+2] {
	case 'T', 't':
		return runtime.StatusPaused
	case 'Z', 'X':
		return runtime.StatusStopped
	default:
		return runtime.StatusRunning
	}
}

// List reports every recorded instance.
func (r *Runtime) List(context.Context) ([]runtime.Instance, error) {
	ents, err := os.ReadDir(filepath.Join(r.cfg.Dir, "instances"))
	if err != nil {
		return nil, err
	}
	var out []runtime.Instance
	for _, e := range ents {
		id, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok {
			continue
		}
		rec, err := r.read(id)
		if err != nil {
			continue
		}
		out = append(out, runtime.Instance{ID: id, Status: procStatus(rec.PID)})
	}
	slices.SortFunc(out, func(a, b runtime.Instance) int { return strings.Compare(a.ID, b.ID) })
	return out, nil
}

// Adopt checks that the instance still runs.
func (r *Runtime) Adopt(_ context.Context, spec runtime.Spec) error {
	rec, err := r.read(spec.ID)
	if err != nil {
		return fmt.Errorf("fake adopt %s: %w", spec.ID, err)
	}
	if procStatus(rec.PID) == runtime.StatusStopped {
		return fmt.Errorf("fake adopt %s: the agent is gone", spec.ID)
	}
	return nil
}

// Destroy kills the agent and every process it started.
func (r *Runtime) Destroy(_ context.Context, id string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	rec, err := r.read(id)
	if errors.Is(err, runtime.ErrNotFound) {
		return nil
	}
	if err != nil {
		return err
	}
	killTree(rec.PID)
	_ = os.Remove(rec.Socket)
	_ = os.RemoveAll(filepath.Join(r.cfg.Dir, "sock", id+".run"))
	return os.Remove(r.recordPath(id))
}

// Kill ends an instance's agent abruptly, as a crash of the runtime would (the record
// stays: the instance is reported stopped).
func (r *Runtime) Kill(id string) error {
	rec, err := r.read(id)
	if err != nil {
		return err
	}
	killTree(rec.PID)
	return nil
}

// Pause stops the agent process, and returns once it is stopped, as a real runtime's
// pause does. A signal lands a moment after kill(2) returns: a Pause that returned at
// once left a window in which Status still said running, and a resume asked for at
// once found nothing to do (TestCrashWalk/resume's discovery run).
func (r *Runtime) Pause(ctx context.Context, id string) error {
	if err := r.signal(id, syscall.SIGSTOP); err != nil {
		return err
	}
	return r.waitStatus(ctx, id, "pause", func(st runtime.Status) bool { return st == runtime.StatusPaused })
}

// Resume continues it, and returns once it runs again.
func (r *Runtime) Resume(ctx context.Context, id string) error {
	if err := r.signal(id, syscall.SIGCONT); err != nil {
		return err
	}
	return r.waitStatus(ctx, id, "resume", func(st runtime.Status) bool { return st != runtime.StatusPaused })
}

// signalLands bounds how long a stop or continue signal may take to show in /proc.
const signalLands = 5 * time.Second

// waitStatus polls Status until done accepts it, bounded by ctx and signalLands.
func (r *Runtime) waitStatus(ctx context.Context, id, what string, done func(runtime.Status) bool) error {
	ctx, cancel := context.WithTimeout(ctx, signalLands)
	defer cancel()
	for {
		st, err := r.Status(ctx, id)
		if err == nil && done(st) {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("fake %s %s: still %s (%v): %w", what, id, st, err, ctx.Err())
		case <-time.After(time.Millisecond):
		}
	}
}

func (r *Runtime) signal(id string, sig syscall.Signal) error {
	rec, err := r.read(id)
	if err != nil {
		return err
	}
	if err := syscall.Kill(rec.PID, sig); err != nil {
		return fmt.Errorf("fake %s %s: %w", sig, id, err)
	}
	return nil
}

// checkpointFile marks a fake checkpoint.
const checkpointFile = "fake-checkpoint.json"

// Checkpoint writes a marker into dir and ends the instance (memory is not kept).
func (r *Runtime) Checkpoint(ctx context.Context, id, dir string) error {
	if r.cfg.BeforeCheckpoint != nil {
		r.cfg.BeforeCheckpoint(id)
	}
	if _, err := r.read(id); err != nil {
		return err
	}
	data, _ := json.Marshal(map[string]any{"id": id, "at": time.Now()})
	if err := os.WriteFile(filepath.Join(dir, checkpointFile), data, 0o600); err != nil {
		return err
	}
	return r.Destroy(ctx, id)
}

// CheckpointPaused writes a marker into dir and leaves the paused instance as it is.
func (r *Runtime) CheckpointPaused(ctx context.Context, id, dir string) error {
	if r.cfg.BeforeCheckpoint != nil {
		r.cfg.BeforeCheckpoint(id)
	}
	if _, err := r.read(id); err != nil {
		return err
	}
	if st, err := r.Status(ctx, id); err != nil || st != runtime.StatusPaused {
		return fmt.Errorf("fake checkpoint %s: not paused (%s, %v)", id, st, err)
	}
	data, _ := json.Marshal(map[string]any{"id": id, "at": time.Now()})
	return os.WriteFile(filepath.Join(dir, checkpointFile), data, 0o600)
}

// Restore starts a fresh agent for spec.ID from a checkpoint dir made by Checkpoint.
func (r *Runtime) Restore(_ context.Context, spec runtime.Spec, dir string) error {
	if _, err := os.Stat(filepath.Join(dir, checkpointFile)); err != nil {
		return fmt.Errorf("fake restore %s: %w", spec.ID, err)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, err := r.read(spec.ID); err == nil {
		return fmt.Errorf("fake restore %s: instance already exists", spec.ID)
	}
	if err := r.start(spec.ID, spec); err != nil {
		return err
	}
	if r.cfg.DieAfterRestore != nil && r.cfg.DieAfterRestore(spec.ID) {
		if rec, err := r.read(spec.ID); err == nil {
			killTree(rec.PID)
		}
	}
	return nil
}

// killTree kills pid and every process descended from it (the agent's children run in
// their own sessions, so a process group would miss them).
func killTree(pid int) {
	// The agent dies first, so that it never sees its children die and reports their
	// exit (a lost sandbox loses its agent and its processes at once): once kill(2) of
	// SIGKILL returns, none of its threads runs user code again. It is never stopped
	// on the way, which the node would observe as a pause.
	kids := descendants(pid)
	_ = syscall.Kill(pid, syscall.SIGKILL)
	for _, p := range kids {
		_ = syscall.Kill(p, syscall.SIGKILL)
	}
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) && procStatus(pid) != runtime.StatusStopped {
		time.Sleep(5 * time.Millisecond)
	}
}

// descendants lists the processes whose ancestry includes pid.
func descendants(pid int) []int {
	ents, _ := os.ReadDir("/proc")
	parent := map[int]int{}
	for _, e := range ents {
		p, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		data, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		s := string(data)
		i := strings.LastIndexByte(s, ')')
		f := strings.Fields(s[i+1:])
		if len(f) < 2 {
			continue
		}
		pp, _ := strconv.Atoi(f[1])
		parent[p] = pp
	}
	var out []int
	for p := range parent {
		for q := parent[p]; q > 1; q = parent[q] {
			if q == pid {
				out = append(out, p)
				break
			}
		}
	}
	return out
}

// PID returns the agent process of an instance (0 if none).
func (r *Runtime) PID(id string) int {
	rec, err := r.read(id)
	if err != nil {
		return 0
	}
	return rec.PID
}

// MemoryBound is MemoryMB plus Config.MemoryOverheadMB (runtime.MemoryBounder; with
// none, the node keeps MemoryMB for checkpoints, as for runtimes without a bound).
func (r *Runtime) MemoryBound(spec runtime.Spec) int64 {
	return int64(spec.MemoryMB+r.cfg.MemoryOverheadMB) << 20
}

// WatchMemory reports a rise near the limit each time PressMemory names the instance
// (runtime.MemoryWatcher), with a usage of 0 and the MemoryBound as limit.
func (r *Runtime) WatchMemory(ctx context.Context, spec runtime.Spec, near func(usage, limit int64)) error {
	ch := make(chan struct{}, 1)
	if _, loaded := r.pressure.LoadOrStore(spec.ID, ch); loaded {
		return fmt.Errorf("fake runtime: %s is watched already", spec.ID)
	}
	defer r.pressure.Delete(spec.ID)
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-ch:
			near(0, r.MemoryBound(spec))
		}
	}
}

// PressMemory tells the instance's memory watch that its memory nears the limit, and
// reports whether one watches it.
func (r *Runtime) PressMemory(id string) bool {
	v, ok := r.pressure.Load(id)
	if ok {
		select {
		case v.(chan struct{}) <- struct{}{}:
		default:
		}
	}
	return ok
}

// CPUTime is the CPU time of the instance's agent and of its descendants, living and
// reaped (Config.CPUTime).
func (r *Runtime) CPUTime(_ context.Context, id string) (time.Duration, error) {
	if !r.cfg.CPUTime {
		return 0, runtime.ErrUnsupported
	}
	rec, err := r.read(id)
	if err != nil {
		return 0, err
	}
	p, err := procfs.NewProc(rec.PID)
	if err != nil {
		return 0, err
	}
	st, err := p.Stat()
	if err != nil {
		return 0, err
	}
	ticks := st.UTime + st.STime + uint(st.CUTime) + uint(st.CSTime)
	for _, pid := range descendants(rec.PID) {
		if q, err := procfs.NewProc(pid); err == nil {
			if qs, err := q.Stat(); err == nil {
				ticks += qs.UTime + qs.STime
			}
		}
	}
	return time.Duration(ticks) * time.Second / userHZ, nil
}

// userHZ is the kernel's clock tick for /proc/<pid>/stat times (100 on Linux).
const userHZ = 100
