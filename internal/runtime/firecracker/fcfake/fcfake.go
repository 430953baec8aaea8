// Package fcfake owns a stand-in for the Firecracker VMM, for hosts without KVM (such as
// space's development machines and CI): a server that speaks Firecracker's REST API on a
// unix socket the way a firecracker process does, and emulates its hybrid vsock socket.
// No guest runs; what the fake checks is the host side of the contract:
//
//   - every request's method, path and JSON body against Firecracker's API: unknown
//     fields are errors (Firecracker's bodies are deny_unknown_fields), keys are
//     case-sensitive, duplicates, missing required fields, wrong types and bad enum
//     values are rejected, and fields newer than the emulated version are unknown;
//   - the call order: pre-boot configuration only before InstanceStart, PATCH /vm only
//     after it, /snapshot/create only while paused, /snapshot/load only on a fresh
//     process before any boot-specific configuration (a failed load ends the process);
//   - the files requests name: the kernel and initrd are opened, drives opened read-write,
//     the vsock socket bound (and refused if it exists), snapshots written and read, all
//     resolved like a jailed process would (inside Options.Root) and, with CheckAccess,
//     with the permissions of the jailed uid and gid;
//   - answers with Firecracker's status codes: 204 for accepted actions, 200 and JSON for
//     GET /, GET /version, GET /machine-config and GET /vm/config, 400 and
//     {"fault_message": ...} for everything refused.
//
// The "guest" is emulated just enough for the agent transport: once booted (or loaded
// from a snapshot) it listens on the vsock port that the kernel command line gives the
// space agent (SPACE_AGENT_LISTEN=vsock:PORT inside space.env), and each "CONNECT PORT"
// on the vsock socket is answered "OK N" and bridged to Options.Guest. Connections wait
// while the VM is paused and are reset when a snapshot is taken, as in Firecracker.
//
// Every call is recorded (Calls, Options.Record) so tests can assert exact request
// bodies. The binaries under cmd/ wrap this package as drop-in firecracker and jailer
// executables (see Config).
package fcfake

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"
)

// DefaultVersion is the Firecracker version the fake emulates unless told otherwise.
const DefaultVersion = "1.16.1"

// maxPayload is Firecracker's default --http-api-max-payload-size.
const maxPayload = 51200

// Instance states as GET / reports them.
const (
	StateNotStarted = "Not started"
	StateRunning    = "Running"
	StatePaused     = "Paused"
)

// GuestDialer connects to whatever serves the guest's vsock listener on port.
type GuestDialer func(ctx context.Context, port uint32) (net.Conn, error)

// Options configures a Server.
type Options struct {
	// Version is the emulated Firecracker version (default DefaultVersion). It is
	// reported by GET /version and decides which request fields exist.
	Version string
	// ID is the instance id reported by GET / (firecracker's --id).
	ID string
	// Root emulates the jailer's chroot: absolute paths in requests resolve inside it,
	// relative ones too (a jailed firecracker's working directory is its root). Empty
	// means no chroot: paths resolve as given, relative ones against Dir.
	Root string
	// Dir is the working directory for relative paths when Root is empty (default: the
	// process's working directory).
	Dir string
	// CheckAccess makes the fake check file permissions as UID and GID would see them
	// (the jailer drops privileges before firecracker runs) and give files it creates to
	// UID and GID.
	CheckAccess bool
	UID, GID    int
	// Guest serves the guest's vsock listener; nil means nothing in the guest answers.
	Guest GuestDialer
	// BootDelay is how long after InstanceStart the guest agent starts listening.
	BootDelay time.Duration
	// Record, if set, receives every call as it is answered.
	Record func(Call)
	// OnLoadFailure is called after a failed /snapshot/load has been answered: a real
	// firecracker exits then (the fake binary does).
	OnLoadFailure func()
	Logger        *slog.Logger
}

// Call is one API request and the fake's answer.
type Call struct {
	Method string `json:"method"`
	Path   string `json:"path"`
	// Body is the request body as sent (empty for none).
	Body   string `json:"body,omitempty"`
	Status int    `json:"status"`
	Fault  string `json:"fault,omitempty"`
}

