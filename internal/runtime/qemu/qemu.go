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
// Each QEMU is jailed (jail.go): its own session (it outlives the node process), mount
// namespace holding only what it reads, PID, IPC, UTS and network namespace (empty: a
// networked VM's NIC is a tap in the sandbox's namespace whose descriptor QEMU gets), an unprivileged uid and gid of its own leased from a
// range (uids.go), no capabilities, no_new_privs, QEMU's seccomp sandbox, and a cgroup of
// its own with cpu, memory and pids limits (cgroup.go). Every instance-specific file is
// opened by the node and passed to QEMU as an inherited descriptor, so the command line
// is identical for all instances of one machine shape: a restored or cloned VM finds the
// same devices whatever its StateDir and disk are. QMP (a unix socket in the StateDir)
// drives pause, resume, checkpoint (migration into a file descriptor) and restore
// (-incoming defer).
//
// The package owns the StateDir files listed in stateFiles, the checkpoint files
// (memory, vm.json), its root dir: instance records (instances/<id>.json), the initramfs
// cache (initramfs/) and the jail's mount point (jail/), the VMs' cgroups and the uid
// leases.
package qemu

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
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

	"github.com/prometheus/procfs"
	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/network"
	"github.com/spacedev/space/internal/runtime"
	"github.com/spacedev/space/internal/runtime/initramfs"
	"github.com/spacedev/space/internal/runtime/instances"
	"github.com/spacedev/space/internal/runtime/kernelimage"
)

// Config configures the QEMU runtime. Zero values take the documented defaults.
type Config struct {
	// QemuPath is the emulator; default qemu-system-x86_64 on PATH.
	QemuPath string
	// KernelPath is the guest kernel; default the newest /boot/vmlinuz-*-cloud-amd64,
	// else the newest /boot/vmlinuz-*. A compressed kernel (bzImage) built with
	// CONFIG_PVH is booted through its PVH entry: the vmlinux inside it is extracted
	// once into KernelCacheDir (package kernelimage); any other kernel is booted as it is.
	KernelPath string
	// KernelCacheDir holds the vmlinux extracted from KernelPath; default
	// <RootDir>/kernel. On a disk (space serve: <data-dir>/cache/qemu-kernel) its pages
	// are page cache the host can reclaim; on tmpfs they stay in memory.
	KernelCacheDir string
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

	// FirstUID and UIDCount are the range of host uids QEMU processes run as, one per
	// VM (its gid the same number); default DefaultFirstUID and DefaultUIDCount. No other
	// user or group of the host may use them.
	FirstUID, UIDCount int
	// LeaseDir holds the leases of the uid range; default DefaultLeaseDir. Every runtime
	// on the host that uses the same range must use the same directory.
	LeaseDir string
	// CgroupParent is the cgroup under which each VM gets its own; default
	// DefaultCgroupParent. It is relative to the cgroup v2 root, or with cgroup v1 to
	// this process's own cgroup in each hierarchy.
	CgroupParent string
}

// Defaults.
const (
	DefaultRootDir      = "/run/space/qemu"
	DefaultCPU          = 1
	DefaultMemoryMB     = 512
	DefaultCgroupParent = "space-qemu"
)

