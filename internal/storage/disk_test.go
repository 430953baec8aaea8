package storage_test

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spacedev/space/internal/storage"
	"github.com/spacedev/space/internal/template/templatetest"
)

func requireE2fs(t *testing.T) {
	t.Helper()
	for _, tool := range []string{"mkfs.ext4", "debugfs", "dumpe2fs", "filefrag", "resize2fs"} {
		if _, err := exec.LookPath(tool); err != nil {
			if _, err := os.Stat("/usr/sbin/" + tool); err != nil {
				t.Skipf("needs e2fsprogs (%s)", tool)
			}
		}
	}
}

func diskTool(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %v: %v\n%s", name, args, err, out)
	}
	return string(out)
}

func readAt(t *testing.T, path string, off int64, n int) []byte {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, n)
	if _, err := f.ReadAt(b, off); err != nil {
		t.Fatal(err)
	}
	return b
}

// TestReleaseImage builds the base release's image once, from several goroutines at
// once, and checks that it holds the rootfs files with their owners and modes.
func TestReleaseImage(t *testing.T) {
	requireE2fs(t)
	s := templatetest.Store(t)
	rel := templatetest.Base(t, s)
	ctx := context.Background()

	var wg sync.WaitGroup
	paths := make([]string, 3)
	errs := make([]error, 3)
	start := time.Now()
	for i := range paths {
		wg.Go(func() { paths[i], errs[i] = s.ReleaseImage(ctx, rel.Digest, 0) })
	}
	wg.Wait()
	t.Logf("image built in %v", time.Since(start))
	for i := range paths {
		if errs[i] != nil {
			t.Fatal(errs[i])
		}
		if paths[i] != paths[0] {
			t.Fatalf("paths differ: %v", paths)
		}
	}
	img := paths[0]
	fi, err := os.Stat(img)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Size() != storage.DefaultDiskSize {
		t.Errorf("apparent size %d, want %d", fi.Size(), storage.DefaultDiskSize)
	}
	if fi.Mode().Perm()&0o222 != 0 {
		t.Errorf("image is writable: %v", fi.Mode())
	}
	if entries, _ := os.ReadDir(filepath.Join(s.Root(), "tmp")); len(entries) > 0 {
		t.Errorf("tmp/ not empty after build: %v", entries)
	}

	ls := diskTool(t, "debugfs", "-R", "ls -l /usr/bin", img)
	if !strings.Contains(ls, "python3") {
		t.Errorf("python3 missing from /usr/bin in the image:\n%.2000s", ls)
	}
	stat := diskTool(t, "debugfs", "-R", "stat /home/user", img)
	// The base template's user owns its home; owners must survive the copy.
	if m := regexp.MustCompile(`User:\s+(\d+)`).FindStringSubmatch(stat); m == nil || m[1] == "0" {
		t.Errorf("/home/user owner not preserved:\n%s", stat)
	}
	if _, err := s.ReleaseImage(ctx, "sha256:"+strings.Repeat("0", 64), 0); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("missing release: %v, want ErrNotExist", err)
	}
}

// TestSandboxDiskReflink checks that a sandbox disk is an O(1) reflink sharing the
// release image's extents, that growing resizes its file system, and that
// DeleteSandbox removes it.
func TestSandboxDiskReflink(t *testing.T) {
	requireE2fs(t)
	s := templatetest.Store(t)
	rel := templatetest.Base(t, s)
	ctx := context.Background()
	img, err := s.ReleaseImage(ctx, rel.Digest, 0)
	if err != nil {
		t.Fatal(err)
	}

	var durations []time.Duration
	for _, id := range []string{"diska", "diskb", "diskc"} {
		start := time.Now()
		p, err := s.CreateSandboxDisk(ctx, id, rel.Digest, 0)
		durations = append(durations, time.Since(start))
		if err != nil {
			t.Fatal(err)
		}
		if want, _ := s.SandboxDisk(id); p != want {
			t.Errorf("path %s, want %s", p, want)
		}
	}
	// No time bound (a loaded host's disk can stretch even a reflink): that the disks
	// share the image's extents is what tells a reflink from a copy.
	t.Logf("reflink durations: %v", durations)
	for _, id := range []string{"diska", "diskb", "diskc"} {
		disk, _ := s.SandboxDisk(id)
		if frag := diskTool(t, "filefrag", "-v", disk); !strings.Contains(frag, "shared") {
			t.Errorf("%s: disk extents not shared with the image:\n%.1500s", id, frag)
		}
	}
	disk, _ := s.SandboxDisk("diska")
	if _, err := s.CreateSandboxDisk(ctx, "diska", rel.Digest, 0); !errors.Is(err, fs.ErrExist) {
		t.Errorf("second create: %v, want ErrExist", err)
	}

	// Writes to the clone do not reach the release image.
	f, err := os.OpenFile(disk, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt([]byte("scribble"), 1<<30); err != nil {
		t.Fatal(err)
	}
	f.Close()
	if got := readAt(t, img, 1<<30, 8); string(got) == "scribble" {
		t.Error("writing the sandbox disk changed the release image")
	}
	if got := readAt(t, disk, 1<<30, 8); string(got) != "scribble" {
		t.Errorf("sandbox disk reads back %q", got)
	}

	// Growing: the file and the file system take the new size.
	const grown = 6 << 30
	p, err := s.CreateSandboxDisk(ctx, "diskbig", rel.Digest, grown)
	if err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(p); err != nil || fi.Size() != grown {
		t.Fatalf("grown disk: %v %v", fi, err)
	}
	hdr := diskTool(t, "dumpe2fs", "-h", p)
	count := regexp.MustCompile(`Block count:\s+(\d+)`).FindStringSubmatch(hdr)
	bsize := regexp.MustCompile(`Block size:\s+(\d+)`).FindStringSubmatch(hdr)
	if count == nil || bsize == nil {
		t.Fatalf("dumpe2fs:\n%s", hdr)
	}
	n, _ := strconv.ParseInt(count[1], 10, 64)
	b, _ := strconv.ParseInt(bsize[1], 10, 64)
	if n*b != grown {
		t.Errorf("file system size %d, want %d", n*b, grown)
	}

	for _, id := range []string{"diska", "diskb", "diskc", "diskbig"} {
		if err := s.DeleteSandbox(ctx, id); err != nil {
			t.Fatal(err)
		}
		p, _ := s.SandboxDisk(id)
		if _, err := os.Stat(p); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s still exists: %v", p, err)
		}
	}
}
