package agent

import (
	"fmt"
	"net/http"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/guest/wire"
)

// Out of memory. gVisor has no OOM killer of its own (gVisor issue 2533): a guest that
// allocates past what its host cgroup allows meets the host's, which ends a host
// process of the sandbox: the systrap stub of a large guest process, which ends that
// process, or the Sentry, which ends the whole sandbox with every process and all its
// memory (with huge pages for shared memory it did). So the node watches the sandbox's
// host memory and, when it nears the limit, asks the agent (POST /v1/memory/reclaim) to
// do what a Linux guest's OOM killer would: end the user process holding the most
// memory, with SIGKILL. The sandbox, its other processes and its files stay. In a VM the
// guest kernel's OOM killer does this, and nothing calls the agent.
//
// The candidates are every process of the sandbox but the agent (as PID 1), or, when
// the agent is not PID 1 (tests, the fake runtime), its descendants only. A process
// whose oom_score_adj is -1000 is never chosen, as under Linux. The command the victim
// belongs to (the process itself, or the process that leads its group or session) ends
// with an error that says why, if it ends by a signal or with a non-zero status.

// oomMessage is the error of a command whose process the agent ended.
func oomMessage(v wire.Reclaimed) string {
	return fmt.Sprintf("out of memory: the sandbox's memory was full and process %d (%s), holding %d MiB, was killed", v.PID, v.Name, v.RSS>>20)
}

func (a *Agent) handleReclaim(w http.ResponseWriter, r *http.Request) error {
	v, ok := a.reclaim()
	if !ok {
		w.WriteHeader(http.StatusNoContent)
		return nil
	}
	writeJSON(w, http.StatusOK, v)
	return nil
}

// reclaim ends the candidate process with the largest resident memory, if there is one.
func (a *Agent) reclaim() (wire.Reclaimed, bool) {
	victim, ok := pickVictim(processes(), os.Getpid())
	if !ok {
		a.log.Warn("out of memory, and no process to end")
		return wire.Reclaimed{}, false
	}
	v := wire.Reclaimed{PID: victim.pid, Name: victim.comm, RSS: victim.rss}
	a.noteOOM(victim, oomMessage(v))
	if err := unix.Kill(victim.pid, unix.SIGKILL); err != nil {
		a.log.Warn("out of memory: could not end the largest process", "pid", victim.pid, "err", err)
		return wire.Reclaimed{}, false
	}
	a.log.Warn("out of memory: ended the largest process", "pid", v.PID, "name", v.Name, "rss_mib", v.RSS>>20)
	return v, true
}

// pickVictim returns the candidate (see above) with the most resident memory.
func pickVictim(procs []procInfo, self int) (procInfo, bool) {
	var mine map[int]bool // nil: every process is a candidate (the agent is PID 1)
	if self != 1 {
		mine = descendants(procs, self)
	}
	var best procInfo
	found := false
	for _, p := range procs {
		if p.kernel || p.state == 'Z' || p.state == 'X' || (mine != nil && !mine[p.pid]) ||
			p.rss <= 0 || (found && p.rss <= best.rss) || unkillable(p.pid) {
			continue
		}
		best, found = p, true
	}
	return best, found
}

// descendants returns the pids of procs that descend from pid.
func descendants(procs []procInfo, pid int) map[int]bool {
	children := map[int][]int{}
	for _, p := range procs {
		children[p.ppid] = append(children[p.ppid], p.pid)
	}
	out := map[int]bool{}
	for next := children[pid]; len(next) > 0; {
		c := next[len(next)-1]
		next = next[:len(next)-1]
		if !out[c] {
			out[c] = true
			next = append(next, children[c]...)
		}
	}
	return out
}

// unkillable reports whether the process opted out of the OOM killer
// (oom_score_adj -1000).
func unkillable(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/oom_score_adj")
	if err != nil {
		return false
	}
	adj, err := strconv.Atoi(strings.TrimSpace(string(b)))
	return err == nil && adj <= -1000
}

// noteOOM tells the command the victim belongs to why it may end: the agent's own
// process with the victim's pid, or the one leading its process group or session.
func (a *Agent) noteOOM(victim procInfo, msg string) {
	a.procMu.Lock()
	p := a.procs[victim.pid]
	if p == nil {
		p = a.procs[victim.pgrp]
	}
	if p == nil {
		p = a.procs[victim.session]
	}
	a.procMu.Unlock()
	if p == nil {
		return
	}
	p.mu.Lock()
	if !p.reaped {
		p.oomNote = msg
	}
	p.mu.Unlock()
}
