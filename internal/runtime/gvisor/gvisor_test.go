package gvisor

import (
	"bytes"
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/runtime"
)

// testAgent is the path of the test agent binary built by TestMain ("" when the runsc
// tests are skipped).
var testAgent string

// skipReason says why the tests that need runsc cannot run here.
var skipReason string

func TestMain(m *testing.M) {
	os.Exit(testMain(m))
}

// testRunsc and testPlatform are the runsc the tests use: the default one, or the one
// SPACE_TEST_RUNSC names (e.g. Debian's /usr/bin/runsc with SPACE_TEST_RUNSC_PLATFORM
// ptrace and SPACE_TEST_RUNSC_NO_USERNS=1, to check the fallback).
var (
	testRunsc    = cmp.Or(os.Getenv("SPACE_TEST_RUNSC"), DefaultRunscPath)
	testPlatform = cmp.Or(os.Getenv("SPACE_TEST_RUNSC_PLATFORM"), DefaultPlatform)
	testNoUserNS = os.Getenv("SPACE_TEST_RUNSC_NO_USERNS") != ""
)

func testMain(m *testing.M) int {
	switch _, err := os.Stat(testRunsc); {
	case os.Geteuid() != 0:
		skipReason = "runsc tests need root"
	case err != nil:
		skipReason = fmt.Sprintf("runsc not installed at %s (scripts/setup.sh builds it)", testRunsc)
	}
	if skipReason == "" && os.Getenv(helperSpecEnv) == "" {
		dir, err := os.MkdirTemp("", "gvisor-testagent-")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		defer os.RemoveAll(dir)
		testAgent = filepath.Join(dir, "testagent")
		cmd := exec.Command("go", "build", "-o", testAgent, "./testdata/testagent")
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			fmt.Fprintf(os.Stderr, "build test agent: %v\n%s", err, out)
			return 1
		}
	}
	return m.Run()
}

func needRunsc(t *testing.T) {
	t.Helper()
	if skipReason != "" {
		t.Skip(skipReason)
	}
}

// testLogger sends the runtime's logs (runsc invocations at debug) to the test log.
func testLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(tWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type tWriter struct{ t *testing.T }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Helper()
	w.t.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}

func newTestRuntime(t *testing.T, rootDir string) *Runtime {
	t.Helper()
	return newRuntimeWith(t, rootDir, testRunsc)
}

// newRuntimeWith is newTestRuntime with another runsc binary (a wrapper of the real one).
func newRuntimeWith(t *testing.T, rootDir, runsc string) *Runtime {
	t.Helper()
	cfg := Config{RunscPath: runsc, Platform: testPlatform, RootDir: rootDir, NoUserNS: testNoUserNS, Logger: testLogger(t)}
	// Extra runsc flags for investigating a failure, e.g. "--debug --debug-log=/tmp/d/".
	cfg.ExtraFlags = strings.Fields(os.Getenv("SPACE_TEST_RUNSC_FLAGS"))
	rt, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		rt.Close()
		unmountNullNetNS(t, rootDir)
	})
	return rt
}

// unmountNullNetNS unmounts the empty network namespace runsc pins in its root dir for
// all gofers (a host mount the root dir keeps for the host's lifetime), so that the
// test's temporary root dir can be removed.
func unmountNullNetNS(t *testing.T, rootDir string) {
	if err := UnpinNullNetNS(rootDir); err != nil {
		t.Error(err)
	}
}

// testRootDir is a root dir for a test runtime. The sandboxes' user namespace must be
// able to search the directories above it, and t.TempDir makes them 0700.
func testRootDir(t *testing.T) string {
	t.Helper()
	tmp := t.TempDir()
	for _, d := range []string{tmp, filepath.Dir(tmp)} {
		if err := os.Chmod(d, 0o711); err != nil {
			t.Fatal(err)
		}
	}
	return filepath.Join(tmp, "runsc")
}

func newID(t *testing.T) string {
	b := make([]byte, 6)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return "t" + hex.EncodeToString(b)
}

func testSpec(t *testing.T, id string) runtime.Spec {
	return runtime.Spec{
		ID:        id,
		RootFS:    t.TempDir(),
		StateDir:  t.TempDir(),
		AgentPath: testAgent,
		CPU:       1,
		MemoryMB:  256,
	}
}

// agentClient is an HTTP client whose connections are rt.Dial(id).
func agentClient(t *testing.T, rt *Runtime, id string) *http.Client {
	tr := &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return rt.Dial(ctx, id)
		},
	}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: 10 * time.Second}
}

func get(t *testing.T, c *http.Client, path string) []byte {
	t.Helper()
	resp, err := c.Get("http://agent" + path)
	if err != nil {
		t.Fatalf("GET %s: %v", path, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %d %v %s", path, resp.StatusCode, err, body)
	}
	return body
}

// waitHealthy polls the agent's health endpoint until it answers.
func waitHealthy(t *testing.T, c *http.Client) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		resp, err := c.Get("http://agent/v1/health")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
			err = fmt.Errorf("status %d", resp.StatusCode)
		}
		if time.Now().After(deadline) {
			t.Fatalf("agent not healthy: %v", err)
		}
		time.Sleep(20 * time.Millisecond) // poll interval, not a readiness guess
	}
}

