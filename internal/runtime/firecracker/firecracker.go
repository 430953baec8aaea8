// Package firecracker implements runtime.Runtime and runtime.Snapshotter with
// Firecracker microVMs: one firecracker process per sandbox, started through
// Firecracker's jailer (chroot, unprivileged uid/gid, cgroup v2 limits, the sandbox's
// network namespace) and driven over its REST API.
//
// The guest boots an uncompressed kernel (Config.KernelPath) with an initramfs built and
// cached by package initramfs (space-agent as /init plus the modules the kernel lacks,
// see package vmboot); the agent mounts the sandbox's ext4 disk (Spec.RootFS, the VM's
// root drive) and listens on AF_VSOCK port AgentVsockPort. The host reaches it through
// Firecracker's hybrid vsock: a unix socket in the jail and a "CONNECT <port>" line per
// connection (Dial).
//
// Everything a VM uses lives in its jail, <chroot base>/<firecracker's file
// name>/<root key>-<id>/root, under fixed names (vmlinux, initrd.cpio, rootfs.ext4,
// v.sock, run/firecracker.socket, snapshot/): the disk is hard-linked in, so the guest
// writes the node's file. A snapshot thus names no host path and restores into any jail
// (a clone, another id); on Firecracker ≥ 1.16 the restore also re-points the vsock
// socket explicitly (vsock_override), and on ≥ 1.12 network interfaces (network_overrides).
// Snapshot constraints this design follows: vsock connections are reset by a snapshot
// (the agent's listener survives, Dial reconnects), every clone wakes with the same guest
// IP and MAC (one network namespace per sandbox), and snapshots load only in the
// Firecracker release line that wrote them (Restore checks).
//
// The package owns its root dir (instance records under instances/, the initramfs cache
// under initramfs/), the jails, the instances' cgroups (<parent cgroup>/<jail id>) and
// the StateDir file firecracker.log (firecracker's output and the guest console).
package firecracker

import (
	"bufio"
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
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/spacedev/space/internal/guest/vmboot"
	"github.com/spacedev/space/internal/runtime"
	"github.com/spacedev/space/internal/runtime/initramfs"
	"github.com/spacedev/space/internal/runtime/instances"
	"github.com/spacedev/space/internal/runtime/kernelimage"
)

// Config configures the Firecracker runtime. Zero values take the documented defaults.
type Config struct {
	// FirecrackerPath is the firecracker binary; default "firecracker" on PATH. Its file
	// name must contain "firecracker" (the jailer insists).
	FirecrackerPath string
	// JailerPath is the jailer of the same release; default "jailer" on PATH.
	JailerPath string
	// NoJailer runs firecracker directly, as the calling user, without chroot, uid/gid
	// switch or cgroup limits (the working directory is still the instance's jail).
	// For development only.
	NoJailer bool
	// KernelPath is the guest kernel: an uncompressed vmlinux (ELF), or a compressed
	// kernel (a bzImage such as Debian's /boot/vmlinuz-*), whose vmlinux the runtime
	// extracts once into <RootDir>/kernel (package kernelimage). Required.
	KernelPath string
	// ModulesDir holds the kernel's modules (modules.dep) for the initramfs. Default
	// /lib/modules/<version> when the kernel is named vmlinux-<version> or
	// vmlinuz-<version> and that directory exists; otherwise the kernel must have its
	// drivers built in.
	ModulesDir string
	// RootDir holds the runtime's records and initramfs cache; default
	// /var/lib/space/firecracker.
	RootDir string
	// ChrootBaseDir is the jailer's --chroot-base-dir; default <RootDir>/jail. It must be
	// on a local filesystem; when it is not on the sandbox disks' filesystem (hard links
	// are impossible), jails are made next to each disk instead.
	ChrootBaseDir string
	// UID and GID are the unprivileged user and group firecracker runs as (jailer).
	UID, GID int
	// CgroupVersion is the jailer's --cgroup-version: 2 (the default) is the only one
	// supported (cgroup v1 makes snapshot restores slow and splits the controllers).
	CgroupVersion int
	// ParentCgroup is the cgroup (relative to the cgroup v2 root) under which each VM
	// gets its own; default "space-firecracker". New creates it and enables the cpu and
	// memory controllers down to it.
	ParentCgroup string
	// CgroupRoot is the cgroup v2 hierarchy's mount point; default the first cgroup2
	// mount in /proc/mounts (the one the jailer uses).
	CgroupRoot string
	// Logger receives lifecycle records and timings (default: discard).
	Logger *slog.Logger
}

