package server

import (
	"bufio"
	"context"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"unicode/utf8"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/guest/wire"
	"github.com/spacedev/space/internal/store"
	"github.com/spacedev/space/internal/token"
)

// AgentDialer gives the data plane a transport to the agent of a sandbox running on
// this node. It fails with a NotFound or Conflict fault otherwise.
type AgentDialer interface {
	AgentTransport(ctx context.Context, sandboxID string) (http.RoundTripper, error)
	// Touch records activity on the sandbox (for idle detection).
	Touch(sandboxID string)
}

// DataPlaneConfig configures a node's data plane.
type DataPlaneConfig struct {
	Store  *store.Store
	Signer *token.Signer
	Logger *slog.Logger
	Node   AgentDialer
	NodeID string
}

// DataPlane serves attach streams, stdin, signals and resizes for the sandboxes of one
// node, authorized by attachment tokens, and the internal agent proxy that the api role
// uses (authorized by node tokens).
type DataPlane struct {
	cfg     DataPlaneConfig
	log     *slog.Logger
	mu      sync.Mutex
	streams map[string]map[*liveStream]struct{}
}

type liveStream struct {
	epoch  int64
	cancel context.CancelFunc
}

// NewDataPlane returns the data plane of a node.
func NewDataPlane(cfg DataPlaneConfig) *DataPlane {
	return &DataPlane{cfg: cfg, log: cfg.Logger, streams: map[string]map[*liveStream]struct{}{}}
}

// Run cuts streams whose tokens were revoked until ctx ends.
func (d *DataPlane) Run(ctx context.Context) error {
	return d.cfg.Store.Listen(ctx, d.log, func(_, id string) {
		if id == "" {
			return
		}
		epoch, _, err := d.cfg.Store.TokenEpoch(ctx, id)
		if err != nil {
			epoch = 1 << 62 // deleted: cut everything
		}
		d.mu.Lock()
		for s := range d.streams[id] {
			if s.epoch < epoch {
				s.cancel()
			}
		}
		d.mu.Unlock()
	}, store.ChannelTokens)
}

func (d *DataPlane) track(id string, epoch int64, cancel context.CancelFunc) func() {
	s := &liveStream{epoch: epoch, cancel: cancel}
	d.mu.Lock()
	if d.streams[id] == nil {
		d.streams[id] = map[*liveStream]struct{}{}
	}
	d.streams[id][s] = struct{}{}
	d.mu.Unlock()
	return func() {
		d.mu.Lock()
		delete(d.streams[id], s)
		if len(d.streams[id]) == 0 {
			delete(d.streams, id)
		}
		d.mu.Unlock()
	}
}

// Register adds the data plane's routes to mux.
func (d *DataPlane) Register(mux *http.ServeMux) {
	h := func(pattern string, fn handlerFunc) {
		mux.HandleFunc(pattern, func(w http.ResponseWriter, r *http.Request) {
			if err := fn(w, r); err != nil {
				writeError(w, r, d.log, err)
			}
		})
	}
	h("GET /v1/dp/sandboxes/{id}/processes/{pid}/attach", d.attach)
	h("POST /v1/dp/sandboxes/{id}/processes/{pid}/stdin", d.stdin)
	h("POST /v1/dp/sandboxes/{id}/processes/{pid}/signal", d.signal)
	h("POST /v1/dp/sandboxes/{id}/processes/{pid}/resize", d.resize)
	h("/internal/v1/sandboxes/{id}/agent/{path...}", d.agentProxy)
}

// tokenFrom returns the attachment token of a data-plane request.
func tokenFrom(r *http.Request) string {
	if t := bearer(r); t != "" {
		return t
	}
	return r.URL.Query().Get("token")
}

