package agent

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"syscall"

	"golang.org/x/sys/unix"
)

// A gated process is the agent's own binary (/proc/self/exe) started with argv[0] =
// gateArg0 and everything a process needs already in place (credentials, session,
// controlling terminal, cwd, environment, stdio). It blocks reading gateFD; one byte
// makes it exec the real program (argv[1:]), EOF makes it exit 127 without running
// anything. Its pid is the program's pid, so a client can attach to the output before
// the first byte is written.
//
// Exec failures are reported on statusFD, which is close-on-exec: the agent reads until
// EOF, and EOF with no bytes means the exec succeeded.
const (
	gateArg0 = "space-agent-gate"
	gateFD   = 3
	statusFD = 4
)

// MaybeRunGate turns the current process into a process gate when it was started as
// one, and never returns in that case. It must be the first thing in main of every
// binary that runs agent code (cmd/space-agent, and TestMain of test binaries that start
// agent processes), since gated processes re-execute /proc/self/exe.
func MaybeRunGate() {
	if len(os.Args) == 0 || os.Args[0] != gateArg0 {
		return
	}
	os.Exit(runGate(os.Args[1:]))
}

func runGate(argv []string) int {
	status := os.NewFile(statusFD, "status")
	fail := func(code int, format string, args ...any) int {
		if status != nil {
			fmt.Fprintf(status, format, args...)
		}
		return code
	}
	if len(argv) == 0 {
		return fail(127, "gate: no program")
	}
	var b [1]byte
	for {
		n, err := unix.Read(gateFD, b[:])
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if n != 1 {
			// The agent gave up on the process before starting it: exit quietly.
			return 127
		}
		break
	}
	unix.CloseOnExec(gateFD)
	unix.CloseOnExec(statusFD)
	// PATH here is the process's own environment, set by the agent.
	path, err := exec.LookPath(argv[0])
	if err != nil {
		return fail(execExitCode(err), "exec %s: %v", argv[0], errors.Unwrap(err))
	}
	err = syscall.Exec(path, argv, os.Environ())
	return fail(execExitCode(err), "exec %s: %v", path, err)
}

// execExitCode is the shell's convention: 127 for a program that does not exist, 126
// for one that exists but cannot be executed.
func execExitCode(err error) int {
	if errors.Is(err, unix.ENOENT) || errors.Is(err, exec.ErrNotFound) {
		return 127
	}
	return 126
}
