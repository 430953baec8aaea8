package firecracker

import (
	"path/filepath"
	"time"

	"github.com/spacedev/space/internal/runtime/instances"
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
