package storage_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/storage"
	"github.com/spacedev/space/internal/template/templatetest"
)

// loopsBackedBy lists the loop devices whose backing file is image.
func loopsBackedBy(t *testing.T, image string) []string {
	t.Helper()
	files, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	var devs []string
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err == nil && strings.TrimSpace(string(data)) == image {
			devs = append(devs, f)
		}
	}
	return devs
}

func isMounted(t *testing.T, dir string) bool {
	t.Helper()
	data, err := os.ReadFile("/proc/self/mountinfo")
	must(t, err)
	for _, line := range strings.Split(string(data), "\n") {
		if f := strings.Fields(line); len(f) > 4 && f[4] == dir {
			return true
		}
	}
	return false
}

func TestOpenImageReopen(t *testing.T) {
	templatetest.RequireStore(t)
	ctx := context.Background()
	dataDir := t.TempDir()
	image := filepath.Join(dataDir, "store.img")
	cfg := storage.Config{DataDir: dataDir, ImageSizeBytes: 2 << 30}

	s, err := storage.Open(ctx, cfg)
	must(t, err)
	unmounted := false
	t.Cleanup(func() {
		if !unmounted {
			s.Unmount(ctx)
		}
	})
	root := s.Root()
	if root != filepath.Join(dataDir, "store") || !isMounted(t, root) {
		t.Fatalf("store root %s not mounted", root)
	}
	var st unix.Statfs_t
	must(t, unix.Statfs(root, &st))
	if st.Type != unix.BTRFS_SUPER_MAGIC {
		t.Fatalf("store is not btrfs: %#x", st.Type)
	}
	if fi, err := os.Stat(image); err != nil || fi.Size() != 2<<30 {
		t.Fatalf("image: %v %v", fi, err)
	}
	for _, d := range []string{"templates", "sandboxes", "tmp"} {
		if _, err := os.Stat(filepath.Join(root, d)); err != nil {
			t.Fatal(err)
		}
	}
	must(t, os.WriteFile(filepath.Join(root, "sandboxes", "marker"), []byte("x"), 0o644))

	// A second Open while mounted uses the existing mount, and Close leaves it mounted.
	s2, err := storage.Open(ctx, cfg)
	must(t, err)
	must(t, s2.Close())
	if !isMounted(t, root) || len(loopsBackedBy(t, image)) != 1 {
		t.Fatalf("second open changed the mount: loops %v", loopsBackedBy(t, image))
	}

	must(t, s.Unmount(ctx))
	unmounted = true
	if isMounted(t, root) {
		t.Fatal("still mounted after Unmount")
	}
	if devs := loopsBackedBy(t, image); len(devs) != 0 {
		t.Fatalf("loop devices left after Unmount: %v", devs)
	}

	// Reopen mounts the same image again; contents survive.
	s, err = storage.Open(ctx, cfg)
	must(t, err)
	unmounted = false
	if _, err := os.Stat(filepath.Join(root, "sandboxes", "marker")); err != nil {
		t.Fatalf("content lost across remount: %v", err)
	}
	must(t, s.Unmount(ctx))
	unmounted = true
	if devs := loopsBackedBy(t, image); len(devs) != 0 {
		t.Fatalf("loop devices left: %v", devs)
	}
}

func TestOpenFailureUndoes(t *testing.T) {
	templatetest.RequireStore(t)
	dataDir := t.TempDir()
	// Too small for mkfs.btrfs: the image must not be left behind.
	_, err := storage.Open(context.Background(), storage.Config{DataDir: dataDir, ImageSizeBytes: 1 << 20})
	if err == nil {
		t.Fatal("Open with a 1 MiB image succeeded")
	}
	entries, _ := os.ReadDir(dataDir)
	if len(entries) != 0 {
		t.Fatalf("Open left %v behind after: %v", entries, err)
	}
}

// newRelease commits a release whose rootfs fill() populated.
func newRelease(t *testing.T, s *storage.Store, name string, fill func(root string)) storage.Release {
	t.Helper()
	ctx := context.Background()
	b, err := s.BeginRelease(ctx)
	must(t, err)
	defer b.Discard(ctx)
	fill(b.Rootfs())
	rel, err := b.Commit(ctx, storage.Release{Name: name, Config: json.RawMessage(`{"user":"user","workdir":"/"}`)})
	must(t, err)
	return rel
}

