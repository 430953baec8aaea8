package gvisor

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"github.com/spacedev/space/internal/durable"
	"github.com/spacedev/space/internal/runtime"
)

var _ runtime.Snapshotter = (*Runtime)(nil)

// Pause freezes the sandbox (runsc pause).
func (r *Runtime) Pause(ctx context.Context, id string) error {
	if !validID(id) {
		return fmt.Errorf("gvisor pause: invalid id %q", id)
	}
	if _, err := r.runsc(ctx, "pause", id); err != nil {
		return fmt.Errorf("gvisor pause %s: %w", id, err)
	}
	return nil
}

// Resume continues a paused sandbox (runsc resume).
func (r *Runtime) Resume(ctx context.Context, id string) error {
	if !validID(id) {
		return fmt.Errorf("gvisor resume: invalid id %q", id)
	}
	if _, err := r.runsc(ctx, "resume", id); err != nil {
		return fmt.Errorf("gvisor resume %s: %w", id, err)
	}
	return nil
}

// Checkpoint saves the sandbox's memory and kernel state into dir (runsc checkpoint),
// fsyncs the files, and returns once the sandbox has stopped. The agent must have
// quiesced first: runsc cannot save a sandbox that holds a bound host socket, and the
// failed attempt kills it.
func (r *Runtime) Checkpoint(ctx context.Context, id, dir string) error {
	if !validID(id) {
		return fmt.Errorf("gvisor checkpoint: invalid id %q", id)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("gvisor checkpoint %s: %w", id, err)
	}
	if _, err := r.runsc(ctx, "checkpoint", "-image-path", dir, id); err != nil {
		return fmt.Errorf("gvisor checkpoint %s: %w", id, err)
	}
	if err := syncDir(dir); err != nil {
		return fmt.Errorf("gvisor checkpoint %s: %w", id, err)
	}
	// runsc returns once the image is written; the sandbox exits a moment later.
	if err := r.waitStopped(ctx, id); err != nil {
		return fmt.Errorf("gvisor checkpoint %s: %w", id, err)
	}
	return nil
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
		if errors.Is(err, runtime.ErrNotFound) || (err == nil && status(st.Status) == runtime.StatusStopped) {
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

// syncDir fsyncs the regular files in dir and dir itself.
func syncDir(dir string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, e := range entries {
		if e.Type().IsRegular() {
			if err := durable.Sync(filepath.Join(dir, e.Name())); err != nil {
				return err
			}
		}
	}
	return durable.Sync(dir)
}

// Restore starts an instance from a checkpoint in dir with spec's root filesystem
// (which may be a copy of the original's: a clone). The bundle is the same as Create's,
// so paths inside the sandbox match the checkpointed ones.
func (r *Runtime) Restore(ctx context.Context, spec runtime.Spec, dir string) (err error) {
	if err := validateSpec(spec); err != nil {
		return fmt.Errorf("gvisor restore: %w", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "checkpoint.img")); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("gvisor restore %s: %w", spec.ID, err)
	}
	if err := r.claimRecord(record{ID: spec.ID, StateDir: spec.StateDir}); err != nil {
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
	if err := os.MkdirAll(filepath.Join(spec.StateDir, runDir), 0o700); err != nil {
		return fmt.Errorf("gvisor restore %s: %w", spec.ID, err)
	}
	oci := bundleSpec(spec, bundleOptions{CgroupsPath: r.cgroupsPath(spec.ID)})
	if mountPoints, err = makeMountPoints(spec.RootFS, oci.Mounts); err != nil {
		return fmt.Errorf("gvisor restore %s: %w", spec.ID, err)
	}
	if err := writeBundle(spec.StateDir, oci); err != nil {
		return fmt.Errorf("gvisor restore %s: %w", spec.ID, err)
	}
	if err := r.run(ctx, spec, "restore", "-image-path", dir, "-detach", "-bundle", spec.StateDir, spec.ID); err != nil {
		return fmt.Errorf("gvisor restore %s: %w", spec.ID, err)
	}
	return nil
}
