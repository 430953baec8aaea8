package gvisor

import (
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/spacedev/space/internal/guest/rundirs"
	"github.com/spacedev/space/internal/guest/wire"
	"github.com/spacedev/space/internal/runtime"
)

// configFile is the OCI bundle config in the instance's StateDir (the bundle). Destroy
// removes it and the run and log mounts (mounts.go): all the runtime creates there.
const configFile = "config.json"

// cgroupMountDir is where the sandbox sees its (gVisor-internal) cgroups.
const cgroupMountDir = "/sys/fs/cgroup"

// agentListenEnv tells the agent where to listen.
const agentListenEnv = "SPACE_AGENT_LISTEN"

// ociVersion is the OCI runtime-spec version we claim: the config uses only 1.0 fields,
// and Debian's runsc implements 1.0.2.
const ociVersion = "1.0.2"

// cpuPeriod is the CFS period (µs) the CPU quota is expressed in: the kernel default.
const cpuPeriod = 100_000

// defaultCaps is the capability set of the agent (and the upper bound of everything it
// starts): Docker's default set minus CAP_NET_RAW. `runsc spec` only grants AUDIT_WRITE,
// KILL and NET_BIND_SERVICE, which does not let the agent switch to the sandbox user
// (SETUID/SETGID) or hand files to it (CHOWN, FOWNER, DAC_OVERRIDE). The capabilities are
// those of gVisor's user-space kernel, not of the host.
var defaultCaps = []string{
	"CAP_AUDIT_WRITE",
	"CAP_CHOWN",
	"CAP_DAC_OVERRIDE",
	"CAP_FOWNER",
	"CAP_FSETID",
	"CAP_KILL",
	"CAP_MKNOD",
	"CAP_NET_BIND_SERVICE",
	"CAP_SETFCAP",
	"CAP_SETGID",
	"CAP_SETPCAP",
	"CAP_SETUID",
	"CAP_SYS_CHROOT",
}

// bundleOptions are the inputs of the OCI config that do not come from the Spec.
type bundleOptions struct {
	// CPULater leaves the CPU quota out of the bundle: start sets it on the host cgroup
	// once runsc has returned (a restore; limits.go).
	CPULater bool
	// CgroupsPath is linux.cgroupsPath, e.g. /space/<id>.
	CgroupsPath string
	// NetNS is the path of a network namespace to join; empty means a new one.
	NetNS string
	// RootPath is the root the sandbox gets (an id-mapped view of the Spec's RootFS, or
	// the RootFS itself); empty means the RootFS.
	RootPath string
	// RunSource is the host directory mounted at wire.RunMountDir; empty means
	// <StateDir>/run.
	RunSource string
	// GuestPids mounts gVisor's cgroups in the sandbox, where the pids limit is set
	// (runsc releases that have --in-sandbox-cgroup).
	GuestPids bool
	// UIDBase, when not 0, puts the sandbox in a user namespace mapping its ids
	// 0…UserNSSize-1 to host ids UIDBase….
	UIDBase uint32
	// layout sizes the sandbox's memory file systems and names its agent's transport.
	layout
}

// layout is what an instance's bundle and every checkpoint of it must agree on, since
// a restore repeats it: the size of the memory file systems it mounts, in MiB, and
// how its agent reaches the host. A zero field is what an instance made before the
// field existed has (its checkpoints restore with it: runsc refuses a restore whose
// bundle names the mounts otherwise, and the restored agent keeps its transport).
type layout struct {
	// TmpfsMB bounds /tmp and /dev/shm, each (/dev/shm is mounted only with a size).
	TmpfsMB int `json:"tmpfs_mb,omitempty"`
	// RunMB bounds /run, a tmpfs since 2026-12-06 (package rundirs); before, /run was
	// on the disk.
	RunMB int `json:"run_mb,omitempty"`
	// AgentDials: the agent connects to the node's socket (link.go) and runsc runs
	// with --host-uds=open. False: the agent listens on its own socket in the run
	// directory, which takes --host-uds=create (instances from before 2026-12-06).
	AgentDials bool `json:"agent_dials,omitempty"`
	// AgentPath is the host file of the agent binary the instance runs (its bundle's
	// bind mount at wire.AgentPath). A restore mounts that same file: the restored
	// agent's code is mapped from it, and a node whose own agent changed since (space
	// was upgraded, or rebuilt) would otherwise give the restored process another
	// binary under its mapped pages, which it does not survive (restoreAgent). Empty
	// in records and checkpoints from before 2026-12-07 (then read from the bundle, or
	// unknown).
	AgentPath string `json:"agent_path,omitempty"`
}

