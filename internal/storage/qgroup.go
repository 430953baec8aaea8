package storage

// btrfs quota group ioctls. Like the subvolume ioctls in btrfs.go they are declared here
// because golang.org/x/sys/unix lacks them; the values are _IOW/_IOR/_IOWR(0x94, nr,
// type) from linux/btrfs.h (uapi) spelled out. The btrfs CLI of the Debian 12 release
// (btrfs-progs 6.2) cannot enable simple quotas at all, and forking it for every sandbox
// would cost more than the ioctls themselves.

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"unsafe"
)

const (
	iocTreeSearch   = 0xd0009411 // _IOWR(0x94, 17, struct btrfs_ioctl_search_args)
	iocInoLookup    = 0xd0009412 // _IOWR(0x94, 18, struct btrfs_ioctl_ino_lookup_args)
	iocFSInfo       = 0x8400941f // _IOR(0x94, 31, struct btrfs_ioctl_fs_info_args)
	iocQuotaCtl     = 0xc0109428 // _IOWR(0x94, 40, struct btrfs_ioctl_quota_ctl_args)
	iocQgroupAssign = 0x40189429 // _IOW(0x94, 41, struct btrfs_ioctl_qgroup_assign_args)
	iocQgroupCreate = 0x4010942a // _IOW(0x94, 42, struct btrfs_ioctl_qgroup_create_args)
	iocQgroupLimit  = 0x8030942b // _IOR(0x94, 43, struct btrfs_ioctl_qgroup_limit_args)

	// quotaCtlEnableSimple is BTRFS_QUOTA_CTL_ENABLE_SIMPLE_QUOTA (Linux 6.7+).
	quotaCtlEnableSimple = 4

	qgroupLimitMaxExcl = 1 << 1 // BTRFS_QGROUP_LIMIT_MAX_EXCL
	// qgroupLimitClear as a limit value removes the limit (CLEAR_VALUE in the kernel).
	qgroupLimitClear = ^uint64(0)

	// qgroupLevelShift places a qgroup's level above its 48-bit id: "1/258" is
	// 1<<48 | 258.
	qgroupLevelShift = 48

	rootTreeObjectID  = 1   // BTRFS_ROOT_TREE_OBJECTID
	quotaTreeObjectID = 8   // BTRFS_QUOTA_TREE_OBJECTID
	rootItemKey       = 132 // BTRFS_ROOT_ITEM_KEY
	qgroupRelationKey = 246 // BTRFS_QGROUP_RELATION_KEY
)

// qgroupID returns the id of qgroup level/id.
func qgroupID(level, id uint64) uint64 { return level<<qgroupLevelShift | id }

// inoLookupArgs is struct btrfs_ioctl_ino_lookup_args.
type inoLookupArgs struct {
	treeID   uint64
	objectID uint64
	name     [4080]byte
}

// fsInfoArgs is struct btrfs_ioctl_fs_info_args (only the fields used here are named).
type fsInfoArgs struct {
	maxID      uint64
	numDevices uint64
	fsid       [16]byte
	rest       [992]byte
}

// searchKey is struct btrfs_ioctl_search_key.
type searchKey struct {
	treeID      uint64
	minObjectID uint64
	maxObjectID uint64
	minOffset   uint64
	maxOffset   uint64
	minTransID  uint64
	maxTransID  uint64
	minType     uint32
	maxType     uint32
	nrItems     uint32
	unused      uint32
	unused1     [4]uint64
}

// searchArgs is struct btrfs_ioctl_search_args.
type searchArgs struct {
	key searchKey
	buf [4096 - 104]byte
}

// searchHeaderSize is sizeof(struct btrfs_ioctl_search_header).
const searchHeaderSize = 32

// The structs must match the kernel ABI's sizes; these fail to compile otherwise.
const (
	_ uintptr = 4096 - unsafe.Sizeof(inoLookupArgs{})
	_ uintptr = unsafe.Sizeof(inoLookupArgs{}) - 4096
	_ uintptr = 1024 - unsafe.Sizeof(fsInfoArgs{})
	_ uintptr = unsafe.Sizeof(fsInfoArgs{}) - 1024
	_ uintptr = 104 - unsafe.Sizeof(searchKey{})
	_ uintptr = unsafe.Sizeof(searchKey{}) - 104
	_ uintptr = 4096 - unsafe.Sizeof(searchArgs{})
	_ uintptr = unsafe.Sizeof(searchArgs{}) - 4096
)

// subvolumeID returns the id of the subvolume that holds the open directory f.
func subvolumeID(f *os.File) (uint64, error) {
	args := inoLookupArgs{objectID: firstFreeObjectID}
	if err := ioctl(f.Fd(), iocInoLookup, unsafe.Pointer(&args)); err != nil {
		return 0, &fs.PathError{Op: "subvolume id", Path: f.Name(), Err: err}
	}
	return args.treeID, nil
}

// subvolumeIDOf returns the id of the subvolume that holds the directory path.
func subvolumeIDOf(path string) (uint64, error) {
	f, err := openDir(path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	return subvolumeID(f)
}

// subvolumeExists reports whether the subvolume with this id exists (f is any directory
// of the file system): whether the root tree holds its root item, which stays until the
// kernel has dropped a deleted subvolume.
func subvolumeExists(f *os.File, id uint64) (bool, error) {
	found := false
	err := treeSearch(f, rootTreeObjectID, id, rootItemKey, func(uint64, uint32) { found = true })
	if err != nil {
		return false, fmt.Errorf("look up subvolume %d: %w", id, err)
	}
	return found, nil
}

// fsUUID returns the file system's UUID in its usual text form, the name of its
// directory under /sys/fs/btrfs.
func fsUUID(f *os.File) (string, error) {
	var args fsInfoArgs
	if err := ioctl(f.Fd(), iocFSInfo, unsafe.Pointer(&args)); err != nil {
		return "", &fs.PathError{Op: "btrfs fs info", Path: f.Name(), Err: err}
	}
	u := args.fsid
	return fmt.Sprintf("%x-%x-%x-%x-%x", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16]), nil
}

