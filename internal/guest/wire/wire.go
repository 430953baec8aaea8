// Package wire owns the host↔agent protocol: the JSON types of the agent's HTTP API and
// the binary frame format of its output streams. It is shared by space-agent (server)
// and the node role (client) and must stay free of heavy dependencies.
//
// Transport: plain HTTP/1.1 over any stream connection the runtime provides (a unix
// socket for gVisor, vsock or a yamux stream over virtio-serial for VMs). Every request
// is independent; long responses (output, watch) are streamed as frames.
//
// Endpoints (all paths under /v1):
//
//	GET    /v1/health                       → Health
//	POST   /v1/identity                     Identity → 204
//	POST   /v1/processes                    ProcessSpec → ProcessInfo (201)
//	GET    /v1/processes                    → []ProcessInfo
//	GET    /v1/processes/{pid}              → ProcessInfo
//	POST   /v1/processes/{pid}/start        → 204 (starts a gated process; idempotent)
//	GET    /v1/processes/{pid}/output?from=N&follow=1 → frame stream
//	POST   /v1/processes/{pid}/stdin[?eof=1] body = bytes → 204
//	POST   /v1/processes/{pid}/signal       Signal → 204
//	POST   /v1/processes/{pid}/resize       Resize → 204
//	POST   /v1/exec                         ExecRequest → frame stream from offset 0 (one call:
//	                                        create, run, feed stdin, follow to the exit frame);
//	                                        PIDHeader and UIDHeader name the process. Agents
//	                                        older than this call answer 404 without an error
//	                                        code: the host then takes the three calls above
//	GET    /v1/ports/{port}/connect         Connection: Upgrade, Upgrade: PortUpgrade →
//	                                        101, then the connection carries the bytes of a
//	                                        TCP connection the agent made to 127.0.0.1:port
//	                                        (::1 when nothing answers there) inside the
//	                                        sandbox, both ways; 502 ErrCodePortClosed when
//	                                        nothing listens. Quiesce and shutdown close it.
//	POST   /v1/quiesce                      → 204, then the agent closes its listener and
//	                                        every connection until <run dir>/resume holds an
//	                                        Identity with a newer generation (see ResumeFileName)
//
// Files (paths are absolute, or relative to the home of `user`; `~` is that home):
//
//	GET    /v1/files/content?path=&user=&offset=&length= → raw bytes (Content-Length)
//	PUT    /v1/files/content?path=&user=&mode=&append=1  body = bytes → EntryInfo
//	GET    /v1/files/stat?path=&user=                    → EntryInfo (lstat: links not followed)
//	GET    /v1/files/list?path=&user=&depth=             → []EntryInfo (depth 1 by default)
//	POST   /v1/files/mkdir                  MkdirRequest → EntryInfo (201)
//	POST   /v1/files/move                   MoveRequest → EntryInfo
//	DELETE /v1/files?path=&user=&recursive=1             → 204
//	GET    /v1/files/watch?path=&user=&recursive=1       → newline-delimited WatchEvent JSON;
//	                                        the first line is a "start" event, sent once the
//	                                        watch is in place; "heartbeat" lines when idle
//
// Errors are JSON Error bodies with a meaningful HTTP status: 400 bad path or arguments,
// 403 permission denied, 404 not found, 409 conflict (exists, not empty, process exited),
// 503 a process start while user code is frozen for a checkpoint (quiesced), 507 no
// space left, 500 anything else. Error.Code is one of the ErrCode constants.
package wire

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"time"
)

