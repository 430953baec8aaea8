package qemu

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// procName is the -name of an instance's QEMU process: it carries the runtime's root
// dir key and the instance id, so the process is found from /proc even without a
// record, and never confused with another runtime's (another root dir) or with a reused
// pid.
func (r *Runtime) procName(id string) string { return "space-" + r.rootKey + "-" + id }

// procInfo is what /proc says about a process.
type procInfo struct {
	argv      []string
	state     byte // R, S, D, Z, ...
	startTime uint64
}

func readProc(pid int) (procInfo, error) {
	var pi procInfo
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
	pi.state = f[0][0]
	if pi.startTime, err = strconv.ParseUint(f[19], 10, 64); err != nil {
		return pi, fmt.Errorf("parse /proc/%d/stat: %w", pid, err)
	}
	cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil {
		return pi, err
	}
	pi.argv = strings.Split(strings.TrimSuffix(string(cmdline), "\x00"), "\x00")
	return pi, nil
}

// live reports whether the process runs (exists and is not a zombie).
func (pi procInfo) live() bool { return pi.state != 'Z' && pi.state != 'X' }

// isQEMU reports whether argv is this runtime's QEMU for instance id.
func (r *Runtime) isQEMU(argv []string, id string) bool {
	if len(argv) < 3 || argv[0] != r.cfg.QemuPath {
		return false
	}
	i := slices.Index(argv, "-name")
	return i >= 0 && i+1 < len(argv) && argv[i+1] == r.procName(id)
}

// instancePID returns the pid of the instance's live QEMU process, or 0: the recorded
// one if it is still that process, else one found by its name in /proc.
func (r *Runtime) instancePID(id string, rec *record) int {
	if rec != nil && rec.PID > 0 {
		if pi, err := readProc(rec.PID); err == nil && pi.live() && pi.startTime == rec.StartTime && r.isQEMU(pi.argv, id) {
			return rec.PID
		}
	}
	pids := r.scan(func(argv []string) bool { return r.isQEMU(argv, id) })
	if len(pids) > 0 {
		return pids[0]
	}
	return 0
}

// scan returns the live processes whose argv matches.
func (r *Runtime) scan(match func(argv []string) bool) []int {
	dirs, _ := filepath.Glob("/proc/[0-9]*")
	var pids []int
	for _, d := range dirs {
		pid, err := strconv.Atoi(filepath.Base(d))
		if err != nil || pid == os.Getpid() {
			continue
		}
		pi, err := readProc(pid)
		if err != nil || !pi.live() {
			continue
		}
		if match(pi.argv) {
			pids = append(pids, pid)
		}
	}
	slices.Sort(pids)
	return pids
}

// orphanIDs returns the ids of this runtime's QEMU processes found in /proc.
func (r *Runtime) orphanIDs() []string {
	prefix := "space-" + r.rootKey + "-"
	var ids []string
	r.scan(func(argv []string) bool {
		if len(argv) < 3 || argv[0] != r.cfg.QemuPath {
			return false
		}
		if i := slices.Index(argv, "-name"); i >= 0 && i+1 < len(argv) {
			if id, ok := strings.CutPrefix(argv[i+1], prefix); ok && validID(id) {
				ids = append(ids, id)
			}
		}
		return false
	})
	return ids
}

// threads counts the threads of a process. A thread group's leader turns zombie as soon
// as it exits, while its other threads (QEMU's vCPU and I/O threads) may still be
// exiting and holding the process's files (the disk image, the StateDir): the process is
// only gone when they are.
func threads(pid int) int {
	tasks, _ := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	return len(tasks)
}

// waitGone polls until pid is no longer a live process of this instance. After grace it
// sends SIGKILL, then keeps polling until ctx ends.
func waitGone(ctx context.Context, pid int, startTime uint64, grace time.Duration) error {
	killAt := time.Now().Add(grace)
	t := time.NewTicker(5 * time.Millisecond)
	defer t.Stop()
	killed := false
	for {
		pi, err := readProc(pid)
		if err != nil || pi.startTime != startTime || (!pi.live() && threads(pid) <= 1) {
			return nil
		}
		if !killed && time.Now().After(killAt) {
			if err := syscall.Kill(pid, syscall.SIGKILL); err != nil && !errors.Is(err, syscall.ESRCH) {
				return fmt.Errorf("kill %d: %w", pid, err)
			}
			killed = true
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for qemu %d to exit: %w", pid, ctx.Err())
		case <-t.C:
		}
	}
}
