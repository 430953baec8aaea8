package gvisor

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
)

// recordsDir is the directory under RootDir holding one record per instance. runsc
// ignores entries of its root dir that are not its own state files.
const recordsDir = "space-records"

// record is what the runtime keeps per instance so that it finds the instance's StateDir
// from the id alone after a node restart, and also when runsc no longer knows the
// container (a Create or Destroy interrupted half-way).
type record struct {
	ID       string `json:"id"`
	StateDir string `json:"state_dir"`
}

func (r *Runtime) recordPath(id string) string {
	return filepath.Join(r.cfg.RootDir, recordsDir, id+".json")
}

// claimRecord writes the record of a new instance. It fails with fs.ErrExist when the id
// already has one: writing a temporary file and hard-linking it into place makes the
// claim atomic and the record never half-written.
func (r *Runtime) claimRecord(rec record) error {
	dir := filepath.Join(r.cfg.RootDir, recordsDir)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("create records dir: %w", err)
	}
	data, err := json.Marshal(rec)
	if err != nil {
		return fmt.Errorf("encode record: %w", err)
	}
	tmp, err := os.CreateTemp(dir, ".tmp-"+rec.ID+"-")
	if err != nil {
		return fmt.Errorf("write record: %w", err)
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return fmt.Errorf("write record: %w", err)
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return fmt.Errorf("write record: %w", err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("write record: %w", err)
	}
	if err := os.Link(tmp.Name(), r.recordPath(rec.ID)); err != nil {
		return fmt.Errorf("claim record: %w", err)
	}
	return nil
}

// readRecord returns the instance's record; the error wraps fs.ErrNotExist when there is
// none.
func (r *Runtime) readRecord(id string) (record, error) {
	data, err := os.ReadFile(r.recordPath(id))
	if err != nil {
		return record{}, fmt.Errorf("read record: %w", err)
	}
	var rec record
	if err := json.Unmarshal(data, &rec); err != nil {
		return record{}, fmt.Errorf("read record %s: %w", r.recordPath(id), err)
	}
	return rec, nil
}

func (r *Runtime) removeRecord(id string) error {
	if err := os.Remove(r.recordPath(id)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove record: %w", err)
	}
	return nil
}

// recordIDs lists the ids that have a record.
func (r *Runtime) recordIDs() ([]string, error) {
	entries, err := os.ReadDir(filepath.Join(r.cfg.RootDir, recordsDir))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("list records: %w", err)
	}
	var ids []string
	for _, e := range entries {
		if id, ok := strings.CutSuffix(e.Name(), ".json"); ok && validID(id) {
			ids = append(ids, id)
		}
	}
	return ids, nil
}
