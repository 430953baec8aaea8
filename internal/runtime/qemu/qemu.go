// Package qemu implements runtime.Runtime and runtime.Snapshotter with QEMU's microvm
// machine: one qemu-system-x86_64 process per sandbox, KVM where the host has hardware
// virtualization, TCG (software emulation) elsewhere.
//
// The guest is Debian's cloud kernel booted with an initramfs built and cached by package
// initramfs (space-agent as /init plus the virtio modules, see package vmboot); the agent
// mounts the sandbox's ext4 disk (Spec.RootFS, a virtio-blk device), switches to it and
// serves the agent protocol as yamux streams over a virtio-serial port whose host end is
// a unix socket in the StateDir (package vmboot's serial transport). The runtime keeps
// one yamux session per instance and opens a stream per Dial; sessions are re-established
// lazily after a node restart or a restore.
//
// Each QEMU runs in its own session (it outlives the node process), mount namespace and
// network namespace (empty: sandboxes have no network yet). Every instance-specific file
// is passed to QEMU as an inherited descriptor and named on its command line as
// /proc/self/fd/N[/NAME], so the command line is identical for all instances of one
// machine shape: a restored or cloned VM finds the same paths whatever its StateDir and
// disk are. QMP (a unix socket in the StateDir) drives pause, resume, checkpoint
// (migration into a file descriptor) and restore (-incoming defer).
//
// The package owns the StateDir files listed in stateFiles, the checkpoint files
// (memory, vm.json), and its root dir: instance records (instances/<id>.json) and the
// initramfs cache (initramfs/).
package qemu

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/runtime"
	"github.com/spacedev/space/internal/runtime/initramfs"
	"github.com/spacedev/space/internal/runtime/instances"
)

// Config configures the QEMU runtime. Zero values take the documented defaults.
type Config struct {
	// QemuPath is the emulator; default qemu-system-x86_64 on PATH.
	QemuPath string
	// KernelPath is the guest kernel; default the newest /boot/vmlinuz-*-cloud-amd64,
	// else the newest /boot/vmlinuz-*.
	KernelPath string
	// ModulesDir holds the kernel's modules (modules.dep); default
	// /lib/modules/<version>, the version taken from the kernel's file name.
	ModulesDir string
	// Accel is "auto" (default: kvm when usable, else tcg), "kvm" or "tcg".
	Accel string
	// RootDir holds the runtime's records and initramfs cache; default /run/space/qemu
	// (tmpfs: VMs do not survive a host reboot and neither should their records).
	RootDir string
	// Logger receives lifecycle records and timings (default: discard).
	Logger *slog.Logger
}

// Defaults.
const (
	DefaultRootDir  = "/run/space/qemu"
	DefaultCPU      = 1
	DefaultMemoryMB = 512
)

// Timeouts of QEMU operations.
const (
	startTimeout   = 15 * time.Second // QEMU process start until QMP answers
	quitTimeout    = 3 * time.Second  // QMP quit until the process is gone, then SIGKILL
	destroyTimeout = 20 * time.Second
	cleanupTimeout = 30 * time.Second // undo of a failed Create or Restore
)

// Runtime runs sandboxes as QEMU microVMs. It is safe for concurrent use. Its state in
// memory is a cache (agent sessions, file hashes): a new Runtime over the same RootDir
// sees every instance of an old one.
type Runtime struct {
	cfg         Config
	log         *slog.Logger
	accel       string
	accelReason string
	version     string // QEMU's version
	rootKey     string // short hash of RootDir, part of every process name
	tscKHz      int64  // the host's TSC frequency, given to TCG guests (0: unknown)

	initrds *initramfs.Cache

	mu    sync.Mutex
	insts map[string]*instance
}

// instance is the in-memory side of one instance: a lock serializing its lifecycle and
// QMP use (QEMU serves one QMP client at a time), and its agent session. It is dropped
// from Runtime.insts when nobody uses it and it has no session.
type instance struct {
	lock chan struct{} // QMP and lifecycle
	conn chan struct{} // agent session (re)connection
	refs int           // holders of lock or conn, and waiters; guarded by Runtime.mu
	sess *agentSession // guarded by Runtime.mu
}