func tmpEntries(t *testing.T, s *storage.Store) []string {
	t.Helper()
	entries, err := os.ReadDir(filepath.Join(s.Root(), "tmp"))
	must(t, err)
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	return names
}

func TestSnapshotIsConstantTime(t *testing.T) {
	s := templatetest.Store(t)
	ctx := context.Background()
	const size = 200 << 20
	rel := newRelease(t, s, "big", func(root string) {
		f, err := os.Create(filepath.Join(root, "big"))
		must(t, err)
		buf := bytes.Repeat([]byte("0123456789abcdef"), 1<<16) // 1 MiB, incompressible enough
		for i := 0; i < size/len(buf); i++ {
			_, err := f.Write(buf)
			must(t, err)
		}
		must(t, f.Close())
	})
	if rel.SizeBytes != size || rel.Name != "big" || !s.HasRelease(rel.Digest) {
		t.Fatalf("release = %+v", rel)
	}

	start := time.Now()
	root, err := s.CreateSandboxRoot(ctx, "sb1", rel.Digest)
	must(t, err)
	elapsed := time.Since(start)
	t.Logf("snapshot of a %d MiB release took %v", size>>20, elapsed)
	if fi, err := os.Stat(filepath.Join(root, "big")); err != nil || fi.Size() != size {
		t.Fatalf("file in sandbox root: %v %v", fi, err)
	}
	// O(1) in space: the sandbox's file shares all its extents with the release.
	out, err := exec.Command("btrfs", "filesystem", "du", "-s", "--raw", root).CombinedOutput()
	must(t, err)
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	fields := strings.Fields(lines[len(lines)-1])
	exclusive, err := strconv.ParseInt(fields[1], 10, 64)
	if err != nil || exclusive != 0 {
		t.Fatalf("sandbox root has exclusive data right after the snapshot:\n%s", out)
	}
	// O(1) in time: generous bound, the ioctl takes milliseconds.
	if elapsed > 2*time.Second {
		t.Fatalf("snapshot took %v", elapsed)
	}

	if _, err := s.CreateSandboxRoot(ctx, "sb1", rel.Digest); !errors.Is(err, fs.ErrExist) {
		t.Fatalf("second CreateSandboxRoot: %v, want ErrExist", err)
	}
	missing := "sha256:" + strings.Repeat("0", 64)
	if _, err := s.CreateSandboxRoot(ctx, "sb2", missing); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("CreateSandboxRoot from missing release: %v", err)
	}
	if _, err := os.Stat(filepath.Join(s.Root(), "sandboxes", "sb2")); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("failed create left sandbox dir: %v", err)
	}
	if _, err := s.CreateSandboxRoot(ctx, "../x", rel.Digest); err == nil {
		t.Fatal("invalid id accepted")
	}
}

func TestReleaseReadOnly(t *testing.T) {
	s := templatetest.Store(t)
	ctx := context.Background()
	rel := newRelease(t, s, "ro", func(root string) {
		must(t, os.WriteFile(filepath.Join(root, "f"), []byte("release"), 0o644))
	})
	rroot, err := s.ReleaseRoot(rel.Digest)
	must(t, err)
	if ro, err := s.IsReadOnly(rroot); err != nil || !ro {
		t.Fatalf("IsReadOnly = %v, %v", ro, err)
	}
	for name, write := range map[string]func() error{
		"create": func() error { return os.WriteFile(filepath.Join(rroot, "new"), nil, 0o644) },
		"modify": func() error { return os.WriteFile(filepath.Join(rroot, "f"), []byte("x"), 0o644) },
		"chmod":  func() error { return os.Chmod(filepath.Join(rroot, "f"), 0o777) },
		"remove": func() error { return os.Remove(filepath.Join(rroot, "f")) },
	} {
		if err := write(); !errors.Is(err, unix.EROFS) {
			t.Errorf("%s in release: %v, want EROFS", name, err)
		}
	}
	// The sandbox's snapshot is writable and its writes do not reach the release.
	sroot, err := s.CreateSandboxRoot(ctx, "w", rel.Digest)
	must(t, err)
	must(t, os.WriteFile(filepath.Join(sroot, "f"), []byte("sandbox"), 0o644))
	if data, _ := os.ReadFile(filepath.Join(rroot, "f")); string(data) != "release" {
		t.Fatalf("release content changed to %q", data)
	}
	got, err := s.Release(rel.Digest)
	must(t, err)
	if got.Digest != rel.Digest || got.Name != "ro" || !jsonHas(got.Config, "user", "user") || !got.CreatedAt.Equal(rel.CreatedAt) {
		t.Fatalf("Release() = %+v, want %+v", got, rel)
	}
	if d, _, err := storage.TreeDigest(ctx, rroot); err != nil || d != rel.Digest {
		t.Fatalf("recomputed digest %s, %v; want %s", d, err, rel.Digest)
	}
}

