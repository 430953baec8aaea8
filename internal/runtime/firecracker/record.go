package firecracker

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// recordsDir holds one record per instance under the root dir.
const recordsDir = "instances"

// record is what the runtime keeps per instance so that it finds the instance again
// from its id alone after a node restart, and everything it created for it: the jail
// and the cgroup are named in it before they are made.
type record struct {
	ID       string `json:"id"`
	JailID   string `json:"jail_id"` // firecracker's --id, the jail's and the cgroup's name
	StateDir string `json:"state_dir"`
	RootFS   string `json:"rootfs"`
	// JailDir is <chroot base>/<exec name>/<jail id>; the chroot is its "root".
	JailDir string `json:"jail_dir"`
	// Cgroup is the instance's cgroup directory (jailer only).
	Cgroup string `json:"cgroup,omitempty"`
	Jailed bool   `json:"jailed"`
	// PID and StartTime (clock ticks after boot, /proc/PID/stat field 22) identify the
	// firecracker process; PID 0 while it is being started.
	PID       int       `json:"pid"`
	StartTime uint64    `json:"start_time"`
	Version   string    `json:"firecracker_version,omitempty"` // from GET /version
	Machine   machine   `json:"machine"`
	CreatedAt time.Time `json:"created_at"`
}

// chroot is the host path of the instance's chroot.
func (rec record) chroot() string { return filepath.Join(rec.JailDir, "root") }

func (r *Runtime) recordPath(id string) string {
	return filepath.Join(r.cfg.RootDir, recordsDir, id+".json")
}

// claimRecord writes the record of a new instance, failing with fs.ErrExist when the id
// has one (temporary file hard-linked into place: atomic and never half-written).
func (r *Runtime) claimRecord(rec record) error { return r.putRecord(rec, true) }

// updateRecord replaces an instance's record atomically.
func (r *Runtime) updateRecord(rec record) error { return r.putRecord(rec, false) }

func (r *Runtime) putRecord(rec record, claim bool) error {
	dir := filepath.Join(r.cfg.RootDir, recordsDir)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("records dir: %w", err)
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
	if claim {
		err = os.Link(tmp.Name(), r.recordPath(rec.ID))
	} else {
		err = os.Rename(tmp.Name(), r.recordPath(rec.ID))
	}
	if err != nil {
		return fmt.Errorf("write record: %w", err)
	}
	return nil
}

// readRecord returns the instance's record; the error wraps fs.ErrNotExist when there
// is none.
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
