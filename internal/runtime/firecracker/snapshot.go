package firecracker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/runtime"
)

// Files in a checkpoint directory.
const (
	cpVMState = "vmstate"          // Firecracker's microVM state file
	cpMemory  = "memory"           // guest memory (Full snapshot, File backend on load)
	cpMeta    = "firecracker.json" // checkpointMeta
)

// checkpointFormat versions checkpointMeta.
const checkpointFormat = 1

// checkpointMeta is what Restore needs besides Firecracker's files: the release that
// wrote them and the host resource names the snapshot baked in.
type checkpointMeta struct {
	Format             int       `json:"format"`
	FirecrackerVersion string    `json:"firecracker_version"`
	Machine            machine   `json:"machine"`
	Disk               string    `json:"disk"`           // in-jail name of the root drive
	VsockSocket        string    `json:"vsock_uds_path"` // in-jail name of the vsock socket
	Interfaces         []netName `json:"network_interfaces,omitempty"`
	CreatedAt          time.Time `json:"created_at"`
}

// netName is a network interface and the TAP device it was attached to.
type netName struct {
	IfaceID     string `json:"iface_id"`
	HostDevName string `json:"host_dev_name"`
}

// checkpoint is a checkpoint directory being restored.
type checkpoint struct {
	dir  string
	meta checkpointMeta
}

// Pause freezes the VM's vCPUs (PATCH /vm Paused); it stays resident.
func (r *Runtime) Pause(ctx context.Context, id string) error {
	if err := r.setState(ctx, id, statePaused); err != nil {
		return fmt.Errorf("firecracker pause %s: %w", id, err)
	}
	return nil
}

// Resume continues a paused VM (PATCH /vm Resumed).
func (r *Runtime) Resume(ctx context.Context, id string) error {
	if err := r.setState(ctx, id, "Resumed"); err != nil {
		return fmt.Errorf("firecracker resume %s: %w", id, err)
	}
	return nil
}

func (r *Runtime) setState(ctx context.Context, id, state string) error {
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
	actx, cancel := context.WithTimeout(ctx, apiTimeout)
	defer cancel()
	return newAPIClient(filepath.Join(rec.chroot(), apiSocket)).setVMState(actx, state)
}

// runningInstance returns the record of an instance whose firecracker runs.
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

// Checkpoint pauses the VM (if it runs), has Firecracker write a Full snapshot into the
// jail, ends firecracker and moves the state and memory files into dir with the metadata
// Restore needs. Firecracker flushes the drive to the host page cache first; the node
// snapshots the disk afterwards. Nothing is fsynced here: the node does that once, and
// only for a checkpoint that must outlive the host's boot (a suspend's, after it is
// reported; runtime.Snapshotter). On failure dir is left without the files and a VM
// that was running runs again.
func (r *Runtime) Checkpoint(ctx context.Context, id, dir string) (err error) {
	if !validID(id) {
		return fmt.Errorf("firecracker checkpoint: invalid id %q", id)
	}
	unlock, err := r.lock(ctx, id)
	if err != nil {
		return fmt.Errorf("firecracker checkpoint %s: %w", id, err)
	}
	defer unlock()
	if err := r.checkpoint(ctx, id, dir); err != nil {
		return fmt.Errorf("firecracker checkpoint %s: %w", id, err)
	}
	return nil
}

