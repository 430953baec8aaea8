// Package runtime defines the contract between the node role and the isolation
// technologies that run sandboxes (gVisor, QEMU microvm, Firecracker). Each runtime lives
// in its own sub-package and passes the conformance suite in runtime/conformance.
//
// A runtime instance is identified by the sandbox id. The node owns storage (it hands the
// runtime a prepared root filesystem) and the runtime owns processes, sockets and
// runtime-specific state under Spec.StateDir. Everything a runtime creates for a sandbox
// must be found again from the sandbox id alone after the node restarts (Adopt), and
// removed by Destroy, even if Create failed half-way.
package runtime

import (
	"context"
	"errors"
	"net"
	"time"
)

// ErrNotFound is returned when the runtime has no instance with the given id.
var ErrNotFound = errors.New("runtime: instance not found")

// ErrUnsupported is returned for operations a runtime does not implement.
var ErrUnsupported = errors.New("runtime: operation not supported")

// Spec describes one sandbox instance to create.
type Spec struct {
	// ID is the sandbox id (lowercase alphanumerics).
	ID string
	// RootFS is the host path of the sandbox's writable root filesystem (a directory for
	// gVisor, an image file for VM runtimes).
	RootFS string
	// StateDir is a host directory private to this instance where the runtime keeps its
	// sockets, config and logs. It exists and is empty on Create.
	StateDir string
	// AgentPath is the host path of the space-agent binary to run as PID 1.
	AgentPath string
	// CPU is the number of vCPUs (or CPU quota in cores for gVisor).
	CPU int
	// MemoryMB bounds the sandbox's memory.
	MemoryMB int
	// PidsLimit bounds the number of host tasks (processes and threads) the sandbox's
	// processes on the host may have (cgroup pids.max); 0 takes the runtime's default.
	PidsLimit int
	// Network enables networking; the default (false) means no network at all.
	Network bool
	// NetNS is the path of a network namespace the node prepared for the instance
	// (only with Network).
	NetNS string
	// AgentEnv is passed to the agent process (not to user processes).
	AgentEnv map[string]string
}

// Status is what the runtime observes about an instance.
type Status string

// Instance statuses.
const (
	StatusRunning Status = "running"
	StatusPaused  Status = "paused"
	StatusStopped Status = "stopped" // exists but not running (crashed or exited)
)

// Instance is one sandbox instance known to the runtime.
type Instance struct {
	ID     string
	Status Status
}

// DiskFormat is how a runtime takes a sandbox's root filesystem.
type DiskFormat string

// Disk formats.
const (
	// DiskDir is a directory (a btrfs subvolume): gVisor.
	DiskDir DiskFormat = "dir"
	// DiskExt4 is an ext4 image file (reflinked per sandbox): VM runtimes.
	DiskExt4 DiskFormat = "ext4"
)

// Info describes the runtime on this host.
type Info struct {
	Name    string     `json:"name"`
	Disk    DiskFormat `json:"disk"`
	Version string     `json:"version"`
	// Caps is what the node must do differently for this runtime.
	Caps Caps `json:"caps"`
	// Details are shown to operators (platform, accelerator and why); nothing
	// branches on them.
	Details map[string]string `json:"details,omitempty"`
}

// AgentResume is how an agent learns its identity after a restore.
type AgentResume string

// Ways of resuming an agent.
const (
	// ResumeByAPI: the agent's transport survives a checkpoint (VM transports); it
	// keeps serving while quiesced and takes its identity over POST /v1/identity.
	ResumeByAPI AgentResume = "api"
	// ResumeByFile: the agent closes its host socket before a checkpoint (runsc
	// cannot checkpoint one) and reads its identity from the resume file the host
	// writes into its run directory (<StateDir>/run).
	ResumeByFile AgentResume = "file"
)

// Caps are the runtime's capabilities that change what the node does.
type Caps struct {
	AgentResume AgentResume `json:"agent_resume"`
	// Preload is a library every process in the sandbox needs preloaded (LD_PRELOAD),
	// at this path inside the sandbox; empty for none.
	Preload string `json:"preload,omitempty"`
	// Network is how the runtime puts a sandbox on the network namespace the node
	// prepared (Spec.NetNS); empty: it does not (the node then configures nothing
	// inside the sandbox).
	Network NetworkMode `json:"network,omitempty"`
	// ParkRunning: warm-pool members wait for their claim with their instance running
	// rather than paused, because a pause and a resume cost more than an idle instance
	// does (gVisor: each is a runsc process, about 30 ms, on a claim's path; an idle
	// sandbox uses about 0.3 % of a CPU). The sandbox is recorded paused either way:
	// nobody's, running nothing but its agent, not served to anyone.
	ParkRunning bool `json:"park_running,omitempty"`
}

// NetworkMode is how a runtime attaches a sandbox to its network namespace.
type NetworkMode string

// Network modes.
const (
	// NetworkNamespace: the sandbox's own network stack takes over the namespace's
	// interface with its address and routes (gVisor's netstack). The node sets the
	// guest's resolver.
	NetworkNamespace NetworkMode = "netns"
	// NetworkTap: the VM gets a tap device in the namespace; the guest's address,
	// route and resolver are configured through the agent.
	NetworkTap NetworkMode = "tap"
)