var (
	_ runtime.Runtime     = (*Runtime)(nil)
	_ runtime.Snapshotter = (*Runtime)(nil)
)

// New checks the configuration, finds QEMU, the kernel and its modules, picks the
// accelerator and creates the root dir.
func New(cfg Config) (*Runtime, error) {
	if cfg.QemuPath == "" {
		p, err := exec.LookPath("qemu-system-x86_64")
		if err != nil {
			return nil, fmt.Errorf("qemu: qemu-system-x86_64 not found on PATH (install it with `apt-get install qemu-system-x86`): %w", err)
		}
		cfg.QemuPath = p
	}
	if p, err := filepath.Abs(cfg.QemuPath); err == nil {
		cfg.QemuPath = p
	}
	if _, err := os.Stat(cfg.QemuPath); err != nil {
		return nil, fmt.Errorf("qemu: %w", err)
	}
	if cfg.KernelPath == "" {
		k, err := DefaultKernel()
		if err != nil {
			return nil, fmt.Errorf("qemu: %w", err)
		}
		cfg.KernelPath = k
	}
	if _, err := os.Stat(cfg.KernelPath); err != nil {
		return nil, fmt.Errorf("qemu: kernel: %w", err)
	}
	if cfg.ModulesDir == "" {
		ver := strings.TrimPrefix(filepath.Base(cfg.KernelPath), "vmlinuz-")
		cfg.ModulesDir = filepath.Join("/lib/modules", ver)
	}
	if cfg.RootDir == "" {
		cfg.RootDir = DefaultRootDir
	}
	if !filepath.IsAbs(cfg.RootDir) {
		return nil, fmt.Errorf("qemu: root dir %q is not absolute", cfg.RootDir)
	}
	cfg.RootDir = filepath.Clean(cfg.RootDir)
	logger := cfg.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	accel, reason, err := DetectAccel(cfg.Accel)
	if err != nil {
		return nil, fmt.Errorf("qemu: %w", err)
	}
	modules, err := initramfs.ResolveModules(cfg.ModulesDir, guestModules(), optionalModule)
	if err != nil {
		return nil, fmt.Errorf("qemu: %w", err)
	}
	out, err := exec.Command(cfg.QemuPath, "--version").Output()
	if err != nil {
		return nil, fmt.Errorf("qemu: %s --version: %w", cfg.QemuPath, err)
	}
	version, _, _ := strings.Cut(string(out), "\n")
	version = strings.TrimSpace(strings.TrimPrefix(version, "QEMU emulator version"))
	if err := os.MkdirAll(cfg.RootDir, 0o700); err != nil {
		return nil, fmt.Errorf("qemu: create root dir: %w", err)
	}
	key := sha256.Sum256([]byte(cfg.RootDir))
	var tscKHz int64
	if accel == AccelTCG {
		tscKHz = hostTSCkHz()
	}
	r := &Runtime{
		tscKHz:      tscKHz,
		cfg:         cfg,
		log:         logger.With("runtime", "qemu"),
		accel:       accel,
		accelReason: reason,
		version:     version,
		rootKey:     hex.EncodeToString(key[:4]),
		insts:       map[string]*instance{},
	}
	r.initrds = &initramfs.Cache{
		Dir:        filepath.Join(cfg.RootDir, initramfsDir),
		KernelPath: cfg.KernelPath,
		Modules:    modules,
		Logger:     r.log,
	}
	r.log.Info("qemu runtime", "accel", accel, "reason", reason, "kernel", cfg.KernelPath, "modules", len(modules), "version", version, "tsc_khz", tscKHz)
	return r, nil
}

// DefaultKernel finds the default guest kernel: the newest /boot/vmlinuz-*-cloud-amd64,
// else the newest /boot/vmlinuz-*.
func DefaultKernel() (string, error) {
	for _, pattern := range []string{"/boot/vmlinuz-*-cloud-amd64", "/boot/vmlinuz-*"} {
		matches, _ := filepath.Glob(pattern)
		if len(matches) == 0 {
			continue
		}
		slices.SortFunc(matches, func(a, b string) int { return compareVersions(b, a) })
		return matches[0], nil
	}
	return "", errors.New("no guest kernel in /boot (install linux-image-cloud-amd64)")
}

