// Package gvisor implements runtime.Runtime with gVisor's runsc. Each sandbox is one runsc
// container whose PID 1 is the space agent; the agent listens on a unix socket in a host
// directory (<StateDir>/run, a small tmpfs) bind-mounted into the sandbox at
// wire.RunMountDir.
//
// The package owns the OCI bundle it writes into the instance's StateDir, the host mounts
// it makes for the instance (mounts.go), every runsc invocation, runsc's root dir
// (Config.RootDir) and a small per-instance record kept under it, through which an
// instance is found again from its id alone after a node restart. The sandbox runs in a
// user namespace (Config.UIDBase), under a pids limit (bundle.go) and with its output in
// a capped, rotated log (logs.go). runsc cannot checkpoint a sandbox that holds a bound
// host socket, so the agent closes its socket before a checkpoint and resumes from a
// file (runtime.ResumeByFile).
package gvisor

import (
	"bytes"
	"context"
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

	"golang.org/x/sync/singleflight"
	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/guest/wire"
	"github.com/spacedev/space/internal/runtime"
)

// Config configures the gVisor runtime.
type Config struct {
	// RunscPath is the runsc binary; empty means DefaultRunscPath, the pinned release
	// scripts/setup.sh builds. Another runsc (e.g. Debian's 2022 package) must be named
	// explicitly, and may need Platform "ptrace".
	RunscPath string
	// RootDir is runsc's --root state directory, private to this runtime. The default,
	// /run/space/runsc, is on tmpfs: runsc containers do not survive a host reboot and
	// neither should their state.
	RootDir string
	// Platform is runsc's --platform (default systrap: seccomp-trapped system calls, no
	// KVM needed, several times faster than ptrace).
	Platform string
	// CgroupParent is the cgroup under which each sandbox gets its own (<parent>/<id>);
	// default /space. A relative path is taken relative to runsc's own cgroups. Hosts where
	// runsc may not manage cgroups can pass --ignore-cgroups in ExtraFlags (and lose the
	// CPU and memory limits).
	CgroupParent string
	// UIDBase is the first host uid (and gid) of the sandboxes' user namespace: a
	// sandbox's uid N is host uid UIDBase+N (N < UserNSSize), so the Sentry, the gofer and
	// the platform's processes run as host uid UIDBase, not root. 0 means DefaultUIDBase.
	// The range must be used by nothing else on the host. Needs id-mapped mounts (Linux
	// 6.3+ for the tmpfs of the run directory) and RootDir searchable by that uid.
	UIDBase uint32
	// NoUserNS runs sandboxes without the user namespace: the Sentry and the gofer run
	// as host root (in a namespace runsc makes, which maps ids one to one).
	NoUserNS bool
	// ExtraFlags are global runsc flags added to every invocation (e.g. --debug-log=DIR/).
	ExtraFlags []string
	// CommandTimeout bounds each runsc invocation (default 30s).
	CommandTimeout time.Duration
	// Logger receives a debug record of every runsc invocation (default: discard).
	Logger *slog.Logger
}

// Defaults of Config.
const (
	DefaultRunscPath      = "/usr/local/lib/space/runsc"
	DefaultRootDir        = "/run/space/runsc"
	DefaultPlatform       = "systrap"
	DefaultCgroupParent   = "/space"
	DefaultCommandTimeout = 30 * time.Second
	// DefaultUIDBase is 0x70000000: above the ranges systemd hands to containers
	// (524288…1879048191) and below 2^31, in a range systemd documents as unused.
	DefaultUIDBase uint32 = 0x70000000
)

// cleanupTimeout bounds the undo of a failed Create. It is long because the sandbox's
// processes are reaped by whoever inherited them, which can take seconds.
const cleanupTimeout = 30 * time.Second

// procsGrace is how long Destroy lets runsc stop the sandbox's host processes before
// killing leftovers itself; procsTimeout is how long it waits for them in total.
const (
	procsGrace   = 5 * time.Second
	procsTimeout = 15 * time.Second
)

// Runtime runs sandboxes with runsc. It is safe for concurrent use; it keeps no state in
// memory, so a new Runtime over the same RootDir sees every instance of an old one.
type Runtime struct {
	cfg     Config
	log     *slog.Logger
	version string // of runsc, from `runsc --version`
	// guestPids says runsc can hold the pids limit inside the sandbox (it has
	// --in-sandbox-cgroup, and cgroup v2 inside, whose limits write-control can set).
	// Older releases (Debian's 2022 runsc) only get the host limit.
	guestPids bool
	// allowSUID says runsc honours setuid bits inside the sandbox (--allow-suid; off
	// by default since 2023, absent from older releases).
	allowSUID bool
	userns    *os.File // the user namespace of the id-mapped views; nil with NoUserNS
	stop      context.CancelFunc
	statuses  statusCache
	// lists shares one runsc list among the lookups of ids without a record that
	// overlap (unrecorded): a batch of clones starts them together.
	lists singleflight.Group
	// cpuFiles is each running instance's host cgroup CPU counter file (CPUTime).
	cpuFiles sync.Map
	// cgroupMounts are the host's cgroup hierarchies (cgroupRoots), read once;
	// memoryMount is the one with the memory controller ("" if none), whose limit file
	// is memoryLimitFileName.
	cgroupOnce          sync.Once
	cgroupMounts        []string
	memoryMount         string
	memoryLimitFileName string

	// links are the agents' transports by instance id (link.go).
	links links
	// agentListens starts new instances as before 2026-12-06: the agent listens on its
	// run directory and runsc runs with --host-uds=create. Tests set it, for the path
	// that adopted instances and older checkpoints still take.
	agentListens bool
}

