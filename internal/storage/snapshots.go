package storage

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/durable"
)

// Snapshot layout (memory + device state from the runtime, disk from btrfs):
//
//	sandboxes/<id>/checkpoint/                 a suspended sandbox's memory state
//	sandboxes/<id>/clones/<batch>/{checkpoint,disk}  a source's snapshot for a clone batch
//	templates/<hex>/snapshots/<key>/{checkpoint,disk}  a release's base snapshot
//
// A checkpoint directory is complete once it holds the file "complete"; everything in
// it is fsynced before that marker is written, and readers ignore incomplete ones.
// Before that, a checkpoint may be marked "written": its files are whole in the host's
// page cache but not yet on disk. The marker holds the host's boot id, and a written
// checkpoint counts as complete only on the boot that wrote it: a crash of space keeps
// the page cache, a crash of the host does not (docs/lifecycle.md, "Durability").

const (
	checkpointName = "checkpoint"
	completeName   = "complete"
	writtenName    = "written"
	snapshotsName  = "snapshots"
	clonesName     = "clones"
)

// CheckpointDir returns sandboxes/<id>/checkpoint (it may not exist).
func (s *Store) CheckpointDir(id string) (string, error) {
	dir, err := s.SandboxDir(id)
	if err != nil {
		return "", err
	}
	return filepath.Join(dir, checkpointName), nil
}

// CloneBatchDir returns sandboxes/<id>/clones/<batch>.
func (s *Store) CloneBatchDir(id, batch string) (string, error) {
	dir, err := s.SandboxDir(id)
	if err != nil {
		return "", err
	}
	if err := validateName(batch); err != nil {
		return "", err
	}
	return filepath.Join(dir, clonesName, batch), nil
}

// BaseSnapshotDir returns templates/<hex>/snapshots/<key> for a release.
func (s *Store) BaseSnapshotDir(digest, key string) (string, error) {
	dir, err := s.releaseDir(digest)
	if err != nil {
		return "", err
	}
	if err := validateName(key); err != nil {
		return "", err
	}
	return filepath.Join(dir, snapshotsName, key), nil
}

// validateName accepts names made of letters, digits, '.', '_' and '-'.
func validateName(n string) error {
	if n == "" || n == "." || n == ".." || len(n) > 128 || strings.IndexFunc(n, func(r rune) bool {
		return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '.' || r == '_' || r == '-')
	}) >= 0 {
		return fmt.Errorf("storage: invalid name %q", n)
	}
	return nil
}

// MarkComplete fsyncs every file in dir, then writes and fsyncs the completion marker.
func (s *Store) MarkComplete(dir string) error {
	if err := s.Sync(context.Background(), dir); err != nil {
		return err
	}
	m := filepath.Join(dir, completeName)
	if err := os.WriteFile(m, []byte("ok\n"), 0o600); err != nil {
		return fmt.Errorf("storage: %w", err)
	}
	if err := durable.Sync(m); err != nil {
		return err
	}
	return durable.Sync(dir)
}

// syncChunk is how much of a file Sync writes back between looks at its context.
const syncChunk = 32 << 20

// Sync fsyncs every file and directory in dir (dir included). Large files are written
// back a chunk at a time first, so that a cancelled ctx stops it between chunks: a
// checkpoint restored (and removed) meanwhile need not reach the disk at all.
func (s *Store) Sync(ctx context.Context, dir string) error {
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		if d.Type().IsRegular() {
			return syncFile(ctx, p)
		}
		if d.IsDir() {
			return durable.Sync(p)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("storage: sync %s: %w", dir, err)
	}
	return nil
}

