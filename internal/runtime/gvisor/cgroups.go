package gvisor

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"syscall"

	"github.com/spacedev/space/internal/cgroupstat"
)

// removeCgroup removes the instance's host cgroup (cgroupsPath) from every cgroup
// hierarchy where it is left once the instance's processes are gone.
//
// runsc removes on delete the cgroups it created, but not one that was there before its
// run or restore. Two instances with one id on one host share the cgroup: a sandbox
// moved between two node processes of one host (a fleet on one machine) is restored on
// one while the instance of the other, killed, node still runs, and the node that comes
// back reclaims its instance later. The cgroup is the first runsc's; the second one
// finds it and does not own it, so whichever is deleted last left an empty cgroup
// behind on every such move (found as one leaked cgroup per test run). The runtime
// named the cgroup, so it removes it: a cgroup another instance still runs in stays
// (rmdir fails with EBUSY) until that one is destroyed too.
func (r *Runtime) removeCgroup(ctx context.Context, id string) {
	if r.ignoresCgroups() {
		return
	}
	for _, root := range r.cgroupRoots() {
		dir := filepath.Join(root, r.cgroupsPath(id))
		err := os.Remove(dir)
		switch {
		case err == nil:
			r.log.DebugContext(ctx, "removed the host cgroup runsc left", "id", id, "dir", dir)
		case errors.Is(err, os.ErrNotExist), errors.Is(err, syscall.EBUSY):
		default:
			r.log.WarnContext(ctx, "remove the sandbox's host cgroup", "id", id, "err", err)
		}
	}
}

// cgroupRoots lists the mount points of the host's cgroup hierarchies (v1 and v2), read
// once: a host does not mount them while it runs sandboxes.
func (r *Runtime) cgroupRoots() []string {
	r.cgroupOnce.Do(func() {
		mounts, err := cgroupstat.Mounts()
		if err != nil {
			r.log.Warn("list the host's cgroup hierarchies", "err", err)
			return
		}
		for _, m := range mounts {
			r.cgroupMounts = append(r.cgroupMounts, m.MountPoint)
			if m.FSType == "cgroup2" && r.memoryMount == "" && slices.Contains(cgroupstat.V2Controllers(m.MountPoint), "memory") {
				r.memoryMount, r.memoryLimitFileName = m.MountPoint, "memory.max"
			}
		}
		if m := cgroupstat.V1Mount(mounts, "memory"); m != nil {
			r.memoryMount, r.memoryLimitFileName = m.MountPoint, "memory.limit_in_bytes"
		}
	})
	return r.cgroupMounts
}