// jailDir is the jail helper's mount point, under the root dir (see jailSpec.Root).
const jailDir = "jail"

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
	host        hostOpts
	// boot is the kernel QEMU boots: the PVH vmlinux extracted from cfg.KernelPath, or
	// cfg.KernelPath itself; bootNote says which and why.
	boot, bootNote string

	initrds *initramfs.Cache
	uids    *uidLeases
	cgroups *cgroups
	jail    jailSpec // the binds, links and groups every jail gets

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
// accelerator and creates the root dir, the uid lease dir and the parent cgroups.
func New(cfg Config) (*Runtime, error) {
	if os.Geteuid() != 0 {
		// Jailing QEMU takes namespaces, cgroups and a uid switch.
		return nil, fmt.Errorf("qemu: needs root to jail QEMU (running as uid %d)", os.Geteuid())
	}
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
	if cfg.FirstUID == 0 && cfg.UIDCount == 0 {
		cfg.FirstUID, cfg.UIDCount = DefaultFirstUID, DefaultUIDCount
	}
	if cfg.LeaseDir == "" {
		cfg.LeaseDir = DefaultLeaseDir
	}
	if cfg.CgroupParent == "" {
		cfg.CgroupParent = DefaultCgroupParent
	}
	// QEMU opens the kernel by path as its own unprivileged uid.
	if err := worldReadable(cfg.KernelPath); err != nil {
		return nil, fmt.Errorf("qemu: kernel: %w", err)
	}
	jail, err := baseJail(cfg.QemuPath, accel)
	if err != nil {
		return nil, fmt.Errorf("qemu: %w", err)
	}
	uids, err := newUIDLeases(cfg.LeaseDir, cfg.FirstUID, cfg.UIDCount)
	if err != nil {
		return nil, fmt.Errorf("qemu: %w", err)
	}
	cgs, err := newCgroups(cfg.CgroupParent)
	if err != nil {
		return nil, fmt.Errorf("qemu: %w", err)
	}
	if err := os.MkdirAll(cfg.RootDir, 0o700); err != nil {
		return nil, fmt.Errorf("qemu: create root dir: %w", err)
	}
	if cfg.KernelCacheDir == "" {
		cfg.KernelCacheDir = filepath.Join(cfg.RootDir, kernelDir)
	}
	boot, bootNote := bootKernel(cfg.KernelPath, cfg.KernelCacheDir, logger)
	jail.Root = filepath.Join(cfg.RootDir, jailDir)
	if err := os.Mkdir(jail.Root, 0o700); err != nil && !errors.Is(err, fs.ErrExist) {
		return nil, fmt.Errorf("qemu: create jail mount point: %w", err)
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
		uids:        uids,
		cgroups:     cgs,
		jail:        jail,
		host:        defaultHostOpts(),
		boot:        boot,
		bootNote:    bootNote,
	}
	r.initrds = &initramfs.Cache{
		Dir:        filepath.Join(cfg.RootDir, initramfsDir),
		KernelPath: cfg.KernelPath,
		Modules:    modules,
		Logger:     r.log,
		// Bind-mounted into each jail: only the file's own mode counts for QEMU's uid.
		WorldReadable: true,
	}
	r.log.Info("qemu runtime", "accel", accel, "reason", reason, "kernel", cfg.KernelPath, "boot", bootNote, "modules", len(modules), "version", version, "tsc_khz", tscKHz,
		"uids", fmt.Sprintf("%d+%d", cfg.FirstUID, cfg.UIDCount), "cgroup_v2", cgs.v2)
	return r, nil
}

// kernelDir is where the extracted kernel is kept by default, under the root dir.
const kernelDir = "kernel"

