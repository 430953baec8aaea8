package firecracker

import (
	"bytes"
	"context"
	"debug/elf"
	"encoding/binary"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/spacedev/space/internal/guest/agent"
	"github.com/spacedev/space/internal/guest/agentclient"
	"github.com/spacedev/space/internal/runtime"
	"github.com/spacedev/space/internal/runtime/firecracker/fcfake"
	"github.com/spacedev/space/internal/runtime/instances"
	kt "github.com/spacedev/space/internal/runtime/kernelimage/kernelimagetest"
	"github.com/spacedev/space/internal/testenv"
)

var update = flag.Bool("update", false, "rewrite golden files")

// agentEnv names the unix socket a re-executed test binary serves the agent on.
const agentEnv = "FIRECRACKER_TEST_AGENT_SOCKET"

func TestMain(m *testing.M) { testenv.Main(m, agent.MaybeRunGate, maybeRunAgent) }

// maybeRunAgent turns the test binary into a space agent serving unix:$agentEnv (the
// "guest" the fake bridges vsock connections to). It runs in its own process: an agent
// reaps every child of its process, which a test process that runs firecracker
// processes cannot allow.
func maybeRunAgent() {
	sock := os.Getenv(agentEnv)
	if sock == "" {
		return
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	reaper, err := agent.NewReaper(agent.ReaperConfig{})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	a, err := agent.New(agent.Config{Listen: "unix:" + sock, Reaper: reaper, Version: "test"})
	if err == nil {
		err = a.Run(ctx)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	os.Exit(0)
}

type tWriter struct{ t *testing.T }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}

func testLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(tWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// fixture is a runtime over the fake firecracker (and fake jailer) built from fcfake,
// with a real agent behind the emulated vsock.
type fixture struct {
	t      *testing.T
	dir    string
	fc     string // the fake firecracker
	jailer string // the fake jailer
	fake   fcfake.Config
	cfg    Config
	rt     *Runtime
	agent  string // a small file standing in for the agent binary
}

type fixtureOpts struct {
	version   string
	jailer    bool
	bootDelay time.Duration
}

const testUID, testGID = 4242, 4243

func newFixture(t *testing.T, o fixtureOpts) *fixture {
	t.Helper()
	if o.jailer && os.Geteuid() != 0 {
		t.Skip("the fake jailer chowns the jail: needs root")
	}
	dir := t.TempDir()
	f := &fixture{t: t, dir: dir}
	f.fc, f.jailer = buildFakes(t, filepath.Join(dir, "bin"))
	f.fake = fcfake.Config{
		Version:      o.version,
		AgentSocket:  startAgent(t),
		Record:       filepath.Join(dir, "calls.jsonl"),
		CgroupRoot:   filepath.Join(dir, "cgroup"),
		JailerRecord: filepath.Join(dir, "jailer.jsonl"),
	}
	if o.bootDelay > 0 {
		f.fake.BootDelay = o.bootDelay.String()
	}
	for _, exe := range []string{f.fc, f.jailer} {
		if err := fcfake.WriteConfig(exe, f.fake); err != nil {
			t.Fatal(err)
		}
	}
	// The cgroup v2 root the runtime and the fake jailer share: a plain directory.
	if err := os.MkdirAll(f.fake.CgroupRoot, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(f.fake.CgroupRoot, "cgroup.controllers"), []byte("cpuset cpu io memory pids\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	kernel := filepath.Join(dir, "vmlinux")
	writeELF(t, kernel)
	f.agent = filepath.Join(dir, "space-agent")
	if err := os.WriteFile(f.agent, []byte("#!agent\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	f.cfg = Config{
		FirecrackerPath: f.fc, JailerPath: f.jailer, NoJailer: !o.jailer, KernelPath: kernel,
		RootDir: filepath.Join(dir, "root"), UID: testUID, GID: testGID,
		CgroupRoot: f.fake.CgroupRoot, Logger: testLogger(t),
	}
	f.rt = f.newRuntime()
	return f
}

func (f *fixture) newRuntime() *Runtime {
	f.t.Helper()
	rt, err := New(f.cfg)
	if err != nil {
		f.t.Fatal(err)
	}
	return rt
}

// spec makes a sandbox disk and an empty StateDir for a new instance.
func (f *fixture) spec(id string) runtime.Spec {
	f.t.Helper()
	disks := filepath.Join(f.dir, "disks")
	state := filepath.Join(f.dir, "state", id)
	for _, d := range []string{disks, state} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			f.t.Fatal(err)
		}
	}
	disk := filepath.Join(disks, id+".ext4")
	if err := os.WriteFile(disk, []byte("ext4 image of "+id), 0o644); err != nil {
		f.t.Fatal(err)
	}
	return runtime.Spec{
		ID: id, RootFS: disk, StateDir: state, AgentPath: f.agent, CPU: 2, MemoryMB: 64,
		AgentEnv: map[string]string{"SPACE_AGENT_LOG_LEVEL": "debug"},
	}
}

func (f *fixture) create(spec runtime.Spec) {
	f.t.Helper()
	if err := f.rt.Create(f.ctx(), spec); err != nil {
		f.t.Fatalf("Create: %v\n%s", err, runtime.LogTail(filepath.Join(spec.StateDir, logFile), 4096))
	}
	f.track(spec)
}

// restore restores spec from the checkpoint in dir; the instance is destroyed when the
// test ends.
func (f *fixture) restore(spec runtime.Spec, dir string) {
	f.t.Helper()
	if err := f.rt.Restore(f.ctx(), spec, dir); err != nil {
		f.t.Fatalf("Restore: %v\n%s", err, runtime.LogTail(filepath.Join(spec.StateDir, logFile), 4096))
	}
	f.track(spec)
}

// track destroys the instance when the test ends (after a failure mid-way).
func (f *fixture) track(spec runtime.Spec) {
	f.t.Cleanup(func() {
		if err := f.rt.Destroy(context.Background(), spec.ID); err != nil {
			f.t.Errorf("cleanup: %v", err)
		}
	})
}

func (f *fixture) ctx() context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	f.t.Cleanup(cancel)
	return ctx
}

// calls returns the API calls the fake recorded since the last call of calls.
func (f *fixture) calls() []fcfake.Call {
	f.t.Helper()
	calls, err := fcfake.ReadCalls(f.fake.Record)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		f.t.Fatal(err)
	}
	os.Remove(f.fake.Record)
	return calls
}

// health reaches the instance's agent through Dial.
func (f *fixture) health(id string) string {
	f.t.Helper()
	c := agentclient.New(func(ctx context.Context) (net.Conn, error) { return f.rt.Dial(ctx, id) })
	defer c.CloseIdleConnections()
	h, err := c.Health(f.ctx())
	if err != nil {
		f.t.Fatalf("agent health through the vsock: %v", err)
	}
	return h.BootID
}

// assertGone checks that nothing of a destroyed instance is left: not known to Status or
// List, no process, no jail, no cgroup, no record, an empty StateDir, and the disk intact.
func (f *fixture) assertGone(spec runtime.Spec, rec record) {
	f.t.Helper()
	ctx := f.ctx()
	if st, err := f.rt.Status(ctx, spec.ID); !errors.Is(err, runtime.ErrNotFound) {
		f.t.Errorf("Status of destroyed %s: %v %v", spec.ID, st, err)
	}
	list, err := f.rt.List(ctx)
	if err != nil || slices.ContainsFunc(list, func(i runtime.Instance) bool { return i.ID == spec.ID }) {
		f.t.Errorf("List after Destroy: %v %v", list, err)
	}
	if rec.JailID != "" {
		if pids := instances.Scan(func(argv []string) bool { return argID(argv) == rec.JailID }); len(pids) > 0 {
			f.t.Errorf("processes left: %v", pids)
		}
	}
	for _, p := range []string{rec.JailDir, rec.Cgroup, f.rt.recordPath(spec.ID)} {
		if p == "" {
			continue
		}
		if _, err := os.Lstat(p); !errors.Is(err, os.ErrNotExist) {
			f.t.Errorf("%s left behind (%v)", p, err)
		}
	}
	if entries, err := os.ReadDir(spec.StateDir); err != nil || len(entries) > 0 {
		f.t.Errorf("StateDir not empty: %v %v", entries, err)
	}
	if _, err := os.Stat(spec.RootFS); err != nil {
		f.t.Errorf("the disk is gone: %v", err)
	}
}

// golden compares calls (rendered one per line) with testdata/name.
func golden(t *testing.T, name string, calls []fcfake.Call) {
	t.Helper()
	var b strings.Builder
	for _, c := range calls {
		b.WriteString(c.String() + "\n")
	}
	goldenText(t, name, b.String())
}

func goldenText(t *testing.T, name, got string) {
	t.Helper()
	p := filepath.Join("testdata", name)
	if *update {
		if err := os.MkdirAll("testdata", 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(p)
	if err != nil {
		t.Fatalf("%v (run with -update to create it)", err)
	}
	if got != string(want) {
		t.Errorf("%s changed (run with -update if intended):\n%s", p, got)
	}
}

// TestCreateGolden pins the exact API conversation of a boot, and what Create leaves:
// a running instance with a jail holding its files under their fixed names.
func TestCreateGolden(t *testing.T) {
	f := newFixture(t, fixtureOpts{})
	spec := f.spec("boot1")
	f.create(spec)
	golden(t, "create.golden", f.calls())
	if st, err := f.rt.Status(f.ctx(), spec.ID); err != nil || st != runtime.StatusRunning {
		t.Errorf("Status: %v %v", st, err)
	}
	rec, err := f.rt.readRecord(spec.ID)
	if err != nil {
		t.Fatal(err)
	}
	if want := filepath.Join(f.cfg.RootDir, "jail", "firecracker", f.rt.jailID(spec.ID)); rec.JailDir != want {
		t.Errorf("jail %s, want %s", rec.JailDir, want)
	}
	for _, name := range []string{kernelName, initrdName, diskName, vsockSocket, apiSocket} {
		if _, err := os.Lstat(filepath.Join(rec.chroot(), name)); err != nil {
			t.Errorf("jail lacks %s: %v", name, err)
		}
	}
	if !sameFile(t, spec.RootFS, filepath.Join(rec.chroot(), diskName)) {
		t.Error("the jail's disk is not the sandbox's disk (hard link)")
	}
	info, err := f.rt.Info(f.ctx())
	if err != nil || info.Name != "firecracker" || info.Disk != runtime.DiskExt4 || info.Version != fcfake.DefaultVersion ||
		info.Details["jailer"] != "off" || info.Caps.AgentResume != runtime.ResumeByAPI {
		t.Errorf("Info: %+v %v", info, err)
	}
	if err := f.rt.Create(f.ctx(), spec); err == nil || !strings.Contains(err.Error(), "already exists") {
		t.Errorf("second Create of one id: %v", err)
	}
	if err := f.rt.Destroy(f.ctx(), spec.ID); err != nil {
		t.Fatal(err)
	}
	f.assertGone(spec, rec)
	if err := f.rt.Destroy(f.ctx(), spec.ID); err != nil {
		t.Errorf("Destroy of a destroyed instance: %v", err)
	}
}

// TestJailer runs through the (fake) jailer: its command line, the cgroup, a jail
// owned by the jailer user whose files the unprivileged firecracker can use, the same
// API conversation as without the jailer, and a Destroy that removes the cgroup too.
func TestJailer(t *testing.T) {
	f := newFixture(t, fixtureOpts{jailer: true})
	spec := f.spec("jailed1")
	f.create(spec)
	golden(t, "create.golden", f.calls()) // identical to the unjailed conversation
	data, err := os.ReadFile(f.fake.JailerRecord)
	if err != nil {
		t.Fatal(err)
	}
	var inv struct {
		Args      []string          `json:"args"`
		Chroot    string            `json:"chroot"`
		CgroupDir string            `json:"cgroup_dir"`
		Cgroup    map[string]string `json:"cgroup"`
	}
	if err := json.Unmarshal(data, &inv); err != nil {
		t.Fatal(err)
	}
	norm := strings.NewReplacer(f.dir, "$TMP", f.rt.rootKey, "$KEY").Replace
	var b strings.Builder
	for _, a := range inv.Args {
		b.WriteString(norm(a) + "\n")
	}
	fmt.Fprintf(&b, "# chroot %s\n# cgroup %s %v\n", norm(inv.Chroot), norm(inv.CgroupDir), inv.Cgroup)
	goldenText(t, "jailer.golden", b.String())
	rec, err := f.rt.readRecord(spec.ID)
	if err != nil {
		t.Fatal(err)
	}
	if rec.Cgroup != inv.CgroupDir || !rec.Jailed {
		t.Errorf("record cgroup %q jailed %v; the jailer made %q", rec.Cgroup, rec.Jailed, inv.CgroupDir)
	}
	var st syscall.Stat_t
	if err := syscall.Stat(filepath.Join(rec.chroot(), diskName), &st); err != nil || st.Uid != testUID || st.Gid != testGID {
		t.Errorf("disk in the jail not owned by the jailer user: %+v %v", st, err)
	}
	f.health(spec.ID)
	info, _ := f.rt.Info(f.ctx())
	if info.Details["jailer"] != "on" || info.Details["jailer_user"] != "4242:4243" {
		t.Errorf("Info details: %v", info.Details)
	}
	// The parent cgroup got the controllers the VM cgroups need.
	for _, d := range []string{f.fake.CgroupRoot, filepath.Join(f.fake.CgroupRoot, DefaultParentCgroup)} {
		if data, _ := os.ReadFile(filepath.Join(d, "cgroup.subtree_control")); string(data) != "+cpu +memory" {
			t.Errorf("%s/cgroup.subtree_control: %q", d, data)
		}
	}
	if err := f.rt.Destroy(f.ctx(), spec.ID); err != nil {
		t.Fatal(err)
	}
	f.assertGone(spec, rec)
}

func TestDialHealth(t *testing.T) {
	// The guest's agent listens only some time after InstanceStart: Dial waits for it.
	f := newFixture(t, fixtureOpts{bootDelay: 300 * time.Millisecond})
	spec := f.spec("dial1")
	f.create(spec)
	start := time.Now()
	boot := f.health(spec.ID)
	if d := time.Since(start); d < 200*time.Millisecond {
		t.Errorf("agent answered %v after Create, before the guest booted", d)
	}
	if boot == "" || f.health(spec.ID) != boot {
		t.Error("agent boot id empty or changing")
	}
	if _, err := f.rt.Dial(f.ctx(), "nosuch"); !errors.Is(err, runtime.ErrNotFound) {
		t.Errorf("Dial of an unknown id: %v", err)
	}
}

func TestPauseResume(t *testing.T) {
	f := newFixture(t, fixtureOpts{})
	spec := f.spec("pause1")
	f.create(spec)
	f.health(spec.ID)
	f.calls()
	ctx := f.ctx()
	for range 2 { // idempotent
		if err := f.rt.Pause(ctx, spec.ID); err != nil {
			t.Fatal(err)
		}
	}
	if st, err := f.rt.Status(ctx, spec.ID); err != nil || st != runtime.StatusPaused {
		t.Errorf("Status after Pause: %v %v", st, err)
	}
	// A paused guest accepts nothing.
	short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	if c, err := f.rt.Dial(short, spec.ID); err == nil {
		c.Close()
		t.Error("Dial to a paused VM succeeded")
	}
	if err := f.rt.Resume(ctx, spec.ID); err != nil {
		t.Fatal(err)
	}
	if st, err := f.rt.Status(ctx, spec.ID); err != nil || st != runtime.StatusRunning {
		t.Errorf("Status after Resume: %v %v", st, err)
	}
	f.health(spec.ID)
	golden(t, "pause.golden", f.calls())
}

// TestCheckpointRestore: a checkpoint pauses the VM, snapshots it into the jail, ends
// firecracker and moves the files out; a restore in a new jail, with another id and a
// copy of the disk, gives Firecracker ≥ 1.16 the vsock socket explicitly and reaches
// the agent again.
func TestCheckpointRestore(t *testing.T) {
	f := newFixture(t, fixtureOpts{jailer: os.Geteuid() == 0})
	src := f.spec("orig1")
	f.create(src)
	boot := f.health(src.ID)
	f.calls()
	dir := filepath.Join(f.dir, "checkpoint")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := f.rt.Checkpoint(f.ctx(), src.ID, dir); err != nil {
		t.Fatal(err)
	}
	golden(t, "checkpoint.golden", f.calls())
	for _, name := range []string{cpVMState, cpMemory, cpMeta} {
		if _, err := os.Stat(filepath.Join(dir, name)); err != nil {
			t.Errorf("checkpoint lacks %s: %v", name, err)
		}
	}
	if fi, err := os.Stat(filepath.Join(dir, cpMemory)); err != nil || fi.Size() != 64<<20 {
		t.Errorf("memory file: %v %v", fi, err)
	}
	if st, err := f.rt.Status(f.ctx(), src.ID); err != nil || st != runtime.StatusStopped {
		t.Errorf("Status after Checkpoint: %v %v", st, err)
	}
	srcRec, _ := f.rt.readRecord(src.ID)
	if err := f.rt.Destroy(f.ctx(), src.ID); err != nil {
		t.Fatal(err)
	}
	f.assertGone(src, srcRec)

	dst := f.spec("clone1")
	if err := os.WriteFile(dst.RootFS, []byte("a copy of the disk"), 0o644); err != nil {
		t.Fatal(err)
	}
	f.restore(dst, dir)
	golden(t, "restore.golden", f.calls())
	if st, err := f.rt.Status(f.ctx(), dst.ID); err != nil || st != runtime.StatusRunning {
		t.Errorf("Status after Restore: %v %v", st, err)
	}
	if f.health(dst.ID) != boot {
		t.Error("restored agent has another boot id (same agent process expected)")
	}
	// A second clone of the same checkpoint runs alongside.
	dst2 := f.spec("clone2")
	f.restore(dst2, dir)
	f.health(dst2.ID)
	for _, s := range []runtime.Spec{dst, dst2} {
		rec, _ := f.rt.readRecord(s.ID)
		if err := f.rt.Destroy(f.ctx(), s.ID); err != nil {
			t.Fatal(err)
		}
		f.assertGone(s, rec)
	}
	if _, err := os.Stat(filepath.Join(dir, cpMemory)); err != nil {
		t.Errorf("Destroy of a restored instance removed the checkpoint's memory: %v", err)
	}
}

// TestRestoreOlderFirecracker: Firecracker 1.15 knows no vsock_override. A checkpoint
// whose names are the jail's restores without it; one that would need it, or one from
// another release line, is refused with a clear error before anything is left behind.
func TestRestoreOlderFirecracker(t *testing.T) {
	f := newFixture(t, fixtureOpts{version: "1.15.1"})
	src := f.spec("old1")
	f.create(src)
	f.health(src.ID)
	dir := filepath.Join(f.dir, "checkpoint")
	os.Mkdir(dir, 0o700)
	if err := f.rt.Checkpoint(f.ctx(), src.ID, dir); err != nil {
		t.Fatal(err)
	}
	f.calls()
	dst := f.spec("old2")
	f.restore(dst, dir)
	golden(t, "restore-1.15.golden", f.calls())
	f.health(dst.ID)

	meta, err := readCheckpointMeta(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		edit func(*checkpointMeta)
		want string
	}{
		{func(m *checkpointMeta) { m.VsockSocket = "vsock.sock" }, "needs vsock_override (Firecracker 1.16 or later; this host runs 1.15.1)"},
		{func(m *checkpointMeta) { m.FirecrackerVersion = "1.16.1" }, "written by Firecracker 1.16.1 and this host runs 1.15.1"},
		{func(m *checkpointMeta) { m.Disk = "disk.img" }, "root drive is \"disk.img\""},
	} {
		m := meta
		c.edit(&m)
		data, _ := json.Marshal(m)
		if err := os.WriteFile(filepath.Join(dir, cpMeta), data, 0o600); err != nil {
			t.Fatal(err)
		}
		spec := f.spec("refused")
		err := f.rt.Restore(f.ctx(), spec, dir)
		if err == nil {
			f.track(spec)
		}
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("Restore: %v, want an error with %q", err, c.want)
		}
		f.assertGone(spec, record{JailID: f.rt.jailID(spec.ID), JailDir: filepath.Join(f.cfg.RootDir, "jail", "firecracker", f.rt.jailID(spec.ID))})
	}
	for _, c := range f.calls() {
		if c.Method != "GET" { // Status and List (assertGone) ask the running clone
			t.Errorf("a refused restore talked to firecracker: %v", c)
		}
	}
}

// TestVersionGateAtLoad: the process's GET /version is authoritative. A binary that
// claimed 1.16 but whose API says 1.15 (replaced on disk) must not get vsock_override,
// which Firecracker 1.15 refuses as an unknown field.
func TestVersionGateAtLoad(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dir := t.TempDir()
	srv, err := fcfake.New(fcfake.Options{Version: "1.15.1", Dir: dir})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := srv.Listen("api.sock")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go srv.Serve(ln)
	api := newAPIClient(filepath.Join(dir, "api.sock"))
	load := snapshotLoad{SnapshotPath: vmstateName, MemBackend: &memBackend{BackendType: "File", BackendPath: memoryName}, VsockOverride: &vsockOverride{UDSPath: vsockSocket}}
	err = api.put(ctx, "/snapshot/load", load)
	var ae *APIError
	if !errors.As(err, &ae) || ae.StatusCode != 400 || !strings.Contains(ae.FaultMessage, "unknown field `vsock_override`") {
		t.Fatalf("vsock_override to 1.15: %v", err)
	}
	meta := checkpointMeta{FirecrackerVersion: "1.15.1", Disk: diskName, VsockSocket: vsockSocket}
	// The load fails (that fake has no snapshot files and failed once already), but not
	// over the field.
	g, err := fcfake.New(fcfake.Options{Version: "1.15.1", Dir: dir})
	if err != nil {
		t.Fatal(err)
	}
	ln2, err := g.Listen("api2.sock")
	if err != nil {
		t.Fatal(err)
	}
	defer ln2.Close()
	go g.Serve(ln2)
	err = (&Runtime{}).load(ctx, newAPIClient(filepath.Join(dir, "api2.sock")), version{1, 15, 1}, meta, runtime.Spec{})
	if err == nil || strings.Contains(err.Error(), "unknown field") || !strings.Contains(err.Error(), "Failed to get snapshot state") {
		t.Errorf("load on 1.15: %v", err)
	}
	if calls := g.Calls(); len(calls) != 1 || strings.Contains(calls[0].Body, "override") {
		t.Errorf("load on 1.15 sent %v", calls)
	}
}

// TestConfigAfterStartRejected: Firecracker refuses pre-boot configuration once the VM
// runs; the client surfaces the status and the fault message.
func TestConfigAfterStartRejected(t *testing.T) {
	f := newFixture(t, fixtureOpts{})
	spec := f.spec("late1")
	f.create(spec)
	rec, _ := f.rt.readRecord(spec.ID)
	api := newAPIClient(filepath.Join(rec.chroot(), apiSocket))
	err := api.put(f.ctx(), "/machine-config", machineConfig{VcpuCount: 4, MemSizeMib: 1024})
	var ae *APIError
	if !errors.As(err, &ae) || ae.StatusCode != 400 || ae.FaultMessage != "The requested operation is not supported after starting the microVM." {
		t.Fatalf("machine-config after start: %v", err)
	}
	if !strings.Contains(err.Error(), "firecracker PUT /machine-config: 400: The requested operation is not supported after starting") {
		t.Errorf("error text %q", err)
	}
	// An unknown field is refused as a whole.
	type extra struct {
		machineConfig
		Balloon bool `json:"balloon"`
	}
	err = api.put(f.ctx(), "/machine-config", extra{machineConfig: machineConfig{VcpuCount: 1, MemSizeMib: 128}, Balloon: true})
	if !errors.As(err, &ae) || !strings.Contains(ae.FaultMessage, "unknown field `balloon`") {
		t.Errorf("unknown field: %v", err)
	}
}

// TestCreateFailureUndo: a boot Firecracker refuses (here: a kernel that is no ELF at
// InstanceStart) fails Create with the fault message and leaves nothing.
func TestCreateFailureUndo(t *testing.T) {
	f := newFixture(t, fixtureOpts{jailer: os.Geteuid() == 0})
	if err := os.WriteFile(f.cfg.KernelPath, []byte("MZ not an elf"), 0o644); err != nil {
		t.Fatal(err)
	}
	spec := f.spec("fail1")
	err := f.rt.Create(f.ctx(), spec)
	if err == nil {
		f.track(spec)
	}
	if err == nil || !strings.Contains(err.Error(), "Cannot load kernel") {
		t.Fatalf("Create with a bad kernel: %v", err)
	}
	jid := f.rt.jailID(spec.ID)
	rec := record{JailID: jid, JailDir: filepath.Join(f.cfg.RootDir, "jail", "firecracker", jid)}
	if f.rt.jailed {
		rec.Cgroup = filepath.Join(f.fake.CgroupRoot, DefaultParentCgroup, jid)
	}
	f.assertGone(spec, rec)
	if err := os.WriteFile(f.cfg.KernelPath, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := New(f.cfg); err == nil || !strings.Contains(err.Error(), "not an uncompressed vmlinux") {
		t.Errorf("New with a non-ELF kernel: %v", err)
	}
}

// TestAdoptAfterRestart: a new Runtime over the same root dir (a restarted node) lists,
// adopts and reaches a running instance, and refuses a wrong StateDir.
func TestAdoptAfterRestart(t *testing.T) {
	f := newFixture(t, fixtureOpts{})
	spec := f.spec("adopt1")
	f.create(spec)
	boot := f.health(spec.ID)
	f.rt = f.newRuntime()
	list, err := f.rt.List(f.ctx())
	if err != nil || !slices.Contains(list, runtime.Instance{ID: spec.ID, Status: runtime.StatusRunning}) {
		t.Fatalf("List of the new runtime: %v %v", list, err)
	}
	if err := f.rt.Adopt(f.ctx(), spec); err != nil {
		t.Fatal(err)
	}
	if f.health(spec.ID) != boot {
		t.Error("adopted instance has another agent")
	}
	wrong := spec
	wrong.StateDir = filepath.Join(f.dir, "elsewhere")
	if err := f.rt.Adopt(f.ctx(), wrong); err == nil {
		t.Error("Adopt with another StateDir succeeded")
	}
	// A lost record is rebuilt from the process.
	rec, _ := f.rt.readRecord(spec.ID)
	os.Remove(f.rt.recordPath(spec.ID))
	if err := f.rt.Adopt(f.ctx(), spec); err != nil {
		t.Fatalf("Adopt without a record: %v", err)
	}
	if err := f.rt.Destroy(f.ctx(), spec.ID); err != nil {
		t.Fatal(err)
	}
	f.assertGone(spec, rec)
}

func TestNetworkUnsupported(t *testing.T) {
	f := newFixture(t, fixtureOpts{})
	spec := f.spec("net1")
	spec.Network = true
	err := f.rt.Create(f.ctx(), spec)
	if err == nil {
		f.track(spec)
	}
	if !errors.Is(err, runtime.ErrUnsupported) {
		t.Fatalf("Create with Network and no namespace: %v", err)
	}
	f.assertGone(spec, record{JailID: f.rt.jailID(spec.ID)})
	if calls := f.calls(); len(calls) > 0 {
		t.Errorf("calls: %v", calls)
	}
}

// TestJailNextToDisk: when the disk is on another file system than the chroot base (no
// hard link possible), the jail goes next to the disk and goes away with the instance.
func TestJailNextToDisk(t *testing.T) {
	f := newFixture(t, fixtureOpts{})
	shm, err := os.MkdirTemp("/dev/shm", "fctest-")
	if err != nil {
		t.Skipf("no /dev/shm: %v", err)
	}
	defer os.RemoveAll(shm)
	if same, _ := sameDevice(shm, f.dir); same {
		t.Skip("/dev/shm is on the temp dir's file system")
	}
	spec := f.spec("shm1")
	spec.RootFS = filepath.Join(shm, "disk.ext4")
	if err := os.WriteFile(spec.RootFS, []byte("ext4"), 0o644); err != nil {
		t.Fatal(err)
	}
	f.create(spec)
	rec, _ := f.rt.readRecord(spec.ID)
	if !strings.HasPrefix(rec.JailDir, filepath.Join(shm, fallbackJail)+"/") {
		t.Errorf("jail %s not next to the disk", rec.JailDir)
	}
	f.health(spec.ID)
	if err := f.rt.Destroy(f.ctx(), spec.ID); err != nil {
		t.Fatal(err)
	}
	f.assertGone(spec, rec)
	if entries, _ := os.ReadDir(shm); len(entries) != 1 {
		t.Errorf("left next to the disk: %v", entries)
	}
}

func TestBootArgsLimit(t *testing.T) {
	if _, err := bootArgs(map[string]string{"BIG": strings.Repeat("x", 2000)}); err == nil {
		t.Error("a 2000-byte environment fits on the kernel command line")
	}
}

func TestParseVersion(t *testing.T) {
	for in, want := range map[string]version{"1.16.1": {1, 16, 1}, "v1.12.0": {1, 12, 0}, "1.17.0-dev": {1, 17, 0}} {
		if v, err := parseVersion(in); err != nil || v != want {
			t.Errorf("parseVersion(%q) = %v %v", in, v, err)
		}
	}
	if _, err := parseVersion("one"); err == nil {
		t.Error("parseVersion(one) succeeded")
	}
}

// buildFakes builds the fake firecracker and jailer (static, so the jailer's copy runs
// anywhere) into dir.
func buildFakes(t *testing.T, dir string) (fc, jailer string) {
	t.Helper()
	wd, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	root := wd
	for !fileExists(filepath.Join(root, "go.mod")) {
		if root == filepath.Dir(root) {
			t.Fatal("no go.mod above " + wd)
		}
		root = filepath.Dir(root)
	}
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Skipf("no go toolchain to build the fakes: %v", err)
	}
	cmd := exec.Command(goBin, "build", "-o", dir+"/",
		"./internal/runtime/firecracker/fcfake/cmd/firecracker",
		"./internal/runtime/firecracker/fcfake/cmd/jailer")
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build fakes: %v\n%s", err, out)
	}
	return filepath.Join(dir, "firecracker"), filepath.Join(dir, "jailer")
}

// startAgent runs a space agent (this test binary, see maybeRunAgent) on a unix socket
// and returns the socket's path once the agent answers.
func startAgent(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "fcagent-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	sock := filepath.Join(dir, "agent.sock")
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), agentEnv+"="+sock)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGTERM)
		cmd.Wait()
	})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := agentclient.New(agentclient.DialUnix(sock)).WaitReady(ctx); err != nil {
		t.Fatalf("test agent: %v\n%s", err, out.String())
	}
	return sock
}

