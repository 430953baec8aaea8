package qemu

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	goruntime "runtime"
	"slices"
	"syscall"

	"golang.org/x/sys/unix"
)

// QEMU is confined the way Firecracker's jailer confines Firecracker. The node (root)
// starts this same binary again (/proc/self/exe) under the name jailArg0, in new mount,
// PID, network, IPC and UTS namespaces; the node moves it into the VM's cgroups, then
// sends it a jailSpec over a pipe. The helper, still root but already in its own mount
// namespace:
//
//  1. mounts an empty tmpfs on the spec's root, bind-mounts (read-only, nosuid) only what
//     QEMU reads by path into it: its binary, the host's libraries (/usr/lib; QEMU's
//     accelerator is a loadable module there), its firmware (/usr/share/qemu), the
//     kernel and the initramfs, and /dev/null, zero, random, urandom (plus /dev/kvm for
//     KVM guests), and pivots into it: the store, the StateDir, other sandboxes' files
//     and the rest of the host's / are not in QEMU's view at all;
//  2. drops every capability from its bounding and ambient sets, switches to the VM's
//     own uid and gid (no supplementary groups but kvm's, with KVM), which clears its
//     permitted and effective sets, clears the inheritable set, sets no_new_privs and
//     RLIMIT_CORE 0;
//  3. execs QEMU, which turns its own seccomp sandbox on (machine.args).
//
// Everything else QEMU uses was opened by the node and is inherited: the disk (an fdset,
// /dev/fdset/1), the console log (/dev/fdset/2), the listening QMP and agent sockets
// (chardev fd=N), and later the migration streams (QMP getfd). QEMU needs no writable
// path; it cannot open or create any file on the host.
//
// A Go program cannot do this between fork and exec (os/exec's SysProcAttr has no bind
// mounts, pivot_root or bounding set); a helper of our own keeps the whole start in
// one place, with no runc-style lifecycle (state dir, delete) around each QEMU.

// jailArg0 is argv[0] of the jail helper. The package's init runs the helper when the
// process was started under this name, before main: every binary that links this
// package (the server, its tests) can jail a QEMU.
const jailArg0 = "space-qemu-jail"

// fdJailSpec is the helper's descriptor for the spec pipe (the first of ExtraFiles).
const fdJailSpec = 3

func init() {
	if len(os.Args) == 0 || os.Args[0] != jailArg0 {
		return
	}
	// The capability bounding set and no_new_privs are per thread: they are set on the
	// thread that execs QEMU (init runs on the main thread; keep it there).
	goruntime.LockOSThread()
	err := runJail()
	fmt.Fprintf(os.Stderr, "%s: %v\n", jailArg0, err)
	os.Exit(125)
}

// jailSpec is what the helper needs to confine and exec QEMU.
type jailSpec struct {
	// Root is an empty directory of the host on which the jail's tmpfs is mounted (in
	// the helper's own mount namespace; the host never sees it).
	Root  string     `json:"root"`
	Binds []jailBind `json:"binds"`
	Links []jailLink `json:"links"`
	UID   int        `json:"uid"`
	GID   int        `json:"gid"`
	// Groups are the supplementary groups (kvm's, for /dev/kvm).
	Groups []int `json:"groups"`
	// NoTHP disables transparent huge pages for QEMU (PR_SET_THP_DISABLE, kept across
	// exec): see hostOpts.THP.
	NoTHP bool     `json:"no_thp,omitempty"`
	Path  string   `json:"path"` // QEMU's path inside the jail
	Args  []string `json:"args"`
	Env   []string `json:"env"`
}

// jailBind is a read-only bind mount of a host file or directory into the jail.
type jailBind struct {
	Src string `json:"src"` // host path
	Dst string `json:"dst"` // path in the jail
	// Exec allows mapping its files executable (the binary, the libraries).
	Exec bool `json:"exec,omitempty"`
	// Dev allows using it as a device node.
	Dev bool `json:"dev,omitempty"`
}

// jailLink is a symbolic link in the jail (the host's /lib -> usr/lib).
type jailLink struct {
	Path   string `json:"path"`
	Target string `json:"target"`
}

// runJail reads the spec from fdJailSpec and becomes QEMU; it returns only on error.
func runJail() error {
	f := os.NewFile(fdJailSpec, "jail spec")
	data, err := io.ReadAll(io.LimitReader(f, 1<<20))
	f.Close()
	if err != nil {
		return fmt.Errorf("read spec: %w", err)
	}
	if len(data) == 0 {
		return errors.New("no spec (the node went away)")
	}
	var js jailSpec
	if err := json.Unmarshal(data, &js); err != nil {
		return fmt.Errorf("spec: %w", err)
	}
	if err := js.enter(); err != nil {
		return err
	}
	if err := dropPrivileges(js.UID, js.GID, js.Groups); err != nil {
		return err
	}
	if js.NoTHP {
		if err := unix.Prctl(unix.PR_SET_THP_DISABLE, 1, 0, 0, 0); err != nil {
			return fmt.Errorf("disable transparent huge pages: %w", err)
		}
	}
	return fmt.Errorf("exec %s: %w", js.Path, syscall.Exec(js.Path, js.Args, js.Env))
}