// String renders the call as one line: METHOD PATH BODY -> STATUS [FAULT].
func (c Call) String() string {
	s := c.Method + " " + c.Path
	if c.Body != "" {
		s += " " + c.Body
	}
	s += fmt.Sprintf(" -> %d", c.Status)
	if c.Fault != "" {
		s += " " + c.Fault
	}
	return s
}

// Server is one emulated firecracker process. It is safe for concurrent use.
type Server struct {
	opts    Options
	log     *slog.Logger
	version version

	mu         sync.Mutex
	state      string
	bootConfig bool // a boot-specific resource was configured
	loadFailed bool
	boot       *bootSource
	drives     []*drive
	ifaces     []*networkInterface
	machine    machineConfig
	vsock      *vsockDevice
	vsockLn    net.Listener
	guestPort  uint32
	guestAt    time.Time     // when the guest's agent listens
	running    chan struct{} // closed while the VM runs
	conns      map[net.Conn]struct{}
	calls      []Call
	hostPort   uint32
	closed     bool
	wg         sync.WaitGroup
}

// New returns a server in the "Not started" state.
func New(opts Options) (*Server, error) {
	if opts.Version == "" {
		opts.Version = DefaultVersion
	}
	v, err := parseVersion(opts.Version)
	if err != nil {
		return nil, err
	}
	if opts.Dir == "" {
		if opts.Dir, err = os.Getwd(); err != nil {
			return nil, err
		}
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.ID == "" {
		opts.ID = "anonymous-instance"
	}
	one, mem := 1, 128
	f := false
	none := "None"
	return &Server{
		opts:     opts,
		log:      opts.Logger,
		version:  v,
		state:    StateNotStarted,
		machine:  machineConfig{VcpuCount: &one, MemSizeMib: &mem, Smt: &f, TrackDirtyPages: &f, HugePages: &none},
		running:  make(chan struct{}),
		conns:    map[net.Conn]struct{}{},
		hostPort: 1 << 30,
	}, nil
}

// Serve answers API requests on ln until ln is closed.
func (s *Server) Serve(ln net.Listener) error {
	srv := &http.Server{Handler: s, ReadHeaderTimeout: 10 * time.Second}
	err := srv.Serve(ln)
	if errors.Is(err, net.ErrClosed) {
		return nil
	}
	return err
}

// Listen binds the API socket at path (resolved like every other path) as firecracker
// does: it fails if the file exists.
func (s *Server) Listen(path string) (net.Listener, error) {
	p := s.hostPath(path)
	if err := s.checkCreate(p); err != nil {
		return nil, fmt.Errorf("failed to open the API socket at %s: %w", path, err)
	}
	ln, err := listenUnix(p)
	if err != nil {
		return nil, fmt.Errorf("failed to open the API socket at %s: %w", path, err)
	}
	s.own(p)
	return ln, nil
}

// Calls returns the calls answered so far.
func (s *Server) Calls() []Call {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]Call(nil), s.calls...)
}

// State returns the instance state as GET / reports it.
func (s *Server) State() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.state
}

// Close stops the vsock listener and resets every bridged connection. It does not remove
// the sockets (firecracker does not either).
func (s *Server) Close() error {
	s.mu.Lock()
	s.closed = true
	ln := s.vsockLn
	s.vsockLn = nil
	s.resetConnsLocked()
	s.mu.Unlock()
	if ln != nil {
		ln.Close()
	}
	s.wg.Wait()
	return nil
}

