package kernelimage

import (
	"bytes"
	"context"
	"debug/elf"
	"encoding/binary"
	"errors"
	"io"
	"os"
	"path/filepath"
	"testing"

	kt "github.com/spacedev/space/internal/runtime/kernelimage/kernelimagetest"
)

func writeTemp(t *testing.T, name string, data []byte) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, data, 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestExtractEachCompression(t *testing.T) {
	kernel := kt.ELF(t, true, 3<<20)
	for _, format := range []string{"gzip", "lzma", "xz", "lz4", "zstd"} {
		t.Run(format, func(t *testing.T) {
			img := kt.BzImage(kt.Compress(t, format, kernel))
			var out bytes.Buffer
			p, err := Extract(bytes.NewReader(img), int64(len(img)), &out)
			if err != nil {
				t.Fatal(err)
			}
			if p.Compression != format || p.Size != int64(len(kernel)) {
				t.Fatalf("payload %+v, want %s of %d bytes", p, format, len(kernel))
			}
			if !bytes.Equal(out.Bytes(), kernel) {
				t.Fatalf("extracted %d bytes that differ from the %d-byte kernel", out.Len(), len(kernel))
			}
		})
	}
}

func TestLocateRefuses(t *testing.T) {
	kernel := kt.ELF(t, true, 64<<10)
	good := kt.BzImage(kt.Compress(t, "zstd", kernel))
	oldProto := bytes.Clone(good)
	binary.LittleEndian.PutUint16(oldProto[offVersion:], 0x0206)
	lzo := kt.BzImage(append([]byte{0x89, 'L', 'Z', 'O', 0, 0x0d}, make([]byte, 64)...))
	outside := bytes.Clone(good)
	binary.LittleEndian.PutUint32(outside[offPayloadLength:], uint32(len(good)))
	for name, img := range map[string][]byte{
		"not a bzImage":   kernel,
		"protocol 2.06":   oldProto,
		"lzo":             lzo,
		"payload outside": outside,
		"too small":       good[:100],
	} {
		if _, err := Extract(bytes.NewReader(img), int64(len(img)), io.Discard); !errors.Is(err, ErrUnsupported) {
			t.Errorf("%s: err = %v, want ErrUnsupported", name, err)
		}
	}
	// A size trailer that disagrees with the stream, and a damaged stream: errors.
	wrongSize := kt.Compress(t, "xz", kernel)
	binary.LittleEndian.PutUint32(wrongSize[len(wrongSize)-4:], uint32(len(kernel)-1))
	damaged := kt.Compress(t, "lz4", kernel)
	for i := 40; i < 80; i++ {
		damaged[i] ^= 0x5a
	}
	for name, payload := range map[string][]byte{"size trailer": wrongSize, "damaged": damaged} {
		img := kt.BzImage(payload)
		if _, err := Extract(bytes.NewReader(img), int64(len(img)), io.Discard); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
}

func TestPVHEntry(t *testing.T) {
	entry, ok, err := PVHEntry(writeTemp(t, "vmlinux", kt.ELF(t, true, 4096)))
	if err != nil || !ok || entry != kt.PVHEntry {
		t.Fatalf("PVHEntry = %#x, %v, %v; want 0x1000850, true", entry, ok, err)
	}
	if _, ok, err := PVHEntry(writeTemp(t, "vmlinux", kt.ELF(t, false, 4096))); err != nil || ok {
		t.Fatalf("no PVH note: ok %v, err %v", ok, err)
	}
	if _, _, err := PVHEntry(writeTemp(t, "junk", []byte("not an elf at all"))); err == nil {
		t.Fatal("not an ELF: no error")
	}
}

func TestCache(t *testing.T) {
	ctx := context.Background()
	dir := filepath.Join(t.TempDir(), "kernels")
	c := &Cache{Dir: dir}
	kernel := kt.ELF(t, true, 1<<20)
	img := writeTemp(t, "vmlinuz-1", kt.BzImage(kt.Compress(t, "lz4", kernel)))

	p, err := c.PVH(ctx, img)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := os.ReadFile(p); err != nil || !bytes.Equal(got, kernel) {
		t.Fatalf("cached kernel differs (%v)", err)
	}
	if fi, err := os.Stat(p); err != nil || fi.Mode().Perm() != 0o644 {
		t.Fatalf("cached kernel mode %v (%v), want 0644: VMMs run as other users", fi.Mode(), err)
	}
	// Again: the same file, not extracted again.
	before, _ := os.Stat(p)
	if again, err := c.PVH(ctx, img); err != nil || again != p {
		t.Fatalf("second PVH = %s, %v; want %s", again, err, p)
	}
	if after, _ := os.Stat(p); !after.ModTime().Equal(before.ModTime()) {
		t.Fatal("extracted again")
	}
	// A damaged cache file (the wrong size) is replaced.
	if err := os.Truncate(p, 100); err != nil {
		t.Fatal(err)
	}
	if again, err := c.PVH(ctx, img); err != nil || again != p {
		t.Fatalf("PVH over a damaged file = %s, %v", again, err)
	}
	if got, _ := os.ReadFile(p); !bytes.Equal(got, kernel) {
		t.Fatal("damaged cache file not replaced")
	}
	// Another kernel replaces the first in the cache.
	img2 := writeTemp(t, "vmlinuz-2", kt.BzImage(kt.Compress(t, "gzip", kt.ELF(t, true, 1<<19))))
	p2, err := c.PVH(ctx, img2)
	if err != nil || p2 == p {
		t.Fatalf("second kernel: %s, %v", p2, err)
	}
	if _, err := os.Stat(p); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the first kernel's extraction is still there (%v)", err)
	}
	// An ELF kernel is used as it is; one without PVH, and a kernel that cannot be
	// unpacked, are refused and leave nothing behind.
	elfKernel := writeTemp(t, "vmlinux", kernel)
	if got, err := c.PVH(ctx, elfKernel); err != nil || got != elfKernel {
		t.Fatalf("ELF kernel: %s, %v", got, err)
	}
	if _, err := c.PVH(ctx, writeTemp(t, "vmlinux", kt.ELF(t, false, 4096))); !errors.Is(err, ErrNoPVH) {
		t.Fatalf("ELF without PVH: %v, want ErrNoPVH", err)
	}
	// A bzImage without PVH: its vmlinux is there for ELF, refused by PVH.
	noPVH := writeTemp(t, "vmlinuz-3", kt.BzImage(kt.Compress(t, "zstd", kt.ELF(t, false, 1<<16))))
	if _, err := c.PVH(ctx, noPVH); !errors.Is(err, ErrNoPVH) {
		t.Fatalf("bzImage without PVH: %v, want ErrNoPVH", err)
	}
	p3, err := c.ELF(ctx, noPVH)
	if err != nil {
		t.Fatalf("ELF of a bzImage without PVH: %v", err)
	}
	// A damaged bzImage fails and leaves the cache as it was.
	damaged := kt.Compress(t, "zstd", kernel)
	damaged[len(damaged)/2] ^= 0xff
	if _, err := c.ELF(ctx, writeTemp(t, "vmlinuz-4", kt.BzImage(damaged))); err == nil {
		t.Fatal("damaged bzImage: no error")
	}
	entries, _ := os.ReadDir(dir)
	if len(entries) != 1 || filepath.Join(dir, entries[0].Name()) != p3 {
		var names []string
		for _, e := range entries {
			names = append(names, e.Name())
		}
		t.Fatalf("cache holds %v, want only %s", names, filepath.Base(p3))
	}
}

// TestHostKernel unpacks the host's distribution kernel, if it has one in /boot.
func TestHostKernel(t *testing.T) {
	imgs, _ := filepath.Glob("/boot/vmlinuz-*")
	if len(imgs) == 0 {
		t.Skip("no /boot/vmlinuz-*")
	}
	c := &Cache{Dir: t.TempDir()}
	p, err := c.PVH(context.Background(), imgs[0])
	if errors.Is(err, ErrNoPVH) || errors.Is(err, ErrUnsupported) {
		t.Skipf("%s: %v", imgs[0], err)
	}
	if err != nil {
		t.Fatal(err)
	}
	f, err := elf.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if f.Machine != elf.EM_X86_64 || len(f.Progs) == 0 {
		t.Fatalf("%s: machine %v, %d program headers", p, f.Machine, len(f.Progs))
	}
	entry, _, _ := PVHEntry(p)
	t.Logf("%s → %s, PVH entry %#x", imgs[0], p, entry)
}
