package pgmanaged

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// The /proc reads below are hand-rolled: three small files (stat, cwd, exe) do not
// justify a direct dependency on a full procfs library.

// pollInterval is how often waits re-check a real condition (process gone, server
// answering). Short: the conditions are cheap to check and the waits are on hot paths
// (start, stop).
const pollInterval = 25 * time.Millisecond

// readPostmasterPID returns the pid in dataDir/postmaster.pid, or 0 when the file does
// not exist or is being written (the postmaster writes the pid on its first line).
func readPostmasterPID(dataDir string) (int, error) {
	b, err := os.ReadFile(filepath.Join(dataDir, "postmaster.pid"))
	if errors.Is(err, os.ErrNotExist) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	first, _, _ := bytes.Cut(b, []byte("\n"))
	pid, err := strconv.Atoi(strings.TrimSpace(string(first)))
	if err != nil || pid <= 0 {
		return 0, nil
	}
	return pid, nil
}

// alive reports whether pid exists and is not a zombie.
func alive(pid int) bool {
	if err := syscall.Kill(pid, 0); err != nil && !errors.Is(err, syscall.EPERM) {
		return false
	}
	st, err := procStat(pid)
	if err != nil {
		return false // gone between the two checks
	}
	return st.state != 'Z' && st.state != 'X'
}

type stat struct {
	state byte
	ppid  int
}

// procStat parses /proc/pid/stat: "pid (comm) state ppid ...", where comm may contain
// spaces and parentheses, hence the last ')'.
func procStat(pid int) (stat, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return stat{}, err
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return stat{}, fmt.Errorf("parse /proc/%d/stat", pid)
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 2 || len(f[0]) != 1 {
		return stat{}, fmt.Errorf("parse /proc/%d/stat", pid)
	}
	ppid, err := strconv.Atoi(f[1])
	if err != nil {
		return stat{}, fmt.Errorf("parse /proc/%d/stat: %w", pid, err)
	}
	return stat{state: f[0][0], ppid: ppid}, nil
}

// servesDataDir tells whether pid is a postgres process of the cluster in dataDir (its
// real path): every postgres process chdirs into its data directory. ok is false when
// that cannot be read (another user's process while not root).
func servesDataDir(pid int, dataDir string) (yes, ok bool) {
	cwd, err := os.Readlink(fmt.Sprintf("/proc/%d/cwd", pid))
	if err != nil {
		return false, false
	}
	exe, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", pid))
	if err != nil {
		return false, false
	}
	// After a package upgrade the running binary reads "postgres (deleted)".
	return cwd == dataDir && strings.HasPrefix(filepath.Base(exe), "postgres"), true
}

// leftovers lists postgres processes of dataDir that do not belong to the postmaster
// keep (0: none is running): backends and auxiliary processes orphaned when their
// postmaster was SIGKILLed. They keep the old shared memory attached, which makes a new
// postmaster refuse to start, and they exit on their own only eventually.
func leftovers(dataDir string, keep int) []int {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	var pids []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == keep {
			continue
		}
		if yes, _ := servesDataDir(pid, dataDir); !yes {
			continue
		}
		st, err := procStat(pid)
		if err != nil || (keep != 0 && st.ppid == keep) || st.state == 'Z' {
			continue
		}
		pids = append(pids, pid)
	}
	return pids
}

// killLeftovers SIGKILLs the leftovers of dataDir and waits until they are gone.
func killLeftovers(ctx context.Context, dataDir string, keep int) error {
	pids := leftovers(dataDir, keep)
	if len(pids) == 0 {
		return nil
	}
	for _, pid := range pids {
		_ = syscall.Kill(pid, syscall.SIGKILL) // ESRCH: already gone
	}
	err := waitFor(ctx, 10*time.Second, func() bool {
		for _, pid := range pids {
			if alive(pid) {
				return false
			}
		}
		return true
	})
	if err != nil {
		return fmt.Errorf("leftover postgres processes %v: %w", pids, err)
	}
	return nil
}

// waitFor polls cond until it holds, ctx is done, or max has passed.
func waitFor(ctx context.Context, max time.Duration, cond func() bool) error {
	ctx, cancel := context.WithTimeout(ctx, max)
	defer cancel()
	t := time.NewTicker(pollInterval)
	defer t.Stop()
	for {
		if cond() {
			return nil
		}
		select {
		case <-ctx.Done():
			if cond() {
				return nil
			}
			return ctx.Err()
		case <-t.C:
		}
	}
}
