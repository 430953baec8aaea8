package gvisor

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/cgroupstat"
	"github.com/spacedev/space/internal/guest/wire"
	"github.com/spacedev/space/internal/runtime"
)

// needUserNS skips tests of the user namespace when the tests run without it (the
// fallback runsc).
func needUserNS(t *testing.T) {
	t.Helper()
	if testNoUserNS {
		t.Skip("SPACE_TEST_RUNSC_NO_USERNS is set")
	}
}

// startSandbox creates a sandbox from spec with rt, waits for its agent and registers
// its destruction.
func startSandbox(t *testing.T, rt *Runtime, spec runtime.Spec) *http.Client {
	t.Helper()
	if err := rt.Create(context.Background(), spec); err != nil {
		t.Fatal(err)
	}
	destroyAtEnd(t, rt, spec)
	c := agentClient(t, rt, spec.ID)
	waitHealthy(t, c)
	return c
}

// destroyAtEnd destroys spec's instance when the test ends, showing its log first if
// the test failed.
func destroyAtEnd(t *testing.T, rt *Runtime, spec runtime.Spec) {
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("sandbox log:\n%s", runtime.LogTail(logPath(spec.StateDir), 16<<10))
		}
		if err := rt.Destroy(context.Background(), spec.ID); err != nil {
			t.Error(err)
		}
	})
}

// hostUIDs reports the real uid of each host process runsc runs for the instance.
func hostUIDs(t *testing.T, rt *Runtime, spec runtime.Spec) map[int]uint32 {
	t.Helper()
	pids, err := rt.hostProcs(spec.ID, spec.StateDir)
	if err != nil {
		t.Fatal(err)
	}
	if len(pids) < 2 {
		t.Fatalf("host processes %v: want at least the sandbox and the gofer", pids)
	}
	uids := map[int]uint32{}
	for _, pid := range pids {
		var st unix.Stat_t
		if err := unix.Stat(fmt.Sprintf("/proc/%d", pid), &st); err != nil {
			continue // gone meanwhile
		}
		uids[pid] = st.Uid
	}
	return uids
}

// TestUserNamespace: the Sentry, the gofer and the platform's stub processes run as the
// unprivileged host uid UIDBase (sandbox root), not as root; sandbox root sees itself as
// uid 0 and its files as its own; files it writes keep ordinary ownership on disk (the
// rootfs is an id-mapped view); the views are nosuid and nodev.
func TestUserNamespace(t *testing.T) {
	needRunsc(t)
	needUserNS(t)
	rt := newTestRuntime(t, testRootDir(t))
	spec := testSpec(t, newID(t))
	if err := os.WriteFile(filepath.Join(spec.RootFS, "template-file"), []byte("t"), 0o600); err != nil {
		t.Fatal(err)
	}
	c := startSandbox(t, rt, spec)

	for pid, uid := range hostUIDs(t, rt, spec) {
		if uid != DefaultUIDBase {
			t.Errorf("host process %d runs as uid %d, want %d", pid, uid, DefaultUIDBase)
		}
	}
	status := string(get(t, c, "/status"))
	if !strings.Contains(strings.Join(strings.Fields(status), " "), "Uid: 0 0 0 0") {
		t.Errorf("sandbox root is not uid 0 inside:\n%s", status)
	}
	// A root-only file of the template is sandbox root's.
	if got := string(get(t, c, "/read?path=/template-file")); got != "t" {
		t.Errorf("template file = %q", got)
	}
	resp, err := c.Post("http://agent/write?path=/written", "text/plain", strings.NewReader("w"))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusNoContent {
		t.Fatalf("write: %s", resp.Status)
	}
	var st unix.Stat_t
	if err := unix.Stat(filepath.Join(spec.RootFS, "written"), &st); err != nil {
		t.Fatal(err)
	}
	if st.Uid != 0 || st.Gid != 0 {
		t.Errorf("file written by sandbox root is %d:%d on disk, want 0:0", st.Uid, st.Gid)
	}
	if err := unix.Stat(filepath.Join(rt.mountDir(spec.ID), rootfsMount, "written"), &st); err != nil {
		t.Fatal(err)
	}
	if st.Uid != DefaultUIDBase {
		t.Errorf("file written by sandbox root is uid %d in the view, want %d", st.Uid, DefaultUIDBase)
	}
	for _, v := range []string{rootfsMount, runDir} {
		var fs unix.Statfs_t
		if err := unix.Statfs(filepath.Join(rt.mountDir(spec.ID), v), &fs); err != nil {
			t.Fatal(err)
		}
		if fs.Flags&unix.ST_NOSUID == 0 || fs.Flags&unix.ST_NODEV == 0 {
			t.Errorf("view %s is not nosuid,nodev: flags %#x", v, fs.Flags)
		}
	}
	info, err := rt.Info(context.Background())
	if err != nil || info.Details["userns"] != fmt.Sprintf("%d:%d", DefaultUIDBase, UserNSSize) {
		t.Errorf("Info = %+v, %v", info, err)
	}
}

// TestNoUserNS: with the user namespace off, sandboxes still work (their processes run
// as host root, in runsc's one-to-one namespace).
func TestNoUserNS(t *testing.T) {
	needRunsc(t)
	rootDir := filepath.Join(t.TempDir(), "runsc")
	rt, err := New(Config{RunscPath: testRunsc, Platform: testPlatform, RootDir: rootDir, NoUserNS: true, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		rt.Close()
		unmountNullNetNS(t, rootDir)
	})
	spec := testSpec(t, newID(t))
	startSandbox(t, rt, spec)
	for pid, uid := range hostUIDs(t, rt, spec) {
		if uid >= DefaultUIDBase && uid < DefaultUIDBase+UserNSSize {
			t.Errorf("host process %d runs as uid %d, in the user namespace's range", pid, uid)
		}
	}
	if info, _ := rt.Info(context.Background()); info.Details["userns"] != "off" {
		t.Errorf("Info details %v", info.Details)
	}
	if err := rt.Destroy(context.Background(), spec.ID); err != nil {
		t.Fatal(err)
	}
	assertNothingLeft(t, rt, spec)
}

