package storage

// Disk images for VM runtimes.
//
//	templates/<hex>/disk.ext4    a release's root filesystem as an ext4 image, built once
//	                             from templates/<hex>/rootfs (read-only, sparse)
//	templates/<hex>/.disk.lock   flock serializing that build across goroutines and
//	                             processes
//	sandboxes/<id>/disk.ext4     a sandbox's writable disk: a reflink (FICLONE) of the
//	                             release image, O(1) in time and space
//
// The release image is built in tmp/ and published with one rename, so disk.ext4 is
// either absent or complete. DeleteRelease and DeleteSandbox remove these files with
// their directories.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/durable"
)

// DefaultDiskSize is the apparent size of a release's ext4 image when the caller does
// not ask for one. The image is sparse: it only takes the space its contents use.
const DefaultDiskSize int64 = 4 << 30

const (
	diskName     = "disk.ext4"
	diskLockName = ".disk.lock"
	// diskLockPoll is how often a caller waiting for another caller's image build
	// retries the lock (flock cannot wait on a context).
	diskLockPoll = 20 * time.Millisecond
)

// ReleaseImage returns the path of the ext4 image of the release's root filesystem,
// building it on first use (mkfs.ext4 -d, no mount and no root privileges needed). size
// is the image's apparent size when it is built (0 means DefaultDiskSize); an image built
// earlier is returned whatever its size. Concurrent callers, in this process or others,
// wait for a single build. The image must not be written to: sandboxes get reflinks of
// it (CreateSandboxDisk).
func (s *Store) ReleaseImage(ctx context.Context, digest string, size int64) (string, error) {
	if size < 0 {
		return "", fmt.Errorf("storage: negative disk size %d", size)
	}
	if size == 0 {
		size = DefaultDiskSize
	}
	rootfs, err := s.ReleaseRoot(digest)
	if err != nil {
		return "", err
	}
	dir := filepath.Dir(rootfs)
	img := filepath.Join(dir, diskName)
	if _, err := os.Stat(img); err == nil {
		return img, nil
	}
	unlock, err := lockFile(ctx, filepath.Join(dir, diskLockName))
	if err != nil {
		return "", fmt.Errorf("storage: release image %s: %w", digest, err)
	}
	defer unlock()
	if _, err := os.Stat(img); err == nil {
		return img, nil // built by whoever held the lock
	}
	start := time.Now()
	if err := s.buildImage(ctx, rootfs, img, size); err != nil {
		return "", fmt.Errorf("storage: release image %s: %w", digest, err)
	}
	s.log.InfoContext(ctx, "storage: release image built", "digest", digest, "size", size, "duration", time.Since(start))
	return img, nil
}

// buildImage makes an ext4 image of rootfs in tmp/ and renames it to dst.
func (s *Store) buildImage(ctx context.Context, rootfs, dst string, size int64) error {
	tmp, err := s.tmpDirFor("disk")
	if err != nil {
		return err
	}
	defer removeTree(context.WithoutCancel(ctx), tmp)
	img := filepath.Join(tmp, diskName)
	f, err := os.OpenFile(img, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	if err := f.Truncate(size); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	// -d copies the tree with owners, modes, links and device nodes; -m 0 reserves no
	// blocks for root (the sandbox's user should see the whole disk); on a fresh sparse
	// file mkfs discards (punches) the whole range and so marks the inode tables zeroed:
	// the guest kernel has no lazy init to do.
	if err := runE2fs(ctx, "mkfs.ext4", "-q", "-F", "-t", "ext4", "-m", "0", "-L", "space-root",
		"-E", "root_owner=0:0", "-d", rootfs, img); err != nil {
		return err
	}
	if err := os.Chmod(img, 0o444); err != nil {
		return err
	}
	if err := durable.Sync(img); err != nil {
		return err
	}
	err = unix.Renameat2(unix.AT_FDCWD, img, unix.AT_FDCWD, dst, unix.RENAME_NOREPLACE)
	if err != nil && !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("publish image: %w", err)
	}
	return durable.Sync(filepath.Dir(dst))
}

