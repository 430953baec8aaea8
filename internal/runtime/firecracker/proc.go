package firecracker

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/spacedev/space/internal/runtime/instances"
)

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
	var pid int
	var startTime uint64
	if rec != nil {
		pid, startTime = rec.PID, rec.StartTime
	}
	return instances.FindPID(pid, startTime, func(argv []string) bool { return r.jailIDOf(argv) == jid })
}

// orphanIDs returns the ids of this runtime's firecracker processes found in /proc.
func (r *Runtime) orphanIDs() []string {
	prefix := r.rootKey + "-"
	var ids []string
	instances.Scan(func(argv []string) bool {
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
		pi, err := instances.ReadProc(pid)
		if err != nil || !pi.Live() || pi.StartTime != startTime {
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
