package adversary

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
	"github.com/spacedev/space/internal/e2e/e2etest"
)

// nobody is the unprivileged host user the host-side probes run as.
const nobody = 65534

// probeEnv turns the test binary into the probe helper (see maybeProbe).
const probeEnv = "SPACE_ADVERSARY_PROBE"

// maybeProbe runs the probe helper when the test binary was started as one: as an
// unprivileged user it tries each probe "stat:<path>" (reach a path) or "open:<path>"
// (open it read-write) and prints the results (ok or the errno's name) as JSON.
func maybeProbe() {
	if os.Getenv(probeEnv) == "" {
		return
	}
	out := map[string]string{}
	for _, p := range os.Args[1:] {
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
		var errno syscall.Errno
		switch {
		case err == nil:
			out[p] = "ok"
		case errors.As(err, &errno):
			out[p] = unix.ErrnoName(errno)
		default:
			out[p] = err.Error()
		}
	}
	_ = json.NewEncoder(os.Stdout).Encode(out)
	os.Exit(0)
}

// asNobody returns a command that runs as uid/gid 65534 with no supplementary groups,
// with files as its descriptors 3, 4, ...
func asNobody(name string, args []string, files ...*os.File) *exec.Cmd {
	cmd := exec.Command(name, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: nobody, Gid: nobody, Groups: []uint32{}}}
	cmd.ExtraFiles = files
	cmd.Env = []string{"PATH=/usr/bin:/bin"}
	return cmd
}

// probeAsNobody runs the probe helper (a copy of the test binary every user may run)
// as nobody.
func probeAsNobody(t *testing.T, helper string, files []*os.File, probes ...string) map[string]string {
	t.Helper()
	cmd := asNobody(helper, probes, files...)
	cmd.Env = append(cmd.Env, probeEnv+"=1")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("probe helper: %v\n%s", err, stderr.Bytes())
	}
	m := map[string]string{}
	if err := json.Unmarshal(out, &m); err != nil {
		t.Fatalf("probe helper output %q: %v", out, err)
	}
	return m
}

// euidAsNobody runs an `id` binary at path as nobody and returns the effective uid it
// reports.
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

// publicDir makes a directory every user may enter, removed when the test ends.
func publicDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "space-adversary-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

func copyFile(t *testing.T, src, dst string, mode os.FileMode) {
	t.Helper()
	in, err := os.Open(src)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o700)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(out, in); err != nil {
		t.Fatal(err)
	}
	if err := out.Close(); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dst, mode); err != nil { // after the write, which would clear setuid
		t.Fatal(err)
	}
}

