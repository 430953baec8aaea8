// Package vmboot owns the guest side of VM sandboxes below the agent protocol: what
// space-agent does first when the kernel starts it as /init of a VM's initramfs (mount
// the pseudo file systems, load the virtio modules, mount the root disk, switch to it
// and re-execute itself from there as the agent), and the serial transport that carries
// the agent's HTTP connections as yamux streams over a virtio-serial port (Listen on the
// guest, Connect on the host; the handshake is described in handshake.go).
//
// The initramfs contract, shared with package runtime/initramfs that builds it for the
// VM runtimes:
//
//	/init                 the space-agent binary
//	/dev/console          character device 5:1 (the kernel opens it for init's stdio)
//	/modules/order        file names of the modules in /modules, in load order
//	/modules/*.ko         the kernel modules the VM needs (virtio transport, block,
//	                      console, rng) that the kernel does not have built in
//
// and on the kernel command line:
//
//	space.vm=1            marks a space VM
//	space.env=B64         base64url (unpadded) JSON object: the agent's environment
//	                      (settings, not secrets: /proc/cmdline is world-readable)
//	<mod>.<param>=V       passed to module <mod> when it is loaded (as modprobe does)
//
// The root disk is /dev/vda (ext4). In the new root the agent binary appears read-only
// at wire.AgentPath (a bind mount of /init on a small tmpfs at /.space), /run is a
// tmpfs, /dev has devpts and /dev/shm, and /sys/fs/cgroup the cgroup2 hierarchy.
package vmboot

import (
	"encoding/base64"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/guest/rundirs"
	"github.com/spacedev/space/internal/guest/wire"
)

// Initramfs layout and kernel command line (see the package comment).
const (
	InitPath     = "/init"
	ModulesDir   = "/modules"
	ModulesOrder = "/modules/order"
	VMFlag       = "space.vm=1"
	EnvParam     = "space.env"
	RootDevice   = "/dev/vda"
	ConsoleDev   = "/dev/hvc0"
)

// DefaultListen is the agent's listen address in a VM unless space.env sets
// SPACE_AGENT_LISTEN.
const DefaultListen = "serial:" + PortName

const (
	newRoot     = "/newroot"
	agentDir    = "/.space" // tmpfs holding the agent binary in the new root
	deviceWait  = 10 * time.Second
	devicePoll  = 5 * time.Millisecond
	defaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
)

// IsInit reports whether this process is the init of a VM's initramfs: PID 1 started
// as /init. (In gVisor the agent is PID 1 too, but started as wire.AgentPath.)
func IsInit() bool {
	return os.Getpid() == 1 && len(os.Args) > 0 && os.Args[0] == InitPath
}

// Main boots the VM (Boot) and never returns: on success the process has become the
// agent in the new root; on failure it reports the error on the console and reboots,
// which ends the VM (the runtime starts QEMU with -no-reboot).
func Main() {
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	err := Boot(log)
	log.Error("vm boot failed", "err", err)
	unix.Sync()
	_ = unix.Reboot(unix.LINUX_REBOOT_CMD_RESTART)
	os.Exit(1)
}