func TestDeleteSandboxNested(t *testing.T) {
	s := templatetest.Store(t)
	ctx := context.Background()
	rel := newRelease(t, s, "n", func(root string) {
		must(t, os.MkdirAll(filepath.Join(root, "home/user"), 0o755))
	})
	root, err := s.CreateSandboxRoot(ctx, "nested", rel.Digest)
	must(t, err)
	// What a user could do inside: nested subvolumes, two deep, the middle one read-only.
	outer := filepath.Join(root, "home/user/vol")
	inner := filepath.Join(outer, "deeper/vol2")
	must(t, s.CreateSubvolume(ctx, outer))
	must(t, os.MkdirAll(filepath.Dir(inner), 0o755))
	must(t, s.CreateSubvolume(ctx, inner))
	must(t, os.WriteFile(filepath.Join(inner, "data"), []byte("x"), 0o644))
	must(t, s.Snapshot(ctx, inner, filepath.Join(outer, "snap"), true))
	must(t, s.SetReadOnly(ctx, outer, true))
	// Other per-sandbox files next to the rootfs.
	dir, err := s.SandboxDir("nested")
	must(t, err)
	must(t, os.WriteFile(filepath.Join(dir, "state.json"), []byte("{}"), 0o644))

	ids, err := s.ListSandboxes()
	must(t, err)
	if len(ids) != 1 || ids[0] != "nested" {
		t.Fatalf("ListSandboxes = %v", ids)
	}
	must(t, s.DeleteSandbox(ctx, "nested"))
	if _, err := os.Lstat(dir); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("sandbox dir still there: %v", err)
	}
	if ids, _ := s.ListSandboxes(); len(ids) != 0 {
		t.Fatalf("ListSandboxes after delete = %v", ids)
	}
	if left := tmpEntries(t, s); len(left) != 0 {
		t.Fatalf("tmp holds %v", left)
	}
	must(t, s.DeleteSandbox(ctx, "nested")) // idempotent
	if err := s.DeleteSandbox(ctx, "Bad/Id"); err == nil {
		t.Fatal("invalid id accepted")
	}
	// Release is untouched; deleting it works and is idempotent too.
	if !s.HasRelease(rel.Digest) {
		t.Fatal("release gone")
	}
	must(t, s.DeleteRelease(ctx, rel.Digest))
	must(t, s.DeleteRelease(ctx, rel.Digest))
	if s.HasRelease(rel.Digest) {
		t.Fatal("release still there")
	}
	if rels, err := s.ListReleases(); err != nil || len(rels) != 0 {
		t.Fatalf("ListReleases = %v, %v", rels, err)
	}
}

func TestTmpCleanup(t *testing.T) {
	s := templatetest.Store(t)
	ctx := context.Background()
	dataDir := filepath.Dir(s.Root())

	// An abandoned build, and a leftover tree with a nested read-only subvolume.
	b, err := s.BeginRelease(ctx)
	must(t, err)
	must(t, os.WriteFile(filepath.Join(b.Rootfs(), "f"), []byte("x"), 0o644))
	left := filepath.Join(s.Root(), "tmp", "leftover")
	must(t, os.MkdirAll(left, 0o755))
	must(t, s.CreateSubvolume(ctx, filepath.Join(left, "vol")))
	must(t, s.CreateSubvolume(ctx, filepath.Join(left, "vol", "inner")))
	must(t, s.SetReadOnly(ctx, filepath.Join(left, "vol"), true))

	// Another process's Open must not clean while this store is open.
	s2, err := storage.Open(ctx, storage.Config{DataDir: dataDir})
	must(t, err)
	must(t, s2.Close())
	if got := tmpEntries(t, s); len(got) != 2 {
		t.Fatalf("tmp cleaned while the store was open: %v", got)
	}

	must(t, s.Close())
	s3, err := storage.Open(ctx, storage.Config{DataDir: dataDir})
	must(t, err)
	defer s3.Close()
	if got := tmpEntries(t, s3); len(got) != 0 {
		t.Fatalf("tmp not cleaned at Open: %v", got)
	}
	must(t, b.Discard(ctx)) // already gone: no error
}

