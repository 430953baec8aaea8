package storage

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// isBtrfs reports whether path lies on a btrfs filesystem.
func isBtrfs(path string) (bool, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return false, fmt.Errorf("statfs %s: %w", path, err)
	}
	return st.Type == unix.BTRFS_SUPER_MAGIC, nil
}

// isMountPoint reports whether dir is the root of a mount (its device differs from its
// parent's). A btrfs subvolume also has its own device number, so callers check this only
// for directories that cannot be subvolumes.
func isMountPoint(dir string) (bool, error) {
	var st, parent unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		return false, fmt.Errorf("stat %s: %w", dir, err)
	}
	if err := unix.Stat(filepath.Dir(dir), &parent); err != nil {
		return false, fmt.Errorf("stat %s: %w", filepath.Dir(dir), err)
	}
	return st.Dev != parent.Dev, nil
}

// lookTool finds a btrfs-progs binary. /usr/sbin and /sbin are searched too because a
// non-root PATH often lacks them.
func lookTool(name string) (string, error) {
	if p, err := exec.LookPath(name); err == nil {
		return p, nil
	}
	for _, dir := range []string{"/usr/sbin", "/sbin"} {
		p := filepath.Join(dir, name)
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
	}
	return "", fmt.Errorf("storage: %s not found: install the Debian package btrfs-progs", name)
}

// runTool runs a short command and folds its output into the error.
func runTool(ctx context.Context, name string, args ...string) error {
	path, err := lookTool(name)
	if err != nil {
		return err
	}
	var out bytes.Buffer
	cmd := exec.CommandContext(ctx, path, args...)
	cmd.Stdout = &out
	cmd.Stderr = &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("%s: %w: %s", name, err, bytes.TrimSpace(out.Bytes()))
	}
	return nil
}

// makeImage creates a sparse file of size bytes at path and formats it btrfs. It fails if
// path exists, and removes the file again on failure.
func makeImage(ctx context.Context, path string, size int64) (err error) {
	if _, err := lookTool("mkfs.btrfs"); err != nil {
		return err
	}
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("create image: %w", err)
	}
	defer func() {
		if err != nil {
			os.Remove(path)
		}
	}()
	if err := f.Truncate(size); err != nil {
		f.Close()
		return fmt.Errorf("size image: %w", err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("create image: %w", err)
	}
	if err := runTool(ctx, "mkfs.btrfs", "-q", "-L", "space", path); err != nil {
		return fmt.Errorf("format image: %w", err)
	}
	return nil
}

// storeMountFlags are the flags the store is mounted with: nothing a sandbox writes
// becomes a setuid program or a device node on the host. noexec is not among them: gVisor
// maps sandbox binaries from the host file executable, and Firecracker's jailer runs its
// binary from a jail that may live in the store (see docs/security.md).
const storeMountFlags = unix.MS_NOSUID | unix.MS_NODEV

// mountImage attaches image to a free loop device with LO_FLAGS_AUTOCLEAR and mounts it
// at dir with flags. Autoclear makes the kernel detach the device once the filesystem is unmounted
// and our descriptor closed, so neither a failed mount nor a later Unmount leaves a loop
// device behind. Hand-rolled rather than calling mount(8) so that the undo is exact and
// no helper process is involved; it is the same LOOP_CTL_GET_FREE + LOOP_CONFIGURE
// sequence losetup uses.
func mountImage(image, dir string, flags uintptr) error {
	ctl, err := os.OpenFile("/dev/loop-control", os.O_RDWR, 0)
	if err != nil {
		return fmt.Errorf("open loop control: %w", err)
	}
	defer ctl.Close()
	backing, err := os.OpenFile(image, os.O_RDWR, 0)
	if err != nil {
		return fmt.Errorf("open image: %w", err)
	}
	defer backing.Close()

	// Another process can claim the device between GET_FREE and CONFIGURE (EBUSY); try a
	// few more.
	for attempt := 0; ; attempt++ {
		n, err := unix.IoctlRetInt(int(ctl.Fd()), unix.LOOP_CTL_GET_FREE)
		if err != nil {
			return fmt.Errorf("find free loop device: %w", err)
		}
		dev := fmt.Sprintf("/dev/loop%d", n)
		loop, err := os.OpenFile(dev, os.O_RDWR, 0)
		if err != nil {
			return fmt.Errorf("open %s: %w", dev, err)
		}
		cfg := unix.LoopConfig{Fd: uint32(backing.Fd())}
		cfg.Info.Flags = unix.LO_FLAGS_AUTOCLEAR
		copy(cfg.Info.File_name[:len(cfg.Info.File_name)-1], image)
		err = unix.IoctlLoopConfigure(int(loop.Fd()), &cfg)
		if errors.Is(err, unix.EBUSY) && attempt < 8 {
			loop.Close()
			continue
		}
		if err != nil {
			loop.Close()
			return fmt.Errorf("attach %s to %s: %w", image, dev, err)
		}
		err = unix.Mount(dev, dir, "btrfs", flags, "")
		// Closing drops our reference: the mount now holds the device, or, if the mount
		// failed, autoclear detaches it here.
		loop.Close()
		if err != nil {
			if errors.Is(err, unix.ENODEV) {
				return fmt.Errorf("mount %s: kernel has no btrfs support: %w", dir, err)
			}
			return fmt.Errorf("mount %s on %s: %w", dev, dir, err)
		}
		return nil
	}
}