// Defaults.
const (
	DefaultRootDir      = "/var/lib/space/firecracker"
	DefaultParentCgroup = "space-firecracker"
	DefaultCPU          = 1
	DefaultMemoryMB     = 512
)

// The guest side of the agent transport and of networking. Every VM has the same: they
// are in the snapshot, so clones share them (one network namespace per sandbox).
const (
	// AgentVsockPort is the vsock port the agent listens on (SPACE_AGENT_LISTEN).
	AgentVsockPort = 1024
	// GuestCID is the guest's vsock context id (hybrid vsock: no host-wide uniqueness).
	GuestCID = 3
	// TapName is the TAP device the node creates in a sandbox's network namespace.
	TapName = "tap0"
	// GuestMAC is the guest's MAC address on it.
	GuestMAC = "06:00:ac:10:00:02"
)

// Timeouts.
const (
	apiTimeout     = 10 * time.Second // one API call in Status, Pause, Resume
	destroyTimeout = 30 * time.Second
	cleanupTimeout = 30 * time.Second // undo of a failed Create or Restore
)

// Runtime runs sandboxes as Firecracker microVMs. It is safe for concurrent use; its
// state in memory is a cache, so a new Runtime over the same RootDir sees every instance
// of an old one.
type Runtime struct {
	cfg        Config
	log        *slog.Logger
	jailed     bool
	execName   string  // firecracker's file name: a jail path level and how its processes are named
	version    version // of the firecracker binary
	cgroupRoot string
	rootKey    string // short hash of RootDir, part of every jail id
	kernel     string // the vmlinux each jail gets: cfg.KernelPath or the one extracted from it

	fallbackOnce sync.Once
	initrds      *initramfs.Cache

	mu    sync.Mutex
	locks map[string]chan struct{}
}

var (
	_ runtime.Runtime     = (*Runtime)(nil)
	_ runtime.Snapshotter = (*Runtime)(nil)
)

