package qemu

import (
	"path/filepath"
	"time"

	"github.com/spacedev/space/internal/runtime/instances"
)

// recordsDir holds one record per instance under the root dir.
const recordsDir = "instances"

// record is what the runtime keeps per instance so that it finds the instance again
// from its id alone after a node restart, and also when its QEMU is gone.
type record struct {
	ID       string `json:"id"`
	StateDir string `json:"state_dir"`
	RootFS   string `json:"rootfs"`
	// PID and StartTime (clock ticks after boot, /proc/PID/stat field 22) identify the
	// QEMU process; PID 0 while it is being started.
	PID       int       `json:"pid"`
	StartTime uint64    `json:"start_time"`
	Machine   machine   `json:"machine"`
	CreatedAt time.Time `json:"created_at"`
	// UID is the uid (and gid) QEMU runs as, leased from the runtime's range; 0 before
	// the lease.
	UID int `json:"uid,omitempty"`
	// Cgroups are the VM's cgroup directories (one per hierarchy).
	Cgroups []string `json:"cgroups,omitempty"`
}

// records is the store of the instances' records, under the root dir.
func (r *Runtime) records() instances.Records[record] {
	return instances.Records[record]{Dir: filepath.Join(r.cfg.RootDir, recordsDir)}
}

func (r *Runtime) recordPath(id string) string { return r.records().Path(id) }

// claimRecord writes the record of a new instance, failing with fs.ErrExist when the id
// has one.
func (r *Runtime) claimRecord(rec record) error { return r.records().Claim(rec.ID, rec) }

// updateRecord replaces an instance's record atomically.
func (r *Runtime) updateRecord(rec record) error { return r.records().Update(rec.ID, rec) }

// readRecord returns the instance's record; the error wraps fs.ErrNotExist when there
// is none.
func (r *Runtime) readRecord(id string) (record, error) { return r.records().Read(id) }

func (r *Runtime) removeRecord(id string) error { return r.records().Remove(id) }

// recordIDs lists the ids that have a record.
func (r *Runtime) recordIDs() ([]string, error) { return r.records().IDs(validID) }
