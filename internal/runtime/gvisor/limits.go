package gvisor

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/spacedev/space/internal/cgroupstat"
	"github.com/spacedev/space/internal/runtime"
)

// A restore's CPU limit comes after the restore. `runsc restore` does its work — the
// Sentry's start, the kernel state's load, the copy of every saved page into fresh
// memory — inside the sandbox's host cgroup, and with the Spec's quota on it from the
// start a 1-CPU sandbox's wake was throttled for most of that copy on a 2-core host
// (docs/benchmarks.md, thirteenth pass). So a restore's bundle carries no CPU quota, and
// start sets the quota on the host cgroup as soon as runsc returns. No user code runs
// unlimited meanwhile: every checkpoint this runtime takes is of a sandbox whose agent
// has stopped all user processes (the quiesce), and the agent continues them only once
// it has its new identity, after Restore has returned. A node that restarts between the
// restore and the write finds the instance in Adopt, which sets the quota again. A
// boot keeps its quota in the bundle: the agent may start the template's processes as
// soon as it runs.

// applyCPULimit sets spec's CPU quota on the host cgroup runsc made for the instance,
// found from the sandbox process pid. Without a CPU count there is nothing to set, and
// with runsc's --ignore-cgroups no cgroup to set it on.
func (r *Runtime) applyCPULimit(spec runtime.Spec, pid int) error {
	if spec.CPU <= 0 || r.ignoresCgroups() {
		return nil
	}
	file, err := cgroupstat.CPULimitFile(pid, spec.ID)
	if err != nil {
		return fmt.Errorf("find the sandbox's host cgroup: %w", err)
	}
	quota := int64(spec.CPU) * cpuPeriod
	if filepath.Base(file) == "cpu.max" {
		return writeCgroupFile(file, fmt.Sprintf("%d %d", quota, cpuPeriod))
	}
	if err := writeCgroupFile(filepath.Join(filepath.Dir(file), "cpu.cfs_period_us"), strconv.Itoa(cpuPeriod)); err != nil {
		return err
	}
	return writeCgroupFile(file, strconv.FormatInt(quota, 10))
}

// The memory limit comes after runsc too, for every start. runsc tells the Sentry the
// guest's total memory (MemTotal inside) from the host cgroup's limit as it finds it at
// start, so the bundle carries the guest's size, and start raises the limit to
// hostMemoryLimit (the guest plus what the Sentry spends on its tasks, bundle.go) once
// runsc has returned. Until then the limit is the lower one: nothing the guest does in
// those milliseconds could have been allowed and is not. Adopt raises it again for a
// node that stopped in between.

// applyMemoryLimit sets the host cgroup's memory limit of the instance (found from the
// sandbox process pid) to hostMemoryLimit(spec). Without a memory size, or with runsc's
// --ignore-cgroups, there is nothing to set.
func (r *Runtime) applyMemoryLimit(spec runtime.Spec, pid int) error {
	limit := hostMemoryLimit(spec)
	if limit <= 0 || r.ignoresCgroups() {
		return nil
	}
	file, err := cgroupstat.MemoryLimitFile(pid, spec.ID)
	if err != nil {
		return fmt.Errorf("find the sandbox's host memory cgroup: %w", err)
	}
	return writeCgroupFile(file, strconv.FormatInt(limit, 10))
}

// ignoresCgroups tells whether runsc runs with --ignore-cgroups (ExtraFlags): it then
// makes no cgroup for a sandbox, so there is no quota to set.
func (r *Runtime) ignoresCgroups() bool {
	return slices.ContainsFunc(r.cfg.ExtraFlags, func(f string) bool {
		name, value, _ := strings.Cut(strings.TrimLeft(f, "-"), "=")
		return name == "ignore-cgroups" && value != "false"
	})
}

func writeCgroupFile(file, value string) error {
	if err := os.WriteFile(file, []byte(value), 0); err != nil {
		return fmt.Errorf("set the sandbox's host cgroup limit: %w", err)
	}
	return nil
}
