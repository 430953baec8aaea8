// Package conformance owns the test suite every runtime.Runtime implementation passes:
// the same cases, run against each runtime present on the machine (see the
// *_conformance_test.go files), with the real agent, real root filesystems from the
// base template release and the real isolation technology.
//
// Instances share work where the cases allow (one booted instance serves the exec,
// files, limits and pause cases, the checkpoint of that instance feeds the restore and
// clone cases), which keeps a run of the suite under a few minutes even for VMs under
// software emulation. The suite coordinates the agent around checkpoints the way the
// node does: runtimes whose Info().Caps.AgentResume is ResumeByFile (gVisor) get the
// agent quiesced before Checkpoint and its identity as a resume file in the run
// directory after Restore; the others get the identity through POST /v1/identity.
package conformance

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/guest/agentclient"
	"github.com/spacedev/space/internal/guest/wire"
	"github.com/spacedev/space/internal/runtime"
	"github.com/spacedev/space/internal/storage"
	"github.com/spacedev/space/internal/template/templatetest"
	"github.com/spacedev/space/internal/testenv"
)

// Factory makes the runtime under test.
type Factory struct {
	// New returns a runtime keeping its host state in rootDir. The suite calls it a
	// second time with the same rootDir to model a node restart, after closing the first
	// runtime if it is an io.Closer (the node process exiting).
	New func(t *testing.T, rootDir string) runtime.Runtime
	// MemoryMB and CPU size every instance (default 256 MiB, 1 CPU).
	MemoryMB int
	CPU      int
	// CPUIsQuota says the runtime enforces CPU as a quota in cores rather than as a
	// number of CPUs (gVisor, which also never shows fewer than 2): the suite then only
	// checks that at least CPU CPUs are usable.
	CPUIsQuota bool
}

// Timeouts of the suite (generous: VMs may run under software emulation).
const (
	readyTimeout = 90 * time.Second // create or restore until the agent answers
	opTimeout    = 60 * time.Second // one agent request or runtime call
)

// counterProgram prints an in-memory counter, one number per line, ten times a second.
const counterProgram = "import time\ni = 0\nwhile True:\n    print(i, flush=True)\n    i += 1\n    time.sleep(0.1)\n"

// Run runs the suite against the runtime f makes. It needs root, btrfs and the base
// template (see package templatetest); the agent binary comes from testenv.Binaries, so
// the calling package's TestMain must call testenv.Main.
func Run(t *testing.T, f Factory) {
	if f.MemoryMB == 0 {
		f.MemoryMB = 256
	}
	if f.CPU == 0 {
		f.CPU = 1
	}
	store := templatetest.Store(t)
	rel := templatetest.Base(t, store)
	_, agentPath := testenv.Binaries(t)
	rootDir := t.TempDir()
	s := &suite{
		t: t, f: f, store: store, rel: rel, agent: agentPath, rootDir: rootDir,
		rt: f.New(t, rootDir), live: map[string]runtime.Spec{}, timings: map[string]time.Duration{},
	}
	ctx := context.Background()
	info, err := s.rt.Info(ctx)
	if err != nil {
		t.Fatalf("Info: %v", err)
	}
	s.info = info
	t.Logf("runtime %s %s disk=%s details=%v", info.Name, info.Version, info.Disk, info.Details)
	t.Cleanup(s.cleanup)
	defer s.report()

	t.Run("NetworkUnsupported", s.testNetworkUnsupported)
	if info.Caps.Network != "" {
		t.Run("Network", func(t *testing.T) {
			e := s.netEnv(t)
			src := s.testNetwork(t, e)
			t.Run("Clone", func(t *testing.T) { s.testNetworkClone(t, e, src) })
		})
	}
	main := s.create(t, "main")
	c := s.client(main.ID)
	start := time.Now()
	if _, err := c.WaitReady(s.ctx(t, readyTimeout)); err != nil {
		t.Fatalf("agent of a new instance not ready: %v\n%s", err, s.diagnose(main))
	}
	s.timings["boot (create to agent ready)"] = time.Since(start) + s.timings["create call"]
	s.rss("running instance", main)

	t.Run("Health", func(t *testing.T) { s.testHealth(t, c) })
	t.Run("Exec", func(t *testing.T) { s.testExec(t, c) })
	t.Run("StreamedOutput", func(t *testing.T) { s.testStreamed(t, c) })
	t.Run("Files", func(t *testing.T) { s.testFiles(t, c) })
	t.Run("Limits", func(t *testing.T) { s.testLimits(t, c) })
	if _, ok := s.rt.(runtime.Snapshotter); !ok {
		t.Logf("%s does not implement runtime.Snapshotter: no pause, checkpoint, restore or clone", info.Name)
		t.Run("NodeRestart", func(t *testing.T) { s.testNodeRestart(t, main) })
		t.Run("DestroyLeavesNothing", s.testDestroyAll)
		return
	}
	t.Run("PauseResume", func(t *testing.T) { s.testPauseResume(t, main, c) })
	var cp checkpoint
	t.Run("CheckpointRestore", func(t *testing.T) { cp = s.testCheckpointRestore(t, main, c) })
	if cp.dir == "" {
		t.Fatal("no checkpoint: skipping clone and node restart cases")
	}
	var clones []runtime.Spec
	t.Run("Clone", func(t *testing.T) { clones = s.testClone(t, cp) })
	if len(clones) > 0 {
		t.Run("NodeRestart", func(t *testing.T) { s.testNodeRestart(t, clones[0]) })
	}
	t.Run("DestroyLeavesNothing", s.testDestroyAll)
}

