// Package api holds the public wire types of space's HTTP API (control plane and data
// plane) and the OpenAPI document that describes them. It has no behaviour: the server
// encodes these types and the Go client decodes them.
package api

import (
	"encoding/json"
	"time"
)

// Sandbox states, as observed by the node that runs the sandbox.
const (
	StatePending  = "pending"
	StateCreating = "creating"
	// StateStarting is a stopped sandbox booting from its disk (start, or wake of a
	// stopped sandbox).
	StateStarting   = "starting"
	StateRunning    = "running"
	StatePausing    = "pausing"
	StatePaused     = "paused"
	StateResuming   = "resuming"
	StateSuspending = "suspending"
	StateSuspended  = "suspended"
	StateRestoring  = "restoring"
	StateStopping   = "stopping"
	StateStopped    = "stopped"
	StateDeleting   = "deleting"
	StateDeleted    = "deleted"
	StateFailed     = "failed"
)

// Operation states.
const (
	OpPending   = "pending"
	OpRunning   = "running"
	OpSucceeded = "succeeded"
	OpFailed    = "failed"
)

// Operation kinds.
const (
	OpCreate        = "create"
	OpDelete        = "delete"
	OpStart         = "start"
	OpStop          = "stop"
	OpPause         = "pause"
	OpResume        = "resume"
	OpSuspend       = "suspend"
	OpRestore       = "restore"
	OpWake          = "wake"
	OpClone         = "clone"
	OpTemplateBuild = "template_build"
	// OpNodeDrain moves every running sandbox off a node (space node drain).
	OpNodeDrain = "node_drain"
)

// Sandbox is one isolated machine.
type Sandbox struct {
	ID string `json:"id"`
	// Tenant is the tenant the sandbox belongs to.
	Tenant   string `json:"tenant,omitempty"`
	Template string `json:"template"`
	// TemplateDigest is the content digest of the release the sandbox was created
	// from ("sha256:…"). Empty until the template reference is resolved.
	TemplateDigest string `json:"template_digest,omitempty"`
	State          string `json:"state"`
	DesiredState   string `json:"desired_state"`
	CPU            int    `json:"cpu"`
	MemoryMB       int    `json:"memory_mb"`
	// DiskMB is the disk limit: what the sandbox may write to its disk (its suspend
	// snapshots are kept beside it, within disk_mb + memory_mb + 64 MiB).
	DiskMB    int               `json:"disk_mb,omitempty"`
	Env       map[string]string `json:"env,omitempty"`
	Metadata  map[string]string `json:"metadata,omitempty"`
	Runtime   string            `json:"runtime,omitempty"`
	Node      string            `json:"node,omitempty"`
	StartPath string            `json:"start_path,omitempty"`
	Error     string            `json:"error,omitempty"`
	CreatedAt time.Time         `json:"created_at"`
	UpdatedAt time.Time         `json:"updated_at"`
	// ExpiresAt is when the sandbox's TTL ends and it is deleted.
	ExpiresAt *time.Time `json:"expires_at,omitempty"`
	// IdleTimeout is how long the sandbox may be idle before it is suspended.
	IdleTimeout string `json:"idle_timeout,omitempty"`
	// LastActivityAt is the last API request, attached stream or process output.
	LastActivityAt time.Time `json:"last_activity_at"`
	// StatusReason says why the sandbox is in its state (e.g. why it was suspended).
	StatusReason string `json:"status_reason,omitempty"`
	// StatusAt is when the sandbox last reached a resting state.
	StatusAt *time.Time `json:"status_at,omitempty"`
	// CloneOf is the sandbox this one was cloned from.
	CloneOf string `json:"clone_of,omitempty"`
	// Snapshot is the named snapshot the sandbox was created from.
	Snapshot string `json:"snapshot,omitempty"`
	// DiskBytes is the disk space the sandbox uses exclusively (not shared with its
	// template or clones), as last measured.
	DiskBytes int64 `json:"disk_bytes"`
	// Network is the sandbox's network policy (absent: no network). Secrets are not
	// shown: header values read "[redacted]", the egress proxy's password is omitted.
	Network *Network `json:"network,omitempty"`
	// SnapshotPushed: its suspend snapshot is in the fleet's registry, so it can wake on
	// another node (docs/operations.md, "When a node dies").
	SnapshotPushed bool `json:"snapshot_pushed,omitempty"`
	// MovedAt is when the sandbox last moved to another node (a drain, or a wake after
	// its node died); MoveDowntimeMs how long it did not run for that move.
	MovedAt        *time.Time `json:"moved_at,omitempty"`
	MoveDowntimeMs int64      `json:"move_downtime_ms,omitempty"`
	// CheckpointInterval is how often its node checkpoints it to the registry (its
	// create's checkpoint_interval); CheckpointAt is when the last one was pushed.
	CheckpointInterval string     `json:"checkpoint_interval,omitempty"`
	CheckpointAt       *time.Time `json:"checkpoint_at,omitempty"`
	// CheckpointLossMs: restored on another node from its last periodic checkpoint
	// after its node died, it lost this much of its run (the time from that checkpoint
	// to the node's death).
	CheckpointLossMs int64 `json:"checkpoint_loss_ms,omitempty"`
	// Operation is the operation that created the sandbox (set on create responses).
	Operation *Operation `json:"operation,omitempty"`
}