// bootKernel returns the kernel QEMU is to boot for kernel and a note saying how: the
// PVH-capable vmlinux inside it (extracted into cacheDir on first use), which QEMU maps
// instead of copying into every VM's memory and which skips the guest's decompressor
// (docs/benchmarks.md, "QEMU boots the vmlinux"); else kernel itself, booted through
// the firmware as a bzImage.
func bootKernel(kernel, cacheDir string, log *slog.Logger) (string, string) {
	c := &kernelimage.Cache{Dir: cacheDir, Logger: log}
	p, err := c.PVH(context.Background(), kernel)
	if err != nil {
		log.Info("qemu: booting the kernel through the firmware, not PVH", "kernel", kernel, "reason", err)
		return kernel, "firmware (" + err.Error() + ")"
	}
	return p, "pvh " + p
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
		Caps:    runtime.Caps{AgentResume: runtime.ResumeByAPI, Network: runtime.NetworkTap},
		Details: map[string]string{
			"machine":      "microvm",
			"accel":        r.accel,
			"accel_reason": r.accelReason,
			"kernel":       r.cfg.KernelPath,
			"kernel_boot":  r.bootNote,
			"transport":    "virtio-serial+yamux",
			// The agent keeps its transport across a checkpoint (the serial port is a
			// device, not a host socket): after a restore it gets its identity over it.
			"jail": fmt.Sprintf("uid/gid per VM from %d+%d, no capabilities, mount/pid/net/ipc/uts namespaces, seccomp, %s", r.cfg.FirstUID, r.cfg.UIDCount, r.cgroups.describe()),
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
	if err := ensureWorldReadable(initrd); err != nil {
		return fmt.Errorf("qemu create %s: %w", spec.ID, err)
	}
	m := machine{
		MemoryMB: spec.MemoryMB, CPU: spec.CPU, Accel: r.accel,
		Kernel: r.boot, Initrd: initrd, Append: cmdline, QEMU: r.version,
		Network: spec.NetNS != "", Balloon: true, Host: r.host,
	}
	if err := r.launch(ctx, spec, m, ""); err != nil {
		return fmt.Errorf("qemu create %s: %w", spec.ID, err)
	}
	return nil
}

// launch claims the instance's record, leases its uid, creates its cgroup, starts QEMU
// for machine m and, with a checkpoint dir, loads the checkpoint. On error it removes
// everything it created.
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
	if _, err := r.uids.acquire(r.leaseHolder(spec.ID), func(uid int) error {
		rec.UID = uid
		return r.updateRecord(rec)
	}); err != nil {
		return err
	}
	// The cgroup's directories go into the record before they exist, so that an
	// interrupted start leaves nothing Destroy does not find.
	rec.Cgroups = r.cgroups.dirs(r.cgroupName(spec.ID))
	if err := r.updateRecord(rec); err != nil {
		return err
	}
	limits := vmLimits{CPU: m.CPU, MemoryMB: m.MemoryMB, Pids: spec.PidsLimit}
	if _, err := r.cgroups.create(r.cgroupName(spec.ID), limits); err != nil {
		return err
	}
	pid, startTime, err := r.start(ctx, spec, m, rec, checkpoint != "")
	if err != nil {
		return err
	}
	rec.PID, rec.StartTime = pid, startTime
	if err := r.updateRecord(rec); err != nil {
		return err
	}
	if checkpoint == "" {
		r.log.InfoContext(ctx, "vm started", "id", spec.ID, "pid", pid, "uid", rec.UID, "duration", time.Since(start))
		return nil
	}
	started := time.Since(start)
	if err := r.load(ctx, spec, checkpoint); err != nil {
		return err
	}
	r.log.InfoContext(ctx, "vm restored", "id", spec.ID, "pid", pid, "uid", rec.UID, "qemu_start", started, "duration", time.Since(start))
	return nil
}

// leaseHolder names the instance in its uid lease.
func (r *Runtime) leaseHolder(id string) leaseHolder {
	return leaseHolder{RootDir: r.cfg.RootDir, ID: id}
}

// cgroupName is the name of the instance's cgroup under the parent: the root dir's key
// keeps runtimes with different root dirs apart.
func (r *Runtime) cgroupName(id string) string { return r.rootKey + "-" + id }

// stateEnv names QEMU's StateDir in its environment: QEMU itself cannot reach it (it is
// outside its jail), but a runtime that lost the instance's record finds it again there.
const stateEnv = "SPACE_QEMU_STATE_DIR"

