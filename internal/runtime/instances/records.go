// Package instances holds what the runtimes share to find their instances again from an
// id alone, after a node restart and without any state in memory: a store of
// per-instance records (Records) and the lookup of an instance's processes in /proc
// (ReadProc, Scan, FindPID).
package instances

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
)

// Records stores one JSON-encoded record of type R per instance, as Dir/<id>.json. It
// holds no state besides Dir: any number of Records over one Dir see the same records.
type Records[R any] struct {
	Dir string // created on the first write
}

// Path returns the file of id's record.
func (s Records[R]) Path(id string) string { return filepath.Join(s.Dir, id+".json") }

// Claim writes the record of a new instance, failing with fs.ErrExist when the id has
// one: writing a temporary file and hard-linking it into place makes the claim atomic
// and the record never half-written.
func (s Records[R]) Claim(id string, rec R) error { return s.put(id, rec, true) }

// Update replaces an instance's record atomically (or writes it when there is none).
func (s Records[R]) Update(id string, rec R) error { return s.put(id, rec, false) }

func (s Records[R]) put(id string, rec R, claim bool) error {
	if err := os.MkdirAll(s.Dir, 0o700); err != nil {
		return fmt.Errorf("create records dir: %w", err)
	}
	data, err := json.Marshal(rec)
	if err != nil {
		return fmt.Errorf("encode record: %w", err)
	}
	tmp, err := os.CreateTemp(s.Dir, ".tmp-"+id+"-")
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
	if claim {
		if err := os.Link(tmp.Name(), s.Path(id)); err != nil {
			return fmt.Errorf("claim record: %w", err)
		}
		return nil
	}
	if err := os.Rename(tmp.Name(), s.Path(id)); err != nil {
		return fmt.Errorf("write record: %w", err)
	}
	return nil
}

// Read returns the instance's record; the error wraps fs.ErrNotExist when there is none.
func (s Records[R]) Read(id string) (R, error) {
	var rec R
	data, err := os.ReadFile(s.Path(id))
	if err != nil {
		return rec, fmt.Errorf("read record: %w", err)
	}
	if err := json.Unmarshal(data, &rec); err != nil {
		var zero R
		return zero, fmt.Errorf("read record %s: %w", s.Path(id), err)
	}
	return rec, nil
}

// Remove deletes the instance's record, if any.
func (s Records[R]) Remove(id string) error {
	if err := os.Remove(s.Path(id)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove record: %w", err)
	}
	return nil
}

// IDs lists the ids that have a record, skipping file names that are not valid ids
// (temporary files, other files in Dir).
func (s Records[R]) IDs(valid func(id string) bool) ([]string, error) {
	entries, err := os.ReadDir(s.Dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("list records: %w", err)
	}
	var ids []string
	for _, e := range entries {
		if id, ok := strings.CutSuffix(e.Name(), ".json"); ok && valid(id) {
			ids = append(ids, id)
		}
	}
	return ids, nil
}
