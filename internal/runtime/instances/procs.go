package instances

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

// Proc is what /proc says about a process.
type Proc struct {
	Argv      []string
	State     byte   // R, S, D, Z, ...
	StartTime uint64 // clock ticks after boot (/proc/PID/stat field 22): with the pid, the process's identity
}

// ReadProc reads pid's state, start time and command line from /proc.
func ReadProc(pid int) (Proc, error) {
	var pi Proc
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return pi, err
	}
	// The command name (field 2) is in parentheses and may hold spaces: parse after it.
	i := bytes.LastIndexByte(stat, ')')
	if i < 0 {
		return pi, fmt.Errorf("parse /proc/%d/stat", pid)
	}
	f := strings.Fields(string(stat[i+1:]))
	if len(f) < 20 {
		return pi, fmt.Errorf("parse /proc/%d/stat", pid)
	}
	pi.State = f[0][0]
	if pi.StartTime, err = strconv.ParseUint(f[19], 10, 64); err != nil {
		return pi, fmt.Errorf("parse /proc/%d/stat: %w", pid, err)
	}
	cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil {
		return pi, err
	}
	pi.Argv = strings.Split(strings.TrimSuffix(string(cmdline), "\x00"), "\x00")
	return pi, nil
}

// Live reports whether the process runs (exists and is not a zombie).
func (pi Proc) Live() bool { return pi.State != 'Z' && pi.State != 'X' }

// Scan returns the live processes (but this one) whose argv matches, in pid order.
func Scan(match func(argv []string) bool) []int {
	dirs, _ := filepath.Glob("/proc/[0-9]*")
	var pids []int
	for _, d := range dirs {
		pid, err := strconv.Atoi(filepath.Base(d))
		if err != nil || pid == os.Getpid() {
			continue
		}
		pi, err := ReadProc(pid)
		if err != nil || !pi.Live() {
			continue
		}
		if match(pi.Argv) {
			pids = append(pids, pid)
		}
	}
	slices.Sort(pids)
	return pids
}

// FindPID returns the pid of an instance's live process, or 0: pid if it is still the
// process that started at startTime and its argv matches (a recorded pid; 0 when there
// is none), else the first match found by Scan.
func FindPID(pid int, startTime uint64, match func(argv []string) bool) int {
	if pid > 0 {
		// An empty argv is a process still inside execve (the kernel lays out the new
		// argv after the exec is committed): pid and start time already identify it.
		if pi, err := ReadProc(pid); err == nil && pi.Live() && pi.StartTime == startTime && (match(pi.Argv) || slices.Equal(pi.Argv, []string{""})) {
			return pid
		}
	}
	if pids := Scan(match); len(pids) > 0 {
		return pids[0]
	}
	return 0
}