// AgentSocketName is the file name of the agent's unix socket inside the runtime's
// per-sandbox run directory (gVisor), and MountDir is where that directory appears
// inside the sandbox.
const (
	AgentSocketName = "agent.sock"
	// NodeSocketName is the file name of the node's unix socket in the same directory
	// (gVisor since 2026-12-06): the agent connects to it, a control connection and one
	// connection per HTTP connection the node asks for (package agentlink), so that no
	// socket of the sandbox's is a host socket (runsc --host-uds=open, not create).
	NodeSocketName = "node.sock"
	RunMountDir    = "/run/space"
	// AgentPath is where the agent binary is visible inside a sandbox.
	AgentPath = "/.space/space-agent"
	// Quiesce protocol (checkpoints need an agent without host connections):
	//  1. The host calls POST /v1/quiesce (204).
	//  2. The agent closes its listener and every connection, removes its socket file
	//     if it can, then creates QuiescedFileName in its run directory.
	//  3. The host waits for that file, checkpoints (and maybe restores), removes the
	//     socket file if it is still there (gVisor does not let the agent unlink a
	//     socket backed by the host), and writes ResumeFileName: a JSON Identity with a
	//     generation newer than the agent's (write to a temporary name, then rename).
	//  4. The agent applies the identity, deletes both files and listens again
	//     (retrying while the old socket file is in the way). Processes run on
	//     throughout; their output keeps going into the journals.
	QuiescedFileName = "quiesced"
	ResumeFileName   = "resume"
	// FileSizeHeader carries the whole file's size on GET /v1/files/content (the body
	// may be a range of it).
	FileSizeHeader = "X-Space-File-Size"
)

// UIDQuery is the query parameter that binds a process request to a process
// identity (ProcessInfo.UID).
const UIDQuery = "uid"

// ResumableHeader, on a request for a stream (an exec's output, a followed output, a
// watch), says that its caller resumes the stream by itself when it is cut. A relay in
// front of the agent (a node's data plane, for the api role) then ends it at once when
// it stops, instead of holding its stop for the stream (rest.EndAtStop). The agent
// ignores it.
const ResumableHeader = "X-Space-Resumable"

// Headers of the answer to POST /v1/exec: the process's pid and identity (the body is
// its output stream).
const (
	PIDHeader = "X-Space-Pid"
	UIDHeader = "X-Space-Process-Uid"
)

// Defaults of the agent's journal bound and exit retention (space serve passes its
// flags' values to every agent; these are the one source of the defaults).
const (
	DefaultJournalBytes = 8 << 20
	DefaultRetention    = 10 * time.Minute
)

// Health is the answer of GET /v1/health.
type Health struct {
	Version string `json:"version"`
	// BootID changes each time the agent process starts (not on restore).
	BootID string `json:"boot_id"`
	// Generation is the last identity generation applied (0 = none yet).
	Generation int64 `json:"generation"`
	// Frozen: user processes are stopped since a quiesce, until the next identity.
	Frozen bool      `json:"frozen,omitempty"`
	Time   time.Time `json:"time"`
	// LastActivity is the time of the last process output or the last request other
	// than /v1/health (for idle detection).
	LastActivity time.Time `json:"last_activity"`
}

// Identity gives a (possibly restored or cloned) sandbox its identity: fresh entropy,
// the host's clock and default environment. Generation increases with every restore.
type Identity struct {
	Generation int64 `json:"generation"`
	// Seed is 32+ random bytes mixed into the kernel entropy pool.
	Seed []byte `json:"seed"`
	// UnixNano is the host's clock when the request was sent.
	UnixNano int64             `json:"unix_nano"`
	Env      map[string]string `json:"env,omitempty"`
	Hostname string            `json:"hostname,omitempty"`
}

// ProcessSpec describes a process to start.
type ProcessSpec struct {
	// Argv is the program and its arguments. If Argv[0] has no slash it is looked up in
	// PATH (of the process's environment).
	Argv []string          `json:"argv"`
	Env  map[string]string `json:"env,omitempty"`
	Cwd  string            `json:"cwd,omitempty"`
	// User is a user name from the sandbox's /etc/passwd; empty means root.
	User string `json:"user,omitempty"`
	// Stdin keeps stdin open (writes via /stdin); otherwise stdin is /dev/null.
	Stdin bool  `json:"stdin,omitempty"`
	PTY   *Size `json:"pty,omitempty"`
	// TimeoutMs kills the process (SIGKILL) this long after it starts; 0 = never.
	TimeoutMs int64 `json:"timeout_ms,omitempty"`
	// Gated creates the process without running it: it gets its pid now and runs the
	// program when /start is called. Output can be attached to before the first byte.
	Gated bool `json:"gated,omitempty"`
	// Tag is an opaque label kept with the process (e.g. an E2B tag).
	Tag string `json:"tag,omitempty"`
	// Key makes POST /v1/exec and POST /v1/processes safe to send again: while the
	// agent keeps a process started with the same key (running, or exited within its
	// Retention and among its MaxExited most recent), a start with the key gets that
	// process (an exec streams its output from offset 0) instead of starting another;
	// with another command (spec or, for an exec, stdin) it is refused (422). Agents
	// from before 2026-12-07 ignore it (on POST /v1/processes, those built before
	// session keys, the same day, do too).
	Key string `json:"key,omitempty"`
}