// ServeHTTP implements the API.
func (s *Server) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	body, err := io.ReadAll(io.LimitReader(req.Body, maxPayload+1))
	call := Call{Method: req.Method, Path: req.URL.Path, Body: string(body)}
	var resp response
	switch {
	case err != nil:
		resp = fault("Failed to read the request body: %v", err)
	case len(body) > maxPayload:
		resp = fault("Request payload with size %d is larger than the limit of %d allowed by server.", len(body), maxPayload)
	default:
		resp = s.route(req.Method, req.URL.Path, body)
	}
	call.Status, call.Fault = resp.status, resp.fault
	s.mu.Lock()
	s.calls = append(s.calls, call)
	failedLoad := s.loadFailed
	s.mu.Unlock()
	if s.opts.Record != nil {
		s.opts.Record(call)
	}
	s.log.Debug("api call", "call", call.String())
	w.Header().Set("Server", "Firecracker API")
	switch {
	case resp.fault != "":
		writeJSON(w, resp.status, map[string]string{"fault_message": resp.fault})
	case resp.body != nil:
		writeJSON(w, resp.status, resp.body)
	default:
		w.WriteHeader(resp.status)
	}
	if failedLoad && resp.fault != "" && s.opts.OnLoadFailure != nil {
		_ = http.NewResponseController(w).Flush()
		s.opts.OnLoadFailure()
	}
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	data, _ := json.Marshal(v) // plain maps and structs
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(data)
}

// response is what a handler answers.
type response struct {
	status int
	body   any
	fault  string
}

var noContent = response{status: http.StatusNoContent}

func ok(body any) response { return response{status: http.StatusOK, body: body} }

func fault(format string, args ...any) response {
	return response{status: http.StatusBadRequest, fault: fmt.Sprintf(format, args...)}
}

// Messages Firecracker answers for calls out of order.
const (
	msgAfterStart  = "The requested operation is not supported after starting the microVM."
	msgBeforeStart = "The requested operation is not supported before starting the microVM."
	msgLoadAfter   = "Loading a microVM snapshot not allowed after configuring boot-specific resources."
)

// route dispatches a request. Handlers run under s.mu: firecracker handles API requests
// one at a time. As in Firecracker, a body is parsed (and refused if malformed) before
// the VMM looks at whether the request fits the instance's state.
func (s *Server) route(method, path string, body []byte) response {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.loadFailed {
		return fault("The microVM failed to load a snapshot and is shutting down.")
	}
	switch {
	case path == "/" && method == http.MethodGet:
		return ok(map[string]string{"id": s.opts.ID, "state": s.state, "vmm_version": s.version.String(), "app_name": "Firecracker"})
	case path == "/version" && method == http.MethodGet:
		return ok(map[string]string{"firecracker_version": s.version.String()})
	case path == "/machine-config" && method == http.MethodGet:
		return ok(s.machine)
	case path == "/vm/config" && method == http.MethodGet:
		return ok(s.vmConfigLocked())
	case path == "/logger" && method == http.MethodPut:
		return s.putLogger(body)
	case path == "/metrics" && method == http.MethodPut:
		return s.putMetrics(body)
	case path == "/boot-source" && method == http.MethodPut:
		return s.putBootSource(body)
	case strings.HasPrefix(path, "/drives/") && method == http.MethodPut:
		return s.putDrive(strings.TrimPrefix(path, "/drives/"), body)
	case strings.HasPrefix(path, "/drives/") && method == http.MethodPatch:
		return s.patchDrive(strings.TrimPrefix(path, "/drives/"), body)
	case strings.HasPrefix(path, "/network-interfaces/") && method == http.MethodPut:
		return s.putInterface(strings.TrimPrefix(path, "/network-interfaces/"), body)
	case path == "/machine-config" && method == http.MethodPut:
		return s.putMachineConfig(body)
	case path == "/vsock" && method == http.MethodPut:
		return s.putVsock(body)
	case path == "/entropy" && method == http.MethodPut && s.version.atLeast(1, 4):
		return s.putEntropy(body)
	case path == "/actions" && method == http.MethodPut:
		return s.putAction(body)
	case path == "/vm" && method == http.MethodPatch:
		return s.patchVM(body)
	case path == "/snapshot/create" && method == http.MethodPut:
		return s.createSnapshot(body)
	case path == "/snapshot/load" && method == http.MethodPut:
		return s.loadSnapshot(body)
	}
	return fault("Invalid request method and/or path: %s %s.", method, path)
}