// TestRootDirNotSearchable: New refuses a root dir the sandboxes' uid cannot reach.
func TestRootDirNotSearchable(t *testing.T) {
	needRunsc(t)
	needUserNS(t)
	_, err := New(Config{RunscPath: testRunsc, RootDir: filepath.Join(t.TempDir(), "runsc")})
	if err == nil || !strings.Contains(err.Error(), "not searchable") {
		t.Errorf("New under a 0700 directory: %v", err)
	}
}

// TestRunDirBounded: the agent's run directory is a small tmpfs (nosuid, nodev,
// noexec) of the runtime: sandbox code cannot fill the host's disk through it.
func TestRunDirBounded(t *testing.T) {
	needRunsc(t)
	rt := newTestRuntime(t, testRootDir(t))
	spec := testSpec(t, newID(t))
	c := startSandbox(t, rt, spec)

	run := filepath.Join(spec.StateDir, runDir)
	var fs unix.Statfs_t
	if err := unix.Statfs(run, &fs); err != nil {
		t.Fatal(err)
	}
	if fs.Type != unix.TMPFS_MAGIC || fs.Blocks*uint64(fs.Bsize) > runTmpfsSize {
		t.Errorf("run dir: type %#x, %d bytes; want a tmpfs of at most %d", fs.Type, fs.Blocks*uint64(fs.Bsize), runTmpfsSize)
	}
	if fs.Flags&(unix.ST_NOSUID|unix.ST_NODEV|unix.ST_NOEXEC) != unix.ST_NOSUID|unix.ST_NODEV|unix.ST_NOEXEC {
		t.Errorf("run dir flags %#x, want nosuid,nodev,noexec", fs.Flags)
	}
	resp, err := c.Post("http://agent/write?path=/run/space/big", "text/plain", bytes.NewReader(make([]byte, 2*runTmpfsSize)))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode == http.StatusNoContent {
		t.Error("writing twice the run dir's size succeeded")
	}
	if fi, err := os.Stat(filepath.Join(run, "big")); err == nil && fi.Size() > runTmpfsSize {
		t.Errorf("big is %d bytes on the host", fi.Size())
	}
	// The agent still listens: a full run dir does not break the socket.
	get(t, c, "/v1/health")
}

// TestLogCapped: whatever the sandbox writes to its stdio lands in a log on a capped
// tmpfs, rotated in the background, and log files are 0600.
func TestLogCapped(t *testing.T) {
	needRunsc(t)
	rt := newTestRuntime(t, testRootDir(t))
	spec := testSpec(t, newID(t))
	c := startSandbox(t, rt, spec)
	dir := filepath.Join(spec.StateDir, logDir)

	// Much more than the tmpfs holds, in chunks the rotation can follow.
	total := 0
	for range 12 {
		var n int
		if err := json.Unmarshal(post(t, c, "/stderr?n="+strconv.Itoa(1<<20)), &n); err != nil {
			t.Fatal(err)
		}
		total += n
		var fs unix.Statfs_t
		if err := unix.Statfs(dir, &fs); err != nil {
			t.Fatal(err)
		}
		if used := (fs.Blocks - fs.Bfree) * uint64(fs.Bsize); used > logTmpfsSize {
			t.Fatalf("log tmpfs holds %d bytes", used)
		}
	}
	t.Logf("the agent wrote %d bytes", total)
	// The rotation catches up.
	deadline := time.Now().Add(3 * logRotateEvery)
	for {
		fi, err := os.Stat(logPath(spec.StateDir))
		if err != nil {
			t.Fatal(err)
		}
		// Rotated: the log truncated and its tail written to runsc.log.1 (after the
		// truncation: a poll between the two sees only the first).
		_, oldErr := os.Stat(filepath.Join(dir, logFileOld))
		if fi.Size() <= logRotateSize && oldErr == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("log not rotated: %d bytes (%s: %v)", fi.Size(), logFileOld, oldErr)
		}
		time.Sleep(50 * time.Millisecond) // poll interval
	}
	for _, name := range []string{logFile, logFileOld} {
		fi, err := os.Stat(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != 0o600 {
			t.Errorf("%s mode %v, want 0600", name, fi.Mode().Perm())
		}
	}
	if fi, _ := os.Stat(filepath.Join(dir, logFileOld)); fi.Size() > logKeepSize {
		t.Errorf("%s is %d bytes, want at most %d", logFileOld, fi.Size(), logKeepSize)
	}
	get(t, c, "/v1/health")
	// New output still arrives after a rotation, at the start of the truncated file
	// (the sandbox appends; a writer at its own offset would leave a hole).
	before, err := os.Stat(logPath(spec.StateDir))
	if err != nil {
		t.Fatal(err)
	}
	post(t, c, "/stderr?n=100")
	after, err := os.Stat(logPath(spec.StateDir))
	if err != nil {
		t.Fatal(err)
	}
	if after.Size() != before.Size()+100 {
		t.Errorf("log grew from %d to %d bytes for 100 bytes of output", before.Size(), after.Size())
	}
}

