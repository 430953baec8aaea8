package storage_test

import (
	"context"
	"crypto/rand"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/storage"
	"github.com/spacedev/space/internal/template/templatetest"
)

const mib = 1 << 20

// quotaStore returns a test store with per-sandbox limits, skipping when the kernel has
// no btrfs simple quotas.
func quotaStore(t *testing.T) *storage.Store {
	t.Helper()
	s := templatetest.Store(t)
	if ok, why := s.QuotasEnabled(); !ok {
		t.Skipf("no per-sandbox disk limits here: %s", why)
	}
	return s
}

// randomFile writes n random (incompressible) bytes to path.
func randomFile(t *testing.T, path string, n int) {
	t.Helper()
	buf := make([]byte, n)
	rand.Read(buf)
	must(t, os.WriteFile(path, buf, 0o644))
}

// fill writes random 1 MiB blocks to path at offset off, stepping by step (0: append),
// until a write fails or max bytes are written. It returns the bytes written and the
// error that stopped it.
func fill(t *testing.T, path string, off, step, max int64) (int64, error) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE, 0o644)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	buf := make([]byte, mib)
	var written int64
	for written < max {
		rand.Read(buf)
		n, err := f.WriteAt(buf, off)
		written += int64(n)
		if err != nil {
			return written, err
		}
		if step == 0 {
			off += mib
		} else {
			off += step
		}
	}
	return written, f.Sync()
}

// commit makes the kernel's accounting current (frees and new extents are accounted when
// the transaction commits).
func commit(t *testing.T, s *storage.Store) {
	t.Helper()
	f, err := os.Open(s.Root())
	must(t, err)
	defer f.Close()
	must(t, unix.Syncfs(int(f.Fd())))
}

func usage(t *testing.T, s *storage.Store, id string) storage.DiskUsage {
	t.Helper()
	commit(t, s)
	u, err := s.SandboxUsage(context.Background(), id)
	must(t, err)
	return u
}

// imageBytes is how much host disk the store's image file takes.
func imageBytes(t *testing.T, s *storage.Store) int64 {
	t.Helper()
	commit(t, s)
	var st unix.Stat_t
	must(t, unix.Stat(filepath.Join(filepath.Dir(s.Root()), "store.img"), &st))
	return st.Blocks * 512
}

func isQuotaErr(err error) bool {
	return errors.Is(err, unix.EDQUOT) || errors.Is(err, unix.ENOSPC)
}

// near reports whether got is within tol of want.
func near(got, want, tol int64) bool { return got >= want-tol && got <= want+tol }