// New checks the configuration and the host: finds the binaries (of one release), checks
// the kernel, resolves the guest's modules, prepares the parent cgroup and the root dir.
func New(cfg Config) (*Runtime, error) {
	var err error
	if cfg.FirecrackerPath, err = findBinary(cfg.FirecrackerPath, "firecracker"); err != nil {
		return nil, fmt.Errorf("firecracker: %w", err)
	}
	jailed := !cfg.NoJailer
	if jailed {
		if cfg.JailerPath, err = findBinary(cfg.JailerPath, "jailer"); err != nil {
			return nil, fmt.Errorf("firecracker: %w (or run without the jailer, for development only)", err)
		}
		if !strings.Contains(filepath.Base(cfg.FirecrackerPath), "firecracker") {
			return nil, fmt.Errorf("firecracker: the jailer runs only binaries whose name contains \"firecracker\", not %s", cfg.FirecrackerPath)
		}
		if cfg.UID <= 0 || cfg.GID <= 0 {
			return nil, fmt.Errorf("firecracker: the jailer needs an unprivileged uid and gid to run firecracker as (got %d:%d)", cfg.UID, cfg.GID)
		}
		switch cfg.CgroupVersion {
		case 0, 2:
			cfg.CgroupVersion = 2
		default:
			return nil, fmt.Errorf("firecracker: cgroup version %d is not supported (only 2: v1 slows snapshot restores)", cfg.CgroupVersion)
		}
		if cfg.ParentCgroup == "" {
			cfg.ParentCgroup = DefaultParentCgroup
		}
		if filepath.IsAbs(cfg.ParentCgroup) || !filepath.IsLocal(cfg.ParentCgroup) {
			return nil, fmt.Errorf("firecracker: parent cgroup %q must be a relative path", cfg.ParentCgroup)
		}
	}
	if cfg.KernelPath == "" {
		return nil, errors.New("firecracker: a guest kernel is required (a vmlinux, or a vmlinuz to extract it from)")
	}
	if cfg.KernelPath, err = filepath.Abs(cfg.KernelPath); err != nil {
		return nil, fmt.Errorf("firecracker: %w", err)
	}
	if cfg.ModulesDir == "" {
		base := filepath.Base(cfg.KernelPath)
		for _, prefix := range []string{"vmlinux-", "vmlinuz-"} {
			if ver, ok := strings.CutPrefix(base, prefix); ok {
				if d := filepath.Join("/lib/modules", ver); dirExists(d) {
					cfg.ModulesDir = d
				}
			}
		}
	}
	if cfg.RootDir == "" {
		cfg.RootDir = DefaultRootDir
	}
	if cfg.ChrootBaseDir == "" {
		cfg.ChrootBaseDir = filepath.Join(cfg.RootDir, "jail")
	}
	for _, p := range []*string{&cfg.RootDir, &cfg.ChrootBaseDir} {
		if !filepath.IsAbs(*p) {
			return nil, fmt.Errorf("firecracker: %q is not absolute", *p)
		}
		*p = filepath.Clean(*p)
	}
	logger := cfg.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	if err := os.MkdirAll(cfg.RootDir, 0o700); err != nil {
		return nil, fmt.Errorf("firecracker: %w", err)
	}
	kc := &kernelimage.Cache{Dir: filepath.Join(cfg.RootDir, kernelDir), Logger: logger.With("runtime", "firecracker")}
	boot, err := kc.ELF(context.Background(), cfg.KernelPath)
	if err != nil {
		return nil, fmt.Errorf("firecracker: kernel %s is not an uncompressed vmlinux (ELF), nor a compressed kernel space can unpack: %w", cfg.KernelPath, err)
	}
	if jailed {
		if err := readableBy(boot, cfg.UID, cfg.GID); err != nil {
			return nil, fmt.Errorf("firecracker: kernel: %w", err)
		}
	}
	// Without a modules directory (or modules.dep in it) the kernel is assumed to have
	// everything built in, as Firecracker's recommended guest configurations do.
	var modules []string
	if cfg.ModulesDir != "" {
		if modules, err = initramfs.ResolveModules(cfg.ModulesDir, guestModules(), nil); err != nil {
			return nil, fmt.Errorf("firecracker: %w", err)
		}
	}
	ver, err := binaryVersion(cfg.FirecrackerPath, "Firecracker v")
	if err != nil {
		return nil, fmt.Errorf("firecracker: %w", err)
	}
	r := &Runtime{
		cfg:      cfg,
		log:      logger.With("runtime", "firecracker"),
		jailed:   jailed,
		execName: filepath.Base(cfg.FirecrackerPath),
		version:  ver,
		locks:    map[string]chan struct{}{},
		kernel:   boot,
	}
	// Initramfs images are keyed by the agent's content and the modules' identity (not
	// the kernel's); each jail holds a hard link or copy of its image. They are readable
	// by everyone: the jailed firecracker opens them as the jailer user.
	r.initrds = &initramfs.Cache{
		Dir:           filepath.Join(cfg.RootDir, initramfsDir),
		Modules:       modules,
		WorldReadable: true,
		Logger:        r.log,
	}
	if jailed {
		jv, err := binaryVersion(cfg.JailerPath, "Jailer v")
		if err != nil {
			return nil, fmt.Errorf("firecracker: %w", err)
		}
		if jv != ver {
			return nil, fmt.Errorf("firecracker: jailer %s is %s but firecracker is %s: use both binaries of one release", cfg.JailerPath, jv, ver)
		}
		if r.cgroupRoot = cfg.CgroupRoot; r.cgroupRoot == "" {
			if r.cgroupRoot, err = cgroup2Mount(); err != nil {
				return nil, fmt.Errorf("firecracker: %w", err)
			}
		}
		if err := prepareParentCgroup(r.cgroupRoot, cfg.ParentCgroup); err != nil {
			return nil, fmt.Errorf("firecracker: %w", err)
		}
	}
	for _, d := range []string{cfg.RootDir, cfg.ChrootBaseDir} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, fmt.Errorf("firecracker: %w", err)
		}
	}
	key := sha256.Sum256([]byte(cfg.RootDir))
	r.rootKey = hex.EncodeToString(key[:4])
	if !ver.atLeast(1, 13) {
		r.log.Warn("firecracker before 1.13: snapshots are not generally available", "version", ver)
	} else if ver.major == 1 && ver.minor == 16 && ver.patch == 0 {
		r.log.Warn("firecracker 1.16.0 can leave vsock silent after a restore: use 1.16.1 or later", "version", ver)
	}
	r.log.Info("firecracker runtime", "version", ver, "jailer", jailed, "kernel", cfg.KernelPath, "boot", boot,
		"modules", len(modules), "chroot_base", cfg.ChrootBaseDir, "cgroup", r.cgroupRoot)
	return r, nil
}