// enter builds the jail's root and pivots into it.
func (js jailSpec) enter() error {
	if js.Root == "" || !filepath.IsAbs(js.Root) {
		return fmt.Errorf("jail root %q is not absolute", js.Root)
	}
	// The namespace is new, but mounts would still propagate to the host's.
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("make mounts private: %w", err)
	}
	if err := unix.Mount("tmpfs", js.Root, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "mode=0755,size=64k,nr_inodes=512"); err != nil {
		return fmt.Errorf("mount jail root: %w", err)
	}
	for _, b := range js.Binds {
		if err := bindInto(js.Root, b); err != nil {
			return err
		}
	}
	for _, l := range js.Links {
		p := filepath.Join(js.Root, l.Path)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return err
		}
		if err := os.Symlink(l.Target, p); err != nil {
			return err
		}
	}
	// pivot_root(".", "."): the old root ends up under the new one and is detached at
	// once, so nothing of the host's tree stays reachable.
	if err := unix.Chdir(js.Root); err != nil {
		return err
	}
	if err := unix.PivotRoot(".", "."); err != nil {
		return fmt.Errorf("pivot_root: %w", err)
	}
	if err := unix.Unmount(".", unix.MNT_DETACH); err != nil {
		return fmt.Errorf("detach old root: %w", err)
	}
	if err := unix.Chdir("/"); err != nil {
		return err
	}
	if err := unix.Mount("", "/", "", unix.MS_REMOUNT|unix.MS_BIND|unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return fmt.Errorf("make jail root read-only: %w", err)
	}
	return nil
}

// bindInto bind-mounts b into the jail rooted at root, read-only and nosuid (and nodev,
// noexec unless asked otherwise).
func bindInto(root string, b jailBind) error {
	fi, err := os.Stat(b.Src)
	if err != nil {
		return fmt.Errorf("bind %s: %w", b.Src, err)
	}
	dst := filepath.Join(root, b.Dst)
	if fi.IsDir() {
		err = os.MkdirAll(dst, 0o755)
	} else {
		if err = os.MkdirAll(filepath.Dir(dst), 0o755); err == nil {
			var f *os.File
			if f, err = os.OpenFile(dst, os.O_CREATE|os.O_WRONLY, 0o644); err == nil {
				f.Close()
			}
		}
	}
	if err != nil && !errors.Is(err, fs.ErrExist) {
		return fmt.Errorf("bind %s: mount point: %w", b.Src, err)
	}
	if err := unix.Mount(b.Src, dst, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("bind %s: %w", b.Src, err)
	}
	flags := uintptr(unix.MS_REMOUNT | unix.MS_BIND | unix.MS_RDONLY | unix.MS_NOSUID)
	if !b.Dev {
		flags |= unix.MS_NODEV
	}
	if !b.Exec {
		flags |= unix.MS_NOEXEC
	}
	if err := unix.Mount("", dst, "", flags, ""); err != nil {
		return fmt.Errorf("bind %s: remount read-only: %w", b.Src, err)
	}
	return nil
}

// dropPrivileges makes the calling thread (the one that execs QEMU) uid:gid with groups,
// no capabilities in any set, no_new_privs and no core dumps.
func dropPrivileges(uid, gid int, groups []int) error {
	if uid <= 0 || gid <= 0 {
		return fmt.Errorf("refusing to run QEMU as uid %d gid %d", uid, gid)
	}
	if err := unix.Setrlimit(unix.RLIMIT_CORE, &unix.Rlimit{}); err != nil {
		return fmt.Errorf("rlimit core: %w", err)
	}
	// syscall's set*id change every thread of the process (Go 1.16+).
	if err := syscall.Setgroups(groups); err != nil {
		return fmt.Errorf("setgroups: %w", err)
	}
	if err := syscall.Setresgid(gid, gid, gid); err != nil {
		return fmt.Errorf("setresgid: %w", err)
	}
	// The bounding set limits what any later exec could gain; dropping needs
	// CAP_SETPCAP, so before setuid. Capabilities past the kernel's last one are EINVAL.
	for c := 0; c < 64; c++ {
		if err := unix.Prctl(unix.PR_CAPBSET_DROP, uintptr(c), 0, 0, 0); err != nil {
			if errors.Is(err, unix.EINVAL) {
				break
			}
			return fmt.Errorf("drop capability %d from the bounding set: %w", c, err)
		}
	}
	if err := unix.Prctl(unix.PR_CAP_AMBIENT, unix.PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0); err != nil {
		return fmt.Errorf("clear ambient capabilities: %w", err)
	}
	// From root to non-zero uids in all three: the kernel clears the permitted,
	// effective and ambient sets.
	if err := syscall.Setresuid(uid, uid, uid); err != nil {
		return fmt.Errorf("setresuid: %w", err)
	}
	// The inheritable set survives setuid: clear it too.
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capset(&hdr, &data[0]); err != nil {
		return fmt.Errorf("clear capabilities: %w", err)
	}
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("no_new_privs: %w", err)
	}
	return nil
}