// TestSandboxLimit bounds a sandbox made from a release: what it shares with the release
// is free, what it overwrites or writes counts, writes past the limit fail with EDQUOT
// while the host image grows by no more than the limit, and its checkpoints count too.
func TestSandboxLimit(t *testing.T) {
	s := quotaStore(t)
	ctx := context.Background()
	rel := newRelease(t, s, "big", func(root string) { randomFile(t, filepath.Join(root, "big"), 64*mib) })
	root, err := s.CreateSandboxRoot(ctx, "lim", rel.Digest)
	must(t, err)
	const limit = 32 * mib
	must(t, s.SetSandboxLimit(ctx, "lim", limit))
	u := usage(t, s, "lim")
	if u.LimitBytes != limit || u.UsedBytes > mib {
		t.Fatalf("fresh sandbox: %+v, want limit %d and (almost) nothing used", u, limit)
	}
	before := imageBytes(t, s)

	// Overwriting 8 MiB of the release's file copies those extents: they count.
	if n, err := fill(t, filepath.Join(root, "big"), 0, 4*mib, 8*mib); err != nil {
		t.Fatalf("overwrite %d bytes of a shared file: %v", n, err)
	}
	if u := usage(t, s, "lim"); !near(u.UsedBytes, 8*mib, mib) {
		t.Fatalf("after overwriting 8 MiB: used %d", u.UsedBytes)
	}

	// A flood stops at the limit.
	written, err := fill(t, filepath.Join(root, "flood"), 0, 0, 256*mib)
	if !isQuotaErr(err) {
		t.Fatalf("flood wrote %d MiB and ended with %v, want EDQUOT", written/mib, err)
	}
	if written > limit-8*mib+mib {
		t.Errorf("flood wrote %d MiB past the %d MiB limit", written/mib, limit/mib)
	}
	t.Logf("flood stopped after %d MiB with %v", written/mib, err)
	if grew := imageBytes(t, s) - before; grew > limit+16*mib {
		t.Errorf("the host image grew by %d MiB under a %d MiB limit", grew/mib, limit/mib)
	}
	u = usage(t, s, "lim")
	if u.UsedBytes > limit+mib || u.UsedBytes < limit-4*mib {
		t.Errorf("at the limit: used %d MiB, limit %d MiB", u.UsedBytes/mib, limit/mib)
	}

	// Deleting the release does not move its data onto the sandbox's account.
	must(t, s.DeleteRelease(ctx, rel.Digest))
	if after := usage(t, s, "lim"); !near(after.UsedBytes, u.UsedBytes, mib) {
		t.Errorf("deleting the release changed the sandbox's usage from %d to %d", u.UsedBytes, after.UsedBytes)
	}

	// Freeing space lets writes through again.
	must(t, os.Remove(filepath.Join(root, "flood")))
	if u := usage(t, s, "lim"); !near(u.UsedBytes, 8*mib, 2*mib) {
		t.Fatalf("after removing the flood: used %d", u.UsedBytes)
	}
	// A suspend snapshot's memory file counts toward the same limit.
	cp, err := s.CheckpointDir("lim")
	must(t, err)
	must(t, os.MkdirAll(cp, 0o700))
	if n, err := fill(t, filepath.Join(cp, "memory"), 0, 0, 16*mib); err != nil {
		t.Fatalf("checkpoint write of %d bytes: %v", n, err)
	}
	if u := usage(t, s, "lim"); !near(u.UsedBytes, 24*mib, 2*mib) {
		t.Fatalf("with a 16 MiB checkpoint: used %d", u.UsedBytes)
	}
	if n, err := fill(t, filepath.Join(cp, "memory2"), 0, 0, 64*mib); !isQuotaErr(err) {
		t.Fatalf("checkpoint past the limit wrote %d MiB: %v", n/mib, err)
	}
	must(t, os.RemoveAll(cp))

	// Removing the limit lets the sandbox write on.
	must(t, s.SetSandboxLimit(ctx, "lim", 0))
	if u := usage(t, s, "lim"); u.LimitBytes != 0 {
		t.Fatalf("limit after removal: %d", u.LimitBytes)
	}
	if n, err := fill(t, filepath.Join(root, "more"), 0, 0, 48*mib); err != nil {
		t.Fatalf("unlimited write stopped at %d: %v", n, err)
	}
}