// CreateSandboxRequest is the body of POST /v1/sandboxes.
type CreateSandboxRequest struct {
	// Template is a template reference: "name", "name:tag" or "name@sha256:…".
	// Defaults to "base".
	Template string `json:"template,omitempty"`
	CPU      int    `json:"cpu,omitempty"`
	MemoryMB int    `json:"memory_mb,omitempty"`
	// DiskMB bounds what the sandbox may write to its disk (default: the template's,
	// else the server's). Writes past it fail with ENOSPC or EDQUOT inside the sandbox.
	// Its suspend snapshots are kept beside it, within disk_mb + memory_mb + 64 MiB.
	DiskMB   int               `json:"disk_mb,omitempty"`
	Env      map[string]string `json:"env,omitempty"`
	Metadata map[string]string `json:"metadata,omitempty"`
	// TTL is a Go duration ("30m", "2h"); the sandbox is deleted when it ends.
	TTL string `json:"ttl,omitempty"`
	// Runtime asks for a specific runtime ("gvisor", "qemu", "firecracker").
	Runtime string `json:"runtime,omitempty"`
	// IdleTimeout is a Go duration after which an idle sandbox is suspended (default:
	// the server's, 6h). "0" never suspends.
	IdleTimeout string `json:"idle_timeout,omitempty"`
	// FreshBoot skips the warm pool and the base snapshot: the sandbox boots.
	FreshBoot bool `json:"fresh_boot,omitempty"`
	// CheckpointInterval is a Go duration (at least 10s): its node checkpoints the
	// running sandbox this often and pushes the checkpoint to the fleet's registry, so
	// that if the node dies the sandbox is restored on another node from the last one
	// instead of being lost (docs/operations.md, "When a node dies"). Each checkpoint
	// pauses the sandbox briefly. Needs nodes with a registry; ignored without one.
	CheckpointInterval string `json:"checkpoint_interval,omitempty"`
	// Network is the sandbox's network policy. Absent: the server's default (no network
	// unless the operator configured another, see docs/networking.md).
	Network *Network `json:"network,omitempty"`
	// Snapshot creates the sandbox from a named snapshot (its id or name) instead of
	// a template: it restores the snapshot's memory and disk, with a new id and
	// identity, on the node that holds it. Template, resources and runtime are the
	// snapshot's (giving others is an error); env is added to the snapshot's.
	Snapshot string `json:"snapshot,omitempty"`
}

// CloneRequest is the body of POST /v1/sandboxes/{id}/clone.
type CloneRequest struct {
	// Count is how many clones to make (default 1, at most 50).
	Count int `json:"count,omitempty"`
	// Metadata of the clones (default: the source's).
	Metadata map[string]string `json:"metadata,omitempty"`
	TTL      string            `json:"ttl,omitempty"`
}

// CloneResponse lists the new sandboxes, each with its create operation.
type CloneResponse struct {
	Sandboxes []Sandbox `json:"sandboxes"`
}

// Pool is a warm pool: Size parked sandboxes of a template and size class.
type Pool struct {
	// Tenant is the tenant whose creates claim the pool's members.
	Tenant   string `json:"tenant,omitempty"`
	Template string `json:"template"`
	CPU      int    `json:"cpu"`
	MemoryMB int    `json:"memory_mb"`
	Size     int    `json:"size"`
	// Ready is how many parked sandboxes are ready to be claimed now.
	Ready int `json:"ready"`
}