// findBinary returns the absolute path of p, or of name on PATH when p is empty.
func findBinary(p, name string) (string, error) {
	if p == "" {
		found, err := exec.LookPath(name)
		if err != nil {
			return "", fmt.Errorf("%s not found on PATH: %w", name, err)
		}
		p = found
	}
	abs, err := filepath.Abs(p)
	if err != nil {
		return "", err
	}
	fi, err := os.Stat(abs)
	if err != nil {
		return "", err
	}
	if !fi.Mode().IsRegular() || fi.Mode().Perm()&0o111 == 0 {
		return "", fmt.Errorf("%s is not an executable file", abs)
	}
	return abs, nil
}

// binaryVersion runs "bin --version" and parses the first line, "<prefix>X.Y.Z".
func binaryVersion(bin, prefix string) (version, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, bin, "--version").Output()
	if err != nil {
		return version{}, fmt.Errorf("%s --version: %w", bin, err)
	}
	first, _, _ := strings.Cut(string(out), "\n")
	v, ok := strings.CutPrefix(strings.TrimSpace(first), prefix)
	if !ok {
		return version{}, fmt.Errorf("%s --version: unexpected output %q", bin, first)
	}
	return parseVersion(v)
}

// readableBy checks that p's permission bits let uid or gid read it (the jail holds a
// hard link to it, so only the file's own bits matter to the jailed process).
func readableBy(p string, uid, gid int) error {
	check := func(p string, want uint32) error {
		var st syscall.Stat_t
		if err := syscall.Stat(p, &st); err != nil {
			return err
		}
		bits := st.Mode & 7
		switch {
		case int(st.Uid) == uid:
			bits = st.Mode >> 6 & 7
		case int(st.Gid) == gid:
			bits = st.Mode >> 3 & 7
		}
		if bits&want != want {
			return fmt.Errorf("%s is not accessible to uid %d gid %d (mode %o)", p, uid, gid, st.Mode&0o777)
		}
		return nil
	}
	if err := check(p, 4); err != nil {
		return fmt.Errorf("%w: the jailed firecracker opens it through a hard link; make it world-readable", err)
	}
	return nil
}

func dirExists(p string) bool {
	fi, err := os.Stat(p)
	return err == nil && fi.IsDir()
}

// cgroup2Mount returns the mount point of the first cgroup2 file system in /proc/mounts.
func cgroup2Mount() (string, error) {
	f, err := os.Open("/proc/mounts")
	if err != nil {
		return "", err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) >= 3 && fields[2] == "cgroup2" {
			return fields[1], nil
		}
	}
	if err := sc.Err(); err != nil {
		return "", err
	}
	return "", errors.New("no cgroup2 file system mounted (the jailer needs cgroup v2)")
}

// prepareParentCgroup creates the parent cgroup and enables the cpu and memory
// controllers from the root down to it, so that each VM's cgroup has cpu.max and
// memory.max.
func prepareParentCgroup(root, parent string) error {
	data, err := os.ReadFile(filepath.Join(root, "cgroup.controllers"))
	if err != nil {
		return fmt.Errorf("cgroup v2 root %s: %w", root, err)
	}
	avail := strings.Fields(string(data))
	for _, c := range []string{"cpu", "memory"} {
		if !slices.Contains(avail, c) {
			return fmt.Errorf("cgroup v2 root %s lacks the %s controller", root, c)
		}
	}
	dir := root
	for _, part := range append([]string{""}, strings.Split(filepath.Clean(parent), "/")...) {
		if part != "" {
			dir = filepath.Join(dir, part)
			if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
				return fmt.Errorf("create cgroup %s: %w", dir, err)
			}
		}
		ctl := filepath.Join(dir, "cgroup.subtree_control")
		have, _ := os.ReadFile(ctl)
		if fields := strings.Fields(string(have)); slices.Contains(fields, "cpu") && slices.Contains(fields, "memory") {
			continue
		}
		if err := os.WriteFile(ctl, []byte("+cpu +memory"), 0o644); err != nil {
			return fmt.Errorf("enable cpu and memory controllers in %s: %w", dir, err)
		}
	}
	return nil
}