func TestRotateLog(t *testing.T) {
	dir := t.TempDir()
	cur := filepath.Join(dir, logFile)
	data := bytes.Repeat([]byte("0123456789"), 100)
	if err := os.WriteFile(cur, data, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := rotateLog(dir, 2000, 300); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, logFileOld)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("rotated below the limit: %v", err)
	}
	if err := rotateLog(dir, 500, 300); err != nil {
		t.Fatal(err)
	}
	if got, _ := os.ReadFile(filepath.Join(dir, logFileOld)); !bytes.Equal(got, data[len(data)-300:]) {
		t.Errorf("old log = %q", got)
	}
	if fi, _ := os.Stat(cur); fi.Size() != 0 {
		t.Errorf("current log is %d bytes after rotation", fi.Size())
	}
	if err := rotateLog(filepath.Join(dir, "missing"), 1, 1); err != nil {
		t.Errorf("rotate without a log: %v", err)
	}
}

// quiesce asks the test agent to close its socket and waits until it has.
func quiesce(t *testing.T, c *http.Client, spec runtime.Spec) {
	t.Helper()
	// The agent closes its connection once it has answered: the answer and the close
	// race (agentclient.QuiesceClosing), so the marker is what tells.
	resp, err := c.Post("http://agent/quiesce", "application/json", nil)
	if err == nil {
		resp.Body.Close()
		if resp.StatusCode != http.StatusNoContent {
			t.Fatalf("POST /quiesce: %s", resp.Status)
		}
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := os.Stat(filepath.Join(spec.StateDir, runDir, "quiesced")); err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("agent did not quiesce")
		}
		time.Sleep(5 * time.Millisecond) // poll interval
	}
}

