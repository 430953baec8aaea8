// Package cgroupstat reads a process's host cgroup counters — the CPU time and the
// memory charged to the cgroup it is in — on cgroup v1 and v2 hosts, and lists the
// host's cgroup hierarchies. The gVisor runtime
// reports a sandbox's CPU time from it, and the benchmarks read sandboxes' memory and
// CPU with it. It reads files only: it never writes a cgroup or asks the process (the
// gVisor runtime finds a sandbox's CPU quota file with it and writes that itself).
package cgroupstat

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/procfs"
)

// Root is where the host's cgroup hierarchies are mounted.
const Root = "/sys/fs/cgroup"

// ErrNoCgroup is returned when the process's cgroup is not the one asked for or has no
// such counter.
var ErrNoCgroup = errors.New("cgroupstat: no such cgroup counter")

// CPUFile finds the CPU counter file of pid's cgroup: cpuacct.usage of its cpuacct
// cgroup (v1) or cpu.stat of its cgroup (v2). With base set, the cgroup's last path
// element must be base (a sandbox's own cgroup, named by its id): a process in any
// other cgroup — or a pid since reused — gives ErrNoCgroup.
func CPUFile(pid int, base string) (string, error) {
	return controllerFile(pid, base, "cpuacct", "cpuacct.usage", "cpu.stat")
}

// CPULimitFile finds the file that holds the CPU quota of pid's cgroup, whose last path
// element must be base: cpu.cfs_quota_us of its cpu cgroup (v1; cpu.cfs_period_us is
// beside it) or cpu.max (v2). It only finds the file; the caller writes it.
func CPULimitFile(pid int, base string) (string, error) {
	return controllerFile(pid, base, "cpu", "cpu.cfs_quota_us", "cpu.max")
}

// controllerFile finds a file of pid's cgroup: v1File in the v1 hierarchy of controller
// (mounted alone or as the usual cpu and cpuacct pair), or v2File in the unified one.
func controllerFile(pid int, base, controller, v1File, v2File string) (string, error) {
	var found string
	err := eachCgroup(pid, base, func(controllers []string, hierarchy int, p string) bool {
		if slices.Contains(controllers, controller) {
			for _, dir := range []string{controller, "cpu,cpuacct", "cpuacct,cpu"} {
				if f := filepath.Join(Root, dir, p, v1File); fileExists(f) {
					found = f
					return true
				}
			}
		}
		if hierarchy == 0 && len(controllers) == 0 {
			if f := filepath.Join(Root, p, v2File); fileExists(f) {
				found = f
				return true
			}
		}
		return false
	})
	if err != nil {
		return "", err
	}
	if found == "" {
		return "", ErrNoCgroup
	}
	return found, nil
}

// Mounts lists the host's cgroup hierarchies (v1 and v2) as mounted, in mount order.
// The gVisor runtime removes a sandbox's cgroup from each; the QEMU runtime finds in
// them where its VMs' cgroups go.
func Mounts() ([]*procfs.MountInfo, error) {
	mounts, err := procfs.GetMounts()
	if err != nil {
		return nil, fmt.Errorf("list cgroup mounts: %w", err)
	}
	return slices.DeleteFunc(mounts, func(m *procfs.MountInfo) bool {
		return m.FSType != "cgroup" && m.FSType != "cgroup2"
	}), nil
}

// V1Mount returns the cgroup v1 hierarchy among mounts that holds controller, or nil.
func V1Mount(mounts []*procfs.MountInfo, controller string) *procfs.MountInfo {
	for _, m := range mounts {
		if _, ok := m.SuperOptions[controller]; ok && m.FSType == "cgroup" {
			return m
		}
	}
	return nil
}

// V2Controllers lists the controllers a cgroup v2 hierarchy mounted at mountPoint
// offers (its root's cgroup.controllers); none when it cannot be read.
func V2Controllers(mountPoint string) []string {
	data, err := os.ReadFile(filepath.Join(mountPoint, "cgroup.controllers"))
	if err != nil {
		return nil
	}
	return strings.Fields(string(data))
}

