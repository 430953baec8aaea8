package agent

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/guest/wire"
)

// File metadata (E2B's files.write(path, data, {metadata}), returned in every entry)
// lives where envd keeps it: user extended attributes, user.e2b.<key>, which travel
// with the file (renames, hard links, copies with xattrs). Not every file system has
// user extended attributes: gVisor's root file system (host-backed through its gofer)
// and ramfs refuse them (ENOTSUP). For files there the agent keeps the metadata itself,
// in a sidecar store: one JSON file it owns (metaStoreFile under Config.StateDir,
// mode 0600, root's), mapping an absolute path to the file's inode number and its
// metadata.
//
// An entry holds only while the path still names the same inode. The agent's own file
// operations keep the store right: a move (envd Move, the agent's /v1/files/move)
// carries the entries of the path and everything under it to the new path, a remove
// drops them, a write with metadata replaces them. What programs in the sandbox do is
// not seen: a file renamed by a program loses its metadata (the old path no longer
// names its inode), a file replaced by a program (a new inode) has none, and a file a
// program deletes and creates again at the same path keeps the old metadata only if
// the file system hands out the same inode number again. The store is capped at
// metaStoreMax entries (stale entries are pruned first); beyond that a write with
// metadata fails with 507 and writes nothing.

const (
	metadataXattrPrefix = "user.e2b."
	// metaStoreFile is the sidecar store's file name under Config.StateDir.
	metaStoreFile = "file-metadata.json"
	metaStoreMax  = 10000
	// Limits of one file's metadata (checked before anything is written): they keep
	// every value readable with one getxattr buffer and the store small.
	maxMetadataKeys     = 64
	maxMetadataKeyLen   = 128
	maxMetadataValueLen = 4096
)

// metaEntry is one file's metadata in the sidecar store.
type metaEntry struct {
	Ino      uint64            `json:"ino"`
	Metadata map[string]string `json:"metadata"`
}

// metaStore is the sidecar store: file metadata for file systems without extended
// attributes, persisted to path (memory only when path is empty).
type metaStore struct {
	path string

	mu      sync.Mutex
	loaded  bool
	entries map[string]metaEntry
}

func newMetaStore(path string) *metaStore { return &metaStore{path: path} }

// validateMetadata checks md against the limits before a write touches anything.
func validateMetadata(md map[string]string) error {
	if len(md) > maxMetadataKeys {
		return badRequest("at most %d metadata keys per file", maxMetadataKeys)
	}
	for k, v := range md {
		if k == "" || len(k) > maxMetadataKeyLen {
			return badRequest("metadata key %q must have 1 to %d characters", k, maxMetadataKeyLen)
		}
		if len(v) > maxMetadataValueLen {
			return badRequest("metadata value for %q is longer than %d bytes", k, maxMetadataValueLen)
		}
	}
	return nil
}