// layoutOf is a new instance's layout: its agent connects to the node, and its memory
// file systems are sized so. /tmp and /dev/shm get half the
// sandbox's memory each, as Linux sizes a tmpfs by default. Their files are the
// sandbox's memory. gVisor's default is half of the HOST's memory, so a 256 MiB sandbox
// could write gigabytes into /tmp: past the host memory limit of its cgroup, where the
// host's OOM killer ends a process of the sandbox's (the Sentry itself, often: the
// whole sandbox), and ending a user process (memwatch) frees nothing a file holds.
// Bounded, a write that does not fit fails with ENOSPC, as on a Linux machine of that
// size; with no memory size they are not bounded. /run, which holds pid files, locks
// and sockets, gets an eighth of the memory (64 MiB with no memory size): with /tmp and
// /dev/shm full as well, the files stay under the host limit's overhead above the
// memory size.
func layoutOf(spec runtime.Spec) layout {
	if spec.MemoryMB <= 0 {
		return layout{RunMB: 64, AgentDials: true, AgentPath: spec.AgentPath}
	}
	return layout{TmpfsMB: max(spec.MemoryMB/2, 1), RunMB: max(spec.MemoryMB/8, 1), AgentDials: true, AgentPath: spec.AgentPath}
}

// bundleSpec generates the OCI config of an instance: the agent as PID 1 on the writable
// RootFS, the agent binary and the run dir bind-mounted in, cgroup limits from the Spec.
func bundleSpec(spec runtime.Spec, opts bundleOptions) *specs.Spec {
	env := map[string]string{
		"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
		"HOME": "/root",
	}
	for k, v := range spec.AgentEnv {
		env[k] = v
	}
	env[agentListenEnv] = "unix:" + path.Join(wire.RunMountDir, wire.AgentSocketName)
	if opts.AgentDials {
		env[agentListenEnv] = "connect:" + path.Join(wire.RunMountDir, wire.NodeSocketName)
	}
	envList := make([]string, 0, len(env))
	for k, v := range env {
		envList = append(envList, k+"="+v)
	}
	slices.Sort(envList)

	rootPath := cmp.Or(opts.RootPath, spec.RootFS)
	runSource := cmp.Or(opts.RunSource, filepath.Join(spec.StateDir, "run"))
	caps := slices.Clone(defaultCaps)
	s := &specs.Spec{
		Version: ociVersion,
		Process: &specs.Process{
			User: specs.User{UID: 0, GID: 0},
			Args: []string{wire.AgentPath},
			Env:  envList,
			Cwd:  "/",
			Capabilities: &specs.LinuxCapabilities{
				Bounding:  caps,
				Effective: caps,
				Permitted: caps,
			},
			Rlimits: []specs.POSIXRlimit{
				{Type: "RLIMIT_NOFILE", Hard: 65536, Soft: 65536},
			},
		},
		Root:     &specs.Root{Path: rootPath, Readonly: false},
		Hostname: spec.ID,
		Mounts: []specs.Mount{
			{Destination: "/proc", Type: "proc", Source: "proc", Options: []string{"nosuid", "noexec", "nodev"}},
			{Destination: "/dev", Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "strictatime", "mode=755"}},
			{Destination: "/sys", Type: "sysfs", Source: "sysfs", Options: []string{"nosuid", "noexec", "nodev", "ro"}},
			// gVisor mounts a tmpfs at /tmp anyway when the image's /tmp is empty; saying
			// so makes /tmp the same whatever the template holds there.
			{Destination: "/tmp", Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "nodev", "mode=1777"}},
			{Destination: wire.AgentPath, Type: "bind", Source: spec.AgentPath, Options: []string{"rbind", "ro", "nosuid", "nodev"}},
			{Destination: wire.RunMountDir, Type: "bind", Source: runSource, Options: []string{"rbind", "rw", "nosuid", "nodev", "noexec"}},
		},
		Linux: &specs.Linux{
			CgroupsPath: opts.CgroupsPath,
			Resources:   resources(spec),
			Namespaces: []specs.LinuxNamespace{
				{Type: specs.PIDNamespace},
				{Type: specs.NetworkNamespace, Path: opts.NetNS},
				{Type: specs.IPCNamespace},
				{Type: specs.UTSNamespace},
				{Type: specs.MountNamespace},
			},
		},
	}
	if opts.CPULater {
		s.Linux.Resources.CPU = nil
	}
	if opts.GuestPids {
		// gVisor's own cgroups (not the host's): with this mount the container's tasks
		// live in a cgroup of their own inside the Sentry (/<id>), where the runtime sets
		// the pids limit. It is writable so that the agent can start user processes in
		// a child cgroup with a tighter limit, keeping room for itself; sandbox root can
		// also raise the limit, which only brings it to the host limit (see
		// hostPidsFactor). Programs also see their limits here.
		s.Mounts = slices.Insert(s.Mounts, 4, specs.Mount{Destination: cgroupMountDir, Type: "cgroup2", Source: "cgroup2", Options: []string{"nosuid", "noexec", "nodev"}})
	}
	if opts.TmpfsMB > 0 {
		// gVisor makes /dev a file system of its own, which takes no size (and in which
		// only root may write): /dev/shm, where any user may, gets a tmpfs of its own,
		// as Docker gives it.
		size := fmt.Sprintf("size=%dm", opts.TmpfsMB)
		for i, m := range s.Mounts {
			if m.Destination == "/tmp" {
				s.Mounts[i].Options = append(slices.Clone(m.Options), size)
			}
		}
		s.Mounts = append(s.Mounts, specs.Mount{Destination: "/dev/shm", Type: "tmpfs", Source: "shm",
			Options: []string{"nosuid", "nodev", "mode=1777", size}})
	}
	if opts.RunMB > 0 {
		// Before the agent's run dir, which is mounted inside it.
		i := slices.IndexFunc(s.Mounts, func(m specs.Mount) bool { return m.Destination == wire.RunMountDir })
		s.Mounts = slices.Insert(s.Mounts, i, specs.Mount{Destination: "/run", Type: "tmpfs", Source: "tmpfs",
			Options: []string{"nosuid", "nodev", "mode=755", fmt.Sprintf("size=%dm", opts.RunMB)}})
	}
	if opts.UIDBase != 0 {
		m := []specs.LinuxIDMapping{{ContainerID: 0, HostID: opts.UIDBase, Size: UserNSSize}}
		s.Linux.Namespaces = append(s.Linux.Namespaces, specs.LinuxNamespace{Type: specs.UserNamespace})
		s.Linux.UIDMappings = m
		s.Linux.GIDMappings = slices.Clone(m)
	}
	return s
}

