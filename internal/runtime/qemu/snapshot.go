package qemu

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/spacedev/space/internal/runtime"
	"github.com/spacedev/space/internal/runtime/instances"
)

// maxBandwidth lifts QEMU's default migration bandwidth limit: a checkpoint goes to a
// local file with the VM stopped, as fast as possible.
const maxBandwidth = 1 << 40

// Pause stops the VM's CPUs (QMP stop); it stays resident.
func (r *Runtime) Pause(ctx context.Context, id string) error {
	if err := r.qmpCommand(ctx, id, "stop"); err != nil {
		return fmt.Errorf("qemu pause %s: %w", id, err)
	}
	return nil
}

// Resume continues a paused VM (QMP cont).
func (r *Runtime) Resume(ctx context.Context, id string) error {
	if err := r.qmpCommand(ctx, id, "cont"); err != nil {
		return fmt.Errorf("qemu resume %s: %w", id, err)
	}
	return nil
}

func (r *Runtime) qmpCommand(ctx context.Context, id, cmd string) error {
	if !validID(id) {
		return fmt.Errorf("invalid id %q", id)
	}
	unlock, err := r.lock(ctx, id)
	if err != nil {
		return err
	}
	defer unlock()
	rec, err := r.runningInstance(id)
	if err != nil {
		return err
	}
	return r.withQMP(ctx, rec.StateDir, func(q *qmp) error { return q.exec(ctx, cmd, nil, nil) })
}

// runningInstance returns the record of an instance whose QEMU runs.
func (r *Runtime) runningInstance(id string) (record, error) {
	rec, err := r.findInstance(id)
	if err != nil {
		return rec, err
	}
	pid := r.instancePID(id, &rec)
	if pid == 0 {
		return rec, errors.New("instance is stopped")
	}
	rec.PID = pid
	return rec, nil
}

// Checkpoint stops the VM, writes its RAM and device state into dir/memory (a QEMU
// migration stream, written straight into a descriptor passed over QMP) and the machine
// configuration into dir/vm.json, and ends QEMU. The disk is flushed before QEMU exits;
// the node snapshots it afterwards. The files are not fsynced here: the node does that
// once, and only for a checkpoint that must outlive the host's boot (a suspend's, after
// it is reported; runtime.Snapshotter), so a clone's or a wake-bound suspend's
// checkpoint never waits for the disk. On failure the files are removed and a VM that
// was running runs again.
func (r *Runtime) Checkpoint(ctx context.Context, id, dir string) (err error) {
	if !validID(id) {
		return fmt.Errorf("qemu checkpoint: invalid id %q", id)
	}
	unlock, err := r.lock(ctx, id)
	if err != nil {
		return fmt.Errorf("qemu checkpoint %s: %w", id, err)
	}
	defer unlock()
	rec, err := r.runningInstance(id)
	if err != nil {
		return fmt.Errorf("qemu checkpoint %s: %w", id, err)
	}
	// The host's connection does not survive; the agent reconnects after a restore.
	r.dropSession(id, nil)
	start := time.Now()
	q, err := dialQMP(ctx, filepath.Join(rec.StateDir, qmpSocket))
	if err != nil {
		return fmt.Errorf("qemu checkpoint %s: %w", id, err)
	}
	defer q.Close()
	state, err := q.runState(ctx)
	if err != nil {
		return fmt.Errorf("qemu checkpoint %s: %w", id, err)
	}
	memPath := filepath.Join(dir, memoryFile)
	defer func() {
		if err == nil {
			return
		}
		os.Remove(memPath)
		os.Remove(filepath.Join(dir, machineFile))
		if state == "running" {
			cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			defer cancel()
			if cerr := q.exec(cctx, "cont", nil, nil); cerr != nil {
				r.log.ErrorContext(cctx, "resume after failed checkpoint", "id", id, "err", cerr)
			}
		}
	}()
	if state == "running" {
		if err := q.exec(ctx, "stop", nil, nil); err != nil {
			return fmt.Errorf("qemu checkpoint %s: %w", id, err)
		}
	}
	stopped := time.Since(start)
	if err := q.exec(ctx, "migrate-set-parameters", map[string]any{"max-bandwidth": maxBandwidth}, nil); err != nil {
		return fmt.Errorf("qemu checkpoint %s: %w", id, err)
	}
	mem, err := os.OpenFile(memPath, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return fmt.Errorf("qemu checkpoint %s: %w", id, err)
	}
	err = q.execFD(ctx, "getfd", map[string]any{"fdname": memoryFile}, nil, int(mem.Fd()))
	mem.Close()
	if err != nil {
		return fmt.Errorf("qemu checkpoint %s: %w", id, err)
	}
	if err := q.exec(ctx, "migrate", map[string]any{"uri": "fd:" + memoryFile}, nil); err != nil {
		return fmt.Errorf("qemu checkpoint %s: %w", id, err)
	}
	if err := q.waitMigration(ctx); err != nil {
		return fmt.Errorf("qemu checkpoint %s: %w", id, err)
	}
	migrated := time.Since(start)
	if err := writeMachine(dir, rec.Machine); err != nil {
		return fmt.Errorf("qemu checkpoint %s: %w", id, err)
	}
	// From here on the checkpoint is complete: the VM is not resumed on failure.
	state = ""
	_ = q.exec(ctx, "quit", nil, nil) // QEMU may close the connection before answering
	if pi, perr := instances.ReadProc(rec.PID); perr == nil {
		if err := waitGone(ctx, rec.PID, pi.StartTime, quitTimeout); err != nil {
			return fmt.Errorf("qemu checkpoint %s: %w", id, err)
		}
	}
	var size int64
	if fi, err := os.Stat(memPath); err == nil {
		size = fi.Size()
	}
	r.log.InfoContext(ctx, "vm checkpointed", "id", id, "stop", stopped, "migrate", migrated,
		"duration", time.Since(start), "memory_bytes", size)
	return nil
}

