package agent

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Reaper is the one place in an OS process that collects exited children
// (wait4(-1)-style): as PID 1 every orphan of the sandbox becomes its child, and any
// other waiter would race with it. There must be exactly one Reaper per OS process and
// nothing else may wait for children (no exec.Cmd.Wait) while it runs; several Agents
// (tests) share one through Config.Reaper.
//
// It peeks at an exited child with waitid(WNOWAIT) first and reaps it only inside the
// owner's exit callback, under the owner's lock: until then the zombie keeps its pid,
// so an owner that checks "not yet reaped" under that lock can signal the pid (or its
// process group) without hitting a recycled pid.
type Reaper struct {
	log  *slog.Logger
	sigc chan os.Signal
	done chan struct{}
	stop chan struct{}

	mu       sync.Mutex
	children map[int]func(reap func() unix.WaitStatus)
	closed   bool
}

// ReaperConfig configures a Reaper.
type ReaperConfig struct {
	Logger *slog.Logger
}

// NewReaper starts the reaper. When the process is not PID 1 it makes itself a child
// subreaper (PR_SET_CHILD_SUBREAPER) so that orphaned descendants are still reaped
// here. Close stops it.
func NewReaper(cfg ReaperConfig) (*Reaper, error) {
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if os.Getpid() != 1 {
		if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
			return nil, fmt.Errorf("set child subreaper: %w", err)
		}
	}
	r := &Reaper{
		log:      log,
		sigc:     make(chan os.Signal, 1),
		done:     make(chan struct{}),
		stop:     make(chan struct{}),
		children: make(map[int]func(func() unix.WaitStatus)),
	}
	signal.Notify(r.sigc, unix.SIGCHLD)
	go r.loop()
	return r, nil
}

// Close stops reaping. Children still registered are left alone.
func (r *Reaper) Close() {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return
	}
	r.closed = true
	r.mu.Unlock()
	signal.Stop(r.sigc)
	close(r.stop)
	<-r.done
}

// spawn runs start (which forks a child and returns its pid) and registers onExit for
// that pid atomically with respect to reaping: a child that exits before spawn returns
// is still delivered to onExit. onExit is called once, from the reaper goroutine; it
// must call reap (exactly once) to collect the status, while holding whatever lock
// guards its "exited" flag.
func (r *Reaper) spawn(start func() (int, error), onExit func(reap func() unix.WaitStatus)) (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return 0, errors.New("reaper closed")
	}
	pid, err := start()
	if err != nil {
		return 0, err
	}
	r.children[pid] = onExit
	return pid, nil
}

func (r *Reaper) loop() {
	defer close(r.done)
	for {
		r.reapAll()
		select {
		case <-r.sigc:
		case <-r.stop:
			return
		}
	}
}

// reapAll collects every child that has exited so far.
func (r *Reaper) reapAll() {
	for {
		pid, err := peekExited()
		if err != nil {
			if !errors.Is(err, unix.ECHILD) {
				r.log.Warn("waitid", "err", err)
			}
			return
		}
		if pid == 0 {
			return
		}
		r.mu.Lock()
		onExit := r.children[pid]
		delete(r.children, pid)
		r.mu.Unlock()
		if onExit == nil {
			// An orphan adopted by us (PID 1 or subreaper), or a child somebody else
			// started: collect it so it does not linger as a zombie.
			ws, _ := reapPid(pid)
			r.log.Debug("reaped orphan", "pid", pid, "status", int(ws))
			continue
		}
		called := false
		onExit(func() unix.WaitStatus {
			called = true
			ws, err := reapPid(pid)
			if err != nil {
				r.log.Warn("wait4", "pid", pid, "err", err)
			}
			return ws
		})
		if !called {
			_, _ = reapPid(pid)
		}
	}
}

// peekExited returns the pid of an exited child without reaping it (0 if none).
func peekExited() (int, error) {
	var info unix.Siginfo
	for {
		err := unix.Waitid(unix.P_ALL, 0, &info, unix.WEXITED|unix.WNOHANG|unix.WNOWAIT, nil)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return 0, err
		}
		return siginfoPid(&info), nil
	}
}

// siginfoPid reads si_pid from a siginfo_t: x/sys/unix exposes only the header fields.
// The union holding si_pid starts after three int32 fields, aligned to the pointer size
// (offset 16 on 64-bit, 12 on 32-bit architectures).
func siginfoPid(info *unix.Siginfo) int {
	off := uintptr(12)
	if unsafe.Sizeof(uintptr(0)) == 8 {
		off = 16
	}
	return int(*(*int32)(unsafe.Add(unsafe.Pointer(info), off)))
}

func reapPid(pid int) (unix.WaitStatus, error) {
	var ws unix.WaitStatus
	for {
		_, err := unix.Wait4(pid, &ws, 0, nil)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		return ws, err
	}
}