var _ runtime.Runtime = (*Runtime)(nil)

// New checks the configuration, finds runsc, creates the root dir and starts the log
// rotation; Close stops it.
func New(cfg Config) (*Runtime, error) {
	if cfg.RunscPath == "" {
		cfg.RunscPath = DefaultRunscPath
		if _, err := os.Stat(cfg.RunscPath); err != nil {
			return nil, fmt.Errorf("gvisor: runsc not found at %s (scripts/setup.sh builds it; or name another runsc): %w", cfg.RunscPath, err)
		}
	} else if _, err := os.Stat(cfg.RunscPath); err != nil {
		return nil, fmt.Errorf("gvisor: runsc: %w", err)
	}
	if cfg.RootDir == "" {
		cfg.RootDir = DefaultRootDir
	}
	if !filepath.IsAbs(cfg.RootDir) {
		return nil, fmt.Errorf("gvisor: root dir %q is not absolute", cfg.RootDir)
	}
	cfg.RootDir = filepath.Clean(cfg.RootDir)
	if cfg.Platform == "" {
		cfg.Platform = DefaultPlatform
	}
	if cfg.CgroupParent == "" {
		cfg.CgroupParent = DefaultCgroupParent
	}
	if cfg.CommandTimeout <= 0 {
		cfg.CommandTimeout = DefaultCommandTimeout
	}
	if cfg.UIDBase == 0 {
		cfg.UIDBase = DefaultUIDBase
	}
	if uint64(cfg.UIDBase)+UserNSSize > 1<<32-1 {
		return nil, fmt.Errorf("gvisor: uid base %d leaves no room for %d ids", cfg.UIDBase, UserNSSize)
	}
	cfg.ExtraFlags = slices.Clone(cfg.ExtraFlags)
	logger := cfg.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	r := &Runtime{cfg: cfg, log: logger.With("runtime", "gvisor"), agentListens: agentListensForTests()}
	ctx, cancel := context.WithTimeout(context.Background(), cfg.CommandTimeout)
	defer cancel()
	out, err := r.exec(ctx, []string{"--version"})
	if err != nil {
		return nil, fmt.Errorf("gvisor: %s does not run: %w", cfg.RunscPath, err)
	}
	r.version = parseVersion(string(out))
	// `runsc flags` describes the flags this release knows, on stderr.
	flags, err := exec.CommandContext(ctx, cfg.RunscPath, "flags").CombinedOutput()
	if err != nil {
		return nil, fmt.Errorf("gvisor: %s flags: %w: %s", cfg.RunscPath, err, flags)
	}
	r.guestPids = bytes.Contains(flags, []byte("-in-sandbox-cgroup"))
	r.allowSUID = bytes.Contains(flags, []byte("-allow-suid"))
	// Releases without directfs (2022 and older) neither run the sandbox in the spec's
	// user namespace nor open bind-mount sources the namespace cannot reach for it.
	if !cfg.NoUserNS && !bytes.Contains(flags, []byte("-directfs")) {
		return nil, fmt.Errorf("gvisor: runsc %s cannot run sandboxes in a user namespace; run without it (space serve --runsc-userns=false)", r.version)
	}
	if err := r.makeRootDir(); err != nil {
		return nil, err
	}
	if !cfg.NoUserNS {
		if r.userns, err = newUserNS(cfg.UIDBase); err != nil {
			return nil, fmt.Errorf("gvisor: %w", err)
		}
	}
	bg, stop := context.WithCancel(context.Background())
	r.stop = stop
	go r.rotateLogs(bg)
	return r, nil
}

// makeRootDir creates the root dir and the directory of the id-mapped views in it. With
// the user namespace, the sandboxes' uid must reach those views: the root dir is then
// searchable by everyone (0711, as runsc makes its own), but not listable; runsc's state
// files in it are not readable by others (0640).
func (r *Runtime) makeRootDir() error {
	mode := os.FileMode(0o700)
	if !r.cfg.NoUserNS {
		mode = 0o711
	}
	for _, dir := range []string{r.cfg.RootDir, filepath.Join(r.cfg.RootDir, mountsDir)} {
		if err := os.MkdirAll(dir, mode); err != nil {
			return fmt.Errorf("gvisor: create root dir: %w", err)
		}
		if err := os.Chmod(dir, mode); err != nil {
			return fmt.Errorf("gvisor: root dir: %w", err)
		}
	}
	if !r.cfg.NoUserNS {
		if err := searchable(filepath.Join(r.cfg.RootDir, mountsDir), r.cfg.UIDBase); err != nil {
			return fmt.Errorf("gvisor: root dir: %w", err)
		}
	}
	return nil
}

