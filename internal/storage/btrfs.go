package storage

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"unsafe"

	"golang.org/x/sys/unix"
)

// btrfs ioctl numbers and structs from linux/btrfs.h (uapi). golang.org/x/sys/unix does not
// define them; the values are _IOW/_IOR(0x94, nr, type) spelled out.
const (
	iocSubvolCreateV2 = 0x50009418 // _IOW(0x94, 24, struct btrfs_ioctl_vol_args_v2)
	iocSnapCreateV2   = 0x50009417 // _IOW(0x94, 23, struct btrfs_ioctl_vol_args_v2)
	iocSnapDestroy    = 0x5000940f // _IOW(0x94, 15, struct btrfs_ioctl_vol_args)
	iocSubvolGetFlags = 0x80089419 // _IOR(0x94, 25, __u64)
	iocSubvolSetFlags = 0x4008941a // _IOW(0x94, 26, __u64)

	subvolReadOnly = 1 << 1 // BTRFS_SUBVOL_RDONLY

	// firstFreeObjectID is the inode number of every subvolume's root directory
	// (BTRFS_FIRST_FREE_OBJECTID).
	firstFreeObjectID = 256

	subvolNameMax = 4039 // BTRFS_SUBVOL_NAME_MAX
)

// volArgs is struct btrfs_ioctl_vol_args.
type volArgs struct {
	fd   int64
	name [4088]byte
}

// volArgsV2 is struct btrfs_ioctl_vol_args_v2 (the size/qgroup union is left zero).
type volArgsV2 struct {
	fd      int64
	transid uint64
	flags   uint64
	unused  [4]uint64
	name    [4040]byte
}

// Both structs are 4096 bytes in the kernel ABI; these fail to compile otherwise.
const (
	_ uintptr = 4096 - unsafe.Sizeof(volArgs{})
	_ uintptr = unsafe.Sizeof(volArgs{}) - 4096
	_ uintptr = 4096 - unsafe.Sizeof(volArgsV2{})
	_ uintptr = unsafe.Sizeof(volArgsV2{}) - 4096
)

func ioctl(fd uintptr, req uintptr, arg unsafe.Pointer) error {
	for {
		_, _, errno := unix.Syscall(unix.SYS_IOCTL, fd, req, uintptr(arg))
		switch errno {
		case 0:
			return nil
		case unix.EINTR:
			continue
		default:
			return errno
		}
	}
}

// openDir opens path as a directory without following a final symlink.
func openDir(path string) (*os.File, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &fs.PathError{Op: "open", Path: path, Err: err}
	}
	return os.NewFile(uintptr(fd), path), nil
}

// splitName splits path into its parent directory and a valid subvolume name.
func splitName(path string) (dir, name string, err error) {
	dir, name = filepath.Split(filepath.Clean(path))
	if name == "" || name == "." || name == ".." || len(name) > subvolNameMax {
		return "", "", fmt.Errorf("invalid subvolume path %q", path)
	}
	return dir, name, nil
}

// createSubvolume creates an empty subvolume at path.
func createSubvolume(path string) error {
	dir, name, err := splitName(path)
	if err != nil {
		return err
	}
	parent, err := openDir(dir)
	if err != nil {
		return err
	}
	defer parent.Close()
	var args volArgsV2
	copy(args.name[:], name)
	if err := ioctl(parent.Fd(), iocSubvolCreateV2, unsafe.Pointer(&args)); err != nil {
		return &fs.PathError{Op: "create subvolume", Path: path, Err: err}
	}
	return nil
}

// snapshotSubvolume makes dst a snapshot of the subvolume src, read-only if readOnly.
func snapshotSubvolume(src, dst string, readOnly bool) error {
	dir, name, err := splitName(dst)
	if err != nil {
		return err
	}
	source, err := openDir(src)
	if err != nil {
		return err
	}
	defer source.Close()
	parent, err := openDir(dir)
	if err != nil {
		return err
	}
	defer parent.Close()
	var args volArgsV2
	args.fd = int64(source.Fd())
	if readOnly {
		args.flags = subvolReadOnly
	}
	copy(args.name[:], name)
	if err := ioctl(parent.Fd(), iocSnapCreateV2, unsafe.Pointer(&args)); err != nil {
		return &fs.PathError{Op: "snapshot " + src, Path: dst, Err: err}
	}
	return nil
}