// attackSetuidAndDeviceNodes: root in a sandbox plants a setuid-root copy of id and
// device nodes (the host's /dev/null, its first virtio disk, /dev/kvm) on its disk;
// an unprivileged host user gets nothing from them: it cannot reach them by path, and
// handed a descriptor or a bind mount by root, id runs with its own euid and the
// devices do not open. A control (the same id, setuid-root in a host directory) shows
// the probe can see euid 0.
func attackSetuidAndDeviceNodes(t *testing.T, su *suite) {
	if b, err := os.ReadFile("/proc/self/status"); err == nil && strings.Contains(string(b), "NoNewPrivs:\t1") {
		t.Skip("this process runs with no_new_privs: setuid programs never elevate here, so nothing could be shown")
	}
	sb := su.create(t, api.CreateSandboxRequest{})
	out := su.mustSh(t, sb.ID, `cp /usr/bin/id /usr/local/bin/suid-id && chmod 4755 /usr/local/bin/suid-id &&
		for d in "null c 1 3" "vda b 253 0" "kvm c 10 232"; do set -- $d; mknod /root/dev-$1 $2 $3 $4 && chmod 666 /root/dev-$1 && echo "planted $1"; done;
		ls -ln /usr/local/bin/suid-id /root; id -u`)
	t.Logf("inside the sandbox:\n%s", out)
	// gVisor's gofer keeps the files it wrote open for writing while the sandbox runs
	// (exec of them fails with ETXTBSY on the host): stop the sandbox, so that the
	// probes below meet the files as they rest on the disk.
	if op, err := su.s.C.LifecycleAndWait(e2etest.Ctx(t, 2*time.Minute), sb.ID, "stop"); err != nil || op.State != api.OpSucceeded {
		t.Fatalf("stop: %+v %v", op, err)
	}

	rootfs := filepath.Join(su.s.DataDir, "store", "sandboxes", sb.ID, "rootfs")
	planted := filepath.Join(rootfs, "usr/local/bin/suid-id")
	fi, err := os.Stat(planted)
	if err != nil {
		t.Fatalf("the planted binary is not on the host: %v", err)
	}
	if st := fi.Sys().(*syscall.Stat_t); fi.Mode()&os.ModeSetuid == 0 || st.Uid != 0 {
		t.Fatalf("the planted binary is %v owned by %d on the host: the attack planted nothing to test", fi.Mode(), st.Uid)
	}
	var devices []string
	for _, d := range []string{"null", "vda", "kvm"} {
		p := filepath.Join(rootfs, "root", "dev-"+d)
		if fi, err := os.Lstat(p); err == nil && fi.Mode()&(os.ModeDevice|os.ModeCharDevice) != 0 {
			devices = append(devices, p)
		} else if strings.Contains(out, "planted "+d) {
			t.Logf("device node %s made inside is no device node on the host (%v, %v)", d, fi, err)
		}
	}
	t.Logf("device nodes that reached the host's disk: %v", devices)

	helper := filepath.Join(publicDir(t), "probe")
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	copyFile(t, self, helper, 0o755)

	// By path: nobody cannot walk to the files.
	probes := []string{"stat:" + planted, "stat:" + rootfs, "stat:" + filepath.Join(su.s.DataDir, "store", "sandboxes")}
	for _, d := range devices {
		probes = append(probes, "stat:"+d, "open:"+d)
	}
	for p, r := range probeAsNobody(t, helper, nil, probes...) {
		if r != "EACCES" {
			t.Errorf("nobody: %s: %s, want EACCES", p, r)
		}
	}
	// Handed descriptors opened by root.
	if euid := euidAsNobody(t, "/proc/self/fd/3", openPath(t, planted)); euid != fmt.Sprint(nobody) {
		t.Errorf("the planted setuid binary run by nobody through a descriptor: euid %s, want %d", euid, nobody)
	}
	for _, d := range devices {
		if r := probeAsNobody(t, helper, []*os.File{openPath(t, d)}, "open:/proc/self/fd/3")["open:/proc/self/fd/3"]; r != "EACCES" {
			t.Errorf("nobody opening planted device %s through a descriptor: %s, want EACCES", filepath.Base(d), r)
		}
	}
	// Through a bind mount of the sandbox's root filesystem in a public directory.
	view := filepath.Join(publicDir(t), "view")
	if err := os.Mkdir(view, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(rootfs, view, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(view, unix.MNT_DETACH) })
	if euid := euidAsNobody(t, filepath.Join(view, "usr/local/bin/suid-id")); euid != fmt.Sprint(nobody) {
		t.Errorf("the planted setuid binary run by nobody through a bind mount: euid %s, want %d", euid, nobody)
	}
	for _, d := range devices {
		p := filepath.Join(view, "root", filepath.Base(d))
		if r := probeAsNobody(t, helper, nil, "open:"+p)["open:"+p]; r != "EACCES" {
			t.Errorf("nobody opening planted device %s through a bind mount: %s, want EACCES", filepath.Base(d), r)
		}
	}
	// Control: the same binary, setuid-root in a host directory, does elevate.
	control := filepath.Join(t.TempDir(), "id")
	copyFile(t, "/usr/bin/id", control, 0o755|os.ModeSetuid)
	var st unix.Statfs_t
	if err := unix.Statfs(control, &st); err == nil && st.Flags&unix.ST_NOSUID == 0 {
		if euid := euidAsNobody(t, "/proc/self/fd/3", openPath(t, control)); euid != "0" {
			t.Errorf("control: a setuid-root id on the host gave nobody euid %s, want 0: the checks above prove nothing", euid)
		}
	}
}