// Close stops the log rotation and releases the user namespace. Sandboxes keep running.
func (r *Runtime) Close() error {
	r.stop()
	r.links.closeAll()
	if r.userns != nil {
		return r.userns.Close()
	}
	return nil
}

// parseVersion takes the version out of `runsc --version`'s output ("runsc version V\n
// spec: S\n").
func parseVersion(out string) string {
	first, _, _ := strings.Cut(out, "\n")
	return strings.TrimSpace(strings.TrimPrefix(first, "runsc version"))
}

// Info reports runsc's version and the platform in use.
func (r *Runtime) Info(context.Context) (runtime.Info, error) {
	return runtime.Info{
		Name:    "gvisor",
		Disk:    runtime.DiskDir,
		Version: r.version,
		// The agent cannot hold a host socket across a checkpoint: after a restore it
		// learns its identity from a resume file in its run directory. runsc pause and
		// resume are a runsc process each (its start alone is most of the 30 ms each
		// takes here): warm-pool members wait running, and a claim resumes nothing.
		Caps: runtime.Caps{AgentResume: runtime.ResumeByFile, Network: runtime.NetworkNamespace, ParkRunning: true},
		Details: map[string]string{
			"platform":   r.cfg.Platform,
			"runsc":      r.cfg.RunscPath,
			"userns":     r.usernsInfo(),
			"pids_limit": r.pidsInfo(),
		},
	}, nil
}

// pidsInfo says where the pids limit holds for Info: "sandbox" (inside the Sentry, with
// the host limit) or "host" (the host cgroup only: older runsc releases).
func (r *Runtime) pidsInfo() string {
	if r.guestPids {
		return "sandbox"
	}
	return "host"
}

// usernsInfo describes the user namespace for Info: "UIDBase:size", or "off".
func (r *Runtime) usernsInfo() string {
	if r.cfg.NoUserNS {
		return "off"
	}
	return fmt.Sprintf("%d:%d", r.cfg.UIDBase, UserNSSize)
}

// Create writes the instance's OCI bundle into spec.StateDir, makes its host mounts and
// starts the sandbox detached, in its own session, so that it outlives the calling
// process. On error it removes everything it created.
func (r *Runtime) Create(ctx context.Context, spec runtime.Spec) (err error) {
	if err := validateSpec(spec); err != nil {
		return fmt.Errorf("gvisor create: %w", err)
	}
	// Known absent (destroyed, or seen without a record and not listed by runsc, and
	// not changed since): runsc need not be asked again below.
	absent := r.statuses.isGone(spec.ID)
	mem := layoutOf(spec)
	mem.AgentDials = !r.agentListens
	if err := r.claimRecord(record{ID: spec.ID, StateDir: spec.StateDir, Cgroup: spec.ID, PidsMax: r.pidsMax(spec), layout: mem}); err != nil {
		if errors.Is(err, fs.ErrExist) {
			return fmt.Errorf("gvisor create %s: instance already exists", spec.ID)
		}
		return fmt.Errorf("gvisor create %s: %w", spec.ID, err)
	}
	// Until runsc is known not to have this id, undoing means dropping the record only.
	owned := false
	var mountPoints []string
	defer func() {
		if err == nil {
			return
		}
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
		defer cancel()
		var uerr error
		if owned {
			uerr = r.destroy(cctx, spec.ID, spec.StateDir)
		} else {
			uerr = r.removeRecord(spec.ID)
		}
		removeMountPoints(spec.RootFS, mountPoints)
		if uerr != nil {
			r.log.ErrorContext(cctx, "undo failed create", "id", spec.ID, "err", uerr)
			err = errors.Join(err, fmt.Errorf("undo: %w", uerr))
		}
	}()

	if !absent {
		if _, err := r.state(ctx, spec.ID); err == nil {
			return fmt.Errorf("gvisor create %s: runsc already has a container with this id", spec.ID)
		} else if !errors.Is(err, runtime.ErrNotFound) {
			return fmt.Errorf("gvisor create %s: %w", spec.ID, err)
		}
	}
	owned = true
	if mountPoints, err = r.start(ctx, spec, spec.ID, mem, false, "run", "-detach", "-bundle", spec.StateDir, spec.ID); err != nil {
		return fmt.Errorf("gvisor create %s: %w", spec.ID, err)
	}
	return nil
}

