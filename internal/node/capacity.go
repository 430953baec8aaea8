package node

import (
	"fmt"
	goruntime "runtime"
	"strconv"
	"strings"

	"github.com/prometheus/procfs"

	"github.com/spacedev/space/internal/store"
)

// hostCapacity returns what a node publishes about its host beside the runtime's own
// details: why the runtime was chosen, and the host's CPUs and memory, which its
// sandboxes share (the web console sets the sandboxes' sizes against them).
func hostCapacity(reason string) map[string]any {
	out := map[string]any{"host_cpus": goruntime.NumCPU()}
	if reason != "" {
		out["selected"] = reason
	}
	if mb := hostMemoryMB(); mb > 0 {
		out["host_memory_mb"] = mb
	}
	return out
}

func hostMemoryMB() int64 {
	fs, err := procfs.NewDefaultFS()
	if err != nil {
		return 0
	}
	mi, err := fs.Meminfo()
	if err != nil || mi.MemTotal == nil {
		return 0
	}
	return int64(*mi.MemTotal / 1024)
}

// Capacity defaults (docs/operations.md, "Capacity and placement").
const (
	// MemoryReserveMB is the least memory kept for the host and space itself; the
	// reserve is the larger of it and MemoryReservePercent of the host's memory.
	MemoryReserveMB      = 1024
	MemoryReservePercent = 10
	// MemoryOvercommit is how many times the memory left after the reserve the
	// sandboxes' memory sizes may add up to: a size is a ceiling the guest may touch,
	// not a reservation, and idle sandboxes touch little of it.
	MemoryOvercommit = 2
)

// DefaultCapacity is what a node offers its sandboxes unless --capacity says
// otherwise: vCPUs unbounded in sum (a vCPU is a CFS time share an idle sandbox does
// not use; the scheduler still refuses a sandbox with more vCPUs than the host has
// CPUs), MemoryOvercommit × (host memory − reserve), and the store's file system
// minus its disk reserve (storeBytes 0: unbounded).
func DefaultCapacity(hostMemMB, storeBytes int64, diskReserve float64) store.Resources {
	var c store.Resources
	if hostMemMB > 0 {
		reserve := max(int64(MemoryReserveMB), hostMemMB*MemoryReservePercent/100)
		c.MemoryMB = max(hostMemMB-reserve, 256) * MemoryOvercommit
	}
	if storeBytes > 0 {
		c.DiskMB = int64(float64(storeBytes)*(1-diskReserve)) >> 20
	}
	return c
}

// HostMemoryMB is the host's memory in MiB (0 when unknown).
func HostMemoryMB() int64 { return hostMemoryMB() }

// ParseCapacity parses --capacity: comma-separated cpu=N, memory=MiB and disk=MiB;
// a key it omits keeps its value in def, and 0 makes a dimension unbounded.
func ParseCapacity(s string, def store.Resources) (store.Resources, error) {
	c := def
	if strings.TrimSpace(s) == "" {
		return c, nil
	}
	for _, kv := range strings.Split(s, ",") {
		k, v, ok := strings.Cut(strings.TrimSpace(kv), "=")
		n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
		if !ok || err != nil || n < 0 {
			return c, fmt.Errorf("capacity %q: want comma-separated cpu=N, memory=MiB, disk=MiB (non-negative integers; 0: unbounded)", kv)
		}
		switch strings.TrimSpace(k) {
		case "cpu":
			c.CPU = int(n)
		case "memory":
			c.MemoryMB = n
		case "disk":
			c.DiskMB = n
		default:
			return c, fmt.Errorf("capacity %q: unknown resource %q (cpu, memory, disk)", kv, k)
		}
	}
	return c, nil
}