// probeScript runs inside a sandbox and reports what it can learn about the host and
// what it can do to it: names, kernel, block devices, network interfaces, device
// nodes it makes for host devices, and writes to every cgroup limit it can see.
const probeScript = `
import errno, glob, json, os, socket, stat
def err(e): return errno.errorcode.get(getattr(e, 'errno', None) or 0, type(e).__name__)
def rd(p, n=1 << 16):
    try:
        with open(p, 'rb') as f: return f.read(n).decode('utf-8', 'replace')
    except Exception as e: return 'ERR:' + err(e)
def ls(p):
    try: return sorted(os.listdir(p))
    except Exception as e: return ['ERR:' + err(e)]
r = {'nodename': os.uname().nodename, 'release': os.uname().release,
     'proc_hostname': rd('/proc/sys/kernel/hostname').strip(),
     'boot_id': rd('/proc/sys/kernel/random/boot_id').strip(),
     'mounts': rd('/proc/mounts'), 'partitions': rd('/proc/partitions'),
     'diskstats': rd('/proc/diskstats'), 'sys_block': ls('/sys/block'),
     'sys_class_block': ls('/sys/class/block'), 'net': ls('/sys/class/net'),
     'dev': ls('/dev'), 'cmdline': rd('/proc/cmdline'), 'pid1': rd('/proc/1/cmdline')}
devs = {}
for name, kind, major, minor in [('vda', stat.S_IFBLK, 253, 0), ('kvm', stat.S_IFCHR, 10, 232),
                                 ('mem', stat.S_IFCHR, 1, 1), ('kmsg', stat.S_IFCHR, 1, 11), ('loop0', stat.S_IFBLK, 7, 0)]:
    p = '/tmp/probe-dev-' + name
    try: os.mknod(p, kind | 0o600, os.makedev(major, minor)); made = 'ok'
    except Exception as e: made = err(e)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
        try: opened = 'read %d bytes' % len(os.read(fd, 512))
        except Exception as e: opened = 'opened, read ' + err(e)
        os.close(fd)
    except Exception as e: opened = err(e)
    devs[name] = [made, opened]
r['devices'] = devs
writes = {}
for pat in ('pids.max', 'memory.max', 'memory.limit_in_bytes', 'cpu.max', 'cpu.cfs_quota_us'):
    for f in glob.glob('/sys/fs/cgroup/**/' + pat, recursive=True)[:20]:
        val = '-1' if pat.endswith(('_in_bytes', '_us')) else 'max'
        try:
            with open(f, 'w') as fh: fh.write(val)
            writes[f] = 'ok'
        except Exception as e: writes[f] = err(e)
r['cgroup_writes'] = writes
try:
    os.makedirs('/tmp/cg2', exist_ok=True)
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.mount(b'none', b'/tmp/cg2', b'cgroup2', 0, None)
    r['mount_cgroup2'] = 'ok' if rc == 0 else errno.errorcode.get(ctypes.get_errno(), '?')
except Exception as e: r['mount_cgroup2'] = err(e)
print(json.dumps(r))
`