// preBoot refuses pre-boot configuration once the VM started (or was loaded).
func (s *Server) preBoot() (response, bool) {
	if s.state != StateNotStarted {
		return fault(msgAfterStart), false
	}
	return response{}, true
}

func (s *Server) putLogger(body []byte) response {
	var l logger
	if err := s.decode(body, &l); err != nil {
		return fault("%v", err)
	}
	if r, ok := s.preBoot(); !ok {
		return r
	}
	if l.Level != nil && !oneOfFold(*l.Level, "Error", "Warning", "Info", "Debug", "Trace", "Off") {
		return fault("%s", deserializeMsg(fmt.Sprintf("unknown variant `%s`, expected one of `Error`, `Warning`, `Info`, `Debug`, `Trace`, `Off`", *l.Level)))
	}
	if l.LogPath != nil {
		if err := s.openable(*l.LogPath, true); err != nil {
			return fault("Failed to open target file: %v", err)
		}
	}
	return noContent
}

func (s *Server) putMetrics(body []byte) response {
	var m metrics
	if err := s.decode(body, &m); err != nil {
		return fault("%v", err)
	}
	if r, ok := s.preBoot(); !ok {
		return r
	}
	if m.MetricsPath == nil {
		return fault("%s", deserializeMsg("missing field `metrics_path`"))
	}
	if err := s.openable(*m.MetricsPath, true); err != nil {
		return fault("Failed to open target file: %v", err)
	}
	return noContent
}

func (s *Server) putBootSource(body []byte) response {
	var b bootSource
	if err := s.decode(body, &b); err != nil {
		return fault("%v", err)
	}
	if r, ok := s.preBoot(); !ok {
		return r
	}
	if b.KernelImagePath == nil {
		return fault("%s", deserializeMsg("missing field `kernel_image_path`"))
	}
	if err := s.openable(*b.KernelImagePath, false); err != nil {
		return fault("The kernel file cannot be opened: %v", err)
	}
	if b.InitrdPath != nil {
		if err := s.openable(*b.InitrdPath, false); err != nil {
			return fault("The initrd file cannot be opened due to invalid path or invalid permissions. %v", err)
		}
	}
	s.boot = &b
	s.bootConfig = true
	return noContent
}

func (s *Server) putDrive(id string, body []byte) response {
	var d drive
	if err := s.decode(body, &d); err != nil {
		return fault("%v", err)
	}
	if r, ok := s.preBoot(); !ok {
		return r
	}
	switch {
	case d.DriveID == nil:
		return fault("%s", deserializeMsg("missing field `drive_id`"))
	case d.IsRootDevice == nil:
		return fault("%s", deserializeMsg("missing field `is_root_device`"))
	case *d.DriveID != id:
		return fault("The id from the path [%s] does not match the id from the body [%s]!", id, *d.DriveID)
	case d.CacheType != nil && !oneOf(*d.CacheType, "Unsafe", "Writeback"):
		return fault("%s", deserializeMsg(fmt.Sprintf("unknown variant `%s`, expected `Unsafe` or `Writeback`", *d.CacheType)))
	case d.IOEngine != nil && !oneOf(*d.IOEngine, "Sync", "Async"):
		return fault("%s", deserializeMsg(fmt.Sprintf("unknown variant `%s`, expected `Sync` or `Async`", *d.IOEngine)))
	case d.Socket != nil && (d.PathOnHost != nil || d.IsReadOnly != nil):
		return fault("Unable to create the block device: a vhost-user-block drive takes no path_on_host or is_read_only.")
	case d.Socket == nil && d.PathOnHost == nil:
		return fault("Unable to create the block device: path_on_host is required for a virtio-block drive.")
	}
	if *d.IsRootDevice {
		for _, o := range s.drives {
			if *o.IsRootDevice && *o.DriveID != id {
				return fault("A root block device already exists!")
			}
		}
	}
	if d.PathOnHost != nil {
		rw := d.IsReadOnly == nil || !*d.IsReadOnly
		if err := s.openable(*d.PathOnHost, rw); err != nil {
			return fault("Unable to create the block device: BackingFile(%v, %q)", err, *d.PathOnHost)
		}
	}
	for i, o := range s.drives {
		if *o.DriveID == id {
			s.drives[i] = &d
			return noContent
		}
	}
	s.drives = append(s.drives, &d)
	s.bootConfig = true
	return noContent
}