// authorize checks the request's token for right on sandbox/pid and returns its claims
// and the sandbox's current epoch.
func (d *DataPlane) authorize(r *http.Request, right string) (string, int, int64, error) {
	id := r.PathValue("id")
	pid := 0
	if p := r.PathValue("pid"); p != "" {
		n, err := strconv.Atoi(p)
		if err != nil || n <= 0 {
			return "", 0, 0, invalid("pid must be a positive integer")
		}
		pid = n
	}
	tok := tokenFrom(r)
	if tok == "" {
		return "", 0, 0, fault.New(fault.Unauthorized, "missing attachment token: send Authorization: Bearer <token> or ?token=")
	}
	claims, err := d.cfg.Signer.Verify(tok)
	if err != nil {
		return "", 0, 0, err
	}
	if claims.Sandbox != id {
		return "", 0, 0, fault.New(fault.Forbidden, "token is not valid for this sandbox")
	}
	epoch, nodeID, err := d.cfg.Store.TokenEpoch(r.Context(), id)
	if err != nil {
		return "", 0, 0, fault.New(fault.Unauthorized, "token was revoked")
	}
	if err := token.Authorize(claims, id, pid, right, epoch); err != nil {
		return "", 0, 0, err
	}
	if nodeID != d.cfg.NodeID {
		return "", 0, 0, fault.New(fault.NotFound, "sandbox %s is not on this node", id)
	}
	d.cfg.Node.Touch(id)
	return id, pid, epoch, nil
}

// agentDo sends a request to the agent and returns the response, turning error
// statuses into faults.
func (d *DataPlane) agentDo(ctx context.Context, id, method, path string, body io.Reader, ctype string) (*http.Response, error) {
	rt, err := d.cfg.Node.AgentTransport(ctx, id)
	if err != nil {
		return nil, err
	}
	req, err := http.NewRequestWithContext(ctx, method, "http://agent"+path, body)
	if err != nil {
		return nil, err
	}
	if ctype != "" {
		req.Header.Set("Content-Type", ctype)
	}
	resp, err := rt.RoundTrip(req)
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, fault.New(fault.Unavailable, "sandbox agent unreachable: %v", err)
	}
	if resp.StatusCode >= 300 {
		defer resp.Body.Close()
		return nil, agentError(resp)
	}
	return resp, nil
}

func (d *DataPlane) agentJSON(ctx context.Context, id, method, path string, in, out any) error {
	var body io.Reader
	ctype := ""
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return err
		}
		body = strings.NewReader(string(b))
		ctype = "application/json"
	}
	resp, err := d.agentDo(ctx, id, method, path, body, ctype)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if out != nil {
		return json.NewDecoder(resp.Body).Decode(out)
	}
	return nil
}