// Runtime is implemented by every isolation technology.
type Runtime interface {
	// Info reports the runtime's name and version.
	Info(ctx context.Context) (Info, error)
	// Create creates and starts an instance running the agent. It returns once the
	// runtime has started it (not necessarily once the agent answers). On error
	// everything it created is removed.
	Create(ctx context.Context, spec Spec) error
	// Dial opens a new stream connection to the instance's agent.
	Dial(ctx context.Context, id string) (net.Conn, error)
	// Status reports the instance's status, or ErrNotFound.
	Status(ctx context.Context, id string) (Status, error)
	// List reports every instance this runtime knows on the host (for adoption and
	// orphan reclamation after a restart).
	List(ctx context.Context) ([]Instance, error)
	// Adopt re-attaches to an instance that survived a node restart. spec is the same
	// spec Create received.
	Adopt(ctx context.Context, spec Spec) error
	// Destroy stops the instance and removes everything the runtime created for it.
	// It succeeds if the instance does not exist.
	Destroy(ctx context.Context, id string) error
}

// Snapshotter is implemented by runtimes that can freeze instances and save them.
//
// The node coordinates the agent around these calls: before Checkpoint it asks the
// agent to quiesce (close its transport), after Restore it hands the agent a new
// identity (fresh entropy, clock) before user code continues. The disk belongs to the
// node: it snapshots RootFS itself (btrfs) and passes the right one to Restore.
type Snapshotter interface {
	// Pause freezes the instance's CPUs; it stays resident.
	Pause(ctx context.Context, id string) error
	// Resume continues a paused instance.
	Resume(ctx context.Context, id string) error
	// Checkpoint writes the instance's memory and device state into dir (an empty
	// directory on the node's btrfs store) and stops the instance, freeing its
	// resources (Destroy is still called afterwards to remove leftovers). The node
	// fsyncs the files when it needs them durable, once: a runtime does not (a clone's
	// checkpoint is used at once, and a suspend's is synced after it is reported).
	// A checkpoint that fails leaves the instance as it was where the runtime can
	// (gVisor, QEMU): the node then has it run on rather than lose its memory.
	Checkpoint(ctx context.Context, id, dir string) error
	// Restore starts an instance from a checkpoint in dir. spec.RootFS may be a copy of
	// the disk the checkpoint was taken with (a clone); spec.ID may differ from the
	// checkpointed instance's id. On error everything it created is removed.
	Restore(ctx context.Context, spec Spec, dir string) error
}

// AgentMapper is implemented by Snapshotters whose checkpoints need a host file to
// restore: gVisor's restored agent maps its code from the agent binary it was started
// with, so a restore must mount that same binary (a VM's agent lives in guest memory,
// in the checkpoint itself). The node sends that binary with a checkpoint it pushes to
// another node, and installs a pulled one under <data-dir>/agents/.
type AgentMapper interface {
	// RestoreAgent returns the host file of the agent binary a restore of the
	// checkpoint in dir mounts on a node whose own agent is own: the binary the
	// checkpoint was taken with where it is found, else own.
	RestoreAgent(dir, own string) (string, error)
	// InstanceAgents returns the host files of the agent binaries the runtime's
	// instances run (a checkpoint of one records its own), so that the node keeps them.
	InstanceAgents() ([]string, error)
}

// LiveCheckpointer is implemented by Snapshotters that can checkpoint an instance
// without stopping it: a clone source or a named snapshot's source then needs no
// restore of its own.
type LiveCheckpointer interface {
	// CheckpointPaused writes a paused instance's memory and device state into dir as
	// Checkpoint does, and leaves it paused: nothing in it runs (and nothing it writes
	// reaches its disk) until Resume.
	CheckpointPaused(ctx context.Context, id, dir string) error
}

// MemoryBounder is implemented by runtimes whose instances may hold more memory than
// Spec.MemoryMB (gVisor: the host cgroup leaves room for what the Sentry spends on the
// guest's tasks, and the guest, which nothing else bounds, may use it). A checkpoint of
// such an instance can be as large as the bound: the node keeps that much room for
// checkpoints in the sandbox's disk quota.
type MemoryBounder interface {
	// MemoryBound is the most memory, in bytes, an instance of spec may hold.
	MemoryBound(spec Spec) int64
}

// MemoryWatcher is implemented by runtimes with no OOM killer inside, whose host's may
// end an instance whole when it passes its memory limit (gVisor): the node
// watches the instance and, when its memory nears the limit, asks the agent to end the
// process holding the most, as a guest kernel would.
type MemoryWatcher interface {
	// WatchMemory calls near(usage, limit) each time the instance's host memory rises
	// near its limit (both in bytes), one call at a time, until ctx is done or the
	// instance is gone (nil). It fails with ErrUnsupported when it cannot watch this
	// instance (no memory limit, or no cgroup of its own).
	WatchMemory(ctx context.Context, spec Spec, near func(usage, limit int64)) error
}

// CPUTimer is implemented by runtimes that can read the CPU time an instance has used
// from the host (its cgroup's counter) without waking anything inside it. The node's
// resource samples read it every round and ask the agent only when the sandbox did
// something since (docs/operations.md, "Sandbox metrics"): each question to an agent
// wakes the sandbox, which costs an idle gVisor sandbox several milliseconds of CPU.
type CPUTimer interface {
	// CPUTime reports the host CPU time the instance has used since it started (a
	// restore starts the count again). An error means the runtime cannot tell now
	// (no cgroup of its own, or not running); the node then asks the agent.
	CPUTime(ctx context.Context, id string) (time.Duration, error)
}