// compareVersions orders strings with embedded numbers numerically (6.1.0-10 > 6.1.0-9).
func compareVersions(a, b string) int {
	for a != "" && b != "" {
		da, db := leadingDigits(a), leadingDigits(b)
		if da > 0 && db > 0 {
			na, nb := strings.TrimLeft(a[:da], "0"), strings.TrimLeft(b[:db], "0")
			if c := len(na) - len(nb); c != 0 {
				return c
			}
			if c := strings.Compare(na, nb); c != 0 {
				return c
			}
			a, b = a[da:], b[db:]
			continue
		}
		if a[0] != b[0] {
			return int(a[0]) - int(b[0])
		}
		a, b = a[1:], b[1:]
	}
	return len(a) - len(b)
}

func leadingDigits(s string) int {
	i := 0
	for i < len(s) && s[i] >= '0' && s[i] <= '9' {
		i++
	}
	return i
}

// Info reports QEMU's version, the accelerator and why it was chosen.
func (r *Runtime) Info(ctx context.Context) (runtime.Info, error) {
	return runtime.Info{
		Name:    "qemu",
		Disk:    runtime.DiskExt4,
		Version: r.version,
		Caps:    runtime.Caps{AgentResume: runtime.ResumeByAPI},
		Details: map[string]string{
			"machine":      "microvm",
			"accel":        r.accel,
			"accel_reason": r.accelReason,
			"kernel":       r.cfg.KernelPath,
			"transport":    "virtio-serial+yamux",
			// The agent keeps its transport across a checkpoint (the serial port is a
			// device, not a host socket): after a restore it gets its identity over it.
		},
	}, nil
}

// acquire returns the in-memory side of instance id, counting the caller as a user
// until release.
func (r *Runtime) acquire(id string) *instance {
	r.mu.Lock()
	defer r.mu.Unlock()
	in := r.insts[id]
	if in == nil {
		in = &instance{lock: make(chan struct{}, 1), conn: make(chan struct{}, 1)}
		r.insts[id] = in
	}
	in.refs++
	return in
}

func (r *Runtime) release(id string, in *instance) {
	r.mu.Lock()
	defer r.mu.Unlock()
	in.refs--
	if in.refs == 0 && in.sess == nil && r.insts[id] == in {
		delete(r.insts, id)
	}
}

// take takes one of the instance's locks (ch is in.lock or in.conn), waiting at most
// until ctx is done.
func (r *Runtime) take(ctx context.Context, id string, ch func(*instance) chan struct{}) (func(), error) {
	in := r.acquire(id)
	select {
	case ch(in) <- struct{}{}:
		return func() {
			<-ch(in)
			r.release(id, in)
		}, nil
	case <-ctx.Done():
		r.release(id, in)
		return nil, fmt.Errorf("instance %s busy: %w", id, ctx.Err())
	}
}

// lock takes the instance's lifecycle lock, waiting at most until ctx is done.
func (r *Runtime) lock(ctx context.Context, id string) (func(), error) {
	return r.take(ctx, id, func(in *instance) chan struct{} { return in.lock })
}

// Create starts a VM booting spec.RootFS (an ext4 image) with the agent. It returns once
// QEMU runs (answers QMP), before the guest has booted; Dial waits for the agent. On
// error everything it created is removed.
func (r *Runtime) Create(ctx context.Context, spec runtime.Spec) (err error) {
	spec, err = r.checkSpec(spec)
	if err != nil {
		return fmt.Errorf("qemu create: %w", err)
	}
	unlock, err := r.lock(ctx, spec.ID)
	if err != nil {
		return fmt.Errorf("qemu create %s: %w", spec.ID, err)
	}
	defer unlock()
	initrd, err := r.initrds.Build(ctx, spec.AgentPath)
	if err != nil {
		return fmt.Errorf("qemu create %s: %w", spec.ID, err)
	}
	cmdline, err := kernelCmdline(spec.AgentEnv, r.tscKHz)
	if err != nil {
		return fmt.Errorf("qemu create %s: %w", spec.ID, err)
	}
	m := machine{
		MemoryMB: spec.MemoryMB, CPU: spec.CPU, Accel: r.accel,
		Kernel: r.cfg.KernelPath, Initrd: initrd, Append: cmdline, QEMU: r.version,
	}
	if err := r.launch(ctx, spec, m, ""); err != nil {
		return fmt.Errorf("qemu create %s: %w", spec.ID, err)
	}
	return nil
}