// ExecRequest is the body of POST /v1/exec: a process (never gated: the answer is its
// output from offset 0, read by the agent itself from the start) and, when StdinData is
// set, bytes the agent writes to its stdin before closing it (Stdin is implied).
type ExecRequest struct {
	ProcessSpec
	StdinData []byte `json:"stdin_data,omitempty"`
}

// Size is a terminal size.
type Size struct {
	Rows uint16 `json:"rows"`
	Cols uint16 `json:"cols"`
}

// ProcessInfo describes a process known to the agent.
type ProcessInfo struct {
	PID int `json:"pid"`
	// UID identifies the process among every process the sandbox ever ran (its agent's
	// boot id and a sequence number): a pid can be reused after the sandbox's instance
	// was lost, a UID never is. Requests may name it (?uid=) to be sure to reach this
	// process and no other (410 ErrCodeProcessGone otherwise).
	UID      string            `json:"uid"`
	Argv     []string          `json:"argv"`
	Env      map[string]string `json:"env,omitempty"`
	Cwd      string            `json:"cwd,omitempty"`
	User     string            `json:"user,omitempty"`
	Tag      string            `json:"tag,omitempty"`
	State    string            `json:"state"` // created, running, exited
	ExitCode *int              `json:"exit_code,omitempty"`
	Signal   string            `json:"signal,omitempty"`
	// Error and TimedOut are those of the exit (Exit) once the process exited.
	Error     string     `json:"error,omitempty"`
	TimedOut  bool       `json:"timed_out,omitempty"`
	PTY       bool       `json:"pty,omitempty"`
	Stdin     bool       `json:"stdin,omitempty"`
	StartedAt *time.Time `json:"started_at,omitempty"`
	EndedAt   *time.Time `json:"ended_at,omitempty"`
	// Written is the total number of output bytes produced so far (journal end offset).
	Written int64 `json:"written"`
	// Retained is the first offset still held in the journal.
	Retained int64 `json:"retained"`
}

// Process states.
const (
	StateCreated = "created"
	StateRunning = "running"
	StateExited  = "exited"
)

// Signal is the body of /signal: a name like "SIGTERM" or "TERM", or a number.
type Signal struct {
	Signal string `json:"signal"`
}

// Resize is the body of /resize.
type Resize = Size

// Error is the body of an error response.
type Error struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

// Frame types of an output stream.
const (
	FrameStdout    byte = 1
	FrameStderr    byte = 2
	FrameGap       byte = 3 // Offset = first offset available; payload = uint64 dropped bytes
	FrameExit      byte = 4 // payload = JSON Exit
	FrameHeartbeat byte = 5 // no payload; sent on idle streams
	FrameStart     byte = 6 // payload = JSON Start (process started running)
)

// Output stream rules (GET /v1/processes/{pid}/output?from=N&follow=1):
//
//   - A start frame comes first once the process runs (at once if it already started).
//   - Stdout/stderr frames carry journal bytes; the first one starts exactly at N.
//   - If N is older than the first retained byte, a gap frame comes first (Offset = first
//     retained offset, payload = uint64 big-endian count of dropped bytes); a follower
//     that falls behind the journal's start later gets another gap frame.
//   - The exit frame comes after all output, once the process was reaped and its output
//     pipes closed (or 200 ms after reaping, when descendants keep the pipes open; their
//     later output is still journaled and readable by a new request).
//   - N beyond the current end is rejected with 400 ErrCodeOffsetBeyondEnd.
//   - follow=0 sends what exists (and the exit frame if the process has exited) and ends;
//     follow=1 keeps going, with heartbeat frames on idle streams, until the exit frame.
//
// FrameHeaderSize is the size of a frame header: type (1), offset (8), length (4).
const FrameHeaderSize = 13

