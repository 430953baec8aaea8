package firecracker

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/runtime"
	"github.com/spacedev/space/internal/runtime/instances"
)

// Every file a VM uses sits in its chroot under a fixed name, and the API is given that
// name relative to the chroot (a jailed firecracker's working directory is its root; an
// unjailed one runs with the chroot as working directory). A snapshot therefore bakes in
// only these names, never a host path: restoring it in another chroot (a clone, another
// id) finds that chroot's files.
const (
	kernelName   = "vmlinux"
	initrdName   = "initrd.cpio"
	diskName     = "rootfs.ext4"
	vsockSocket  = "v.sock"
	runDir       = "run"
	apiSocket    = "run/firecracker.socket"
	snapshotDir  = "snapshot"
	vmstateName  = "snapshot/vmstate"
	memoryName   = "snapshot/memory"
	fallbackJail = ".firecracker-jail" // see jailBase
)

// logFile is firecracker's stdout and stderr (its log and the guest's serial console),
// in the StateDir; Destroy removes it.
const logFile = "firecracker.log"

// Limits the jailer puts on each VM's cgroup besides the guest's own size.
const (
	cpuPeriod     = 100000 // µs
	cpuVMMShare   = 25000  // a quarter core for the VMM's device emulation threads
	memOverheadMB = 64     // VMM, page tables, I/O buffers
)

// jailID is firecracker's --id for instance id: the jail's and the cgroup's name. It
// carries the root dir's key, so this runtime never mistakes another's process for one
// of its own (several servers or test runs on one host).
func (r *Runtime) jailID(id string) string { return r.rootKey + "-" + id }

// jailBase picks the chroot base for an instance whose disk is rootfs. The disk is
// hard-linked into the chroot (the guest must write to the node's file, and the jailer
// cannot see bind mounts), and hard links need one filesystem (and, on btrfs, one
// subvolume): when ChrootBaseDir is elsewhere the jail goes next to the disk instead.
func (r *Runtime) jailBase(rootfs string) (string, error) {
	dir := filepath.Dir(rootfs)
	same, err := sameDevice(r.cfg.ChrootBaseDir, dir)
	if err != nil {
		return "", err
	}
	if same {
		return r.cfg.ChrootBaseDir, nil
	}
	r.fallbackOnce.Do(func() {
		r.log.Info("sandbox disks are not on the chroot base's filesystem: jails go next to the disks",
			"chroot_base", r.cfg.ChrootBaseDir, "disk_dir", dir)
	})
	return filepath.Join(dir, fallbackJail), nil
}

func sameDevice(a, b string) (bool, error) {
	var sa, sb unix.Stat_t
	if err := unix.Stat(a, &sa); err != nil {
		return false, fmt.Errorf("stat %s: %w", a, err)
	}
	if err := unix.Stat(b, &sb); err != nil {
		return false, fmt.Errorf("stat %s: %w", b, err)
	}
	return sa.Dev == sb.Dev, nil
}

// newRecord lays out where everything of a new instance goes (nothing is created yet).
func (r *Runtime) newRecord(spec specFiles, m machine) (record, error) {
	base, err := r.jailBase(spec.RootFS)
	if err != nil {
		return record{}, err
	}
	jid := r.jailID(spec.ID)
	rec := record{
		ID: spec.ID, JailID: jid, StateDir: spec.StateDir, RootFS: spec.RootFS,
		JailDir: filepath.Join(base, r.execName, jid), Jailed: r.jailed, Machine: m,
		CreatedAt: time.Now().UTC(),
	}
	if r.jailed {
		rec.Cgroup = filepath.Join(r.cgroupRoot, r.cfg.ParentCgroup, jid)
	}
	return rec, nil
}

// specFiles is what newRecord needs of a spec.
type specFiles struct{ ID, RootFS, StateDir string }

