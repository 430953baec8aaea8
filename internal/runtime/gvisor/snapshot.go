package gvisor

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/runtime"
	"github.com/spacedev/space/internal/runtime/instances"
)

var (
	_ runtime.Snapshotter      = (*Runtime)(nil)
	_ runtime.LiveCheckpointer = (*Runtime)(nil)
)

// Pause freezes the sandbox (runsc pause).
func (r *Runtime) Pause(ctx context.Context, id string) error {
	if !validID(id) {
		return fmt.Errorf("gvisor pause: invalid id %q", id)
	}
	before, known, _ := r.statuses.lookup(id)
	if _, err := r.runsc(ctx, "pause", id); err != nil {
		return fmt.Errorf("gvisor pause %s: %w", id, err)
	}
	if known {
		r.statuses.moved(id, before, "paused")
	}
	return nil
}

// Resume continues a paused sandbox (runsc resume). A running one is left as it is (a
// warm-pool member parked running, runtime.Caps.ParkRunning): known running from the
// status cache, no runsc process is started for it.
func (r *Runtime) Resume(ctx context.Context, id string) error {
	if !validID(id) {
		return fmt.Errorf("gvisor resume: invalid id %q", id)
	}
	before, known, _ := r.statuses.lookup(id)
	if known && before.st.Status == "running" {
		return nil
	}
	if _, err := r.runsc(ctx, "resume", id); err != nil {
		// runsc refuses to resume a container that runs: then there is nothing to do.
		if st, serr := r.state(ctx, id); serr == nil && observed(st) == runtime.StatusRunning {
			return nil
		}
		return fmt.Errorf("gvisor resume %s: %w", id, err)
	}
	if known {
		r.statuses.moved(id, before, "running")
	}
	return nil
}

// Checkpoint saves the sandbox's memory and kernel state into dir (runsc checkpoint)
// and returns once the sandbox has stopped. The node makes the files durable (it
// fsyncs them when it needs them to outlive the host's boot). The agent must have
// quiesced first: runsc cannot save a sandbox that holds a bound host socket.
//
// It checkpoints with -leave-running and stops the sandbox itself once the image is
// written: without it, runsc stops the sandbox whatever the outcome, and a checkpoint
// that failed (a socket gVisor cannot save, an error writing the image) took the
// sandbox's memory with it. A failed one now leaves the sandbox as it was, and the
// node has it run on (afterFailedCheckpoint).
func (r *Runtime) Checkpoint(ctx context.Context, id, dir string) error {
	// The sandbox process, to stop it and watch it exit in /proc rather than through
	// runsc state.
	before, _, err := r.sandboxProcess(ctx, id)
	if err != nil {
		return fmt.Errorf("gvisor checkpoint %s: %w", id, err)
	}
	if err := r.checkpoint(ctx, id, dir, true); err != nil {
		return fmt.Errorf("gvisor checkpoint %s: %w", id, err)
	}
	// Saved; the sandbox runs on, its user code frozen and its agent waiting for a
	// resume that does not come. A SIGKILL to its process stops it as runsc's own
	// stop after a checkpoint does (Destroy removes what is left), without a runsc.
	if err := r.killSandboxProcess(ctx, id, before); err != nil {
		return fmt.Errorf("gvisor checkpoint %s: stop the saved sandbox: %w", id, err)
	}
	r.statuses.stopped(id)
	return nil
}

// sandboxProcess returns the instance's state and its sandbox process's start time:
// from the status cache when it holds them (known), else from runsc and /proc.
func (r *Runtime) sandboxProcess(ctx context.Context, id string) (cachedState, bool, error) {
	c, known, _ := r.statuses.lookup(id)
	if known {
		return c, true, nil
	}
	st, err := r.state(ctx, id)
	if err != nil {
		return cachedState{}, false, err
	}
	c.st = st
	if p, err := instances.ReadProc(st.PID); err == nil && p.Live() {
		c.start = p.StartTime
	}
	return c, false, nil
}