// assertNothingLeft checks that nothing of the instance remains: no runsc container, no
// host process, no record, no file in the StateDir, no cgroup.
func assertNothingLeft(t *testing.T, rt *Runtime, spec runtime.Spec) {
	t.Helper()
	ctx := context.Background()
	if _, err := rt.Status(ctx, spec.ID); !errors.Is(err, runtime.ErrNotFound) {
		t.Errorf("Status after destroy: %v, want ErrNotFound", err)
	}
	list, err := rt.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if slices.ContainsFunc(list, func(i runtime.Instance) bool { return i.ID == spec.ID }) {
		t.Errorf("List still has %s: %v", spec.ID, list)
	}
	out, err := exec.Command(rt.cfg.RunscPath, "--root="+rt.cfg.RootDir, "list", "-format=json").Output()
	if err != nil {
		t.Fatal(err)
	}
	if s := strings.TrimSpace(string(out)); s != "[]" && s != "null" {
		t.Errorf("runsc list: %s", s)
	}
	if pids := procsMentioning(t, rt.cfg.RootDir, spec.StateDir); len(pids) > 0 {
		t.Errorf("processes left: %v", pids)
	}
	if entries, _ := os.ReadDir(filepath.Join(rt.cfg.RootDir, recordsDir)); len(entries) > 0 {
		t.Errorf("records left: %v", entries)
	}
	if entries, err := os.ReadDir(spec.StateDir); err != nil || len(entries) > 0 {
		t.Errorf("state dir: %v %v", entries, err)
	}
	for _, dir := range cgroupDirs(spec.ID) {
		if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("cgroup %s: %v", dir, err)
		}
	}
	if _, err := os.Stat(rt.mountDir(spec.ID)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("mount dir: %v", err)
	}
	if m := mountsUnder(t, spec.StateDir, rt.mountDir(spec.ID)); len(m) > 0 {
		t.Errorf("mounts left: %v", m)
	}
}

// mountsUnder lists the mount points in /proc/self/mountinfo at or below the dirs.
func mountsUnder(t *testing.T, dirs ...string) []string {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	var found []string
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 5 {
			continue
		}
		for _, d := range dirs {
			if f[4] == d || strings.HasPrefix(f[4], d+"/") {
				found = append(found, f[4])
			}
		}
	}
	return found
}

// procsMentioning lists the processes whose command line contains one of the strings,
// read independently of the package's own /proc scan.
func procsMentioning(t *testing.T, s ...string) []string {
	t.Helper()
	matches, err := filepath.Glob("/proc/[0-9]*/cmdline")
	if err != nil {
		t.Fatal(err)
	}
	var found []string
	for _, m := range matches {
		b, err := os.ReadFile(m)
		if err != nil {
			continue
		}
		cmd := string(bytes.ReplaceAll(b, []byte{0}, []byte{' '}))
		for _, x := range s {
			if strings.Contains(cmd, x) {
				found = append(found, filepath.Base(filepath.Dir(m))+": "+cmd)
				break
			}
		}
	}
	return found
}

// cgroupDirs are the host cgroup directories of an instance under the default parent.
func cgroupDirs(id string) []string {
	if _, err := os.Stat("/sys/fs/cgroup/cgroup.controllers"); err == nil { // v2
		return []string{filepath.Join("/sys/fs/cgroup", DefaultCgroupParent, id)}
	}
	return []string{
		filepath.Join("/sys/fs/cgroup/memory", DefaultCgroupParent, id),
		filepath.Join("/sys/fs/cgroup/cpu", DefaultCgroupParent, id),
	}
}