type suite struct {
	t       *testing.T
	f       Factory
	rt      runtime.Runtime
	info    runtime.Info
	store   *storage.Store
	rel     storage.Release
	agent   string
	rootDir string

	mu      sync.Mutex
	live    map[string]runtime.Spec // created and not yet destroyed
	timings map[string]time.Duration
	notes   []string
}

func (s *suite) ctx(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// newID returns a fresh sandbox id; random, so that a leftover of an earlier run can
// never be mistaken for this run's instance.
func newID(name string) string {
	b := make([]byte, 5)
	_, _ = rand.Read(b)
	return strings.ToLower(strings.Map(func(r rune) rune {
		if (r >= 'a' && r <= 'z') || (r >= '0' && r <= '9') {
			return r
		}
		return -1
	}, name)) + hex.EncodeToString(b)
}

// spec prepares a new instance: its root filesystem (a subvolume snapshot or a reflinked
// ext4 image of the base release, per Info().Disk) and an empty StateDir.
func (s *suite) spec(t *testing.T, name string) runtime.Spec {
	t.Helper()
	id := newID(name)
	ctx := s.ctx(t, opTimeout)
	var root string
	var err error
	switch s.info.Disk {
	case runtime.DiskDir:
		root, err = s.store.CreateSandboxRoot(ctx, id, s.rel.Digest)
	case runtime.DiskExt4:
		root, err = s.store.CreateSandboxDisk(ctx, id, s.rel.Digest, 0)
	default:
		t.Fatalf("unknown disk format %q", s.info.Disk)
	}
	if err != nil {
		t.Fatalf("prepare root filesystem: %v", err)
	}
	return runtime.Spec{
		ID:        id,
		RootFS:    root,
		StateDir:  s.stateDir(t),
		AgentPath: s.agent,
		CPU:       s.f.CPU,
		MemoryMB:  s.f.MemoryMB,
		AgentEnv:  map[string]string{"SPACE_AGENT_LOG_LEVEL": "debug"},
	}
}

func (s *suite) stateDir(t *testing.T) string {
	t.Helper()
	// Lives as long as the suite (instances outlive the subtest that made them).
	dir, err := os.MkdirTemp(s.rootDir, "state-")
	if err != nil {
		t.Fatal(err)
	}
	return dir
}

// copyRoot gives dst's instance a copy of src's root filesystem, as the node does for a
// checkpoint's disk: a btrfs snapshot or a reflink, both O(1).
func (s *suite) copyRoot(t *testing.T, src runtime.Spec, name string) runtime.Spec {
	t.Helper()
	dst := runtime.Spec{
		ID: newID(name), StateDir: s.stateDir(t), AgentPath: s.agent,
		CPU: src.CPU, MemoryMB: src.MemoryMB, AgentEnv: src.AgentEnv,
	}
	dir, err := s.store.SandboxDir(dst.ID)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	dst.RootFS = filepath.Join(dir, filepath.Base(src.RootFS))
	switch s.info.Disk {
	case runtime.DiskDir:
		err = s.store.Snapshot(s.ctx(t, opTimeout), src.RootFS, dst.RootFS, false)
	default:
		err = reflink(src.RootFS, dst.RootFS)
	}
	if err != nil {
		t.Fatalf("copy root filesystem: %v", err)
	}
	return dst
}

func reflink(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	if err := unix.IoctlFileClone(int(out.Fd()), int(in.Fd())); err != nil {
		out.Close()
		return fmt.Errorf("reflink: %w", err)
	}
	return out.Close()
}

// create prepares and creates an instance; it is destroyed at the end of the suite if a
// case did not do it.
func (s *suite) create(t *testing.T, name string) runtime.Spec {
	t.Helper()
	spec := s.spec(t, name)
	start := time.Now()
	if err := s.rt.Create(s.ctx(t, readyTimeout), spec); err != nil {
		t.Fatalf("Create: %v", err)
	}
	s.timings["create call"] = time.Since(start)
	s.track(spec)
	return spec
}

func (s *suite) track(spec runtime.Spec) {
	s.mu.Lock()
	s.live[spec.ID] = spec
	s.mu.Unlock()
}

// destroy destroys an instance and checks that nothing of it is left.
func (s *suite) destroy(t *testing.T, spec runtime.Spec) {
	t.Helper()
	if err := s.rt.Destroy(s.ctx(t, opTimeout), spec.ID); err != nil {
		t.Errorf("Destroy %s: %v", spec.ID, err)
	}
	s.mu.Lock()
	delete(s.live, spec.ID)
	s.mu.Unlock()
	s.assertNothingLeft(t, spec)
}

// cleanup destroys what the cases left (after a failure) and removes their storage.
func (s *suite) cleanup() {
	s.mu.Lock()
	live := make([]runtime.Spec, 0, len(s.live))
	for _, spec := range s.live {
		live = append(live, spec)
	}
	s.mu.Unlock()
	for _, spec := range live {
		s.destroy(s.t, spec)
	}
	if c, ok := s.rt.(io.Closer); ok {
		c.Close()
	}
}

func (s *suite) report() {
	keys := make([]string, 0, len(s.timings))
	for k := range s.timings {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	var b strings.Builder
	fmt.Fprintf(&b, "%s timings:", s.info.Name)
	for _, k := range keys {
		fmt.Fprintf(&b, "\n  %-40s %v", k, s.timings[k].Round(time.Millisecond))
	}
	for _, n := range s.notes {
		fmt.Fprintf(&b, "\n  %s", n)
	}
	s.t.Log(b.String())
}

// client returns an agent client whose connections are Dials of the runtime.
func (s *suite) client(id string) *agentclient.Client {
	return agentclient.New(func(ctx context.Context) (net.Conn, error) { return s.rt.Dial(ctx, id) })
}

// diagnose collects what the runtime left in the StateDir's logs, for failure messages.
func (s *suite) diagnose(spec runtime.Spec) string {
	var b strings.Builder
	entries, _ := os.ReadDir(spec.StateDir)
	for _, e := range entries {
		if !strings.HasSuffix(e.Name(), ".log") {
			continue
		}
		data, _ := os.ReadFile(filepath.Join(spec.StateDir, e.Name()))
		if len(data) > 4096 {
			data = data[len(data)-4096:]
		}
		fmt.Fprintf(&b, "--- %s:\n%s\n", e.Name(), data)
	}
	return b.String()
}

// identity is a fresh identity of generation gen.
func identity(gen int64, host string) wire.Identity {
	seed := make([]byte, 32)
	_, _ = rand.Read(seed)
	return wire.Identity{Generation: gen, Seed: seed, UnixNano: time.Now().UnixNano(), Hostname: host}
}

// resumeByFile tells whether the runtime's agent resumes from a file in its run dir.
func (s *suite) resumeByFile() bool { return s.info.Caps.AgentResume == runtime.ResumeByFile }

// runDir is the agent's run directory on the host for file-resumed runtimes.
func runDir(spec runtime.Spec) string { return filepath.Join(spec.StateDir, "run") }

// quiesce prepares the agent for a checkpoint as the node does.
func (s *suite) quiesce(t *testing.T, spec runtime.Spec, c *agentclient.Client) {
	t.Helper()
	if !s.resumeByFile() {
		// The agent keeps its transport across the checkpoint: nothing to close.
		c.CloseIdleConnections()
		return
	}
	ctx := s.ctx(t, opTimeout)
	if err := c.QuiesceClosing(ctx, runDir(spec)); err != nil {
		t.Fatalf("quiesce: %v", err)
	}
}

// resume gives a restored instance its identity as the node does and waits until the
// agent answers with it.
func (s *suite) resume(t *testing.T, spec runtime.Spec, c *agentclient.Client, id wire.Identity) wire.Health {
	t.Helper()
	ctx := s.ctx(t, readyTimeout)
	if s.resumeByFile() {
		if err := os.MkdirAll(runDir(spec), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := agentclient.WriteResume(runDir(spec), id); err != nil {
			t.Fatal(err)
		}
	}
	h, err := c.WaitReady(ctx)
	if err != nil {
		t.Fatalf("restored agent not ready: %v\n%s", err, s.diagnose(spec))
	}
	if !s.resumeByFile() {
		if err := c.SetIdentity(ctx, id); err != nil {
			t.Fatalf("set identity: %v", err)
		}
	}
	for h.Generation < id.Generation {
		if ctx.Err() != nil {
			t.Fatalf("agent did not apply identity generation %d (has %d)", id.Generation, h.Generation)
		}
		time.Sleep(5 * time.Millisecond) // polling the agent's state
		if h, err = c.Health(ctx); err != nil {
			t.Fatal(err)
		}
	}
	return h
}

// run runs a program to completion and returns its stdout, stderr and exit.
func run(t *testing.T, ctx context.Context, c *agentclient.Client, spec wire.ProcessSpec) (string, string, wire.Exit) {
	t.Helper()
	pi, err := c.StartProcess(ctx, spec)
	if err != nil {
		t.Fatalf("start %v: %v", spec.Argv, err)
	}
	out, err := c.Output(ctx, pi.PID, 0, true)
	if err != nil {
		t.Fatalf("output of %v: %v", spec.Argv, err)
	}
	defer out.Close()
	var stdout, stderr bytes.Buffer
	for {
		f, err := out.Next()
		if err != nil {
			t.Fatalf("output of %v: %v (so far %q %q)", spec.Argv, err, stdout.String(), stderr.String())
		}
		switch f.Type {
		case wire.FrameStdout:
			stdout.Write(f.Payload)
		case wire.FrameStderr:
			stderr.Write(f.Payload)
		case wire.FrameExit:
			var e wire.Exit
			_ = decodeJSON(f.Payload, &e)
			return stdout.String(), stderr.String(), e
		}
	}
}

// python runs a python3 snippet and returns its stdout, failing on a non-zero exit.
func python(t *testing.T, ctx context.Context, c *agentclient.Client, code string) string {
	t.Helper()
	stdout, stderr, exit := run(t, ctx, c, wire.ProcessSpec{Argv: []string{"python3", "-c", code}})
	if exit.ExitCode == nil || *exit.ExitCode != 0 {
		t.Fatalf("python3 %q: exit %+v, stderr %q", code, exit, stderr)
	}
	return stdout
}

// startCounter starts counterProgram and waits until it printed a few lines.
func startCounter(t *testing.T, ctx context.Context, c *agentclient.Client) int {
	t.Helper()
	pi, err := c.StartProcess(ctx, wire.ProcessSpec{Argv: []string{"python3", "-u", "-c", counterProgram}})
	if err != nil {
		t.Fatalf("start counter: %v", err)
	}
	for {
		if nums := counterOutput(t, ctx, c, pi.PID); len(nums) >= 3 {
			return pi.PID
		}
		if ctx.Err() != nil {
			t.Fatal("counter printed nothing")
		}
		time.Sleep(20 * time.Millisecond) // polling the process's output
	}
}

// counterOutput returns the numbers the counter printed so far (complete lines only).
func counterOutput(t *testing.T, ctx context.Context, c *agentclient.Client, pid int) []int {
	t.Helper()
	out, err := c.Output(ctx, pid, 0, false)
	if err != nil {
		t.Fatalf("counter output: %v", err)
	}
	defer out.Close()
	var buf bytes.Buffer
	for {
		f, err := out.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("counter output: %v", err)
		}
		if f.Type == wire.FrameStdout {
			buf.Write(f.Payload)
		}
		if f.Type == wire.FrameExit {
			t.Fatalf("counter exited: %s", f.Payload)
		}
	}
	var nums []int
	sc := bufio.NewScanner(&buf)
	for sc.Scan() {
		n, err := strconv.Atoi(sc.Text())
		if err != nil {
			break // a partial last line
		}
		nums = append(nums, n)
	}
	return nums
}

// checkSequence fails unless nums is 0, 1, 2, ... without gaps or restarts.
func checkSequence(t *testing.T, nums []int) {
	t.Helper()
	for i, n := range nums {
		if n != i {
			t.Fatalf("counter output is not 0..%d in order: at line %d got %d (%v)", len(nums)-1, i, n, nums)
		}
	}
}

// rss records the resident memory of the host processes serving an instance: those
// holding files in its StateDir or its root filesystem.
func (s *suite) rss(what string, spec runtime.Spec) {
	var total int64
	for _, pid := range holders(spec) {
		data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(data), "\n") {
			if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
				kb, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
				total += kb
			}
		}
	}
	s.notes = append(s.notes, fmt.Sprintf("host RSS of %s (%d MiB guest): %d MiB", what, spec.MemoryMB, total>>10))
}

