package qemu

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/procfs"
	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/cgroupstat"
)

// Each QEMU runs in a cgroup of its own, <parent>/<rootKey>-<id>, with cpu, memory and
// pids limits. With cgroup v2 (one hierarchy holding all three controllers) the parent is
// taken from the hierarchy's root: a cgroup that holds processes (the node's own) cannot
// hand controllers down to children. With cgroup v1 (one hierarchy per controller) the
// parent is taken from the node's own cgroup in each hierarchy, so the VMs also count
// against whatever limits the node itself runs under.
//
// The control files are written directly (a handful per VM) rather than through a
// cgroup library: those bring systemd and eBPF dependencies for device rules this
// runtime does not need.

// Limits each VM's cgroup gets besides the guest's own size.
const (
	cpuPeriod     = 100000 // µs
	cpuVMMShare   = 25000  // a quarter core for QEMU's own threads (main loop, I/O)
	memOverheadMB = 160    // QEMU, TCG's translation cache (tcgCacheMB), page tables, I/O buffers
	// threadPoolMax bounds QEMU's block I/O worker threads (-object main-loop): QEMU aborts
	// when it cannot create a thread, so the pids limit must leave room for all of them.
	threadPoolMax = 16
	// vmmTasks is what QEMU needs besides its vCPU threads and I/O workers: the main
	// loop, RCU, signal and migration threads, with room to spare. The jail helper runs
	// in the cgroup too (a Go runtime's threads) until it becomes QEMU.
	vmmTasks = 16
	// DefaultPidsLimit is a VM's pids.max when the spec leaves it 0.
	DefaultPidsLimit = 64
)

// minPids is the least pids.max a VM with cpu vCPUs runs with.
func minPids(cpu int) int { return vmmTasks + threadPoolMax + cpu }

// cgroupHierarchy is where one hierarchy's VM cgroups go.
type cgroupHierarchy struct {
	parent      string   // absolute directory of the parent cgroup
	controllers []string // of cpu, memory, pids: those this hierarchy bounds
}

// cgroups places QEMU processes in per-VM cgroups.
type cgroups struct {
	v2          bool
	hierarchies []cgroupHierarchy
}

// limitControllers are the controllers every VM's cgroup is limited by.
var limitControllers = []string{"cpu", "memory", "pids"}

// newCgroups finds the cgroup hierarchies holding the cpu, memory and pids controllers and
// creates the parent cgroup (parent, relative) in each, enabling the controllers on the
// way down under v2.
func newCgroups(parent string) (*cgroups, error) {
	if parent == "" || filepath.IsAbs(parent) || !filepath.IsLocal(parent) {
		return nil, fmt.Errorf("cgroup parent %q must be a relative path", parent)
	}
	mounts, err := cgroupstat.Mounts()
	if err != nil {
		return nil, fmt.Errorf("cgroups: %w", err)
	}
	for _, m := range mounts {
		if m.FSType != "cgroup2" || !containsAll(cgroupstat.V2Controllers(m.MountPoint), limitControllers) {
			continue // a hybrid host: the controllers live in v1 hierarchies
		}
		dir, err := prepareV2Parent(m.MountPoint, parent)
		if err != nil {
			return nil, err
		}
		return &cgroups{v2: true, hierarchies: []cgroupHierarchy{{parent: dir, controllers: limitControllers}}}, nil
	}
	self, err := procfs.NewDefaultFS()
	if err != nil {
		return nil, fmt.Errorf("cgroups: %w", err)
	}
	proc, err := self.Self()
	if err != nil {
		return nil, fmt.Errorf("cgroups: %w", err)
	}
	own, err := proc.Cgroups()
	if err != nil {
		return nil, fmt.Errorf("cgroups: %w", err)
	}
	cg := &cgroups{}
	for _, c := range limitControllers {
		m := cgroupstat.V1Mount(mounts, c)
		if m == nil {
			return nil, fmt.Errorf("cgroups: no cgroup v2 hierarchy with %s and no cgroup v1 hierarchy for %s", strings.Join(limitControllers, ", "), c)
		}
		if i := slices.IndexFunc(cg.hierarchies, func(h cgroupHierarchy) bool {
			return strings.HasPrefix(h.parent, m.MountPoint+"/")
		}); i >= 0 {
			cg.hierarchies[i].controllers = append(cg.hierarchies[i].controllers, c)
			continue
		}
		path := "/"
		for _, o := range own {
			if slices.Contains(o.Controllers, c) {
				path = o.Path
			}
		}
		// The node's cgroup as seen in this mount (a mount may show a subtree only).
		rel, err := filepath.Rel(m.Root, path)
		if err != nil || !filepath.IsLocal(rel) {
			rel = "."
		}
		dir := filepath.Join(m.MountPoint, rel, parent)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return nil, fmt.Errorf("create cgroup %s: %w", dir, err)
		}
		cg.hierarchies = append(cg.hierarchies, cgroupHierarchy{parent: dir, controllers: []string{c}})
	}
	return cg, nil
}

