// Package templatetest gives tests a btrfs store and the builtin template releases
// (base, code-interpreter-v1) quickly. A builtin release is built once per machine and
// recipe and kept as an export in the test cache ($SPACE_TEST_CACHE, default
// /var/tmp/space-test-cache), where debootstrap's package cache lives too; later tests
// import it in seconds.
package templatetest

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/storage"
	"github.com/spacedev/space/internal/template"
)

// DefaultCacheDir is the test cache used when SPACE_TEST_CACHE is not set.
const DefaultCacheDir = "/var/tmp/space-test-cache"

// testImageSize is the apparent size of test store images (sparse).
const testImageSize = 16 << 30

// CacheDir returns the test cache directory, creating it.
func CacheDir(t testing.TB) string {
	t.Helper()
	dir := os.Getenv("SPACE_TEST_CACHE")
	if dir == "" {
		dir = DefaultCacheDir
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatalf("templatetest: %v", err)
	}
	return dir
}

// RequireStore skips the test unless it can make btrfs stores: root, btrfs-progs and
// kernel btrfs support.
func RequireStore(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root for loop-mounted btrfs")
	}
	if _, err := exec.LookPath("mkfs.btrfs"); err != nil {
		t.Skip("needs btrfs-progs (mkfs.btrfs)")
	}
	data, err := os.ReadFile("/proc/filesystems")
	if err != nil || !slices.Contains(strings.Fields(string(data)), "btrfs") {
		t.Skip("kernel has no btrfs support")
	}
}

