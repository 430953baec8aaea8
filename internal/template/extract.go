package template

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"strings"
	"syscall"
	"time"
)

// extractStats counts what an extraction wrote.
type extractStats struct {
	Files, Dirs, Links int
	Skipped            int
	Bytes              int64
}

// progressEvery is how often long extractions and copies report progress.
const progressEvery = 5 * time.Second

// extractTar writes a tar stream (a flattened image, or a directory walked by
// tarTree) into root. Every file system call goes through the os.Root, so no entry can
// create or change anything outside it: names with "..", absolute names, and names
// that lead through a symbolic link pointing outside (absolute links, "../" links) are
// refused and fail the extraction. Symbolic links themselves are created as they are
// (an absolute link target is resolved inside the sandbox later, never on the host).
// Owners, permission bits and modification times are kept. Setuid and setgid bits are
// kept too, because sandboxes need them (sudo inside); they are harmless on the host
// only because the store is mounted nosuid and its directories are 0700 (see
// docs/security.md, "Storage"). Device nodes and FIFOs are never created (the runtime
// provides /dev), nor hard links to them: an image cannot place a device node on the
// host, whatever the mount flags. Entries may come in any order (mutate.Extract emits
// the top layer first): missing parents are created and get their own mode when their
// entry arrives, and hard links are made at the end.
func extractTar(ctx context.Context, root *os.Root, r io.Reader, progress func(string)) (extractStats, error) {
	var st extractStats
	type hardlink struct{ name, target string }
	var links []hardlink
	skipped := map[string]bool{} // device nodes and FIFOs not created
	tr := tar.NewReader(r)
	last := time.Now()
	for {
		if err := ctx.Err(); err != nil {
			return st, err
		}
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return st, fmt.Errorf("read archive: %w", err)
		}
		name, err := entryName(hdr.Name)
		if err != nil {
			return st, err
		}
		if name == "." {
			continue // the root directory itself keeps its mode
		}
		if dir := path.Dir(name); dir != "." {
			if err := root.MkdirAll(dir, 0o755); err != nil {
				return st, fmt.Errorf("archive entry %q: create parent: %w", hdr.Name, err)
			}
		}
		switch hdr.Typeflag {
		case tar.TypeDir:
			if err := extractDir(root, name, hdr); err != nil {
				return st, fmt.Errorf("archive entry %q: %w", hdr.Name, err)
			}
			st.Dirs++
		case tar.TypeReg, tar.TypeRegA:
			n, err := extractFile(root, name, hdr, tr)
			if err != nil {
				return st, fmt.Errorf("archive entry %q: %w", hdr.Name, err)
			}
			st.Files++
			st.Bytes += n
		case tar.TypeSymlink:
			if err := replaceable(root, name); err != nil {
				return st, fmt.Errorf("archive entry %q: %w", hdr.Name, err)
			}
			if strings.ContainsRune(hdr.Linkname, 0) || hdr.Linkname == "" {
				return st, fmt.Errorf("archive entry %q: bad link target", hdr.Name)
			}
			if err := root.Symlink(hdr.Linkname, name); err != nil {
				return st, fmt.Errorf("archive entry %q: %w", hdr.Name, err)
			}
			if err := root.Lchown(name, hdr.Uid, hdr.Gid); err != nil {
				return st, fmt.Errorf("archive entry %q: %w", hdr.Name, err)
			}
			st.Links++
		case tar.TypeLink:
			target, err := entryName(hdr.Linkname)
			if err != nil || target == "." {
				return st, fmt.Errorf("archive entry %q: hard link target %q escapes the root filesystem", hdr.Name, hdr.Linkname)
			}
			links = append(links, hardlink{name: name, target: target})
		case tar.TypeChar, tar.TypeBlock, tar.TypeFifo:
			skipped[name] = true
			st.Skipped++
		default:
			// PAX global headers and the like: nothing to write.
			st.Skipped++
		}
		if progress != nil && time.Since(last) > progressEvery {
			last = time.Now()
			progress(fmt.Sprintf("extracted %d files, %d MiB so far", st.Files, st.Bytes>>20))
		}
	}
	for _, l := range links {
		if skipped[l.target] {
			st.Skipped++
			continue
		}
		if err := replaceable(root, l.name); err != nil {
			return st, fmt.Errorf("archive entry %q: %w", l.name, err)
		}
		if err := root.Link(l.target, l.name); err != nil {
			return st, fmt.Errorf("archive entry %q: hard link to %q: %w", l.name, l.target, err)
		}
		st.Links++
	}
	return st, nil
}