// killSandboxProcess ends the sandbox process seen as before (if it is still that
// process) and waits for it to exit; without one it asks runsc.
func (r *Runtime) killSandboxProcess(ctx context.Context, id string, before cachedState) error {
	pid := before.st.PID
	if p, err := instances.ReadProc(pid); pid > 0 && before.start != 0 && err == nil && p.Live() && p.StartTime == before.start {
		if err := unix.Kill(pid, unix.SIGKILL); err != nil && !errors.Is(err, unix.ESRCH) {
			return err
		}
		return r.waitExited(ctx, pid)
	}
	if _, err := r.runsc(ctx, "kill", id, "KILL"); err != nil {
		return err
	}
	return r.waitStopped(ctx, id)
}

// CheckpointPaused saves a paused sandbox's memory and kernel state into dir and
// leaves it paused (runsc checkpoint -leave-running: the Sentry's own pause nests in
// runsc pause's, so the sandbox runs again only at Resume). A clone source or a named
// snapshot's source thus needs no restore of its own.
func (r *Runtime) CheckpointPaused(ctx context.Context, id, dir string) error {
	before, known, err := r.sandboxProcess(ctx, id)
	if err != nil {
		return fmt.Errorf("gvisor checkpoint %s: %w", id, err)
	}
	if observed(before.st) != runtime.StatusPaused {
		return fmt.Errorf("gvisor checkpoint %s: the sandbox is %s, not paused", id, before.st.Status)
	}
	if err := r.checkpoint(ctx, id, dir, true); err != nil {
		return fmt.Errorf("gvisor checkpoint %s: %w", id, err)
	}
	if known {
		// -leave-running: still paused, the same sandbox process.
		r.statuses.moved(id, before, "paused")
	}
	return nil
}

// checkpointCompression is the pinned setting: uncompressed memory in its own pages
// file, which Restore can load in the background. runsc's default is the same today;
// naming it keeps a future default from changing what space writes.
const checkpointCompression = "none"

func (r *Runtime) checkpoint(ctx context.Context, id, dir string, leaveRunning bool) error {
	if !validID(id) {
		return fmt.Errorf("invalid id %q", id)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	meta := checkpointMeta{Cgroup: id, Compression: checkpointCompression}
	rec, err := r.readRecord(id)
	if err != nil {
		// Without it the restore could not name the mounts as this instance has them.
		return fmt.Errorf("record: %w", err)
	}
	if rec.Cgroup != "" {
		meta.Cgroup, meta.PidsMax = rec.Cgroup, rec.PidsMax
	}
	meta.layout = rec.layout
	if meta.AgentPath == "" {
		meta.AgentPath = bundleAgentPath(rec.StateDir) // a record from before it was kept
	}
	if err := writeMeta(dir, meta); err != nil {
		return err
	}
	args := []string{"checkpoint", "-image-path", dir, "-compression", checkpointCompression}
	if leaveRunning {
		args = append(args, "-leave-running")
	}
	if _, err := r.runsc(ctx, append(args, id)...); err != nil {
		return err
	}
	return nil
}

// metaFile is the runtime's own file in a checkpoint directory, beside runsc's.
const metaFile = "space-gvisor.json"

// checkpointMeta is what Restore needs to know about a checkpoint besides runsc's image.
type checkpointMeta struct {
	// Cgroup is the name of the container's cgroup inside the checkpointed Sentry.
	Cgroup string `json:"cgroup"`
	// Compression is the runsc -compression the image was written with; empty in
	// checkpoints written before it was recorded (runsc's default then: none). Restore
	// loads memory in the background only from an uncompressed image with its pages file.
	Compression string `json:"compression,omitempty"`
	// PidsMax is the pids limit the runtime had set on Cgroup (0: unknown, or none).
	PidsMax int64 `json:"pids_max,omitempty"`
	// layout is the checkpointed instance's: runsc refuses a restore whose bundle names
	// the mounts otherwise, the restored file systems keep their size, and the restored
	// agent its transport.
	layout
}

func writeMeta(dir string, m checkpointMeta) error {
	data, err := json.Marshal(m)
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, metaFile), data, 0o600); err != nil {
		return fmt.Errorf("write checkpoint metadata: %w", err)
	}
	return nil
}