func (s *Server) patchDrive(id string, body []byte) response {
	if s.state == StateNotStarted {
		return fault(msgBeforeStart)
	}
	var d partialDrive
	if err := s.decode(body, &d); err != nil {
		return fault("%v", err)
	}
	if d.DriveID == nil {
		return fault("%s", deserializeMsg("missing field `drive_id`"))
	}
	if *d.DriveID != id {
		return fault("The id from the path [%s] does not match the id from the body [%s]!", id, *d.DriveID)
	}
	for _, o := range s.drives {
		if *o.DriveID != id {
			continue
		}
		if d.PathOnHost != nil {
			ro := o.IsReadOnly != nil && *o.IsReadOnly
			if err := s.openable(*d.PathOnHost, !ro); err != nil {
				return fault("Unable to patch the block device: BackingFile(%v, %q)", err, *d.PathOnHost)
			}
			o.PathOnHost = d.PathOnHost
		}
		return noContent
	}
	return fault("Unable to patch the block device: drive %s does not exist.", id)
}

func (s *Server) putInterface(id string, body []byte) response {
	var n networkInterface
	if err := s.decode(body, &n); err != nil {
		return fault("%v", err)
	}
	if r, ok := s.preBoot(); !ok {
		return r
	}
	switch {
	case n.IfaceID == nil:
		return fault("%s", deserializeMsg("missing field `iface_id`"))
	case n.HostDevName == nil:
		return fault("%s", deserializeMsg("missing field `host_dev_name`"))
	case *n.IfaceID != id:
		return fault("The id from the path [%s] does not match the id from the body [%s]!", id, *n.IfaceID)
	case n.GuestMAC != nil:
		if _, err := net.ParseMAC(*n.GuestMAC); err != nil {
			return fault("%s", deserializeMsg(fmt.Sprintf("invalid MAC address %q", *n.GuestMAC)))
		}
	}
	for i, o := range s.ifaces {
		if *o.IfaceID == id {
			s.ifaces[i] = &n
			return noContent
		}
	}
	s.ifaces = append(s.ifaces, &n)
	s.bootConfig = true
	return noContent
}

func (s *Server) putMachineConfig(body []byte) response {
	var m machineConfig
	if err := s.decode(body, &m); err != nil {
		return fault("%v", err)
	}
	if r, ok := s.preBoot(); !ok {
		return r
	}
	switch {
	case m.VcpuCount == nil:
		return fault("%s", deserializeMsg("missing field `vcpu_count`"))
	case m.MemSizeMib == nil:
		return fault("%s", deserializeMsg("missing field `mem_size_mib`"))
	case *m.VcpuCount < 1 || *m.VcpuCount > 32:
		return fault("The vCPU number is invalid! The vCPU number can only be 1 or an even number when SMT is enabled.")
	case m.Smt != nil && *m.Smt && *m.VcpuCount != 1 && *m.VcpuCount%2 != 0:
		return fault("The vCPU number is invalid! The vCPU number can only be 1 or an even number when SMT is enabled.")
	case *m.MemSizeMib <= 0:
		return fault("The memory size (MiB) is invalid.")
	case m.HugePages != nil && !oneOf(*m.HugePages, "None", "2M"):
		return fault("%s", deserializeMsg(fmt.Sprintf("unknown variant `%s`, expected `None` or `2M`", *m.HugePages)))
	case m.CPUTemplate != nil && !oneOf(*m.CPUTemplate, "C3", "T2", "T2S", "T2CL", "T2A", "V1N1", "None"):
		return fault("%s", deserializeMsg(fmt.Sprintf("unknown variant `%s`", *m.CPUTemplate)))
	}
	f := false
	none := "None"
	for _, d := range []struct {
		p   **bool
		def *bool
	}{{&m.Smt, &f}, {&m.TrackDirtyPages, &f}} {
		if *d.p == nil {
			*d.p = d.def
		}
	}
	if m.HugePages == nil {
		m.HugePages = &none
	}
	s.machine = m
	s.bootConfig = true
	return noContent
}