// start makes the instance's host mounts, writes its bundle (with the memory file
// systems mem sizes), runs runsc's sub (run or restore) and sets the pids
// limit on the container's cgroup inside the Sentry, named cgroup, unless pidsSet (a
// restore whose checkpoint holds that limit already). A
// restore's bundle has no CPU quota, and every bundle has the guest's memory size as its
// limit: start sets the quota and raises the memory limit on the host cgroup once runsc
// has returned (limits.go). It returns the mount points it created in the rootfs. The
// caller undoes a failure with destroy.
func (r *Runtime) start(ctx context.Context, spec runtime.Spec, cgroup string, mem layout, pidsSet bool, sub ...string) (mountPoints []string, err error) {
	opts, err := r.prepareMounts(spec)
	if err != nil {
		return nil, err
	}
	opts.layout = mem
	if mem.AgentDials {
		// Before runsc: the agent connects as soon as it runs.
		if _, err := r.links.open(spec.ID, spec.StateDir, r.log, starting); err != nil {
			return nil, err
		}
	}
	if sub[0] == "restore" {
		// The restored agent waits for its resume file from its first instant; the
		// marker says so to a node that restarts before it writes one (node revive).
		if err := os.WriteFile(filepath.Join(spec.StateDir, runDir, wire.QuiescedFileName), nil, 0o600); err != nil {
			return nil, err
		}
	}
	if sub[0] == "run" && mem.RunMB > 0 {
		// A boot: the agent makes the template's directories in /run's tmpfs.
		if err := writeRunDirs(spec); err != nil {
			return nil, err
		}
	}
	cpuLater := sub[0] == "restore"
	opts.CPULater = cpuLater
	oci := bundleSpec(spec, opts)
	if mountPoints, err = makeMountPoints(spec.RootFS, oci.Mounts); err != nil {
		return nil, err
	}
	if err := writeBundle(spec.StateDir, oci); err != nil {
		return mountPoints, err
	}
	stopRaise := r.raiseMemoryAtStart(ctx, spec)
	err = r.run(ctx, spec, mem.AgentDials, sub...)
	raised := stopRaise()
	if err != nil {
		return mountPoints, err
	}
	r.statuses.startedClean(spec.ID)
	if !raised {
		if err := r.setMemoryLimit(spec); err != nil {
			return mountPoints, err
		}
	}
	if cpuLater {
		pid, err := readPidFile(spec.StateDir)
		if err != nil {
			return mountPoints, fmt.Errorf("sandbox process: %w", err)
		}
		if err := r.applyCPULimit(spec, pid); err != nil {
			return mountPoints, err
		}
	}
	if r.guestPids && !pidsSet {
		if err := r.limitTasks(ctx, spec, cgroup); err != nil {
			return mountPoints, err
		}
	}
	r.noteRunning(spec)
	return mountPoints, nil
}

// noteRunning tells the status cache what runsc would say now of an instance that run
// has just started (or restored) and whose runsc commands have all ended: running,
// with the sandbox process runsc wrote to its pid file. The node observes every
// instance right after starting it; this saves that observation its runsc state (a
// process, 10–25 ms, in every create, wake and clone). Without a readable pid file
// (an older runsc) the observation asks runsc, as before.
func (r *Runtime) noteRunning(spec runtime.Spec) {
	pid, err := readPidFile(spec.StateDir)
	if err != nil {
		return
	}
	r.statuses.put(spec.ID, containerState{ID: spec.ID, Status: "running", PID: pid, Bundle: spec.StateDir}, r.statuses.generation())
}

// pidFilePath is where run has runsc write the sandbox process's pid (on the log tmpfs,
// which only the host writes to).
func pidFilePath(stateDir string) string { return filepath.Join(stateDir, logDir, "sandbox.pid") }

// readPidFile reads the sandbox process's pid runsc wrote (pidFilePath).
func readPidFile(stateDir string) (int, error) {
	b, err := os.ReadFile(pidFilePath(stateDir))
	if err != nil {
		return 0, err
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pid <= 0 {
		return 0, fmt.Errorf("pid file: %q", b)
	}
	return pid, nil
}

// pidsMax is the pids limit start sets inside the Sentry for spec (0 when this runsc
// holds none there).
func (r *Runtime) pidsMax(spec runtime.Spec) int64 {
	if !r.guestPids {
		return 0
	}
	return guestPidsLimit(spec)
}

// prepareMounts makes the instance's host mounts (see mounts.go) and returns the bundle
// options that name them.
func (r *Runtime) prepareMounts(spec runtime.Spec) (bundleOptions, error) {
	opts := bundleOptions{
		NetNS:       spec.NetNS,
		CgroupsPath: r.cgroupsPath(spec.ID),
		GuestPids:   r.guestPids,
		RootPath:    spec.RootFS,
		RunSource:   filepath.Join(spec.StateDir, runDir),
	}
	for dir, size := range map[string]int64{opts.RunSource: runTmpfsSize, filepath.Join(spec.StateDir, logDir): logTmpfsSize} {
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return opts, err
		}
		if err := mountTmpfs(dir, size); err != nil {
			return opts, err
		}
	}
	if r.cfg.NoUserNS {
		return opts, nil
	}
	views := r.mountDir(spec.ID)
	if err := os.Mkdir(views, 0o711); err != nil {
		return opts, err
	}
	for _, v := range []struct {
		src, name string
		noexec    bool
	}{{spec.RootFS, rootfsMount, false}, {opts.RunSource, runDir, true}} {
		dst := filepath.Join(views, v.name)
		if err := os.Mkdir(dst, 0o700); err != nil {
			return opts, err
		}
		if err := idmapBind(v.src, dst, r.userns, v.noexec); err != nil {
			return opts, err
		}
	}
	opts.RootPath = filepath.Join(views, rootfsMount)
	opts.RunSource = filepath.Join(views, runDir)
	opts.UIDBase = r.cfg.UIDBase
	return opts, nil
}