// SetPoolRequest is the body of PUT /v1/pools.
type SetPoolRequest struct {
	// Tenant names the pool's tenant (operators only; default: the caller's).
	Tenant   string `json:"tenant,omitempty"`
	Template string `json:"template"`
	CPU      int    `json:"cpu,omitempty"`
	MemoryMB int    `json:"memory_mb,omitempty"`
	Size     int    `json:"size"`
}

// SandboxList is the body of GET /v1/sandboxes.
type SandboxList struct {
	Sandboxes []Sandbox `json:"sandboxes"`
}

// Operation is the record of one asynchronous lifecycle request.
type Operation struct {
	ID        string `json:"id"`
	Kind      string `json:"kind"`
	SandboxID string `json:"sandbox_id,omitempty"`
	// Template is the template a build operation builds (name:tag).
	Template string `json:"template,omitempty"`
	// Snapshot is the snapshot a snapshot operation takes.
	Snapshot  string     `json:"snapshot,omitempty"`
	State     string     `json:"state"`
	Message   string     `json:"message,omitempty"`
	Error     string     `json:"error,omitempty"`
	CreatedAt time.Time  `json:"created_at"`
	UpdatedAt time.Time  `json:"updated_at"`
	DoneAt    *time.Time `json:"done_at,omitempty"`
	// Node is the node a node_drain operation drains; Moves what became of each
	// sandbox it moves.
	Node  string        `json:"node,omitempty"`
	Moves []SandboxMove `json:"moves,omitempty"`
	// Timeline says where the operation's time went: its phases in order, from
	// "accepted" (created_at) to "done" (done_at), for operations whose phases were
	// recorded (creates, wakes and the other lifecycle verbs a node carries out).
	Timeline []TimelineEntry `json:"timeline,omitempty"`
}

// SandboxMove is one sandbox a drain moves to another node.
type SandboxMove struct {
	SandboxID string `json:"sandbox_id"`
	// State is "moving", "moved", "failed" (it could not move; it runs where it was,
	// Error says why) or "deleted" (a warm-pool member, which its pool refills elsewhere,
	// or a sandbox deleted meanwhile).
	State string `json:"state"`
	// To is the node it runs on now (moved).
	To string `json:"to,omitempty"`
	// DowntimeMs is how long it did not run: from its checkpoint to its restore there.
	DowntimeMs int64  `json:"downtime_ms,omitempty"`
	Error      string `json:"error,omitempty"`
}

// TimelineEntry is one phase of an operation's timeline.
type TimelineEntry struct {
	// Phase is what was reached: accepted, claimed (a warm-pool member was taken),
	// node (the node began), recorded (it recorded the transition), disk, instance,
	// restored, resumed, agent, identity, quiesced (the agent closed its transport for
	// a checkpoint), checkpointed, destroyed, reported (the state it reached), done.
	Phase string `json:"phase"`
	// At is when, by the clock of the process that recorded it.
	At time.Time `json:"at"`
	// Ms is At in milliseconds after the operation was accepted.
	Ms float64 `json:"ms"`
}

// Done reports whether the operation reached a terminal state.
func (o *Operation) Done() bool { return o.State == OpSucceeded || o.State == OpFailed }

// CreateSessionRequest is the body of POST /v1/sandboxes/{id}/sessions. Either a new
// command (Command or Argv) or an existing process (PID) is given.
type CreateSessionRequest struct {
	// Argv runs a program directly.
	Argv []string `json:"argv,omitempty"`
	// Command runs through "/bin/bash -c" (or /bin/sh when bash is missing).
	Command string            `json:"command,omitempty"`
	Env     map[string]string `json:"env,omitempty"`
	Cwd     string            `json:"cwd,omitempty"`
	// User is "root" or "user"; default "root".
	User string `json:"user,omitempty"`
	// Timeout is a Go duration after which the process is killed; empty means none.
	Timeout string `json:"timeout,omitempty"`
	// Stdin keeps the process's stdin open for writes; otherwise it reads /dev/null.
	Stdin bool     `json:"stdin,omitempty"`
	PTY   *PTYSize `json:"pty,omitempty"`
	// PID re-attaches to an existing process instead of starting a new one.
	PID int `json:"pid,omitempty"`
	// ProcessUID, with PID, re-attaches only if the process is still the one with this
	// identity (CommandSession.ProcessUID); 410 if the sandbox lost it.
	ProcessUID string `json:"process_uid,omitempty"`
	// Rights narrows the token's rights; default all of read, stdin, resize, signal.
	Rights []string `json:"rights,omitempty"`
	// TokenTTL overrides the token lifetime (Go duration, at most the server's maximum).
	TokenTTL string `json:"token_ttl,omitempty"`
}