// prepareJail creates the chroot with the kernel and the initramfs (unless initrd is
// empty) and the disk under their fixed names, plus the directories firecracker writes
// to (owned by the jailer user).
func (r *Runtime) prepareJail(rec record, initrd string) error {
	// A jail without a record is a leftover of this id (the record is claimed first).
	if err := removeJail(rec); err != nil {
		return err
	}
	chroot := rec.chroot()
	if err := os.MkdirAll(chroot, 0o700); err != nil {
		return fmt.Errorf("create jail: %w", err)
	}
	if initrd != "" { // a restore needs no kernel: it is in the snapshot's memory
		if err := placeFile(r.kernel, filepath.Join(chroot, kernelName)); err != nil {
			return fmt.Errorf("kernel into jail: %w", err)
		}
		if err := placeFile(initrd, filepath.Join(chroot, initrdName)); err != nil {
			return fmt.Errorf("initramfs into jail: %w", err)
		}
	}
	disk := filepath.Join(chroot, diskName)
	if err := os.Link(rec.RootFS, disk); err != nil {
		return fmt.Errorf("disk into jail (a hard link, so the guest writes the sandbox's disk): %w", err)
	}
	for _, d := range []string{runDir, snapshotDir} {
		if err := os.Mkdir(filepath.Join(chroot, d), 0o700); err != nil {
			return fmt.Errorf("create jail: %w", err)
		}
	}
	if r.jailed {
		for _, p := range []string{diskName, runDir, snapshotDir} {
			if err := os.Lchown(filepath.Join(chroot, p), r.cfg.UID, r.cfg.GID); err != nil {
				return fmt.Errorf("give %s to the jailer user: %w", p, err)
			}
		}
	}
	return nil
}

// removeJail removes the instance's jail directory tree. The record names it; it is
// checked to be a jail of this instance before anything is removed.
func removeJail(rec record) error {
	if rec.JailDir == "" {
		return nil
	}
	if filepath.Base(rec.JailDir) != rec.JailID || rec.JailID == "" || !filepath.IsAbs(rec.JailDir) {
		return fmt.Errorf("record names jail %q, not one of %s", rec.JailDir, rec.JailID)
	}
	// RemoveAll unlinks symlinks and hard links (the disk, checkpoint files) without
	// following them; nothing is mounted in a jail outside firecracker's own namespace.
	if err := os.RemoveAll(rec.JailDir); err != nil {
		return fmt.Errorf("remove jail: %w", err)
	}
	// A jail next to the disk leaves no empty directories in the node's storage.
	if base := filepath.Dir(filepath.Dir(rec.JailDir)); filepath.Base(base) == fallbackJail {
		_ = os.Remove(filepath.Dir(rec.JailDir))
		_ = os.Remove(base)
	}
	return nil
}

// placeFile puts src at dst for reading: a hard link, else a reflink, else a copy.
func placeFile(src, dst string) error {
	err := os.Link(src, dst)
	if err == nil {
		return nil
	}
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return err
	}
	if unix.IoctlFileClone(int(out.Fd()), int(in.Fd())) == nil {
		return out.Close()
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		os.Remove(dst)
		return err
	}
	return out.Close()
}

// jailerArgs is the jailer's command line for an instance.
func (r *Runtime) jailerArgs(rec record, netns string) []string {
	base := filepath.Dir(filepath.Dir(rec.JailDir))
	m := rec.Machine
	args := []string{
		"--id", rec.JailID,
		"--exec-file", r.cfg.FirecrackerPath,
		"--uid", strconv.Itoa(r.cfg.UID),
		"--gid", strconv.Itoa(r.cfg.GID),
		"--chroot-base-dir", base,
		"--cgroup-version", "2",
		"--parent-cgroup", r.cfg.ParentCgroup,
		"--cgroup", fmt.Sprintf("cpu.max=%d %d", m.CPU*cpuPeriod+cpuVMMShare, cpuPeriod),
		"--cgroup", fmt.Sprintf("memory.max=%d", int64(m.MemoryMB+memOverheadMB)<<20),
	}
	if netns != "" {
		args = append(args, "--netns", netns)
	}
	return append(args, "--", "--api-sock", "/"+apiSocket)
}