// TestCloneLimits checks that a clone made from a source's clone batch has a limit and
// account of its own: its writes count for it, not for the source.
func TestCloneLimits(t *testing.T) {
	s := quotaStore(t)
	ctx := context.Background()
	rel := newRelease(t, s, "c", func(root string) { randomFile(t, filepath.Join(root, "f"), 4*mib) })
	root, err := s.CreateSandboxRoot(ctx, "src", rel.Digest)
	must(t, err)
	must(t, s.SetSandboxLimit(ctx, "src", 64*mib))
	randomFile(t, filepath.Join(root, "mine"), 8*mib)
	batch, err := s.CloneBatchDir("src", "b1")
	must(t, err)
	must(t, s.CopyDisk(ctx, root, filepath.Join(batch, "disk"), true))
	cloneRoot, err := s.SandboxRoot("dst")
	must(t, err)
	must(t, s.CopyDisk(ctx, filepath.Join(batch, "disk"), cloneRoot, false))
	must(t, s.SetSandboxLimit(ctx, "dst", 16*mib))
	srcUsed := usage(t, s, "src").UsedBytes
	if u := usage(t, s, "dst"); u.UsedBytes > mib || u.LimitBytes != 16*mib {
		t.Fatalf("fresh clone: %+v", u)
	}
	if data, err := os.ReadFile(filepath.Join(cloneRoot, "mine")); err != nil || len(data) != 8*mib {
		t.Fatalf("clone lacks the source's file: %d bytes, %v", len(data), err)
	}
	if n, err := fill(t, filepath.Join(cloneRoot, "flood"), 0, 0, 64*mib); !isQuotaErr(err) || n > 16*mib {
		t.Fatalf("clone flood: %d MiB, %v", n/mib, err)
	}
	if u := usage(t, s, "src"); !near(u.UsedBytes, srcUsed, mib) {
		t.Errorf("the clone's writes changed the source's usage from %d to %d", srcUsed, u.UsedBytes)
	}
	// The source still writes within its own limit.
	if n, err := fill(t, filepath.Join(root, "more"), 0, 0, 16*mib); err != nil {
		t.Fatalf("source write after the clone's flood: %d, %v", n, err)
	}
	// Deleting the source leaves the clone's data intact.
	must(t, s.DeleteSandbox(ctx, "src"))
	if data, err := os.ReadFile(filepath.Join(cloneRoot, "mine")); err != nil || len(data) != 8*mib {
		t.Fatalf("clone lost the source's file: %d bytes, %v", len(data), err)
	}
	must(t, s.DeleteSandbox(ctx, "dst"))
}

// TestSandboxDiskLimit bounds a VM sandbox's disk image, a reflink of the release's ext4
// image: guest writes land in the image file, and past the limit they fail.
func TestSandboxDiskLimit(t *testing.T) {
	requireE2fs(t)
	s := quotaStore(t)
	ctx := context.Background()
	rel := newRelease(t, s, "vm", func(root string) { randomFile(t, filepath.Join(root, "f"), 8*mib) })
	disk, err := s.CreateSandboxDisk(ctx, "vm", rel.Digest, 0)
	must(t, err)
	const limit = 32 * mib
	must(t, s.SetSandboxLimit(ctx, "vm", limit))
	if u := usage(t, s, "vm"); u.UsedBytes > mib {
		t.Fatalf("fresh disk: %+v", u)
	}
	before := imageBytes(t, s)
	// Writes spread over the image, as a guest's file system would make them.
	written, err := fill(t, disk, 64*mib, 37*mib, 512*mib)
	if !isQuotaErr(err) {
		t.Fatalf("disk flood wrote %d MiB and ended with %v, want EDQUOT", written/mib, err)
	}
	if written > limit+mib {
		t.Errorf("disk flood wrote %d MiB past the %d MiB limit", written/mib, limit/mib)
	}
	if grew := imageBytes(t, s) - before; grew > limit+16*mib {
		t.Errorf("the host image grew by %d MiB under a %d MiB limit", grew/mib, limit/mib)
	}
	if fi, err := os.Stat(disk); err != nil || fi.Size() != storage.DefaultDiskSize {
		t.Errorf("disk image size changed: %v %v", fi, err)
	}
}

