package node

import (
	"context"
	"errors"
	"io/fs"
	"os"

	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/store"

	"github.com/spacedev/space/internal/runtime"
	"github.com/spacedev/space/internal/storage"
)

// Disk is what the node needs of its local store (implemented by *storage.Store, the
// btrfs store): template releases, sandbox disks, checkpoints and the directories of
// base snapshots and clone batches.
type Disk interface {
	HasRelease(digest string) bool
	Release(digest string) (storage.Release, error)
	ListReleases() ([]storage.Release, error)
	DeleteRelease(ctx context.Context, digest string) error

	SandboxDir(id string) (string, error)
	SandboxRoot(id string) (string, error)
	SandboxDisk(id string) (string, error)
	CreateSandboxRoot(ctx context.Context, id, digest string) (string, error)
	CreateSandboxDisk(ctx context.Context, id, digest string, size int64) (string, error)
	DeleteSandbox(ctx context.Context, id string) error
	ListSandboxes() ([]string, error)
	ExclusiveBytes(ctx context.Context, id string) (int64, error)

	CheckpointDir(id string) (string, error)
	CloneBatchDir(id, batch string) (string, error)
	BaseSnapshotDir(digest, key string) (string, error)
	TempDir(prefix string) (string, error)
	// SnapshotDir and ListSnapshotDirs locate named snapshots (snapshots/<id>).
	SnapshotDir(id string) (string, error)
	ListSnapshotDirs() ([]string, error)
	// MarkComplete makes a checkpoint durable (fsync) and marks it complete; MarkWritten
	// marks it complete for this boot of the host only (no fsync), Sync fsyncs it
	// without marking it. IsComplete accepts both, IsDurable only the first.
	MarkComplete(dir string) error
	MarkWritten(dir string) error
	Sync(ctx context.Context, dir string) error
	Unmark(dir string) error
	IsComplete(dir string) bool
	IsDurable(dir string) bool
	CopyDisk(ctx context.Context, src, dst string, readOnly bool) error
	// CopyTree copies a directory without its completion markers.
	CopyTree(ctx context.Context, src, dst string) error
	RemoveAll(ctx context.Context, path string) error
	// RemoveLater moves path out of the way now and removes it in the background.
	RemoveLater(ctx context.Context, path string) error

	// SetSandboxLimit bounds what a sandbox may write (its disk and snapshots); a
	// fault.Unavailable error means the store enforces no limits (docs/operations.md).
	SetSandboxLimit(ctx context.Context, id string, bytes int64) error
	// SetRootfsLimit bounds what a sandbox may write to its root filesystem (its
	// disk_mb); fs.ErrNotExist for sandboxes on a disk image.
	SetRootfsLimit(ctx context.Context, id string, bytes int64) error
	// CheckSpace fails with fault.InsufficientStorage when need bytes more would take
	// the store's free space below the operator's reserve.
	CheckSpace(need int64) error
}

var _ Disk = (*storage.Store)(nil)

// Disks: a root filesystem directory (gVisor) or an ext4 image (VM runtimes).

func (n *Node) diskPath(id string) (string, error) {
	if n.info.Disk == runtime.DiskExt4 {
		return n.disk.SandboxDisk(id)
	}
	return n.disk.SandboxRoot(id)
}

// hasDisk reports whether the sandbox's disk exists.
func (n *Node) hasDisk(id string) bool {
	p, err := n.diskPath(id)
	if err != nil {
		return false
	}
	_, err = os.Stat(p)
	return err == nil
}

func (n *Node) createDisk(ctx context.Context, id, digest string) (string, error) {
	if n.info.Disk == runtime.DiskExt4 {
		return n.disk.CreateSandboxDisk(ctx, id, digest, 0)
	}
	return n.disk.CreateSandboxRoot(ctx, id, digest)
}

// limitDisk bounds what a sandbox may write: its root filesystem to its disk limit
// (disk_mb; on VM runtimes the disk image's size does that), and its whole volume to the
// disk limit plus room for a suspend snapshot of its memory (checkpointRoom) plus a
// margin for the runtime's own files. Stores without quotas enforce nothing (logged once).
func (n *Node) limitDisk(ctx context.Context, sb *store.Sandbox) error {
	if sb.Spec.DiskMB <= 0 {
		return nil
	}
	bytes := int64(sb.Spec.DiskMB)<<20 + n.checkpointRoom(sb) + diskMarginMB<<20
	err := n.disk.SetSandboxLimit(ctx, sb.ID, bytes)
	if err == nil {
		// The sandbox's own writes stop at disk_mb; the volume's limit above leaves room
		// for its checkpoints.
		if err = n.disk.SetRootfsLimit(ctx, sb.ID, int64(sb.Spec.DiskMB)<<20); errors.Is(err, fs.ErrNotExist) {
			err = nil
		}
	}
	if fault.Is(err, fault.Unavailable) {
		n.quotaOnce.Do(func() { n.log.Warn("sandbox disk limits are not enforced by this store", "why", err) })
		return nil
	}
	return err
}

// checkpointRoom is the room a checkpoint of the sandbox's memory may take: its memory
// size, or the runtime's bound when its instances may hold more (runtime.MemoryBounder).
func (n *Node) checkpointRoom(sb *store.Sandbox) int64 {
	room := int64(sb.Spec.MemoryMB) << 20
	if b, ok := n.rt.(runtime.MemoryBounder); ok {
		room = max(room, b.MemoryBound(n.spec(sb, "", nil)))
	}
	return room
}

// diskMarginMB is what the runtime may write beside the sandbox's own data.
const diskMarginMB = 64

// createDiskFrom makes sandbox id's disk an O(1) copy of src (a snapshot's disk).
func (n *Node) createDiskFrom(ctx context.Context, id, src string) (string, error) {
	dst, err := n.diskPath(id)
	if err != nil {
		return "", err
	}
	if err := n.disk.CopyDisk(ctx, src, dst, false); err != nil {
		return "", err
	}
	return dst, nil
}