// releaseMounts undoes prepareMounts (views first: they hold the run tmpfs). stateDir
// may be empty when unknown.
func (r *Runtime) releaseMounts(id, stateDir string) error {
	views := r.mountDir(id)
	dirs := []string{filepath.Join(views, rootfsMount), filepath.Join(views, runDir), views}
	if stateDir != "" {
		dirs = append(dirs, filepath.Join(stateDir, runDir), filepath.Join(stateDir, logDir))
	}
	var errs []error
	for _, d := range dirs {
		if err := unmountAll(d); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// limitTasks sets the pids limit of the container's cgroup inside the Sentry, named
// cgroup (see hostPidsFactor). The agent is the only task until the node asks it for
// more, which happens after Create or Restore returns.
func (r *Runtime) limitTasks(ctx context.Context, spec runtime.Spec, cgroup string) error {
	out, err := r.runsc(ctx, "write-control", spec.ID, "pids", "/"+cgroup, "pids.max", strconv.FormatInt(guestPidsLimit(spec), 10))
	if err != nil {
		return fmt.Errorf("set the sandbox's pids limit: %w: %s", err, bytes.TrimSpace(out))
	}
	return nil
}

// cgroupsPath is the instance's linux.cgroupsPath; runsc creates the cgroup (v1 or v2)
// and removes it on delete, and destroy removes what runsc leaves (removeCgroup).
func (r *Runtime) cgroupsPath(id string) string {
	return filepath.Join(r.cfg.CgroupParent, id)
}

// run starts the container with `runsc run -detach` (or restore). runsc and the sandbox
// it leaves behind get their own session (no terminal signal reaches them) and write
// their stdio, which includes the agent's, to the instance's log (logs.go).
func (r *Runtime) run(ctx context.Context, spec runtime.Spec, agentDials bool, sub ...string) error {
	logPath := logPath(spec.StateDir)
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return fmt.Errorf("open runsc log: %w", err)
	}
	defer logf.Close()
	// Without a network, runsc's netstack has only loopback; with one, it takes over
	// the interface of the namespace the node prepared (linux.namespaces names it):
	// the sandbox's packets leave through the veth into the node's rules, never
	// through the host's own stack.
	network := "--network=none"
	if spec.NetNS != "" {
		network = "--network=sandbox"
	}
	// An agent that connects to the node needs only to open host sockets: every socket
	// a program binds is the Sentry's then, which a checkpoint saves (link.go). One that
	// listens on its run directory (instances from before 2026-12-06) needs to create
	// one, and so makes every socket bound on the disk a host socket.
	hostUDS := "--host-uds=create"
	if agentDials {
		hostUDS = "--host-uds=open"
	}
	args := []string{network, "--overlay2=none", hostUDS}
	if r.guestPids {
		args = append(args, "--in-sandbox-cgroup=v2")
	}
	if r.allowSUID {
		// setuid programs (sudo) elevate inside the sandbox as they do on a VM: the
		// Sentry is the sandbox's kernel, so what they gain is the sandbox's root, never
		// a host identity (the user namespace maps it; the store is nosuid on the host).
		args = append(args, "--allow-suid")
	}
	// The instance's id comes last: the pid file goes before it (noteRunning).
	pidFile := pidFilePath(spec.StateDir)
	_ = os.Remove(pidFile)
	args = append(args, sub[:len(sub)-1]...)
	args = append(args, "-pid-file", pidFile, sub[len(sub)-1])
	ctx, cancel := context.WithTimeout(ctx, r.cfg.CommandTimeout)
	defer cancel()
	full := r.args(args...)
	defer r.statuses.change([]string{spec.ID})()
	cmd := exec.CommandContext(ctx, r.cfg.RunscPath, full...)
	cmd.Stdout = logf
	cmd.Stderr = logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	start := time.Now()
	err = cmd.Run()
	r.logRun(ctx, full, start, err)
	if err != nil {
		return runscError(full, err, runtime.LogTail(logPath, 2048))
	}
	return nil
}

// Dial opens a connection to the instance's agent: a stream of its link (link.go),
// which waits for the agent to connect (listening first if this node process has not
// yet: an instance it found running after a restart), or, for an agent that listens
// itself (an instance from before 2026-12-06), a connection to its unix socket in the
// run dir.
func (r *Runtime) Dial(ctx context.Context, id string) (net.Conn, error) {
	if !validID(id) {
		return nil, fmt.Errorf("gvisor dial: invalid id %q", id)
	}
	l := r.links.get(id) // the instance's record is read only when it has none yet
	if l == nil {
		if rec, err := r.readRecord(id); err == nil && rec.AgentDials {
			if l, err = r.links.open(id, rec.StateDir, r.log, reopening); err != nil {
				return nil, fmt.Errorf("gvisor dial %s: %w", id, err)
			}
		}
	}
	if l != nil {
		conn, err := l.dial(ctx)
		if err != nil {
			return nil, fmt.Errorf("gvisor dial %s: %w", id, err)
		}
		return conn, nil
	}
	dir, err := r.stateDir(ctx, id)
	if err != nil {
		return nil, fmt.Errorf("gvisor dial %s: %w", id, err)
	}
	conn, err := dialUnix(ctx, filepath.Join(dir, runDir, wire.AgentSocketName))
	if err != nil {
		return nil, fmt.Errorf("gvisor dial %s: %w", id, err)
	}
	return conn, nil
}

// dialUnix connects to a unix socket, also when its path is too long for sockaddr_un:
// then it connects through /proc/self/fd/N/NAME, N being an O_PATH descriptor of the
// socket's directory (the kernel resolves the path, only the short one is in the address).
func dialUnix(ctx context.Context, path string) (net.Conn, error) {
	var d net.Dialer
	if len(path) < len(unix.RawSockaddrUnix{}.Path) {
		return d.DialContext(ctx, "unix", path)
	}
	fd, err := unix.Open(filepath.Dir(path), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: filepath.Dir(path), Err: err}
	}
	defer unix.Close(fd)
	return d.DialContext(ctx, "unix", fmt.Sprintf("/proc/self/fd/%d/%s", fd, filepath.Base(path)))
}