func readMeta(dir string) (checkpointMeta, error) {
	var m checkpointMeta
	data, err := os.ReadFile(filepath.Join(dir, metaFile))
	if err != nil {
		return m, fmt.Errorf("read checkpoint metadata: %w", err)
	}
	if err := json.Unmarshal(data, &m); err != nil {
		return m, fmt.Errorf("read checkpoint metadata: %w", err)
	}
	if !validID(m.Cgroup) {
		return m, fmt.Errorf("checkpoint metadata: invalid cgroup %q", m.Cgroup)
	}
	return m, nil
}

// waitExited polls /proc until the sandbox process pid has exited (or is a zombie,
// which runsc counts as stopped too: observed), bounded by the command timeout. Each
// look is a read of /proc/PID/stat; runsc state is a process of its own (10–25 ms).
// A pid reused meanwhile would read as another start time: the original is gone then.
func (r *Runtime) waitExited(ctx context.Context, pid int) error {
	first, err := instances.ReadProc(pid)
	if err != nil || !first.Live() {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, r.cfg.CommandTimeout)
	defer cancel()
	for wait := time.Millisecond; ; wait = min(2*wait, 10*time.Millisecond) {
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for the sandbox process %d to exit: %w", pid, ctx.Err())
		case <-time.After(wait):
		}
		p, err := instances.ReadProc(pid)
		if err != nil || !p.Live() || p.StartTime != first.StartTime {
			return nil
		}
	}
}

// waitStopped polls runsc until the container is no longer running, bounded by the
// command timeout.
func (r *Runtime) waitStopped(ctx context.Context, id string) error {
	ctx, cancel := context.WithTimeout(ctx, r.cfg.CommandTimeout)
	defer cancel()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		st, err := r.state(ctx, id)
		if errors.Is(err, runtime.ErrNotFound) || (err == nil && observed(st) == runtime.StatusStopped) {
			return nil
		}
		if err != nil {
			return err
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for the sandbox to stop: still %s: %w", st.Status, ctx.Err())
		case <-tick.C:
		}
	}
}

// chooseAgent returns the agent binary a restore of a checkpoint taken with the agent
// at checkpointed mounts on a node whose own agent is own: the file of the same
// content-addressed name among own's (node.installAgent keeps every agent it ran, or
// pulled with a checkpoint, under <data-dir>/agents/<hash>/), else the checkpointed
// file itself where it still is (a checkpoint from before agents were kept so), else
// own. This node's copy comes first: a checkpoint pulled from another node names a
// file in that node's data dir, which is not this node's to rely on even when the two
// share a host. It reports whether it found the checkpointed binary. A restored agent given
// another binary dies when it touches a code page it has not loaded yet (its text is
// mapped from the file), and the restore falls back to a boot from its disk, losing its
// memory: measured, every restore of a sandbox started by a space build other than the
// restoring one's did (2026-12-07).
func chooseAgent(own, checkpointed string) (string, bool) {
	if checkpointed == "" || checkpointed == own {
		return own, checkpointed != "" // the node's own, or unknown (a checkpoint from before it was recorded)
	}
	candidates := []string{filepath.Join(filepath.Dir(filepath.Dir(own)),
		filepath.Base(filepath.Dir(checkpointed)), filepath.Base(checkpointed)), checkpointed}
	for _, p := range candidates {
		if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() {
			return p, true
		}
	}
	return own, false
}