// parseFrom reads the resume offset from Last-Event-ID or ?from=.
func parseFrom(r *http.Request) (int64, error) {
	v := r.Header.Get("Last-Event-ID")
	if v == "" {
		v = r.URL.Query().Get("from")
	}
	if v == "" {
		return 0, nil
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n < 0 {
		return 0, invalid("offset %q must be a non-negative integer", v)
	}
	return n, nil
}

// attach streams a process's output as SSE, starting a gated process once the stream
// is connected, so the client sees every byte from the first.
func (d *DataPlane) attach(w http.ResponseWriter, r *http.Request) error {
	id, pid, epoch, err := d.authorize(r, token.RightRead)
	if err != nil {
		return err
	}
	from, err := parseFrom(r)
	if err != nil {
		return err
	}
	text := false
	switch r.URL.Query().Get("encoding") {
	case "", "base64":
	case "text":
		text = true
	default:
		return invalid("encoding must be base64 or text")
	}
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	defer d.track(id, epoch, cancel)()

	var info wire.ProcessInfo
	if err := d.agentJSON(ctx, id, http.MethodGet, fmt.Sprintf("/v1/processes/%d", pid), nil, &info); err != nil {
		return err
	}
	follow := 1
	if f := r.URL.Query().Get("follow"); f == "0" || f == "false" {
		follow = 0
	}
	resp, err := d.agentDo(ctx, id, http.MethodGet, fmt.Sprintf("/v1/processes/%d/output?from=%d&follow=%d", pid, from, follow), nil, "")
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if info.State == wire.StateCreated && follow == 1 {
		if err := d.agentJSON(ctx, id, http.MethodPost, fmt.Sprintf("/v1/processes/%d/start", pid), nil, nil); err != nil && !fault.Is(err, fault.Conflict) {
			return err
		}
	}
	s := newSSE(w)
	if err := s.event("", api.EventStart, api.StartEvent{PID: pid, Offset: from}); err != nil {
		return nil
	}
	_ = s.flush()
	br := bufio.NewReaderSize(resp.Body, 256<<10)
	buf := make([]byte, wire.MaxFramePayload)
	merged := make([]byte, 0, maxEventBytes)
	for {
		f, err := wire.ReadFrame(br, buf)
		if err == nil && (f.Type == wire.FrameStdout || f.Type == wire.FrameStderr) {
			f.Payload = coalesce(br, f, merged[:0], buf)
		}
		if err != nil {
			if ctx.Err() == nil && err != io.EOF {
				_ = s.event("", api.EventError, map[string]string{"message": "agent stream ended: " + err.Error()})
			}
			_ = s.flush()
			return nil
		}
		if err := writeFrame(s, f, text); err != nil {
			return nil
		}
		if f.Type == wire.FrameStdout || f.Type == wire.FrameStderr || f.Type == wire.FrameHeartbeat {
			d.cfg.Node.Touch(id) // output and an open stream both count as activity
		}
		if br.Buffered() < wire.FrameHeaderSize {
			if s.flush() != nil {
				return nil
			}
		}
		if f.Type == wire.FrameExit {
			_ = s.flush()
			return nil
		}
	}
}

// writeFrame converts one agent frame to an SSE event.
func writeFrame(s *sse, f wire.Frame, text bool) error {
	switch f.Type {
	case wire.FrameStdout, wire.FrameStderr:
		name := api.EventStdout
		if f.Type == wire.FrameStderr {
			name = api.EventStderr
		}
		ev := api.OutputEvent{Offset: f.Offset}
		if text {
			ev.Text = strings.ToValidUTF8(string(f.Payload), string(utf8.RuneError))
		} else {
			ev.Data = base64.StdEncoding.EncodeToString(f.Payload)
		}
		return s.event(strconv.FormatInt(f.Offset+int64(len(f.Payload)), 10), name, ev)
	case wire.FrameGap:
		var dropped int64
		if len(f.Payload) >= 8 {
			for _, b := range f.Payload[:8] {
				dropped = dropped<<8 | int64(b)
			}
		}
		return s.event(strconv.FormatInt(f.Offset, 10), api.EventGap, api.GapEvent{Offset: f.Offset, Dropped: dropped})
	case wire.FrameExit:
		var ex wire.Exit
		_ = json.Unmarshal(f.Payload, &ex)
		return s.event(strconv.FormatInt(f.Offset, 10), api.EventExit, api.ExitEvent{ExitCode: ex.ExitCode, Signal: ex.Signal, Offset: f.Offset, Error: ex.Error})
	case wire.FrameHeartbeat:
		return s.comment("keepalive")
	default:
		return nil
	}
}

func (d *DataPlane) stdin(w http.ResponseWriter, r *http.Request) error {
	id, pid, _, err := d.authorize(r, token.RightStdin)
	if err != nil {
		return err
	}
	path := fmt.Sprintf("/v1/processes/%d/stdin", pid)
	if eof := r.URL.Query().Get("eof"); eof == "1" || eof == "true" {
		path += "?eof=1"
	}
	resp, err := d.agentDo(r.Context(), id, http.MethodPost, path, r.Body, "application/octet-stream")
	if err != nil {
		return err
	}
	resp.Body.Close()
	w.WriteHeader(http.StatusNoContent)
	return nil
}

func (d *DataPlane) signal(w http.ResponseWriter, r *http.Request) error {
	id, pid, _, err := d.authorize(r, token.RightSignal)
	if err != nil {
		return err
	}
	var req wire.Signal
	if err := decodeJSON(w, r, &req); err != nil {
		return err
	}
	if err := d.agentJSON(r.Context(), id, http.MethodPost, fmt.Sprintf("/v1/processes/%d/signal", pid), req, nil); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

func (d *DataPlane) resize(w http.ResponseWriter, r *http.Request) error {
	id, pid, _, err := d.authorize(r, token.RightResize)
	if err != nil {
		return err
	}
	var req api.PTYSize
	if err := decodeJSON(w, r, &req); err != nil {
		return err
	}
	if req.Rows < 1 || req.Rows > 1000 || req.Cols < 1 || req.Cols > 1000 {
		return invalid("rows and cols must be between 1 and 1000")
	}
	if err := d.agentJSON(r.Context(), id, http.MethodPost, fmt.Sprintf("/v1/processes/%d/resize", pid),
		wire.Size{Rows: uint16(req.Rows), Cols: uint16(req.Cols)}, nil); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

// agentProxy relays an api-role request to the sandbox's agent verbatim (streaming both
// ways). Only node tokens minted by an api process are accepted.
func (d *DataPlane) agentProxy(w http.ResponseWriter, r *http.Request) error {
	id := r.PathValue("id")
	claims, err := d.cfg.Signer.Verify(bearer(r))
	if err != nil {
		return err
	}
	if !claims.Has(token.RightNode) || claims.Sandbox != id {
		return fault.New(fault.Forbidden, "this endpoint is for space's api role only")
	}
	rt, err := d.cfg.Node.AgentTransport(r.Context(), id)
	if err != nil {
		return err
	}
	d.cfg.Node.Touch(id)
	path := "/" + r.PathValue("path")
	proxy := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.Out.URL = &url.URL{Scheme: "http", Host: "agent", Path: path, RawQuery: r.URL.RawQuery}
			pr.Out.Host = "agent"
			pr.Out.Header.Del("Authorization")
		},
		Transport:     rt,
		FlushInterval: -1,
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			if r.Context().Err() != nil {
				return
			}
			writeError(w, r, d.log, fault.New(fault.Unavailable, "sandbox agent unreachable: %v", err))
		},
	}
	// The agent may answer before it has read the whole request body; without full
	// duplex Go's server closes the body when the answer starts, which cuts the
	// upstream connection mid-stream.
	_ = http.NewResponseController(w).EnableFullDuplex()
	proxy.ServeHTTP(w, r)
	return nil
}

// maxEventBytes bounds the output carried by one SSE event.
const maxEventBytes = 1 << 20

// coalesce appends to first's payload the payloads of the frames already buffered in br
// that continue it (same stream, contiguous offsets), up to maxEventBytes. Processes
// write in small pieces (a pipe read is often 4 KiB); one event per piece would make the
// stream's cost per byte high.
func coalesce(br *bufio.Reader, first wire.Frame, merged, scratch []byte) []byte {
	merged = append(merged, first.Payload...)
	for len(merged) < maxEventBytes && br.Buffered() >= wire.FrameHeaderSize {
		hdr, err := br.Peek(wire.FrameHeaderSize)
		if err != nil || hdr[0] != first.Type {
			break
		}
		off := int64(binary.BigEndian.Uint64(hdr[1:9]))
		n := int(binary.BigEndian.Uint32(hdr[9:13]))
		if off != first.Offset+int64(len(merged)) || br.Buffered() < wire.FrameHeaderSize+n || len(merged)+n > maxEventBytes {
			break
		}
		f, err := wire.ReadFrame(br, scratch)
		if err != nil {
			break
		}
		merged = append(merged, f.Payload...)
	}
	return merged
}