// start runs QEMU for machine m in its jail (see jail.go) and its cgroups, with the disk,
// the console log and the listening QMP and agent sockets as inherited descriptors, and
// waits until QMP answers. On error no process of it is left.
func (r *Runtime) start(ctx context.Context, spec runtime.Spec, m machine, rec record, incoming bool) (pid int, startTime uint64, err error) {
	var files []*os.File
	defer func() {
		for _, f := range files {
			f.Close()
		}
	}()
	open := func(p string, flag int, perm os.FileMode) (*os.File, error) {
		f, err := os.OpenFile(p, flag|unix.O_CLOEXEC, perm)
		if err == nil {
			files = append(files, f)
		}
		return f, err
	}
	disk, err := open(spec.RootFS, os.O_RDWR, 0)
	if err != nil {
		return 0, 0, fmt.Errorf("open disk: %w", err)
	}
	diskRO, err := open(spec.RootFS, os.O_RDONLY, 0)
	if err != nil {
		return 0, 0, fmt.Errorf("open disk: %w", err)
	}
	console, err := open(filepath.Join(spec.StateDir, consoleLog), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return 0, 0, fmt.Errorf("open console log: %w", err)
	}
	logPath := filepath.Join(spec.StateDir, qemuLog)
	logf, err := open(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return 0, 0, fmt.Errorf("open qemu log: %w", err)
	}
	qmpL, err := listenUnix(filepath.Join(spec.StateDir, qmpSocket))
	if err != nil {
		return 0, 0, fmt.Errorf("qmp socket: %w", err)
	}
	files = append(files, qmpL)
	agentL, err := listenUnix(filepath.Join(spec.StateDir, agentSocket))
	if err != nil {
		return 0, 0, fmt.Errorf("agent socket: %w", err)
	}
	files = append(files, agentL)
	specR, specW, err := os.Pipe()
	if err != nil {
		return 0, 0, err
	}
	files = append(files, specR, specW)
	extra := []*os.File{specR, disk, diskRO, console, qmpL, agentL}
	if m.Network {
		if spec.NetNS == "" {
			return 0, 0, fmt.Errorf("the machine has a network interface but the sandbox has no network namespace: %w", runtime.ErrUnsupported)
		}
		tap, err := network.OpenTap(spec.NetNS)
		if err != nil {
			return 0, 0, err
		}
		files = append(files, tap)
		extra = append(extra, tap) // fdTap
	}

	// Not CommandContext: the VM must outlive ctx and the node process.
	cmd := exec.Command("/proc/self/exe")
	cmd.Args = []string{jailArg0}
	cmd.Dir = "/"
	cmd.Env = []string{}
	cmd.Stdout, cmd.Stderr = logf, logf
	// fdJailSpec, fdDisk, fdDiskRO, fdConsole, fdQMP, fdAgent[, fdTap]
	cmd.ExtraFiles = extra
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Setsid:     true,
		Cloneflags: syscall.CLONE_NEWNS | syscall.CLONE_NEWPID | syscall.CLONE_NEWNET | syscall.CLONE_NEWIPC | syscall.CLONE_NEWUTS,
	}
	args := m.args(r.procName(spec.ID), incoming)
	js := r.jail.forVM(m.Kernel, m.Initrd, rec.UID, args, []string{stateEnv + "=" + spec.StateDir})
	js.NoTHP = !m.Host.THP
	r.log.DebugContext(ctx, "starting qemu", "id", spec.ID, "uid", rec.UID, "args", js.Args)
	if err := cmd.Start(); err != nil {
		return 0, 0, fmt.Errorf("start qemu jail: %w", err)
	}
	pid = cmd.Process.Pid
	exited := make(chan struct{})
	go func() {
		// Reap QEMU whenever it exits while this process lives; after a node restart
		// init (or a subreaper) does.
		_ = cmd.Wait()
		close(exited)
	}()
	defer func() {
		if err != nil {
			_ = cmd.Process.Kill()
			<-exited
			err = fmt.Errorf("%w: %s", err, runtime.LogTail(logPath, 2048))
		}
	}()
	pi, err := instances.ReadProc(pid)
	if err != nil {
		return 0, 0, errors.New("qemu jail exited at once")
	}
	// The helper waits for its spec: it is in the VM's cgroups before QEMU exists.
	if err := joinCgroups(rec.Cgroups, pid); err != nil {
		return 0, 0, err
	}
	data, err := json.Marshal(js)
	if err != nil {
		return 0, 0, err
	}
	if _, err := specW.Write(data); err != nil {
		return 0, 0, fmt.Errorf("send jail spec: %w", err)
	}
	specW.Close()
	sctx, cancel := context.WithTimeout(ctx, startTimeout)
	defer cancel()
	if err := r.waitQMP(sctx, spec.StateDir, exited); err != nil {
		return 0, 0, err
	}
	return pid, pi.StartTime, nil
}