// ExecRequest is the body of POST /v1/sandboxes/{id}/exec: a command started and
// streamed in one request (the answer is the SSE stream of an attach, from offset 0).
type ExecRequest struct {
	// Argv runs a program directly; Command runs through "/bin/bash -c". One of them.
	Argv    []string          `json:"argv,omitempty"`
	Command string            `json:"command,omitempty"`
	Env     map[string]string `json:"env,omitempty"`
	Cwd     string            `json:"cwd,omitempty"`
	// User is "root" (the default) or another user of the sandbox.
	User string `json:"user,omitempty"`
	// Timeout is a Go duration after which the process group is killed; empty: none.
	Timeout string `json:"timeout,omitempty"`
	// Stdin is written to the command's stdin, which is then closed; without it (and
	// without StdinBase64) stdin is /dev/null.
	Stdin *string `json:"stdin,omitempty"`
	// StdinBase64 is Stdin for bytes that are not text (standard base64).
	StdinBase64 string `json:"stdin_base64,omitempty"`
}

// PTYSize is a terminal size.
type PTYSize struct {
	Rows int `json:"rows"`
	Cols int `json:"cols"`
}

// CommandSession is connection information and authorization for one process.
type CommandSession struct {
	SessionID string `json:"session_id"`
	SandboxID string `json:"sandbox_id"`
	PID       int    `json:"pid"`
	// ProcessUID identifies the process among all the sandbox ever ran (a pid can be
	// reused after the sandbox lost its instance; this never is). The token is bound
	// to it.
	ProcessUID string    `json:"process_uid"`
	AttachURL  string    `json:"attach_url"`
	Token      string    `json:"token"`
	ExpiresAt  time.Time `json:"expires_at"`
	Rights     []string  `json:"rights"`
}

// Token rights.
const (
	RightRead   = "read"
	RightStdin  = "stdin"
	RightResize = "resize"
	RightSignal = "signal"
)

// Process describes one process in a sandbox.
type Process struct {
	PID      int      `json:"pid"`
	Argv     []string `json:"argv"`
	Cwd      string   `json:"cwd,omitempty"`
	User     string   `json:"user,omitempty"`
	State    string   `json:"state"` // created, running, exited
	ExitCode *int     `json:"exit_code,omitempty"`
	Signal   string   `json:"signal,omitempty"`
	// Error says why the program could not be run; TimedOut that its timeout killed it.
	Error     string     `json:"error,omitempty"`
	TimedOut  bool       `json:"timed_out,omitempty"`
	PTY       bool       `json:"pty,omitempty"`
	Stdin     bool       `json:"stdin,omitempty"`
	StartedAt *time.Time `json:"started_at,omitempty"`
	EndedAt   *time.Time `json:"ended_at,omitempty"`
}

// Process states.
const (
	ProcCreated = "created"
	ProcRunning = "running"
	ProcExited  = "exited"
)

// Attach stream (SSE) event names.
const (
	EventStart  = "start"
	EventStdout = "stdout"
	EventStderr = "stderr"
	EventGap    = "gap"
	EventExit   = "exit"
	EventError  = "error"
	// EventLost ends a stream whose process is gone without an exit of its own: the
	// sandbox's instance was lost (its memory and processes with it) and booted again.
	EventLost = "lost"
)

// Output stream encoding "frames" (Accept: application/vnd.space.frames, or
// ?encoding=frames), for attach streams and POST /v1/sandboxes/{id}/exec: the same
// events as SSE, each a binary frame of a FrameHeaderSize-byte header — type (1 byte),
// offset (8 bytes, big-endian), payload length (4 bytes, big-endian) — and the payload.
// Stdout and stderr payloads are the raw output bytes at the offset (no base64, no
// JSON); the other payloads are the JSON of the SSE event's data. The offset of output
// frames is the first byte's; the resume point (the SSE event id, for Last-Event-ID or
// ?from=) is offset+length after an output frame and offset after a gap or exit frame.
const (
	FramesContentType      = "application/vnd.space.frames"
	FrameStdout       byte = 1 // raw bytes
	FrameStderr       byte = 2 // raw bytes
	FrameGap          byte = 3 // GapEvent
	FrameExit         byte = 4 // ExitEvent
	FrameHeartbeat    byte = 5 // no payload
	FrameStart        byte = 6 // StartEvent
	FrameError        byte = 7 // {"message": "..."}
	FrameLost         byte = 8 // LostEvent
	FrameHeaderSize        = 13
	// MaxFramePayload bounds a frame's payload.
	MaxFramePayload = 1 << 20
)