// marshalSpec encodes an OCI config the way it is written to disk.
func marshalSpec(s *specs.Spec) ([]byte, error) {
	data, err := json.MarshalIndent(s, "", "  ")
	if err != nil {
		return nil, fmt.Errorf("encode bundle config: %w", err)
	}
	return append(data, '\n'), nil
}

// writeBundle writes config.json into the StateDir.
func writeBundle(stateDir string, oci *specs.Spec) error {
	data, err := marshalSpec(oci)
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(stateDir, configFile), data, 0o600); err != nil {
		return fmt.Errorf("write bundle config: %w", err)
	}
	return nil
}

// readBundle reads the bundle in stateDir (nil when it cannot be read).
func readBundle(stateDir string) *specs.Spec {
	data, err := os.ReadFile(filepath.Join(stateDir, configFile))
	if err != nil {
		return nil
	}
	var oci specs.Spec
	if json.Unmarshal(data, &oci) != nil || oci.Process == nil {
		return nil
	}
	return &oci
}

// bundleAgentDials reports whether the bundle in stateDir starts an agent that connects
// to the node (false when it cannot be read).
func bundleAgentDials(stateDir string) bool {
	oci := readBundle(stateDir)
	return oci != nil && slices.ContainsFunc(oci.Process.Env, func(e string) bool { return strings.HasPrefix(e, agentListenEnv+"=connect:") })
}

// bundleAgentPath returns the host file the bundle in stateDir mounts as the agent
// ("" when it cannot be read).
func bundleAgentPath(stateDir string) string {
	if oci := readBundle(stateDir); oci != nil {
		for _, m := range oci.Mounts {
			if m.Destination == wire.AgentPath {
				return m.Source
			}
		}
	}
	return ""
}