// attackProbing: sandbox root probes /proc, /sys and /dev for the host and writes to
// every cgroup limit it sees. It learns no host name, kernel, boot id, block device or
// network interface; device nodes it makes for the host's disk, /dev/kvm, /dev/mem and
// /dev/kmsg do not open the host's devices; cgroup writes do not change the host
// cgroup's limits of the sandbox.
func attackProbing(t *testing.T, su *suite) {
	sb := su.create(t, api.CreateSandboxRequest{})
	hostCg := map[string]string{
		"pids":   hostCgroupFile(sb.ID, "pids", "pids.max", "pids.max"),
		"memory": hostCgroupFile(sb.ID, "memory", "memory.limit_in_bytes", "memory.max"),
	}
	before := map[string]int64{}
	for k, f := range hostCg {
		before[k] = readInt64(t, f)
	}
	su.put(t, sb.ID, "/tmp/probe.py", probeScript, 0o644)
	out := su.mustSh(t, sb.ID, "python3 /tmp/probe.py")
	var r struct {
		Nodename, Release, ProcHostname, BootID, Mounts, Partitions, Diskstats, Cmdline, Pid1 string
		SysBlock, SysClassBlock, Net, Dev                                                     []string
		Devices                                                                               map[string][2]string
		CgroupWrites                                                                          map[string]string `json:"cgroup_writes"`
		MountCgroup2                                                                          string            `json:"mount_cgroup2"`
	}
	// The script's keys are snake_case; map the few that differ.
	fixed := strings.NewReplacer(`"proc_hostname"`, `"ProcHostname"`, `"boot_id"`, `"BootID"`, `"sys_block"`, `"SysBlock"`, `"sys_class_block"`, `"SysClassBlock"`).Replace(out)
	if err := json.Unmarshal([]byte(fixed), &r); err != nil {
		t.Fatalf("probe output %q: %v", out, err)
	}
	t.Logf("inside: nodename %q, release %q, /dev %v, net %v, devices %v, cgroup writes %v, cgroup2 mount %s",
		r.Nodename, r.Release, r.Dev, r.Net, r.Devices, r.CgroupWrites, r.MountCgroup2)

	hostName, _ := os.Hostname()
	var uts unix.Utsname
	_ = unix.Uname(&uts)
	hostRelease := unix.ByteSliceToString(uts.Release[:])
	hostBoot, _ := os.ReadFile("/proc/sys/kernel/random/boot_id")
	hostCmdline, _ := os.ReadFile("/proc/cmdline")
	if r.Nodename == hostName || r.ProcHostname == hostName {
		t.Errorf("the sandbox sees the host's hostname %q", hostName)
	}
	if r.Release == hostRelease || strings.Contains(r.Mounts+r.Cmdline, hostRelease) {
		t.Errorf("the sandbox sees the host's kernel release %q", hostRelease)
	}
	if b := strings.TrimSpace(string(hostBoot)); b != "" && r.BootID == b {
		t.Errorf("the sandbox sees the host's boot id")
	}
	if c := strings.TrimSpace(string(hostCmdline)); c != "" && strings.Contains(r.Cmdline, c) {
		t.Errorf("the sandbox sees the host's kernel command line %q", c)
	}
	// No host block device by name anywhere the kernel lists them.
	blocks, _ := os.ReadDir("/sys/block")
	seen := strings.Join([]string{r.Mounts, r.Partitions, r.Diskstats, strings.Join(r.SysBlock, " "), strings.Join(r.SysClassBlock, " "), strings.Join(r.Dev, " ")}, "\n")
	for _, b := range blocks {
		if regexp.MustCompile(`\b` + regexp.QuoteMeta(b.Name()) + `\b`).MatchString(seen) {
			t.Errorf("the sandbox sees the host's block device %s", b.Name())
		}
	}
	for _, d := range r.Dev {
		if d == "kvm" || d == "mem" || d == "kmsg" || strings.HasPrefix(d, "vd") || strings.HasPrefix(d, "sd") || strings.HasPrefix(d, "loop") || strings.HasPrefix(d, "nvme") {
			t.Errorf("the sandbox's /dev has %s", d)
		}
	}
	for _, n := range r.Net {
		if n != "lo" && n != "ERR:ENOENT" {
			t.Errorf("the sandbox sees network interface %s", n)
		}
	}
	for name, res := range r.Devices {
		if strings.HasPrefix(res[1], "read ") && res[1] != "read 0 bytes" {
			t.Errorf("a device node for the host's %s opened and read: %v", name, res)
		}
	}
	// The host cgroup's limits hold whatever the sandbox wrote.
	for k, f := range hostCg {
		if got := readInt64(t, f); got != before[k] {
			t.Errorf("host cgroup %s: %d after the sandbox's writes, was %d", f, got, before[k])
		}
	}
	// And the sandbox still works.
	if out := su.mustSh(t, sb.ID, "echo alive"); out != "alive\n" {
		t.Errorf("sandbox after probing: %q", out)
	}
}