// writeELF writes a minimal x86-64 ELF header: what New checks of a kernel.
func writeELF(t *testing.T, p string) {
	t.Helper()
	h := elf.Header64{
		Type: uint16(elf.ET_EXEC), Machine: uint16(elf.EM_X86_64), Version: uint32(elf.EV_CURRENT),
		Ehsize: 64, Phentsize: 56, Shentsize: 64,
	}
	copy(h.Ident[:], elf.ELFMAG)
	h.Ident[elf.EI_CLASS] = byte(elf.ELFCLASS64)
	h.Ident[elf.EI_DATA] = byte(elf.ELFDATA2LSB)
	h.Ident[elf.EI_VERSION] = byte(elf.EV_CURRENT)
	var b bytes.Buffer
	if err := binary.Write(&b, binary.LittleEndian, h); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, b.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
}

func sameFile(t *testing.T, a, b string) bool {
	t.Helper()
	fa, err := os.Stat(a)
	if err != nil {
		t.Fatal(err)
	}
	fb, err := os.Stat(b)
	if err != nil {
		t.Fatal(err)
	}
	return os.SameFile(fa, fb)
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

// TestCompressedKernel: a compressed kernel (a bzImage, as /boot/vmlinuz-* is) works as
// KernelPath: the runtime extracts its vmlinux once into <RootDir>/kernel, each jail
// gets that ELF, and a restarted runtime reuses the extraction.
func TestCompressedKernel(t *testing.T) {
	f := newFixture(t, fixtureOpts{jailer: os.Geteuid() == 0})
	vmlinux, err := os.ReadFile(f.cfg.KernelPath)
	if err != nil {
		t.Fatal(err)
	}
	f.cfg.KernelPath = filepath.Join(f.dir, "vmlinuz-0.0.0-test")
	if err := os.WriteFile(f.cfg.KernelPath, kt.BzImage(kt.Compress(t, "zstd", vmlinux)), 0o644); err != nil {
		t.Fatal(err)
	}
	f.rt = f.newRuntime()
	extracted, err := filepath.Glob(filepath.Join(f.cfg.RootDir, kernelDir, "*.vmlinux"))
	if err != nil || len(extracted) != 1 {
		t.Fatalf("extracted kernels: %v %v, want one", extracted, err)
	}
	before, _ := os.Stat(extracted[0])
	spec := f.spec("bz1")
	f.create(spec)
	f.health(spec.ID)
	jid := f.rt.jailID(spec.ID)
	rec := record{JailID: jid, JailDir: filepath.Join(f.cfg.RootDir, "jail", "firecracker", jid)}
	got, err := os.ReadFile(filepath.Join(rec.chroot(), kernelName))
	if err != nil || !bytes.Equal(got, vmlinux) {
		t.Fatalf("the jail's kernel is not the vmlinux inside the bzImage (%v)", err)
	}
	f.rt = f.newRuntime()
	if after, err := os.Stat(extracted[0]); err != nil || !after.ModTime().Equal(before.ModTime()) {
		t.Fatalf("a restarted runtime extracted the kernel again (%v)", err)
	}
	// Neither an ELF nor a bzImage: refused at start-up.
	if err := os.WriteFile(f.cfg.KernelPath, []byte("MZ\x00 a PE image"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := New(f.cfg); err == nil || !strings.Contains(err.Error(), "not an uncompressed vmlinux") {
		t.Fatalf("New with an unusable kernel: %v", err)
	}
}
