package gvisor

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os/exec"
	"slices"
	"strings"
	"time"

	"github.com/spacedev/space/internal/runtime"
	"github.com/spacedev/space/internal/runtime/instances"
)

// containerState is the JSON that `runsc state` and `runsc list -format=json` print (the
// OCI runtime state).
type containerState struct {
	ID     string `json:"id"`
	Status string `json:"status"`
	PID    int    `json:"pid"`
	Bundle string `json:"bundle"`
}

// runsc runs one runsc subcommand with the runtime's global flags and returns its
// stdout. Errors carry runsc's stderr.
func (r *Runtime) runsc(ctx context.Context, args ...string) ([]byte, error) {
	return r.exec(ctx, r.args(args...))
}

// exec runs runsc with exactly args, bounded by the command timeout.
func (r *Runtime) exec(ctx context.Context, args []string) ([]byte, error) {
	if ok, ids := changes(args); ok {
		defer r.statuses.change(ids)()
	}
	ctx, cancel := context.WithTimeout(ctx, r.cfg.CommandTimeout)
	defer cancel()
	var stdout, stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, r.cfg.RunscPath, args...)
	cmd.Stdout = &stdout
	cmd.Stderr = &stderr
	start := time.Now()
	err := cmd.Run()
	r.logRun(ctx, args, start, err)
	if err != nil {
		return stdout.Bytes(), runscError(args, err, stderr.String())
	}
	return stdout.Bytes(), nil
}

// args prepends the global flags every invocation gets.
func (r *Runtime) args(args ...string) []string {
	out := []string{"--root=" + r.cfg.RootDir, "--platform=" + r.cfg.Platform}
	out = append(out, r.cfg.ExtraFlags...)
	return append(out, args...)
}

func (r *Runtime) logRun(ctx context.Context, args []string, start time.Time, err error) {
	attrs := []any{"args", args, "duration", time.Since(start)}
	if err != nil {
		attrs = append(attrs, "err", err)
	}
	r.log.DebugContext(ctx, "runsc", attrs...)
}

func runscError(args []string, err error, stderr string) error {
	sub := strings.Join(args, " ")
	if i := slices.IndexFunc(args, func(a string) bool { return !strings.HasPrefix(a, "-") }); i >= 0 {
		sub = args[i]
	}
	if msg := trimStateDump(strings.TrimSpace(stderr)); msg != "" {
		return fmt.Errorf("runsc %s: %w: %s", sub, err, msg)
	}
	return fmt.Errorf("runsc %s: %w", sub, err)
}

// trimStateDump shortens a checkpoint's "encoding error": gVisor follows it with the
// encoder's goroutine dump and a dump of the object it could not save, tens of KiB
// that ended up in the sandbox's error. It keeps the first line and the object's path
// when it has one (a unix socket's).
func trimStateDump(msg string) string {
	i := strings.Index(msg, "\ngoroutine ")
	if i < 0 {
		return msg
	}
	head := strings.TrimSuffix(strings.TrimSpace(msg[:i]), ":")
	if _, rest, ok := strings.Cut(msg, `path:"`); ok {
		if p, _, ok := strings.Cut(rest, `"`); ok && p != "" {
			head += " (path " + p + ")"
		}
	}
	return head
}

// state reports runsc's view of the container, or runtime.ErrNotFound when runsc has no
// container with that id.
func (r *Runtime) state(ctx context.Context, id string) (containerState, error) {
	out, err := r.runsc(ctx, "state", id)
	if err != nil {
		// runsc's "not found" is only an error message; ask `list` to tell a missing
		// container from a failing runsc.
		all, lerr := r.list(ctx)
		if lerr == nil && !slices.ContainsFunc(all, func(c containerState) bool { return c.ID == id }) {
			return containerState{}, runtime.ErrNotFound
		}
		return containerState{}, err
	}
	var st containerState
	if err := json.Unmarshal(out, &st); err != nil {
		return containerState{}, fmt.Errorf("runsc state %s: parse output: %w", id, err)
	}
	return st, nil
}

// list reports every container under the runtime's root dir.
func (r *Runtime) list(ctx context.Context) ([]containerState, error) {
	out, err := r.runsc(ctx, "list", "-format=json")
	if err != nil {
		return nil, err
	}
	var all []containerState
	if s := bytes.TrimSpace(out); len(s) > 0 && !bytes.Equal(s, []byte("null")) {
		if err := json.Unmarshal(s, &all); err != nil {
			return nil, fmt.Errorf("runsc list: parse output: %w", err)
		}
	}
	return all, nil
}

// observed is the instance's status from runsc's state, corrected for a sandbox process
// that has exited but is not reaped yet: runsc tests it with kill(pid, 0), which
// succeeds on a zombie, and the process that reaps it (whoever inherited it when
// `runsc run -detach` exited: init or a subreaper) may take its time.
func observed(st containerState) runtime.Status {
	s := status(st.Status)
	if s != runtime.StatusStopped && st.PID > 0 {
		if p, err := instances.ReadProc(st.PID); err != nil || !p.Live() {
			return runtime.StatusStopped
		}
	}
	return s
}

// status maps an OCI status string to a runtime.Status.
func status(oci string) runtime.Status {
	switch oci {
	case "running":
		return runtime.StatusRunning
	case "paused":
		return runtime.StatusPaused
	default: // "creating", "created", "stopped"
		return runtime.StatusStopped
	}
}