// Spec.PidsLimit is the sandbox's host cgroup pids.max (the OCI config's
// linux.resources.pids.limit), as for every runtime. Under gVisor that host limit must
// never be reached: a Sentry that cannot create a thread dies ("failed to create new OS
// thread"), taking the sandbox with it. So the runtime also limits the tasks inside the
// sandbox, through gVisor's own pids controller (the container's cgroup in the Sentry,
// set with `runsc write-control` after start), where fork and clone fail with EAGAIN, at
// (PidsLimit - hostPidsSlack) / hostPidsFactor: each guest process costs the systrap
// platform a stub process with a system call thread and up to GOMAXPROCS sysmsg threads
// (the Sentry pools them for reuse after the guest process exits), a guest thread
// blocked in a host system call holds a Sentry thread, and the Sentry and the gofer
// have threads of their own. Measured with bash fork bombs on a 2-core host
// (2026-12-06): with 1-CPU sandboxes 2048 tasks inside peaked at 4,213–5,210 host
// tasks and 1024 at 3,192–3,855; with 2-CPU sandboxes 2048 peaked at 6,746–9,075 (up to
// 4.3 a task) and 1024 at 2,948–3,749. A stub runs at most as many sysmsg threads as its
// address space has guest threads (systrap's kickSysmsgThread), so a single-threaded
// guest process costs at most three host tasks in its own subprocess; what grows with
// the CPUs is the pool of subprocesses released by exited processes and not yet reused
// (unbounded in gVisor): a bomb that churns faster keeps more of them. The factor is 6
// (two subprocesses of three tasks a guest task; it was 5, which a 2-CPU bomb brought
// within 14 %, and 4 before that).
//
// A Spec without a pids limit gets one task inside per MiB of memory, at least 256 and
// at most 2048 (2048 without a memory size): every task also costs host memory outside
// the guest's (hostMemoryLimit), and that cost has to stay in proportion to the
// sandbox's size.
const (
	hostPidsFactor = 6
	hostPidsSlack  = 256
	// DefaultPidsLimit is the host limit of a sandbox whose Spec names none and has 2 GiB
	// of memory or more (or no size): 2048 tasks inside.
	DefaultPidsLimit = hostPidsFactor*maxDefaultGuestTasks + hostPidsSlack
	// MinPidsLimit is the smallest PidsLimit: 16 tasks inside.
	MinPidsLimit = hostPidsFactor*16 + hostPidsSlack

	minDefaultGuestTasks = 256
	maxDefaultGuestTasks = 2048
)

// defaultGuestTasks is the number of tasks inside a sandbox whose Spec names no pids
// limit: one per MiB of memory, within [minDefaultGuestTasks, maxDefaultGuestTasks].
func defaultGuestTasks(spec runtime.Spec) int64 {
	if spec.MemoryMB <= 0 {
		return maxDefaultGuestTasks
	}
	return min(max(int64(spec.MemoryMB), minDefaultGuestTasks), maxDefaultGuestTasks)
}

// hostPidsLimit is the pids.max of the sandbox's host cgroup: the Spec's, or the
// default for its size.
func hostPidsLimit(spec runtime.Spec) int64 {
	if spec.PidsLimit > 0 {
		return int64(spec.PidsLimit)
	}
	return hostPidsFactor*defaultGuestTasks(spec) + hostPidsSlack
}

// guestPidsLimit is the limit on tasks inside the sandbox that keeps the host limit out
// of reach.
func guestPidsLimit(spec runtime.Spec) int64 {
	return (hostPidsLimit(spec) - hostPidsSlack) / hostPidsFactor
}

// The sandbox's host memory cgroup holds the guest's memory (the Sentry's memory file)
// and everything the Sentry spends on the guest's behalf: its Go heap (kernel objects
// for every task, address space and file), the systrap stub processes' page tables and
// the host kernel's memory for all those tasks. With the cgroup limited to the guest's
// size, a guest using half of its memory with many tasks had its whole instance killed
// by the host's OOM killer: a bash fork bomb in a 1 GiB sandbox died at 498 MB of guest
// memory. Measured (2026-12-06, bash fork bombs): at 2048 tasks inside (a 4 GiB
// sandbox) 637 MiB of guest memory, 335 MiB of Sentry and stub memory and 316 MiB of
// host kernel memory, 325 KiB a task besides the guest's own; at about 960 tasks (1 GiB)
// 387, 261 and 199 MiB, 490 KiB a task (the Sentry's Go heap keeps garbage in
// proportion). So the host limit is the guest's size plus
// sentryMemOverhead plus taskMemOverhead for every task the sandbox may have
// (guestPidsLimit): a sandbox within its memory and its tasks is never killed by the
// host, and one beyond its memory still is (gVisor does not bound the guest's memory
// itself; see docs/runtimes.md).
const (
	sentryMemOverhead = 32 << 20
	taskMemOverhead   = 512 << 10
)

// hostMemoryLimit is the memory limit of the sandbox's host cgroup (0: none). The
// guest's own size is what runsc tells the Sentry (MemTotal inside): the bundle carries
// that, and start raises the cgroup's limit to this once runsc has returned (limits.go).
func hostMemoryLimit(spec runtime.Spec) int64 {
	if spec.MemoryMB <= 0 {
		return 0
	}
	return int64(spec.MemoryMB)<<20 + sentryMemOverhead + guestPidsLimit(spec)*taskMemOverhead
}