// ReadCPU reads a counter file CPUFile found: cpuacct.usage (nanoseconds) or cpu.stat
// (usage_usec).
func ReadCPU(file string) (time.Duration, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return 0, err
	}
	if filepath.Base(file) == "cpuacct.usage" {
		n, err := strconv.ParseInt(string(bytes.TrimSpace(b)), 10, 64)
		return time.Duration(n), err
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "usage_usec "); ok {
			n, err := strconv.ParseInt(v, 10, 64)
			return time.Duration(n) * time.Microsecond, err
		}
	}
	return 0, fmt.Errorf("%s: no usage_usec", file)
}

// CPU is the CPU time pid's cgroup has used.
func CPU(pid int) (time.Duration, error) {
	f, err := CPUFile(pid, "")
	if err != nil {
		return 0, err
	}
	return ReadCPU(f)
}

// Memory is the memory charged to pid's memory cgroup, in bytes: memory.usage_in_bytes
// (v1: anonymous memory, page cache, shared memory and kernel memory together) or
// memory.current (v2).
func Memory(pid int) (int64, error) {
	var found string
	err := eachCgroup(pid, "", func(controllers []string, hierarchy int, p string) bool {
		if slices.Contains(controllers, "memory") {
			found = filepath.Join(Root, "memory", p, "memory.usage_in_bytes")
			return true
		}
		if hierarchy == 0 && len(controllers) == 0 && p != "/" {
			found = filepath.Join(Root, p, "memory.current")
		}
		return false
	})
	if err != nil {
		return 0, err
	}
	if found == "" {
		return 0, ErrNoCgroup
	}
	b, err := os.ReadFile(found)
	if err != nil {
		return 0, err
	}
	return strconv.ParseInt(string(bytes.TrimSpace(b)), 10, 64)
}

// eachCgroup calls fn for each of pid's cgroups (whose last element is base, if set)
// until fn returns true.
func eachCgroup(pid int, base string, fn func(controllers []string, hierarchy int, path string) bool) error {
	p, err := procfs.NewProc(pid)
	if err != nil {
		return err
	}
	groups, err := p.Cgroups()
	if err != nil {
		return err
	}
	for _, g := range groups {
		if base != "" && path.Base(g.Path) != base {
			continue
		}
		if fn(g.Controllers, g.HierarchyID, g.Path) {
			return nil
		}
	}
	return nil
}

func fileExists(f string) bool {
	_, err := os.Stat(f)
	return err == nil
}

// FileMemory is the part of a cgroup's memory that holds file data (memory.stat).
type FileMemory struct {
	// Cache is the page cache charged to the cgroup, less shared memory (which the page
	// cache counts but reclaim cannot free without swap; a gVisor Sentry's memory is
	// shared memory): what the kernel frees at the limit once it is on disk.
	Cache int64
	// Dirty is the part of Cache not yet on disk (dirty or being written back).
	Dirty int64
}

// ReadFileMemory reads the file data charged to the memory cgroup dir, with its
// sub-cgroups (cgroup v1's total_* counters; v2's memory.stat counts them anyway).
func ReadFileMemory(dir string) (FileMemory, error) {
	b, err := os.ReadFile(filepath.Join(dir, "memory.stat"))
	if err != nil {
		return FileMemory{}, err
	}
	v := map[string]int64{}
	for _, line := range strings.Split(string(b), "\n") {
		if k, val, ok := strings.Cut(line, " "); ok {
			if n, err := strconv.ParseInt(strings.TrimSpace(val), 10, 64); err == nil {
				v[k] = n
			}
		}
	}
	var m FileMemory
	if _, v1 := v["total_cache"]; v1 {
		m = FileMemory{Cache: v["total_cache"] - v["total_shmem"], Dirty: v["total_dirty"] + v["total_writeback"]}
	} else {
		// v2: shared memory is counted in "file" as well.
		m = FileMemory{Cache: v["file"] - v["shmem"], Dirty: v["file_dirty"] + v["file_writeback"]}
	}
	m.Cache, m.Dirty = max(m.Cache, 0), max(m.Dirty, 0)
	return m, nil
}

// ReadMemoryUsage reads the memory charged to the memory cgroup dir (cgroup v1's
// memory.usage_in_bytes, v2's memory.current).
func ReadMemoryUsage(dir string) (int64, error) {
	b, err := os.ReadFile(filepath.Join(dir, "memory.usage_in_bytes"))
	if errors.Is(err, os.ErrNotExist) {
		b, err = os.ReadFile(filepath.Join(dir, "memory.current"))
	}
	if err != nil {
		return 0, err
	}
	return strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
}
