//go:build failpoints

package crash

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
)

// Environment of a failpoints build:
//
//	SPACE_CRASH_LOG      file every point passed is appended to (one name a line)
//	SPACE_CRASH_AT       the point to act at (its first pass only)
//	SPACE_CRASH_ACTION   kill (default): SIGKILL this process; pgkill: SIGKILL the
//	                     PostgreSQL whose postmaster.pid is SPACE_CRASH_PGPID, then go on
//	SPACE_CRASH_ONCE     a file created when the action is taken; if it exists, the
//	                     action is not taken again (across restarts)
//	SPACE_CRASH_ARM      when set, act only once this file exists (a test arms the
//	                     point after its setup, which may pass the same point); a
//	                     file holding "<point> <action> <once-file>" names the point,
//	                     action and once-file itself, over the three above, so that a
//	                     test walks point after point without restarting the process
type config struct {
	log, at, action, pgPID, once, arm string
}

// The configuration is read once per process: a failpoints build is a test binary
// whose environment is the test's, fixed at start.
var cfg = sync.OnceValue(func() config {
	return config{
		log: os.Getenv("SPACE_CRASH_LOG"), at: os.Getenv("SPACE_CRASH_AT"),
		action: os.Getenv("SPACE_CRASH_ACTION"), pgPID: os.Getenv("SPACE_CRASH_PGPID"),
		once: os.Getenv("SPACE_CRASH_ONCE"), arm: os.Getenv("SPACE_CRASH_ARM"),
	}
})

var logMu sync.Mutex

// Point records that name was passed and, at SPACE_CRASH_AT, takes the action.
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
	at, action, once := c.at, c.action, c.once
	if c.arm != "" {
		b, err := os.ReadFile(c.arm)
		if err != nil {
			return // not armed
		}
		if f := strings.Fields(string(b)); len(f) == 3 {
			at, action, once = f[0], f[1], f[2]
		}
	}
	if name != at || at == "" {
		return
	}
	if once != "" {
		f, err := os.OpenFile(once, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o644)
		if err != nil {
			return // taken already
		}
		// The point and the process that takes the action: a test tells from it whether
		// the process it is watching is the one that dies.
		_, _ = f.WriteString(name + " " + strconv.Itoa(os.Getpid()) + "\n")
		_ = f.Sync()
		_ = f.Close()
	}
	switch action {
	case "pgkill":
		if b, err := os.ReadFile(filepath.Clean(c.pgPID)); err == nil {
			first, _, _ := strings.Cut(string(b), "\n")
			if pid, err := strconv.Atoi(strings.TrimSpace(first)); err == nil && pid > 1 {
				_ = syscall.Kill(pid, syscall.SIGKILL)
			}
		}
	default:
		_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {} // never returns
	}
}
