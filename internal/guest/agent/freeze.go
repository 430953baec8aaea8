package agent

import (
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/guest/wire"
)

// Freezing user code around a checkpoint: nothing the user started may run between
// the moment the sandbox's memory is saved and the moment a restored copy has its new
// identity (fresh entropy, the host's clock), or two clones could produce the same
// "random" values, and a process could take the agent's place on its transport while
// the agent waits for its identity. Over a socket the host removed (gVisor) user code
// thaws only once the agent listens again (listenThenThaw): a process that ran first
// could bind the free path.
//
// As PID 1 of the sandbox (always, in production) the agent stops EVERY process of the
// sandbox but itself — whatever session, group or parent it has, so a `setsid` or a
// double-forked daemon is stopped too — scanning /proc until a pass finds nothing left
// running (a process that forked meanwhile is caught by the next pass). It continues
// exactly the processes it stopped, so a process the user had stopped stays stopped.
// (A cgroup freezer would do the same, but gVisor has none; signals work on every
// runtime.) When the agent is not PID 1 (tests that run it as a plain process) it stops
// the process groups of the processes it started.

// errQuiesced refuses a process start while user code is frozen: the request came past
// the host's gate as the checkpoint began (the host normally holds such requests
// until it resumes the sandbox). Nothing was started, so the caller may retry.
var errQuiesced = &apiError{status: http.StatusServiceUnavailable, code: wire.ErrCodeQuiesced,
	msg: "the sandbox is being checkpointed; nothing was started, try again"}

// Bounds of the freeze scan.
const (
	freezePasses = 100
	freezeSettle = 2 * time.Millisecond
)

// freeze stops user code.
func (a *Agent) freeze() {
	a.freezeMu.Lock()
	defer a.freezeMu.Unlock()
	if a.frozen {
		return
	}
	a.frozen = true
	if os.Getpid() == 1 {
		a.stopped = stopAll()
		a.log.Info("froze every process of the sandbox", "processes", len(a.stopped))
		return
	}
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
	if a.stopped != nil {
		for _, pid := range a.stopped {
			_ = unix.Kill(pid, unix.SIGCONT)
		}
		a.stopped = nil
		a.log.Info("continued the sandbox's processes")
		return
	}
	for _, pid := range a.runningPIDs() {
		if unix.Kill(-pid, unix.SIGCONT) != nil {
			_ = unix.Kill(pid, unix.SIGCONT)
		}
	}
	a.log.Info("continued user processes")
}

// stopAll stops every process of the PID namespace but the caller (PID 1) and kernel
// threads, until none is left running, and returns the pids it stopped.
func stopAll() []int {
	stopped := map[int]bool{}
	for range freezePasses {
		running := 0
		for _, p := range processes() {
			if p.kernel || p.state == 'Z' || p.state == 'X' {
				continue
			}
			if p.state == 'T' || p.state == 't' {
				continue // stopped: by us (a previous pass), or by the user (left so)
			}
			running++
			if unix.Kill(p.pid, unix.SIGSTOP) == nil {
				stopped[p.pid] = true
			}
		}
		if running == 0 {
			break
		}
		time.Sleep(freezeSettle) // let the signals land, then look again
	}
	out := make([]int, 0, len(stopped))
	for pid := range stopped {
		out = append(out, pid)
	}
	return out
}

type procInfo struct {
	pid, ppid, pgrp, session int
	state                    byte
	kernel                   bool
	comm                     string
	rss                      int64 // resident memory, bytes
}

// pfKthread is PF_KTHREAD in /proc/<pid>/stat's flags.
const pfKthread = 0x00200000

// pids lists the processes of the PID namespace (/proc's numeric entries).
func pids() []int {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	var out []int
	for _, e := range ents {
		if pid, err := strconv.Atoi(e.Name()); err == nil {
			out = append(out, pid)
		}
	}
	return out
}

// processes lists the processes of the PID namespace other than the caller.
func processes() []procInfo {
	self := os.Getpid()
	var out []procInfo
	for _, pid := range pids() {
		if pid == self {
			continue
		}
		data, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
		if err != nil {
			continue // gone
		}
		// pid (comm) state ppid pgrp session tty tpgid flags ...: comm may hold spaces.
		s := string(data)
		i := strings.LastIndexByte(s, ')')
		j := strings.IndexByte(s, '(')
		if i < 0 || j < 0 || j > i || i+2 >= len(s) {
			continue
		}
		f := strings.Fields(s[i+2:])
		if len(f) < 22 {
			continue
		}
		flags, _ := strconv.ParseUint(f[6], 10, 64)
		ppid, _ := strconv.Atoi(f[1])
		pgrp, _ := strconv.Atoi(f[2])
		session, _ := strconv.Atoi(f[3])
		rss, _ := strconv.ParseInt(f[21], 10, 64)
		out = append(out, procInfo{pid: pid, ppid: ppid, pgrp: pgrp, session: session, state: f[0][0],
			kernel: flags&pfKthread != 0 || pid == 2 || ppid == 2, comm: s[j+1 : i], rss: rss * int64(os.Getpagesize())})
	}
	return out
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