// isMountRoot reports whether dir is the root of a mount (not merely a btrfs subvolume,
// which has a device number of its own too).
func isMountRoot(dir string) (bool, error) {
	var stx unix.Statx_t
	if err := unix.Statx(unix.AT_FDCWD, dir, unix.AT_SYMLINK_NOFOLLOW|unix.AT_STATX_DONT_SYNC, unix.STATX_TYPE, &stx); err != nil {
		return false, fmt.Errorf("statx %s: %w", dir, err)
	}
	if stx.Attributes_mask&unix.STATX_ATTR_MOUNT_ROOT == 0 { // before Linux 5.8
		return isMountPoint(dir)
	}
	return stx.Attributes&unix.STATX_ATTR_MOUNT_ROOT != 0, nil
}

// secureMount makes the store's mount nosuid,nodev: a mount made by an older version is
// changed in place; a store directory on the operator's btrfs is first bind-mounted onto
// itself so that it has mount flags of its own (the bind mount, like the loop mount, stays
// when the process exits). Without root it only warns: then what sandboxes write belongs
// to this user and can give no one more privilege than this user has.
func (s *Store) secureMount(ctx context.Context, undo *[]func()) error {
	if os.Geteuid() != 0 {
		s.log.WarnContext(ctx, "storage: not root: the store is not mounted nosuid,nodev", "root", s.root, "uid", os.Geteuid())
		return nil
	}
	mounted, err := isMountRoot(s.root)
	if err != nil {
		return err
	}
	if !mounted {
		if err := unix.Mount(s.root, s.root, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("bind-mount %s onto itself: %w", s.root, err)
		}
		*undo = append(*undo, func() { unix.Unmount(s.root, unix.MNT_DETACH) })
		s.log.InfoContext(ctx, "storage: bind-mounted the store onto itself", "root", s.root)
	}
	return setMountFlags(s.root)
}

// setMountFlags adds nosuid and nodev to the flags of the mount at dir, leaving its other
// flags as they are.
func setMountFlags(dir string) error {
	attr := unix.MountAttr{Attr_set: unix.MOUNT_ATTR_NOSUID | unix.MOUNT_ATTR_NODEV}
	err := unix.MountSetattr(unix.AT_FDCWD, dir, 0, &attr)
	if err == nil {
		return nil
	}
	if !errors.Is(err, unix.ENOSYS) {
		return fmt.Errorf("set nosuid,nodev on %s: %w", dir, err)
	}
	// Before Linux 5.12: a bind remount sets every per-mount flag at once, so the current
	// ones are carried over.
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return fmt.Errorf("statfs %s: %w", dir, err)
	}
	flags := uintptr(unix.MS_REMOUNT | unix.MS_BIND | storeMountFlags)
	for stFlag, msFlag := range map[int64]uintptr{
		unix.ST_RDONLY: unix.MS_RDONLY, unix.ST_NOEXEC: unix.MS_NOEXEC, unix.ST_NOATIME: unix.MS_NOATIME,
		unix.ST_NODIRATIME: unix.MS_NODIRATIME, unix.ST_RELATIME: unix.MS_RELATIME,
	} {
		if st.Flags&stFlag != 0 {
			flags |= msFlag
		}
	}
	if err := unix.Mount("", dir, "", flags, ""); err != nil {
		return fmt.Errorf("remount %s nosuid,nodev: %w", dir, err)
	}
	return nil
}
