package gvisor

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/prometheus/procfs"
)

// hostProcs returns the host processes runsc runs for a container, found in /proc: the
// sandbox ("runsc-sandbox --root=R … boot … ID"), the gofer ("runsc-gofer --root=R gofer
// --bundle DIR …") and their descendants (the ptrace platform's stub processes). Zombies
// are skipped: they hold nothing but a pid and are reaped by whoever inherited them.
// stateDir may be empty when unknown; the gofer is then only found as a descendant.
func (r *Runtime) hostProcs(id, stateDir string) ([]int, error) {
	fs, err := procfs.NewFS(procfs.DefaultMountPoint)
	if err != nil {
		return nil, fmt.Errorf("open /proc: %w", err)
	}
	all, err := fs.AllProcs()
	if err != nil {
		return nil, fmt.Errorf("list processes: %w", err)
	}
	children := map[int][]int{}
	var found []int
	for _, p := range all {
		st, err := p.Stat()
		if err != nil || st.State == "Z" || st.State == "X" {
			continue // gone meanwhile, or dead
		}
		children[st.PPID] = append(children[st.PPID], p.PID)
		argv, err := p.CmdLine()
		if err == nil && r.isRunscOf(argv, id, stateDir) {
			found = append(found, p.PID)
		}
	}
	for i := 0; i < len(found); i++ { // found grows while walking: breadth-first descendants
		for _, c := range children[found[i]] {
			if !slices.Contains(found, c) {
				found = append(found, c)
			}
		}
	}
	return found, nil
}

// isRunscOf tells whether argv is a runsc sandbox or gofer process of container id under
// this runtime's root dir.
func (r *Runtime) isRunscOf(argv []string, id, stateDir string) bool {
	if len(argv) < 2 || !strings.Contains(argv[0], "runsc") {
		return false
	}
	if flagValue(argv, "root") != r.cfg.RootDir {
		return false
	}
	if slices.Contains(argv, "boot") && argv[len(argv)-1] == id {
		return true
	}
	return stateDir != "" && slices.Contains(argv, "gofer") && flagValue(argv, "bundle") == stateDir
}

// flagValue returns the value of a Go-style flag given as --name=value, -name=value,
// --name value or -name value.
func flagValue(argv []string, name string) string {
	for i, a := range argv {
		for _, f := range []string{"--" + name, "-" + name} {
			if v, ok := strings.CutPrefix(a, f+"="); ok {
				return v
			}
			if a == f && i+1 < len(argv) {
				return argv[i+1]
			}
		}
	}
	return ""
}

// waitHostProcsGone polls until no host process of the container is left. After grace it
// SIGKILLs whatever is left (runsc failed to), then keeps polling until ctx ends.
func (r *Runtime) waitHostProcsGone(ctx context.Context, id, stateDir string, grace time.Duration) error {
	killAt := time.Now().Add(grace)
	// The gofer exits a moment after the sandbox: look again soon, then every 20 ms.
	wait := 2 * time.Millisecond
	for {
		pids, err := r.hostProcs(id, stateDir)
		if err != nil {
			return err
		}
		if len(pids) == 0 {
			return nil
		}
		if time.Now().After(killAt) {
			r.log.WarnContext(ctx, "killing leftover runsc processes", "id", id, "pids", pids)
			for _, pid := range pids {
				if err := syscall.Kill(pid, syscall.SIGKILL); err != nil && !errors.Is(err, syscall.ESRCH) {
					return fmt.Errorf("kill leftover runsc process %d: %w", pid, err)
				}
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for runsc processes %v to exit: %w", pids, ctx.Err())
		case <-time.After(wait):
		}
		wait = min(2*wait, 20*time.Millisecond)
	}
}
