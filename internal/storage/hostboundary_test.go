package storage_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/storage"
	"github.com/spacedev/space/internal/template/templatetest"
	"github.com/spacedev/space/internal/testenv"
)

// helperEnv turns the test binary into probeHelper (see TestMain).
const helperEnv = "SPACE_STORAGE_PROBE"

// nobody is the unprivileged host user the probes run as.
const nobody = 65534

func TestMain(m *testing.M) {
	if os.Getenv(helperEnv) != "" {
		probeHelper(os.Args[1:])
		return
	}
	os.Exit(m.Run())
}

// probeResult is what probeHelper reports for one probe: "ok" or the errno's name.
type probeResult struct {
	Probe  string `json:"probe"`
	Result string `json:"result"`
}

// probeHelper runs as an unprivileged user and tries each probe "stat:<path>" (reach a
// path) or "open:<path>" (open it read-write), printing the results as JSON.
func probeHelper(probes []string) {
	var out []probeResult
	for _, p := range probes {
		op, path, _ := strings.Cut(p, ":")
		var err error
		switch op {
		case "stat":
			_, err = os.Stat(path)
		case "open":
			var f *os.File
			if f, err = os.OpenFile(path, os.O_RDWR, 0); err == nil {
				f.Close()
			}
		default:
			err = fmt.Errorf("unknown probe %q", p)
		}
		out = append(out, probeResult{Probe: p, Result: errName(err)})
	}
	json.NewEncoder(os.Stdout).Encode(out)
	os.Exit(0)
}

func errName(err error) string {
	var errno syscall.Errno
	switch {
	case err == nil:
		return "ok"
	case errors.As(err, &errno):
		return unix.ErrnoName(errno)
	default:
		return err.Error()
	}
}

// asNobody returns a command that runs as uid/gid 65534 with no supplementary groups,
// with files as its fds 3, 4, ...
func asNobody(name string, args []string, files ...*os.File) *exec.Cmd {
	cmd := exec.Command(name, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: nobody, Gid: nobody, Groups: []uint32{}}}
	cmd.ExtraFiles = files
	cmd.Env = []string{"PATH=/usr/bin:/bin"}
	return cmd
}

// probe runs probeHelper as nobody: the test binary, copied where nobody can run it.
func probe(t *testing.T, helper string, files []*os.File, probes ...string) map[string]string {
	t.Helper()
	cmd := asNobody(helper, probes, files...)
	cmd.Env = append(cmd.Env, helperEnv+"=1")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("probe helper: %v\n%s", err, stderr.Bytes())
	}
	var results []probeResult
	if err := json.Unmarshal(out, &results); err != nil {
		t.Fatalf("probe helper output %q: %v", out, err)
	}
	m := map[string]string{}
	for _, r := range results {
		m[r.Probe] = r.Result
	}
	return m
}

// euidAsNobody runs the program at path ("id") as nobody and returns the effective uid
// it reports.
func euidAsNobody(t *testing.T, path string, files ...*os.File) string {
	t.Helper()
	cmd := asNobody(path, []string{"-u"}, files...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("run %s as uid %d: %v\n%s", path, nobody, err, stderr.Bytes())
	}
	return strings.TrimSpace(string(out))
}

// publicDir makes a directory every user may enter, removed when the test ends.
func publicDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "space-storage-public-")
	must(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	must(t, os.Chmod(dir, 0o755))
	return dir
}

func copyFile(t *testing.T, src, dst string, mode os.FileMode) {
	t.Helper()
	in, err := os.Open(src)
	must(t, err)
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o700)
	must(t, err)
	_, err = io.Copy(out, in)
	must(t, err)
	must(t, out.Close())
	must(t, os.Chown(dst, 0, 0))
	must(t, os.Chmod(dst, mode)) // after chown, which clears setuid
}

func openPath(t *testing.T, path string) *os.File {
	t.Helper()
	fd, err := unix.Open(path, unix.O_PATH|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatalf("open %s: %v", path, err)
	}
	f := os.NewFile(uintptr(fd), path)
	t.Cleanup(func() { f.Close() })
	return f
}