// destroySubvolume deletes the subvolume at path; it fails with ENOTEMPTY when the
// subvolume contains other subvolumes.
func destroySubvolume(path string) error {
	dir, name, err := splitName(path)
	if err != nil {
		return err
	}
	parent, err := openDir(dir)
	if err != nil {
		return err
	}
	defer parent.Close()
	var args volArgs
	copy(args.name[:], name)
	if err := ioctl(parent.Fd(), iocSnapDestroy, unsafe.Pointer(&args)); err != nil {
		return &fs.PathError{Op: "delete subvolume", Path: path, Err: err}
	}
	return nil
}

func subvolumeFlags(f *os.File) (uint64, error) {
	var flags uint64
	if err := ioctl(f.Fd(), iocSubvolGetFlags, unsafe.Pointer(&flags)); err != nil {
		return 0, &fs.PathError{Op: "get subvolume flags", Path: f.Name(), Err: err}
	}
	return flags, nil
}

// isReadOnly reports whether the subvolume at path is read-only.
func isReadOnly(path string) (bool, error) {
	f, err := openDir(path)
	if err != nil {
		return false, err
	}
	defer f.Close()
	flags, err := subvolumeFlags(f)
	return flags&subvolReadOnly != 0, err
}

// setReadOnly sets or clears the read-only flag of the subvolume at path.
func setReadOnly(path string, readOnly bool) error {
	f, err := openDir(path)
	if err != nil {
		return err
	}
	defer f.Close()
	flags, err := subvolumeFlags(f)
	if err != nil {
		return err
	}
	next := flags &^ subvolReadOnly
	if readOnly {
		next |= subvolReadOnly
	}
	if next == flags {
		return nil
	}
	if err := ioctl(f.Fd(), iocSubvolSetFlags, unsafe.Pointer(&next)); err != nil {
		return &fs.PathError{Op: "set subvolume flags", Path: path, Err: err}
	}
	return nil
}

// statIsSubvolume reports whether st describes the root directory of a subvolume.
func statIsSubvolume(st *unix.Stat_t) bool {
	return st.Mode&unix.S_IFMT == unix.S_IFDIR && st.Ino == firstFreeObjectID
}

// isSubvolume reports whether path (not following symlinks) is a subvolume root. Only
// meaningful on btrfs, which the whole store is.
func isSubvolume(path string) (bool, error) {
	var st unix.Stat_t
	if err := unix.Lstat(path, &st); err != nil {
		return false, &fs.PathError{Op: "lstat", Path: path, Err: err}
	}
	return statIsSubvolume(&st), nil
}

// deleteSubvolume deletes the subvolume at path including any subvolumes nested in it
// (which a sandbox user may have created, and may have made read-only). The common case,
// no nesting, is one ioctl; only when the kernel reports ENOTEMPTY is the tree walked.
func deleteSubvolume(ctx context.Context, path string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	err := destroySubvolume(path)
	if !errors.Is(err, unix.ENOTEMPTY) {
		return err
	}
	nested, err := nestedSubvolumes(ctx, path)
	if err != nil {
		return err
	}
	// A read-only parent cannot have entries unlinked from it.
	if err := setReadOnly(path, false); err != nil {
		return err
	}
	for _, n := range nested {
		if err := deleteSubvolume(ctx, n); err != nil {
			return err
		}
	}
	return destroySubvolume(path)
}

// nestedSubvolumes lists the subvolumes directly nested in the subvolume root (not the
// ones nested deeper inside those).
func nestedSubvolumes(ctx context.Context, root string) ([]string, error) {
	var found []string
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if ctxErr := ctx.Err(); ctxErr != nil {
			return ctxErr
		}
		if !d.IsDir() || path == root {
			return nil
		}
		sub, err := isSubvolume(path)
		if err != nil {
			return err
		}
		if sub {
			found = append(found, path)
			return filepath.SkipDir
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("find nested subvolumes: %w", err)
	}
	return found, nil
}

// removeTree removes path and everything below it, deleting subvolumes with the ioctl
// (os.RemoveAll cannot remove a non-empty subvolume). A missing path is not an error.
func removeTree(ctx context.Context, path string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	var st unix.Stat_t
	if err := unix.Lstat(path, &st); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil
		}
		return &fs.PathError{Op: "lstat", Path: path, Err: err}
	}
	if statIsSubvolume(&st) {
		return deleteSubvolume(ctx, path)
	}
	// What vanishes meanwhile is not an error: a background removal (RemoveLater) may
	// run inside a tree that is being removed as a whole.
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		return ignoreGone(os.Remove(path))
	}
	entries, err := os.ReadDir(path)
	if err != nil {
		return ignoreGone(err)
	}
	for _, e := range entries {
		if err := removeTree(ctx, filepath.Join(path, e.Name())); err != nil {
			return err
		}
	}
	return ignoreGone(os.Remove(path))
}

func ignoreGone(err error) error {
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	return err
}