// launch claims the instance's record, starts QEMU for machine m and, with a checkpoint
// dir, loads the checkpoint. On error it removes everything it created.
func (r *Runtime) launch(ctx context.Context, spec runtime.Spec, m machine, checkpoint string) (err error) {
	rec := record{ID: spec.ID, StateDir: spec.StateDir, RootFS: spec.RootFS, Machine: m, CreatedAt: time.Now().UTC()}
	if err := r.claimRecord(rec); err != nil {
		if errors.Is(err, fs.ErrExist) {
			return errors.New("instance already exists")
		}
		return err
	}
	defer func() {
		if err == nil {
			return
		}
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
		defer cancel()
		if uerr := r.destroy(cctx, spec.ID); uerr != nil {
			r.log.ErrorContext(cctx, "undo failed start", "id", spec.ID, "err", uerr)
			err = errors.Join(err, fmt.Errorf("undo: %w", uerr))
		}
	}()
	start := time.Now()
	pid, startTime, err := r.start(ctx, spec, m, checkpoint != "")
	if err != nil {
		return err
	}
	rec.PID, rec.StartTime = pid, startTime
	if err := r.updateRecord(rec); err != nil {
		return err
	}
	if checkpoint == "" {
		r.log.InfoContext(ctx, "vm started", "id", spec.ID, "pid", pid, "duration", time.Since(start))
		return nil
	}
	started := time.Since(start)
	if err := r.load(ctx, spec, checkpoint); err != nil {
		return err
	}
	r.log.InfoContext(ctx, "vm restored", "id", spec.ID, "pid", pid, "qemu_start", started, "duration", time.Since(start))
	return nil
}

// start runs QEMU for machine m in its own session, mount and network namespace, with
// the StateDir and the disk as descriptors 3 and 4, and waits until QMP answers.
func (r *Runtime) start(ctx context.Context, spec runtime.Spec, m machine, incoming bool) (pid int, startTime uint64, err error) {
	sfd, err := unix.Open(spec.StateDir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0, 0, fmt.Errorf("open state dir: %w", err)
	}
	stateDir := os.NewFile(uintptr(sfd), spec.StateDir)
	defer stateDir.Close()
	disk, err := os.OpenFile(spec.RootFS, os.O_RDWR, 0)
	if err != nil {
		return 0, 0, fmt.Errorf("open disk: %w", err)
	}
	defer disk.Close()
	logPath := filepath.Join(spec.StateDir, qemuLog)
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return 0, 0, fmt.Errorf("open qemu log: %w", err)
	}
	defer logf.Close()

	// Not CommandContext: the VM must outlive ctx and the node process.
	cmd := exec.Command(r.cfg.QemuPath, m.args(r.procName(spec.ID), incoming)...)
	cmd.Dir = "/"
	cmd.Env = []string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin"}
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.ExtraFiles = []*os.File{stateDir, disk} // fdStateDir, fdDisk
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Setsid:       true,
		Unshareflags: syscall.CLONE_NEWNS | syscall.CLONE_NEWNET,
	}
	r.log.DebugContext(ctx, "starting qemu", "id", spec.ID, "args", cmd.Args)
	if err := cmd.Start(); err != nil {
		return 0, 0, fmt.Errorf("start qemu: %w", err)
	}
	pid = cmd.Process.Pid
	exited := make(chan struct{})
	go func() {
		// Reap QEMU whenever it exits while this process lives; after a node restart
		// init (or a subreaper) does.
		_ = cmd.Wait()
		close(exited)
	}()
	pi, err := instances.ReadProc(pid)
	if err != nil {
		return 0, 0, fmt.Errorf("qemu exited at once: %s", runtime.LogTail(logPath, 2048))
	}
	sctx, cancel := context.WithTimeout(ctx, startTimeout)
	defer cancel()
	if err := r.waitQMP(sctx, spec.StateDir, exited); err != nil {
		return pid, pi.StartTime, fmt.Errorf("%w: %s", err, runtime.LogTail(logPath, 2048))
	}
	return pid, pi.StartTime, nil
}