// stateDir finds an instance's StateDir: from its record, else from runsc's bundle path.
func (r *Runtime) stateDir(ctx context.Context, id string) (string, error) {
	rec, err := r.readRecord(id)
	if err == nil {
		return rec.StateDir, nil
	}
	if !errors.Is(err, fs.ErrNotExist) {
		return "", err
	}
	st, err := r.state(ctx, id)
	if err != nil {
		return "", err
	}
	return st.Bundle, nil
}

// Status reports runsc's view of the instance. An instance that runsc does not know but
// that has a record (a Create or Destroy interrupted half-way) is reported stopped, so
// that the node reclaims it with Destroy.
func (r *Runtime) Status(ctx context.Context, id string) (runtime.Status, error) {
	if !validID(id) {
		return "", fmt.Errorf("gvisor status: invalid id %q", id)
	}
	if r.statuses.isGone(id) {
		return "", fmt.Errorf("gvisor status %s: %w", id, runtime.ErrNotFound)
	}
	st, cached, gen := r.statuses.get(id)
	var err error
	if !cached {
		if _, rerr := r.readRecord(id); errors.Is(rerr, fs.ErrNotExist) {
			// No record: this runtime made no instance with this id (Create and Restore
			// claim one before runsc runs), as for a new clone or a sandbox about to be
			// created. One runsc list confirms it (a record lost by hand would leave
			// runsc's container listed), where runsc state would fail and need the list
			// anyway; and the answer is kept until the id is next changed, so the
			// restore's or create's own check and teardown cost nothing either.
			return r.unrecorded(ctx, id, gen)
		}
		st, err = r.state(ctx, id)
		if err == nil {
			r.statuses.put(id, st, gen)
		}
	}
	if errors.Is(err, runtime.ErrNotFound) {
		if _, rerr := r.readRecord(id); rerr == nil {
			return runtime.StatusStopped, nil
		}
		return "", fmt.Errorf("gvisor status %s: %w", id, runtime.ErrNotFound)
	}
	if err != nil {
		return "", fmt.Errorf("gvisor status %s: %w", id, err)
	}
	return observed(st), nil
}

// unrecorded is Status for an id without a record: runsc's listing of it, or not found
// (then known absent from gen on, statusCache.absent).
func (r *Runtime) unrecorded(ctx context.Context, id string, gen uint64) (runtime.Status, error) {
	// runsc keeps each container as files in its root dir named after its ids
	// (<sandbox>_sandbox:<container>.state and .lock, runsc-<sandbox>.sock; older
	// releases a directory per container): an id that no entry names is one runsc
	// cannot list. Knowing that costs a directory read instead of a runsc list (a
	// process of its own, about 30 ms here, before every new sandbox's start and every
	// batch of clones).
	if named, err := r.rootNames(id); err == nil && !named {
		r.statuses.absent(id, gen)
		return "", fmt.Errorf("gvisor status %s: %w", id, runtime.ErrNotFound)
	}
	// A list already running answers too: a container with this id that it missed would
	// have had to appear after it began, and every container this runtime makes has its
	// record first — the record this lookup found missing.
	ch := r.lists.DoChan("list", func() (any, error) {
		return r.list(context.WithoutCancel(ctx))
	})
	var all []containerState
	var err error
	select {
	case res := <-ch:
		all, _ = res.Val.([]containerState)
		err = res.Err
	case <-ctx.Done():
		err = ctx.Err()
	}
	if err != nil {
		return "", fmt.Errorf("gvisor status %s: %w", id, err)
	}
	if i := slices.IndexFunc(all, func(c containerState) bool { return c.ID == id }); i >= 0 {
		return observed(all[i]), nil
	}
	r.statuses.absent(id, gen)
	return "", fmt.Errorf("gvisor status %s: %w", id, runtime.ErrNotFound)
}

// rootNames reports whether an entry of runsc's root dir has id in its name.
func (r *Runtime) rootNames(id string) (bool, error) {
	ents, err := os.ReadDir(r.cfg.RootDir)
	if err != nil {
		return false, err
	}
	return slices.ContainsFunc(ents, func(e os.DirEntry) bool { return strings.Contains(e.Name(), id) }), nil
}

