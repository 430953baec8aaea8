// Package rundirs carries the directory tree of a root filesystem's /run into the memory
// file system mounted over it when a sandbox boots.
//
// /run is a tmpfs in every sandbox, as on a booted Linux machine: what programs keep
// there (pid files, locks, unix sockets) lives in the sandbox's memory and is gone at
// the next boot. On gVisor that also means a socket there is the Sentry's own, which a
// checkpoint saves; one bound on the disk is a host socket, which it cannot. But
// templates install packages that make their directories in /run when they are built
// (PostgreSQL's /run/postgresql, owned by its user), and a machine booting systemd
// makes them again from tmpfiles.d. A sandbox boots no systemd, so the tmpfs starts
// with the template's directories and symbolic links — not its files: a file in /run
// on the disk is a leftover from a run before (a pid file, a socket) and means nothing
// after a boot.
//
// Scan reads the tree (on the host for gVisor, through an os.Root, since a sandbox
// that ran before may have planted links anywhere in it; in the guest before the tmpfs
// is mounted for VMs), bounded in depth and count; Make recreates it.
package rundirs

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"slices"
	"strings"
	"syscall"

	"github.com/spacedev/space/internal/guest/wire"
)

// FileName is the manifest's name in the agent's run directory (gVisor: the node writes
// it before a boot; the agent applies and removes it).
const FileName = "run-dirs.json"

// Bounds of a scan: deeper or further entries are left out.
const (
	MaxDepth   = 6
	MaxEntries = 512
)

// ScanRootFS lists the directories and links of the /run of the root filesystem at
// rootfs (Scan through an os.Root), leaving out the agent's own run dir.
func ScanRootFS(rootfs string) ([]Entry, error) {
	root, err := os.OpenRoot(rootfs)
	if err != nil {
		return nil, fmt.Errorf("open rootfs: %w", err)
	}
	defer root.Close()
	return Scan(root, "run", strings.TrimPrefix(wire.RunMountDir, "/run/"))
}

// Entry is one directory or symbolic link, relative to /run.
type Entry struct {
	Path string      `json:"path"`
	Mode fs.FileMode `json:"mode"` // permission, setgid and sticky bits, and ModeSymlink
	UID  int         `json:"uid"`
	GID  int         `json:"gid"`
	Link string      `json:"link,omitempty"`
}

// Scan lists the directories and symbolic links under dir of root, parents first,
// leaving out the names in skip (relative to dir: the mount points of the agent's own
// directories) and anything past MaxDepth or MaxEntries. A missing dir is an empty tree.
func Scan(root *os.Root, dir string, skip ...string) ([]Entry, error) {
	var out []Entry
	var walk func(rel string, depth int) error
	walk = func(rel string, depth int) error {
		f, err := root.Open(path.Join(dir, rel))
		if err != nil {
			return err
		}
		names, err := f.Readdirnames(-1)
		f.Close()
		if err != nil {
			return err
		}
		slices.Sort(names)
		for _, name := range names {
			if len(out) >= MaxEntries {
				return nil
			}
			p := path.Join(rel, name)
			if slices.Contains(skip, p) {
				continue
			}
			fi, err := root.Lstat(path.Join(dir, p))
			if err != nil {
				continue // gone meanwhile
			}
			e := Entry{Path: p, Mode: fi.Mode() & (fs.ModePerm | fs.ModeSetgid | fs.ModeSticky | fs.ModeSymlink)}
			if st, ok := fi.Sys().(*syscall.Stat_t); ok {
				e.UID, e.GID = int(st.Uid), int(st.Gid)
			}
			switch {
			case fi.Mode()&fs.ModeSymlink != 0:
				if e.Link, err = root.Readlink(path.Join(dir, p)); err != nil {
					continue
				}
				out = append(out, e)
			case fi.IsDir():
				out = append(out, e)
				if depth < MaxDepth {
					if err := walk(p, depth+1); err != nil {
						return err
					}
				}
			}
		}
		return nil
	}
	if fi, err := root.Lstat(dir); err != nil || !fi.IsDir() {
		return nil, nil
	}
	if err := walk("", 1); err != nil {
		return nil, fmt.Errorf("scan %s: %w", dir, err)
	}
	return out, nil
}

// Make recreates entries under dir (an empty tmpfs): each directory with its mode and
// owner, each link as it was. An entry whose path is not clean and relative, or whose
// parent is missing, is left out; the first other failure is returned after the rest
// were tried.
func Make(dir string, entries []Entry) error {
	var errs []error
	for _, e := range entries {
		if !fs.ValidPath(e.Path) || e.Path == "." {
			continue
		}
		p := path.Join(dir, e.Path)
		link := e.Mode&fs.ModeSymlink != 0
		var err error
		if link {
			err = os.Symlink(e.Link, p)
		} else {
			err = os.Mkdir(p, 0o700)
		}
		if errors.Is(err, fs.ErrNotExist) {
			continue // its parent was left out
		}
		if err == nil {
			err = os.Lchown(p, e.UID, e.GID)
		}
		if err == nil && !link {
			// After the chown, which may clear setgid; Mkdir's mode passes the umask and
			// drops setgid and sticky bits.
			err = os.Chmod(p, e.Mode&(fs.ModePerm|fs.ModeSetgid|fs.ModeSticky))
		}
		if err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// Write saves a manifest of entries as file.
func Write(file string, entries []Entry) error {
	data, err := json.Marshal(entries)
	if err != nil {
		return err
	}
	return os.WriteFile(file, data, 0o600)
}

// Apply makes the tree a manifest file describes under dir and removes the file. No
// file: nothing to do.
func Apply(file, dir string) error {
	data, err := os.ReadFile(file)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	var entries []Entry
	if err := json.Unmarshal(data, &entries); err != nil {
		return fmt.Errorf("%s: %w", file, err)
	}
	err = Make(dir, entries)
	return errors.Join(err, os.Remove(file))
}