func noNewPrivs(t *testing.T) bool {
	data, err := os.ReadFile("/proc/self/status")
	must(t, err)
	return strings.Contains(string(data), "NoNewPrivs:\t1")
}

// TestSandboxFilesGiveHostUsersNothing plants what root in a sandbox can write (gVisor's
// gofer writes as host root): a setuid-root copy of id and a world-writable device node,
// and checks that an unprivileged host user gains nothing from them. It cannot reach
// them by path; handed an open descriptor, or a bind mount in a directory it can enter,
// running the binary leaves its euid its own and opening the device fails. Controls
// show the same binary and node do work from an ordinary host directory, so the checks
// can fail.
func TestSandboxFilesGiveHostUsersNothing(t *testing.T) {
	templatetest.RequireStore(t)
	testenv.RequireRoot(t)
	idPath := testenv.RequireBinary(t, "/usr/bin/id", "coreutils")
	if noNewPrivs(t) {
		t.Skip("this process runs with no_new_privs: setuid programs never elevate here, so nothing could be shown")
	}
	ctx := context.Background()

	// The data directory's parents are public so that only the store's own modes stand
	// between a host user and the sandbox's files.
	dataDir := publicDir(t)
	s, err := storage.Open(ctx, storage.Config{DataDir: dataDir, ImageSizeBytes: 2 << 30})
	must(t, err)
	t.Cleanup(func() { s.Unmount(ctx) })

	rel := newRelease(t, s, "plain", func(root string) {
		must(t, os.MkdirAll(filepath.Join(root, "usr/bin"), 0o755))
		must(t, os.MkdirAll(filepath.Join(root, "dev"), 0o755))
	})
	rootfs, err := s.CreateSandboxRoot(ctx, "victim", rel.Digest)
	must(t, err)
	planted := filepath.Join(rootfs, "usr/bin/id")
	copyFile(t, idPath, planted, 0o755|os.ModeSetuid)
	device := filepath.Join(rootfs, "dev/planted")
	must(t, unix.Mknod(device, unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3)))) // /dev/null's numbers
	must(t, os.Chmod(device, 0o666))
	if fi, err := os.Stat(planted); err != nil || fi.Mode()&os.ModeSetuid == 0 {
		t.Fatalf("planted binary is not setuid: %v %v", fi, err)
	}

	// The mount: nosuid and nodev.
	var st unix.Statfs_t
	must(t, unix.Statfs(rootfs, &st))
	if st.Flags&unix.ST_NOSUID == 0 || st.Flags&unix.ST_NODEV == 0 {
		t.Fatalf("store mount flags %#x lack nosuid or nodev", st.Flags)
	}
	// The directories down to the rootfs: 0700.
	sandboxDir, err := s.SandboxDir("victim")
	must(t, err)
	for _, d := range []string{s.Root(), filepath.Join(s.Root(), "templates"), filepath.Join(s.Root(), "sandboxes"), filepath.Join(s.Root(), "tmp"), sandboxDir} {
		fi, err := os.Stat(d)
		must(t, err)
		if fi.Mode().Perm() != 0o700 {
			t.Errorf("%s: mode %v, want 0700", d, fi.Mode().Perm())
		}
	}
	// Not even root can open a device node on a nodev mount.
	if _, err := os.OpenFile(device, os.O_RDWR, 0); !errors.Is(err, unix.EACCES) {
		t.Errorf("root opening the planted device: %v, want EACCES", err)
	}

	helperDir := publicDir(t)
	helper := filepath.Join(helperDir, "probe")
	self, err := os.Executable()
	must(t, err)
	copyFile(t, self, helper, 0o755)

	// 1. By path: nobody cannot walk into the store.
	got := probe(t, helper, nil, "stat:"+dataDir, "stat:"+s.Root(), "stat:"+filepath.Join(s.Root(), "sandboxes"), "stat:"+planted, "stat:"+device)
	if got["stat:"+dataDir] != "ok" || got["stat:"+s.Root()] != "ok" {
		t.Fatalf("nobody cannot even reach the data directory (%v): the probe proves nothing", got)
	}
	for _, p := range []string{filepath.Join(s.Root(), "sandboxes"), planted, device} {
		if got["stat:"+p] != "EACCES" {
			t.Errorf("nobody reaching %s: %s, want EACCES", p, got["stat:"+p])
		}
	}

	// 2. Handed descriptors opened by root.
	if euid := euidAsNobody(t, "/proc/self/fd/3", openPath(t, planted)); euid != fmt.Sprint(nobody) {
		t.Errorf("planted setuid binary run by nobody through a descriptor: euid %s, want %d", euid, nobody)
	}
	got = probe(t, helper, []*os.File{openPath(t, device)}, "open:/proc/self/fd/3")
	if r := got["open:/proc/self/fd/3"]; r != "EACCES" {
		t.Errorf("nobody opening the planted device through a descriptor: %s, want EACCES", r)
	}

	// 3. Through a bind mount in a public directory (bind mounts keep nosuid,nodev).
	view := filepath.Join(publicDir(t), "view")
	must(t, os.Mkdir(view, 0o755))
	must(t, unix.Mount(rootfs, view, "", unix.MS_BIND, ""))
	t.Cleanup(func() { unix.Unmount(view, unix.MNT_DETACH) })
	if euid := euidAsNobody(t, filepath.Join(view, "usr/bin/id")); euid != fmt.Sprint(nobody) {
		t.Errorf("planted setuid binary run by nobody through a bind mount: euid %s, want %d", euid, nobody)
	}
	got = probe(t, helper, nil, "open:"+filepath.Join(view, "dev/planted"))
	if r := got["open:"+filepath.Join(view, "dev/planted")]; r != "EACCES" {
		t.Errorf("nobody opening the planted device through a bind mount: %s, want EACCES", r)
	}

	// Controls: the same binary and node in a host directory mounted suid,dev work.
	control := t.TempDir()
	must(t, unix.Statfs(control, &st))
	if st.Flags&(unix.ST_NOSUID|unix.ST_NODEV) != 0 {
		t.Skipf("%s is mounted nosuid or nodev: the controls cannot run (the checks above passed)", control)
	}
	suid := filepath.Join(control, "id")
	copyFile(t, idPath, suid, 0o755|os.ModeSetuid)
	if euid := euidAsNobody(t, "/proc/self/fd/3", openPath(t, suid)); euid != "0" {
		t.Fatalf("control: setuid-root id from %s gave euid %s, want 0: the checks above prove nothing", control, euid)
	}
	node := filepath.Join(control, "node")
	must(t, unix.Mknod(node, unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))))
	must(t, os.Chmod(node, 0o666))
	if r := probe(t, helper, []*os.File{openPath(t, node)}, "open:/proc/self/fd/3")["open:/proc/self/fd/3"]; r != "ok" {
		t.Fatalf("control: opening a device node from %s: %s, want ok", control, r)
	}
}