// List reports every container under the root dir, plus the instances that only have a
// record (reported stopped, see Status), sorted by id.
func (r *Runtime) List(ctx context.Context) ([]runtime.Instance, error) {
	all, err := r.list(ctx)
	if err != nil {
		return nil, fmt.Errorf("gvisor list: %w", err)
	}
	ids, err := r.recordIDs()
	if err != nil {
		return nil, fmt.Errorf("gvisor list: %w", err)
	}
	seen := map[string]bool{}
	var out []runtime.Instance
	for _, c := range all {
		seen[c.ID] = true
		out = append(out, runtime.Instance{ID: c.ID, Status: observed(c)})
	}
	for _, id := range ids {
		if !seen[id] {
			out = append(out, runtime.Instance{ID: id, Status: runtime.StatusStopped})
		}
	}
	slices.SortFunc(out, func(a, b runtime.Instance) int { return strings.Compare(a.ID, b.ID) })
	return out, nil
}

// Adopt checks that the instance survived (runsc runs it from spec.StateDir) and restores
// its record if it was lost.
func (r *Runtime) Adopt(ctx context.Context, spec runtime.Spec) error {
	if !validID(spec.ID) {
		return fmt.Errorf("gvisor adopt: invalid id %q", spec.ID)
	}
	st, err := r.state(ctx, spec.ID)
	if err != nil {
		return fmt.Errorf("gvisor adopt %s: %w", spec.ID, err)
	}
	// A paused instance is alive too (a crash between a pause and what followed it:
	// the node resumes it if it should run).
	if s := observed(st); s != runtime.StatusRunning && s != runtime.StatusPaused {
		return fmt.Errorf("gvisor adopt %s: instance is %s, not running or paused", spec.ID, s)
	}
	if filepath.Clean(st.Bundle) != filepath.Clean(spec.StateDir) {
		return fmt.Errorf("gvisor adopt %s: runsc runs it from %s, not %s", spec.ID, st.Bundle, spec.StateDir)
	}
	rec, err := r.readRecord(spec.ID)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		// The bundle still says how the agent reaches the host.
		rec = record{ID: spec.ID, StateDir: st.Bundle, layout: layout{AgentDials: bundleAgentDials(st.Bundle), AgentPath: bundleAgentPath(st.Bundle)}}
		if err := r.claimRecord(rec); err != nil && !errors.Is(err, fs.ErrExist) {
			return fmt.Errorf("gvisor adopt %s: %w", spec.ID, err)
		}
	case err != nil:
		return fmt.Errorf("gvisor adopt %s: %w", spec.ID, err)
	case filepath.Clean(rec.StateDir) != filepath.Clean(spec.StateDir):
		return fmt.Errorf("gvisor adopt %s: recorded state dir %s, not %s", spec.ID, rec.StateDir, spec.StateDir)
	}
	// A start whose node stopped before it set the CPU quota or raised the memory limit
	// (limits.go) gets them now; for every other instance this writes what it has.
	if err := r.applyCPULimit(spec, st.PID); err != nil {
		return fmt.Errorf("gvisor adopt %s: %w", spec.ID, err)
	}
	if err := r.setMemoryLimit(spec); err != nil {
		return fmt.Errorf("gvisor adopt %s: %w", spec.ID, err)
	}
	if rec.AgentDials {
		// The agent connects again within a second (agent listenConnect).
		if _, err := r.links.open(spec.ID, spec.StateDir, r.log, adopting); err != nil {
			return fmt.Errorf("gvisor adopt %s: %w", spec.ID, err)
		}
	}
	return nil
}

// Destroy kills and deletes the container, waits until its host processes are gone and
// removes the files Create made in the StateDir and the record. It succeeds when the
// instance does not exist. It never touches the RootFS.
func (r *Runtime) Destroy(ctx context.Context, id string) error {
	if !validID(id) {
		return fmt.Errorf("gvisor destroy: invalid id %q", id)
	}
	r.cpuFiles.Delete(id)
	if r.statuses.isGone(id) {
		// Destroyed completely, and nothing has made it since: nothing to tear down
		// (a restore destroys first, which cost runsc kill, runsc delete and a /proc
		// scan on every wake).
		return nil
	}
	// The generation before the record is read, as in Status: a Create claiming the
	// record after that read is a change absent then ignores.
	gen := r.statuses.generation()
	if _, err := r.readRecord(id); errors.Is(err, fs.ErrNotExist) {
		// No record: this runtime never made an instance with this id, or removed it
		// completely (a record is claimed before runsc runs and removed last). Unless
		// runsc lists it anyway (a record lost by hand), there is nothing to tear down:
		// one runsc list instead of state, kill, delete and list — the precautionary
		// teardown before every clone's restore and every new sandbox's.
		if _, err := r.unrecorded(ctx, id, gen); errors.Is(err, runtime.ErrNotFound) {
			return nil
		}
	}
	dir, err := r.stateDir(ctx, id)
	if err != nil && !errors.Is(err, runtime.ErrNotFound) {
		// A corrupt record or a failing runsc: still tear down what can be found by id.
		r.log.WarnContext(ctx, "destroy: state dir unknown", "id", id, "err", err)
	}
	if err := r.destroy(ctx, id, dir); err != nil {
		return fmt.Errorf("gvisor destroy %s: %w", id, err)
	}
	return nil
}