// Info reports Firecracker's version and how VMs are run.
func (r *Runtime) Info(ctx context.Context) (runtime.Info, error) {
	d := map[string]string{
		"jailer":      "off",
		"kernel":      r.cfg.KernelPath,
		"transport":   "hybrid vsock",
		"vsock_port":  strconv.Itoa(AgentVsockPort),
		"chroot_base": r.cfg.ChrootBaseDir,
		"kernel_boot": "vmlinux " + r.kernel,
		// vsock connections do not survive a snapshot, the agent's listener does: after
		// a restore the node dials again and hands the identity over the API.
	}
	if r.jailed {
		d["jailer"] = "on"
		d["jailer_user"] = fmt.Sprintf("%d:%d", r.cfg.UID, r.cfg.GID)
		d["cgroup"] = filepath.Join(r.cgroupRoot, r.cfg.ParentCgroup)
	}
	return runtime.Info{Name: "firecracker", Disk: runtime.DiskExt4, Version: r.version.String(),
		Caps: runtime.Caps{AgentResume: runtime.ResumeByAPI}, Details: d}, nil
}

// machine is the VM's configuration; Checkpoint saves it with the snapshot.
type machine struct {
	CPU      int    `json:"cpu"`
	MemoryMB int    `json:"memory_mb"`
	BootArgs string `json:"boot_args"`
	Network  bool   `json:"network,omitempty"`
}

// maxCmdline leaves room under the x86 kernel's 2048-byte command line for what
// Firecracker appends (root device, virtio-mmio devices).
const maxCmdline = 1800

// bootArgs is the guest kernel's command line: console on the serial port, a reboot or
// panic ends the VM (Firecracker exits on the guest's reboot), the space VM flag and the
// agent's environment with its vsock listen address (see package vmboot).
func bootArgs(agentEnv map[string]string) (string, error) {
	env := map[string]string{}
	for k, v := range agentEnv {
		env[k] = v
	}
	env["SPACE_AGENT_LISTEN"] = "vsock:" + strconv.Itoa(AgentVsockPort)
	envArg, err := vmboot.EncodeEnv(env)
	if err != nil {
		return "", err
	}
	s := strings.Join([]string{
		"console=ttyS0", "reboot=k", "panic=1", "pci=off", vmboot.VMFlag, "quiet",
		// No PS/2 controller to probe beyond what SendCtrlAltDel needs.
		"i8042.noaux", "i8042.nomux", "i8042.dumbkbd",
		envArg,
	}, " ")
	if len(s) > maxCmdline {
		return "", fmt.Errorf("kernel command line too long (%d bytes): agent environment too large", len(s))
	}
	return s, nil
}

// lock takes the instance's lifecycle lock, waiting at most until ctx is done.
func (r *Runtime) lock(ctx context.Context, id string) (func(), error) {
	r.mu.Lock()
	l := r.locks[id]
	if l == nil {
		l = make(chan struct{}, 1)
		r.locks[id] = l
	}
	r.mu.Unlock()
	select {
	case l <- struct{}{}:
		return func() { <-l }, nil
	case <-ctx.Done():
		return nil, fmt.Errorf("instance %s busy: %w", id, ctx.Err())
	}
}

// Create boots a VM from spec.RootFS (an ext4 image) with the agent. It returns once
// Firecracker accepted InstanceStart, before the guest has booted; Dial waits for the
// agent. On error everything it created is removed.
func (r *Runtime) Create(ctx context.Context, spec runtime.Spec) error {
	spec, err := r.checkSpec(spec)
	if err != nil {
		return fmt.Errorf("firecracker create: %w", err)
	}
	unlock, err := r.lock(ctx, spec.ID)
	if err != nil {
		return fmt.Errorf("firecracker create %s: %w", spec.ID, err)
	}
	defer unlock()
	initrd, err := r.initrds.Build(ctx, spec.AgentPath)
	if err != nil {
		return fmt.Errorf("firecracker create %s: %w", spec.ID, err)
	}
	args, err := bootArgs(spec.AgentEnv)
	if err != nil {
		return fmt.Errorf("firecracker create %s: %w", spec.ID, err)
	}
	m := machine{CPU: spec.CPU, MemoryMB: spec.MemoryMB, BootArgs: args, Network: spec.Network}
	if err := r.launch(ctx, spec, m, initrd, nil); err != nil {
		return fmt.Errorf("firecracker create %s: %w", spec.ID, err)
	}
	return nil
}