// SandboxDisk returns the path of sandbox id's disk image (sandboxes/<id>/disk.ext4). It
// may not exist.
func (s *Store) SandboxDisk(id string) (string, error) {
	dir, err := s.SandboxDir(id)
	if err != nil {
		return "", err
	}
	return filepath.Join(dir, diskName), nil
}

// CreateSandboxDisk makes sandbox id's disk a reflink of the release's ext4 image
// (building that first if needed, see ReleaseImage) and returns its path. The clone is
// O(1) in time and space: it shares every extent with the release image until written.
// If size is larger than the image, the disk is grown to size and its file system with
// it (resize2fs, offline); a smaller size is ignored. It fails with an error wrapping
// fs.ErrExist if the disk exists. SandboxDir may exist already; if this call created it
// and fails, it removes it again.
func (s *Store) CreateSandboxDisk(ctx context.Context, id, digest string, size int64) (_ string, err error) {
	if _, err := s.SandboxDir(id); err != nil {
		return "", err
	}
	src, err := s.ReleaseImage(ctx, digest, 0)
	if err != nil {
		return "", err
	}
	dir, made, err := s.makeSandboxDir(ctx, id)
	if err != nil {
		return "", err
	}
	dst := filepath.Join(dir, diskName)
	created := false
	defer func() {
		if err == nil {
			return
		}
		if created {
			os.Remove(dst)
		}
		if made {
			s.removeSandboxDir(ctx, dir)
		}
	}()
	if err := cloneFile(src, dst); err != nil {
		if errors.Is(err, fs.ErrExist) {
			return "", fmt.Errorf("storage: sandbox %s disk: %w", id, err)
		}
		created = !errors.Is(err, errNotCreated)
		return "", fmt.Errorf("storage: sandbox %s disk: %w", id, err)
	}
	created = true
	fi, err := os.Stat(dst)
	if err != nil {
		return "", fmt.Errorf("storage: %w", err)
	}
	if size > fi.Size() {
		if err := os.Truncate(dst, size); err != nil {
			return "", fmt.Errorf("storage: sandbox %s disk: grow: %w", id, err)
		}
		if err := runE2fs(ctx, "resize2fs", dst); err != nil {
			return "", fmt.Errorf("storage: sandbox %s disk: %w", id, err)
		}
	}
	if err := durable.Sync(dst); err != nil {
		return "", fmt.Errorf("storage: sandbox %s disk: %w", id, err)
	}
	s.log.DebugContext(ctx, "storage: sandbox disk created", "id", id, "digest", digest, "size", max(size, fi.Size()))
	return dst, nil
}

// errNotCreated marks a cloneFile failure that happened before dst existed.
var errNotCreated = errors.New("destination not created")

// cloneFile creates dst (mode 0600, failing if it exists) as a reflink of src.
func cloneFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return fmt.Errorf("%w: %w", errNotCreated, err)
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		if errors.Is(err, fs.ErrExist) {
			return err
		}
		return fmt.Errorf("%w: %w", errNotCreated, err)
	}
	if err := unix.IoctlFileClone(int(out.Fd()), int(in.Fd())); err != nil {
		out.Close()
		return fmt.Errorf("reflink %s: %w", src, err)
	}
	return out.Close()
}

// lockFile takes an exclusive flock on path (created if missing), polling until ctx is
// done, and returns the unlock function.
func lockFile(ctx context.Context, path string) (func(), error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, err
	}
	t := time.NewTicker(diskLockPoll)
	defer t.Stop()
	for {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			return func() { f.Close() }, nil
		}
		if !errors.Is(err, unix.EWOULDBLOCK) && !errors.Is(err, unix.EINTR) {
			f.Close()
			return nil, fmt.Errorf("lock %s: %w", path, err)
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, ctx.Err()
		case <-t.C:
		}
	}
}

// runE2fs runs an e2fsprogs tool and folds its output into the error.
func runE2fs(ctx context.Context, name string, args ...string) error {
	path, err := exec.LookPath(name)
	if err != nil {
		path = filepath.Join("/usr/sbin", name)
		if _, serr := os.Stat(path); serr != nil {
			return fmt.Errorf("%s not found: install the Debian package e2fsprogs", name)
		}
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