func (r *Runtime) checkpoint(ctx context.Context, id, dir string) (err error) {
	rec, err := r.runningInstance(id)
	if err != nil {
		return err
	}
	start := time.Now()
	chroot := rec.chroot()
	api := newAPIClient(filepath.Join(chroot, apiSocket))
	info, err := api.instance(ctx)
	if err != nil {
		return err
	}
	v, err := parseVersion(info.VMMVersion)
	if err != nil {
		return err
	}
	killed := false
	defer func() {
		if err == nil {
			return
		}
		for _, name := range []string{cpVMState, cpMemory, cpMeta} {
			os.Remove(filepath.Join(dir, name))
		}
		for _, name := range []string{vmstateName, memoryName} {
			os.Remove(filepath.Join(chroot, name))
		}
		if info.State == stateRunning && !killed {
			cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), apiTimeout)
			defer cancel()
			if rerr := api.setVMState(cctx, "Resumed"); rerr != nil {
				r.log.ErrorContext(cctx, "resume after failed checkpoint", "id", id, "err", rerr)
			}
		}
	}()
	if info.State == stateRunning {
		if err := api.setVMState(ctx, statePaused); err != nil {
			return err
		}
	}
	paused := time.Since(start)
	if err := api.put(ctx, "/snapshot/create", snapshotCreate{SnapshotType: "Full", SnapshotPath: vmstateName, MemFilePath: memoryName}); err != nil {
		return err
	}
	written := time.Since(start)
	// The snapshot holds everything; the process only holds resources now.
	kctx, cancel := context.WithTimeout(ctx, killTimeout)
	err = kill(kctx, rec.PID, rec.StartTime)
	cancel()
	if err != nil {
		return err
	}
	killed = true
	for _, f := range []struct{ from, to string }{{vmstateName, cpVMState}, {memoryName, cpMemory}} {
		if err := moveFile(filepath.Join(chroot, f.from), filepath.Join(dir, f.to)); err != nil {
			return fmt.Errorf("save %s: %w", f.to, err)
		}
	}
	meta := checkpointMeta{
		Format: checkpointFormat, FirecrackerVersion: v.String(), Machine: rec.Machine,
		Disk: diskName, VsockSocket: vsockSocket, CreatedAt: time.Now().UTC(),
	}
	if rec.Machine.Network {
		meta.Interfaces = []netName{{IfaceID: "eth0", HostDevName: TapName}}
	}
	data, err := json.MarshalIndent(meta, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, cpMeta), append(data, '\n'), 0o600); err != nil {
		return err
	}
	r.log.InfoContext(ctx, "vm checkpointed", "id", id, "pause", paused, "snapshot", written-paused, "duration", time.Since(start))
	return nil
}

// Restore starts a VM from the checkpoint in dir with spec's disk (a copy of the
// checkpointed one) in a new jail. The machine (vCPUs, memory, kernel command line)
// comes from the checkpoint. It refuses checkpoints of another Firecracker release line,
// and ones whose baked-in names this Firecracker cannot re-point. On error everything it
// created is removed.
func (r *Runtime) Restore(ctx context.Context, spec runtime.Spec, dir string) error {
	meta, err := readCheckpointMeta(dir)
	if err != nil {
		return fmt.Errorf("firecracker restore: %w", err)
	}
	spec.CPU, spec.MemoryMB, spec.Network = meta.Machine.CPU, meta.Machine.MemoryMB, meta.Machine.Network
	spec, err = r.checkSpec(spec)
	if err != nil {
		return fmt.Errorf("firecracker restore: %w", err)
	}
	// Fail before starting anything when the binary already tells it will not work; the
	// running process's GET /version is checked again in load.
	if err := checkRestorable(meta, r.version); err != nil {
		return fmt.Errorf("firecracker restore %s: %w", spec.ID, err)
	}
	unlock, err := r.lock(ctx, spec.ID)
	if err != nil {
		return fmt.Errorf("firecracker restore %s: %w", spec.ID, err)
	}
	defer unlock()
	if err := r.launch(ctx, spec, meta.Machine, "", &checkpoint{dir: dir, meta: meta}); err != nil {
		return fmt.Errorf("firecracker restore %s: %w", spec.ID, err)
	}
	return nil
}

func readCheckpointMeta(dir string) (checkpointMeta, error) {
	var m checkpointMeta
	data, err := os.ReadFile(filepath.Join(dir, cpMeta))
	if err != nil {
		return m, fmt.Errorf("not a firecracker checkpoint: %w", err)
	}
	if err := json.Unmarshal(data, &m); err != nil {
		return m, fmt.Errorf("%s: %w", filepath.Join(dir, cpMeta), err)
	}
	if m.Format != checkpointFormat {
		return m, fmt.Errorf("%s: format %d, this runtime reads %d", filepath.Join(dir, cpMeta), m.Format, checkpointFormat)
	}
	if m.Machine.CPU <= 0 || m.Machine.MemoryMB <= 0 || m.Disk == "" || m.VsockSocket == "" {
		return m, fmt.Errorf("%s: incomplete", filepath.Join(dir, cpMeta))
	}
	return m, nil
}