// holders lists the processes (other than this one) that have a file open in the
// instance's StateDir or on its root filesystem, or whose command line names its id.
func holders(spec runtime.Spec) []int {
	dirs, _ := filepath.Glob("/proc/[0-9]*")
	var pids []int
	for _, d := range dirs {
		pid, err := strconv.Atoi(filepath.Base(d))
		if err != nil || pid == os.Getpid() {
			continue
		}
		if stat, err := os.ReadFile(filepath.Join(d, "stat")); err == nil {
			if i := bytes.LastIndexByte(stat, ')'); i > 0 && len(stat) > i+2 && stat[i+2] == 'Z' {
				continue // a zombie holds nothing
			}
		}
		if cmdline, err := os.ReadFile(filepath.Join(d, "cmdline")); err == nil && bytes.Contains(cmdline, []byte(spec.ID)) {
			pids = append(pids, pid)
			continue
		}
		fds, _ := os.ReadDir(filepath.Join(d, "fd"))
		for _, fd := range fds {
			target, err := os.Readlink(filepath.Join(d, "fd", fd.Name()))
			if err != nil {
				continue
			}
			if target == spec.RootFS || target == spec.StateDir || strings.HasPrefix(target, spec.StateDir+"/") ||
				strings.HasPrefix(target, spec.RootFS+"/") {
				pids = append(pids, pid)
				break
			}
		}
	}
	return pids
}

