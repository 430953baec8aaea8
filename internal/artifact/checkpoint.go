package artifact

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"syscall"
	"time"

	"github.com/spacedev/space/internal/fault"
)

// A checkpoint directory (the runtime's memory and device state files) travels as a
// tar stream of its regular files and directories; its completion markers do not (a
// pull marks its copy complete itself, once every file is written). Nothing else is
// allowed in a checkpoint: links and device nodes would let an extracted checkpoint
// point outside its directory.

// completeMarker and writtenMarker are storage's completion markers of a checkpoint
// directory (durable, and complete on the boot of the host that wrote it).
const (
	completeMarker = "complete"
	writtenMarker  = "written"
)

// writeCheckpoint writes dir as a tar stream to w. Headers carry no owner and no
// sub-second times, so the same directory always gives the same stream.
func writeCheckpoint(ctx context.Context, dir string, w io.Writer) error {
	tw := tar.NewWriter(w)
	buf := make([]byte, 1<<20)
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		rel, err := filepath.Rel(dir, p)
		if err != nil {
			return err
		}
		if rel == "." || rel == completeMarker || rel == writtenMarker {
			return nil
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		hdr := &tar.Header{Name: filepath.ToSlash(rel), ModTime: info.ModTime().UTC().Truncate(time.Second)}
		switch {
		case info.IsDir():
			hdr.Typeflag, hdr.Name, hdr.Mode = tar.TypeDir, hdr.Name+"/", 0o700
			return tw.WriteHeader(hdr)
		case info.Mode().IsRegular():
			hdr.Typeflag, hdr.Size, hdr.Mode = tar.TypeReg, info.Size(), int64(info.Mode().Perm())
		default:
			return fault.New(fault.Invalid, "checkpoint %s: %s is neither a regular file nor a directory", dir, rel)
		}
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		f, err := os.Open(p)
		if err != nil {
			return err
		}
		defer f.Close()
		n, err := io.CopyBuffer(tw, struct{ io.Reader }{f}, buf)
		if err != nil {
			return err
		}
		if n != info.Size() {
			return fmt.Errorf("checkpoint file %s changed while it was read", rel)
		}
		return nil
	})
	if err != nil {
		return err
	}
	return tw.Close()
}

// extractCheckpoint reads a checkpoint tar stream into the new directory dir, confined
// to it (os.Root), writing runs of zeros as holes. The files' total size may not exceed
// limit. It does not mark the directory complete.
func extractCheckpoint(ctx context.Context, r io.Reader, dir string, limit int64) error {
	if err := os.Mkdir(dir, 0o700); err != nil {
		return noSpace(err)
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		return err
	}
	defer root.Close()
	tr := tar.NewReader(r)
	buf := make([]byte, 64<<10)
	var total int64
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return fault.New(fault.BadGateway, "checkpoint stream: %v", err)
		}
		name := path.Clean(hdr.Name)
		if !filepath.IsLocal(name) || name == completeMarker || name == writtenMarker {
			return fault.New(fault.BadGateway, "checkpoint stream: refused entry %q", hdr.Name)
		}
		switch hdr.Typeflag {
		case tar.TypeDir:
			if err := root.MkdirAll(name, 0o700); err != nil {
				return noSpace(err)
			}
		case tar.TypeReg:
			total += hdr.Size
			if hdr.Size < 0 || total > limit {
				return fault.New(fault.BadGateway, "checkpoint stream: files exceed the declared %d bytes", limit)
			}
			if err := writeSparse(root, name, tr, hdr.Size, os.FileMode(hdr.Mode).Perm()&0o700, buf); err != nil {
				return err
			}
		default:
			return fault.New(fault.BadGateway, "checkpoint stream: entry %q is neither a regular file nor a directory", hdr.Name)
		}
	}
	// The stream may carry padding after the archive's end.
	if _, err := io.Copy(io.Discard, r); err != nil {
		return err
	}
	return nil
}

// writeSparse creates name in root with size bytes from r, seeking over all-zero blocks
// so that a memory image's empty pages take no disk space.
func writeSparse(root *os.Root, name string, r io.Reader, size int64, perm os.FileMode, buf []byte) error {
	if perm == 0 {
		perm = 0o600
	}
	f, err := root.OpenFile(name, os.O_CREATE|os.O_EXCL|os.O_WRONLY, perm)
	if err != nil {
		return noSpace(err)
	}
	defer f.Close()
	var off int64
	for off < size {
		n, err := io.ReadFull(r, buf[:min(int64(len(buf)), size-off)])
		if n > 0 {
			if allZero(buf[:n]) {
				if _, err := f.Seek(int64(n), io.SeekCurrent); err != nil {
					return err
				}
			} else if _, err := f.Write(buf[:n]); err != nil {
				return noSpace(err)
			}
			off += int64(n)
		}
		if err != nil {
			return fault.New(fault.BadGateway, "checkpoint stream: %s: %v", name, err)
		}
	}
	if err := f.Truncate(size); err != nil {
		return noSpace(err)
	}
	return noSpace(f.Close())
}

func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

// noSpace gives an error caused by a full file system the kind
// fault.InsufficientStorage.
func noSpace(err error) error {
	if err != nil && (errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EDQUOT)) && !fault.Is(err, fault.InsufficientStorage) {
		return fault.New(fault.InsufficientStorage, "the store ran out of disk space: %v", err)
	}
	return err
}
