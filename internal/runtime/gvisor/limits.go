package gvisor

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/cgroupstat"
	"github.com/spacedev/space/internal/cgroupwatch"
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

// The memory limit is raised during the start. runsc tells the Sentry the guest's total
// memory (MemTotal inside, the sandbox process's --total-memory) from the host cgroup's
// limit as it finds it when it builds that process's arguments, so the bundle carries
// the guest's size. Once the sandbox process exists its arguments are fixed, and the
// runtime raises the limit to hostMemoryLimit (the guest plus what the Sentry spends on
// its tasks, bundle.go) at once, while `runsc restore` is still loading the guest's
// memory: a sandbox that ran above its guest size (which the raised limit allows) was
// OOM-killed during its restore when the raise came only after runsc returned
// (TestRestoreAboveGuestSize). start sets the limit once runsc has returned if the
// watch did not, and Adopt for a node that stopped in between. On a cgroup v1 host runsc joins the
// cgroup itself to start the gofer before it computes the sandbox's arguments, so the
// sign is the sandbox process (argv[0] runsc-sandbox) in the cgroup, not any process.

// MemoryBound is the host memory limit of spec's instances (runtime.MemoryBounder):
// the guest may use what the Sentry does not.
func (r *Runtime) MemoryBound(spec runtime.Spec) int64 { return hostMemoryLimit(spec) }

// Near the memory limit. gVisor has no OOM killer inside the sandbox: the host's ends
// the Sentry, and with it every process and all the guest's memory. WatchMemory tells
// the node when the instance's host memory rises to pressureThreshold, so that the
// agent ends the largest process first (internal/guest/agent/memory.go). The margin
// under the limit is what a program may allocate while the node and the agent react
// (a few ms: an eventfd, one agent call, a scan of /proc): a quarter of what the
// limit holds beyond the guest's size, at least 48 MiB (1.5 GB/s for 30 ms; Python
// filled a 256 MiB sandbox at 0.7 GB/s), and never more than half of it, so that the
// guest keeps the size it was given and most of the allowance for its tasks.

// minPressureMargin is the least room left under the host limit when the node is told.
const minPressureMargin = 48 << 20

// pressureThreshold is the host memory at which WatchMemory reports an instance of
// spec (0 without a memory limit).
func pressureThreshold(spec runtime.Spec) int64 {
	limit := hostMemoryLimit(spec)
	if limit <= 0 {
		return 0
	}
	headroom := limit - int64(spec.MemoryMB)<<20
	return limit - min(headroom/2, max(minPressureMargin, headroom/4))
}

// WatchMemory reports each rise of the instance's host memory to pressureThreshold
// (runtime.MemoryWatcher), through its host cgroup (cgroupwatch), unless what fills it
// is files the sandbox wrote.
//
// Files a sandbox writes to its disk pass through the host's page cache, charged to
// its cgroup: they fill the cgroup as fast as they are written, and the kernel frees
// them at the limit once they are on disk. On a cgroup v1 host nothing writes them out
// before the host's own dirty limits (gigabytes on a large host), so a sandbox writing
// a file of its memory's size reached the threshold with most of it dirty cache, and
// the agent ended the writer (measured 2026-12-07: dd of 1.5 GB in a 512 MiB sandbox
// killed at 740 MB, 712 MB of the cgroup dirty; and a process of 49 MiB ended in a
// sandbox whose cgroup still held 680 MB of clean cache). Now the node is told only
// when what the processes hold (the cgroup's memory less its file cache) comes within
// the margin of the threshold. While file cache fills the cgroup above the threshold,
// its dirty part is written out (syncfs of the sandbox's file system, one at a time)
// so that the kernel can reclaim it at the limit, and the cgroup is looked at again —
// on cgroup v1 each time the kernel reclaims some of it (a process growing into it),
// elsewhere sooner the closer its processes are (10 ms to 1 s: fastAlloc) — until it
// is back under the threshold or its processes' share calls for the node after all.
func (r *Runtime) WatchMemory(ctx context.Context, spec runtime.Spec, near func(usage, limit int64)) error {
	limit, threshold := hostMemoryLimit(spec), pressureThreshold(spec)
	dir, _ := r.memoryLimitFile(spec.ID)
	if threshold <= 0 || dir == "" {
		return runtime.ErrUnsupported
	}
	held := threshold - (limit - threshold) // what the processes may hold before the node is told
	var (
		nearMu           sync.Mutex // near runs one call at a time
		syncing, polling atomic.Bool
	)
	tell := func(usage int64) {
		nearMu.Lock()
		defer nearMu.Unlock()
		near(usage, limit)
	}
	// room returns how much more the processes may take before the node is told (0 or
	// less: now), starting to write the file cache out when some of it is dirty.
	room := func(usage int64) int64 {
		files, err := cgroupstat.ReadFileMemory(dir)
		if err != nil {
			return 0
		}
		if files.Dirty > 0 && syncing.CompareAndSwap(false, true) {
			go func() {
				defer syncing.Store(false)
				if err := syncFS(spec.RootFS); err != nil {
					r.log.Warn("write out a sandbox's files near its memory limit", "id", spec.ID, "err", err)
				}
			}()
		}
		return held - (usage - files.Cache)
	}
	// On cgroup v1 the kernel tells each reclaim in the cgroup: a cgroup that file cache
	// holds above the threshold is looked at again when its cache is reclaimed (what a
	// growing process makes the kernel do) instead of on a timer, so an idle sandbox
	// that once wrote its memory's worth of files costs nothing (the timer alone cost
	// about 2 ms of the node's CPU a second for each, measured 2026-12-07).
	reclaimed := make(chan struct{}, 1)
	var onReclaim atomic.Bool
	if err := cgroupwatch.CanReclaim(dir); err == nil {
		onReclaim.Store(true)
		go func() {
			err := cgroupwatch.Reclaim(ctx, dir, func() {
				select {
				case reclaimed <- struct{}{}:
				default:
				}
			})
			if err != nil {
				onReclaim.Store(false)
				r.log.Warn("no reclaim notifications for a sandbox's memory; its file cache is polled", "id", spec.ID, "err", err)
			}
		}()
	}
	return cgroupwatch.Memory(ctx, dir, threshold, func(usage int64) {
		left := room(usage)
		if left <= 0 {
			tell(usage)
			return
		}
		if !polling.CompareAndSwap(false, true) {
			return
		}
		// A cgroup that file cache holds at its limit stays there: its processes can
		// grow into the cache (the kernel reclaims it) without the usage moving, so the
		// usage's crossings say nothing until the cache is gone. It is looked at again
		// before a process allocating at fastAlloc could take what is left.
		go func() {
			defer polling.Store(false)
			for {
				wait := min(max(time.Duration(float64(left)/fastAlloc*float64(time.Second)), 10*time.Millisecond), time.Second)
				if onReclaim.Load() {
					wait = reclaimFallback
				}
				select {
				case <-ctx.Done():
					return
				case <-reclaimed:
				case <-time.After(wait):
				}
				usage, err := cgroupstat.ReadMemoryUsage(dir)
				if err != nil || usage < threshold {
					return
				}
				if left = room(usage); left <= 0 {
					tell(usage)
					return
				}
			}
		}()
	})
}