// TestCheckpointRestore: a checkpoint restores as another instance (a clone) with its
// own pids limit on the container cgroup it inherited, its own host mounts and user
// namespace, and Destroy leaves nothing of either.
func TestCheckpointRestore(t *testing.T) {
	needRunsc(t)
	ctx := context.Background()
	rt := newTestRuntime(t, testRootDir(t))
	src := testSpec(t, newID(t))
	src.PidsLimit = hostPidsFactor*100 + hostPidsSlack
	c := startSandbox(t, rt, src)
	quiesce(t, c, src)
	dir := t.TempDir()
	// Seen running first, as the node sees a sandbox before each step: the checkpoint
	// then watches the sandbox process exit in /proc.
	if st, err := rt.Status(ctx, src.ID); err != nil || st != runtime.StatusRunning {
		t.Fatalf("Status before Checkpoint = %v, %v", st, err)
	}
	start := time.Now()
	if err := rt.Checkpoint(ctx, src.ID, dir); err != nil {
		t.Fatal(err)
	}
	t.Logf("checkpoint: %v", time.Since(start))
	if !rt.statuses.isStopped(src.ID) {
		t.Error("the checkpointed instance is not known stopped")
	}
	if st, err := rt.Status(ctx, src.ID); err != nil || st != runtime.StatusStopped {
		t.Errorf("Status after Checkpoint = %v, %v", st, err)
	}
	if err := rt.Destroy(ctx, src.ID); err != nil {
		t.Fatal(err)
	}
	assertNothingLeft(t, rt, src)

	dst := testSpec(t, newID(t))
	dst.RootFS = src.RootFS
	dst.PidsLimit = hostPidsFactor*150 + hostPidsSlack
	start = time.Now()
	if err := rt.Restore(ctx, dst, dir); err != nil {
		t.Fatal(err)
	}
	t.Logf("restore: %v", time.Since(start))
	t.Cleanup(func() {
		if err := rt.Destroy(context.Background(), dst.ID); err != nil {
			t.Error(err)
		}
	})
	if err := os.WriteFile(filepath.Join(dst.StateDir, runDir, "resume"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	dc := agentClient(t, rt, dst.ID)
	waitHealthy(t, dc)
	// The container's cgroup inside the Sentry keeps the original's name.
	if !rt.guestPids {
		t.Log("this runsc holds no pids limit inside the sandbox")
	} else if got := strings.TrimSpace(string(get(t, dc, "/read?path=/sys/fs/cgroup/"+src.ID+"/pids.max"))); got != "150" {
		t.Errorf("pids.max inside the restored sandbox = %s, want 150", got)
	}
	if got := readInt(t, filepath.Join(pidsCgroupDir(dst.ID), "pids.max")); got != dst.PidsLimit {
		t.Errorf("host pids.max = %d, want %d", got, dst.PidsLimit)
	}
	for pid, uid := range hostUIDs(t, rt, dst) {
		if uid != DefaultUIDBase && !testNoUserNS {
			t.Errorf("host process %d runs as uid %d", pid, uid)
		}
	}
	var fs unix.Statfs_t
	if err := unix.Statfs(filepath.Join(dst.StateDir, runDir), &fs); err != nil || fs.Type != unix.TMPFS_MAGIC {
		t.Errorf("run dir after restore: %#x %v", fs.Type, err)
	}
	if err := rt.Destroy(ctx, dst.ID); err != nil {
		t.Fatal(err)
	}
	assertNothingLeft(t, rt, dst)
}

// TestWakeKeepsPidsLimit: a restore with the limit its checkpoint was taken with (a
// wake) skips setting it again, and the limit inside the sandbox is still the one set.
func TestWakeKeepsPidsLimit(t *testing.T) {
	needRunsc(t)
	ctx := context.Background()
	rt := newTestRuntime(t, testRootDir(t))
	if !rt.guestPids {
		t.Skip("this runsc holds no pids limit inside the sandbox")
	}
	spec := testSpec(t, newID(t))
	spec.PidsLimit = hostPidsFactor*120 + hostPidsSlack
	c := startSandbox(t, rt, spec)
	quiesce(t, c, spec)
	dir := t.TempDir()
	if err := rt.Checkpoint(ctx, spec.ID, dir); err != nil {
		t.Fatal(err)
	}
	if meta, err := readMeta(dir); err != nil || meta.PidsMax != 120 {
		t.Fatalf("checkpoint metadata: %+v %v, want pids_max 120", meta, err)
	}
	if err := rt.Destroy(ctx, spec.ID); err != nil {
		t.Fatal(err)
	}
	dc := restoreResumed(t, rt, spec, dir)
	if got := strings.TrimSpace(string(get(t, dc, "/read?path=/sys/fs/cgroup/"+spec.ID+"/pids.max"))); got != "120" {
		t.Errorf("pids.max inside the woken sandbox = %s, want 120", got)
	}
	if rec, err := rt.readRecord(spec.ID); err != nil || rec.PidsMax != 120 {
		t.Errorf("record after the wake: %+v %v", rec, err)
	}
}

// TestRestoreWithoutMetadata: a directory that is not a checkpoint of this runtime is
// refused before anything is made.
func TestRestoreWithoutMetadata(t *testing.T) {
	needRunsc(t)
	rt := newTestRuntime(t, testRootDir(t))
	spec := testSpec(t, newID(t))
	err := rt.Restore(context.Background(), spec, t.TempDir())
	if err == nil || !errors.Is(err, syscall.ENOENT) {
		t.Errorf("Restore from an empty dir: %v", err)
	}
	assertNothingLeft(t, rt, spec)
}

// TestCheckpointPaused: a paused sandbox checkpoints without stopping (runsc checkpoint
// -leave-running): it is still paused afterwards, runs again at Resume and serves once
// it is told to resume; the checkpoint restores as a clone, also with the metadata of a
// checkpoint written before its settings were recorded (a sandbox suspended before an
// upgrade). A running sandbox is refused.
func TestCheckpointPaused(t *testing.T) {
	needRunsc(t)
	ctx := context.Background()
	rt := newTestRuntime(t, testRootDir(t))
	src := testSpec(t, newID(t))
	c := startSandbox(t, rt, src)
	if err := rt.CheckpointPaused(ctx, src.ID, t.TempDir()); err == nil || !strings.Contains(err.Error(), "not paused") {
		t.Errorf("CheckpointPaused of a running sandbox: %v", err)
	}
	quiesce(t, c, src)
	if err := rt.Pause(ctx, src.ID); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	start := time.Now()
	if err := rt.CheckpointPaused(ctx, src.ID, dir); err != nil {
		t.Fatal(err)
	}
	t.Logf("checkpoint of a paused sandbox: %v", time.Since(start))
	// The status cache kept it (paused, the same sandbox process), as runsc says.
	if st, cached, _ := rt.statuses.get(src.ID); !cached {
		t.Error("the paused instance is not cached after CheckpointPaused")
	} else if runsc, err := rt.state(ctx, src.ID); err != nil || runsc.Status != st.Status || runsc.PID != st.PID {
		t.Errorf("cached %+v, runsc says %+v (%v)", st, runsc, err)
	}
	if st, err := rt.Status(ctx, src.ID); err != nil || st != runtime.StatusPaused {
		t.Fatalf("Status after CheckpointPaused = %v, %v", st, err)
	}
	// A node restarted here takes the paused instance over (and resumes it itself).
	// (Its link replaces the first runtime's, which this test uses again after.)
	rt.links.close(src.ID)
	fresh := newTestRuntime(t, rt.cfg.RootDir)
	if err := fresh.Adopt(ctx, src); err != nil {
		t.Errorf("Adopt of a paused instance: %v", err)
	}
	fresh.links.close(src.ID)
	if err := rt.Adopt(ctx, src); err != nil {
		t.Fatal(err)
	}
	meta, err := readMeta(dir)
	if err != nil || meta.Compression != "none" {
		t.Errorf("checkpoint metadata %+v, %v", meta, err)
	}
	if err := rt.Resume(ctx, src.ID); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(src.StateDir, runDir, "resume"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	waitHealthy(t, c)

	// The metadata of a checkpoint written before the settings were recorded. (Its
	// memory file systems' sizes and its agent's transport stay: runsc restores only a
	// bundle that names the mounts as the checkpointed one did, a checkpoint from before
	// a size was recorded had no such mount, which a missing tmpfs_mb or run_mb repeats,
	// and its agent listened, which a missing agent_dials repeats.)
	old, err := json.Marshal(map[string]any{"cgroup": meta.Cgroup, "tmpfs_mb": meta.TmpfsMB, "run_mb": meta.RunMB, "agent_dials": meta.AgentDials})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, metaFile), old, 0o600); err != nil {
		t.Fatal(err)
	}
	dst := testSpec(t, newID(t))
	dst.RootFS = src.RootFS
	start = time.Now()
	if err := rt.Restore(ctx, dst, dir); err != nil {
		t.Fatal(err)
	}
	t.Logf("restore: %v", time.Since(start))
	t.Cleanup(func() {
		if err := rt.Destroy(context.Background(), dst.ID); err != nil {
			t.Error(err)
		}
	})
	if err := os.WriteFile(filepath.Join(dst.StateDir, runDir, "resume"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	waitHealthy(t, agentClient(t, rt, dst.ID))
	waitHealthy(t, c) // the source runs on beside its clone
}

// TestRestoreCPULimit: a restore runs without the CPU quota (limits.go) and Restore
// returns only once the quota is on the sandbox's host cgroup; Adopt puts back a quota
// that is missing (a node stopped between the restore and the write).
func TestRestoreCPULimit(t *testing.T) {
	needRunsc(t)
	ctx := context.Background()
	rt := newTestRuntime(t, testRootDir(t))
	spec := testSpec(t, newID(t))
	c := startSandbox(t, rt, spec)
	quiesce(t, c, spec)
	dir := suspendInstance(t, rt, spec.ID)
	spec.CPU = 2 // a clone may be of another size: the Spec's count is what counts
	if err := rt.Restore(ctx, spec, dir); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := rt.Destroy(context.Background(), spec.ID); err != nil {
			t.Error(err)
		}
	})
	pid, err := readPidFile(spec.StateDir)
	if err != nil {
		t.Fatal(err)
	}
	file, err := cgroupstat.CPULimitFile(pid, spec.ID)
	if err != nil {
		t.Fatal(err)
	}
	quota := func() string {
		t.Helper()
		b, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		return strings.TrimSpace(string(b))
	}
	want, unlimited := "200000", "-1"
	if filepath.Base(file) == "cpu.max" {
		want, unlimited = "200000 100000", "max 100000"
	}
	if got := quota(); got != want {
		t.Fatalf("%s after Restore = %q, want %q", file, got, want)
	}
	if err := os.WriteFile(file, []byte(strings.Fields(unlimited)[0]), 0); err != nil {
		t.Fatal(err)
	}
	if got := quota(); got != unlimited {
		t.Fatalf("%s = %q after removing the quota, want %q", file, got, unlimited)
	}
	if err := rt.Adopt(ctx, spec); err != nil {
		t.Fatal(err)
	}
	if got := quota(); got != want {
		t.Errorf("%s after Adopt = %q, want %q", file, got, want)
	}
}

// TestHostMemoryLimit: the guest sees its own size (MemTotal) while its host cgroup's
// limit leaves room for what the Sentry spends on its tasks (hostMemoryLimit), after a
// boot and after a restore; Adopt raises a limit a node left at the guest's size (it
// stopped between runsc's return and the write).
func TestHostMemoryLimit(t *testing.T) {
	needRunsc(t)
	ctx := context.Background()
	rt := newTestRuntime(t, testRootDir(t))
	spec := testSpec(t, newID(t))
	want := strconv.FormatInt(hostMemoryLimit(spec), 10)
	if hostMemoryLimit(spec) <= int64(spec.MemoryMB)<<20 {
		t.Fatalf("hostMemoryLimit %d leaves no room beyond the guest's %d MiB", hostMemoryLimit(spec), spec.MemoryMB)
	}
	check := func(when string, c *http.Client) string {
		t.Helper()
		dir, file := rt.memoryLimitFile(spec.ID)
		if file == "" || !sandboxProcessIn(dir) {
			t.Fatalf("%s: the sandbox process is not in the memory cgroup %q", when, dir)
		}
		if got := readTrim(t, file); got != want {
			t.Errorf("%s: %s = %s, want %s", when, file, got, want)
		}
		meminfo := strings.Join(strings.Fields(string(get(t, c, "/meminfo"))), " ")
		if total := fmt.Sprintf("MemTotal: %d kB", spec.MemoryMB*1024); !strings.Contains(meminfo, total) {
			t.Errorf("%s: the guest's meminfo does not say %q: %.200s", when, total, meminfo)
		}
		return file
	}
	c := startSandbox(t, rt, spec)
	check("after a boot", c)
	quiesce(t, c, spec)
	dir := suspendInstance(t, rt, spec.ID)
	c = restoreResumed(t, rt, spec, dir)
	file := check("after a restore", c)
	if err := os.WriteFile(file, []byte(strconv.Itoa(spec.MemoryMB<<20)), 0); err != nil {
		t.Fatal(err)
	}
	if err := rt.Adopt(ctx, spec); err != nil {
		t.Fatal(err)
	}
	check("after Adopt", c)
}

// TestRestoreAboveGuestSize: a sandbox may use more host memory than its guest size
// while it runs (hostMemoryLimit leaves room for the Sentry), and its checkpoint
// restores: the restore loads the guest's memory under the raised limit, not under the
// guest size the bundle carries for the Sentry's MemTotal.
func TestRestoreAboveGuestSize(t *testing.T) {
	needRunsc(t)
	rt := newTestRuntime(t, testRootDir(t))
	spec := testSpec(t, newID(t)) // 256 MiB: host limit 416 MiB
	c := startSandbox(t, rt, spec)
	post(t, c, "/hold?mib=300")
	quiesce(t, c, spec)
	dir := suspendInstance(t, rt, spec.ID)
	c = restoreResumed(t, rt, spec, dir)
	get(t, c, "/v1/health")
}

// TestFailedCheckpointKeepsSandbox: a checkpoint that fails leaves the sandbox running
// as it was (runsc checkpoint -leave-running; the runtime stops the sandbox only once
// the image is written). Here the sandbox is one started as before 2026-12-06, whose
// agent listens (--host-uds=create), and the test agent's listener is the host socket
// gVisor cannot save: before, runsc stopped the sandbox anyway and its memory was lost.
// (It is also the path of the instances from then that a node adopts.)
func TestFailedCheckpointKeepsSandbox(t *testing.T) {
	needRunsc(t)
	rt := newTestRuntime(t, testRootDir(t))
	rt.agentListens = true
	spec := testSpec(t, newID(t))
	c := startSandbox(t, rt, spec)
	err := rt.Checkpoint(context.Background(), spec.ID, t.TempDir())
	if err == nil || !strings.Contains(err.Error(), "bound host socket") {
		t.Fatalf("checkpoint of a sandbox holding a host socket: %v", err)
	}
	if len(err.Error()) > 1024 {
		t.Errorf("the error carries gVisor's dumps (%d bytes)", len(err.Error()))
	}
	if st, err := rt.Status(context.Background(), spec.ID); err != nil || st != runtime.StatusRunning {
		t.Fatalf("after the failed checkpoint: %v %v", st, err)
	}
	get(t, c, "/v1/health")
}

// TestMemoryFilesBounded: /tmp and /dev/shm are bounded to half the
// sandbox's memory each, /run to an eighth, and a checkpoint keeps those bounds: a restore of it with another
// memory size (a clone of another size) is one runsc accepts (its bundle names the
// mounts as the checkpointed one did) and keeps the source's bound.
func TestMemoryFilesBounded(t *testing.T) {
	needRunsc(t)
	rt := newTestRuntime(t, testRootDir(t))
	spec := testSpec(t, newID(t)) // 256 MiB
	c := startSandbox(t, rt, spec)
	checkSizes := func(c *http.Client, when string) {
		t.Helper()
		found := 0
		for _, line := range strings.Split(string(get(t, c, "/mounts")), "\n") {
			f := strings.Fields(line)
			if len(f) < 4 || f[2] != "tmpfs" {
				continue
			}
			want := map[string]string{"/tmp": "size=131072k", "/dev/shm": "size=131072k", "/run": "size=32768k"}[f[1]]
			if want == "" {
				continue
			}
			found++
			if !slices.Contains(strings.Split(f[3], ","), want) {
				t.Errorf("%s: %s is not bounded to %s: %s", when, f[1], want, line)
			}
		}
		if found != 3 {
			t.Errorf("%s: %d of /tmp, /dev/shm and /run found as tmpfs:\n%s", when, found, get(t, c, "/mounts"))
		}
	}
	checkSizes(c, "created")
	quiesce(t, c, spec)
	dir := suspendInstance(t, rt, spec.ID)
	if meta, err := readMeta(dir); err != nil || meta.TmpfsMB != 128 || meta.RunMB != 32 {
		t.Errorf("checkpoint metadata %+v, %v; want tmpfs_mb 128, run_mb 32", meta, err)
	}
	bigger := spec
	bigger.MemoryMB = 512
	c = restoreResumed(t, rt, bigger, dir)
	checkSizes(c, "restored with 512 MiB")
}

// restoreResumed restores spec from the checkpoint in dir (destroyed at the test's
// end), tells its test agent to resume and returns a client once the agent answers.
func restoreResumed(t *testing.T, rt *Runtime, spec runtime.Spec, dir string) *http.Client {
	t.Helper()
	if err := rt.Restore(context.Background(), spec, dir); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := rt.Destroy(context.Background(), spec.ID); err != nil {
			t.Error(err)
		}
	})
	if err := os.WriteFile(filepath.Join(spec.StateDir, runDir, "resume"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	c := agentClient(t, rt, spec.ID)
	waitHealthy(t, c)
	return c
}

// suspendInstance checkpoints a quiesced instance into a new directory, which it
// returns, and destroys the instance, as a suspend does.
func suspendInstance(t *testing.T, rt *Runtime, id string) string {
	t.Helper()
	dir := t.TempDir()
	if err := rt.Checkpoint(context.Background(), id, dir); err != nil {
		t.Fatal(err)
	}
	if err := rt.Destroy(context.Background(), id); err != nil {
		t.Fatal(err)
	}
	return dir
}

// A sandbox's host cgroup goes with it even when two instances of one id shared it, as
// when a sandbox moves between two node processes of one host: it is restored on one
// while the other node's instance, its node killed, still runs, and that node reclaims
// its instance when it comes back. Here two runtimes (two runsc roots) run the same id;
// once both are destroyed, in that order, no hierarchy keeps the cgroup (runsc left it
// in every one).
func TestDestroyRemovesCgroup(t *testing.T) {
	needRunsc(t)
	old := newTestRuntime(t, testRootDir(t))
	if old.ignoresCgroups() || len(old.cgroupRoots()) == 0 {
		t.Skip("no host cgroups for sandboxes")
	}
	id := newID(t)
	oldSpec := testSpec(t, id)
	startSandbox(t, old, oldSpec)
	moved := newTestRuntime(t, testRootDir(t))
	movedSpec := testSpec(t, id)
	startSandbox(t, moved, movedSpec)
	var dirs []string
	for _, root := range old.cgroupRoots() {
		if dir := filepath.Join(root, old.cgroupsPath(id)); fileExists(dir) {
			dirs = append(dirs, dir)
		}
	}
	if len(dirs) == 0 {
		t.Fatal("the sandboxes' cgroup is in no hierarchy")
	}
	t.Cleanup(func() {
		for _, d := range dirs {
			_ = os.Remove(d) // what a failure left
		}
	})
	if err := old.Destroy(context.Background(), id); err != nil {
		t.Fatal(err)
	}
	// The moved instance still runs in the shared cgroup.
	pid, err := readPidFile(movedSpec.StateDir)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cgroupstat.CPULimitFile(pid, id); err != nil {
		t.Fatalf("the moved instance lost its cgroup: %v", err)
	}
	if err := moved.Destroy(context.Background(), id); err != nil {
		t.Fatal(err)
	}
	for _, d := range dirs {
		if fileExists(d) {
			t.Errorf("%s is left after both instances were destroyed", d)
		}
	}
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

// runsc processes that start together each pin the root dir's null network namespace
// (stacked mounts); UnpinNullNetNS takes every one off, so that a test's or a bench's
// own root dir can be removed.
func TestUnpinNullNetNS(t *testing.T) {
	needRunsc(t)
	root := testRootDir(t)
	rt := newTestRuntime(t, root)
	errs := make(chan error, 3)
	for range 3 {
		spec := testSpec(t, newID(t))
		t.Cleanup(func() { _ = rt.Destroy(context.Background(), spec.ID) })
		go func() { errs <- rt.Create(context.Background(), spec) }()
	}
	for range 3 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	mounts := func() int {
		b, err := os.ReadFile("/proc/self/mountinfo")
		if err != nil {
			t.Fatal(err)
		}
		return strings.Count(string(b), " "+filepath.Join(root, "null-netns")+" ")
	}
	t.Logf("%d null-netns mounts after 3 concurrent creates", mounts())
	if err := UnpinNullNetNS(root); err != nil {
		t.Fatal(err)
	}
	if n := mounts(); n != 0 {
		t.Fatalf("%d null-netns mounts left", n)
	}
}

// watchedSandbox starts a 256 MiB sandbox (threshold 368 MiB, host limit 416 MiB) for
// the memory watch's tests, or skips where runsc or host cgroups are missing.
func watchedSandbox(t *testing.T) (*Runtime, runtime.Spec, *http.Client) {
	t.Helper()
	needRunsc(t)
	rt := newTestRuntime(t, testRootDir(t))
	spec := testSpec(t, newID(t))
	if rt.ignoresCgroups() {
		t.Skip("no host cgroups for sandboxes")
	}
	return rt, spec, startSandbox(t, rt, spec)
}

// TestWatchMemory: the watch reports a sandbox whose guest holds memory up to the
// pressure threshold, before the host limit (so the sandbox still runs), and ends with
// the instance.
func TestWatchMemory(t *testing.T) {
	rt, spec, c := watchedSandbox(t)
	type report struct{ usage, limit int64 }
	reports := make(chan report, 16)
	done := make(chan error, 1)
	go func() {
		done <- rt.WatchMemory(context.Background(), spec, func(usage, limit int64) { reports <- report{usage, limit} })
	}()
	threshold := pressureThreshold(spec)
	var got report
	held := 0
	for got.limit == 0 && held < 400 {
		post(t, c, "/hold?mib=16")
		held += 16
		select {
		case got = <-reports:
		case err := <-done:
			t.Fatalf("the watch ended: %v", err)
		default:
		}
	}
	if got.limit == 0 {
		select { // the watch's goroutine may report a moment after the charge
		case got = <-reports:
		case <-time.After(10 * time.Second):
			t.Fatalf("the guest holds %d MiB and no rise was reported (threshold %d MiB)", held, threshold>>20)
		}
	}
	t.Logf("reported at %d MiB of %d MiB with %d MiB held in the guest", got.usage>>20, got.limit>>20, held)
	if got.usage < threshold || got.limit != hostMemoryLimit(spec) {
		t.Fatalf("reported %d of %d, want at least %d of %d", got.usage, got.limit, threshold, hostMemoryLimit(spec))
	}
	get(t, c, "/v1/health") // near the limit, not over it: the sandbox runs
	if err := rt.Destroy(context.Background(), spec.ID); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("the watch of a destroyed instance: %v", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the watch did not end with its instance")
	}
	if err := rt.WatchMemory(context.Background(), runtime.Spec{ID: spec.ID}, func(int64, int64) {}); !errors.Is(err, runtime.ErrUnsupported) {
		t.Fatalf("a watch without a memory size: %v, want ErrUnsupported", err)
	}
}

// TestWatchMemoryThroughFileCache: a sandbox writes a file larger than its memory, so
// file cache fills its host cgroup up to the limit. That is not told (it is not memory
// its processes hold); a process that then grows into the cache is told before the host
// limit ends the sandbox (on cgroup v1 through the kernel's reclaim notifications, no
// longer a timer).
func TestWatchMemoryThroughFileCache(t *testing.T) {
	rt, spec, c := watchedSandbox(t)
	reports := make(chan int64, 16)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		_ = rt.WatchMemory(ctx, spec, func(usage, limit int64) { reports <- usage })
	}()
	resp, err := c.Post("http://agent/write?path=/big", "application/octet-stream", io.LimitReader(zeros{}, 600<<20))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusNoContent {
		t.Fatalf("write 600 MiB in a 256 MiB sandbox: %d", resp.StatusCode)
	}
	dir, _ := rt.memoryLimitFile(spec.ID)
	files, err := cgroupstat.ReadFileMemory(dir)
	if err != nil {
		t.Fatal(err)
	}
	usage, _ := cgroupstat.ReadMemoryUsage(dir)
	t.Logf("after the write: cgroup %d MiB, %d MiB of it file cache", usage>>20, files.Cache>>20)
	select {
	case u := <-reports:
		t.Fatalf("file cache was told as memory the sandbox holds (%d MiB)", u>>20)
	case <-time.After(time.Second): // nothing to tell: a report would come within it
	}
	var got int64
	held := 0
	for got == 0 && held < 400 {
		post(t, c, "/hold?mib=16")
		held += 16
		select {
		case got = <-reports:
		default:
		}
	}
	if got == 0 {
		select { // the watch may report a moment after the charge
		case got = <-reports:
		case <-time.After(10 * time.Second):
			t.Fatalf("the guest holds %d MiB in a cgroup full of file cache and nothing was told", held)
		}
	}
	t.Logf("told at %d MiB with %d MiB held in the guest", got>>20, held)
	get(t, c, "/v1/health") // told before the limit: the sandbox runs
}

type zeros struct{}

func (zeros) Read(p []byte) (int, error) {
	clear(p)
	return len(p), nil
}

// TestListeningAgentAcrossUpgrade: an instance started before 2026-12-06, whose agent
// listens on run/agent.sock (runsc --host-uds=create), keeps that transport when a node
// of today adopts it, and so does its checkpoint when today's node restores it: the
// record and the checkpoint's metadata say so (agent_dials false), and the restored
// agent, which listens, is reached on its socket.
func TestListeningAgentAcrossUpgrade(t *testing.T) {
	needRunsc(t)
	ctx := context.Background()
	old := newTestRuntime(t, testRootDir(t))
	old.agentListens = true
	spec := testSpec(t, newID(t))
	startSandbox(t, old, spec)
	listening := func(stateDir string) {
		t.Helper()
		if fi, err := os.Lstat(filepath.Join(stateDir, runDir, wire.AgentSocketName)); err != nil || fi.Mode().Type() != fs.ModeSocket {
			t.Errorf("the agent's socket: %v %v", fi, err)
		}
		if _, err := os.Lstat(filepath.Join(stateDir, runDir, wire.NodeSocketName)); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("a node socket beside a listening agent: %v", err)
		}
	}
	listening(spec.StateDir)

	now := newTestRuntime(t, old.cfg.RootDir) // a node of today, after a restart
	if err := now.Adopt(ctx, spec); err != nil {
		t.Fatal(err)
	}
	c := agentClient(t, now, spec.ID)
	waitHealthy(t, c)
	quiesce(t, c, spec)
	dir := suspendInstance(t, now, spec.ID)
	if meta, err := readMeta(dir); err != nil || meta.AgentDials {
		t.Fatalf("checkpoint metadata %+v, %v: want agent_dials false", meta, err)
	}
	dst := testSpec(t, newID(t))
	dst.RootFS = spec.RootFS
	restoreResumed(t, now, dst, dir)
	listening(dst.StateDir)
}