// Boot prepares the VM and executes the agent from the root disk. It returns only on
// failure. Messages go to log, whose output should be os.Stderr: Boot points the
// process's stdio at the VM console (ConsoleDev) once the console driver is loaded.
func Boot(log *slog.Logger) error {
	start := time.Now()
	for _, m := range []struct {
		src, dst, typ string
		flags         uintptr
		data          string
	}{
		{"proc", "/proc", "proc", unix.MS_NOSUID | unix.MS_NOEXEC | unix.MS_NODEV, ""},
		{"sysfs", "/sys", "sysfs", unix.MS_NOSUID | unix.MS_NOEXEC | unix.MS_NODEV, ""},
		{"devtmpfs", "/dev", "devtmpfs", unix.MS_NOSUID, "mode=0755"},
	} {
		if err := mountAt(m.src, m.dst, m.typ, m.flags, m.data); err != nil {
			return err
		}
	}
	data, err := os.ReadFile("/proc/cmdline")
	if err != nil {
		return fmt.Errorf("read kernel command line: %w", err)
	}
	cmdline := strings.Fields(string(data))
	if !slices.Contains(cmdline, VMFlag) {
		return fmt.Errorf("kernel command line lacks %s", VMFlag)
	}
	agentEnv, err := decodeEnv(cmdline)
	if err != nil {
		return err
	}
	loaded, err := LoadModules(ModulesOrder, moduleParams(cmdline))
	if err != nil {
		return err
	}
	if err := useConsole(consoleFrom(cmdline)); err != nil {
		// Keep going without a console: the agent's transport matters, not its logs.
		log.Warn("no console", "err", err)
	}
	log.Debug("modules loaded", "modules", loaded, "elapsed", time.Since(start))
	if err := waitFor(func() error { _, err := os.Stat(RootDevice); return err }); err != nil {
		return fmt.Errorf("root disk: %w", err)
	}
	if err := switchRoot(log); err != nil {
		return err
	}
	// The serial transport needs its port device; vsock (Firecracker) needs nothing.
	if listen := agentEnv["SPACE_AGENT_LISTEN"]; listen == "" || strings.HasPrefix(listen, "serial:") {
		if err := waitFor(func() error { _, err := ResolvePort(PortName); return err }); err != nil {
			return fmt.Errorf("agent port: %w", err)
		}
	}
	if err := loopbackUp(); err != nil {
		log.Warn("loopback", "err", err)
	}
	env := agentEnvironment(agentEnv)
	log.Debug("starting agent", "elapsed", time.Since(start))
	err = unix.Exec(wire.AgentPath, []string{filepath.Base(wire.AgentPath)}, env)
	return fmt.Errorf("exec agent: %w", err)
}

func mountAt(src, dst, typ string, flags uintptr, data string) error {
	if err := os.MkdirAll(dst, 0o755); err != nil {
		return fmt.Errorf("mount %s: %w", dst, err)
	}
	if err := unix.Mount(src, dst, typ, flags, data); err != nil {
		return fmt.Errorf("mount %s on %s: %w", typ, dst, err)
	}
	return nil
}

// waitFor polls check until it succeeds or deviceWait passes.
func waitFor(check func() error) error {
	deadline := time.Now().Add(deviceWait)
	for {
		err := check()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("not there after %v: %w", deviceWait, err)
		}
		time.Sleep(devicePoll) // polling a device node: there is nothing to wait on
	}
}