func TestSetSandboxLimitErrors(t *testing.T) {
	s := quotaStore(t)
	ctx := context.Background()
	if err := s.SetSandboxLimit(ctx, "missing", mib); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("limit on a missing sandbox: %v", err)
	}
	if _, err := s.SandboxUsage(ctx, "missing"); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("usage of a missing sandbox: %v", err)
	}
	if err := s.SetSandboxLimit(ctx, "Bad/Id", mib); fault.KindOf(err) != fault.Invalid {
		t.Errorf("invalid id: %v", err)
	}
	rel := newRelease(t, s, "e", func(string) {})
	_, err := s.CreateSandboxRoot(ctx, "neg", rel.Digest)
	must(t, err)
	if err := s.SetSandboxLimit(ctx, "neg", -1); fault.KindOf(err) != fault.Invalid {
		t.Errorf("negative limit: %v", err)
	}

	// A store without quotas says so.
	off, err := storage.Open(ctx, storage.Config{DataDir: t.TempDir(), ImageSizeBytes: 1 << 30, DisableQuotas: true})
	must(t, err)
	defer off.Unmount(ctx)
	if ok, why := off.QuotasEnabled(); ok || why == "" {
		t.Fatalf("QuotasEnabled = %v, %q", ok, why)
	}
	rel = newRelease(t, off, "e", func(string) {})
	_, err = off.CreateSandboxRoot(ctx, "x", rel.Digest)
	must(t, err)
	if err := off.SetSandboxLimit(ctx, "x", mib); fault.KindOf(err) != fault.Unavailable {
		t.Errorf("limit without quotas: %v", err)
	}
	// ExclusiveBytes still works there (btrfs filesystem du).
	if _, err := off.ExclusiveBytes(ctx, "x"); err != nil {
		t.Errorf("ExclusiveBytes without quotas: %v", err)
	}
}

// TestReleaseBuildLimit bounds what build steps may write into a release being built.
func TestReleaseBuildLimit(t *testing.T) {
	s := quotaStore(t)
	ctx := context.Background()
	b, err := s.BeginRelease(ctx)
	must(t, err)
	defer b.Discard(ctx)
	must(t, b.SetLimit(ctx, 16*mib))
	if n, err := fill(t, filepath.Join(b.Rootfs(), "flood"), 0, 0, 128*mib); !isQuotaErr(err) || n > 16*mib {
		t.Fatalf("build flood: %d MiB, %v", n/mib, err)
	}
	must(t, os.Remove(filepath.Join(b.Rootfs(), "flood")))
	randomFile(t, filepath.Join(b.Rootfs(), "f"), mib)
	rel, err := b.Commit(ctx, storage.Release{Name: "limited"})
	must(t, err)
	// The release's sandboxes are not bounded by the build's limit.
	root, err := s.CreateSandboxRoot(ctx, "after", rel.Digest)
	must(t, err)
	if n, err := fill(t, filepath.Join(root, "big"), 0, 0, 32*mib); err != nil {
		t.Fatalf("sandbox of a limited build: %d, %v", n, err)
	}
	if err := b.SetLimit(ctx, -1); fault.KindOf(err) != fault.Invalid {
		t.Errorf("negative build limit: %v", err)
	}
}

// TestRootfsLimit bounds a sandbox's root filesystem below its volume's limit: writes
// to the rootfs stop at the rootfs limit while the volume (checkpoints) has room left.
func TestRootfsLimit(t *testing.T) {
	s := quotaStore(t)
	ctx := context.Background()
	rel := newRelease(t, s, "small", func(root string) { randomFile(t, filepath.Join(root, "f"), mib) })
	root, err := s.CreateSandboxRoot(ctx, "rl", rel.Digest)
	must(t, err)
	must(t, s.SetSandboxLimit(ctx, "rl", 64*mib))
	must(t, s.SetRootfsLimit(ctx, "rl", 16*mib))
	written, err := fill(t, filepath.Join(root, "flood"), 0, 0, 256*mib)
	if !isQuotaErr(err) || written > 17*mib {
		t.Fatalf("rootfs flood wrote %d MiB and ended with %v, want EDQUOT at 16 MiB", written/mib, err)
	}
	// The volume still takes a checkpoint beside the full rootfs.
	dir, err := s.CheckpointDir("rl")
	must(t, err)
	must(t, os.MkdirAll(dir, 0o700))
	if n, err := fill(t, filepath.Join(dir, "mem"), 0, 0, 32*mib); err != nil {
		t.Fatalf("checkpoint beside a full rootfs: wrote %d MiB: %v", n/mib, err)
	}
	if err := s.SetRootfsLimit(ctx, "nope", mib); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("rootfs limit of a missing sandbox: %v", err)
	}
}
