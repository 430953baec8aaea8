package bench

import (
	"fmt"
	"os"
	"regexp"
	"runtime"
	"strings"

	"golang.org/x/sys/unix"
)

// Host is what a report says about the machine it was measured on: figures from
// machines (or host settings) that differ do not compare.
type Host struct {
	CPUs   int    `json:"cpus"`
	Kernel string `json:"kernel,omitempty"`
	// Load is the 1-minute load average when the run began.
	Load string `json:"load,omitempty"`
	// ShmemTHP and THPDefrag are the host's transparent huge page settings for shared
	// memory and their defragmentation: gVisor backs sandbox memory with huge pages
	// only with shmem_enabled "advise" and defrag "always", "defer" or "never", or
	// shmem_enabled "within_size", "always" or "force" (docs/operations.md).
	ShmemTHP  string `json:"shmem_thp,omitempty"`
	THPDefrag string `json:"thp_defrag,omitempty"`
}

// ReadHost describes this machine.
func ReadHost() Host {
	h := Host{CPUs: runtime.NumCPU()}
	var u unix.Utsname
	if unix.Uname(&u) == nil {
		h.Kernel = unix.ByteSliceToString(u.Release[:])
	}
	if b, err := os.ReadFile("/proc/loadavg"); err == nil {
		if f := strings.Fields(string(b)); len(f) > 0 {
			h.Load = f[0]
		}
	}
	h.ShmemTHP = selected("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
	h.THPDefrag = selected("/sys/kernel/mm/transparent_hugepage/defrag")
	return h
}

var bracketed = regexp.MustCompile(`\[([^\]]+)\]`)

// selected returns the [chosen] value of a sysfs multiple-choice file ("" if none).
func selected(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	if m := bracketed.FindSubmatch(b); m != nil {
		return string(m[1])
	}
	return ""
}

// String is the host in one line, as the bench prints it.
func (h Host) String() string {
	s := fmt.Sprintf("%d CPUs", h.CPUs)
	if h.Kernel != "" {
		s += ", kernel " + h.Kernel
	}
	if h.ShmemTHP != "" {
		s += fmt.Sprintf(", huge pages for shared memory %s (defrag %s)", h.ShmemTHP, h.THPDefrag)
	}
	if h.Load != "" {
		s += ", load " + h.Load
	}
	return s
}