// TestRestoreKeepsItsAgent: a restore mounts the agent binary the checkpoint was taken
// with, not the one the restoring node names now (space was upgraded or rebuilt since
// the sandbox started): the restored agent, whose code is mapped from that file, keeps
// serving, and the next checkpoint records the same binary. Before, the restored agent
// got the new file under its mapped pages and never answered; the node waited 60 s for
// it and booted the sandbox from its disk.
func TestRestoreKeepsItsAgent(t *testing.T) {
	needRunsc(t)
	ctx := context.Background()
	rt := newTestRuntime(t, testRootDir(t))
	agents := filepath.Join(t.TempDir(), "agents")
	install := func(hash, from string) string {
		t.Helper()
		data, err := os.ReadFile(from)
		if err != nil {
			t.Fatal(err)
		}
		p := filepath.Join(agents, hash, "space-agent")
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, data, 0o755); err != nil {
			t.Fatal(err)
		}
		return p
	}
	old := install("aaaa", testAgent)
	upgraded := install("bbbb", "/bin/true") // another program in the agent's place
	spec := testSpec(t, newID(t))
	spec.AgentPath = old
	c := startSandbox(t, rt, spec)
	quiesce(t, c, spec)
	dir := suspendInstance(t, rt, spec.ID)
	spec.AgentPath = upgraded
	if err := rt.Restore(ctx, spec, dir); err != nil {
		t.Fatal(err)
	}
	destroyAtEnd(t, rt, spec)
	if got := bundleAgentPath(spec.StateDir); got != old {
		t.Fatalf("the restore mounts the agent %s, want the checkpointed %s", got, old)
	}
	// The node keeps the binary a running instance maps (it prunes the others).
	if got, err := rt.InstanceAgents(); err != nil || !slices.Contains(got, old) {
		t.Fatalf("the runtime's instances run %v (%v), want %s among them", got, err, old)
	}
	if err := os.WriteFile(filepath.Join(spec.StateDir, runDir, "resume"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	c = agentClient(t, rt, spec.ID)
	waitHealthy(t, c)
	quiesce(t, c, spec)
	again := t.TempDir()
	if err := rt.Checkpoint(ctx, spec.ID, again); err != nil {
		t.Fatal(err)
	}
	if meta, err := readMeta(again); err != nil || meta.AgentPath != old {
		t.Fatalf("the next checkpoint records the agent %q (%v), want %s", meta.AgentPath, err, old)
	}
}

// TestRestoreAgentChoice: the one of the checkpointed agent's content-addressed name in
// this node's agents dir (a checkpoint made on another node, its agent pulled with it);
// else the checkpointed file where it is; else this node's own.
func TestRestoreAgentChoice(t *testing.T) {
	rt := &Runtime{log: slog.New(slog.DiscardHandler)}
	dir := t.TempDir()
	put := func(rel string) string {
		p := filepath.Join(dir, rel)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte("agent"), 0o755); err != nil {
			t.Fatal(err)
		}
		return p
	}
	own := put("node/agents/bbbb/space-agent")
	kept := put("node/agents/aaaa/space-agent")
	there := put("other/agents/cccc/space-agent")
	put("other/agents/aaaa/space-agent")
	spec := runtime.Spec{ID: "x", AgentPath: own}
	for _, tc := range []struct{ checkpointed, want string }{
		{"", own},
		{own, own},
		{there, there},
		{filepath.Join(dir, "elsewhere/agents/aaaa/space-agent"), kept},
		{filepath.Join(dir, "other/agents/aaaa/space-agent"), kept}, // this node's copy first
		{filepath.Join(dir, "elsewhere/agents/dddd/space-agent"), own},
	} {
		if got := rt.restoreAgent(spec, tc.checkpointed); got != tc.want {
			t.Errorf("checkpointed %q: %s, want %s", tc.checkpointed, got, tc.want)
		}
	}
}