// launch claims the instance's record, lays out its jail, starts firecracker and then
// boots the VM or, with a checkpoint, loads it. On error it removes everything it made.
func (r *Runtime) launch(ctx context.Context, spec runtime.Spec, m machine, initrd string, cp *checkpoint) (err error) {
	rec, err := r.newRecord(specFiles{ID: spec.ID, RootFS: spec.RootFS, StateDir: spec.StateDir}, m)
	if err != nil {
		return err
	}
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
	if err := r.prepareJail(rec, initrd); err != nil {
		return err
	}
	if cp != nil {
		if err := r.placeCheckpoint(rec, cp.dir); err != nil {
			return err
		}
	}
	pid, startTime, err := r.start(ctx, rec, spec.NetNS)
	if pid > 0 {
		rec.PID, rec.StartTime = pid, startTime
		if uerr := r.updateRecord(rec); uerr != nil && err == nil {
			err = uerr
		}
	}
	if err != nil {
		return err
	}
	started := time.Since(start)
	api := newAPIClient(filepath.Join(rec.chroot(), apiSocket))
	v, err := api.version(ctx)
	if err != nil {
		return err
	}
	if v != r.version {
		r.log.WarnContext(ctx, "firecracker's API reports another version than its binary did", "api", v, "binary", r.version)
	}
	rec.Version = v.String()
	if err := r.updateRecord(rec); err != nil {
		return err
	}
	if cp == nil {
		if err := r.boot(ctx, api, m); err != nil {
			return err
		}
		r.log.InfoContext(ctx, "vm started", "id", spec.ID, "pid", pid, "process_start", started, "duration", time.Since(start))
		return nil
	}
	if err := r.load(ctx, api, v, cp.meta, spec); err != nil {
		return err
	}
	r.log.InfoContext(ctx, "vm restored", "id", spec.ID, "pid", pid, "process_start", started, "duration", time.Since(start))
	return nil
}

// boot configures the VM (boot source, root drive, machine, network, vsock) and starts it.
func (r *Runtime) boot(ctx context.Context, api *apiClient, m machine) error {
	steps := []struct {
		path string
		body any
	}{
		{"/boot-source", bootSource{KernelImagePath: kernelName, InitrdPath: initrdName, BootArgs: m.BootArgs}},
		// Writeback: the guest's flushes reach the disk file (as with QEMU's
		// cache=writeback); Firecracker's default ignores them.
		{"/drives/rootfs", drive{DriveID: "rootfs", PathOnHost: diskName, IsRootDevice: true, IsReadOnly: ptr(false), CacheType: ptr("Writeback")}},
		{"/machine-config", machineConfig{VcpuCount: m.CPU, MemSizeMib: m.MemoryMB, Smt: ptr(false)}},
	}
	if m.Network {
		steps = append(steps, struct {
			path string
			body any
		}{"/network-interfaces/eth0", networkInterface{IfaceID: "eth0", HostDevName: TapName, GuestMAC: GuestMAC}})
	}
	steps = append(steps, []struct {
		path string
		body any
	}{
		{"/vsock", vsockDevice{GuestCID: GuestCID, UDSPath: vsockSocket}},
		{"/actions", instanceAction{ActionType: "InstanceStart"}},
	}...)
	for _, s := range steps {
		if err := api.put(ctx, s.path, s.body); err != nil {
			return err
		}
	}
	return nil
}

// Dial opens a stream to the instance's agent through the hybrid vsock socket. While the
// guest boots or right after a restore nothing listens yet and Firecracker closes the
// connection: Dial tries again until the agent answers or ctx is done.
func (r *Runtime) Dial(ctx context.Context, id string) (net.Conn, error) {
	if !validID(id) {
		return nil, fmt.Errorf("firecracker dial: invalid id %q", id)
	}
	rec, err := r.findInstance(id)
	if err != nil {
		return nil, fmt.Errorf("firecracker dial %s: %w", id, err)
	}
	sock := filepath.Join(rec.chroot(), vsockSocket)
	delay := 5 * time.Millisecond
	for {
		if r.instancePID(id, &rec) == 0 {
			return nil, fmt.Errorf("firecracker dial %s: instance is not running", id)
		}
		c, err := dialVsock(ctx, sock, AgentVsockPort)
		if err == nil {
			return c, nil
		}
		t := time.NewTimer(delay)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, fmt.Errorf("firecracker dial %s: %w (last error: %v)", id, ctx.Err(), err)
		case <-t.C:
		}
		delay = min(delay*2, 100*time.Millisecond)
	}
}

