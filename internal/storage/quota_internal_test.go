package storage

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// openTestStore opens a store on a fresh loop-mounted image, unmounted when the test
// ends. (The storage_test helpers in templatetest cannot be used here: they import this
// package.)
func openTestStore(t *testing.T, dataDir string) *Store {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root for loop-mounted btrfs")
	}
	if _, err := exec.LookPath("mkfs.btrfs"); err != nil {
		t.Skip("needs btrfs-progs (mkfs.btrfs)")
	}
	ctx := context.Background()
	s, err := Open(ctx, Config{DataDir: dataDir, ImageSizeBytes: 2 << 30})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for deadline := time.Now().Add(10 * time.Second); s.Unmount(ctx) != nil && time.Now().Before(deadline); {
			time.Sleep(50 * time.Millisecond)
		}
	})
	if !s.quota.on {
		t.Skipf("no per-sandbox disk limits here: %s", s.quota.reason)
	}
	return s
}

func emptyRelease(t *testing.T, s *Store) Release {
	t.Helper()
	ctx := context.Background()
	b, err := s.BeginRelease(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Discard(ctx)
	if err := os.WriteFile(filepath.Join(b.Rootfs(), "f"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	rel, err := b.Commit(ctx, Release{Name: "q"})
	if err != nil {
		t.Fatal(err)
	}
	return rel
}

func groupExists(s *Store, vol uint64) bool {
	_, err := os.Stat(s.qgroupDir(qgroupID(1, vol)))
	return err == nil
}

func markerExists(s *Store, vol uint64) bool {
	_, err := os.Stat(filepath.Join(s.root, groupsDir, strconv.FormatUint(vol, 10)))
	return err == nil
}

// fillUp writes to path until the quota stops it.
func fillUp(t *testing.T, path string) {
	t.Helper()
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf := make([]byte, 1<<20)
	for i := 0; i < 1024; i++ {
		if _, err := f.Write(buf); err != nil {
			if !errors.Is(err, unix.EDQUOT) {
				t.Fatalf("fill: %v", err)
			}
			return
		}
	}
	t.Fatal("fill never hit the limit")
}

// waitDropped waits until the kernel has cleaned up every deleted subvolume.
func waitDropped(t *testing.T, s *Store) {
	t.Helper()
	// The cleaner that drops them runs after the periodic commit (30 s by default):
	// make that period 1 s for this test's file system.
	if err := unix.Mount("", s.root, "", unix.MS_REMOUNT|storeMountFlags, "commit=1"); err != nil {
		t.Fatalf("remount commit=1: %v", err)
	}
	if out, err := exec.Command("btrfs", "subvolume", "sync", s.root).CombinedOutput(); err != nil {
		t.Fatalf("btrfs subvolume sync: %v\n%s", err, out)
	}
}

// TestSandboxGroupLifecycle checks that a sandbox volume gets its group at creation, with
// the rootfs in it, and loses it at deletion, also when a clone still shares its data.
func TestSandboxGroupLifecycle(t *testing.T) {
	s := openTestStore(t, t.TempDir())
	ctx := context.Background()
	rel := emptyRelease(t, s)
	root, err := s.CreateSandboxRoot(ctx, "a", rel.Digest)
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Dir(root)
	vol, err := s.volumeID(dir)
	if err != nil || vol == 0 {
		t.Fatalf("sandbox dir is not a volume: %d %v", vol, err)
	}
	rootID, err := subvolumeIDOf(root)
	if err != nil {
		t.Fatal(err)
	}
	f, err := openDir(s.root)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	members, _, err := qgroupRelations(f, qgroupID(1, vol))
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(members)
	if want := []uint64{vol, rootID}; !slices.Equal(members, want) {
		t.Fatalf("members of %s: %v, want %v", qgroupName(qgroupID(1, vol)), members, want)
	}
	if !groupExists(s, vol) || !markerExists(s, vol) {
		t.Fatal("group or marker missing")
	}

	// A clone batch and a clone sharing a's data.
	if err := os.WriteFile(filepath.Join(root, "data"), make([]byte, 4<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	batch, err := s.CloneBatchDir("a", "b")
	if err != nil {
		t.Fatal(err)
	}
	if err := s.CopyDisk(ctx, root, filepath.Join(batch, "disk"), true); err != nil {
		t.Fatal(err)
	}
	cloneRoot, _ := s.SandboxRoot("c")
	if err := s.CopyDisk(ctx, filepath.Join(batch, "disk"), cloneRoot, false); err != nil {
		t.Fatal(err)
	}
	cvol, err := s.volumeID(filepath.Dir(cloneRoot))
	if err != nil || cvol == 0 || !groupExists(s, cvol) {
		t.Fatalf("clone volume %d (%v) has no group", cvol, err)
	}

	if err := s.DeleteSandbox(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	if groupExists(s, vol) || markerExists(s, vol) {
		t.Error("deleted sandbox's group or marker is left")
	}
	if err := s.DeleteSandbox(ctx, "c"); err != nil {
		t.Fatal(err)
	}
	if groupExists(s, cvol) || markerExists(s, cvol) {
		t.Error("deleted clone's group or marker is left")
	}
	// Once the kernel has dropped the subvolumes, the next Open leaves no qgroup of
	// them behind.
	waitDropped(t, s)
	s2, err := Open(ctx, Config{DataDir: filepath.Dir(s.root)})
	if err != nil {
		t.Fatal(err)
	}
	s2.Close()
	entries, _ := os.ReadDir(s.quota.sysfs)
	for _, e := range entries {
		if _, id, ok := parseQgroupDir(e.Name()); ok && (id == vol || id == rootID || id == cvol) {
			t.Errorf("qgroup %s left after the sandboxes are gone", e.Name())
		}
	}
}

// TestCrashedDeleteOfFullSandbox leaves a sandbox at its limit in tmp/, as a crash during
// DeleteSandbox would: the next Open must still remove it (deleting its nested rootfs is
// charged to the full volume) and, once it is dropped, its group.
func TestCrashedDeleteOfFullSandbox(t *testing.T) {
	dataDir := t.TempDir()
	s := openTestStore(t, dataDir)
	ctx := context.Background()
	rel := emptyRelease(t, s)
	root, err := s.CreateSandboxRoot(ctx, "full", rel.Digest)
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Dir(root)
	vol, _ := s.volumeID(dir)
	if err := s.SetSandboxLimit(ctx, "full", 8<<20); err != nil {
		t.Fatal(err)
	}
	fillUp(t, filepath.Join(root, "fill"))
	// Without lifting the limit the nested rootfs cannot be deleted.
	if err := destroySubvolume(root); !errors.Is(err, unix.EDQUOT) {
		t.Logf("deleting the rootfs of a full sandbox: %v (expected EDQUOT)", err)
	}
	crashed := filepath.Join(s.root, tmpDir, "delete-sandbox-crashed")
	if err := os.Mkdir(crashed, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(dir, filepath.Join(crashed, "full")); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}

	s2, err := Open(ctx, Config{DataDir: dataDir})
	if err != nil {
		t.Fatalf("Open with a full sandbox in tmp/: %v", err)
	}
	if _, err := os.Lstat(crashed); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("leftover not removed: %v", err)
	}
	s2.Close()
	waitDropped(t, s)
	s3, err := Open(ctx, Config{DataDir: dataDir})
	if err != nil {
		t.Fatal(err)
	}
	s3.Close()
	if groupExists(s, vol) || markerExists(s, vol) {
		t.Errorf("group %s of the crashed sandbox left after the sweep", qgroupName(qgroupID(1, vol)))
	}
}

func TestParseQgroupDir(t *testing.T) {
	for in, want := range map[string][3]uint64{"0_5": {0, 5, 1}, "1_258": {1, 258, 1}, "mode": {0, 0, 0}, "x_1": {0, 0, 0}} {
		l, id, ok := parseQgroupDir(in)
		if ok != (want[2] == 1) || ok && (l != want[0] || id != want[1]) {
			t.Errorf("parseQgroupDir(%q) = %d, %d, %v", in, l, id, ok)
		}
	}
	if got := qgroupName(qgroupID(1, 258)); got != "1/258" {
		t.Errorf("qgroupName = %q", got)
	}
	if !strings.HasPrefix(qgroupName(qgroupID(0, 5)), "0/") {
		t.Error("level 0 name")
	}
}