// StartEvent is the data of the "start" event.
type StartEvent struct {
	PID int `json:"pid"`
	// ProcessUID is the process's identity, sent by POST /v1/sandboxes/{id}/exec so a
	// client that lost the stream can re-attach with a session {"pid","process_uid"}.
	ProcessUID string `json:"process_uid,omitempty"`
	// Offset is the journal offset the stream begins at.
	Offset int64 `json:"offset"`
}

// OutputEvent is the data of "stdout" and "stderr" events. The event id is Offset+len.
type OutputEvent struct {
	Offset int64 `json:"offset"`
	// Data is base64 (standard encoding), unless the stream was opened with
	// encoding=text, in which case Text holds the bytes as UTF-8 (invalid sequences
	// replaced).
	Data string `json:"data,omitempty"`
	Text string `json:"text,omitempty"`
}

// GapEvent says that bytes fell out of the journal before this reader got them.
type GapEvent struct {
	Offset  int64 `json:"offset"`
	Dropped int64 `json:"dropped"`
}

// ExitEvent is the data of the "exit" event.
type ExitEvent struct {
	ExitCode *int   `json:"exit_code,omitempty"`
	Signal   string `json:"signal,omitempty"`
	Offset   int64  `json:"offset"`
	// Error says why the program could not be run (exit code 127: not found; 126:
	// any other failure to execute it).
	Error string `json:"error,omitempty"`
	// TimedOut says the process was killed because its timeout passed.
	TimedOut bool `json:"timed_out,omitempty"`
}

// LostEvent is the data of the "lost" event.
type LostEvent struct {
	PID     int    `json:"pid"`
	Message string `json:"message"`
}

// Error is the body of every error response: {"error": {...}}.
type Error struct {
	Error ErrorBody `json:"error"`
}

// ErrorBody carries a stable code and a human message.
type ErrorBody struct {
	Code    string `json:"code"`
	Message string `json:"message"`
	// Limit names the quota or rate limit a refused request ran into
	// (quota_exceeded, too_many_requests).
	Limit *LimitExceeded `json:"limit,omitempty"`
}

// LimitExceeded describes the limit a request was refused for.
type LimitExceeded struct {
	// Name is the quota (running_sandboxes, vcpus, memory_mb, disk_mb, operations) or
	// request_rate.
	Name  string `json:"name"`
	Limit int64  `json:"limit"`
	// Usage is what the tenant uses now; Requested what the request would add.
	Usage     int64 `json:"usage"`
	Requested int64 `json:"requested"`
}

// APIKey describes an API key (never its secret, except once on creation).
type APIKey struct {
	ID     string `json:"id"`
	Name   string `json:"name"`
	Prefix string `json:"prefix"`
	Kind   string `json:"kind"` // "space" or "e2b"
	// Tenant is the key's tenant (an operator key's home tenant).
	Tenant string `json:"tenant"`
	// Role is operator, admin (of its tenant) or member.
	Role string `json:"role"`
	// Admin is true for operator and admin keys (they manage keys).
	Admin     bool       `json:"admin"`
	CreatedAt time.Time  `json:"created_at"`
	RevokedAt *time.Time `json:"revoked_at,omitempty"`
	// Secret is set only in the response that created the key.
	Secret string `json:"secret,omitempty"`
}

// CreateAPIKeyRequest is the body of POST /v1/apikeys.
type CreateAPIKeyRequest struct {
	Name string `json:"name"`
	Kind string `json:"kind,omitempty"`
	// Tenant is the new key's tenant: required from operators; a tenant's admin
	// creates keys in its own tenant only.
	Tenant string `json:"tenant,omitempty"`
	// Role is member (the default), admin or operator (operators only).
	Role string `json:"role,omitempty"`
	// Admin is role admin (kept for older clients).
	Admin bool `json:"admin,omitempty"`
}

// Key roles.
const (
	RoleOperator = "operator"
	RoleAdmin    = "admin"
	RoleMember   = "member"
)

// Tenant is a tenant with its quotas and what it uses of them.
type Tenant struct {
	Name      string       `json:"name"`
	CreatedAt time.Time    `json:"created_at"`
	Quota     []QuotaUsage `json:"quota"`
}