// MaxFramePayload bounds a frame's payload.
const MaxFramePayload = 1 << 20

// Frame is one unit of an output stream. Offset is the absolute journal offset of the
// first payload byte (for stdout/stderr) or the stream position (other frames).
type Frame struct {
	Type    byte
	Offset  int64
	Payload []byte
}

// Exit is the payload of an exit frame.
type Exit struct {
	ExitCode *int   `json:"exit_code,omitempty"`
	Signal   string `json:"signal,omitempty"`
	// Error explains an exit the program itself did not choose: the program could not
	// be executed (exit code 127 not found, 126 other exec errors), or the sandbox ran
	// out of memory and the agent killed the process, or one of its process group or
	// session that it then ended for (POST /v1/memory/reclaim).
	Error string `json:"error,omitempty"`
	// TimedOut is set when the agent killed the process because TimeoutMs passed.
	TimedOut bool `json:"timed_out,omitempty"`
}

// Reclaimed is the answer of POST /v1/memory/reclaim (204 when there was no process
// to end): the process the agent killed to give the sandbox's memory back.
type Reclaimed struct {
	PID  int    `json:"pid"`
	Name string `json:"name"`
	// RSS is the resident memory it held, in bytes.
	RSS int64 `json:"rss_bytes"`
}

// Start is the payload of a start frame.
type Start struct {
	PID int `json:"pid"`
}

// Error codes (Error.Code).
const (
	ErrCodeBadRequest       = "bad_request"
	ErrCodeProcessGone      = "process_gone"
	ErrCodeNotFound         = "not_found"
	ErrCodePermission       = "permission_denied"
	ErrCodeExists           = "exists"
	ErrCodeNotEmpty         = "not_empty"
	ErrCodeNotDir           = "not_a_directory"
	ErrCodeIsDir            = "is_a_directory"
	ErrCodeNoSpace          = "no_space"
	ErrCodeConflict         = "conflict" // e.g. the process has exited or has no stdin
	ErrCodeExecFailed       = "exec_failed"
	ErrCodeOffsetBeyondEnd  = "offset_beyond_end"
	ErrCodeStaleGeneration  = "stale_generation"
	ErrCodeInternal         = "internal"
	ErrCodeCrossDevice      = "cross_device"
	ErrCodeUnknownUser      = "unknown_user"
	ErrCodeUnknownSignal    = "unknown_signal"
	ErrCodeNotPTY           = "not_a_pty"
	ErrCodeProcessNotFound  = "process_not_found"
	ErrCodeStdinUnavailable = "stdin_unavailable"
	ErrCodeStdinStalled     = "stdin_stalled"     // the process read none of it for a while
	ErrCodePortClosed       = "port_closed"       // nothing listens on the port (GET /v1/ports/{port}/connect)
	ErrCodeQuiesced         = "quiesced"          // user code is frozen for a checkpoint: nothing was started (503)
	ErrCodeCannotCheckpoint = "cannot_checkpoint" // a quiesce refused: the sandbox holds what its checkpoint cannot save (409)
	ErrCodeKeyReused        = "key_reused"        // an exec's key names a process started for another command (422)
)

// PortUpgrade is the Upgrade protocol token of GET /v1/ports/{port}/connect.
const PortUpgrade = "space-tcp"

// File types (EntryInfo.Type).
const (
	FileTypeFile    = "file"
	FileTypeDir     = "dir"
	FileTypeSymlink = "symlink"
	FileTypeOther   = "other"
)

