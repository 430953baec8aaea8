package gvisor

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

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

// Checkpoint saves the sandbox's memory and kernel state into dir (runsc checkpoint);
// the sandbox stops. The agent must have quiesced first: runsc cannot save a sandbox
// that holds a bound host socket, and the failed attempt kills it.
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
	return nil
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
	oci := bundleSpec(spec, bundleOptions{CgroupsPath: r.cgroupsPath(spec.ID), Compat: r.compat})
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
