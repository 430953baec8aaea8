// Package kernelimagetest makes small kernels for tests: an x86-64 ELF (with or without a
// PVH entry note) and a bzImage wrapping one the way the kernel's build does.
package kernelimagetest

import (
	"bytes"
	"compress/gzip"
	"debug/elf"
	"encoding/binary"
	"io"
	"math/rand/v2"
	"testing"

	"github.com/klauspost/compress/zstd"
	"github.com/pierrec/lz4/v4"
	"github.com/ulikunitz/xz"
	"github.com/ulikunitz/xz/lzma"
)

// PVHEntry is the entry point ELF writes into its PVH note.
const PVHEntry = 0x1000850

// Setup header offsets (Linux x86 boot protocol), fixed by the protocol; written out
// again here because package kernelimage's own tests import this one.
const (
	offSetupSects    = 0x1f1
	offHeaderMagic   = 0x202
	offVersion       = 0x206
	offPayloadOffset = 0x248
	offPayloadLength = 0x24c
)

// ELF builds an x86-64 ELF of size bytes with a PT_NOTE segment: with pvh, the notes
// carry a Xen PHYS32_ENTRY note for PVHEntry (behind other notes, as in a real kernel);
// the rest is bytes that compress only in part.
func ELF(t testing.TB, pvh bool, size int) []byte {
	t.Helper()
	const phys32Entry = 18
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
	note("GNU", phys32Entry, make([]byte, 8)) // the right type, another owner
	if pvh {
		note("Xen", phys32Entry, binary.LittleEndian.AppendUint64(nil, PVHEntry))
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

// Compress returns kernel compressed as the kernel's build does: the format's stream
// (gzip, lzma, xz, lz4 in its legacy frame, or zstd), then, but for gzip, whose trailer
// ends with it, the uncompressed size.
func Compress(t testing.TB, format string, kernel []byte) []byte {
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
		t.Fatalf("kernelimagetest: no writer for %s", format)
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

// BzImage wraps payload in a setup header (boot protocol 2.15, 3 setup sectors) with
// protected-mode code before and after it, as a real bzImage has.
func BzImage(payload []byte) []byte {
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
