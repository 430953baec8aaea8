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
// Root in a sandbox writes as host root, so the store is mounted nosuid,nodev (a store
// directory on the operator's btrfs is bind-mounted onto itself for that) and its
// directories are mode 0700: no file a sandbox writes is a setuid program or a device
// node any host user can use. Open also brings stores made by older versions up to
// date. See docs/security.md, "Storage".
//
// # Layout under the store root
//
//	.lock                        flock: shared while a Store is open, exclusive to clean tmp/
//	templates/<hex>/rootfs       a release's root filesystem, read-only subvolume
//	templates/<hex>/release.json release metadata (Release), written before publication
//	sandboxes/<id>               the sandbox volume: a subvolume in its own quota group
//	sandboxes/<id>/rootfs        a sandbox's writable snapshot of a release rootfs
//	sandboxes/<id>/...           free for other per-sandbox files (runtime state, suspend
//	                             snapshots, disk images); DeleteSandbox removes it all
//	sandboxes/<id>/.trash/       what is being removed from inside the volume
//	snapshots/<id>/              a named snapshot (checkpoint/, disk, snapshot.json), outside
//	                             every sandbox volume (named.go)
//	tmp/                         in-progress builds, imports and deletions
//	.qgroups/<V>                 marks quota group 1/V as one of this store's
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
// # Disk limits and reserve
//
// With btrfs simple quotas (Linux 6.7+; Open enables them), every extent counts toward
// the subvolume that wrote it, and subvolumes made inside a sandbox volume V join its
// group 1/V. SetSandboxLimit limits 1/V: the sandbox's writes to its root filesystem or
// disk image, its checkpoints and clone batches, but not what it shares with its release.
// SandboxUsage reports use and limit. CheckSpace refuses requests that would take a file
// system under the store below Config.DiskReserve. Details and measurements are in
// docs/architecture.md, "Storage".
//
// Errors for missing or already existing objects wrap fs.ErrNotExist and fs.ErrExist.
package storage