// entryName turns an archive name into a clean name relative to the root, refusing
// names that climb out of it.
func entryName(n string) (string, error) {
	if strings.ContainsRune(n, 0) {
		return "", fmt.Errorf("archive entry %q: name contains NUL", n)
	}
	clean := path.Clean("/" + n) // absolute names are taken relative to the root
	if strings.Contains("/"+n+"/", "/../") {
		return "", fmt.Errorf("archive entry %q escapes the root filesystem", n)
	}
	if clean == "/" {
		return ".", nil
	}
	return clean[1:], nil
}

// replaceable makes room for a non-directory entry: nothing there, or a
// non-directory (a duplicate in the stream) that is removed. A directory is kept and
// refused.
func replaceable(root *os.Root, name string) error {
	fi, err := root.Lstat(name)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if fi.IsDir() {
		return fmt.Errorf("a directory is in the way")
	}
	return root.Remove(name)
}

func extractDir(root *os.Root, name string, hdr *tar.Header) error {
	fi, err := root.Lstat(name)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		if err := root.Mkdir(name, 0o700); err != nil {
			return err
		}
	case err != nil:
		return err
	case !fi.IsDir():
		// A non-directory from a higher layer wins (mutate.Extract emits it first).
		return nil
	}
	if err := root.Lchown(name, hdr.Uid, hdr.Gid); err != nil {
		return err
	}
	return root.Chmod(name, modeOf(hdr))
}

func extractFile(root *os.Root, name string, hdr *tar.Header, r io.Reader) (int64, error) {
	if err := replaceable(root, name); err != nil {
		return 0, err
	}
	f, err := root.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return 0, err
	}
	n, err := io.Copy(f, io.LimitReader(r, hdr.Size))
	if err == nil && n != hdr.Size {
		err = io.ErrUnexpectedEOF
	}
	if err == nil {
		err = f.Chown(hdr.Uid, hdr.Gid)
	}
	if err == nil {
		err = f.Chmod(modeOf(hdr)) // after chown, which clears setuid
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return n, err
	}
	if !hdr.ModTime.IsZero() {
		_ = root.Chtimes(name, hdr.ModTime, hdr.ModTime)
	}
	return n, nil
}

// modeOf returns the entry's permission bits with setuid, setgid and sticky.
func modeOf(hdr *tar.Header) os.FileMode {
	m := os.FileMode(hdr.Mode & 0o777)
	if hdr.Mode&0o4000 != 0 {
		m |= os.ModeSetuid
	}
	if hdr.Mode&0o2000 != 0 {
		m |= os.ModeSetgid
	}
	if hdr.Mode&0o1000 != 0 {
		m |= os.ModeSticky
	}
	return m
}

// tarTree writes the tree under root as a tar stream: directories, regular files and
// symbolic links (as links) with their owners, modes and times. It reads only through
// the os.Root, so links inside the tree are never followed out of it.
func tarTree(ctx context.Context, root *os.Root, w io.Writer) error {
	tw := tar.NewWriter(w)
	err := fs.WalkDir(root.FS(), ".", func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		if p == "." {
			return nil
		}
		fi, err := root.Lstat(p)
		if err != nil {
			return err
		}
		link := ""
		switch {
		case fi.Mode()&fs.ModeSymlink != 0:
			if link, err = root.Readlink(p); err != nil {
				return err
			}
		case fi.IsDir(), fi.Mode().IsRegular():
		default:
			return nil // sockets, devices, FIFOs
		}
		hdr, err := tar.FileInfoHeader(fi, link)
		if err != nil {
			return err
		}
		hdr.Name = p
		if fi.IsDir() {
			hdr.Name += "/"
		}
		hdr.Uname, hdr.Gname = "", ""
		hdr.Format = tar.FormatPAX
		if sys, ok := fi.Sys().(*syscall.Stat_t); ok {
			hdr.Uid, hdr.Gid = int(sys.Uid), int(sys.Gid)
		}
		if !fi.Mode().IsRegular() {
			return tw.WriteHeader(hdr)
		}
		f, err := root.OpenFile(p, os.O_RDONLY|syscall.O_NOFOLLOW, 0)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		n, err := io.Copy(tw, io.LimitReader(f, hdr.Size))
		if err == nil && n != hdr.Size {
			err = fmt.Errorf("%s changed size while being read", p)
		}
		return err
	})
	if err != nil {
		return err
	}
	return tw.Close()
}

// copyTree copies the directory tree under src into dst (both os.Roots) through a
// tar stream: the same confined writer as image extraction.
func copyTree(ctx context.Context, src, dst *os.Root, progress func(string)) (extractStats, error) {
	pr, pw := io.Pipe()
	go func() { pw.CloseWithError(tarTree(ctx, src, pw)) }()
	st, err := extractTar(ctx, dst, pr, progress)
	if err == nil {
		_, err = io.Copy(io.Discard, pr) // the walk's error, if it failed after the last entry
	}
	pr.CloseWithError(errors.New("extraction ended"))
	return st, err
}