// Status reports the instance's status: from the API while firecracker runs; stopped
// when only its record is left (it crashed, the guest rebooted, or it was checkpointed).
func (r *Runtime) Status(ctx context.Context, id string) (runtime.Status, error) {
	if !validID(id) {
		return "", fmt.Errorf("firecracker status: invalid id %q", id)
	}
	unlock, err := r.lock(ctx, id)
	if err != nil {
		return "", fmt.Errorf("firecracker status %s: %w", id, err)
	}
	defer unlock()
	st, err := r.status(ctx, id)
	if err != nil {
		return "", fmt.Errorf("firecracker status %s: %w", id, err)
	}
	return st, nil
}

func (r *Runtime) status(ctx context.Context, id string) (runtime.Status, error) {
	rec, err := r.findInstance(id)
	if err != nil {
		return "", err
	}
	if r.instancePID(id, &rec) == 0 {
		return runtime.StatusStopped, nil
	}
	actx, cancel := context.WithTimeout(ctx, apiTimeout)
	defer cancel()
	info, err := newAPIClient(filepath.Join(rec.chroot(), apiSocket)).instance(actx)
	if err != nil {
		if r.instancePID(id, &rec) == 0 {
			return runtime.StatusStopped, nil // exited meanwhile
		}
		return "", err
	}
	switch info.State {
	case stateRunning:
		return runtime.StatusRunning, nil
	case statePaused:
		return runtime.StatusPaused, nil
	default: // Not started: a firecracker that was never configured (an interrupted start)
		return runtime.StatusStopped, nil
	}
}

// findInstance returns the instance's record or, for a firecracker of this runtime that
// lost its record (a wiped root dir), one rebuilt from /proc. runtime.ErrNotFound when
// there is neither.
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
	jid := r.jailID(id)
	rec = record{ID: id, JailID: jid, PID: pid, StartTime: pi.StartTime, Jailed: r.jailed}
	if d := filepath.Join(r.cfg.ChrootBaseDir, r.execName, jid); dirExists(d) {
		rec.JailDir = d
	}
	if r.jailed {
		rec.Cgroup = filepath.Join(r.cgroupRoot, r.cfg.ParentCgroup, jid)
	}
	if out, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/1", pid)); err == nil && filepath.Base(out) == logFile {
		rec.StateDir = filepath.Dir(out)
	}
	return rec, nil
}

// List reports every instance with a record or a firecracker process, sorted by id.
func (r *Runtime) List(ctx context.Context) ([]runtime.Instance, error) {
	ids, err := r.recordIDs()
	if err != nil {
		return nil, fmt.Errorf("firecracker list: %w", err)
	}
	out, err := instances.List(ctx, append(ids, r.orphanIDs()...), r.Status)
	if err != nil {
		return nil, fmt.Errorf("firecracker list: %w", err)
	}
	return out, nil
}

// Adopt re-attaches to an instance that survived a node restart: its firecracker must
// still run for spec.StateDir. A lost record is rewritten (with spec's disk).
func (r *Runtime) Adopt(ctx context.Context, spec runtime.Spec) error {
	if !validID(spec.ID) {
		return fmt.Errorf("firecracker adopt: invalid id %q", spec.ID)
	}
	unlock, err := r.lock(ctx, spec.ID)
	if err != nil {
		return fmt.Errorf("firecracker adopt %s: %w", spec.ID, err)
	}
	defer unlock()
	rec, err := r.findInstance(spec.ID)
	if err != nil {
		return fmt.Errorf("firecracker adopt %s: %w", spec.ID, err)
	}
	pid := r.instancePID(spec.ID, &rec)
	if pid == 0 {
		return fmt.Errorf("firecracker adopt %s: instance is stopped", spec.ID)
	}
	if rec.StateDir != "" && filepath.Clean(rec.StateDir) != filepath.Clean(spec.StateDir) {
		return fmt.Errorf("firecracker adopt %s: runs for %s, not %s", spec.ID, rec.StateDir, spec.StateDir)
	}
	if rec.JailDir == "" {
		return fmt.Errorf("firecracker adopt %s: its jail is unknown (record lost and not under %s)", spec.ID, r.cfg.ChrootBaseDir)
	}
	if _, rerr := r.readRecord(spec.ID); rerr != nil || rec.PID != pid {
		pi, err := instances.ReadProc(pid)
		if err != nil {
			return fmt.Errorf("firecracker adopt %s: %w", spec.ID, err)
		}
		rec.PID, rec.StartTime, rec.StateDir = pid, pi.StartTime, spec.StateDir
		if rec.RootFS == "" {
			rec.RootFS = spec.RootFS
		}
		if rec.CreatedAt.IsZero() {
			rec.CreatedAt = time.Now().UTC()
		}
		if err := r.updateRecord(rec); err != nil {
			return fmt.Errorf("firecracker adopt %s: %w", spec.ID, err)
		}
	}
	return nil
}