// assertNothingLeft checks that a destroyed instance left nothing: unknown to Status and
// List, no process, no file in its StateDir.
func (s *suite) assertNothingLeft(t *testing.T, spec runtime.Spec) {
	t.Helper()
	ctx := s.ctx(t, opTimeout)
	if st, err := s.rt.Status(ctx, spec.ID); !errors.Is(err, runtime.ErrNotFound) {
		t.Errorf("Status of destroyed %s: %v %v, want ErrNotFound", spec.ID, st, err)
	}
	list, err := s.rt.List(ctx)
	if err != nil {
		t.Errorf("List: %v", err)
	}
	if slices.ContainsFunc(list, func(i runtime.Instance) bool { return i.ID == spec.ID }) {
		t.Errorf("List still has destroyed %s: %v", spec.ID, list)
	}
	if pids := holders(spec); len(pids) > 0 {
		var desc []string
		for _, pid := range pids {
			cmd, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
			desc = append(desc, fmt.Sprintf("%d %q", pid, bytes.ReplaceAll(cmd, []byte{0}, []byte{' '})))
		}
		t.Errorf("processes of destroyed %s left: %v", spec.ID, desc)
	}
	if entries, err := os.ReadDir(spec.StateDir); err != nil || len(entries) > 0 {
		var names []string
		for _, e := range entries {
			names = append(names, e.Name())
		}
		t.Errorf("StateDir of destroyed %s not empty: %v %v", spec.ID, names, err)
	}
}