func readTrim(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

func TestLifecycle(t *testing.T) {
	needRunsc(t)
	ctx := context.Background()
	rootDir := testRootDir(t)
	rt := newTestRuntime(t, rootDir)
	id := newID(t)
	spec := testSpec(t, id)
	// A StateDir too long for a unix socket address makes Dial take its long-path route.
	spec.StateDir = filepath.Join(spec.StateDir, strings.Repeat("s", 100))
	if err := os.Mkdir(spec.StateDir, 0o700); err != nil {
		t.Fatal(err)
	}
	spec.AgentEnv = map[string]string{"SPACE_TEST": "hello"}

	if err := rt.Create(ctx, spec); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := rt.Destroy(context.Background(), id); err != nil {
			t.Error(err)
		}
	})
	c := agentClient(t, rt, id)
	waitHealthy(t, c)

	t.Run("health", func(t *testing.T) {
		var h struct{ Version string }
		if err := json.Unmarshal(get(t, c, "/v1/health"), &h); err != nil || h.Version != "test" {
			t.Fatalf("health: %+v %v", h, err)
		}
	})
	t.Run("memory limit", func(t *testing.T) {
		// gVisor sizes its memory to the cgroup limit: MemTotal is the limit.
		meminfo := string(get(t, c, "/meminfo"))
		if !strings.Contains(meminfo, fmt.Sprintf("MemTotal: %d kB", spec.MemoryMB*1024)) &&
			!strings.Contains(strings.Join(strings.Fields(meminfo), " "), fmt.Sprintf("MemTotal: %d kB", spec.MemoryMB*1024)) {
			t.Errorf("meminfo does not show %d MiB:\n%s", spec.MemoryMB, meminfo)
		}
	})
	t.Run("host cgroup limits", func(t *testing.T) {
		dirs := cgroupDirs(id)
		if len(dirs) == 1 { // v2
			if got := readTrim(t, filepath.Join(dirs[0], "memory.max")); got != fmt.Sprint(hostMemoryLimit(spec)) { // the guest plus the Sentry's share (bundle.go)
				t.Errorf("memory.max = %s", got)
			}
			if got := readTrim(t, filepath.Join(dirs[0], "cpu.max")); got != "100000 100000" {
				t.Errorf("cpu.max = %s", got)
			}
			return
		}
		if got := readTrim(t, filepath.Join(dirs[0], "memory.limit_in_bytes")); got != fmt.Sprint(hostMemoryLimit(spec)) { // the guest plus the Sentry's share (bundle.go)
			t.Errorf("memory.limit_in_bytes = %s", got)
		}
		if got := readTrim(t, filepath.Join(dirs[1], "cpu.cfs_quota_us")); got != "100000" {
			t.Errorf("cpu.cfs_quota_us = %s", got)
		}
	})
	t.Run("no network", func(t *testing.T) {
		var devs []string
		if err := json.Unmarshal(get(t, c, "/netdevs"), &devs); err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(devs, []string{"lo"}) {
			t.Errorf("interfaces %v, want only lo", devs)
		}
	})
	t.Run("agent env", func(t *testing.T) {
		var env []string
		if err := json.Unmarshal(get(t, c, "/env"), &env); err != nil {
			t.Fatal(err)
		}
		for _, want := range []string{"SPACE_TEST=hello", "SPACE_AGENT_LISTEN=connect:/run/space/node.sock"} {
			if !slices.Contains(env, want) {
				t.Errorf("env %v lacks %s", env, want)
			}
		}
	})
	t.Run("writes reach the rootfs", func(t *testing.T) {
		resp, err := c.Post("http://agent/write?path=/hello", "text/plain", strings.NewReader("hi"))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusNoContent {
			t.Fatalf("write: %s", resp.Status)
		}
		if got, err := os.ReadFile(filepath.Join(spec.RootFS, "hello")); err != nil || string(got) != "hi" {
			t.Errorf("rootfs/hello = %q, %v", got, err)
		}
	})
	t.Run("status and list", func(t *testing.T) {
		if st, err := rt.Status(ctx, id); err != nil || st != runtime.StatusRunning {
			t.Errorf("Status = %v, %v", st, err)
		}
		list, err := rt.List(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Contains(list, runtime.Instance{ID: id, Status: runtime.StatusRunning}) {
			t.Errorf("List = %v", list)
		}
	})
	t.Run("info", func(t *testing.T) {
		info, err := rt.Info(ctx)
		if err != nil || info.Name != "gvisor" || info.Version == "" || info.Details["platform"] != testPlatform {
			t.Errorf("Info = %+v, %v", info, err)
		}
		// The pinned release holds the pids limit inside the sandbox (else the fork bomb
		// test would skip).
		if testRunsc == DefaultRunscPath && info.Details["pids_limit"] != "sandbox" {
			t.Errorf("Info details %v: want pids_limit sandbox", info.Details)
		}
	})
	t.Run("create again fails and keeps the instance", func(t *testing.T) {
		if err := rt.Create(ctx, spec); err == nil {
			t.Fatal("second Create succeeded")
		}
		waitHealthy(t, c)
	})
	t.Run("adopt after restart", func(t *testing.T) {
		fresh := newTestRuntime(t, rootDir) // a new node process: nothing in memory
		rt.links.close(id)                  // the old process is gone, its link with it
		if err := fresh.Adopt(ctx, spec); err != nil {
			t.Fatal(err)
		}
		wrong := spec
		wrong.StateDir = t.TempDir()
		if err := fresh.Adopt(ctx, wrong); err == nil {
			t.Error("Adopt with another state dir succeeded")
		}
		fc := agentClient(t, fresh, id)
		get(t, fc, "/v1/health") // the agent connected again, to the new process
		// And back to the first runtime, for what follows.
		fresh.links.close(id)
		if err := rt.Adopt(ctx, spec); err != nil {
			t.Fatal(err)
		}
		c.CloseIdleConnections()
		waitHealthy(t, c)
	})
	t.Run("stopped", func(t *testing.T) {
		if out, err := exec.Command(rt.cfg.RunscPath, "--root="+rootDir, "kill", id, "KILL").CombinedOutput(); err != nil {
			t.Fatalf("runsc kill: %v %s", err, out)
		}
		deadline := time.Now().Add(10 * time.Second)
		for {
			st, err := rt.Status(ctx, id)
			if err != nil {
				t.Fatal(err)
			}
			if st == runtime.StatusStopped {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("status %s after kill", st)
			}
			time.Sleep(20 * time.Millisecond) // poll interval
		}
		if err := rt.Adopt(ctx, spec); err == nil {
			t.Error("Adopt of a stopped instance succeeded")
		}
	})

	if err := rt.Destroy(ctx, id); err != nil {
		t.Fatal(err)
	}
	assertNothingLeft(t, rt, spec)
	if got, err := os.ReadFile(filepath.Join(spec.RootFS, "hello")); err != nil || string(got) != "hi" {
		t.Errorf("Destroy touched the rootfs: %q, %v", got, err)
	}
	if err := rt.Destroy(ctx, id); err != nil {
		t.Errorf("second Destroy: %v", err)
	}
	if _, err := rt.Dial(ctx, id); err == nil {
		t.Error("Dial after Destroy succeeded")
	}
}

