package gvisor

import (
	"path/filepath"

	"github.com/spacedev/space/internal/runtime/instances"
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
	// Cgroup is the name of the container's cgroup inside the Sentry, where its pids
	// limit is set: the container id it was first created with, which a checkpoint
	// carries over to every instance restored from it.
	Cgroup string `json:"cgroup,omitempty"`
	// PidsMax is the pids limit the runtime set on that cgroup (0: none, this runsc
	// holds no limit inside the sandbox); a checkpoint carries it over.
	PidsMax int64 `json:"pids_max,omitempty"`
	// layout is what the bundle gave the instance (memory file systems, the agent's
	// transport); a checkpoint carries it over, since a restore must repeat it.
	layout
}

// records is the store of the instances' records, under the root dir.
func (r *Runtime) records() instances.Records[record] {
	return instances.Records[record]{Dir: filepath.Join(r.cfg.RootDir, recordsDir)}
}

// claimRecord writes the record of a new instance, failing with fs.ErrExist when the id
// has one.
func (r *Runtime) claimRecord(rec record) error {
	r.statuses.change([]string{rec.ID})() // an instance is being made: no longer known gone
	r.statuses.making(rec.ID)
	return r.records().Claim(rec.ID, rec)
}

// readRecord returns the instance's record; the error wraps fs.ErrNotExist when there
// is none.
func (r *Runtime) readRecord(id string) (record, error) { return r.records().Read(id) }

func (r *Runtime) removeRecord(id string) error { return r.records().Remove(id) }

// recordIDs lists the ids that have a record.
func (r *Runtime) recordIDs() ([]string, error) { return r.records().IDs(validID) }
