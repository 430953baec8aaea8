package gvisor

import (
	"context"
	"fmt"
	"time"

	"github.com/spacedev/space/internal/cgroupstat"
	"github.com/spacedev/space/internal/runtime"
)

var _ runtime.CPUTimer = (*Runtime)(nil)

// CPUTime reads the CPU time the sandbox's host cgroup has used (the Sentry, its stub
// processes and the gofer: everything the sandbox runs on): cpuacct.usage (cgroup v1)
// or cpu.stat's usage_usec (v2). It is a file read on the host and wakes nothing in the
// sandbox. The file is found once per instance, from the sandbox process's
// /proc/<pid>/cgroup (the pid runsc wrote at start), so any CgroupParent works; a runsc
// run with --ignore-cgroups has no cgroup of the sandbox's own, and CPUTime fails.
func (r *Runtime) CPUTime(ctx context.Context, id string) (time.Duration, error) {
	if !validID(id) {
		return 0, fmt.Errorf("gvisor cpu time: invalid id %q", id)
	}
	if p, ok := r.cpuFiles.Load(id); ok {
		if d, err := cgroupstat.ReadCPU(p.(string)); err == nil {
			return d, nil
		}
		r.cpuFiles.Delete(id) // the cgroup went (a checkpoint, a restart): find it again
	}
	file, err := r.cpuFile(id)
	if err != nil {
		return 0, fmt.Errorf("gvisor cpu time %s: %w", id, err)
	}
	d, err := cgroupstat.ReadCPU(file)
	if err != nil {
		return 0, fmt.Errorf("gvisor cpu time %s: %w", id, err)
	}
	r.cpuFiles.Store(id, file)
	return d, nil
}

// cpuFile finds the CPU counter of the instance's host cgroup: the cgroup runsc made for
// it ends in its id (cgroupsPath), which also tells a reused pid apart.
func (r *Runtime) cpuFile(id string) (string, error) {
	rec, err := r.readRecord(id)
	if err != nil {
		return "", err
	}
	pid, err := readPidFile(rec.StateDir)
	if err != nil {
		return "", err
	}
	return cgroupstat.CPUFile(pid, id)
}
