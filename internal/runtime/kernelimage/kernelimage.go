// Package kernelimage turns a distribution's compressed x86 kernel (a bzImage, e.g.
// Debian's /boot/vmlinuz-*) into the uncompressed ELF kernel (vmlinux) inside it, and
// tells whether an ELF kernel can be booted through its PVH entry point.
//
// QEMU boots a PVH-capable vmlinux by mapping the file instead of copying it: the VMM's
// copy of a bzImage (14 MiB of anonymous memory per VM with Debian's cloud kernel)
// becomes page cache shared by every VM, and the guest skips its decompressor. The
// extraction follows the Linux x86 boot protocol (Documentation/x86/boot.rst): the
// setup header's payload_offset and payload_length locate the compressed vmlinux, its
// first bytes name the compression, and its last four bytes hold the uncompressed size.
// The decompressors are the standard library's and well-kept modules'; only the
// framing is read here (the kernel source tree's scripts/extract-vmlinux does the same
// by scanning for magic numbers, which can match inside the setup code).
package kernelimage

import (
	"bytes"
	"compress/bzip2"
	"compress/gzip"
	"debug/elf"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"

	"github.com/klauspost/compress/zstd"
	"github.com/pierrec/lz4/v4"
	"github.com/ulikunitz/xz"
	"github.com/ulikunitz/xz/lzma"
)

// ErrUnsupported is returned for kernels this package cannot unpack: not a bzImage, a
// boot protocol older than 2.08 (no payload fields) or a compression it has no reader
// for (LZO).
var ErrUnsupported = errors.New("kernelimage: unsupported kernel image")

// maxKernel bounds the uncompressed kernel (Debian's is 53 MB).
const maxKernel = 512 << 20

// Setup header fields (Linux x86 boot protocol).
const (
	offSetupSects    = 0x1f1
	offHeaderMagic   = 0x202
	offVersion       = 0x206
	offPayloadOffset = 0x248
	offPayloadLength = 0x24c
	headerEnd        = 0x250
	minVersion       = 0x0208 // payload_offset and payload_length
)

// Payload describes the compressed kernel inside a bzImage.
type Payload struct {
	// Offset and Length locate it in the file.
	Offset, Length int64
	// Compression is the format its magic number names: gzip, bzip2, lzma, xz, lzo,
	// lz4 or zstd.
	Compression string
	// Size is the uncompressed size the image records.
	Size int64
}

// IsELF reports whether the file at path starts with the ELF magic number.
func IsELF(path string) (bool, error) {
	f, err := os.Open(path)
	if err != nil {
		return false, err
	}
	defer f.Close()
	var magic [4]byte
	if _, err := io.ReadFull(f, magic[:]); err != nil {
		if errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) {
			return false, nil
		}
		return false, err
	}
	return string(magic[:]) == elf.ELFMAG, nil
}

// Locate reads a bzImage's setup header and finds its compressed payload.
func Locate(r io.ReaderAt, size int64) (Payload, error) {
	var hdr [headerEnd]byte
	if size < headerEnd {
		return Payload{}, fmt.Errorf("%w: %d bytes is too small for a bzImage", ErrUnsupported, size)
	}
	if _, err := r.ReadAt(hdr[:], 0); err != nil {
		return Payload{}, fmt.Errorf("kernelimage: read setup header: %w", err)
	}
	if string(hdr[offHeaderMagic:offHeaderMagic+4]) != "HdrS" {
		return Payload{}, fmt.Errorf("%w: no bzImage setup header", ErrUnsupported)
	}
	if v := binary.LittleEndian.Uint16(hdr[offVersion:]); v < minVersion {
		return Payload{}, fmt.Errorf("%w: boot protocol %d.%02d (payload fields need 2.08)", ErrUnsupported, v>>8, v&0xff)
	}
	setupSects := int64(hdr[offSetupSects])
	if setupSects == 0 {
		setupSects = 4
	}
	p := Payload{
		Offset: (setupSects+1)*512 + int64(binary.LittleEndian.Uint32(hdr[offPayloadOffset:])),
		Length: int64(binary.LittleEndian.Uint32(hdr[offPayloadLength:])),
	}
	if p.Length < 8 || p.Offset+p.Length > size {
		return Payload{}, fmt.Errorf("%w: payload %d+%d outside the %d-byte file", ErrUnsupported, p.Offset, p.Length, size)
	}
	var head [6]byte
	if _, err := r.ReadAt(head[:], p.Offset); err != nil {
		return Payload{}, fmt.Errorf("kernelimage: read payload: %w", err)
	}
	var tail [4]byte
	if _, err := r.ReadAt(tail[:], p.Offset+p.Length-4); err != nil {
		return Payload{}, fmt.Errorf("kernelimage: read payload size: %w", err)
	}
	p.Size = int64(binary.LittleEndian.Uint32(tail[:]))
	switch {
	case bytes.HasPrefix(head[:], []byte{0x1f, 0x8b}):
		p.Compression = "gzip"
	case bytes.HasPrefix(head[:], []byte("BZh")):
		p.Compression = "bzip2"
	case bytes.HasPrefix(head[:], []byte{0x5d, 0x00, 0x00}):
		p.Compression = "lzma"
	case bytes.HasPrefix(head[:], []byte{0xfd, '7', 'z', 'X', 'Z', 0x00}):
		p.Compression = "xz"
	case bytes.HasPrefix(head[:], []byte{0x89, 'L', 'Z', 'O'}):
		p.Compression = "lzo"
	case bytes.HasPrefix(head[:], []byte{0x02, 0x21, 0x4c, 0x18}):
		p.Compression = "lz4"
	case bytes.HasPrefix(head[:], []byte{0x28, 0xb5, 0x2f, 0xfd}):
		p.Compression = "zstd"
	default:
		return Payload{}, fmt.Errorf("%w: unknown payload compression (first bytes % x)", ErrUnsupported, head)
	}
	if p.Size <= 0 || p.Size > maxKernel {
		return Payload{}, fmt.Errorf("%w: recorded kernel size %d", ErrUnsupported, p.Size)
	}
	return p, nil
}

