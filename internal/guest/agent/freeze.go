package agent

import (
	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/guest/wire"
)

// Freezing user processes around a checkpoint: nothing the user started may run between
// the moment the sandbox's memory is saved and the moment a restored copy has its new
// identity (fresh entropy, the host's clock), or two clones could produce the same
// "random" values. The agent stops every running process's group with SIGSTOP when it
// quiesces and continues them (SIGCONT) once a new identity is applied. (A cgroup
// freezer would also catch processes that left their group, but gVisor has none;
// signals work on every runtime.)

// freeze stops the process group of every running process.
func (a *Agent) freeze() {
	a.freezeMu.Lock()
	defer a.freezeMu.Unlock()
	if a.frozen {
		return
	}
	a.frozen = true
	n := 0
	for _, pid := range a.runningPIDs() {
		if err := unix.Kill(-pid, unix.SIGSTOP); err == nil {
			n++
		} else if err := unix.Kill(pid, unix.SIGSTOP); err == nil {
			n++
		}
	}
	a.log.Info("froze user processes", "groups", n)
}

// thaw continues what freeze stopped.
func (a *Agent) thaw() {
	a.freezeMu.Lock()
	defer a.freezeMu.Unlock()
	if !a.frozen {
		return
	}
	a.frozen = false
	for _, pid := range a.runningPIDs() {
		if unix.Kill(-pid, unix.SIGCONT) != nil {
			_ = unix.Kill(pid, unix.SIGCONT)
		}
	}
	a.log.Info("continued user processes")
}

// runningPIDs lists the processes that are running (started and not exited).
func (a *Agent) runningPIDs() []int {
	a.procMu.Lock()
	defer a.procMu.Unlock()
	var out []int
	for pid, p := range a.procs {
		p.mu.Lock()
		running := p.state == wire.StateRunning
		p.mu.Unlock()
		if running {
			out = append(out, pid)
		}
	}
	return out
}