// useConsole points stdin, stdout and stderr at the console device once it works (the
// virtio console registers its ports asynchronously after the module loads).
func useConsole(dev string) error {
	var fd int
	err := waitFor(func() error {
		var err error
		fd, err = unix.Open(dev, unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
		return err
	})
	if err != nil {
		return err
	}
	for i := range 3 {
		if err := unix.Dup3(fd, i, 0); err != nil {
			return fmt.Errorf("dup console: %w", err)
		}
	}
	return unix.Close(fd)
}

// switchRoot mounts the root disk, prepares it and makes it the root, moving /dev,
// /proc and /sys along (like switch_root, minus deleting the initramfs: its /init stays
// in use as the agent binary).
func switchRoot(log *slog.Logger) error {
	if err := mountAt(RootDevice, newRoot, "ext4", unix.MS_NOATIME, ""); err != nil {
		return err
	}
	// The agent binary: /init bind-mounted read-only on a private tmpfs.
	dir := filepath.Join(newRoot, agentDir)
	if err := mountAt("tmpfs", dir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=0755,size=64k"); err != nil {
		return err
	}
	bin := filepath.Join(newRoot, wire.AgentPath)
	if err := os.WriteFile(bin, nil, 0o755); err != nil {
		return fmt.Errorf("agent mount point: %w", err)
	}
	if err := unix.Mount(InitPath, bin, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("bind agent: %w", err)
	}
	if err := unix.Mount("", bin, "", unix.MS_REMOUNT|unix.MS_BIND|unix.MS_RDONLY|unix.MS_NODEV, ""); err != nil {
		return fmt.Errorf("agent read-only: %w", err)
	}
	if err := unix.Mount("", dir, "", unix.MS_REMOUNT|unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV, "mode=0755,size=64k"); err != nil {
		return fmt.Errorf("agent dir read-only: %w", err)
	}
	for _, d := range []string{"/dev", "/proc", "/sys"} {
		target := filepath.Join(newRoot, d)
		if err := os.MkdirAll(target, 0o755); err != nil {
			return fmt.Errorf("move %s: %w", d, err)
		}
		if err := unix.Mount(d, target, "", unix.MS_MOVE, ""); err != nil {
			return fmt.Errorf("move %s: %w", d, err)
		}
	}
	// /run is a tmpfs that starts with the disk's directories and links in it (package
	// rundirs): read them before it hides them.
	runTree, err := rundirs.ScanRootFS(newRoot)
	if err != nil {
		log.Warn("read /run of the disk", "err", err)
	}
	for _, m := range []struct {
		src, dst, typ string
		flags         uintptr
		data          string
	}{
		{"devpts", "/dev/pts", "devpts", unix.MS_NOSUID | unix.MS_NOEXEC, "mode=0620,ptmxmode=0666,gid=5"},
		{"tmpfs", "/dev/shm", "tmpfs", unix.MS_NOSUID | unix.MS_NODEV, "mode=1777"},
		{"tmpfs", "/run", "tmpfs", unix.MS_NOSUID | unix.MS_NODEV, "mode=0755"},
		{"cgroup2", "/sys/fs/cgroup", "cgroup2", unix.MS_NOSUID | unix.MS_NOEXEC | unix.MS_NODEV, ""},
	} {
		if err := mountAt(m.src, filepath.Join(newRoot, m.dst), m.typ, m.flags, m.data); err != nil {
			return err
		}
	}
	if err := rundirs.Make(filepath.Join(newRoot, "run"), runTree); err != nil {
		log.Warn("make /run's directories", "err", err)
	}
	if err := os.Chdir(newRoot); err != nil {
		return fmt.Errorf("switch root: %w", err)
	}
	if err := unix.Mount(".", "/", "", unix.MS_MOVE, ""); err != nil {
		return fmt.Errorf("switch root: move: %w", err)
	}
	if err := unix.Chroot("."); err != nil {
		return fmt.Errorf("switch root: chroot: %w", err)
	}
	if err := os.Chdir("/"); err != nil {
		return fmt.Errorf("switch root: %w", err)
	}
	return nil
}

// loopbackUp brings up lo: sandboxes have no network, but programs expect localhost.
func loopbackUp() error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return fmt.Errorf("get lo flags: %w", err)
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	if err := unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr); err != nil {
		return fmt.Errorf("set lo up: %w", err)
	}
	return nil
}

// EncodeEnv encodes the agent's environment for the space.env kernel parameter.
func EncodeEnv(env map[string]string) (string, error) {
	data, err := json.Marshal(env)
	if err != nil {
		return "", err
	}
	return EnvParam + "=" + base64.RawURLEncoding.EncodeToString(data), nil
}

func decodeEnv(cmdline []string) (map[string]string, error) {
	env := map[string]string{}
	for _, arg := range cmdline {
		v, ok := strings.CutPrefix(arg, EnvParam+"=")
		if !ok {
			continue
		}
		data, err := base64.RawURLEncoding.DecodeString(v)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", EnvParam, err)
		}
		if err := json.Unmarshal(data, &env); err != nil {
			return nil, fmt.Errorf("%s: %w", EnvParam, err)
		}
	}
	return env, nil
}

// agentEnvironment is the agent's environment: a sane PATH and HOME, the listen address,
// then what space.env says.
func agentEnvironment(extra map[string]string) []string {
	env := map[string]string{
		"PATH":               defaultPath,
		"HOME":               "/root",
		"SPACE_AGENT_LISTEN": DefaultListen,
	}
	for k, v := range extra {
		env[k] = v
	}
	out := make([]string, 0, len(env))
	for k, v := range env {
		out = append(out, k+"="+v)
	}
	slices.Sort(out)
	return out
}

// consoleFrom returns the device of the last console= on the kernel command line
// (ttyS0 for Firecracker, hvc0 for QEMU), else ConsoleDev.
func consoleFrom(cmdline []string) string {
	dev := ConsoleDev
	for _, f := range cmdline {
		if v, ok := strings.CutPrefix(f, "console="); ok && v != "" {
			name, _, _ := strings.Cut(v, ",")
			dev = "/dev/" + name
		}
	}
	return dev
}