func containsAll(have, want []string) bool {
	for _, w := range want {
		if !slices.Contains(have, w) {
			return false
		}
	}
	return true
}

// prepareV2Parent creates the parent cgroup under root and enables the controllers from
// the root down to it, so that each VM's cgroup has cpu.max, memory.max and pids.max.
func prepareV2Parent(root, parent string) (string, error) {
	dir := root
	for _, part := range append([]string{""}, strings.Split(filepath.Clean(parent), "/")...) {
		if part != "" {
			dir = filepath.Join(dir, part)
			if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
				return "", fmt.Errorf("create cgroup %s: %w", dir, err)
			}
		}
		ctl := filepath.Join(dir, "cgroup.subtree_control")
		have, _ := os.ReadFile(ctl)
		if containsAll(strings.Fields(string(have)), limitControllers) {
			continue
		}
		if err := os.WriteFile(ctl, []byte("+cpu +memory +pids"), 0o644); err != nil {
			return "", fmt.Errorf("enable cpu, memory and pids controllers in %s: %w", dir, err)
		}
	}
	return dir, nil
}

// vmLimits is what a VM's cgroup is limited to.
type vmLimits struct {
	CPU      int // vCPUs
	MemoryMB int // guest memory
	Pids     int // pids.max
}

// files returns the control files to write, in order, for the controllers of one
// hierarchy.
func (l vmLimits) files(v2 bool, controllers []string) [][2]string {
	quota := l.CPU*cpuPeriod + cpuVMMShare
	mem := strconv.FormatInt(int64(l.MemoryMB+memOverheadMB)<<20, 10)
	var out [][2]string
	for _, c := range controllers {
		switch {
		case c == "cpu" && v2:
			out = append(out, [2]string{"cpu.max", fmt.Sprintf("%d %d", quota, cpuPeriod)})
		case c == "cpu":
			out = append(out, [2]string{"cpu.cfs_period_us", strconv.Itoa(cpuPeriod)},
				[2]string{"cpu.cfs_quota_us", strconv.Itoa(quota)})
		case c == "memory" && v2:
			out = append(out, [2]string{"memory.max", mem})
		case c == "memory":
			out = append(out, [2]string{"memory.limit_in_bytes", mem})
		case c == "pids":
			out = append(out, [2]string{"pids.max", strconv.Itoa(l.Pids)})
		}
	}
	return out
}

// create makes the VM's cgroup named name in every hierarchy and sets its limits. It
// returns the directories made; on error it removes them. A leftover cgroup of the same
// name (an interrupted start) is reused.
func (c *cgroups) create(name string, l vmLimits) (dirs []string, err error) {
	defer func() {
		if err != nil {
			for _, d := range dirs {
				_ = unix.Rmdir(d)
			}
			dirs = nil
		}
	}()
	for _, h := range c.hierarchies {
		dir := filepath.Join(h.parent, name)
		if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
			return dirs, fmt.Errorf("create cgroup: %w", err)
		}
		dirs = append(dirs, dir)
		for _, f := range l.files(c.v2, h.controllers) {
			if err := os.WriteFile(filepath.Join(dir, f[0]), []byte(f[1]), 0o644); err != nil {
				return dirs, fmt.Errorf("cgroup limit %s=%s: %w", f[0], f[1], err)
			}
		}
	}
	return dirs, nil
}

// joinCgroups moves process pid (all its threads) into the cgroups dirs.
func joinCgroups(dirs []string, pid int) error {
	for _, d := range dirs {
		if err := os.WriteFile(filepath.Join(d, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0o644); err != nil {
			return fmt.Errorf("join cgroup %s: %w", d, err)
		}
	}
	return nil
}

// dirs returns the VM's cgroup directories for name in every hierarchy (whether they
// exist or not).
func (c *cgroups) dirs(name string) []string {
	var out []string
	for _, h := range c.hierarchies {
		out = append(out, filepath.Join(h.parent, name))
	}
	return out
}

// removeCgroups removes the VM's cgroups once its processes are gone (rmdir: a cgroup's
// control files cannot and need not be removed), waiting while they are busy.
func removeCgroups(ctx context.Context, dirs []string) error {
	t := time.NewTicker(5 * time.Millisecond)
	defer t.Stop()
	for _, dir := range dirs {
		for {
			err := unix.Rmdir(dir)
			if err == nil || errors.Is(err, unix.ENOENT) {
				break
			}
			if !errors.Is(err, unix.EBUSY) {
				return fmt.Errorf("remove cgroup %s: %w", dir, err)
			}
			select {
			case <-ctx.Done():
				return fmt.Errorf("remove cgroup %s: still in use: %w", dir, ctx.Err())
			case <-t.C:
			}
		}
	}
	return nil
}

// describe tells where VM cgroups go, for Info.
func (c *cgroups) describe() string {
	if c.v2 {
		return "cgroup v2 " + c.hierarchies[0].parent
	}
	var dirs []string
	for _, h := range c.hierarchies {
		dirs = append(dirs, h.parent)
	}
	return "cgroup v1 " + strings.Join(dirs, " ")
}