// Store returns a new store on a fresh loop-mounted image in t.TempDir(). It is unmounted
// (detaching the loop device) and removed when the test ends. Skips without root.
func Store(t testing.TB) *storage.Store {
	t.Helper()
	RequireStore(t)
	dir := t.TempDir()
	ctx := context.Background()
	s, err := storage.Open(ctx, storage.Config{DataDir: dir, ImageSizeBytes: testImageSize})
	if err != nil {
		t.Fatalf("templatetest: open store: %v", err)
	}
	t.Cleanup(func() {
		// A process that just exited may hold the mount for a moment (EBUSY): retry
		// for a few seconds before reporting.
		var err error
		for deadline := time.Now().Add(10 * time.Second); ; {
			if err = s.Unmount(ctx); err == nil || time.Now().After(deadline) {
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
		if err != nil {
			t.Errorf("templatetest: unmount store: %v", err)
		}
	})
	return s
}

// Base makes the base release available in s and returns it: it imports the cached export
// if there is one, else builds base into s once and caches it. Concurrent test binaries
// serialize on a lock in the cache directory, so only one of them builds.
func Base(t testing.TB, s *storage.Store) storage.Release {
	t.Helper()
	return Builtin(t, s, template.BaseTemplate)
}

// Builtin is Base for any builtin template (template.Builtins).
func Builtin(t testing.TB, s *storage.Store, name string) storage.Release {
	t.Helper()
	cache := cachePath(t, name)
	if rel, ok := importCache(t, s, cache); ok {
		return rel
	}
	if parent := template.BuiltinParent(name); parent != "" {
		// The build starts from the parent's release: import (or build) it first.
		Builtin(t, s, parent)
	}
	unlock := lockCache(t)
	defer unlock()
	if rel, ok := importCache(t, s, cache); ok {
		return rel
	}
	return buildLocked(t, s, name, nil)
}

// Keep exports release digest of builtin name from s into the test cache, unless the
// cache holds that recipe already (a server under test built it).
func Keep(t testing.TB, s *storage.Store, name, digest string) {
	t.Helper()
	unlock := lockCache(t)
	defer unlock()
	if Cached(t, name) && !Rebuild() {
		return
	}
	writeCache(t, s, digest, cachePath(t, name))
}

// Cached reports whether the test cache holds builtin name's current recipe.
func Cached(t testing.TB, name string) bool {
	t.Helper()
	_, err := os.Stat(cachePath(t, name))
	return err == nil
}

// Rebuild reports whether SPACE_TEST_REBUILD asks tests to build builtin templates
// again although the cache has them.
func Rebuild() bool { return os.Getenv("SPACE_TEST_REBUILD") != "" }

// BuildBase always builds the base template into s with a real debootstrap (reusing the
// package cache), then refreshes the cached export. progress, if not nil, receives the
// build's status lines. It holds the cache lock throughout, so Base in other test binaries
// waits for this build instead of starting its own.
func BuildBase(t testing.TB, s *storage.Store, progress func(string)) storage.Release {
	t.Helper()
	return BuildBuiltin(t, s, template.BaseTemplate, progress)
}

// BuildBuiltin is BuildBase for any builtin template.
func BuildBuiltin(t testing.TB, s *storage.Store, name string, progress func(string)) storage.Release {
	t.Helper()
	unlock := lockCache(t)
	defer unlock()
	return buildLocked(t, s, name, progress)
}

func cachePath(t testing.TB, name string) string {
	return filepath.Join(CacheDir(t), name+"-"+template.BuiltinRecipeID(name)+".release")
}

func buildLocked(t testing.TB, s *storage.Store, name string, progress func(string)) storage.Release {
	t.Helper()
	ctx := context.Background()
	b := &template.Builder{Store: s, CacheDir: filepath.Join(CacheDir(t), "debootstrap")}
	if progress == nil {
		progress = func(line string) { t.Log(line) }
	}
	start := time.Now()
	rel, _, err := b.BuildBuiltin(ctx, name, progress)
	if err != nil {
		t.Fatalf("templatetest: build %s: %v", name, err)
	}
	t.Logf("templatetest: built %s in %s: %d MiB", name, time.Since(start).Round(time.Second), rel.SizeBytes>>20)
	writeCache(t, s, rel.Digest, cachePath(t, name))
	return rel
}

// importCache imports the cached export into s, if there is one. A cache that fails to
// import is reported and ignored (the caller rebuilds and overwrites it).
func importCache(t testing.TB, s *storage.Store, path string) (storage.Release, bool) {
	t.Helper()
	f, err := os.Open(path)
	if errors.Is(err, fs.ErrNotExist) {
		return storage.Release{}, false
	}
	if err != nil {
		t.Fatalf("templatetest: %v", err)
	}
	defer f.Close()
	rel, err := s.ImportRelease(context.Background(), f)
	if err != nil {
		t.Logf("templatetest: ignoring unusable cache %s: %v", path, err)
		return storage.Release{}, false
	}
	return rel, true
}

// writeCache exports the release to path atomically (temporary file, fsync, rename).
func writeCache(t testing.TB, s *storage.Store, digest, path string) {
	t.Helper()
	f, err := os.CreateTemp(filepath.Dir(path), ".release-*.tmp")
	if err != nil {
		t.Fatalf("templatetest: %v", err)
	}
	defer os.Remove(f.Name())
	defer f.Close()
	if err := f.Chmod(0o644); err != nil {
		t.Fatalf("templatetest: %v", err)
	}
	if err := s.ExportRelease(context.Background(), digest, f); err != nil {
		t.Fatalf("templatetest: export %s: %v", digest, err)
	}
	if err := f.Sync(); err != nil {
		t.Fatalf("templatetest: %v", err)
	}
	if err := os.Rename(f.Name(), path); err != nil {
		t.Fatalf("templatetest: %v", err)
	}
}

// lockCache takes an exclusive flock on the cache's lock file, waiting for other holders.
func lockCache(t testing.TB) func() {
	t.Helper()
	f, err := os.OpenFile(filepath.Join(CacheDir(t), "base.lock"), os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		t.Fatalf("templatetest: %v", err)
	}
	for {
		err = unix.Flock(int(f.Fd()), unix.LOCK_EX)
		if !errors.Is(err, unix.EINTR) {
			break
		}
	}
	if err != nil {
		f.Close()
		t.Fatalf("templatetest: lock cache: %v", err)
	}
	return func() { f.Close() }
}

// SeedStore puts at dataDir/store.img a btrfs store image of imageSize bytes that
// holds base and the given builtins, for a space serve started on dataDir to mount.
// Importing base into a fresh store takes seconds per server (a btrfs receive of
// hundreds of MiB and tens of thousands of files); instead a golden image is made
// once per cache content (in the test cache, next to the releases it was made from)
// and each store is a sparse copy of it. Copies share the golden image's file system
// id, which the kernel mounts side by side since Linux 6.7 (temp_fsid); on an older
// kernel each store is made and imported into as before.
func SeedStore(t testing.TB, dataDir string, imageSize int64, builtins ...string) {
	t.Helper()
	RequireStore(t)
	names := append([]string{template.BaseTemplate}, builtins...)
	if _, err := os.Stat("/sys/fs/btrfs/features/temp_fsid"); err != nil {
		ctx := context.Background()
		st, err := storage.Open(ctx, storage.Config{DataDir: dataDir, ImageSizeBytes: imageSize})
		if err != nil {
			t.Fatalf("templatetest: %v", err)
		}
		for _, n := range names {
			Builtin(t, st, n)
		}
		st.Close()
		return
	}
	h := sha256.New()
	fmt.Fprintf(h, "size=%d trimmed\n", imageSize)
	for _, n := range names {
		fmt.Fprintf(h, "%s\n", filepath.Base(cachePath(t, n)))
	}
	golden := filepath.Join(CacheDir(t), fmt.Sprintf("golden-%x.img", h.Sum(nil)[:6]))
	if _, err := os.Stat(golden); err != nil || Rebuild() {
		makeGolden(t, golden, imageSize, names)
	}
	if err := os.MkdirAll(dataDir, 0o755); err != nil {
		t.Fatalf("templatetest: %v", err)
	}
	image := filepath.Join(dataDir, "store.img")
	if out, err := exec.Command("cp", "--sparse=always", golden, image).CombinedOutput(); err != nil {
		t.Fatalf("templatetest: copy the golden store image: %v: %s", err, out)
	}
}

// makeGolden builds the golden image of names (importing or building each) and
// publishes it at golden by a rename, removing golden images of older cache content.
func makeGolden(t testing.TB, golden string, imageSize int64, names []string) {
	t.Helper()
	tmp, err := os.MkdirTemp(CacheDir(t), "golden-build-")
	if err != nil {
		t.Fatalf("templatetest: %v", err)
	}
	defer os.RemoveAll(tmp)
	ctx := context.Background()
	st, err := storage.Open(ctx, storage.Config{DataDir: tmp, ImageSizeBytes: imageSize})
	if err != nil {
		t.Fatalf("templatetest: %v", err)
	}
	for _, n := range names {
		Builtin(t, st, n)
	}
	// What the imports wrote and freed again (the release files they unpacked) stays
	// allocated in the image file until btrfs discards it, minutes later: trim it now,
	// or every test copies it too (1.7 GB instead of 0.8 for the base, and the copy,
	// its mount and its removal took 6.8 s instead of 2.4 on an ext4 host).
	if out, err := exec.Command("fstrim", st.Root()).CombinedOutput(); err != nil {
		t.Logf("templatetest: fstrim the golden image (it stays larger): %v: %s", err, out)
	}
	if err := st.Unmount(ctx); err != nil {
		t.Fatalf("templatetest: %v", err)
	}
	if err := os.Rename(filepath.Join(tmp, "store.img"), golden); err != nil {
		t.Fatalf("templatetest: %v", err)
	}
	// Golden images older than the base release in the cache were made from an
	// older base: nothing will use them again.
	base, err := os.Stat(cachePath(t, template.BaseTemplate))
	if err != nil {
		return
	}
	old, _ := filepath.Glob(filepath.Join(CacheDir(t), "golden-*.img"))
	for _, p := range old {
		if fi, err := os.Stat(p); err == nil && fi.ModTime().Before(base.ModTime()) {
			os.Remove(p)
		}
	}
}
