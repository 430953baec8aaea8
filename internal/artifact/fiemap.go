package artifact

import (
	"os"
	"sort"
	"unsafe"

	"golang.org/x/sys/unix"
)

// FIEMAP tells which disk extents back a file. Two files share a range (a reflink copy
// that neither has written since) exactly when the same file offsets map to the same
// disk bytes; PushSnapshot uses it to pick, among the disk bases it has, the one a VM
// disk was copied from. golang.org/x/sys/unix has neither the ioctl number nor the
// structs, which are declared here from linux/fiemap.h.

const (
	iocFiemap = 0xc020660b // FS_IOC_FIEMAP: _IOWR('f', 11, struct fiemap)

	fiemapFlagSync   = 0x1 // FIEMAP_FLAG_SYNC: flush dirty data first
	fiemapExtentLast = 0x1 // FIEMAP_EXTENT_LAST
	// fiemapUnshared marks extents whose disk address says nothing about sharing:
	// unknown, delayed allocation, inline data.
	fiemapUnshared = 0x2 | 0x4 | 0x200
	fiemapBatch    = 256
)

type fiemapHeader struct {
	start, length                uint64
	flags, mapped, count, unused uint32
}

type fiemapExtent struct {
	logical, physical, length uint64
	reserved64                [2]uint64
	flags                     uint32
	reserved                  [3]uint32
}

type extent struct{ logical, physical, length uint64 }

// extents returns the data extents of the file at path, in file order.
func extents(path string) ([]extent, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	buf := make([]byte, unsafe.Sizeof(fiemapHeader{})+fiemapBatch*unsafe.Sizeof(fiemapExtent{}))
	hdr := (*fiemapHeader)(unsafe.Pointer(&buf[0]))
	exts := unsafe.Slice((*fiemapExtent)(unsafe.Pointer(&buf[unsafe.Sizeof(fiemapHeader{})])), fiemapBatch)
	var out []extent
	var start uint64
	for {
		*hdr = fiemapHeader{start: start, length: ^uint64(0) - start, flags: fiemapFlagSync, count: fiemapBatch}
		if _, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), iocFiemap, uintptr(unsafe.Pointer(&buf[0]))); errno != 0 {
			return nil, &os.PathError{Op: "fiemap", Path: path, Err: errno}
		}
		if hdr.mapped == 0 {
			return out, nil
		}
		for _, e := range exts[:hdr.mapped] {
			if e.flags&fiemapUnshared == 0 {
				out = append(out, extent{e.logical, e.physical, e.length})
			}
			start = e.logical + e.length
			if e.flags&fiemapExtentLast != 0 {
				return out, nil
			}
		}
	}
}

// sharedBytes returns how many bytes of a and b are the same disk bytes at the same
// file offsets.
func sharedBytes(a, b []extent) uint64 {
	sort.Slice(a, func(i, j int) bool { return a[i].logical < a[j].logical })
	sort.Slice(b, func(i, j int) bool { return b[i].logical < b[j].logical })
	var shared uint64
	i, j := 0, 0
	for i < len(a) && j < len(b) {
		x, y := a[i], b[j]
		lo, hi := max(x.logical, y.logical), min(x.logical+x.length, y.logical+y.length)
		if lo < hi && x.physical-x.logical == y.physical-y.logical {
			shared += hi - lo
		}
		if x.logical+x.length < y.logical+y.length {
			i++
		} else {
			j++
		}
	}
	return shared
}
