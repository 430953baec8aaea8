package gvisor

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"

	"golang.org/x/sys/unix"
)

// Host mounts of an instance. Everything the sandbox can write on the host is bounded:
//
//	<StateDir>/run  tmpfs of runTmpfsSize: the agent's run directory (its socket, the
//	                quiesce marker, the resume file), bind-mounted at wire.RunMountDir
//	<StateDir>/log  tmpfs of logTmpfsSize: runsc.log, the stdio of `runsc run` and of
//	                the agent (see logs.go)
//
// and, with the user namespace on (Config.UIDBase), id-mapped views of what the sandbox
// reaches through the gofer, under <RootDir>/mnt/<id>/:
//
//	rootfs  Spec.RootFS
//	run     <StateDir>/run
//
// An id-mapped mount shows a file owned by uid N on disk as owned by UIDBase+N, and
// stores a file created by UIDBase+N as uid N: the sandbox's processes run as host uids
// UIDBase… (its root is UIDBase), while the disk keeps ordinary ownership, so templates,
// snapshots and the node's own files need no chown and sandbox creation stays O(1).
// Every mount is nosuid and nodev; the run and log mounts are also noexec (the rootfs
// cannot be: gVisor maps the sandbox's programs from it).
const (
	runDir       = "run" // in the StateDir and in the mount dir
	logDir       = "log" // in the StateDir
	rootfsMount  = "rootfs"
	mountsDir    = "mnt" // under RootDir
	runTmpfsSize = 1 << 20
	logTmpfsSize = 4 << 20
	// tmpfsInodes bounds the files of the run and log tmpfs (the agent needs a handful).
	tmpfsInodes = 64
)

// UserNSSize is the number of ids the sandboxes' user namespace maps: 0…65535, which
// covers root and nobody (65534).
const UserNSSize = 1 << 16

// mountDir is the directory of an instance's id-mapped views. It must be searchable by
// the sandbox's host uid: the gofer opens the rootfs through this path.
func (r *Runtime) mountDir(id string) string {
	return filepath.Join(r.cfg.RootDir, mountsDir, id)
}

// mountTmpfs mounts a size-capped tmpfs on dir, which must exist.
func mountTmpfs(dir string, size int64) error {
	opts := fmt.Sprintf("size=%d,nr_inodes=%d,mode=0700", size, tmpfsInodes)
	if err := unix.Mount("space-sandbox", dir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, opts); err != nil {
		return fmt.Errorf("mount tmpfs on %s: %w", dir, err)
	}
	return nil
}

// idmapBind mounts an id-mapped view of src on dst (an existing directory): ids are
// shifted by the mapping of the user namespace userns. The view is not recursive: a
// mount below src stays hidden.
func idmapBind(src, dst string, userns *os.File, noexec bool) error {
	tree, err := unix.OpenTree(unix.AT_FDCWD, src, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
	if err != nil {
		return fmt.Errorf("open_tree %s: %w", src, err)
	}
	defer unix.Close(tree)
	attr := unix.MountAttr{
		Attr_set:  unix.MOUNT_ATTR_IDMAP | unix.MOUNT_ATTR_NOSUID | unix.MOUNT_ATTR_NODEV,
		Userns_fd: uint64(userns.Fd()),
	}
	if noexec {
		attr.Attr_set |= unix.MOUNT_ATTR_NOEXEC
	}
	if err := unix.MountSetattr(tree, "", unix.AT_EMPTY_PATH, &attr); err != nil {
		return fmt.Errorf("id-map %s (the file system must support id-mapped mounts: btrfs, ext4, xfs; tmpfs from Linux 6.3): %w", src, err)
	}
	if err := unix.MoveMount(tree, "", unix.AT_FDCWD, dst, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return fmt.Errorf("mount id-mapped %s on %s: %w", src, dst, err)
	}
	return nil
}

// unmountAll unmounts whatever is mounted on dir (several stacked mounts, too) and
// removes dir. A missing dir is fine.
func unmountAll(dir string) error {
	for range 16 {
		err := unix.Unmount(dir, unix.UMOUNT_NOFOLLOW)
		if errors.Is(err, unix.EBUSY) {
			// Nothing of the sandbox is left (Destroy waited for its processes); a
			// reader of the node still in it must not keep the mount forever.
			err = unix.Unmount(dir, unix.MNT_DETACH|unix.UMOUNT_NOFOLLOW)
		}
		if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOENT) {
			break // not a mount point (any more)
		}
		if err != nil {
			return fmt.Errorf("unmount %s: %w", dir, err)
		}
	}
	if err := os.RemoveAll(dir); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}

// newUserNS makes the user namespace whose mapping the id-mapped views use (host ids
// base…base+UserNSSize-1 as 0…UserNSSize-1) and returns a descriptor of it. A user
// namespace needs a process to be created; this one is a child stopped before it runs
// anything (PTRACE_TRACEME makes its exec stop), killed once the namespace is open.
func newUserNS(base uint32) (*os.File, error) {
	m := []syscall.SysProcIDMap{{ContainerID: 0, HostID: int(base), Size: UserNSSize}}
	cmd := exec.Command("/proc/self/exe")
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags:  syscall.CLONE_NEWUSER,
		UidMappings: m,
		GidMappings: m,
		Ptrace:      true,
		Pdeathsig:   syscall.SIGKILL,
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start user namespace holder: %w", err)
	}
	defer func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	}()
	ns, err := os.Open(fmt.Sprintf("/proc/%d/ns/user", cmd.Process.Pid))
	if err != nil {
		return nil, fmt.Errorf("open user namespace: %w", err)
	}
	return ns, nil
}

// searchable checks that the host uid can reach dir: every directory from / down to it
// must let others search it (the sandbox's uid owns none of them), or be owned by uid.
func searchable(dir string, uid uint32) error {
	for d := filepath.Clean(dir); ; d = filepath.Dir(d) {
		fi, err := os.Stat(d)
		if err != nil {
			return err
		}
		st, ok := fi.Sys().(*syscall.Stat_t)
		if !ok {
			return fmt.Errorf("stat %s: no owner", d)
		}
		if fi.Mode().Perm()&0o001 == 0 && st.Uid != uid {
			return fmt.Errorf("%s (mode %v) is not searchable by others: the sandboxes' host uid %d must reach %s (chmod o+x it, or run without the user namespace)", d, fi.Mode().Perm(), uid, dir)
		}
		if d == "/" {
			return nil
		}
	}
}
