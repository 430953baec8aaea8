//go:build failpoints

package crash

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/procfs"
)

// Environment of a failpoints build:
//
//	SPACE_CRASH_LOG      file every point passed is appended to (one name a line)
//	SPACE_CRASH_ARM      the arm file (Arm): while it exists, the point it names takes
//	                     its action on its first pass; a test arms a point after its
//	                     setup (which may pass the same point) and walks point after
//	                     point without restarting the process
//	SPACE_CRASH_PGPID    the postmaster.pid of the PostgreSQL the pgkill action kills
type config struct {
	log, pgPID, arm string
}

// The configuration is read once per process: a failpoints build is a test binary
// whose environment is the test's, fixed at start.
var cfg = sync.OnceValue(func() config {
	return config{log: os.Getenv("SPACE_CRASH_LOG"), pgPID: os.Getenv("SPACE_CRASH_PGPID"),
		arm: os.Getenv("SPACE_CRASH_ARM")}
})

var logMu sync.Mutex

// Point records that name was passed and, at the armed point, takes the action.
func Point(name string) {
	c := cfg()
	if c.log != "" {
		logMu.Lock()
		if f, err := os.OpenFile(c.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644); err == nil {
			_, _ = f.WriteString(name + "\n")
			_ = f.Sync()
			_ = f.Close()
		}
		logMu.Unlock()
	}
	if c.arm == "" {
		return
	}
	b, err := os.ReadFile(c.arm)
	if err != nil {
		return // not armed
	}
	f := strings.Fields(string(b))
	if len(f) != 3 || f[0] != name {
		return
	}
	action, once := f[1], f[2]
	of, err := os.OpenFile(once, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o644)
	if err != nil {
		return // taken already
	}
	// The point and the process that takes the action: a test tells from it whether the
	// process it is watching is the one that dies.
	_, _ = of.WriteString(name + " " + strconv.Itoa(os.Getpid()) + "\n")
	_ = of.Sync()
	_ = of.Close()
	switch action {
	case "pgkill":
		if b, err := os.ReadFile(filepath.Clean(c.pgPID)); err == nil {
			first, _, _ := strings.Cut(string(b), "\n")
			if pid, err := strconv.Atoi(strings.TrimSpace(first)); err == nil && pid > 1 {
				killPostgres(pid)
			}
		}
	default:
		_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {} // never returns
	}
}

// killPostgres kills the postmaster pid and every process it started (the backends
// serving this process's connections among them), as a crash of the whole server
// would, and returns once they are all dead: the code after the point meets a database
// that is gone, not backends that have yet to notice their postmaster died.
func killPostgres(pid int) {
	pids := append(childrenOf(pid), pid)
	for _, p := range pids {
		_ = syscall.Kill(p, syscall.SIGKILL)
	}
	deadline := time.Now().Add(5 * time.Second)
	for _, p := range pids {
		for alive(p) && time.Now().Before(deadline) {
			time.Sleep(time.Millisecond)
		}
	}
}

// childrenOf lists the processes whose parent is pid.
func childrenOf(pid int) []int {
	procs, _ := procfs.AllProcs()
	var out []int
	for _, p := range procs {
		if st, err := p.Stat(); err == nil && st.PPID == pid {
			out = append(out, p.PID)
		}
	}
	return out
}

// alive reports whether pid exists and has not exited (a zombie holds no descriptor
// any more: its connections are closed).
func alive(pid int) bool {
	p, err := procfs.NewProc(pid)
	if err != nil {
		return false
	}
	st, err := p.Stat()
	return err == nil && st.State != "Z" && st.State != "X"
}