// resources turns the Spec's CPU, memory and pids limit into host cgroup limits.
func resources(spec runtime.Spec) *specs.LinuxResources {
	res := &specs.LinuxResources{Pids: &specs.LinuxPids{Limit: hostPidsLimit(spec)}}
	if spec.MemoryMB > 0 {
		limit := int64(spec.MemoryMB) << 20
		res.Memory = &specs.LinuxMemory{Limit: &limit}
	}
	if spec.CPU > 0 {
		quota, period := int64(spec.CPU)*cpuPeriod, uint64(cpuPeriod)
		res.CPU = &specs.LinuxCPU{Quota: &quota, Period: &period}
	}
	return res
}

// makeMountPoints creates the destinations of the config's mounts in the rootfs where
// missing (runsc would create them too, but then a failed Create could not tell them from
// the template's), and returns the paths it created, relative and in creation order, so
// that a failed Create removes them again. It works through os.Root so that symlinks left
// in the rootfs by an earlier run of the sandbox cannot make it create anything outside.
func makeMountPoints(rootfs string, mounts []specs.Mount) (created []string, err error) {
	root, err := os.OpenRoot(rootfs)
	if err != nil {
		return nil, fmt.Errorf("open rootfs: %w", err)
	}
	defer root.Close()
	defer func() {
		if err != nil {
			removeMountPoints(rootfs, created)
			created = nil
		}
	}()
	var synthetic []string // destinations of file systems gVisor makes up (proc, sysfs, …)
	for _, m := range mounts {
		// A mount inside one of those needs no mount point in the rootfs — but a bind
		// mount does: runsc's gofer mounts it on the host's view of the rootfs, making
		// the directories it needs there (the agent's run dir in the /run tmpfs).
		if m.Type != "bind" && slices.ContainsFunc(synthetic, func(d string) bool { return within(m.Destination, d) }) {
			continue
		}
		if m.Type != "bind" {
			synthetic = append(synthetic, m.Destination)
		}
		// A bind mount of a file needs a file to mount on; everything else a directory.
		fileTarget := false
		if m.Type == "bind" {
			fi, err := os.Stat(m.Source)
			if err != nil {
				return created, fmt.Errorf("mount source: %w", err)
			}
			fileTarget = !fi.IsDir()
		}
		parts := strings.Split(strings.Trim(path.Clean(m.Destination), "/"), "/")
		for i := range parts {
			name := strings.Join(parts[:i+1], "/")
			made, err := makeMountPoint(root, name, !fileTarget || i < len(parts)-1)
			if err != nil {
				return created, fmt.Errorf("create mount point /%s in rootfs: %w", name, err)
			}
			if made {
				created = append(created, name)
			}
		}
	}
	return created, nil
}

// within reports whether path p is dir or below it.
func within(p, dir string) bool {
	p, dir = path.Clean(p), path.Clean(dir)
	return p == dir || strings.HasPrefix(p, strings.TrimSuffix(dir, "/")+"/")
}

// makeMountPoint creates name (a directory or an empty file) unless something is there.
func makeMountPoint(root *os.Root, name string, dir bool) (bool, error) {
	if _, err := root.Lstat(name); err == nil {
		return false, nil
	} else if !errors.Is(err, fs.ErrNotExist) {
		return false, err
	}
	if dir {
		if err := root.Mkdir(name, 0o755); err != nil {
			return false, err
		}
		return true, nil
	}
	f, err := root.OpenFile(name, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o755)
	if err != nil {
		return false, err
	}
	return true, f.Close()
}

// removeMountPoints removes what makeMountPoints created, newest first. Best effort: it
// only removes empty directories and the empty placeholder file.
func removeMountPoints(rootfs string, created []string) {
	if len(created) == 0 {
		return
	}
	root, err := os.OpenRoot(rootfs)
	if err != nil {
		return
	}
	defer root.Close()
	for _, name := range slices.Backward(created) {
		_ = root.Remove(name)
	}
}

// writeRunDirs leaves the agent the directories and links of the rootfs's /run to make
// in the tmpfs a boot mounts there (package rundirs). The rootfs is read through an
// os.Root: a sandbox that ran before may have left links anywhere in it.
func writeRunDirs(spec runtime.Spec) error {
	entries, err := rundirs.ScanRootFS(spec.RootFS)
	if err != nil {
		return err
	}
	return rundirs.Write(filepath.Join(spec.StateDir, runDir, rundirs.FileName), entries)
}