// Timeouts of process operations.
const (
	startTimeout = 15 * time.Second // process start until the API socket answers
	killTimeout  = 10 * time.Second
)

// start runs firecracker for the instance (through the jailer unless disabled) in its
// own session, so that it outlives the node process, with stdout and stderr to the log
// file in the StateDir, and waits until its API socket accepts connections. Without a
// namespace from the node it gets a new, empty network namespace: no network at all.
func (r *Runtime) start(ctx context.Context, rec record, netns string) (pid int, startTime uint64, err error) {
	logPath := filepath.Join(rec.StateDir, logFile)
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return 0, 0, fmt.Errorf("open log: %w", err)
	}
	defer logf.Close()
	var cmd *exec.Cmd
	// Not CommandContext: the VM must outlive ctx and the node process.
	if rec.Jailed {
		cmd = exec.Command(r.cfg.JailerPath, r.jailerArgs(rec, netns)...)
		cmd.Dir = "/"
	} else {
		cmd = exec.Command(r.cfg.FirecrackerPath, "--api-sock", apiSocket, "--id", rec.JailID)
		cmd.Dir = rec.chroot()
	}
	cmd.Env = []string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin"}
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if netns == "" && os.Geteuid() == 0 {
		cmd.SysProcAttr.Unshareflags = syscall.CLONE_NEWNET
	}
	r.log.DebugContext(ctx, "starting firecracker", "id", rec.ID, "args", cmd.Args)
	if err := cmd.Start(); err != nil {
		return 0, 0, fmt.Errorf("start %s: %w", cmd.Path, err)
	}
	pid = cmd.Process.Pid
	exited := make(chan struct{})
	go func() {
		// Reap the process whenever it exits while this process lives; after a node
		// restart init (or a subreaper) does.
		_ = cmd.Wait()
		close(exited)
	}()
	pi, err := instances.ReadProc(pid)
	if err != nil {
		<-exited
		return 0, 0, fmt.Errorf("firecracker exited at once: %s", runtime.LogTail(logPath, 2048))
	}
	sctx, cancel := context.WithTimeout(ctx, startTimeout)
	defer cancel()
	if err := waitSocket(sctx, filepath.Join(rec.chroot(), apiSocket), exited); err != nil {
		return pid, pi.StartTime, fmt.Errorf("%w: %s", err, runtime.LogTail(logPath, 2048))
	}
	return pid, pi.StartTime, nil
}

// waitSocket polls until the unix socket at path accepts a connection, the process
// exits or ctx ends.
func waitSocket(ctx context.Context, path string, exited <-chan struct{}) error {
	t := time.NewTicker(2 * time.Millisecond)
	defer t.Stop()
	for {
		c, err := dialUnix(ctx, path)
		if err == nil {
			return c.Close()
		}
		select {
		case <-exited:
			return errors.New("firecracker exited during start")
		case <-ctx.Done():
			return fmt.Errorf("firecracker API socket did not come up: %w (last error: %v)", ctx.Err(), err)
		case <-t.C:
		}
	}
}

// removeCgroup removes the instance's cgroup once its processes are gone (rmdir: a
// cgroup's control files cannot and need not be removed).
func removeCgroup(ctx context.Context, dir string) error {
	if dir == "" {
		return nil
	}
	t := time.NewTicker(5 * time.Millisecond)
	defer t.Stop()
	for {
		err := unix.Rmdir(dir)
		if err == nil || errors.Is(err, unix.ENOENT) {
			return nil
		}
		if !errors.Is(err, unix.EBUSY) {
			return fmt.Errorf("remove cgroup %s: %w", dir, err)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("remove cgroup %s: still in use: %w", dir, ctx.Err())
		case <-t.C:
		}
	}
}
