package kernelimage

import (
	"bytes"
	"compress/gzip"
	"context"
	"debug/elf"
	"encoding/binary"
	"errors"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"

	"github.com/klauspost/compress/zstd"
	"github.com/pierrec/lz4/v4"
	"github.com/ulikunitz/xz"
	"github.com/ulikunitz/xz/lzma"
)

// testELF builds a small x86-64 ELF with a PT_NOTE segment: with pvh, the notes carry a
// Xen PHYS32_ENTRY note (behind another Xen note, as in a real kernel); body pads it
// to size with bytes that compress only in part.
func testELF(t *testing.T, pvh bool, size int) []byte {
	t.Helper()
	var notes bytes.Buffer
	note := func(name string, typ uint32, desc []byte) {
		n := append([]byte(name), 0)
		binary.Write(&notes, binary.LittleEndian, [3]uint32{uint32(len(n)), uint32(len(desc)), typ})
		notes.Write(n)
		notes.Write(make([]byte, (4-len(n)%4)%4))
		notes.Write(desc)
		notes.Write(make([]byte, (4-len(desc)%4)%4))
	}
	note("Xen", 6, []byte("linux\x00"))
	note("GNU", xenPhys32EntryNT, make([]byte, 8)) // right type, wrong owner
	if pvh {
		note("Xen", xenPhys32EntryNT, binary.LittleEndian.AppendUint64(nil, 0x1000850))
	}
	const ehsize, phsize = 64, 56
	var b bytes.Buffer
	binary.Write(&b, binary.LittleEndian, elf.Header64{
		Ident:     [16]byte{0x7f, 'E', 'L', 'F', byte(elf.ELFCLASS64), byte(elf.ELFDATA2LSB), byte(elf.EV_CURRENT)},
		Type:      uint16(elf.ET_EXEC),
		Machine:   uint16(elf.EM_X86_64),
		Version:   uint32(elf.EV_CURRENT),
		Entry:     0x1000000,
		Phoff:     ehsize,
		Ehsize:    ehsize,
		Phentsize: phsize,
		Phnum:     1,
	})
	binary.Write(&b, binary.LittleEndian, elf.Prog64{
		Type: uint32(elf.PT_NOTE), Flags: uint32(elf.PF_R), Off: ehsize + phsize,
		Filesz: uint64(notes.Len()), Memsz: uint64(notes.Len()), Align: 4,
	})
	b.Write(notes.Bytes())
	r := rand.New(rand.NewPCG(1, 2))
	for b.Len() < size {
		if r.IntN(4) == 0 {
			b.WriteByte(byte(r.Uint32()))
		} else {
			b.WriteString("kernel text ")
		}
	}
	return b.Bytes()
}