// restoreAgent is chooseAgent for a restore of spec, saying what it chose.
func (r *Runtime) restoreAgent(spec runtime.Spec, checkpointed string) string {
	p, found := chooseAgent(spec.AgentPath, checkpointed)
	switch {
	case !found && checkpointed != "":
		r.log.Warn("the agent the checkpoint was taken with is gone; restoring with this node's", "id", spec.ID, "checkpointed", checkpointed)
	case p != spec.AgentPath:
		r.log.Info("restoring with the agent the checkpoint was taken with", "id", spec.ID, "agent", p)
	}
	return p
}

var _ runtime.AgentMapper = (*Runtime)(nil)

// RestoreAgent implements runtime.AgentMapper: the binary Restore would mount for the
// checkpoint in dir on a node whose own agent is own.
func (r *Runtime) RestoreAgent(dir, own string) (string, error) {
	meta, err := readMeta(dir)
	if err != nil {
		return "", err
	}
	p, _ := chooseAgent(own, meta.AgentPath)
	return p, nil
}

// InstanceAgents implements runtime.AgentMapper: the agent binary of every instance this
// runtime has a record of (its bundle's, for a record from before records kept it).
func (r *Runtime) InstanceAgents() ([]string, error) {
	ids, err := r.recordIDs()
	if err != nil {
		return nil, err
	}
	var out []string
	for _, id := range ids {
		rec, err := r.readRecord(id)
		if errors.Is(err, fs.ErrNotExist) {
			continue // removed since it was listed
		}
		if err != nil {
			return nil, err
		}
		p := rec.AgentPath
		if p == "" {
			p = bundleAgentPath(rec.StateDir)
		}
		if p != "" {
			out = append(out, p)
		}
	}
	return out, nil
}

// Restore starts an instance from a checkpoint in dir with spec's root filesystem
// (which may be a copy of the original's: a clone). The bundle is the same as Create's,
// so paths inside the sandbox match the checkpointed ones.
func (r *Runtime) Restore(ctx context.Context, spec runtime.Spec, dir string) (err error) {
	if err := validateSpec(spec); err != nil {
		return fmt.Errorf("gvisor restore: %w", err)
	}
	meta, err := readMeta(dir)
	if err != nil {
		return fmt.Errorf("gvisor restore %s: %w", spec.ID, err)
	}
	spec.AgentPath = r.restoreAgent(spec, meta.AgentPath)
	meta.AgentPath = spec.AgentPath
	if err := r.claimRecord(record{ID: spec.ID, StateDir: spec.StateDir, Cgroup: meta.Cgroup, PidsMax: r.pidsMax(spec), layout: meta.layout}); err != nil {
		return fmt.Errorf("gvisor restore %s: %w", spec.ID, err)
	}
	var mountPoints []string
	defer func() {
		if err == nil {
			return
		}
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
		defer cancel()
		if uerr := r.destroy(cctx, spec.ID, spec.StateDir); uerr != nil {
			err = errors.Join(err, fmt.Errorf("undo: %w", uerr))
		}
		removeMountPoints(spec.RootFS, mountPoints)
	}()
	// The pids limit is part of the checkpointed kernel state, but this instance's Spec
	// may name another one (a base snapshot restored for a new sandbox, a clone of
	// another size): start sets it then. A wake, whose checkpoint holds the limit the
	// runtime set, skips that runsc write-control (a process, 12–35 ms of every wake).
	// What the sandbox did to its own cgroup meanwhile it could do again after the
	// write; the host's pids cgroup bounds it either way (bundle.go).
	pidsSet := meta.PidsMax != 0 && meta.PidsMax == r.pidsMax(spec)
	// Not -background (return before the memory has loaded): wakes measured no faster
	// with it, since runsc's parallel page reads starve the kernel state's load, which
	// then ends with them anyway (docs/runtimes.md, "Snapshots").
	args := []string{"restore", "-image-path", dir, "-detach", "-bundle", spec.StateDir}
	if mountPoints, err = r.start(ctx, spec, meta.Cgroup, meta.layout, pidsSet, append(args, spec.ID)...); err != nil {
		return fmt.Errorf("gvisor restore %s: %w", spec.ID, err)
	}
	return nil
}