// enableSimpleQuotas turns on btrfs simple quotas for the file system of f. Kernels
// without them (before Linux 6.7) fail with EINVAL.
func enableSimpleQuotas(f *os.File) error {
	args := [2]uint64{quotaCtlEnableSimple, 0}
	if err := ioctl(f.Fd(), iocQuotaCtl, unsafe.Pointer(&args)); err != nil {
		return &fs.PathError{Op: "enable simple quotas", Path: f.Name(), Err: err}
	}
	return nil
}

// createQgroup creates qgroup id; destroyQgroup removes it (it must have no members and,
// with simple quotas, no usage).
func createQgroup(f *os.File, id uint64) error {
	args := [2]uint64{1, id}
	if err := ioctl(f.Fd(), iocQgroupCreate, unsafe.Pointer(&args)); err != nil {
		return fmt.Errorf("create qgroup %s: %w", qgroupName(id), err)
	}
	return nil
}

func destroyQgroup(f *os.File, id uint64) error {
	args := [2]uint64{0, id}
	if err := ioctl(f.Fd(), iocQgroupCreate, unsafe.Pointer(&args)); err != nil {
		return fmt.Errorf("remove qgroup %s: %w", qgroupName(id), err)
	}
	return nil
}

// assignQgroup makes qgroup child a member of parent (or, with assign false, no longer
// one).
func assignQgroup(f *os.File, assign bool, child, parent uint64) error {
	args := [3]uint64{0, child, parent}
	if assign {
		args[0] = 1
	}
	if err := ioctl(f.Fd(), iocQgroupAssign, unsafe.Pointer(&args)); err != nil {
		verb := "assign"
		if !assign {
			verb = "unassign"
		}
		return fmt.Errorf("%s qgroup %s to %s: %w", verb, qgroupName(child), qgroupName(parent), err)
	}
	return nil
}

// limitQgroup sets qgroup id's limit on exclusive bytes; qgroupLimitClear removes it.
func limitQgroup(f *os.File, id, maxExcl uint64) error {
	// struct btrfs_ioctl_qgroup_limit_args: qgroupid, then struct btrfs_qgroup_limit
	// {flags, max_rfer, max_excl, rsv_rfer, rsv_excl}.
	args := [6]uint64{id, qgroupLimitMaxExcl, 0, maxExcl, 0, 0}
	if err := ioctl(f.Fd(), iocQgroupLimit, unsafe.Pointer(&args)); err != nil {
		return fmt.Errorf("limit qgroup %s: %w", qgroupName(id), err)
	}
	return nil
}

// qgroupRelations lists the qgroups related to id, from the relation items of the quota
// tree (the live tree, so relations made in the running transaction count): its members
// (lower levels) and its parents (higher levels).
func qgroupRelations(f *os.File, id uint64) (members, parents []uint64, err error) {
	level := id >> qgroupLevelShift
	// Relation items exist in both directions, (child, REL, parent) and (parent, REL,
	// child): the other side's level tells which one this is.
	err = treeSearch(f, quotaTreeObjectID, id, qgroupRelationKey, func(offset uint64, _ uint32) {
		if offset>>qgroupLevelShift < level {
			members = append(members, offset)
		} else {
			parents = append(parents, offset)
		}
	})
	if err != nil {
		return nil, nil, fmt.Errorf("search qgroup relations of %s: %w", qgroupName(id), err)
	}
	return members, parents, nil
}

// treeSearch calls fn with the offset and data length of every item (objectID, typ, *)
// of the given tree.
func treeSearch(f *os.File, tree, objectID uint64, typ uint32, fn func(offset uint64, length uint32)) error {
	args := searchArgs{key: searchKey{
		treeID:      tree,
		minObjectID: objectID,
		maxObjectID: objectID,
		maxOffset:   ^uint64(0),
		maxTransID:  ^uint64(0),
		minType:     typ,
		maxType:     typ,
	}}
	for {
		args.key.nrItems = 4096
		if err := ioctl(f.Fd(), iocTreeSearch, unsafe.Pointer(&args)); err != nil {
			return err
		}
		n := int(args.key.nrItems)
		if n == 0 {
			return nil
		}
		var last uint64
		off := 0
		for i := 0; i < n; i++ {
			if off+searchHeaderSize > len(args.buf) {
				return errors.New("tree search: truncated result")
			}
			h := args.buf[off : off+searchHeaderSize]
			gotObjectID := binary.NativeEndian.Uint64(h[8:])
			offset := binary.NativeEndian.Uint64(h[16:])
			gotType := binary.NativeEndian.Uint32(h[24:])
			length := binary.NativeEndian.Uint32(h[28:])
			off += searchHeaderSize + int(length)
			if gotObjectID == objectID && gotType == typ {
				fn(offset, length)
			}
			last = offset
		}
		if last == ^uint64(0) {
			return nil
		}
		args.key.minOffset = last + 1
	}
}

// qgroupName formats a qgroup id the way btrfs tools do ("1/258").
func qgroupName(id uint64) string {
	return fmt.Sprintf("%d/%d", id>>qgroupLevelShift, id&(1<<qgroupLevelShift-1))
}