// attackLinks: sandbox root makes symbolic links to /etc/shadow, to ../../.. (far
// above its root), to /proc/1/root, to the host's data directory and to this
// sandbox's own files as the host names them, and a hard link to /etc/shadow; the
// files API, reading and writing through each, stays inside the sandbox.
func attackLinks(t *testing.T, su *suite) {
	sb := su.create(t, api.CreateSandboxRequest{})
	hostFile := filepath.Join(su.s.DataDir, "store", "sandboxes", sb.ID, "rootfs", "etc", "shadow")
	marker := fmt.Sprintf("inside-%d", time.Now().UnixNano())
	su.mustSh(t, sb.ID, fmt.Sprintf(`echo %s > /etc/space-marker &&
		ln -s /etc/shadow /tmp/l-shadow && ln -s ../../../../../../../../../../ /tmp/l-up &&
		ln -s /proc/1/root /tmp/l-proc && ln -s %s /tmp/l-datadir && ln -s %s /tmp/l-hostview &&
		ln /etc/shadow /root/h-shadow && ln -s /tmp/l-up /tmp/l-chain`, marker, su.s.DataDir, hostFile))
	shadow := su.mustSh(t, sb.ID, "cat /etc/shadow")
	hostShadow, _ := os.ReadFile("/etc/shadow")
	if shadow == string(hostShadow) {
		t.Fatal("the sandbox's /etc/shadow equals the host's: the checks below could not tell them apart")
	}
	c := e2etest.Ctx(t, 2*time.Minute)
	read := func(path string) (string, error) {
		rc, err := su.s.C.ReadFile(c, sb.ID, path, client.FileOptions{})
		if err != nil {
			return "", err
		}
		defer rc.Close()
		b, err := io.ReadAll(io.LimitReader(rc, 1<<20))
		return string(b), err
	}
	for path, want := range map[string]string{
		"/tmp/l-shadow":                      shadow,
		"/tmp/l-up/etc/shadow":               shadow,
		"/tmp/l-chain/etc/shadow":            shadow,
		"/tmp/l-proc/etc/shadow":             shadow,
		"/root/h-shadow":                     shadow,
		"../../../../../../etc/shadow":       shadow, // relative to root's home
		"/tmp/l-up/etc/space-marker":         marker + "\n",
		"/tmp/../../../etc/space-marker":     marker + "\n",
		"/tmp/l-proc/../../etc/space-marker": marker + "\n",
	} {
		got, err := read(path)
		if err != nil || got != want {
			t.Errorf("files API read %s: %q %v, want the sandbox's file", path, got, err)
		}
	}
	// Host paths do not exist inside, however they are reached.
	for _, path := range []string{"/tmp/l-datadir/admin.key", "/tmp/l-hostview", "/tmp/l-up" + su.s.DataDir + "/admin.key"} {
		if got, err := read(path); err == nil {
			t.Errorf("files API read %s gave %q: a host file?", path, got)
		} else if code := statusOf(err); code != 404 {
			t.Errorf("files API read %s: %v (status %d), want 404", path, err, code)
		}
	}
	// Writes through links land inside the sandbox, never on the host.
	name := fmt.Sprintf("space-adversary-%d", time.Now().UnixNano())
	for _, path := range []string{"/tmp/l-up/tmp/" + name, "/tmp/l-proc/tmp/" + name + "-proc"} {
		if _, err := su.s.C.WriteFile(c, sb.ID, path, strings.NewReader("written"), client.FileOptions{}); err != nil {
			t.Errorf("files API write %s: %v", path, err)
		}
	}
	if out := su.mustSh(t, sb.ID, "cat /tmp/"+name+" /tmp/"+name+"-proc"); out != "writtenwritten" {
		t.Errorf("writes through links inside the sandbox: %q", out)
	}
	for _, p := range []string{"/tmp/" + name, "/tmp/" + name + "-proc"} {
		if _, err := os.Lstat(p); err == nil {
			t.Errorf("a write through a sandbox's link reached the host: %s", p)
		}
	}
	if _, err := su.s.C.WriteFile(c, sb.ID, "/tmp/l-datadir/admin.key", strings.NewReader("x"), client.FileOptions{}); err == nil {
		t.Logf("a write to /tmp/l-datadir/admin.key succeeded inside the sandbox (made its own directory?)")
	}
	if key, _ := os.ReadFile(filepath.Join(su.s.DataDir, "admin.key")); strings.TrimSpace(string(key)) != su.s.Key {
		t.Errorf("the host's admin key changed")
	}
	list, err := su.s.C.ListDir(c, sb.ID, "/tmp/l-up", 1, client.FileOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range list {
		if e.Name == "work" || e.Name == filepath.Base(su.s.DataDir) {
			t.Errorf("listing /tmp/l-up shows %s: the host's root?", e.Name)
		}
	}
}

// statusOf returns the HTTP status of a client error (0 when it has none).
func statusOf(err error) int {
	var e *client.Error
	if errors.As(err, &e) {
		return e.Status
	}
	return 0
}