// destroy tears down the instance; stateDir may be empty when unknown.
func (r *Runtime) destroy(ctx context.Context, id, stateDir string) error {
	// First: its listening socket would keep the run directory's tmpfs busy.
	r.links.close(id)
	// An instance whose sandbox exited after this runtime's own checkpoint (a suspend's
	// teardown, the common case) has nothing left to signal, and no runsc create of it
	// can be running: the kill and the second look in runsc list are skipped (two runsc
	// processes, 20–30 ms of every suspend).
	stopped := r.statuses.isStopped(id)
	// An instance whose start this runtime saw end cannot be registered again by a
	// runsc run or restore a killed caller left behind: the second look is skipped for
	// it too (a runsc list, 10–25 ms of every delete).
	clean := r.statuses.isClean(id)
	if !stopped {
		if _, err := r.runsc(ctx, "kill", id, "KILL"); err != nil {
			r.log.DebugContext(ctx, "kill failed (not running?)", "id", id, "err", err)
		}
	}
	// delete -force succeeds when runsc has no such container.
	_, delErr := r.runsc(ctx, "delete", "-force", id)
	wctx, cancel := context.WithTimeout(ctx, procsTimeout)
	defer cancel()
	if err := r.waitHostProcsGone(wctx, id, stateDir, procsGrace); err != nil {
		return errors.Join(delErr, err)
	}
	// runsc gives up waiting for the sandbox after a few seconds; now it is gone. And a
	// runsc create left running by a killed caller may have registered the container
	// after the first delete, before waitHostProcsGone killed it.
	if delErr != nil || (!stopped && !clean && r.listed(ctx, id)) {
		if _, err := r.runsc(ctx, "delete", "-force", id); err != nil {
			return err
		}
	}
	r.removeCgroup(ctx, id)
	if err := r.releaseMounts(id, stateDir); err != nil {
		return fmt.Errorf("release mounts: %w", err)
	}
	if stateDir != "" {
		for _, f := range []string{configFile, linkKeyFile} {
			if err := os.RemoveAll(filepath.Join(stateDir, f)); err != nil {
				return fmt.Errorf("clean state dir: %w", err)
			}
		}
	}
	if err := r.removeRecord(id); err != nil {
		return err
	}
	r.statuses.gone(id)
	r.links.forget(id)
	return nil
}

// listed reports whether runsc lists a container with this id.
func (r *Runtime) listed(ctx context.Context, id string) bool {
	all, err := r.list(ctx)
	return err == nil && slices.ContainsFunc(all, func(c containerState) bool { return c.ID == id })
}

// validID reports whether id is a sandbox id: lowercase alphanumerics.
func validID(id string) bool {
	if id == "" || len(id) > 128 {
		return false
	}
	for _, c := range id {
		if (c < 'a' || c > 'z') && (c < '0' || c > '9') {
			return false
		}
	}
	return true
}

func validateSpec(spec runtime.Spec) error {
	if !validID(spec.ID) {
		return fmt.Errorf("invalid id %q (want lowercase alphanumerics)", spec.ID)
	}
	for name, p := range map[string]string{"root fs": spec.RootFS, "state dir": spec.StateDir, "agent": spec.AgentPath} {
		if !filepath.IsAbs(p) {
			return fmt.Errorf("%s path %q is not absolute", name, p)
		}
	}
	if fi, err := os.Stat(spec.StateDir); err != nil {
		return fmt.Errorf("state dir: %w", err)
	} else if !fi.IsDir() {
		return fmt.Errorf("state dir %s is not a directory", spec.StateDir)
	}
	if fi, err := os.Stat(spec.AgentPath); err != nil {
		return fmt.Errorf("agent: %w", err)
	} else if !fi.Mode().IsRegular() {
		return fmt.Errorf("agent %s is not a regular file", spec.AgentPath)
	}
	if spec.CPU < 0 || spec.MemoryMB < 0 {
		return fmt.Errorf("negative cpu (%d) or memory (%d)", spec.CPU, spec.MemoryMB)
	}
	if spec.Network != (spec.NetNS != "") {
		// runsc's netstack needs a namespace prepared for the sandbox (it refuses the
		// host's); a namespace without Network would be a mistake of the caller.
		return fmt.Errorf("network %v with network namespace %q: want both or neither: %w", spec.Network, spec.NetNS, runtime.ErrUnsupported)
	}
	if spec.NetNS != "" {
		if !filepath.IsAbs(spec.NetNS) {
			return fmt.Errorf("network namespace path %q is not absolute", spec.NetNS)
		}
		if _, err := os.Stat(spec.NetNS); err != nil {
			return fmt.Errorf("network namespace: %w", err)
		}
	}
	if spec.PidsLimit != 0 && spec.PidsLimit < MinPidsLimit {
		return fmt.Errorf("pids limit %d below gVisor's minimum %d (the Sentry, the gofer and the platform need host tasks of their own)", spec.PidsLimit, MinPidsLimit)
	}
	return nil
}