// compress returns kernel compressed the way the kernel's build does: the format's
// stream, then (but for gzip, whose trailer ends with it) the uncompressed size.
func compress(t *testing.T, format string, kernel []byte) []byte {
	t.Helper()
	var b bytes.Buffer
	var w io.WriteCloser
	var err error
	switch format {
	case "gzip":
		w = gzip.NewWriter(&b)
	case "lzma":
		w, err = lzma.NewWriter(&b)
	case "xz":
		w, err = xz.NewWriter(&b)
	case "lz4":
		lw := lz4.NewWriter(&b)
		err = lw.Apply(lz4.LegacyOption(true))
		w = lw
	case "zstd":
		w, err = zstd.NewWriter(&b)
	default:
		t.Fatalf("no writer for %s", format)
	}
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.Write(kernel); err != nil {
		t.Fatal(err)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if format != "gzip" {
		b.Write(binary.LittleEndian.AppendUint32(nil, uint32(len(kernel))))
	}
	return b.Bytes()
}

// bzImage wraps payload in a setup header (boot protocol 2.15, 3 setup sectors) and
// some protected-mode code before and after it, as a real bzImage has.
func bzImage(payload []byte) []byte {
	const setupSects, pre = 3, 0x4a0
	img := make([]byte, (setupSects+1)*512+pre)
	img[offSetupSects] = setupSects
	copy(img[offHeaderMagic:], "HdrS")
	binary.LittleEndian.PutUint16(img[offVersion:], 0x020f)
	binary.LittleEndian.PutUint32(img[offPayloadOffset:], pre)
	binary.LittleEndian.PutUint32(img[offPayloadLength:], uint32(len(payload)))
	img = append(img, payload...)
	return append(img, bytes.Repeat([]byte{0xcc}, 700)...)
}

func writeTemp(t *testing.T, name string, data []byte) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, data, 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestExtractEachCompression(t *testing.T) {
	kernel := testELF(t, true, 3<<20)
	for _, format := range []string{"gzip", "lzma", "xz", "lz4", "zstd"} {
		t.Run(format, func(t *testing.T) {
			img := bzImage(compress(t, format, kernel))
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
	kernel := testELF(t, true, 64<<10)
	good := bzImage(compress(t, "zstd", kernel))
	oldProto := bytes.Clone(good)
	binary.LittleEndian.PutUint16(oldProto[offVersion:], 0x0206)
	lzo := bzImage(append([]byte{0x89, 'L', 'Z', 'O', 0, 0x0d}, make([]byte, 64)...))
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
	wrongSize := compress(t, "xz", kernel)
	binary.LittleEndian.PutUint32(wrongSize[len(wrongSize)-4:], uint32(len(kernel)-1))
	damaged := compress(t, "lz4", kernel)
	for i := 40; i < 80; i++ {
		damaged[i] ^= 0x5a
	}
	for name, payload := range map[string][]byte{"size trailer": wrongSize, "damaged": damaged} {
		img := bzImage(payload)
		if _, err := Extract(bytes.NewReader(img), int64(len(img)), io.Discard); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
}

func TestPVHEntry(t *testing.T) {
	entry, ok, err := PVHEntry(writeTemp(t, "vmlinux", testELF(t, true, 4096)))
	if err != nil || !ok || entry != 0x1000850 {
		t.Fatalf("PVHEntry = %#x, %v, %v; want 0x1000850, true", entry, ok, err)
	}
	if _, ok, err := PVHEntry(writeTemp(t, "vmlinux", testELF(t, false, 4096))); err != nil || ok {
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
	kernel := testELF(t, true, 1<<20)
	img := writeTemp(t, "vmlinuz-1", bzImage(compress(t, "lz4", kernel)))

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
	img2 := writeTemp(t, "vmlinuz-2", bzImage(compress(t, "gzip", testELF(t, true, 1<<19))))
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
	if _, err := c.PVH(ctx, writeTemp(t, "vmlinux", testELF(t, false, 4096))); !errors.Is(err, ErrNoPVH) {
		t.Fatalf("ELF without PVH: %v, want ErrNoPVH", err)
	}
	noPVH := writeTemp(t, "vmlinuz-3", bzImage(compress(t, "zstd", testELF(t, false, 1<<16))))
	if _, err := c.PVH(ctx, noPVH); !errors.Is(err, ErrNoPVH) {
		t.Fatalf("bzImage without PVH: %v, want ErrNoPVH", err)
	}
	damaged := compress(t, "zstd", kernel)
	damaged[len(damaged)/2] ^= 0xff
	if _, err := c.PVH(ctx, writeTemp(t, "vmlinuz-4", bzImage(damaged))); err == nil {
		t.Fatal("damaged bzImage: no error")
	}
	entries, _ := os.ReadDir(dir)
	if len(entries) != 1 || filepath.Join(dir, entries[0].Name()) != p2 {
		var names []string
		for _, e := range entries {
			names = append(names, e.Name())
		}
		t.Fatalf("cache holds %v, want only %s", names, filepath.Base(p2))
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