// Restore starts a VM from the checkpoint in dir: QEMU with the checkpoint's machine
// configuration, waiting for an incoming migration (-incoming defer -S), loads dir/memory
// through a descriptor, then continues. spec.RootFS may be any copy of the checkpointed
// disk (QEMU finds it at the same /proc/self/fd path), spec.ID any id; spec's CPU and
// memory, if set, must match the checkpoint's. The agent reconnects on the next Dial;
// the node then gives it its new identity. On error everything it created is removed.
func (r *Runtime) Restore(ctx context.Context, spec runtime.Spec, dir string) error {
	m, err := readMachine(dir)
	if err != nil {
		return fmt.Errorf("qemu restore %s: %w", spec.ID, err)
	}
	if spec.CPU == 0 {
		spec.CPU = m.CPU
	}
	if spec.MemoryMB == 0 {
		spec.MemoryMB = m.MemoryMB
	}
	spec, err = r.checkSpec(spec)
	if err != nil {
		return fmt.Errorf("qemu restore: %w", err)
	}
	if spec.CPU != m.CPU || spec.MemoryMB != m.MemoryMB {
		return fmt.Errorf("qemu restore %s: checkpoint has %d cpu and %d MiB, spec asks %d and %d",
			spec.ID, m.CPU, m.MemoryMB, spec.CPU, spec.MemoryMB)
	}
	if m.QEMU != r.version {
		return fmt.Errorf("qemu restore %s: checkpoint made by QEMU %s, this is %s", spec.ID, m.QEMU, r.version)
	}
	if m.Network != (spec.NetNS != "") {
		return fmt.Errorf("qemu restore %s: the checkpoint's machine has network %v, the sandbox %s: %w", spec.ID, m.Network,
			map[bool]string{true: "has a network namespace", false: "has none"}[spec.NetNS != ""], runtime.ErrUnsupported)
	}
	if m.Accel != r.accel {
		return fmt.Errorf("qemu restore %s: checkpoint made under %s, this host uses %s", spec.ID, m.Accel, r.accel)
	}
	if _, err := os.Stat(m.Initrd); err != nil {
		// The initramfs cache is on tmpfs: rebuild it. Its content is not part of the
		// migration stream (the guest booted from it long ago); QEMU only needs a file.
		if m.Initrd, err = r.initrds.Build(ctx, spec.AgentPath); err != nil {
			return fmt.Errorf("qemu restore %s: %w", spec.ID, err)
		}
	}
	if _, err := os.Stat(m.Kernel); err != nil {
		// An extracted kernel removed since (a kernel upgrade, a cleared cache): as with
		// the initramfs, the guest's kernel is in the migration stream; QEMU only loads a
		// file it will not copy into a VM that arrives by migration.
		m.Kernel = r.boot
	}
	if err := ensureWorldReadable(m.Initrd); err != nil {
		return fmt.Errorf("qemu restore %s: %w", spec.ID, err)
	}
	unlock, err := r.lock(ctx, spec.ID)
	if err != nil {
		return fmt.Errorf("qemu restore %s: %w", spec.ID, err)
	}
	defer unlock()
	m.Host = r.host
	if err := r.launch(ctx, spec, m, dir); err != nil {
		return fmt.Errorf("qemu restore %s: %w", spec.ID, err)
	}
	return nil
}

// load feeds the checkpoint's memory file to a QEMU waiting for it and continues the VM.
func (r *Runtime) load(ctx context.Context, spec runtime.Spec, dir string) error {
	mem, err := os.Open(filepath.Join(dir, memoryFile))
	if err != nil {
		return err
	}
	defer mem.Close()
	return r.withQMP(ctx, spec.StateDir, func(q *qmp) error {
		if err := q.execFD(ctx, "getfd", map[string]any{"fdname": memoryFile}, nil, int(mem.Fd())); err != nil {
			return err
		}
		if err := q.exec(ctx, "migrate-incoming", map[string]any{"uri": "fd:" + memoryFile}, nil); err != nil {
			return err
		}
		t := time.NewTicker(migratePoll)
		defer t.Stop()
		for {
			state, err := q.runState(ctx)
			if err != nil {
				return fmt.Errorf("load checkpoint: %w", err) // QEMU exits when loading fails
			}
			if state != "inmigrate" {
				break
			}
			select {
			case <-ctx.Done():
				return fmt.Errorf("load checkpoint: %w", ctx.Err())
			case <-t.C:
			}
		}
		if st, desc, err := q.migrationStatus(ctx); err != nil {
			return err
		} else if st != "completed" {
			return fmt.Errorf("load checkpoint: migration %s: %s", st, desc)
		}
		return q.exec(ctx, "cont", nil, nil)
	})
}