// listenUnix creates a listening unix socket at p (replacing a leftover one), also when
// p is too long for sockaddr_un: then through /proc/self/fd/N/NAME, N being an O_PATH
// descriptor of its directory. The socket file stays when the descriptor is closed.
func listenUnix(p string) (*os.File, error) {
	if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, err
	}
	addr := p
	if len(p) >= len(unix.RawSockaddrUnix{}.Path) {
		dfd, err := unix.Open(filepath.Dir(p), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			return nil, &os.PathError{Op: "open", Path: filepath.Dir(p), Err: err}
		}
		defer unix.Close(dfd)
		addr = fmt.Sprintf("/proc/self/fd/%d/%s", dfd, filepath.Base(p))
	}
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	if err := unix.Bind(fd, &unix.SockaddrUnix{Name: addr}); err != nil {
		unix.Close(fd)
		return nil, &os.PathError{Op: "bind", Path: p, Err: err}
	}
	if err := unix.Listen(fd, 16); err != nil {
		unix.Close(fd)
		os.Remove(p)
		return nil, &os.PathError{Op: "listen", Path: p, Err: err}
	}
	return os.NewFile(uintptr(fd), p), nil
}

// errExitedAtStart: QEMU (or its jail) ended before it answered QMP.
var errExitedAtStart = errors.New("qemu exited during start")

// waitQMP waits until QEMU greets on its QMP socket (the node made it listen, so the
// connection is accepted once QEMU runs), the process exits or ctx ends.
func (r *Runtime) waitQMP(ctx context.Context, stateDir string, exited <-chan struct{}) error {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	go func() {
		select {
		case <-exited:
			cancel(errExitedAtStart)
		case <-ctx.Done():
		}
	}()
	q, err := dialQMP(ctx, filepath.Join(stateDir, qmpSocket))
	if err != nil {
		if errors.Is(context.Cause(ctx), errExitedAtStart) {
			return errExitedAtStart
		}
		return fmt.Errorf("qemu did not answer QMP: %w", err)
	}
	return q.Close()
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
	rec = record{ID: id, PID: pid, StartTime: pi.StartTime, Cgroups: r.cgroups.dirs(r.cgroupName(id))}
	rec.RootFS, _ = os.Readlink(fmt.Sprintf("/proc/%d/fd/%d", pid, fdDisk))
	if p, err := procfs.NewProc(pid); err == nil {
		if env, err := p.Environ(); err == nil {
			for _, kv := range env {
				if v, ok := strings.CutPrefix(kv, stateEnv+"="); ok {
					rec.StateDir = v
				}
			}
		}
		if st, err := p.NewStatus(); err == nil {
			rec.UID = int(st.UIDs[0])
		}
	}
	return rec, nil
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
	// QEMU is gone: its cgroups are empty and its uid is free.
	dirs := rec.Cgroups
	for _, d := range r.cgroups.dirs(r.cgroupName(id)) {
		if !slices.Contains(dirs, d) {
			dirs = append(dirs, d)
		}
	}
	if err := removeCgroups(ctx, dirs); err != nil {
		return err
	}
	if rec.UID != 0 {
		if err := r.uids.release(rec.UID, r.leaseHolder(id)); err != nil {
			return err
		}
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
	if spec.Network != (spec.NetNS != "") {
		// Networking is a tap device in the namespace the node prepared (its rules, NAT
		// and resolver); user-mode networking would bypass those rules.
		return spec, fmt.Errorf("network %v with network namespace %q: want both or neither: %w", spec.Network, spec.NetNS, runtime.ErrUnsupported)
	}
	if spec.NetNS != "" {
		if !filepath.IsAbs(spec.NetNS) {
			return spec, fmt.Errorf("network namespace path %q is not absolute", spec.NetNS)
		}
		if _, err := os.Stat(spec.NetNS); err != nil {
			return spec, fmt.Errorf("network namespace: %w", err)
		}
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
	switch {
	case spec.PidsLimit < 0:
		return spec, fmt.Errorf("negative pids limit (%d)", spec.PidsLimit)
	case spec.PidsLimit == 0:
		spec.PidsLimit = max(DefaultPidsLimit, minPids(spec.CPU))
	case spec.PidsLimit < minPids(spec.CPU):
		// The guest's processes are not host tasks; QEMU's threads are, and QEMU aborts
		// when it cannot create one.
		return spec, fmt.Errorf("pids limit %d is below the %d host tasks QEMU needs for %d vCPUs", spec.PidsLimit, minPids(spec.CPU), spec.CPU)
	}
	return spec, nil
}