// waitQMP polls until QEMU answers on its QMP socket, the process exits or ctx ends.
func (r *Runtime) waitQMP(ctx context.Context, stateDir string, exited <-chan struct{}) error {
	t := time.NewTicker(5 * time.Millisecond)
	defer t.Stop()
	for {
		actx, cancel := context.WithTimeout(ctx, time.Second)
		q, err := dialQMP(actx, filepath.Join(stateDir, qmpSocket))
		cancel()
		if err == nil {
			return q.Close()
		}
		select {
		case <-exited:
			return errors.New("qemu exited during start")
		case <-ctx.Done():
			return fmt.Errorf("qemu did not answer QMP: %w (last error: %v)", ctx.Err(), err)
		case <-t.C:
		}
	}
}

// withQMP runs f with a QMP connection to the instance; the caller holds its lock.
func (r *Runtime) withQMP(ctx context.Context, stateDir string, f func(*qmp) error) error {
	q, err := dialQMP(ctx, filepath.Join(stateDir, qmpSocket))
	if err != nil {
		return err
	}
	defer q.Close()
	return f(q)
}

// Dial opens a stream to the instance's agent: a new yamux stream on the instance's
// session, (re)connecting and handshaking first if there is none. During boot or right
// after a restore this waits for the agent, at most until ctx is done.
func (r *Runtime) Dial(ctx context.Context, id string) (net.Conn, error) {
	if !validID(id) {
		return nil, fmt.Errorf("qemu dial: invalid id %q", id)
	}
	for attempt := 0; ; attempt++ {
		s, err := r.session(ctx, id)
		if err != nil {
			return nil, fmt.Errorf("qemu dial %s: %w", id, err)
		}
		c, err := s.sess.Open()
		if err == nil {
			return c, nil
		}
		r.dropSession(id, s)
		if attempt > 0 {
			return nil, fmt.Errorf("qemu dial %s: %w", id, err)
		}
	}
}

// Status reports the instance's status: from QMP while QEMU runs; stopped when only its
// record is left (it crashed, shut down or was checkpointed).
func (r *Runtime) Status(ctx context.Context, id string) (runtime.Status, error) {
	if !validID(id) {
		return "", fmt.Errorf("qemu status: invalid id %q", id)
	}
	rec, err := r.findInstance(id)
	if err != nil {
		return "", fmt.Errorf("qemu status %s: %w", id, err)
	}
	pid := r.instancePID(id, &rec)
	if pid == 0 {
		return runtime.StatusStopped, nil
	}
	unlock, err := r.lock(ctx, id)
	if err != nil {
		return "", fmt.Errorf("qemu status %s: %w", id, err)
	}
	defer unlock()
	var state string
	err = r.withQMP(ctx, rec.StateDir, func(q *qmp) error {
		state, err = q.runState(ctx)
		return err
	})
	if err != nil {
		if r.instancePID(id, &rec) == 0 {
			return runtime.StatusStopped, nil // exited meanwhile
		}
		return "", fmt.Errorf("qemu status %s: %w", id, err)
	}
	return runStatus(state), nil
}

// runStatus maps QEMU's run state to a runtime.Status.
func runStatus(state string) runtime.Status {
	switch state {
	case "running":
		return runtime.StatusRunning
	case "shutdown", "internal-error", "guest-panicked", "io-error":
		return runtime.StatusStopped
	default: // paused, prelaunch, inmigrate, postmigrate, finish-migrate, suspended, ...
		return runtime.StatusPaused
	}
}