func (s *Server) putVsock(body []byte) response {
	var v vsockDevice
	if err := s.decode(body, &v); err != nil {
		return fault("%v", err)
	}
	if r, ok := s.preBoot(); !ok {
		return r
	}
	switch {
	case v.GuestCID == nil:
		return fault("%s", deserializeMsg("missing field `guest_cid`"))
	case v.UDSPath == nil:
		return fault("%s", deserializeMsg("missing field `uds_path`"))
	case *v.GuestCID < 3 || *v.GuestCID > 0xffffffff:
		return fault("Cannot create backend for vsock device: invalid guest CID %d (must be at least 3).", *v.GuestCID)
	}
	if s.vsockLn != nil {
		s.vsockLn.Close()
		s.vsockLn = nil
	}
	if err := s.bindVsockLocked(*v.UDSPath); err != nil {
		return fault("Cannot create backend for vsock device: %v", err)
	}
	s.vsock = &v
	s.bootConfig = true
	return noContent
}

func (s *Server) putEntropy(body []byte) response {
	var e entropy
	if err := s.decode(body, &e); err != nil {
		return fault("%v", err)
	}
	if r, ok := s.preBoot(); !ok {
		return r
	}
	s.bootConfig = true
	return noContent
}

func (s *Server) putAction(body []byte) response {
	var a action
	if err := s.decode(body, &a); err != nil {
		return fault("%v", err)
	}
	if a.ActionType == nil {
		return fault("%s", deserializeMsg("missing field `action_type`"))
	}
	switch *a.ActionType {
	case "InstanceStart":
		if s.state != StateNotStarted {
			return fault(msgAfterStart)
		}
		if s.boot == nil {
			return fault("Cannot start microvm without kernel configuration.")
		}
		if err := s.checkKernel(*s.boot.KernelImagePath); err != nil {
			return fault("Cannot load kernel due to invalid memory configuration or invalid kernel image: %v", err)
		}
		s.guestPort = agentPort(s.boot.BootArgs)
		s.guestAt = time.Now().Add(s.opts.BootDelay)
		s.setStateLocked(StateRunning)
		return noContent
	case "SendCtrlAltDel":
		if s.state == StateNotStarted {
			return fault(msgBeforeStart)
		}
		return noContent
	case "FlushMetrics":
		return noContent
	}
	return fault("%s", deserializeMsg(fmt.Sprintf("unknown variant `%s`, expected one of `FlushMetrics`, `InstanceStart`, `SendCtrlAltDel`", *a.ActionType)))
}

func (s *Server) patchVM(body []byte) response {
	var v vmState
	if err := s.decode(body, &v); err != nil {
		return fault("%v", err)
	}
	if v.State == nil {
		return fault("%s", deserializeMsg("missing field `state`"))
	}
	if !oneOf(*v.State, "Paused", "Resumed") {
		return fault("%s", deserializeMsg(fmt.Sprintf("unknown variant `%s`, expected `Paused` or `Resumed`", *v.State)))
	}
	if s.state == StateNotStarted {
		return fault(msgBeforeStart)
	}
	if *v.State == "Paused" {
		s.setStateLocked(StatePaused)
	} else {
		s.setStateLocked(StateRunning)
	}
	return noContent
}

// setStateLocked changes the state and the running channel with it.
func (s *Server) setStateLocked(state string) {
	if s.state == state {
		return
	}
	if state == StateRunning {
		close(s.running)
	} else if s.state == StateRunning {
		s.running = make(chan struct{})
	}
	s.state = state
}

func (s *Server) vmConfigLocked() map[string]any {
	cfg := map[string]any{"machine-config": s.machine}
	if s.boot != nil {
		cfg["boot-source"] = s.boot
	}
	cfg["drives"] = s.drives
	cfg["network-interfaces"] = s.ifaces
	if s.vsock != nil {
		cfg["vsock"] = s.vsock
	}
	return cfg
}