func TestCommitSameDigestReturnsExisting(t *testing.T) {
	s := templatetest.Store(t)
	fill := func(root string) { must(t, os.WriteFile(filepath.Join(root, "f"), []byte("same"), 0o644)) }
	first := newRelease(t, s, "one", fill)
	second := newRelease(t, s, "two", fill)
	if second.Digest != first.Digest || second.Name != "one" {
		t.Fatalf("second commit = %+v, want existing %+v", second, first)
	}
	if left := tmpEntries(t, s); len(left) != 0 {
		t.Fatalf("tmp holds %v", left)
	}
	if rels, err := s.ListReleases(); err != nil || len(rels) != 1 {
		t.Fatalf("ListReleases = %v, %v", rels, err)
	}
}

func TestExportImportRoundTrip(t *testing.T) {
	src := templatetest.Store(t)
	dst := templatetest.Store(t)
	ctx := context.Background()
	rel := newRelease(t, src, "rt", func(root string) {
		makeTree(t, root)
		must(t, os.Lchown(filepath.Join(root, "etc/sub/b"), 1000, 1000))
		must(t, unix.Mknod(filepath.Join(root, "null"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))))
	})
	var buf bytes.Buffer
	must(t, src.ExportRelease(ctx, rel.Digest, &buf))
	stream := buf.Bytes()

	got, err := dst.ImportRelease(ctx, bytes.NewReader(stream))
	must(t, err)
	if got.Digest != rel.Digest || got.Name != "rt" || !got.CreatedAt.Equal(rel.CreatedAt) || got.SizeBytes != rel.SizeBytes {
		t.Fatalf("imported %+v, exported %+v", got, rel)
	}
	root, err := dst.ReleaseRoot(got.Digest)
	must(t, err)
	if ro, err := dst.IsReadOnly(root); err != nil || !ro {
		t.Fatalf("imported release read-only = %v, %v", ro, err)
	}
	if d, _, err := storage.TreeDigest(ctx, root); err != nil || d != rel.Digest {
		t.Fatalf("imported tree digest %s, %v", d, err)
	}
	// Importing again returns the existing release.
	again, err := dst.ImportRelease(ctx, bytes.NewReader(stream))
	must(t, err)
	if again.Digest != rel.Digest {
		t.Fatalf("second import: %+v", again)
	}

	// A header whose digest does not match the content is rejected, leaving nothing.
	nl := bytes.IndexByte(stream, '\n')
	forged := bytes.Replace(stream[:nl], []byte(rel.Digest), []byte("sha256:"+strings.Repeat("ab", 32)), 1)
	forged = append(append(forged, '\n'), stream[nl+1:]...)
	if _, err := dst.ImportRelease(ctx, bytes.NewReader(forged)); err == nil || !strings.Contains(err.Error(), "does not match") {
		t.Fatalf("forged import: %v", err)
	}
	if _, err := dst.ImportRelease(ctx, bytes.NewReader(stream[:len(stream)/2])); err == nil {
		t.Fatal("truncated import succeeded")
	}
	if left := tmpEntries(t, dst); len(left) != 0 {
		t.Fatalf("failed imports left %v", left)
	}
	if rels, _ := dst.ListReleases(); len(rels) != 1 {
		t.Fatalf("ListReleases = %v", rels)
	}
}

// jsonHas reports whether the JSON object raw has key with the string value want.
func jsonHas(raw json.RawMessage, key, want string) bool {
	var m map[string]any
	return json.Unmarshal(raw, &m) == nil && m[key] == want
}