// findInstance returns the instance's record or, for a QEMU process of this runtime that
// lost its record (a Create interrupted between start and record update, or a wiped
// root dir), one rebuilt from /proc. runtime.ErrNotFound when there is neither.
func (r *Runtime) findInstance(id string) (record, error) {
	rec, err := r.readRecord(id)
	if err == nil {
		return rec, nil
	}
	if !errors.Is(err, fs.ErrNotExist) {
		return record{}, err
	}
	pid := r.instancePID(id, nil)
	if pid == 0 {
		return record{}, runtime.ErrNotFound
	}
	pi, err := instances.ReadProc(pid)
	if err != nil {
		return record{}, runtime.ErrNotFound
	}
	stateDir, _ := os.Readlink(fmt.Sprintf("/proc/%d/fd/%d", pid, fdStateDir))
	rootfs, _ := os.Readlink(fmt.Sprintf("/proc/%d/fd/%d", pid, fdDisk))
	return record{ID: id, PID: pid, StartTime: pi.StartTime, StateDir: stateDir, RootFS: rootfs}, nil
}

// List reports every instance with a record or a QEMU process, sorted by id.
func (r *Runtime) List(ctx context.Context) ([]runtime.Instance, error) {
	ids, err := r.recordIDs()
	if err != nil {
		return nil, fmt.Errorf("qemu list: %w", err)
	}
	out, err := instances.List(ctx, append(ids, r.orphanIDs()...), r.Status)
	if err != nil {
		return nil, fmt.Errorf("qemu list: %w", err)
	}
	return out, nil
}

// Adopt re-attaches to an instance that survived a node restart: its QEMU must still
// run from spec.StateDir. A lost record is rewritten. The agent session is re-established
// by the next Dial.
func (r *Runtime) Adopt(ctx context.Context, spec runtime.Spec) error {
	if !validID(spec.ID) {
		return fmt.Errorf("qemu adopt: invalid id %q", spec.ID)
	}
	rec, err := r.findInstance(spec.ID)
	if err != nil {
		return fmt.Errorf("qemu adopt %s: %w", spec.ID, err)
	}
	pid := r.instancePID(spec.ID, &rec)
	if pid == 0 {
		return fmt.Errorf("qemu adopt %s: instance is stopped", spec.ID)
	}
	if filepath.Clean(rec.StateDir) != filepath.Clean(spec.StateDir) {
		return fmt.Errorf("qemu adopt %s: runs from %s, not %s", spec.ID, rec.StateDir, spec.StateDir)
	}
	if _, rerr := r.readRecord(spec.ID); rerr != nil || rec.PID != pid {
		pi, err := instances.ReadProc(pid)
		if err != nil {
			return fmt.Errorf("qemu adopt %s: %w", spec.ID, err)
		}
		rec.PID, rec.StartTime = pid, pi.StartTime
		if rec.CreatedAt.IsZero() {
			rec.CreatedAt = time.Now().UTC()
		}
		if err := r.updateRecord(rec); err != nil {
			return fmt.Errorf("qemu adopt %s: %w", spec.ID, err)
		}
	}
	r.dropSession(spec.ID, nil)
	return nil
}

// Destroy stops the instance's QEMU (QMP quit, SIGKILL if it lingers) and removes its
// files from the StateDir and its record. It succeeds when the instance does not exist.
// It never touches the disk.
func (r *Runtime) Destroy(ctx context.Context, id string) error {
	if !validID(id) {
		return fmt.Errorf("qemu destroy: invalid id %q", id)
	}
	ctx, cancel := context.WithTimeout(ctx, destroyTimeout)
	defer cancel()
	unlock, err := r.lock(ctx, id)
	if err != nil {
		return fmt.Errorf("qemu destroy %s: %w", id, err)
	}
	defer unlock()
	if err := r.destroy(ctx, id); err != nil {
		return fmt.Errorf("qemu destroy %s: %w", id, err)
	}
	return nil
}

