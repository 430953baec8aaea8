package agent

import (
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/guest/envdpb"
	"github.com/spacedev/space/internal/guest/envdpb/filesystem/filesystempbconnect"
	"github.com/spacedev/space/internal/guest/envdpb/process/processpbconnect"
	"github.com/spacedev/space/internal/guest/wire"
)

// The agent also speaks envd, the in-sandbox daemon of E2B's SDKs, under /envd: the
// Connect services process.Process and filesystem.Filesystem (JSON and binary
// protobuf, server streams in Connect's envelope framing) and the plain HTTP endpoints
// /files, /health, /envs and /metrics. space's E2B gateway (package internal/e2b)
// authenticates SDK requests and relays them here through the node, so nothing below
// checks access tokens. It is a second view of the same processes and files the agent
// protocol serves: an E2B command is an agent process, its output comes from the
// process journal.
const (
	// EnvdPrefix is the path under which the agent serves envd.
	EnvdPrefix = envdpb.Prefix
	// envdDefaultUser is who E2B commands and file operations run as when the
	// request names nobody (E2B templates have a user "user"); root where it is
	// missing.
	envdDefaultUser = "user"
)

// envd holds the state of the envd services: the polled watchers of
// CreateWatcher/GetWatcherEvents and the previous CPU sample for /metrics.
type envd struct {
	a *Agent

	mu       sync.Mutex
	watchers map[string]*polledWatcher

	cpuMu   sync.Mutex
	lastCPU cpuSample
}

// registerEnvd adds the envd routes under EnvdPrefix to mux.
func (a *Agent) registerEnvd(mux *http.ServeMux) {
	e := &envd{a: a, watchers: map[string]*polledWatcher{}}
	opts := []connect.HandlerOption{
		connect.WithReadMaxBytes(16 << 20),
		// The SDKs never compress; without gzip registered nothing is compressed
		// for a client that did not ask (proxies add Accept-Encoding by themselves).
		connect.WithCompression("gzip", nil, nil),
	}
	h := http.NewServeMux()
	h.Handle(processpbconnect.NewProcessHandler(&envdProcess{e: e}, opts...))
	h.Handle(filesystempbconnect.NewFilesystemHandler(&envdFilesystem{e: e}, opts...))
	h.HandleFunc("GET /files", e.handleGetFile)
	h.HandleFunc("POST /files", e.handlePostFiles)
	h.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusNoContent) })
	h.HandleFunc("GET /envs", e.handleEnvs)
	h.HandleFunc("GET /metrics", e.handleMetrics)
	h.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		envdError(w, http.StatusNotFound, "no envd route for %s %s", r.Method, r.URL.Path)
	})
	mux.Handle(EnvdPrefix+"/", http.StripPrefix(EnvdPrefix, tunnelStatus(h)))
}

// tunnelStatus implements envdpb.TunnelHeader.
func tunnelStatus(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get(envdpb.TunnelHeader) != "" {
			w = &tunnelWriter{ResponseWriter: w}
		}
		h.ServeHTTP(w, r)
	})
}

type tunnelWriter struct {
	http.ResponseWriter
	wrote bool
}

func (t *tunnelWriter) WriteHeader(code int) {
	if t.wrote {
		return
	}
	t.wrote = true
	if code >= 300 {
		t.Header().Set(envdpb.StatusHeader, strconv.Itoa(code))
		code = http.StatusOK
	}
	t.ResponseWriter.WriteHeader(code)
}

func (t *tunnelWriter) Write(b []byte) (int, error) {
	if !t.wrote {
		t.WriteHeader(http.StatusOK)
	}
	return t.ResponseWriter.Write(b)
}

func (t *tunnelWriter) Flush() { _ = http.NewResponseController(t.ResponseWriter).Flush() }

func (t *tunnelWriter) Unwrap() http.ResponseWriter { return t.ResponseWriter }

// envdError writes envd's JSON error body for the plain HTTP endpoints.
func envdError(w http.ResponseWriter, status int, format string, args ...any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]any{"code": status, "message": fmt.Sprintf(format, args...)})
}

// writeEnvdError writes err as envd's JSON error with the agent's usual status.
func (e *envd) writeEnvdError(w http.ResponseWriter, r *http.Request, err error) {
	status, code := classify(err)
	if code == wire.ErrCodeUnknownUser {
		status = http.StatusUnauthorized
	}
	if status >= 500 && status != http.StatusInsufficientStorage {
		e.a.log.Warn("envd request failed", "method", r.Method, "path", r.URL.Path, "err", err)
	}
	envdError(w, status, "%s", err.Error())
}

// basicUser returns the user named by Basic auth in h (envdpb.AuthHeader first), or "".
func basicUser(h http.Header) (string, error) {
	v := h.Get(envdpb.AuthHeader)
	if v == "" {
		v = h.Get("Authorization")
	}
	if v == "" {
		return "", nil
	}
	enc, ok := strings.CutPrefix(v, "Basic ")
	if !ok {
		return "", nil // some other scheme: not a user name
	}
	b, err := base64.StdEncoding.DecodeString(strings.TrimSpace(enc))
	if err != nil {
		return "", connect.NewError(connect.CodeUnauthenticated, errors.New("malformed Basic authorization"))
	}
	user, _, _ := strings.Cut(string(b), ":")
	return user, nil
}

// account resolves the user of an envd request: the name given, else "user" when the
// sandbox has one, else root.
func (e *envd) account(name string) (account, error) {
	if name != "" {
		return e.a.users.lookup(name)
	}
	if acct, err := e.a.users.lookup(envdDefaultUser); err == nil {
		return acct, nil
	}
	return e.a.users.lookup("root")
}

