// Package storage owns space's local btrfs store: the volume itself, template releases
// (read-only subvolumes plus metadata) and the per-sandbox directories that hold each
// sandbox's writable root filesystem.
//
// # Volume
//
// Open uses DataDir/store. If that directory is already on btrfs it is used as is; if
// DataDir is on btrfs, DataDir/store is a plain directory on it; otherwise a sparse image
// file DataDir/store.img is created once, formatted btrfs, and loop-mounted at
// DataDir/store (root only). The store stays mounted when the process exits so running
// sandboxes keep their filesystems across restarts of space; Unmount exists for tests and
// tooling.
//
// # Layout under the store root
//
//	.lock                        flock: shared while a Store is open, exclusive to clean tmp/
//	templates/<hex>/rootfs       a release's root filesystem, read-only subvolume
//	templates/<hex>/release.json release metadata (Release), written before publication
//	sandboxes/<id>/rootfs        a sandbox's writable snapshot of a release rootfs
//	sandboxes/<id>/...           free for other per-sandbox files (runtime state, suspend
//	                             snapshots, disk images); DeleteSandbox removes it all
//	tmp/                         in-progress builds, imports and deletions
//
// <hex> is the hex part of the release digest "sha256:<hex>" (see TreeDigest). A release
// becomes visible with one rename of a complete directory from tmp/ into templates/, and
// disappears with one rename back into tmp/ before it is deleted, so templates/ and
// sandboxes/ only ever hold complete entries. tmp/ is emptied by Open when no other process
// has the store open; leftovers of a crash are thus reclaimed on the next start.
//
// # btrfs operations
//
// Subvolume create, snapshot, delete and the read-only flag use btrfs ioctls directly
// (golang.org/x/sys/unix lacks their definitions, so the argument structs are declared
// here): creating a sandbox root must be O(1) and should not cost a fork and exec of the
// btrfs tool per call, and errno values (ENOTEMPTY, EEXIST) are easier to act on than a
// CLI's messages. Send and receive, whose stream format is large and versioned, use the
// btrfs CLI from btrfs-progs. The loop device is set up with LOOP_CONFIGURE and
// LO_FLAGS_AUTOCLEAR so that unmounting the store also detaches it.
//
// Per-sandbox disk accounting (ExclusiveBytes) is not implemented: it needs btrfs quota
// groups, which slow snapshot deletion markedly; it can be added behind a Config switch.
//
// Errors for missing or already existing objects wrap fs.ErrNotExist and fs.ErrExist.
package storage