func TestCreateFailureLeavesNothing(t *testing.T) {
	needRunsc(t)
	for _, tc := range []struct {
		name   string
		modify func(t *testing.T, s *runtime.Spec)
		is     error
	}{
		{"missing rootfs", func(t *testing.T, s *runtime.Spec) {
			s.RootFS = filepath.Join(t.TempDir(), "nope")
		}, nil},
		{"agent not executable by runsc", func(t *testing.T, s *runtime.Spec) {
			s.AgentPath = filepath.Join(t.TempDir(), "agent")
			if err := os.WriteFile(s.AgentPath, []byte("not a program"), 0o755); err != nil {
				t.Fatal(err)
			}
		}, nil},
		{"network", func(t *testing.T, s *runtime.Spec) { s.Network = true }, runtime.ErrUnsupported},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rt := newTestRuntime(t, testRootDir(t))
			spec := testSpec(t, newID(t))
			tc.modify(t, &spec)
			err := rt.Create(context.Background(), spec)
			if err == nil {
				t.Cleanup(func() { rt.Destroy(context.Background(), spec.ID) })
				t.Fatal("Create succeeded")
			}
			t.Logf("Create: %v", err)
			if tc.is != nil && !errors.Is(err, tc.is) {
				t.Errorf("error %v is not %v", err, tc.is)
			}
			assertNothingLeft(t, rt, spec)
			if entries, err := os.ReadDir(spec.RootFS); err == nil && len(entries) > 0 {
				t.Errorf("rootfs not restored: %v", entries)
			}
		})
	}
}

func TestUnknownInstance(t *testing.T) {
	needRunsc(t)
	ctx := context.Background()
	rt := newTestRuntime(t, testRootDir(t))
	if err := rt.Destroy(ctx, "nosuchid"); err != nil {
		t.Errorf("Destroy: %v", err)
	}
	if _, err := rt.Status(ctx, "nosuchid"); !errors.Is(err, runtime.ErrNotFound) {
		t.Errorf("Status: %v", err)
	}
	if _, err := rt.Dial(ctx, "nosuchid"); !errors.Is(err, runtime.ErrNotFound) {
		t.Errorf("Dial: %v", err)
	}
	if err := rt.Adopt(ctx, runtime.Spec{ID: "nosuchid", StateDir: t.TempDir()}); !errors.Is(err, runtime.ErrNotFound) {
		t.Errorf("Adopt: %v", err)
	}
	if _, err := rt.Status(ctx, "../x"); err == nil {
		t.Error("Status accepted an invalid id")
	}
}

// TestUnrecordedInstance: an id without a record is looked up with one runsc list and,
// when absent, known absent until it changes: a create then asks runsc nothing more
// about it. A container whose record was lost is still found.
func TestUnrecordedInstance(t *testing.T) {
	needRunsc(t)
	ctx := context.Background()
	rt := newTestRuntime(t, testRootDir(t))
	spec := testSpec(t, newID(t))
	if _, err := rt.Status(ctx, spec.ID); !errors.Is(err, runtime.ErrNotFound) {
		t.Fatalf("Status of a new id: %v", err)
	}
	if !rt.statuses.isGone(spec.ID) {
		t.Fatal("a new id is not known absent after Status")
	}
	rt.statuses.change([]string{spec.ID})()
	if err := rt.Destroy(ctx, spec.ID); err != nil || !rt.statuses.isGone(spec.ID) {
		t.Fatalf("Destroy of a new id: %v, known absent after it: %v", err, rt.statuses.isGone(spec.ID))
	}
	c := startSandbox(t, rt, spec) // Create clears it
	waitHealthy(t, c)
	if st, err := rt.Status(ctx, spec.ID); err != nil || st != runtime.StatusRunning {
		t.Fatalf("Status after Create = %v, %v", st, err)
	}
	// A record lost by hand: runsc still lists the container, and Status says so.
	if err := rt.removeRecord(spec.ID); err != nil {
		t.Fatal(err)
	}
	rt.statuses.change([]string{spec.ID})()
	if st, err := rt.Status(ctx, spec.ID); err != nil || st != runtime.StatusRunning {
		t.Fatalf("Status with the record lost = %v, %v", st, err)
	}
	if rt.statuses.isGone(spec.ID) {
		t.Fatal("a listed container is known absent")
	}
	if err := rt.Adopt(ctx, spec); err != nil { // restores the record
		t.Fatal(err)
	}
}