// syncFile writes a file back in chunks (sync_file_range), then fsyncs it.
func syncFile(ctx context.Context, path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	for off := int64(0); off+syncChunk < fi.Size(); off += syncChunk {
		if err := ctx.Err(); err != nil {
			return err
		}
		const flags = unix.SYNC_FILE_RANGE_WAIT_BEFORE | unix.SYNC_FILE_RANGE_WRITE | unix.SYNC_FILE_RANGE_WAIT_AFTER
		if err := unix.SyncFileRange(int(f.Fd()), off, syncChunk, flags); err != nil {
			break // the fsync below does it all
		}
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := f.Sync(); err != nil {
		return fmt.Errorf("fsync %s: %w", path, err)
	}
	return nil
}

// MarkWritten marks dir's checkpoint whole but not yet durable: it counts as complete
// until the host reboots (IsComplete), or for good once MarkComplete has run. It costs
// no fsync of the checkpoint's data.
func (s *Store) MarkWritten(dir string) error {
	boot, err := bootID()
	if err != nil {
		return fmt.Errorf("storage: %w", err)
	}
	if err := os.WriteFile(filepath.Join(dir, writtenName), []byte(boot+"\n"), 0o600); err != nil {
		return fmt.Errorf("storage: %w", err)
	}
	return nil
}

// Unmark removes dir's completion markers (durably): the checkpoint in it is no longer
// to be restored (e.g. its sandbox has moved on since), though its files may still be
// copied.
func (s *Store) Unmark(dir string) error {
	for _, name := range []string{completeName, writtenName} {
		if err := os.Remove(filepath.Join(dir, name)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("storage: %w", err)
		}
	}
	return durable.Sync(dir)
}

// IsComplete reports whether dir holds a complete checkpoint: durable, or written
// during this boot of the host.
func (s *Store) IsComplete(dir string) bool {
	if _, err := os.Stat(filepath.Join(dir, completeName)); err == nil {
		return true
	}
	return IsWrittenThisBoot(dir)
}

// IsDurable reports whether dir's checkpoint is complete and on disk (MarkComplete).
func (s *Store) IsDurable(dir string) bool {
	_, err := os.Stat(filepath.Join(dir, completeName))
	return err == nil
}

// IsWrittenThisBoot reports whether dir holds a checkpoint marked written (MarkWritten)
// since the host last booted.
func IsWrittenThisBoot(dir string) bool {
	data, err := os.ReadFile(filepath.Join(dir, writtenName))
	if err != nil {
		return false
	}
	boot, err := bootID()
	return err == nil && strings.TrimSpace(string(data)) == boot
}

// bootID is the kernel's id of the host's current boot.
func bootID() (string, error) {
	data, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return "", err
	}
	id := strings.TrimSpace(string(data))
	if id == "" {
		return "", errors.New("empty boot id")
	}
	return id, nil
}

// CopyDisk makes dst an O(1) copy-on-write copy of the disk at src: a subvolume snapshot
// of a root filesystem directory (readOnly selects the snapshot's flag), or a reflink of
// an image file. Both paths must be inside the store.
func (s *Store) CopyDisk(ctx context.Context, src, dst string, readOnly bool) error {
	sp, err := s.inStore(src)
	if err != nil {
		return err
	}
	dp, err := s.inStore(dst)
	if err != nil {
		return err
	}
	if err := s.makeParent(ctx, dp); err != nil {
		return err
	}
	fi, err := os.Stat(sp)
	if err != nil {
		return fmt.Errorf("storage: %w", err)
	}
	if fi.IsDir() {
		if err := snapshotSubvolume(sp, dp, readOnly); err != nil {
			return fmt.Errorf("storage: %w", err)
		}
		return nil
	}
	if err := cloneFile(sp, dp); err != nil {
		return fmt.Errorf("storage: reflink %s: %w", filepath.Base(sp), err)
	}
	if readOnly {
		return os.Chmod(dp, 0o400)
	}
	return nil
}