// QuotaUsage is one quota of a tenant and its use.
type QuotaUsage struct {
	// Name is running_sandboxes, vcpus, memory_mb, disk_mb, operations, request_rate
	// (requests per second) or request_burst.
	Name string `json:"name"`
	// Limit is -1 when unlimited.
	Limit int64 `json:"limit"`
	// Default is true when the limit is the server's default (not set for the tenant).
	Default bool `json:"default"`
	// Usage is what the tenant uses now (0 for the request rate quotas).
	Usage int64 `json:"usage"`
}

// CreateTenantRequest is the body of POST /v1/tenants.
type CreateTenantRequest struct {
	Name string `json:"name"`
}

// SetQuotaRequest is the body of PUT /v1/tenants/{name}/quota: the quotas given are
// set (-1 is unlimited), those named in Reset return to the server's defaults, the
// others stay.
type SetQuotaRequest struct {
	RunningSandboxes *int64   `json:"running_sandboxes,omitempty"`
	VCPUs            *int64   `json:"vcpus,omitempty"`
	MemoryMB         *int64   `json:"memory_mb,omitempty"`
	DiskMB           *int64   `json:"disk_mb,omitempty"`
	Operations       *int64   `json:"operations,omitempty"`
	RequestRate      *int64   `json:"request_rate,omitempty"`
	RequestBurst     *int64   `json:"request_burst,omitempty"`
	Reset            []string `json:"reset,omitempty"`
}

// Node describes one host running the node role.
type Node struct {
	ID           string    `json:"id"`
	Name         string    `json:"name"`
	Runtime      string    `json:"runtime"`
	RuntimeInfo  any       `json:"runtime_info,omitempty"`
	DataPlaneURL string    `json:"data_plane_url"`
	State        string    `json:"state"` // alive, dead
	HeartbeatAt  time.Time `json:"heartbeat_at"`
	Sandboxes    int       `json:"sandboxes"`
	// Cordoned nodes get no new placements.
	Cordoned bool `json:"cordoned,omitempty"`
	// DeadReason says why and since when a dead node is dead.
	DeadReason string `json:"dead_reason,omitempty"`
	// Capacity is what the node offers its sandboxes (0 in a field: unbounded); Used
	// what its sandboxes take of it (docs/operations.md, "Capacity and placement").
	Capacity NodeResources `json:"capacity"`
	Used     NodeResources `json:"used"`
	// Cache is what the node holds on its disk that a sandbox placed there can start
	// or wake from without fetching it.
	Cache NodeCache `json:"cache"`
}

// NodeCache is what a node holds: template releases and named snapshots.
type NodeCache struct {
	Releases      int   `json:"releases"`
	ReleaseBytes  int64 `json:"release_bytes"`
	Snapshots     int   `json:"snapshots"`
	SnapshotBytes int64 `json:"snapshot_bytes"`
}

// NodeResources is an amount of what a node offers its sandboxes.
type NodeResources struct {
	CPU      int   `json:"cpu"`
	MemoryMB int64 `json:"memory_mb"`
	DiskMB   int64 `json:"disk_mb"`
}

// RemovedNode is the body of DELETE /v1/nodes/{name}.
type RemovedNode struct {
	Node Node `json:"node"`
	// SandboxesDeleted counts the sandboxes still recorded on the (dead) node, deleted
	// with it.
	SandboxesDeleted int `json:"sandboxes_deleted"`
	// SnapshotsDeleted counts the named snapshots kept on the node, deleted with it.
	SnapshotsDeleted int `json:"snapshots_deleted"`
}

// Template describes a template release.
type Template struct {
	// Tenant owns the template; empty for shared templates (builtin ones and those
	// operators build), which every tenant may use.
	Tenant    string    `json:"tenant,omitempty"`
	Name      string    `json:"name"`
	Tags      []string  `json:"tags,omitempty"`
	Digest    string    `json:"digest"`
	SizeBytes int64     `json:"size_bytes,omitempty"`
	CreatedAt time.Time `json:"created_at"`
}

// WhoAmI is the body of GET /v1/whoami: the caller's API key.
type WhoAmI struct {
	KeyID  string `json:"key_id"`
	Tenant string `json:"tenant"`
	Role   string `json:"role"`
	// Admin is true for operator and admin keys.
	Admin bool `json:"admin"`
}

// TemplateDetail is the body of GET /v1/templates/{name}.
type TemplateDetail struct {
	Name string `json:"name"`
	// Tags maps each tag to the digest it points at.
	Tags     map[string]string `json:"tags"`
	Releases []TemplateRelease `json:"releases"`
}

