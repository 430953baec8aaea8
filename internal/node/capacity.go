package node

import (
	goruntime "runtime"

	"github.com/prometheus/procfs"
)

// hostCapacity returns what a node publishes about its host beside the runtime's own
// details: why the runtime was chosen, and the host's CPUs and memory, which its
// sandboxes share (the web console sets the sandboxes' sizes against them).
func hostCapacity(reason string) map[string]any {
	out := map[string]any{"host_cpus": goruntime.NumCPU()}
	if reason != "" {
		out["selected"] = reason
	}
	if fs, err := procfs.NewDefaultFS(); err == nil {
		if mi, err := fs.Meminfo(); err == nil && mi.MemTotal != nil {
			out["host_memory_mb"] = *mi.MemTotal / 1024
		}
	}
	return out
}