// CopyTree copies the directory src to dst (inside the store), reflinking every regular
// file so the copy takes no space until one side changes. A checkpoint's completion
// markers are not copied: they belong to the directory they were written in, and a
// copy is complete only once it is marked itself (so no caller has to remove them,
// durably, before using the copy).
func (s *Store) CopyTree(ctx context.Context, src, dst string) error {
	sp, err := s.inStore(src)
	if err != nil {
		return err
	}
	dp, err := s.inStore(dst)
	if err != nil {
		return err
	}
	if err := s.makeParent(ctx, dp); err != nil {
		return err
	}
	return filepath.WalkDir(sp, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		rel, _ := filepath.Rel(sp, p)
		if rel == completeName || rel == writtenName {
			return nil
		}
		target := filepath.Join(dp, rel)
		info, err := d.Info()
		if err != nil {
			return err
		}
		switch {
		case d.IsDir():
			return os.MkdirAll(target, info.Mode().Perm())
		case d.Type()&fs.ModeSymlink != 0:
			l, err := os.Readlink(p)
			if err != nil {
				return err
			}
			return os.Symlink(l, target)
		case d.Type().IsRegular():
			if err := cloneFile(p, target); err != nil {
				return fmt.Errorf("storage: reflink %s: %w", rel, err)
			}
			return os.Chmod(target, info.Mode().Perm())
		}
		return nil
	})
}

// makeParent creates the parent directories of path (inside the store). Below
// sandboxes/<id>/ the sandbox directory itself is made as a sandbox volume, so that what
// goes there counts toward the sandbox's disk limit.
func (s *Store) makeParent(ctx context.Context, path string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if id := s.sandboxOf(path); id != "" {
		if _, _, err := s.makeSandboxDir(ctx, id); err != nil {
			return err
		}
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return fmt.Errorf("storage: %w", err)
	}
	return nil
}

// TempDir makes a fresh directory under the store's tmp/ (cleaned at start-up when no
// other process uses the store); commit it with os.Rename or remove it with RemoveAll.
func (s *Store) TempDir(prefix string) (string, error) { return s.tmpDirFor(prefix) }

// RemoveAll deletes path (inside the store) and everything in it, subvolumes included.
// A missing path is not an error.
func (s *Store) RemoveAll(ctx context.Context, path string) error { return s.remove(ctx, path, false) }

// RemoveLater is RemoveAll that returns as soon as path is out of the way (one
// rename: nothing finds it at its place any more) and frees its space in the
// background. For what nobody waits to see gone: a checkpoint a wake has restored,
// whose removal (a gigabyte of pages that may still be in write-back) the wake waited
// for.
func (s *Store) RemoveLater(ctx context.Context, path string) error { return s.remove(ctx, path, true) }

func (s *Store) remove(ctx context.Context, path string, later bool) error {
	p, err := s.inStore(path)
	if err != nil {
		return err
	}
	if _, err := os.Lstat(p); errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if later {
		return s.retireLater(ctx, p, "remove")
	}
	return s.retire(ctx, p, "remove")
}

// ExclusiveBytes reports how many bytes sandbox id's disk use comes to. With quotas on
// it is SandboxUsage's UsedBytes (what the sandbox's volume owns, read from the kernel's
// accounting at no cost); otherwise the bytes of its directory not shared with anything
// else, measured by `btrfs filesystem du` (a walk of the whole tree).
func (s *Store) ExclusiveBytes(ctx context.Context, id string) (int64, error) {
	dir, err := s.SandboxDir(id)
	if err != nil {
		return 0, err
	}
	if s.quota.on {
		if u, err := s.SandboxUsage(ctx, id); err == nil {
			return u.UsedBytes, nil
		} else if errors.Is(err, fs.ErrNotExist) {
			return 0, err
		}
	}
	bin, err := lookTool("btrfs")
	if err != nil {
		return 0, err
	}
	out, err := exec.CommandContext(ctx, bin, "filesystem", "du", "-s", "--raw", dir).Output()
	if err != nil {
		return 0, fmt.Errorf("storage: btrfs filesystem du: %w", err)
	}
	// Header "Total   Exclusive  Set shared  Filename", then one line of numbers.
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	f := strings.Fields(lines[len(lines)-1])
	if len(f) < 2 {
		return 0, fmt.Errorf("storage: unexpected btrfs du output %q", out)
	}
	n, err := strconv.ParseInt(f[1], 10, 64)
	if err != nil {
		return 0, fmt.Errorf("storage: unexpected btrfs du output %q", out)
	}
	return n, nil
}