// TemplateRelease describes one release of a template.
type TemplateRelease struct {
	// Ref is the release's immutable reference, name@sha256:….
	Ref       string          `json:"ref"`
	Digest    string          `json:"digest"`
	Tags      []string        `json:"tags"`
	SizeBytes int64           `json:"size_bytes"`
	CreatedAt time.Time       `json:"created_at"`
	Config    json.RawMessage `json:"config"`
	// Nodes are the ids of the nodes that hold the release's files.
	Nodes []string `json:"nodes"`
}

// TemplateDeleted is the body of DELETE /v1/templates/{ref}.
type TemplateDeleted struct {
	// Deleted is the tag (name:tag) or release (name@sha256:…) removed.
	Deleted string `json:"deleted"`
	Digest  string `json:"digest"`
	// Nodes are the nodes asked to remove the release's files (release deletes only).
	Nodes []string `json:"nodes,omitempty"`
}

// FileInfo describes one file system entry in a sandbox (symbolic links are not
// followed).
type FileInfo struct {
	Name string `json:"name"`
	Path string `json:"path"`
	// Type is file, dir, symlink or other.
	Type string `json:"type"`
	Size int64  `json:"size"`
	// Mode holds the permission bits (07777).
	Mode uint32 `json:"mode"`
	// Permissions is the ls(1) style mode string, e.g. "-rw-r--r--".
	Permissions   string    `json:"permissions"`
	Owner         string    `json:"owner"`
	Group         string    `json:"group"`
	UID           uint32    `json:"uid"`
	GID           uint32    `json:"gid"`
	ModifiedTime  time.Time `json:"modified_time"`
	SymlinkTarget string    `json:"symlink_target,omitempty"`
}

// MkdirRequest is the body of POST /v1/sandboxes/{id}/files/mkdir.
type MkdirRequest struct {
	Path string `json:"path"`
	// User owns the new directories and resolves relative paths (default root).
	User string `json:"user,omitempty"`
	// Mode defaults to 0755.
	Mode uint32 `json:"mode,omitempty"`
	// Parents creates missing parent directories.
	Parents bool `json:"parents,omitempty"`
}

// MoveRequest is the body of POST /v1/sandboxes/{id}/files/move.
type MoveRequest struct {
	From string `json:"from"`
	To   string `json:"to"`
	User string `json:"user,omitempty"`
}

// WatchEvent is the data of a file watch SSE event (event name = Type: create, write,
// remove, rename, chmod, overflow).
type WatchEvent struct {
	Type  string `json:"type"`
	Path  string `json:"path,omitempty"`
	Name  string `json:"name,omitempty"`
	IsDir bool   `json:"is_dir,omitempty"`
}

// Network is a sandbox's network spec. Its shape follows E2B's SandboxNetworkConfig so
// that the E2B gateway maps it field by field (see docs/networking.md).
//
// With Egress off (the default) the sandbox has no network at all. With Egress on, a
// destination is reached when it is not always-denied (loopback, link-local and cloud
// metadata, private and shared ranges, the host's own addresses, other sandboxes) and
// either matches AllowOut, or does not match DenyOut. Allow wins over deny: DenyOut
// "0.0.0.0/0" with a few AllowOut entries is an allowlist.
type Network struct {
	// Egress turns outbound networking on.
	Egress bool `json:"egress,omitempty"`
	// AllowOut lists IPv4 CIDRs ("203.0.113.0/24"), addresses, domains
	// ("api.example.com") and wildcards ("*.example.com": subdomains only).
	AllowOut []string `json:"allow_out,omitempty"`
	// DenyOut lists the same kinds of entries as AllowOut.
	DenyOut []string `json:"deny_out,omitempty"`
	// Rules maps a domain (or "*.domain") to rules applied to the sandbox's HTTPS
	// requests to it by the node's egress proxy, e.g. injecting an Authorization
	// header so that the secret never enters the sandbox.
	Rules map[string][]NetworkRule `json:"rules,omitempty"`
	// EgressProxy sends every outbound TCP connection through a SOCKS5 proxy. When it
	// cannot be reached the connection fails: egress never falls back to direct.
	EgressProxy *EgressProxy `json:"egress_proxy,omitempty"`
}

// NetworkRule is one rule for requests to a domain.
type NetworkRule struct {
	Transform *NetworkTransform `json:"transform,omitempty"`
}

