package rundirs

import (
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"testing"
)

// TestScanAndMake carries a /run tree with owners, setgid and sticky bits and links
// into an empty directory, leaving out files, sockets, the skipped mount point, a link
// that points out of the tree (kept as a link, not followed) and entries past the depth.
func TestScanAndMake(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (chown)")
	}
	src := t.TempDir()
	run := filepath.Join(src, "run")
	mk := func(p string, mode fs.FileMode, uid int) {
		t.Helper()
		if err := os.MkdirAll(filepath.Join(run, p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Chown(filepath.Join(run, p), uid, uid); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(filepath.Join(run, p), mode); err != nil {
			t.Fatal(err)
		}
	}
	mk("lock", 0o777|fs.ModeSticky, 0)
	mk("postgresql", 0o775|fs.ModeSetgid, 105)
	mk("space", 0o755, 0)
	mk("a/b/c/d/e/f/g", 0o755, 0)
	if err := os.WriteFile(filepath.Join(run, "stale.pid"), []byte("7"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mknod(filepath.Join(run, "fifo"), syscall.S_IFIFO|0o600, 0); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("/etc", filepath.Join(run, "out")); err != nil {
		t.Fatal(err)
	}
	entries, err := ScanRootFS(src) // leaves out the agent's run dir, /run/space
	if err != nil {
		t.Fatal(err)
	}
	var paths []string
	for _, e := range entries {
		paths = append(paths, e.Path)
	}
	want := []string{"a", "a/b", "a/b/c", "a/b/c/d", "a/b/c/d/e", "a/b/c/d/e/f", "lock", "out", "postgresql"}
	if !slices.Equal(paths, want) {
		t.Fatalf("scanned %v, want %v", paths, want)
	}

	manifest := filepath.Join(t.TempDir(), FileName)
	if err := Write(manifest, entries); err != nil {
		t.Fatal(err)
	}
	dst := t.TempDir()
	if err := Apply(manifest, dst); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(manifest); !os.IsNotExist(err) {
		t.Fatalf("the manifest was not removed: %v", err)
	}
	for p, want := range map[string]fs.FileMode{"lock": fs.ModeDir | 0o777 | fs.ModeSticky, "postgresql": fs.ModeDir | 0o775 | fs.ModeSetgid} {
		fi, err := os.Lstat(filepath.Join(dst, p))
		if err != nil || fi.Mode() != want {
			t.Fatalf("%s: %v %v, want %v", p, fi.Mode(), err, want)
		}
	}
	if fi, _ := os.Lstat(filepath.Join(dst, "postgresql")); fi.Sys().(*syscall.Stat_t).Uid != 105 || fi.Sys().(*syscall.Stat_t).Gid != 105 {
		t.Fatalf("postgresql owner: %+v", fi.Sys())
	}
	if l, err := os.Readlink(filepath.Join(dst, "out")); err != nil || l != "/etc" {
		t.Fatalf("link: %q %v", l, err)
	}
	for _, p := range []string{"stale.pid", "fifo", "space"} {
		if _, err := os.Lstat(filepath.Join(dst, p)); !os.IsNotExist(err) {
			t.Fatalf("%s was carried over: %v", p, err)
		}
	}
	if err := Apply(manifest, dst); err != nil {
		t.Fatalf("no manifest: %v", err)
	}
}

// TestMakeRefusesEscapes: a manifest's paths stay inside the directory.
func TestMakeRefusesEscapes(t *testing.T) {
	dst := t.TempDir()
	outside := filepath.Join(filepath.Dir(dst), "escaped")
	if err := Make(dst, []Entry{{Path: "../escaped", Mode: 0o755}, {Path: "/abs", Mode: 0o755}, {Path: "ok", Mode: 0o750, UID: os.Getuid(), GID: os.Getgid()}}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(outside); !os.IsNotExist(err) {
		t.Fatalf("made outside: %v", err)
	}
	if fi, err := os.Stat(filepath.Join(dst, "ok")); err != nil || fi.Mode().Perm() != 0o750 {
		t.Fatalf("ok: %v", err)
	}
}

// TestScanMissing: no /run is an empty tree.
func TestScanMissing(t *testing.T) {
	root, err := os.OpenRoot(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	if e, err := Scan(root, "run"); err != nil || len(e) != 0 {
		t.Fatalf("%v %v", e, err)
	}
}
