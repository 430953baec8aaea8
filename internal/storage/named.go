package storage

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
)

// Named snapshots (a sandbox's memory and disk kept as a resource of its own) live
// outside every sandbox volume, so that they outlive the sandbox they were taken from:
//
//	snapshots/<id>/{checkpoint,disk}
//
// A snapshot directory is made complete in tmp/ and renamed into snapshots/ (one
// rename), and removed with RemoveAll (one rename into tmp/ first), so snapshots/ only
// ever holds complete entries.

const namedSnapshotsDir = "snapshots"

// SnapshotDir returns snapshots/<id>, the directory of named snapshot id (it may not
// exist). Snapshot ids have the form of sandbox ids.
func (s *Store) SnapshotDir(id string) (string, error) {
	if err := ValidateID(id); err != nil {
		return "", err
	}
	return filepath.Join(s.root, namedSnapshotsDir, id), nil
}

// ListSnapshotDirs returns the ids of the named snapshots in the store, sorted.
func (s *Store) ListSnapshotDirs() ([]string, error) {
	return listIDs(filepath.Join(s.root, namedSnapshotsDir))
}

// listIDs lists the entries of dir that are valid ids (none if dir is missing).
func listIDs(dir string) ([]string, error) {
	entries, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("storage: %w", err)
	}
	var out []string
	for _, e := range entries {
		if e.IsDir() && ValidateID(e.Name()) == nil {
			out = append(out, e.Name())
		}
	}
	sort.Strings(out)
	return out, nil
}