// rpcAccount is account for a Connect request (Basic auth), with Connect errors.
func (e *envd) rpcAccount(h http.Header) (account, error) {
	name, err := basicUser(h)
	if err != nil {
		return account{}, err
	}
	acct, err := e.account(name)
	if err != nil {
		return account{}, connect.NewError(connect.CodeUnauthenticated, fmt.Errorf("invalid user %q: %w", name, err))
	}
	return acct, nil
}

// rpcError converts an agent error to a Connect error with the matching code.
func rpcError(err error) error {
	if err == nil {
		return nil
	}
	var ce *connect.Error
	if errors.As(err, &ce) {
		return err
	}
	_, code := classify(err)
	c := connect.CodeInternal
	switch code {
	case wire.ErrCodeNotFound, wire.ErrCodeProcessNotFound:
		c = connect.CodeNotFound
	case wire.ErrCodeExists:
		c = connect.CodeAlreadyExists
	case wire.ErrCodeBadRequest, wire.ErrCodeNotDir, wire.ErrCodeIsDir, wire.ErrCodeCrossDevice,
		wire.ErrCodeExecFailed, wire.ErrCodeUnknownSignal:
		c = connect.CodeInvalidArgument
	case wire.ErrCodePermission:
		c = connect.CodePermissionDenied
	case wire.ErrCodeNoSpace:
		c = connect.CodeResourceExhausted
	case wire.ErrCodeUnknownUser:
		c = connect.CodeUnauthenticated
	case wire.ErrCodeNotEmpty, wire.ErrCodeConflict, wire.ErrCodeStdinUnavailable, wire.ErrCodeNotPTY:
		c = connect.CodeFailedPrecondition
	case wire.ErrCodeStdinStalled:
		c = connect.CodeDeadlineExceeded
	case wire.ErrCodeQuiesced:
		c = connect.CodeUnavailable // nothing was started: the SDK may try again
	}
	return connect.NewError(c, err)
}

// keepaliveInterval reads the Keepalive-Ping-Interval header (seconds); envd's default
// is 90 s.
func keepaliveInterval(h http.Header) time.Duration {
	if s := h.Get("Keepalive-Ping-Interval"); s != "" {
		if n, err := strconv.Atoi(s); err == nil && n > 0 {
			return time.Duration(n) * time.Second
		}
	}
	return 90 * time.Second
}

func (e *envd) handleEnvs(w http.ResponseWriter, r *http.Request) {
	e.a.idMu.Lock()
	env := make(map[string]string, len(e.a.defaultEnv))
	for k, v := range e.a.defaultEnv {
		env[k] = v
	}
	e.a.idMu.Unlock()
	writeJSON(w, http.StatusOK, env)
}

// envdMetrics is the body of GET /metrics (envd's field names).
type envdMetrics struct {
	Timestamp   int64   `json:"ts"`
	CPUCount    int     `json:"cpu_count"`
	CPUUsedPct  float64 `json:"cpu_used_pct"`
	MemTotal    int64   `json:"mem_total"`
	MemUsed     int64   `json:"mem_used"`
	MemCache    int64   `json:"mem_cache"`
	MemTotalMiB int64   `json:"mem_total_mib"`
	MemUsedMiB  int64   `json:"mem_used_mib"`
	DiskUsed    int64   `json:"disk_used"`
	DiskTotal   int64   `json:"disk_total"`
}

type cpuSample struct {
	busy, total uint64
	ok          bool
}

// readCPU reads the aggregate line of /proc/stat.
func readCPU() cpuSample {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return cpuSample{}
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 5 || f[0] != "cpu" {
		return cpuSample{}
	}
	var s cpuSample
	for i, v := range f[1:] {
		n, _ := strconv.ParseUint(v, 10, 64)
		s.total += n
		if i != 3 && i != 4 { // idle, iowait
			s.busy += n
		}
	}
	s.ok = true
	return s
}

// readMeminfo returns MemTotal, MemAvailable and Cached in bytes.
func readMeminfo() (total, avail, cached int64) {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0, 0, 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 {
			continue
		}
		n, _ := strconv.ParseInt(f[1], 10, 64)
		switch f[0] {
		case "MemTotal:":
			total = n * 1024
		case "MemAvailable:":
			avail = n * 1024
		case "Cached:":
			cached = n * 1024
		}
	}
	return total, avail, cached
}

// handleMetrics samples the sandbox's CPU (since the previous call, or over 100 ms),
// memory and root file system.
func (e *envd) handleMetrics(w http.ResponseWriter, r *http.Request) {
	e.cpuMu.Lock()
	prev := e.lastCPU
	if !prev.ok {
		prev = readCPU()
		select {
		case <-time.After(100 * time.Millisecond):
		case <-r.Context().Done():
		}
	}
	cur := readCPU()
	e.lastCPU = cur
	e.cpuMu.Unlock()
	m := envdMetrics{Timestamp: time.Now().Unix(), CPUCount: runtime.NumCPU()}
	if cur.ok && prev.ok && cur.total > prev.total {
		m.CPUUsedPct = float64(cur.busy-prev.busy) * 100 / float64(cur.total-prev.total)
	}
	total, avail, cached := readMeminfo()
	m.MemTotal, m.MemUsed, m.MemCache = total, total-avail, cached
	m.MemTotalMiB, m.MemUsedMiB = m.MemTotal>>20, m.MemUsed>>20
	var st unix.Statfs_t
	if unix.Statfs("/", &st) == nil {
		m.DiskTotal = int64(st.Blocks) * st.Bsize
		m.DiskUsed = int64(st.Blocks-st.Bfree) * st.Bsize
	}
	writeJSON(w, http.StatusOK, m)
}