// reclaimFallback is how often a cgroup that file cache holds above the threshold is
// looked at when the kernel tells its reclaims (cgroupwatch.Reclaim), in case one went
// untold.
const reclaimFallback = 10 * time.Second

// fastAlloc is an allocation rate (bytes a second) above what the sandboxes here
// reached: Python touching 16 MiB buffers 0.7 GB/s, a memset 1.5 GB/s.
const fastAlloc = 2 << 30

// syncFS writes out the file system holding path (syncfs(2)).
func syncFS(path string) error {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return unix.Syncfs(fd)
}

// memoryLimitFile is the instance's limit file in the host's memory hierarchy, with the
// cgroup directory holding it; "" when the host has no memory hierarchy or runsc makes
// no cgroups (--ignore-cgroups).
func (r *Runtime) memoryLimitFile(id string) (dir, file string) {
	r.cgroupRoots()
	if r.memoryMount == "" || r.ignoresCgroups() {
		return "", ""
	}
	dir = filepath.Join(r.memoryMount, r.cgroupsPath(id))
	return dir, filepath.Join(dir, r.memoryLimitFileName)
}

// setMemoryLimit sets the instance's host memory limit to hostMemoryLimit(spec);
// without a memory size, or a cgroup to set it on, there is nothing to do.
func (r *Runtime) setMemoryLimit(spec runtime.Spec) error {
	_, file := r.memoryLimitFile(spec.ID)
	if limit := hostMemoryLimit(spec); limit > 0 && file != "" {
		return writeCgroupFile(file, strconv.FormatInt(limit, 10))
	}
	return nil
}

// raiseMemoryAtStart watches the instance's host memory cgroup while runsc starts it
// and raises the limit as soon as the sandbox process is in it (see above). The
// returned function stops the watch; it returns once the watch has, and whether it
// raised the limit (start sets it itself otherwise).
func (r *Runtime) raiseMemoryAtStart(ctx context.Context, spec runtime.Spec) (stop func() (raised bool)) {
	limit := hostMemoryLimit(spec)
	dir, file := r.memoryLimitFile(spec.ID)
	if limit <= 0 || file == "" {
		return func() bool { return false }
	}
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	var raised bool
	go func() {
		defer close(done)
		tick := time.NewTicker(time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			if !sandboxProcessIn(dir) {
				continue
			}
			if err := writeCgroupFile(file, strconv.FormatInt(limit, 10)); err != nil {
				r.log.WarnContext(ctx, "raise the sandbox's memory limit at start", "id", spec.ID, "err", err)
				return
			}
			raised = true
			return
		}
	}()
	return func() bool {
		cancel()
		<-done
		return raised
	}
}

// sandboxProcessIn reports whether the cgroup dir holds runsc's sandbox process.
func sandboxProcessIn(dir string) bool {
	b, err := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
	if err != nil {
		return false
	}
	for _, pid := range strings.Fields(string(b)) {
		cmdline, err := os.ReadFile(filepath.Join("/proc", pid, "cmdline"))
		if err != nil {
			continue
		}
		if argv0, _, _ := strings.Cut(string(cmdline), "\x00"); argv0 == "runsc-sandbox" {
			return true
		}
	}
	return false
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