// Extract writes the uncompressed kernel of the bzImage r (size bytes) to w and returns
// its payload. It fails, having written part of it, when the output is not exactly the
// size the image records.
func Extract(r io.ReaderAt, size int64, w io.Writer) (Payload, error) {
	p, err := Locate(r, size)
	if err != nil {
		return p, err
	}
	// The kernel's build appends the uncompressed size to every format but gzip, whose
	// own trailer ends with it; the other readers would take it for another stream.
	n := p.Length
	if p.Compression != "gzip" {
		n -= 4
	}
	src := io.NewSectionReader(r, p.Offset, n)
	var dec io.Reader
	switch p.Compression {
	case "gzip":
		zr, err := gzip.NewReader(src)
		if err != nil {
			return p, fmt.Errorf("kernelimage: gzip: %w", err)
		}
		zr.Multistream(false)
		dec = zr
	case "bzip2":
		dec = bzip2.NewReader(src)
	case "lzma":
		lr, err := lzma.NewReader(src)
		if err != nil {
			return p, fmt.Errorf("kernelimage: lzma: %w", err)
		}
		dec = lr
	case "xz":
		xr, err := xz.NewReader(src)
		if err != nil {
			return p, fmt.Errorf("kernelimage: xz: %w", err)
		}
		dec = xr
	case "lz4":
		dec = lz4.NewReader(src)
	case "zstd":
		zr, err := zstd.NewReader(src, zstd.WithDecoderConcurrency(1), zstd.WithDecoderMaxMemory(maxKernel))
		if err != nil {
			return p, fmt.Errorf("kernelimage: zstd: %w", err)
		}
		defer zr.Close()
		dec = zr
	default:
		return p, fmt.Errorf("%w: %s payload", ErrUnsupported, p.Compression)
	}
	got, err := io.Copy(w, io.LimitReader(dec, p.Size+1))
	if err != nil {
		return p, fmt.Errorf("kernelimage: %s: %w", p.Compression, err)
	}
	if got != p.Size {
		return p, fmt.Errorf("kernelimage: %s payload gave %d bytes, the image records %d", p.Compression, got, p.Size)
	}
	return p, nil
}

// PVH entry point note: XEN_ELFNOTE_PHYS32_ENTRY in a "Xen" note (QEMU looks for it in
// the program headers' notes).
const (
	xenNoteName      = "Xen"
	xenPhys32EntryNT = 18
)

// PVHEntry returns the 32-bit physical entry point an x86-64 ELF kernel declares for PVH
// boot, and false when it declares none (a kernel built without CONFIG_PVH).
func PVHEntry(path string) (uint64, bool, error) {
	f, err := elf.Open(path)
	if err != nil {
		return 0, false, fmt.Errorf("kernelimage: %w", err)
	}
	defer f.Close()
	if f.Machine != elf.EM_X86_64 {
		return 0, false, fmt.Errorf("kernelimage: %s is a %s ELF, not x86-64", path, f.Machine)
	}
	for _, prog := range f.Progs {
		if prog.Type != elf.PT_NOTE {
			continue
		}
		data, err := io.ReadAll(io.LimitReader(prog.Open(), 1<<20))
		if err != nil {
			return 0, false, fmt.Errorf("kernelimage: read notes: %w", err)
		}
		if entry, ok := findNote(data, f.ByteOrder); ok {
			return entry, true, nil
		}
	}
	return 0, false, nil
}

// findNote walks ELF notes (each: namesz, descsz, type, then name and descriptor, both
// padded to 4 bytes) for the PVH entry.
func findNote(data []byte, bo binary.ByteOrder) (uint64, bool) {
	pad := func(n uint32) int { return int((n + 3) &^ 3) }
	for len(data) >= 12 {
		namesz, descsz, typ := bo.Uint32(data), bo.Uint32(data[4:]), bo.Uint32(data[8:])
		data = data[12:]
		if pad(namesz) > len(data) {
			return 0, false
		}
		name := string(bytes.TrimRight(data[:namesz], "\x00"))
		data = data[pad(namesz):]
		if pad(descsz) > len(data) {
			return 0, false
		}
		desc := data[:descsz]
		data = data[pad(descsz):]
		if name != xenNoteName || typ != xenPhys32EntryNT {
			continue
		}
		switch len(desc) {
		case 4:
			return uint64(bo.Uint32(desc)), true
		case 8:
			return bo.Uint64(desc), true
		}
	}
	return 0, false
}