// get returns the metadata of path (nil when it has none). fi is path's lstat.
func (s *metaStore) get(path string, fi os.FileInfo) map[string]string {
	if md := readXattrMetadata(path); md != nil {
		return md
	}
	ino, ok := inodeOf(fi)
	if !ok {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.loadLocked(); err != nil {
		return nil
	}
	e, ok := s.entries[path]
	if !ok || e.Ino != ino {
		return nil
	}
	return cloneMetadata(e.Metadata)
}

// set replaces the metadata of the file at path (not a symbolic link): in extended
// attributes where the file system has them, else in the store.
func (s *metaStore) set(path string, md map[string]string) error {
	err := writeXattrMetadata(path, md)
	if err == nil {
		// A file on a file system with xattrs needs no entry (one may be left from a
		// file that was at this path before; get reads the attributes first anyway, so
		// a store that cannot be read does not fail the write).
		_ = s.forget(path, false)
		return nil
	}
	if !errors.Is(err, unix.ENOTSUP) {
		return err
	}
	fi, err := os.Lstat(path)
	if err != nil {
		return err
	}
	ino, ok := inodeOf(fi)
	if !ok {
		return fmt.Errorf("set metadata on %s: no inode number", path)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.loadLocked(); err != nil {
		return err
	}
	if _, exists := s.entries[path]; !exists && len(s.entries) >= metaStoreMax {
		s.pruneLocked()
		if len(s.entries) >= metaStoreMax {
			return &apiError{status: http.StatusInsufficientStorage, code: wire.ErrCodeNoSpace, msg: fmt.Sprintf("file metadata store is full (%d files)", metaStoreMax)}
		}
	}
	prev, had := s.entries[path]
	s.entries[path] = metaEntry{Ino: ino, Metadata: cloneMetadata(md)}
	if err := s.saveLocked(); err != nil {
		if had {
			s.entries[path] = prev
		} else {
			delete(s.entries, path)
		}
		return err
	}
	return nil
}

// move carries the entries of from and of everything under it to to, dropping what
// to replaced. Called after a successful rename.
func (s *metaStore) move(from, to string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.loadLocked(); err != nil {
		return err
	}
	changed := false
	for p := range s.entries {
		if under(p, to) {
			delete(s.entries, p)
			changed = true
		}
	}
	moved := map[string]metaEntry{}
	for p, e := range s.entries {
		if under(p, from) {
			moved[to+strings.TrimPrefix(p, from)] = e
			delete(s.entries, p)
		}
	}
	for p, e := range moved {
		s.entries[p] = e
		changed = true
	}
	if !changed {
		return nil
	}
	return s.saveLocked()
}

// forget drops the entry of path and, with tree, of everything under it.
func (s *metaStore) forget(path string, tree bool) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.loadLocked(); err != nil {
		return err
	}
	changed := false
	for p := range s.entries {
		if p == path || (tree && under(p, path)) {
			delete(s.entries, p)
			changed = true
		}
	}
	if !changed {
		return nil
	}
	return s.saveLocked()
}

// under reports whether p is dir or below it.
func under(p, dir string) bool {
	if dir == "/" {
		return true
	}
	return p == dir || strings.HasPrefix(p, dir+"/")
}

// pruneLocked drops entries whose path no longer names their inode.
func (s *metaStore) pruneLocked() {
	for p, e := range s.entries {
		fi, err := os.Lstat(p)
		if err != nil {
			delete(s.entries, p)
			continue
		}
		if ino, ok := inodeOf(fi); !ok || ino != e.Ino {
			delete(s.entries, p)
		}
	}
}

// loadLocked reads the store file once. A missing file is an empty store; an
// unreadable one is reported (and the write that needed it fails) rather than
// silently replaced.
func (s *metaStore) loadLocked() error {
	if s.loaded {
		return nil
	}
	s.entries = map[string]metaEntry{}
	if s.path != "" {
		data, err := os.ReadFile(s.path)
		switch {
		case errors.Is(err, fs.ErrNotExist):
		case err != nil:
			return storeError("read file metadata store", err)
		default:
			var doc struct {
				Entries map[string]metaEntry `json:"entries"`
			}
			if err := json.Unmarshal(data, &doc); err != nil {
				return storeError("file metadata store "+s.path+" is corrupt", err)
			}
			if doc.Entries != nil {
				s.entries = doc.Entries
			}
		}
	}
	s.loaded = true
	return nil
}

// saveLocked writes the store: a temporary file renamed over the old one.
func (s *metaStore) saveLocked() error {
	if s.path == "" {
		return nil
	}
	data, err := json.Marshal(struct {
		Version int                  `json:"version"`
		Entries map[string]metaEntry `json:"entries"`
	}{1, s.entries})
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(s.path), 0o700); err != nil {
		return storeError("save file metadata", err)
	}
	tmp := s.path + ".tmp"
	if err := os.WriteFile(tmp, data, 0o600); err != nil {
		_ = os.Remove(tmp)
		return storeError("save file metadata", err)
	}
	if err := os.Rename(tmp, s.path); err != nil {
		_ = os.Remove(tmp)
		return storeError("save file metadata", err)
	}
	return nil
}

// storeError reports a failure of the store itself: the agent's problem (500), or no
// space (507), whatever errno the file system gave (a path error would otherwise
// read as the client's).
func storeError(what string, err error) error {
	if errors.Is(err, unix.ENOSPC) || errors.Is(err, unix.EDQUOT) {
		return &apiError{status: http.StatusInsufficientStorage, code: wire.ErrCodeNoSpace, msg: what + ": " + err.Error()}
	}
	return &apiError{status: http.StatusInternalServerError, code: wire.ErrCodeInternal, msg: what + ": " + err.Error()}
}

func inodeOf(fi os.FileInfo) (uint64, bool) {
	if fi == nil {
		return 0, false
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return 0, false
	}
	return st.Ino, true
}

func cloneMetadata(md map[string]string) map[string]string {
	if md == nil {
		return nil
	}
	out := make(map[string]string, len(md))
	for k, v := range md {
		out[k] = v
	}
	return out
}

// readXattrMetadata returns the metadata in path's extended attributes (nil when
// none or unsupported).
func readXattrMetadata(path string) map[string]string {
	buf := make([]byte, 4096)
	n, err := unix.Llistxattr(path, buf)
	if errors.Is(err, unix.ERANGE) {
		if sz, err2 := unix.Llistxattr(path, nil); err2 == nil {
			buf = make([]byte, sz)
			n, err = unix.Llistxattr(path, buf)
		}
	}
	if err != nil || n == 0 {
		return nil
	}
	var out map[string]string
	for _, name := range strings.Split(string(buf[:n]), "\x00") {
		key, ok := strings.CutPrefix(name, metadataXattrPrefix)
		if !ok || key == "" {
			continue
		}
		val := make([]byte, maxMetadataValueLen)
		m, err := unix.Lgetxattr(path, name, val)
		if err != nil {
			continue
		}
		if out == nil {
			out = map[string]string{}
		}
		out[key] = string(val[:m])
	}
	return out
}

// writeXattrMetadata replaces the metadata in path's extended attributes. An error
// wrapping unix.ENOTSUP means the file system has none (nothing was changed then).
func writeXattrMetadata(path string, md map[string]string) error {
	old := readXattrMetadata(path)
	for k, v := range md {
		if err := unix.Lsetxattr(path, metadataXattrPrefix+k, []byte(v), 0); err != nil {
			if errors.Is(err, unix.ENOTSUP) || errors.Is(err, unix.EOPNOTSUPP) {
				return fmt.Errorf("set metadata on %s: %w", path, unix.ENOTSUP)
			}
			return fmt.Errorf("set metadata %q on %s: %w", k, path, err)
		}
	}
	for k := range old {
		if _, keep := md[k]; !keep {
			_ = unix.Lremovexattr(path, metadataXattrPrefix+k)
		}
	}
	return nil
}