// EntryInfo describes one file system entry (lstat: symbolic links are not followed).
type EntryInfo struct {
	Name string `json:"name"`
	Path string `json:"path"`
	Type string `json:"type"`
	Size int64  `json:"size"`
	// Mode holds the permission bits, including setuid, setgid and sticky (07777).
	Mode uint32 `json:"mode"`
	// Permissions is the ls(1) style mode string, e.g. "-rw-r--r--" or "drwxr-xr-x".
	Permissions   string    `json:"permissions"`
	Owner         string    `json:"owner"`
	Group         string    `json:"group"`
	UID           uint32    `json:"uid"`
	GID           uint32    `json:"gid"`
	ModifiedTime  time.Time `json:"modified_time"`
	SymlinkTarget string    `json:"symlink_target,omitempty"`
}

// MkdirRequest is the body of POST /v1/files/mkdir. An existing directory is 409
// ErrCodeExists; an existing non-directory is 409 ErrCodeNotDir.
type MkdirRequest struct {
	Path string `json:"path"`
	User string `json:"user,omitempty"`
	// Mode defaults to 0755.
	Mode uint32 `json:"mode,omitempty"`
	// Parents creates missing parent directories (owned by User).
	Parents bool `json:"parents,omitempty"`
}

// MoveRequest is the body of POST /v1/files/move. Missing parents of To are created
// (owned by User); an existing file at To is replaced.
type MoveRequest struct {
	From string `json:"from"`
	To   string `json:"to"`
	User string `json:"user,omitempty"`
}

// Watch event types (WatchEvent.Type). Create, write, remove, rename and chmod follow
// inotify: a move out of a watched directory is "rename" (old name), a move into it is
// "create" (new name). "overflow" means the kernel dropped events.
const (
	WatchStart     = "start"
	WatchHeartbeat = "heartbeat"
	WatchCreate    = "create"
	WatchWrite     = "write"
	WatchRemove    = "remove"
	WatchRename    = "rename"
	WatchChmod     = "chmod"
	WatchOverflow  = "overflow"
)

// WatchEvent is one line of a /v1/files/watch stream.
type WatchEvent struct {
	Type string `json:"type"`
	// Path is the absolute path of the entry the event is about.
	Path string `json:"path,omitempty"`
	// Name is Path relative to the watched directory.
	Name  string `json:"name,omitempty"`
	IsDir bool   `json:"is_dir,omitempty"`
}

// WriteFrame writes one frame.
func WriteFrame(w io.Writer, f Frame) error {
	if len(f.Payload) > MaxFramePayload {
		return fmt.Errorf("frame payload %d exceeds %d", len(f.Payload), MaxFramePayload)
	}
	var h [FrameHeaderSize]byte
	h[0] = f.Type
	binary.BigEndian.PutUint64(h[1:9], uint64(f.Offset))
	binary.BigEndian.PutUint32(h[9:13], uint32(len(f.Payload)))
	if _, err := w.Write(h[:]); err != nil {
		return err
	}
	if len(f.Payload) > 0 {
		if _, err := w.Write(f.Payload); err != nil {
			return err
		}
	}
	return nil
}

// ParseHeader decodes a frame header (FrameHeaderSize bytes): the frame without its
// payload, and the payload's length.
func ParseHeader(h []byte) (Frame, int) {
	return Frame{Type: h[0], Offset: int64(binary.BigEndian.Uint64(h[1:9]))}, int(binary.BigEndian.Uint32(h[9:13]))
}

// ReadFrame reads one frame. buf is reused for the payload when large enough.
func ReadFrame(r io.Reader, buf []byte) (Frame, error) {
	var h [FrameHeaderSize]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return Frame{}, err
	}
	f, n := ParseHeader(h[:])
	if n > MaxFramePayload {
		return Frame{}, errors.New("wire: frame too large")
	}
	if n > 0 {
		if cap(buf) < int(n) {
			buf = make([]byte, n)
		}
		f.Payload = buf[:n]
		if _, err := io.ReadFull(r, f.Payload); err != nil {
			return Frame{}, err
		}
	}
	return f, nil
}
