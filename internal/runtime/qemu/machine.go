package qemu

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/spacedev/space/internal/guest/vmboot"
)

// Files in an instance's StateDir; Destroy removes exactly these.
const (
	qmpSocket   = "qmp.sock"    // QMP, for this runtime only
	agentSocket = "agent.sock"  // host end of the agent's virtio-serial port
	consoleLog  = "console.log" // the guest console (kernel messages, agent logs)
	qemuLog     = "qemu.log"    // QEMU's own stdout and stderr
)

// stateFiles lists the files Create and Restore make in a StateDir.
func stateFiles() []string { return []string{qmpSocket, agentSocket, consoleLog, qemuLog} }

// Files in a checkpoint directory.
const (
	memoryFile  = "memory"  // QEMU's migration stream: RAM and device state
	machineFile = "vm.json" // the machine configuration the stream needs (machine)
)

// File descriptors every QEMU process gets, all opened by the node: QEMU runs in a jail
// (see jail.go) where it can open no host file itself. Its command line names them
// (fdsets, chardev fd=N) and fixed paths inside the jail, never a host path, so it is the
// same for every instance with the same machine: a restore needs "identical device
// configuration", and a clone must not see its origin's paths.
const (
	fdDisk    = 4 // the root disk image, read-write (fdset 1)
	fdDiskRO  = 5 // the same, read-only: QEMU probes the image read-only (fdset 1)
	fdConsole = 6 // the console log, append-only (fdset 2)
	fdQMP     = 7 // listening QMP socket (StateDir/qmp.sock)
	fdAgent   = 8 // listening socket of the agent's serial port (StateDir/agent.sock)
	fdTap     = 9 // the VM's tap device in the sandbox's network namespace (networked VMs)
)

// guestMAC is every networked VM's MAC address: it is part of the snapshot, so clones
// share it (each on the tap of its own namespace).
const guestMAC = "52:54:00:73:70:01"

// Paths of the kernel and the initramfs inside the jail (bind mounts of the host's files).
const (
	jailKernel = "/vm/kernel"
	jailInitrd = "/vm/initrd"
)

// sandboxOpts turns QEMU's seccomp filter on (-sandbox): no obsolete system calls, no
// set*uid/gid, no fork or exec, no scheduler or priority changes. A QEMU that tries
// one of those is killed.
const sandboxOpts = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"

// machine is what QEMU's command line is made from. Checkpoint saves it next to the
// memory file; Restore starts QEMU from it, so the devices match the stream.
type machine struct {
	MemoryMB int    `json:"memory_mb"`
	CPU      int    `json:"cpu"`
	Accel    string `json:"accel"`
	Kernel   string `json:"kernel"`
	Initrd   string `json:"initrd"`
	Append   string `json:"append"`
	// QEMU is the emulator's version: streams do not load across versions.
	QEMU string `json:"qemu"`
	// Network gives the VM a virtio-net NIC on a tap device in the sandbox's network
	// namespace (network.OpenTap): a restore needs a namespace too.
	Network bool `json:"network,omitempty"`
	// Balloon gives the VM a virtio-balloon device with free page reporting: the guest
	// tells QEMU which of its pages are free (in 2 MiB blocks, a couple of seconds after
	// they are freed) and QEMU gives them back to the host, so the VM holds what the
	// guest uses rather than everything it ever touched. A device, so part of the
	// stream: checkpoints made before it existed restore without one.
	Balloon bool `json:"balloon,omitempty"`

	// Host-side settings of the QEMU process, not of the guest's devices: not saved
	// with a checkpoint (a restore takes the runtime's current ones).
	Host hostOpts `json:"-"`
}

// hostOpts are the settings of a VM's QEMU process the guest does not see.
type hostOpts struct {
	// TCGCacheMB sizes TCG's translated-code cache (tb-size), 0 for tcgCacheMB.
	TCGCacheMB int
	// THP lets the host back guest RAM with transparent huge pages (QEMU asks for
	// them on its RAM with MADV_HUGEPAGE). Off, the jail disables them for the process
	// (PR_SET_THP_DISABLE): the guest's scattered pages then cost 4 KiB each on the host
	// instead of 2 MiB, which saved 9 MiB of an idle 512 MiB guest without the balloon
	// and nothing with it (its reports free whole 2 MiB blocks), while huge pages
	// speed up a KVM guest: on by default.
	THP bool
}

// defaultHostOpts is what the runtime gives every QEMU process (docs/benchmarks.md,
// "QEMU memory", has what each setting saves).
func defaultHostOpts() hostOpts { return hostOpts{TCGCacheMB: tcgCacheMB, THP: true} }

// tcgCacheMB sizes TCG's translated-code cache (MiB); an idle guest fills it. Measured
// on 512 MiB guests (TestIdleMemory): 16 MiB holds 16 MiB less code and ~3 MiB less of
// QEMU's bookkeeping than 32 at the same boot time; 8 MiB nearly tripled the boot (the
// kernel's code retranslated over and over).
const tcgCacheMB = 16

// maxCmdline is the x86 kernel's command line limit (COMMAND_LINE_SIZE) with some room.
const maxCmdline = 2000