// TestInterruptedCreate: a node that died during Create leaves a record and files but no
// container; the instance shows as stopped and Destroy reclaims it.
func TestInterruptedCreate(t *testing.T) {
	needRunsc(t)
	ctx := context.Background()
	rt := newTestRuntime(t, testRootDir(t))
	spec := testSpec(t, newID(t))
	if err := rt.claimRecord(record{ID: spec.ID, StateDir: spec.StateDir}); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(spec.StateDir, runDir), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := writeBundle(spec.StateDir, bundleSpec(spec, bundleOptions{})); err != nil {
		t.Fatal(err)
	}
	list, err := rt.List(ctx)
	if err != nil || !slices.Equal(list, []runtime.Instance{{ID: spec.ID, Status: runtime.StatusStopped}}) {
		t.Errorf("List = %v, %v", list, err)
	}
	if st, err := rt.Status(ctx, spec.ID); err != nil || st != runtime.StatusStopped {
		t.Errorf("Status = %v, %v", st, err)
	}
	if err := rt.Destroy(ctx, spec.ID); err != nil {
		t.Fatal(err)
	}
	assertNothingLeft(t, rt, spec)
}

// Environment of the helper process of TestSurvivesCreator.
const (
	helperSpecEnv = "GVISOR_TEST_HELPER_SPEC"
	helperRootEnv = "GVISOR_TEST_HELPER_ROOT"
)

// TestHelperCreate is not a test on its own: TestSurvivesCreator runs it in a child
// process that creates a sandbox and exits.
func TestHelperCreate(t *testing.T) {
	raw := os.Getenv(helperSpecEnv)
	if raw == "" {
		t.Skip("helper process of TestSurvivesCreator")
	}
	var spec runtime.Spec
	if err := json.Unmarshal([]byte(raw), &spec); err != nil {
		t.Fatal(err)
	}
	rt := newTestRuntime(t, os.Getenv(helperRootEnv))
	if err := rt.Create(context.Background(), spec); err != nil {
		t.Fatal(err)
	}
}

// TestSurvivesCreator: a sandbox outlives the process that created it (a node restart),
// runs in a session of its own, and a new Runtime adopts it and reaches its agent.
func TestSurvivesCreator(t *testing.T) {
	needRunsc(t)
	ctx := context.Background()
	rootDir := testRootDir(t)
	spec := testSpec(t, newID(t))
	raw, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	rt := newTestRuntime(t, rootDir)
	destroyAtEnd(t, rt, spec)
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperCreate$", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), helperSpecEnv+"="+string(raw), helperRootEnv+"="+rootDir)
	// Output returns only once every holder of the pipes is gone: a sandbox that kept
	// the creator's stdio would hang here.
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("creator process: %v\n%s", err, out)
	}

	if err := rt.Adopt(ctx, spec); err != nil {
		t.Fatal(err)
	}
	waitHealthy(t, agentClient(t, rt, spec.ID))
	st, err := rt.state(ctx, spec.ID)
	if err != nil {
		t.Fatal(err)
	}
	sid, err := unix.Getsid(st.PID)
	if err != nil {
		t.Fatal(err)
	}
	if own, _ := unix.Getsid(0); sid == own {
		t.Errorf("sandbox %d is in our session %d", st.PID, sid)
	}

	if err := rt.Destroy(ctx, spec.ID); err != nil {
		t.Fatal(err)
	}
	assertNothingLeft(t, rt, spec)
}