// Destroy kills the instance's firecracker and removes its jail, cgroup, StateDir files
// and record. It succeeds when the instance does not exist. It never touches the disk
// beyond unlinking the jail's hard link to it.
func (r *Runtime) Destroy(ctx context.Context, id string) error {
	if !validID(id) {
		return fmt.Errorf("firecracker destroy: invalid id %q", id)
	}
	ctx, cancel := context.WithTimeout(ctx, destroyTimeout)
	defer cancel()
	unlock, err := r.lock(ctx, id)
	if err != nil {
		return fmt.Errorf("firecracker destroy %s: %w", id, err)
	}
	defer unlock()
	if err := r.destroy(ctx, id); err != nil {
		return fmt.Errorf("firecracker destroy %s: %w", id, err)
	}
	return nil
}

// destroy tears the instance down; the caller holds its lock. On failure the record
// stays, so that a retry finds everything again.
func (r *Runtime) destroy(ctx context.Context, id string) error {
	rec, err := r.findInstance(id)
	if errors.Is(err, runtime.ErrNotFound) {
		return nil
	}
	if err != nil {
		return err
	}
	// More than one process can carry the jail id (a start that lost its record, then
	// another): stop them all.
	for range 8 {
		pid := r.instancePID(id, &rec)
		if pid == 0 {
			break
		}
		pi, err := instances.ReadProc(pid)
		if err == nil {
			kctx, cancel := context.WithTimeout(ctx, killTimeout)
			err = kill(kctx, pid, pi.StartTime)
			cancel()
			if err != nil {
				return err
			}
		}
		rec.PID = 0
	}
	var errs []error
	if err := removeJail(rec); err != nil {
		errs = append(errs, err)
	}
	if rec.Cgroup != "" {
		if filepath.Base(rec.Cgroup) != rec.JailID || !strings.HasPrefix(rec.Cgroup, r.cgroupRoot+"/") {
			errs = append(errs, fmt.Errorf("record names cgroup %q, not one of %s", rec.Cgroup, rec.JailID))
		} else if err := removeCgroup(ctx, rec.Cgroup); err != nil {
			errs = append(errs, err)
		}
	}
	if rec.StateDir != "" {
		if err := os.Remove(filepath.Join(rec.StateDir, logFile)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	if err := r.removeRecord(id); err != nil {
		return err
	}
	r.log.DebugContext(ctx, "vm destroyed", "id", id)
	return nil
}

// validID reports whether id is a sandbox id this runtime can run: lowercase
// alphanumerics, short enough that the jail id (root key, "-", id) fits the jailer's 64.
func validID(id string) bool {
	if id == "" || len(id) > 55 {
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
		return spec, fmt.Errorf("invalid id %q (want at most 55 lowercase alphanumerics)", spec.ID)
	}
	if spec.Network {
		// A network needs a TAP device (TapName) in a namespace the node prepared, which
		// the jailer enters. Without one there is nothing to attach.
		if spec.NetNS == "" {
			return spec, fmt.Errorf("network without a network namespace: %w", runtime.ErrUnsupported)
		}
		if !r.jailed {
			return spec, fmt.Errorf("network without the jailer (it enters the namespace): %w", runtime.ErrUnsupported)
		}
	}
	if !spec.Network {
		spec.NetNS = "" // only with Network (runtime.Spec)
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
	if spec.CPU > 32 {
		return spec, fmt.Errorf("%d vCPUs: Firecracker runs at most 32", spec.CPU)
	}
	return spec, nil
}