// destroy tears the instance down; the caller holds its lock.
func (r *Runtime) destroy(ctx context.Context, id string) error {
	r.dropSession(id, nil)
	rec, err := r.findInstance(id)
	if errors.Is(err, runtime.ErrNotFound) {
		return nil
	}
	if err != nil {
		r.log.WarnContext(ctx, "destroy: unreadable record", "id", id, "err", err)
	}
	// More than one process can carry the name (a start that lost its record, then
	// another): stop them all.
	for range 8 {
		pid := r.instancePID(id, &rec)
		if pid == 0 {
			break
		}
		if err := r.stopQEMU(ctx, pid, rec.StateDir); err != nil {
			return err
		}
		rec.PID = 0
	}
	if rec.StateDir != "" {
		var errs []error
		for _, name := range stateFiles() {
			if err := os.Remove(filepath.Join(rec.StateDir, name)); err != nil && !errors.Is(err, fs.ErrNotExist) {
				errs = append(errs, err)
			}
		}
		if err := errors.Join(errs...); err != nil {
			return fmt.Errorf("clean state dir: %w", err)
		}
	}
	if err := r.removeRecord(id); err != nil {
		return err
	}
	r.log.DebugContext(ctx, "vm destroyed", "id", id)
	return nil
}

// stopQEMU asks QEMU to quit and kills it if it is still there after quitTimeout.
func (r *Runtime) stopQEMU(ctx context.Context, pid int, stateDir string) error {
	pi, err := instances.ReadProc(pid)
	if err != nil || !pi.Live() {
		return nil
	}
	if stateDir != "" {
		qctx, cancel := context.WithTimeout(ctx, time.Second)
		err := r.withQMP(qctx, stateDir, func(q *qmp) error { return q.exec(qctx, "quit", nil, nil) })
		cancel()
		if err != nil {
			r.log.DebugContext(ctx, "qmp quit failed, killing", "pid", pid, "err", err)
		}
	}
	return waitGone(ctx, pid, pi.StartTime, quitTimeout)
}

// Close drops the runtime's agent sessions. VMs keep running; a new Runtime adopts them.
func (r *Runtime) Close() error {
	r.mu.Lock()
	ids := make([]string, 0, len(r.insts))
	for id := range r.insts {
		ids = append(ids, id)
	}
	r.mu.Unlock()
	for _, id := range ids {
		r.dropSession(id, nil)
	}
	return nil
}

// validID reports whether id is a sandbox id: lowercase alphanumerics.
func validID(id string) bool {
	if id == "" || len(id) > 64 {
		return false
	}
	for _, c := range id {
		if (c < 'a' || c > 'z') && (c < '0' || c > '9') {
			return false
		}
	}
	return true
}

// checkSpec validates spec and fills in the default CPU and memory.
func (r *Runtime) checkSpec(spec runtime.Spec) (runtime.Spec, error) {
	if !validID(spec.ID) {
		return spec, fmt.Errorf("invalid id %q (want lowercase alphanumerics)", spec.ID)
	}
	if spec.Network {
		// Networking needs a tap device in a per-sandbox network namespace (NAT, egress
		// rules); user-mode networking would bypass those rules.
		return spec, fmt.Errorf("network: %w", runtime.ErrUnsupported)
	}
	for name, p := range map[string]string{"root fs": spec.RootFS, "state dir": spec.StateDir, "agent": spec.AgentPath} {
		if !filepath.IsAbs(p) {
			return spec, fmt.Errorf("%s path %q is not absolute", name, p)
		}
	}
	if fi, err := os.Stat(spec.StateDir); err != nil {
		return spec, fmt.Errorf("state dir: %w", err)
	} else if !fi.IsDir() {
		return spec, fmt.Errorf("state dir %s is not a directory", spec.StateDir)
	}
	for name, p := range map[string]string{"root fs": spec.RootFS, "agent": spec.AgentPath} {
		if fi, err := os.Stat(p); err != nil {
			return spec, fmt.Errorf("%s: %w", name, err)
		} else if !fi.Mode().IsRegular() {
			return spec, fmt.Errorf("%s %s is not a regular file (want an ext4 image)", name, p)
		}
	}
	if spec.CPU < 0 || spec.MemoryMB < 0 {
		return spec, fmt.Errorf("negative cpu (%d) or memory (%d)", spec.CPU, spec.MemoryMB)
	}
	if spec.CPU == 0 {
		spec.CPU = DefaultCPU
	}
	if spec.MemoryMB == 0 {
		spec.MemoryMB = DefaultMemoryMB
	}
	return spec, nil
}