// TestInstanceAgents: the agents of the instances the runtime has records of, read
// from the bundle for a record from before records kept it.
func TestInstanceAgents(t *testing.T) {
	rt := &Runtime{cfg: Config{RootDir: t.TempDir()}, log: slog.New(slog.DiscardHandler)}
	if got, err := rt.InstanceAgents(); err != nil || len(got) != 0 {
		t.Fatalf("no instances: %v %v", got, err)
	}
	recorded := record{ID: "a", StateDir: t.TempDir(), layout: layout{AgentPath: "/data/agents/aaaa/space-agent"}}
	older := record{ID: "b", StateDir: t.TempDir()}
	spec := runtime.Spec{ID: "b", RootFS: "/", StateDir: older.StateDir, AgentPath: "/data/agents/bbbb/space-agent"}
	if err := writeBundle(older.StateDir, bundleSpec(spec, bundleOptions{})); err != nil {
		t.Fatal(err)
	}
	for _, rec := range []record{recorded, older} {
		if err := rt.records().Claim(rec.ID, rec); err != nil {
			t.Fatal(err)
		}
	}
	got, err := rt.InstanceAgents()
	slices.Sort(got)
	if err != nil || !slices.Equal(got, []string{"/data/agents/aaaa/space-agent", "/data/agents/bbbb/space-agent"}) {
		t.Fatalf("instance agents %v (%v)", got, err)
	}
}
