package qemu

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/spacedev/space/internal/runtime/instances"
)

// procName is the -name of an instance's QEMU process: it carries the runtime's root
// dir key and the instance id, so the process is found from /proc even without a
// record, and never confused with another runtime's (another root dir) or with a reused
// pid.
func (r *Runtime) procName(id string) string { return "space-" + r.rootKey + "-" + id }

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
	var pid int
	var startTime uint64
	if rec != nil {
		pid, startTime = rec.PID, rec.StartTime
	}
	return instances.FindPID(pid, startTime, func(argv []string) bool { return r.isQEMU(argv, id) })
}

// orphanIDs returns the ids of this runtime's QEMU processes found in /proc.
func (r *Runtime) orphanIDs() []string {
	prefix := "space-" + r.rootKey + "-"
	var ids []string
	instances.Scan(func(argv []string) bool {
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
		pi, err := instances.ReadProc(pid)
		if err != nil || pi.StartTime != startTime || (!pi.Live() && threads(pid) <= 1) {
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