// kernelCmdline is the guest kernel's command line: console on the virtio console,
// quiet (console output is slow under TCG), no reboot (a dead agent ends the VM) and
// the agent's environment (see package vmboot).
func kernelCmdline(agentEnv map[string]string, tscKHz int64) (string, error) {
	env := map[string]string{}
	for k, v := range agentEnv {
		env[k] = v
	}
	env["SPACE_AGENT_LISTEN"] = vmboot.DefaultListen
	envArg, err := vmboot.EncodeEnv(env)
	if err != nil {
		return "", err
	}
	args := []string{
		"console=hvc0", vmboot.VMFlag, "quiet", "panic=-1", "reboot=t",
		// No PS/2 controller or PCI bus to probe on microvm; QEMU's TSC is stable
		// (under TCG the watchdog would otherwise demote it to jiffies); no crypto
		// self-tests, no audit: each saves boot time under TCG.
		"i8042.noaux", "i8042.nomux", "i8042.nopnp", "pci=off",
		"tsc=reliable", "cryptomgr.notests", "audit=0",
	}
	if tscKHz > 0 {
		// See hostTSCkHz: without it a TCG guest hangs now and then at boot.
		args = append(args, "tsc_early_khz="+strconv.FormatInt(tscKHz, 10))
	}
	s := strings.Join(append(args, envArg), " ")
	if len(s) > maxCmdline {
		return "", fmt.Errorf("kernel command line too long (%d bytes): agent environment too large", len(s))
	}
	return s, nil
}

// args is QEMU's command line for an instance. name identifies the process (see
// procName); incoming makes QEMU wait for a migration stream instead of booting.
func (m machine) args(name string, incoming bool) []string {
	fd := strconv.Itoa
	a := []string{
		"-name", name,
		// ACPI describes the virtio-mmio devices to the guest (Debian's kernel lacks
		// CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES); no option ROMs, no ISA serial port.
		"-M", "microvm,acpi=on,x-option-roms=off,isa-serial=off,rtc=on",
	}
	switch m.Accel {
	case AccelKVM:
		a = append(a, "-accel", AccelKVM, "-cpu", "host")
	default:
		// TCG's translated-code cache defaults to 1 GiB; a sandbox's working set fits
		// in far less and the cache is part of the VM's resident memory.
		tb := m.Host.TCGCacheMB
		if tb <= 0 {
			tb = tcgCacheMB
		}
		a = append(a, "-accel", AccelTCG+",tb-size="+strconv.Itoa(tb))
	}
	a = append(a,
		"-m", strconv.Itoa(m.MemoryMB),
		"-smp", strconv.Itoa(m.CPU),
		"-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
		"-sandbox", sandboxOpts,
		// A bounded block I/O thread pool: the cgroup's pids limit must fit QEMU's threads.
		"-object", "main-loop,id=main-loop,thread-pool-max="+strconv.Itoa(threadPoolMax),
		"-kernel", jailKernel,
		"-initrd", jailInitrd,
		"-append", m.Append,
		// The disk, read-write and read-only, opened by the node.
		"-add-fd", "fd="+fd(fdDisk)+",set=1",
		"-add-fd", "fd="+fd(fdDiskRO)+",set=1",
		"-drive", "id=root,if=none,format=raw,cache=writeback,discard=unmap,file=/dev/fdset/1",
		"-device", "virtio-blk-device,drive=root",
		"-device", "virtio-serial-device",
		"-add-fd", "fd="+fd(fdConsole)+",set=2",
		"-chardev", "file,id=console,append=on,path=/dev/fdset/2",
		"-device", "virtconsole,chardev=console",
		"-chardev", "socket,id=agent,server=on,wait=off,fd="+fd(fdAgent),
		"-device", "virtserialport,chardev=agent,name="+vmboot.PortName,
		"-device", "virtio-rng-device",
		"-chardev", "socket,id=qmp,server=on,wait=off,fd="+fd(fdQMP),
		"-mon", "chardev=qmp,mode=control",
	)
	if m.Balloon {
		// Free page reporting only: the balloon is never inflated (a sandbox's memory
		// limit is its guest size); deflate-on-oom lets a guest short of memory take
		// any pages back from it all the same.
		a = append(a, "-device", "virtio-balloon-device,free-page-reporting=on,deflate-on-oom=on")
	}
	if m.Network {
		// The tap was made by the node in the sandbox's namespace; QEMU only gets its
		// descriptor (it stays in its own empty namespace).
		a = append(a,
			"-netdev", "tap,id=net0,fd="+fd(fdTap),
			"-device", "virtio-net-device,netdev=net0,mac="+guestMAC)
	}
	if incoming {
		a = append(a, "-incoming", "defer", "-S")
	}
	return a
}

func writeMachine(dir string, m machine) error {
	data, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, machineFile), append(data, '\n'), 0o600)
}

func readMachine(dir string) (machine, error) {
	var m machine
	data, err := os.ReadFile(filepath.Join(dir, machineFile))
	if err != nil {
		return m, err
	}
	if err := json.Unmarshal(data, &m); err != nil {
		return m, fmt.Errorf("%s: %w", filepath.Join(dir, machineFile), err)
	}
	if m.MemoryMB <= 0 || m.CPU <= 0 || m.Kernel == "" {
		return m, fmt.Errorf("%s: incomplete machine", filepath.Join(dir, machineFile))
	}
	return m, nil
}