// baseJail is what every jail holds for QEMU at qemuPath: the binary itself, the host's
// libraries and QEMU's modules, its firmware, the usual character devices and, for KVM,
// /dev/kvm (with its group as a supplementary group when it is not open to all).
func baseJail(qemuPath, accel string) (jailSpec, error) {
	bin, err := filepath.EvalSymlinks(qemuPath)
	if err != nil {
		return jailSpec{}, err
	}
	js := jailSpec{Path: qemuPath}
	seen := map[string]bool{}
	// QEMU's own prefix first (a build under /opt or /usr/local), then the system's.
	for _, prefix := range []string{filepath.Dir(filepath.Dir(bin)), "/usr"} {
		for _, sub := range []string{"lib", "lib64", "share/qemu", "share/seabios"} {
			p := filepath.Join(prefix, sub)
			if seen[p] {
				continue
			}
			seen[p] = true
			if fi, err := os.Lstat(p); err != nil || !fi.IsDir() {
				continue
			}
			js.Binds = append(js.Binds, jailBind{Src: p, Dst: p, Exec: sub == "lib" || sub == "lib64"})
		}
	}
	// The dynamic loader is /lib64/ld-linux-x86-64.so.2: mirror /lib and /lib64, links
	// (merged /usr) or directories.
	for _, p := range []string{"/lib", "/lib64"} {
		fi, err := os.Lstat(p)
		switch {
		case err != nil:
		case fi.Mode()&fs.ModeSymlink != 0:
			target, err := os.Readlink(p)
			if err != nil {
				return jailSpec{}, err
			}
			js.Links = append(js.Links, jailLink{Path: p, Target: target})
		case fi.IsDir():
			js.Binds = append(js.Binds, jailBind{Src: p, Dst: p, Exec: true})
		}
	}
	// After the directories: a binary inside one of them stays visible either way.
	js.Binds = append(js.Binds, jailBind{Src: bin, Dst: qemuPath, Exec: true})
	devices := []string{"/dev/null", "/dev/zero", "/dev/random", "/dev/urandom"}
	if accel == AccelKVM {
		devices = append(devices, "/dev/kvm")
		var st unix.Stat_t
		if err := unix.Stat("/dev/kvm", &st); err != nil {
			return jailSpec{}, fmt.Errorf("/dev/kvm: %w", err)
		}
		if st.Mode&0o006 != 0o006 {
			if st.Mode&0o060 != 0o060 || st.Gid == 0 {
				return jailSpec{}, fmt.Errorf("/dev/kvm (mode %o, gid %d) is open to neither all users nor a group QEMU could join", st.Mode&0o777, st.Gid)
			}
			js.Groups = []int{int(st.Gid)}
		}
	}
	for _, d := range devices {
		js.Binds = append(js.Binds, jailBind{Src: d, Dst: d, Dev: true})
	}
	return js, nil
}

// forVM is the jail of one VM: the base plus its kernel and initramfs, its uid, QEMU's
// command line and environment.
func (js jailSpec) forVM(kernel, initrd string, uid int, args, env []string) jailSpec {
	js.Binds = append(slices.Clone(js.Binds),
		jailBind{Src: kernel, Dst: jailKernel},
		jailBind{Src: initrd, Dst: jailInitrd})
	js.UID, js.GID = uid, uid
	js.Args = append([]string{js.Path}, args...)
	js.Env = env
	return js
}

// worldReadable checks that p's permission bits let every user read it: QEMU's uid is
// neither its owner nor in its group.
func worldReadable(p string) error {
	fi, err := os.Stat(p)
	if err != nil {
		return err
	}
	if fi.Mode().Perm()&0o004 == 0 {
		return fmt.Errorf("%s (mode %o) is not readable by all users; QEMU runs as an unprivileged uid (chmod o+r)", p, fi.Mode().Perm())
	}
	return nil
}

// ensureWorldReadable makes an initramfs of the runtime's cache readable by all users
// (one cached by an older version of this package may not be): QEMU reads it as its own
// uid.
func ensureWorldReadable(p string) error {
	fi, err := os.Stat(p)
	if err != nil {
		return err
	}
	if fi.Mode().Perm()&0o004 != 0 {
		return nil
	}
	if err := os.Chmod(p, fi.Mode().Perm()|0o044); err != nil {
		return fmt.Errorf("make %s readable by QEMU: %w", p, err)
	}
	return nil
}
