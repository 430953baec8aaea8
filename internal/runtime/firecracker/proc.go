package firecracker

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

// argID returns the value of --id in argv ("--id X" or "--id=X"), or "".
func argID(argv []string) string {
	for i, a := range argv {
		if v, ok := strings.CutPrefix(a, "--id="); ok {
			return v
		}
		if a == "--id" && i+1 < len(argv) {
			return argv[i+1]
		}
	}
	return ""
}

// jailIDOf returns the jail id of a process of this runtime (firecracker, or the jailer
// about to become it), or "".
func (r *Runtime) jailIDOf(argv []string) string {
	if len(argv) < 2 {
		return ""
	}
	base := filepath.Base(argv[0])
	if base != r.execName && (!r.jailed || base != filepath.Base(r.cfg.JailerPath)) {
		return ""
	}
	return argID(argv)
}

// instancePID returns the pid of the instance's live firecracker (or jailer) process, or
// 0: the recorded one if it is still that process, else one found by its --id in /proc.
func (r *Runtime) instancePID(id string, rec *record) int {
	jid := r.jailID(id)
	if rec != nil && rec.PID > 0 {
		if pi, err := readProc(rec.PID); err == nil && pi.live() && pi.startTime == rec.StartTime && r.jailIDOf(pi.argv) == jid {
			return rec.PID
		}
	}
	if pids := r.scan(func(argv []string) bool { return r.jailIDOf(argv) == jid }); len(pids) > 0 {
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

// orphanIDs returns the ids of this runtime's firecracker processes found in /proc.
func (r *Runtime) orphanIDs() []string {
	prefix := r.rootKey + "-"
	var ids []string
	r.scan(func(argv []string) bool {
		if id, ok := strings.CutPrefix(r.jailIDOf(argv), prefix); ok && validID(id) {
			ids = append(ids, id)
		}
		return false
	})
	return ids
}

// kill sends SIGKILL to pid (if it is still the process that started at startTime) and
// polls until it is gone or ctx ends.
func kill(ctx context.Context, pid int, startTime uint64) error {
	t := time.NewTicker(5 * time.Millisecond)
	defer t.Stop()
	killed := false
	for {
		pi, err := readProc(pid)
		if err != nil || !pi.live() || pi.startTime != startTime {
			return nil
		}
		if !killed {
			if err := syscall.Kill(pid, syscall.SIGKILL); err != nil && !errors.Is(err, syscall.ESRCH) {
				return fmt.Errorf("kill %d: %w", pid, err)
			}
			killed = true
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for firecracker %d to exit: %w", pid, ctx.Err())
		case <-t.C:
		}
	}
}