// checkRestorable tells whether Firecracker v can load the checkpoint meta describes.
func checkRestorable(meta checkpointMeta, v version) error {
	made, err := parseVersion(meta.FirecrackerVersion)
	if err != nil {
		return err
	}
	if !made.sameLine(v) {
		return fmt.Errorf("checkpoint was written by Firecracker %s and this host runs %s: snapshots load only in the release line that wrote them (re-create the snapshot)", made, v)
	}
	if meta.Disk != diskName {
		// Drives have no override: the jail must have the file under the baked-in name.
		return fmt.Errorf("checkpoint's root drive is %q, this runtime provides %q", meta.Disk, diskName)
	}
	if meta.VsockSocket != vsockSocket && !v.atLeast(1, 16) {
		return fmt.Errorf("checkpoint's vsock socket is %q, not %q: re-pointing it needs vsock_override (Firecracker 1.16 or later; this host runs %s)", meta.VsockSocket, vsockSocket, v)
	}
	for _, n := range meta.Interfaces {
		if n.HostDevName != TapName && !v.atLeast(1, 12) {
			return fmt.Errorf("checkpoint's interface %s is attached to %q, not %q: re-pointing it needs network_overrides (Firecracker 1.12 or later; this host runs %s)", n.IfaceID, n.HostDevName, TapName, v)
		}
	}
	return nil
}

// load loads the checkpoint into the fresh firecracker and resumes it. Where the running
// Firecracker has the overrides, the names are given explicitly (vsock_override ≥ 1.16,
// network_overrides ≥ 1.12); older ones get only what they know, and checkRestorable
// has made sure the baked-in names are the jail's.
func (r *Runtime) load(ctx context.Context, api *apiClient, v version, meta checkpointMeta, spec runtime.Spec) error {
	if err := checkRestorable(meta, v); err != nil {
		return err
	}
	if len(meta.Interfaces) > 0 && spec.NetNS == "" {
		return fmt.Errorf("checkpoint has a network interface: %w", runtime.ErrUnsupported)
	}
	body := snapshotLoad{
		SnapshotPath: vmstateName,
		MemBackend:   &memBackend{BackendType: "File", BackendPath: memoryName},
		ResumeVM:     ptr(true),
	}
	if v.atLeast(1, 16) {
		body.VsockOverride = &vsockOverride{UDSPath: vsockSocket}
	}
	if v.atLeast(1, 12) {
		for _, n := range meta.Interfaces {
			body.NetworkOverrides = append(body.NetworkOverrides, networkOverride{IfaceID: n.IfaceID, HostDevName: TapName})
		}
	}
	return api.put(ctx, "/snapshot/load", body)
}

// placeCheckpoint puts the checkpoint's state and memory files into the jail, under the
// names load gives Firecracker. The memory file is mapped privately by the VM for its
// whole life (pages are read on demand), so it must stay unchanged: a hard link shares
// it between every VM restored from one checkpoint, and the checkpoint directory may go
// away meanwhile.
func (r *Runtime) placeCheckpoint(rec record, dir string) error {
	for _, f := range []struct{ from, to string }{{cpVMState, vmstateName}, {cpMemory, memoryName}} {
		dst := filepath.Join(rec.chroot(), f.to)
		if err := placeFile(filepath.Join(dir, f.from), dst); err != nil {
			return fmt.Errorf("checkpoint into jail: %w", err)
		}
		if r.jailed {
			if err := os.Lchown(dst, r.cfg.UID, r.cfg.GID); err != nil {
				return fmt.Errorf("checkpoint into jail: %w", err)
			}
		}
	}
	return nil
}

// moveFile moves src to dst: a rename, or a copy (reflinked where possible) and removal
// across file systems. Nothing is fsynced (see Checkpoint).
func moveFile(src, dst string) error {
	if err := os.Rename(src, dst); err == nil {
		return nil
	} else if !errors.Is(err, unix.EXDEV) {
		return err
	}
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	if unix.IoctlFileClone(int(out.Fd()), int(in.Fd())) != nil {
		if _, err := io.Copy(out, in); err != nil {
			out.Close()
			os.Remove(dst)
			return err
		}
	}
	if err := out.Close(); err != nil {
		os.Remove(dst)
		return err
	}
	return os.Remove(src)
}