// TestOpenFixesOlderStore opens a store the way an older version left it (mounted without
// nosuid,nodev, directories 0755) and checks that Open fixes both.
func TestOpenFixesOlderStore(t *testing.T) {
	s := templatetest.Store(t)
	ctx := context.Background()
	rel := newRelease(t, s, "old", func(string) {})
	_, err := s.CreateSandboxRoot(ctx, "old", rel.Digest)
	must(t, err)
	sandboxDir, err := s.SandboxDir("old")
	must(t, err)
	releaseDir := filepath.Dir(mustReleaseRoot(t, s, rel.Digest))
	dirs := []string{s.Root(), filepath.Join(s.Root(), "templates"), filepath.Join(s.Root(), "sandboxes"), filepath.Join(s.Root(), "tmp"), sandboxDir, releaseDir}
	for _, d := range dirs {
		must(t, os.Chmod(d, 0o755))
	}
	must(t, unix.MountSetattr(unix.AT_FDCWD, s.Root(), 0, &unix.MountAttr{Attr_clr: unix.MOUNT_ATTR_NOSUID | unix.MOUNT_ATTR_NODEV}))
	var st unix.Statfs_t
	must(t, unix.Statfs(s.Root(), &st))
	if st.Flags&(unix.ST_NOSUID|unix.ST_NODEV) != 0 {
		t.Fatalf("could not make the old store's mount: flags %#x", st.Flags)
	}

	s2, err := storage.Open(ctx, storage.Config{DataDir: filepath.Dir(s.Root())})
	must(t, err)
	defer s2.Close()
	must(t, unix.Statfs(s.Root(), &st))
	if st.Flags&unix.ST_NOSUID == 0 || st.Flags&unix.ST_NODEV == 0 {
		t.Errorf("after Open the mount flags are %#x: no nosuid,nodev", st.Flags)
	}
	for _, d := range dirs {
		if fi, err := os.Stat(d); err != nil || fi.Mode().Perm() != 0o700 {
			t.Errorf("after Open %s: %v %v, want mode 0700", d, fi.Mode().Perm(), err)
		}
	}
}