// NetworkTransform changes a request on its way out.
type NetworkTransform struct {
	// Headers are set on the request (replacing what the sandbox sent).
	Headers map[string]string `json:"headers,omitempty"`
}

// EgressProxy is a SOCKS5 proxy that egress goes through.
type EgressProxy struct {
	// Address is "host:port".
	Address  string `json:"address"`
	Username string `json:"username,omitempty"`
	// Password is write-only: responses never carry it.
	Password string `json:"password,omitempty"`
}

// NetworkState is the body of GET and PATCH /v1/sandboxes/{id}/network.
type NetworkState struct {
	// Network is the policy the sandbox has (secrets redacted as in Sandbox.Network).
	Network Network `json:"network"`
	// Applied is true when the policy is in force on the sandbox's node now; false
	// while the sandbox has no network set up there (it is pending, or its node is
	// restarting): the stored policy is applied before it next runs.
	Applied bool `json:"applied"`
	// Address is the sandbox's IPv4 address on its node's sandbox network (never
	// routable from outside the node).
	Address string `json:"address,omitempty"`
	// Policy describes the policy in force as the node compiled it (no secrets).
	Policy string `json:"policy,omitempty"`
}

// NetworkEvent is one entry of a sandbox's egress audit log: a DNS query or a
// connection attempt, allowed or denied, or the end of an allowed connection.
type NetworkEvent struct {
	// Offset is the event's position in the sandbox's audit journal (0 = first ever).
	Offset int64     `json:"offset"`
	Time   time.Time `json:"time"`
	// Kind is "dns", "connect" (an attempt) or "close" (an allowed connection ended,
	// with its byte counts).
	Kind string `json:"kind"`
	// Verdict is "allowed" or "denied".
	Verdict string `json:"verdict"`
	// Reason says which rule decided (e.g. "allow_out", "deny_out", "forbidden",
	// "not_allowed", "dns_other_resolver", "rebinding", "sni_mismatch", "rate_limited").
	Reason string `json:"reason,omitempty"`
	// Protocol is "tcp", "udp", "icmp", "dns", "https", … (an IP protocol number
	// otherwise).
	Protocol string `json:"protocol"`
	// Destination is the address ("ip" or "ip:port").
	Destination string `json:"destination,omitempty"`
	// Domain is the name asked (dns) or the name the connection was for (SNI, Host,
	// or the name the resolver answered with that address).
	Domain string `json:"domain,omitempty"`
	// BytesOut and BytesIn count payload sent and received (close events).
	BytesOut int64 `json:"bytes_out,omitempty"`
	BytesIn  int64 `json:"bytes_in,omitempty"`
	// Count is how many identical denied attempts this event stands for (>1 when
	// repeats within a second were folded).
	Count int `json:"count,omitempty"`
}

// RedactedValue replaces secrets (header values of network rules) in responses.
const RedactedValue = "[redacted]"

// Redacted returns a copy of n without its secrets: header values read RedactedValue
// and the egress proxy's password is dropped. Nil stays nil.
func (n *Network) Redacted() *Network {
	if n == nil {
		return nil
	}
	out := *n
	out.AllowOut = append([]string(nil), n.AllowOut...)
	out.DenyOut = append([]string(nil), n.DenyOut...)
	if n.Rules != nil {
		out.Rules = make(map[string][]NetworkRule, len(n.Rules))
		for d, rules := range n.Rules {
			rs := make([]NetworkRule, len(rules))
			for i, r := range rules {
				if r.Transform != nil {
					t := &NetworkTransform{}
					if r.Transform.Headers != nil {
						t.Headers = make(map[string]string, len(r.Transform.Headers))
						for k := range r.Transform.Headers {
							t.Headers[k] = RedactedValue
						}
					}
					rs[i].Transform = t
				}
			}
			out.Rules[d] = rs
		}
	}
	if n.EgressProxy != nil {
		p := *n.EgressProxy
		p.Password = ""
		out.EgressProxy = &p
	}
	return &out
}

// Network event kinds and verdicts.
const (
	NetEventDNS     = "dns"
	NetEventConnect = "connect"
	NetEventClose   = "close"
	NetAllowed      = "allowed"
	NetDenied       = "denied"
	// EventNetwork is the SSE event of GET /v1/sandboxes/{id}/netlog: its data is a
	// NetworkEvent and its id the offset to resume from (the event's offset + 1).
	EventNetwork = "network"
)