func TestNewWithoutRunsc(t *testing.T) {
	_, err := New(Config{RunscPath: filepath.Join(t.TempDir(), "runsc"), RootDir: t.TempDir()})
	if err == nil || !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("New with a missing runsc: %v", err)
	}
	notRunsc := filepath.Join(t.TempDir(), "runsc")
	if err := os.WriteFile(notRunsc, []byte("#!/bin/sh\nexit 3\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := New(Config{RunscPath: notRunsc, RootDir: t.TempDir()}); err == nil || !strings.Contains(err.Error(), "does not run") {
		t.Errorf("New with a runsc that fails: %v", err)
	}
	// The release is probed for what it can do; a broken probe is an error.
	if err := os.WriteFile(notRunsc, []byte("#!/bin/sh\n[ \"$1\" = --version ] && echo 'runsc version x' && exit 0\nexit 3\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := New(Config{RunscPath: notRunsc, RootDir: t.TempDir()}); err == nil || !strings.Contains(err.Error(), "flags") {
		t.Errorf("New with a runsc that fails: %v", err)
	}
}

func TestParseVersion(t *testing.T) {
	for out, want := range map[string]string{
		"runsc version v0.0.0-20260905035102-160fafc42237\nspec: 1.2.1\n": "v0.0.0-20260905035102-160fafc42237",
		"runsc version 0.0~20221219.0\nspec: 1.0.2-dev\n":                 "0.0~20221219.0",
		"": "",
	} {
		if got := parseVersion(out); got != want {
			t.Errorf("parseVersion(%q) = %q, want %q", out, got, want)
		}
	}
}

// pidsCgroupDir is the host cgroup directory holding the instance's pids controller.
func pidsCgroupDir(id string) string {
	if _, err := os.Stat("/sys/fs/cgroup/cgroup.controllers"); err == nil { // v2
		return filepath.Join("/sys/fs/cgroup", DefaultCgroupParent, id)
	}
	return filepath.Join("/sys/fs/cgroup/pids", DefaultCgroupParent, id)
}

func readInt(t *testing.T, path string) int {
	t.Helper()
	n, err := strconv.Atoi(readTrim(t, path))
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func post(t *testing.T, c *http.Client, path string) []byte {
	t.Helper()
	resp, err := c.Post("http://agent"+path, "text/plain", nil)
	if err != nil {
		t.Fatalf("POST %s: %v", path, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode/100 != 2 {
		t.Fatalf("POST %s: %d %v %s", path, resp.StatusCode, err, body)
	}
	return body
}

// TestForkBombContained: a fork bomb inside a sandbox runs into the sandbox's pids limit
// (gVisor's cgroup: forks fail with EAGAIN), never into the host cgroup's (which would
// kill the Sentry), the host's task count for the sandbox's cgroup stays below its
// limit, and the sandbox keeps answering during and after the bomb. The test agent runs
// the bomb the way the agent should run user processes: in a child cgroup with a
// tighter limit, so that the agent itself can still start threads.
func TestForkBombContained(t *testing.T) {
	needRunsc(t)
	ctx := context.Background()
	rt := newTestRuntime(t, testRootDir(t))
	if !rt.guestPids {
		t.Skipf("runsc %s holds no pids limit inside the sandbox", rt.version)
	}
	spec := testSpec(t, newID(t))
	spec.PidsLimit = hostPidsFactor*256 + hostPidsSlack // 256 tasks inside
	if err := rt.Create(ctx, spec); err != nil {
		t.Fatal(err)
	}
	destroyAtEnd(t, rt, spec)
	c := agentClient(t, rt, spec.ID)
	waitHealthy(t, c)
	hostCg := pidsCgroupDir(spec.ID)
	hostLimit := spec.PidsLimit
	if got := readInt(t, filepath.Join(hostCg, "pids.max")); got != hostLimit {
		t.Fatalf("host pids.max = %d, want %d", got, hostLimit)
	}
	cg := path.Join(cgroupMountDir, spec.ID) // the sandbox's cgroup, seen from inside
	if got := strings.TrimSpace(string(get(t, c, "/read?path="+cg+"/pids.max"))); got != "256" {
		t.Fatalf("pids.max inside the sandbox = %s, want 256", got)
	}
	write := func(p, data string) {
		t.Helper()
		resp, err := c.Post("http://agent/write?path="+p, "text/plain", strings.NewReader(data))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusNoContent {
			t.Fatalf("write %s: %s", p, resp.Status)
		}
	}
	post(t, c, "/mkdir?path="+cg+"/agent")
	post(t, c, "/mkdir?path="+cg+"/user")
	write(cg+"/agent/cgroup.procs", "1")
	write(cg+"/cgroup.subtree_control", "+pids")
	write(cg+"/user/pids.max", "200")
	t.Logf("tasks before the bomb: %s inside, %d on the host (limit %d)",
		strings.TrimSpace(string(get(t, c, "/read?path="+cg+"/pids.current"))), readInt(t, filepath.Join(hostCg, "pids.current")), hostLimit)

	post(t, c, "/forkbomb?cgroup="+cg+"/user")
	stopped := false
	defer func() {
		if !stopped {
			post(t, c, "/forkbomb/stop")
		}
	}()
	// The bomb is contained once its cgroup refused a fork.
	deadline := time.Now().Add(60 * time.Second)
	peak := 0
	for {
		cur := readInt(t, filepath.Join(hostCg, "pids.current"))
		peak = max(peak, cur)
		events := string(get(t, c, "/read?path="+cg+"/user/pids.events"))
		if refused := eventCount(t, events, "max"); refused > 0 {
			t.Logf("forks refused inside: %d; host tasks %d (peak %d)", refused, cur, peak)
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the bomb never reached the limit: host tasks %d (peak %d), %s", cur, peak, events)
		}
		time.Sleep(20 * time.Millisecond) // poll interval
	}
	// Keep the bomb pushing against the limit for a while; the agent keeps answering.
	for end := time.Now().Add(2 * time.Second); time.Now().Before(end); {
		peak = max(peak, readInt(t, filepath.Join(hostCg, "pids.current")))
		get(t, c, "/v1/health")
		time.Sleep(20 * time.Millisecond) // poll interval
	}
	var n int
	if err := json.Unmarshal(get(t, c, "/procs"), &n); err != nil {
		t.Fatal(err)
	}
	inside, err := strconv.Atoi(strings.TrimSpace(string(get(t, c, "/read?path="+cg+"/pids.current"))))
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("during the bomb: %d processes, %d tasks inside; host tasks peak %d", n, inside, peak)
	if inside > 256 {
		t.Errorf("%d tasks inside, above the limit 256", inside)
	}
	if refused := eventCount(t, readTrim(t, filepath.Join(hostCg, "pids.events")), "max"); refused > 0 || peak >= hostLimit {
		t.Errorf("the host limit was hit: %d forks refused, peak %d of %d", refused, peak, hostLimit)
	}

	var rounds int
	if err := json.Unmarshal(post(t, c, "/forkbomb/stop"), &rounds); err != nil {
		t.Fatal(err)
	}
	stopped = true
	t.Logf("bomb killed in %d rounds", rounds)
	waitHealthy(t, c)
	if st, err := rt.Status(ctx, spec.ID); err != nil || st != runtime.StatusRunning {
		t.Fatalf("Status after the bomb = %v, %v", st, err)
	}
	if got := strings.TrimSpace(string(get(t, c, "/read?path="+cg+"/user/pids.current"))); got != "0" {
		t.Errorf("tasks left in the bomb's cgroup: %s", got)
	}
	t.Logf("host tasks after the bomb: %d (systrap keeps stub processes for reuse)", readInt(t, filepath.Join(hostCg, "pids.current")))
}

// eventCount reads the count of one event ("max N") from a pids.events file.
func eventCount(t *testing.T, events, name string) int {
	t.Helper()
	for _, line := range strings.Split(strings.TrimSpace(events), "\n") {
		if v, ok := strings.CutPrefix(line, name+" "); ok {
			n, err := strconv.Atoi(v)
			if err != nil {
				t.Fatal(err)
			}
			return n
		}
	}
	return 0
}

// TestStartNotesRunning: an instance Create or Restore has just started, or Pause or
// Resume has just moved, is in the status cache as runsc itself reports it (its status,
// the same sandbox process), so the node's observation right after costs no runsc
// state.
func TestStartNotesRunning(t *testing.T) {
	needRunsc(t)
	ctx := context.Background()
	rt := newTestRuntime(t, testRootDir(t))
	spec := testSpec(t, newID(t))
	noted := func(what string) int {
		t.Helper()
		st, cached, _ := rt.statuses.get(spec.ID)
		runsc, err := rt.state(ctx, spec.ID)
		if err != nil {
			t.Fatal(err)
		}
		if !cached || st.Status != runsc.Status || st.PID != runsc.PID || st.Bundle != runsc.Bundle {
			t.Fatalf("after %s: cached %v %+v, runsc says %+v", what, cached, st, runsc)
		}
		return st.PID
	}
	c := startSandbox(t, rt, spec)
	created := noted("Create")
	waitHealthy(t, c)
	// Pause and Resume keep it, with the new status and the same sandbox process.
	if err := rt.Pause(ctx, spec.ID); err != nil {
		t.Fatal(err)
	}
	if pid := noted("Pause"); pid != created {
		t.Fatalf("paused sandbox process %d, was %d", pid, created)
	}
	if err := rt.Resume(ctx, spec.ID); err != nil {
		t.Fatal(err)
	}
	if pid := noted("Resume"); pid != created {
		t.Fatalf("resumed sandbox process %d, was %d", pid, created)
	}
	// Resuming a running sandbox does nothing (warm-pool members wait running,
	// runtime.Caps.ParkRunning): known running from the cache, or, in a runtime that
	// knows nothing of it yet (a restarted node), from runsc.
	if err := rt.Resume(ctx, spec.ID); err != nil {
		t.Fatalf("Resume of a running sandbox: %v", err)
	}
	fresh := newTestRuntime(t, rt.cfg.RootDir)
	if err := fresh.Resume(ctx, spec.ID); err != nil {
		t.Fatalf("Resume of a running sandbox, status not cached: %v", err)
	}
	if pid := noted("Resume of a running sandbox"); pid != created {
		t.Fatalf("sandbox process %d, was %d", pid, created)
	}
	waitHealthy(t, c)
	quiesce(t, c, spec)
	dir := suspendInstance(t, rt, spec.ID)
	if err := rt.Restore(ctx, spec, dir); err != nil {
		t.Fatal(err)
	}
	if restored := noted("Restore"); restored == created {
		t.Fatalf("the restored instance has the created one's sandbox process %d", created)
	}
	if st, err := rt.Status(ctx, spec.ID); err != nil || st != runtime.StatusRunning {
		t.Fatalf("Status after Restore = %v, %v", st, err)
	}
}

// TestUnrecordedShareList: lookups of new ids that overlap (a batch of clones) share one
// runsc list; each id is then known absent.
func TestUnrecordedShareList(t *testing.T) {
	needRunsc(t)
	// A runsc that takes its time over list, so that every lookup below starts while
	// the first list runs.
	root := testRootDir(t)
	rt, calls := newCountingRuntime(t, root, "sleep 0.5")
	const n = 8
	errs := make(chan error, n)
	ids := make([]string, n)
	for i := range ids {
		ids[i] = newID(t)
	}
	// An id that no entry of runsc's root dir names costs no runsc list at all.
	if _, err := rt.Status(context.Background(), ids[0]); !errors.Is(err, runtime.ErrNotFound) || !rt.statuses.isGone(ids[0]) {
		t.Fatalf("Status of a new id: %v (known absent: %v)", err, rt.statuses.isGone(ids[0]))
	}
	if lists := calls("list"); lists != 0 {
		t.Fatalf("a new id no root dir entry names ran %d runsc list", lists)
	}
	rt.statuses.change(ids[:1])()
	// Ids that some entry names (files runsc's list ignores) are looked up in runsc's list.
	for _, id := range ids {
		if err := os.WriteFile(filepath.Join(root, id+".note"), nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	for _, id := range ids {
		go func() {
			_, err := rt.Status(context.Background(), id)
			errs <- err
		}()
	}
	for range n {
		if err := <-errs; !errors.Is(err, runtime.ErrNotFound) {
			t.Fatalf("Status of a new id: %v", err)
		}
	}
	for _, id := range ids {
		if !rt.statuses.isGone(id) {
			t.Errorf("%s is not known absent", id)
		}
	}
	if lists := calls("list"); lists == 0 || lists >= n {
		t.Fatalf("%d lookups ran %d runsc list", n, lists)
	} else {
		t.Logf("%d lookups ran %d runsc list", n, lists)
	}
}

// TestDestroyAfterCleanStart: Destroy of an instance whose start this runtime saw end
// skips the second look in runsc list; a runtime that did not start it (a node
// restarted) still looks.
func TestDestroyAfterCleanStart(t *testing.T) {
	needRunsc(t)
	ctx := context.Background()
	root := testRootDir(t)
	rt, calls := newCountingRuntime(t, root, "")
	for _, adopted := range []bool{false, true} {
		spec := testSpec(t, newID(t))
		c := startSandbox(t, rt, spec)
		waitHealthy(t, c)
		dr := rt
		if adopted {
			rt.links.close(spec.ID) // a node restarted: the old process's link is gone
			dr, calls = newCountingRuntime(t, root, "")
			if err := dr.Adopt(ctx, spec); err != nil {
				t.Fatal(err)
			}
		}
		before := calls("list")
		if err := dr.Destroy(ctx, spec.ID); err != nil {
			t.Fatal(err)
		}
		if lists := calls("list") - before; (lists == 0) != !adopted {
			t.Errorf("adopted %v: Destroy ran %d runsc list", adopted, lists)
		}
		if all, err := dr.list(ctx); err != nil || slices.ContainsFunc(all, func(c containerState) bool { return c.ID == spec.ID }) {
			t.Errorf("runsc still lists %s after Destroy: %v %v", spec.ID, all, err)
		}
	}
}

// newCountingRuntime is a runtime whose runsc notes every invocation's arguments (and
// runs onList, a shell command, before a list); calls counts the invocations naming a
// subcommand so far.
func newCountingRuntime(t *testing.T, root, onList string) (*Runtime, func(sub string) int) {
	t.Helper()
	dir := t.TempDir()
	log := filepath.Join(dir, "calls")
	wrapper := filepath.Join(dir, "runsc")
	script := fmt.Sprintf("#!/bin/sh\necho \"$*\" >> %s\ncase \" $* \" in *\" list \"*) %s;; esac\nexec %s \"$@\"\n", log, cmp.Or(onList, ":"), testRunsc)
	if err := os.WriteFile(wrapper, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	rt := newRuntimeWith(t, root, wrapper)
	calls := func(sub string) int {
		b, err := os.ReadFile(log)
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			t.Fatal(err)
		}
		n := 0
		for _, line := range strings.Split(string(b), "\n") {
			if slices.Contains(strings.Fields(line), sub) {
				n++
			}
		}
		return n
	}
	return rt, calls
}