func mustReleaseRoot(t *testing.T, s *storage.Store, digest string) string {
	t.Helper()
	r, err := s.ReleaseRoot(digest)
	must(t, err)
	return r
}

// TestOpenNativeBtrfs opens a store whose data directory is on a btrfs mounted without
// nosuid,nodev: the store directory is bind-mounted onto itself with them, and the
// file system's own mount is left as it was.
func TestOpenNativeBtrfs(t *testing.T) {
	outer := templatetest.Store(t)
	ctx := context.Background()
	// The outer store's file system, mounted the way an operator's btrfs would be.
	must(t, unix.MountSetattr(unix.AT_FDCWD, outer.Root(), 0, &unix.MountAttr{Attr_clr: unix.MOUNT_ATTR_NOSUID | unix.MOUNT_ATTR_NODEV}))
	dataDir := filepath.Join(outer.Root(), "native")
	must(t, os.Mkdir(dataDir, 0o755))

	s, err := storage.Open(ctx, storage.Config{DataDir: dataDir})
	must(t, err)
	t.Cleanup(func() {
		s.Close()
		// The bind mount stays after Close by design; the test removes it.
		for deadline := time.Now().Add(10 * time.Second); unix.Unmount(s.Root(), 0) != nil && time.Now().Before(deadline); {
			time.Sleep(50 * time.Millisecond)
		}
	})
	var st unix.Statfs_t
	must(t, unix.Statfs(s.Root(), &st))
	if st.Flags&unix.ST_NOSUID == 0 || st.Flags&unix.ST_NODEV == 0 {
		t.Errorf("native store mount flags %#x: no nosuid,nodev", st.Flags)
	}
	must(t, unix.Statfs(dataDir, &st))
	if st.Flags&(unix.ST_NOSUID|unix.ST_NODEV) != 0 {
		t.Errorf("the file system's own mount changed: flags %#x", st.Flags)
	}
	// A second Open finds the bind mount and does not stack another.
	s2, err := storage.Open(ctx, storage.Config{DataDir: dataDir})
	must(t, err)
	must(t, s2.Close())
	if n := mountsAt(t, s.Root()); n != 1 {
		t.Errorf("%d mounts at %s after two Opens, want 1", n, s.Root())
	}
	if ok, why := s.QuotasEnabled(); !ok {
		t.Logf("quotas: %s", why)
	}
}

func mountsAt(t *testing.T, dir string) int {
	t.Helper()
	data, err := os.ReadFile("/proc/self/mountinfo")
	must(t, err)
	n := 0
	for _, line := range strings.Split(string(data), "\n") {
		if f := strings.Fields(line); len(f) > 4 && f[4] == dir {
			n++
		}
	}
	return n
}
