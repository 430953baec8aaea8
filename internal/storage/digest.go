package storage

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"hash"
	"io"
	"os"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"
)

// digestVersion starts the digested byte stream, so that a future change of the record
// format cannot produce digests equal to today's.
const digestVersion = "space-tree-digest-v1\x00"

// TreeDigest computes the content digest of the directory tree at root and the total size
// of its regular files. The digest is "sha256:<hex>" of this byte stream:
//
//	"space-tree-digest-v1" NUL, then one record per entry, root first, depth-first with the
//	entries of each directory in byte order of their names (os.ReadDir order). A record is
//	nine fields, each followed by NUL:
//	  path     relative slash path ("." for root)
//	  type     f regular, d directory, l symlink, c char device, b block device, p fifo,
//	           s socket
//	  mode     permission bits incl. setuid/setgid/sticky, octal
//	  uid, gid decimal
//	  size     decimal; regular files only, else 0
//	  rdev     "major:minor" for device nodes, else empty
//	  target   symlink target, else empty
//	  content  lowercase hex sha256 of a regular file's bytes, else empty
//
// Paths and symlink targets cannot contain NUL, so the encoding is unambiguous.
// Timestamps, extended attributes and hard-link structure are not part of the digest:
// two trees with equal digests present the same files to a program that does not look
// at those.
func TreeDigest(ctx context.Context, root string) (digest string, size int64, err error) {
	w := &digestWalker{ctx: ctx, sum: sha256.New(), file: sha256.New(), buf: make([]byte, 1<<20)}
	io.WriteString(w.sum, digestVersion)
	if err := w.walk(root, "."); err != nil {
		return "", 0, fmt.Errorf("digest %s: %w", root, err)
	}
	return DigestPrefix + hex.EncodeToString(w.sum.Sum(nil)), w.size, nil
}

type digestWalker struct {
	ctx  context.Context
	sum  hash.Hash
	file hash.Hash
	buf  []byte
	size int64
	rec  []byte
}

func (w *digestWalker) walk(abs, rel string) error {
	if err := w.ctx.Err(); err != nil {
		return err
	}
	var st unix.Stat_t
	if err := unix.Lstat(abs, &st); err != nil {
		return fmt.Errorf("lstat %s: %w", abs, err)
	}
	var typ, rdev, target, content string
	var size int64
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
		typ = "f"
		size = st.Size
		sum, err := w.hashFile(abs)
		if err != nil {
			return err
		}
		content = sum
		w.size += size
	case unix.S_IFDIR:
		typ = "d"
	case unix.S_IFLNK:
		typ = "l"
		t, err := os.Readlink(abs)
		if err != nil {
			return err
		}
		target = t
	case unix.S_IFCHR, unix.S_IFBLK:
		typ = "c"
		if st.Mode&unix.S_IFMT == unix.S_IFBLK {
			typ = "b"
		}
		rdev = strconv.FormatUint(uint64(unix.Major(st.Rdev)), 10) + ":" + strconv.FormatUint(uint64(unix.Minor(st.Rdev)), 10)
	case unix.S_IFIFO:
		typ = "p"
	case unix.S_IFSOCK:
		typ = "s"
	default:
		return fmt.Errorf("%s: unknown file type %#o", abs, st.Mode&unix.S_IFMT)
	}
	r := w.rec[:0]
	for _, f := range []string{
		rel, typ,
		strconv.FormatUint(uint64(st.Mode&0o7777), 8),
		strconv.FormatUint(uint64(st.Uid), 10),
		strconv.FormatUint(uint64(st.Gid), 10),
		strconv.FormatInt(size, 10),
		rdev, target, content,
	} {
		r = append(r, f...)
		r = append(r, 0)
	}
	w.rec = r
	w.sum.Write(r)

	if typ != "d" {
		return nil
	}
	entries, err := os.ReadDir(abs)
	if err != nil {
		return err
	}
	for _, e := range entries {
		childRel := e.Name()
		if rel != "." {
			childRel = rel + "/" + e.Name()
		}
		if err := w.walk(filepath.Join(abs, e.Name()), childRel); err != nil {
			return err
		}
	}
	return nil
}

func (w *digestWalker) hashFile(path string) (string, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC|unix.O_NOCTTY|unix.O_NONBLOCK, 0)
	if err != nil {
		return "", fmt.Errorf("open %s: %w", path, err)
	}
	f := os.NewFile(uintptr(fd), path)
	defer f.Close()
	w.file.Reset()
	if _, err := io.CopyBuffer(w.file, struct{ io.Reader }{f}, w.buf); err != nil {
		return "", fmt.Errorf("read %s: %w", path, err)
	}
	return hex.EncodeToString(w.file.Sum(nil)), nil
}