// hostPath resolves a path of a request as the (possibly jailed) firecracker would.
func (s *Server) hostPath(p string) string {
	if s.opts.Root != "" {
		// Inside a chroot the working directory is the root, and ".." stops there.
		return filepath.Join(s.opts.Root, filepath.Clean("/"+p))
	}
	if filepath.IsAbs(p) {
		return filepath.Clean(p)
	}
	return filepath.Join(s.opts.Dir, p)
}

// openable checks that the file p names exists and can be opened for reading (and
// writing) by the emulated process.
func (s *Server) openable(p string, write bool) error {
	hp := s.hostPath(p)
	flag := os.O_RDONLY
	if write {
		flag = os.O_RDWR
	}
	f, err := os.OpenFile(hp, flag, 0)
	if err != nil {
		return err
	}
	f.Close()
	if !s.opts.CheckAccess {
		return nil
	}
	want := uint32(4)
	if write {
		want |= 2
	}
	return s.access(hp, want)
}

// access checks that the emulated uid/gid may traverse to hp and has the permission bits
// want (4 read, 2 write, 1 execute/search) on it.
func (s *Server) access(hp string, want uint32) error {
	root := s.opts.Root
	if root == "" {
		root = "/"
	}
	rel, err := filepath.Rel(root, hp)
	if err != nil || strings.HasPrefix(rel, "..") {
		return fmt.Errorf("%s: outside the chroot", hp)
	}
	dirs := []string{root}
	if parent := filepath.Dir(rel); parent != "." {
		d := root
		for _, part := range strings.Split(parent, string(filepath.Separator)) {
			d = filepath.Join(d, part)
			dirs = append(dirs, d)
		}
	}
	for _, d := range dirs {
		if err := s.permits(d, 1); err != nil {
			return err
		}
	}
	return s.permits(hp, want)
}

// permits checks the permission bits of one file for the emulated uid/gid.
func (s *Server) permits(p string, want uint32) error {
	fi, err := os.Stat(p)
	if err != nil {
		return err
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return nil
	}
	mode := uint32(fi.Mode().Perm())
	var bits uint32
	switch {
	case int(st.Uid) == s.opts.UID:
		bits = mode >> 6 & 7
	case int(st.Gid) == s.opts.GID:
		bits = mode >> 3 & 7
	default:
		bits = mode & 7
	}
	if bits&want != want {
		return fmt.Errorf("%s: permission denied for uid %d gid %d (owner %d:%d, mode %o)", p, s.opts.UID, s.opts.GID, st.Uid, st.Gid, fi.Mode().Perm())
	}
	return nil
}

// checkCreate checks that the emulated process may create hp (write and search on its
// directory).
func (s *Server) checkCreate(hp string) error {
	if !s.opts.CheckAccess {
		return nil
	}
	dir := filepath.Dir(hp)
	if err := s.access(dir, 3); err != nil {
		return err
	}
	return nil
}

// own gives a file the fake created to the emulated uid/gid.
func (s *Server) own(hp string) {
	if s.opts.CheckAccess {
		_ = os.Lchown(hp, s.opts.UID, s.opts.GID)
	}
}

// checkKernel checks that the kernel is an ELF file (an uncompressed vmlinux), as
// Firecracker's x86 loader requires.
func (s *Server) checkKernel(p string) error {
	f, err := os.Open(s.hostPath(p))
	if err != nil {
		return err
	}
	defer f.Close()
	magic := make([]byte, 4)
	if _, err := io.ReadFull(f, magic); err != nil || !bytes.Equal(magic, []byte("\x7fELF")) {
		return errors.New("Elf(InvalidElfMagicNumber)")
	}
	return nil
}

func oneOf(v string, set ...string) bool {
	for _, s := range set {
		if v == s {
			return true
		}
	}
	return false
}

func oneOfFold(v string, set ...string) bool {
	for _, s := range set {
		if strings.EqualFold(v, s) {
			return true
		}
	}
	return false
}
