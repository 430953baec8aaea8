// Package agentclient is the host side of the agent protocol (package wire): the one
// Go client for space-agent, used by the node (over whatever stream connection the
// runtime provides: a unix socket, vsock, a yamux stream), by the node's data plane,
// and by the api role (through the node's internal agent proxy).
//
// Everything that comes out of a sandbox is untrusted input, the agent included: every
// reply is bounded in size (per message type) and time. An oversized, malformed or slow
// reply fails that one call with a fault.BadGateway error; the host's memory does not
// move. Agent errors come back as *Error (with the HTTP status) wrapped in a fault of
// the matching kind, so callers map them onward in one step.
package agentclient

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/guest/wire"
)

// Bounds on what an agent may send back.
const (
	// MaxSmallReply bounds single-record replies (health, a process, a file entry).
	MaxSmallReply = 64 << 10
	// MaxListReply bounds list replies (processes, directory listings).
	MaxListReply = 16 << 20
	// maxErrorBody bounds error bodies.
	maxErrorBody = 64 << 10
	// CallTimeout bounds a JSON call that names no shorter deadline.
	CallTimeout = 30 * time.Second
	// headerTimeout bounds the wait for a reply's headers (also of streams).
	headerTimeout = 30 * time.Second
)

// Client talks to one agent. It is safe for concurrent use.
type Client struct {
	hc        *http.Client
	transport http.RoundTripper
	base      string
	auth      func() (string, error)
	// noExec: the agent has no POST /v1/exec (it answered 404 once).
	noExec atomic.Bool
}

// baseURL is a placeholder host: every connection comes from the dial function.
const baseURL = "http://agent"

// New returns a client that opens each connection with dial. Idle connections are
// reused; CloseIdleConnections drops them (e.g. before a checkpoint).
func New(dial func(ctx context.Context) (net.Conn, error)) *Client {
	t := &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return dial(ctx)
		},
		DisableCompression:     true,
		MaxIdleConnsPerHost:    16,
		IdleConnTimeout:        30 * time.Second,
		ResponseHeaderTimeout:  headerTimeout,
		MaxResponseHeaderBytes: 64 << 10,
		ForceAttemptHTTP2:      false,
	}
	rt := retryClosedIdle{inner: t} // pooled connections the agent closed (retry.go)
	return &Client{hc: &http.Client{Transport: rt}, transport: rt, base: baseURL}
}

// NewVia returns a client that reaches the agent through an HTTP relay at base (the
// node's internal agent proxy), authorized by the bearer token that auth returns.
func NewVia(base string, rt http.RoundTripper, auth func() (string, error)) *Client {
	if rt == nil {
		rt = http.DefaultTransport
	}
	rt = retryClosedIdle{inner: rt} // connections to the node are shared keep-alives (retry.go)
	return &Client{hc: &http.Client{Transport: rt}, transport: rt, base: base, auth: auth}
}

// Through returns a client of the same agent whose round trips pass through wrap(the
// client's transport) (the node's agent gate, gate.go in package node). Connections
// stay shared with c.
func (c *Client) Through(wrap func(http.RoundTripper) http.RoundTripper) *Client {
	rt := wrap(c.transport)
	w := &Client{hc: &http.Client{Transport: rt}, transport: rt, base: c.base, auth: c.auth}
	w.noExec.Store(c.noExec.Load())
	return w
}

// DialUnix returns a dial function for a unix socket path.
func DialUnix(path string) func(ctx context.Context) (net.Conn, error) {
	return func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", path)
	}
}

// Upgrade asks the agent to switch the connection of a GET of path to protocol (a port
// tunnel) and returns its answer as it comes: 101 with a writable body, or an error
// status for the caller to decode. ctx governs the upgraded connection too.
func (c *Client) Upgrade(ctx context.Context, path, protocol string) (*http.Response, error) {
	req, err := c.newRequest(ctx, http.MethodGet, path, nil, nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Connection", "Upgrade")
	req.Header.Set("Upgrade", protocol)
	return c.transport.RoundTrip(req)
}

// Transport is the round tripper that reaches the agent (for relays that stream
// requests through verbatim, like the data plane's internal proxy).
func (c *Client) Transport() http.RoundTripper { return c.transport }

// CloseIdleConnections closes connections not in use.
func (c *Client) CloseIdleConnections() {
	if t, ok := c.transport.(interface{ CloseIdleConnections() }); ok {
		t.CloseIdleConnections()
	}
}

// Error is an error response of the agent.
type Error struct {
	Status  int
	Code    string
	Message string
}

func (e *Error) Error() string { return e.Message }

// StatusOf returns the HTTP status of an agent error, or 0 for other errors.
func StatusOf(err error) int {
	var e *Error
	if errors.As(err, &e) {
		return e.Status
	}
	return 0
}

// CodeOf returns the wire error code of an agent error ("" for other errors).
func CodeOf(err error) string {
	var e *Error
	if errors.As(err, &e) {
		return e.Code
	}
	return ""
}

// kindOf maps an agent (or relay) status to a fault kind.
func kindOf(status int) fault.Kind {
	switch status {
	case http.StatusBadRequest:
		return fault.Invalid
	case http.StatusNotFound:
		return fault.NotFound
	case http.StatusConflict:
		return fault.Conflict
	case http.StatusUnauthorized:
		return fault.Unauthorized
	case http.StatusForbidden:
		return fault.Forbidden
	case http.StatusRequestEntityTooLarge:
		return fault.TooLarge
	case http.StatusInsufficientStorage:
		return fault.InsufficientStorage
	case http.StatusUnprocessableEntity:
		return fault.Unprocessable
	case http.StatusServiceUnavailable:
		return fault.Unavailable
	case http.StatusGone:
		return fault.Gone
	case http.StatusBadGateway, http.StatusGatewayTimeout:
		return fault.BadGateway
	default:
		return fault.Internal
	}
}

// request sends a request and returns the response when its status is wanted;
// otherwise it returns the decoded error.
func (c *Client) request(ctx context.Context, method, path string, query url.Values, body io.Reader, contentType string, want ...int) (*http.Response, error) {
	return c.send(ctx, method, path, query, body, contentType, nil, want...)
}

// stream is request for a stream that its caller resumes by itself when it is cut
// (wire.ResumableHeader): an exec's output, a followed output, a watch.
func (c *Client) stream(ctx context.Context, method, path string, query url.Values, body io.Reader, contentType string, want ...int) (*http.Response, error) {
	return c.send(ctx, method, path, query, body, contentType, http.Header{wire.ResumableHeader: {"1"}}, want...)
}

// newRequest makes a request of path (with query) to the agent, authorized.
func (c *Client) newRequest(ctx context.Context, method, path string, query url.Values, body io.Reader) (*http.Request, error) {
	u := c.base + path
	if len(query) > 0 {
		u += "?" + query.Encode()
	}
	req, err := http.NewRequestWithContext(ctx, method, u, body)
	if err != nil {
		return nil, fmt.Errorf("agent %s %s: %w", method, path, err)
	}
	if c.auth != nil {
		tok, err := c.auth()
		if err != nil {
			return nil, err
		}
		req.Header.Set("Authorization", "Bearer "+tok)
	}
	return req, nil
}

func (c *Client) send(ctx context.Context, method, path string, query url.Values, body io.Reader, contentType string, extra http.Header, want ...int) (*http.Response, error) {
	req, err := c.newRequest(ctx, method, path, query, body)
	if err != nil {
		return nil, err
	}
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	for k, v := range extra {
		req.Header[k] = v
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, fault.New(fault.Unavailable, "sandbox agent unreachable (%s %s): %v", method, path, err)
	}
	for _, s := range want {
		if resp.StatusCode == s {
			return resp, nil
		}
	}
	defer resp.Body.Close()
	if resp.StatusCode < 400 {
		// A success or redirect other than the one the call expects: the agent is not
		// speaking its protocol (or is not the agent at all), so the gateway is at fault.
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, maxErrorBody))
		return nil, fault.New(fault.BadGateway, "sandbox agent: unexpected status %d to %s %s", resp.StatusCode, method, path)
	}
	return nil, DecodeError(resp)
}

// DecodeError turns an error response of an agent (or of the relay in front of it)
// into an *Error wrapped in the fault of its status. The body is read up to a bound.
func DecodeError(resp *http.Response) error {
	data, _ := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody))
	e := &Error{Status: resp.StatusCode}
	var we wire.Error
	var relay struct {
		Error struct {
			Code    string `json:"code"`
			Message string `json:"message"`
		} `json:"error"`
	}
	switch {
	case json.Unmarshal(data, &we) == nil && (we.Code != "" || we.Message != ""):
		e.Code, e.Message = we.Code, we.Message
	case json.Unmarshal(data, &relay) == nil && relay.Error.Message != "":
		e.Code, e.Message = relay.Error.Code, relay.Error.Message
	default:
		e.Message = string(bytes.ToValidUTF8(bytes.TrimSpace(data), []byte("?")))
		if e.Message == "" {
			e.Message = http.StatusText(resp.StatusCode)
		}
	}
	return fault.Wrap(kindOf(resp.StatusCode), e)
}

// decodeBounded decodes one JSON value of at most limit bytes from r into out.
func decodeBounded(r io.Reader, limit int64, out any, what string) error {
	data, err := io.ReadAll(io.LimitReader(r, limit+1))
	if err != nil {
		return fault.New(fault.BadGateway, "sandbox agent: reading the reply to %s: %v", what, err)
	}
	if int64(len(data)) > limit {
		return fault.New(fault.BadGateway, "sandbox agent: the reply to %s exceeds %d bytes", what, limit)
	}
	if err := json.Unmarshal(data, out); err != nil {
		return fault.New(fault.BadGateway, "sandbox agent: malformed reply to %s: %v", what, err)
	}
	return nil
}

// doJSON sends in (JSON, if not nil) and decodes the response (at most limit bytes)
// into out (if not nil), within CallTimeout unless ctx ends sooner.
func (c *Client) doJSON(ctx context.Context, method, path string, query url.Values, in, out any, limit int64, want ...int) error {
	ctx, cancel := context.WithTimeout(ctx, CallTimeout)
	defer cancel()
	var body io.Reader
	ct := ""
	if in != nil {
		data, err := json.Marshal(in)
		if err != nil {
			return fmt.Errorf("agent %s %s: %w", method, path, err)
		}
		body, ct = bytes.NewReader(data), "application/json"
	}
	resp, err := c.request(ctx, method, path, query, body, ct, want...)
	if err != nil {
		if errors.Is(err, context.DeadlineExceeded) && ctx.Err() != nil {
			return fault.New(fault.BadGateway, "sandbox agent did not answer %s %s within %s", method, path, CallTimeout)
		}
		return err
	}
	defer resp.Body.Close()
	if out == nil {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, limit))
		return nil
	}
	if err := decodeBounded(resp.Body, limit, out, method+" "+path); err != nil {
		if ctx.Err() != nil {
			return fault.New(fault.BadGateway, "sandbox agent did not answer %s %s within %s", method, path, CallTimeout)
		}
		return err
	}
	return nil
}

// Health returns the agent's health.
func (c *Client) Health(ctx context.Context) (wire.Health, error) {
	var h wire.Health
	err := c.doJSON(ctx, http.MethodGet, "/v1/health", nil, nil, &h, MaxSmallReply, http.StatusOK)
	return h, err
}

// WaitReady polls Health (backoff 5 ms doubling to 200 ms) until the agent answers or
// ctx is done.
func (c *Client) WaitReady(ctx context.Context) (wire.Health, error) {
	delay := 5 * time.Millisecond
	for {
		actx, cancel := context.WithTimeout(ctx, 2*time.Second)
		h, err := c.Health(actx)
		cancel()
		if err == nil {
			return h, nil
		}
		t := time.NewTimer(delay)
		select {
		case <-ctx.Done():
			t.Stop()
			return wire.Health{}, fmt.Errorf("wait for agent: %w (last error: %v)", ctx.Err(), err)
		case <-t.C:
		}
		delay = min(delay*2, 200*time.Millisecond)
	}
}

// SetIdentity applies an identity (entropy, clock, env, hostname).
func (c *Client) SetIdentity(ctx context.Context, id wire.Identity) error {
	return c.doJSON(ctx, http.MethodPost, "/v1/identity", nil, id, nil, MaxSmallReply, http.StatusNoContent)
}

// Quiesce asks the agent to freeze every user process until its next identity. With
// keepTransport (VM transports, which survive a restore) it keeps serving; otherwise
// it also closes its listener and connections until the resume file appears in its
// run directory (gVisor: runsc cannot checkpoint a host socket). Idle connections of
// this client are dropped.
func (c *Client) Quiesce(ctx context.Context, keepTransport bool) error {
	var q url.Values
	if keepTransport {
		q = url.Values{"transport": {"keep"}}
	}
	err := c.doJSON(ctx, http.MethodPost, "/v1/quiesce", q, nil, nil, MaxSmallReply, http.StatusNoContent)
	c.CloseIdleConnections()
	return err
}

// QuiesceClosing is Quiesce for an agent that closes its transport once it has
// answered (gVisor's), whose run directory on the host is runDir: it returns once the
// agent shows that it is quiesced (WaitQuiesced). The answer and the close race: the
// agent closes every connection as it quiesces, and a request that did reach it may
// still end without its answer. So a failure without an answer of the agent's is
// taken for that close when the quiesced marker follows within quiesceCloseGrace; an
// answer (a refusal such as 409 cannot_checkpoint) is returned as it is.
func (c *Client) QuiesceClosing(ctx context.Context, runDir string) error {
	err := c.Quiesce(ctx, false)
	var answered *Error
	if err != nil && !errors.As(err, &answered) && ctx.Err() == nil {
		gctx, cancel := context.WithTimeout(ctx, quiesceCloseGrace)
		defer cancel()
		if WaitQuiesced(gctx, runDir) == nil {
			return nil
		}
	}
	if err != nil {
		return err
	}
	return WaitQuiesced(ctx, runDir)
}

// quiesceCloseGrace is how long QuiesceClosing waits for the quiesced marker after a
// quiesce request that got no answer.
const quiesceCloseGrace = 2 * time.Second

// ReclaimMemory asks the agent to end the process holding the most memory, as an OOM
// killer would (the node calls it when the sandbox nears its host memory limit). It
// returns false when the agent found no process to end.
func (c *Client) ReclaimMemory(ctx context.Context) (wire.Reclaimed, bool, error) {
	ctx, cancel := context.WithTimeout(ctx, CallTimeout)
	defer cancel()
	resp, err := c.request(ctx, http.MethodPost, "/v1/memory/reclaim", nil, nil, "", http.StatusOK, http.StatusNoContent)
	if err != nil {
		return wire.Reclaimed{}, false, err
	}
	defer resp.Body.Close()
	if resp.StatusCode == http.StatusNoContent {
		return wire.Reclaimed{}, false, nil
	}
	var v wire.Reclaimed
	if err := decodeBounded(resp.Body, MaxSmallReply, &v, "POST /v1/memory/reclaim"); err != nil {
		return wire.Reclaimed{}, false, err
	}
	return v, true, nil
}

// StartProcess creates a process (running at once unless spec.Gated).
func (c *Client) StartProcess(ctx context.Context, spec wire.ProcessSpec) (wire.ProcessInfo, error) {
	var pi wire.ProcessInfo
	err := c.doJSON(ctx, http.MethodPost, "/v1/processes", nil, spec, &pi, MaxSmallReply, http.StatusCreated)
	return pi, err
}

// ListProcesses lists running and retained exited processes, oldest first.
func (c *Client) ListProcesses(ctx context.Context) ([]wire.ProcessInfo, error) {
	var out []wire.ProcessInfo
	err := c.doJSON(ctx, http.MethodGet, "/v1/processes", nil, nil, &out, MaxListReply, http.StatusOK)
	return out, err
}

// Proc addresses one process: by pid and, when uid is set, only if the process with
// that pid is still the one with that identity (wire.ProcessInfo.UID). A pid reused by
// another process (after the sandbox's instance was lost and booted again) then fails
// with a fault.Gone error whose code is wire.ErrCodeProcessGone, never reaching the
// other process.
type Proc struct {
	c   *Client
	pid int
	uid string
}

// Proc returns a handle on process pid (uid "" checks no identity).
func (c *Client) Proc(pid int, uid string) Proc { return Proc{c: c, pid: pid, uid: uid} }

func (p Proc) path(suffix string) string { return procPath(p.pid, suffix) }

// UID is the process identity the handle checks ("" for none).
func (p Proc) UID() string { return p.uid }

func (p Proc) query(q url.Values) url.Values {
	if p.uid == "" {
		return q
	}
	if q == nil {
		q = url.Values{}
	}
	q.Set(wire.UIDQuery, p.uid)
	return q
}

// Info describes the process.
func (p Proc) Info(ctx context.Context) (wire.ProcessInfo, error) {
	var pi wire.ProcessInfo
	err := p.c.doJSON(ctx, http.MethodGet, p.path(""), p.query(nil), nil, &pi, MaxSmallReply, http.StatusOK)
	return pi, err
}

// Start runs a gated process's program (idempotent; 409 once it has exited).
func (p Proc) Start(ctx context.Context) error {
	return p.c.doJSON(ctx, http.MethodPost, p.path("/start"), p.query(nil), nil, nil, MaxSmallReply, http.StatusNoContent)
}

// WriteStdin streams r into the process's stdin; eof closes stdin afterwards (sends ^D
// to a terminal).
func (p Proc) WriteStdin(ctx context.Context, r io.Reader, eof bool) error {
	q := url.Values{}
	if eof {
		q.Set("eof", "1")
	}
	if r == nil {
		r = http.NoBody
	}
	resp, err := p.c.request(ctx, http.MethodPost, p.path("/stdin"), p.query(q), r, "application/octet-stream", http.StatusNoContent)
	if err != nil {
		return err
	}
	resp.Body.Close()
	return nil
}

// Signal sends a signal ("SIGTERM", "TERM", "9", ...) to the process's group.
func (p Proc) Signal(ctx context.Context, signal string) error {
	return p.c.doJSON(ctx, http.MethodPost, p.path("/signal"), p.query(nil), wire.Signal{Signal: signal}, nil, MaxSmallReply, http.StatusNoContent)
}

// Resize sets the terminal size of a PTY process.
func (p Proc) Resize(ctx context.Context, size wire.Size) error {
	return p.c.doJSON(ctx, http.MethodPost, p.path("/resize"), p.query(nil), size, nil, MaxSmallReply, http.StatusNoContent)
}

// Output opens the output stream of the process from journal offset from. With follow
// it lasts until the exit frame; without, it ends after what exists now.
func (p Proc) Output(ctx context.Context, from int64, follow bool) (*OutputStream, error) {
	q := url.Values{"from": {strconv.FormatInt(from, 10)}}
	if follow {
		q.Set("follow", "1")
	}
	send := p.c.request
	if follow {
		send = p.c.stream
	}
	resp, err := send(ctx, http.MethodGet, p.path("/output"), p.query(q), nil, "", http.StatusOK)
	if err != nil {
		return nil, err
	}
	return &OutputStream{body: resp.Body, br: bufio.NewReaderSize(resp.Body, 256<<10)}, nil
}

// Execution is a process started by Exec, with its output stream from offset 0.
type Execution struct {
	PID int
	UID string
	Out *OutputStream
}

// Exec creates a process, writes stdin (when not nil) to it and closes it, and
// returns the process's output stream from offset 0, following it to the exit frame:
// one call (POST /v1/exec) to an agent that has it. An older agent (a sandbox restored
// from a snapshot taken before the call existed) answers 404 without an error code;
// then Exec takes the three calls those agents know: a gated process, its output
// stream, its start (and a stdin write), and remembers not to try again.
func (c *Client) Exec(ctx context.Context, spec wire.ProcessSpec, stdin []byte) (*Execution, error) {
	if !c.noExec.Load() {
		x, err := c.execOne(ctx, spec, stdin)
		if err == nil || StatusOf(err) != http.StatusNotFound || CodeOf(err) != "" {
			return x, err
		}
		c.noExec.Store(true)
	}
	return c.execSteps(ctx, spec, stdin)
}

func (c *Client) execOne(ctx context.Context, spec wire.ProcessSpec, stdin []byte) (*Execution, error) {
	spec.Gated = false
	data, err := json.Marshal(wire.ExecRequest{ProcessSpec: spec, StdinData: stdin})
	if err != nil {
		return nil, fmt.Errorf("agent exec: %w", err)
	}
	resp, err := c.stream(ctx, http.MethodPost, "/v1/exec", nil, bytes.NewReader(data), "application/json", http.StatusOK)
	if err != nil {
		return nil, err
	}
	pid, perr := strconv.Atoi(resp.Header.Get(wire.PIDHeader))
	uid := resp.Header.Get(wire.UIDHeader)
	if perr != nil || pid <= 0 || uid == "" || len(uid) > 256 {
		resp.Body.Close()
		return nil, fault.New(fault.BadGateway, "sandbox agent: exec answer without a valid process id")
	}
	return &Execution{PID: pid, UID: uid, Out: &OutputStream{body: resp.Body, br: bufio.NewReaderSize(resp.Body, 256<<10)}}, nil
}

// execSteps is Exec for agents without POST /v1/exec.
func (c *Client) execSteps(ctx context.Context, spec wire.ProcessSpec, stdin []byte) (*Execution, error) {
	spec.Gated = true
	spec.Stdin = spec.Stdin || stdin != nil
	info, err := c.StartProcess(ctx, spec)
	if err != nil {
		return nil, err
	}
	proc := c.Proc(info.PID, info.UID)
	fail := func(err error) (*Execution, error) {
		// The gated process never ran: end it so it does not wait for a start.
		kctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_ = proc.Signal(kctx, "KILL")
		return nil, err
	}
	out, err := proc.Output(ctx, 0, true)
	if err != nil {
		return fail(err)
	}
	if err := proc.Start(ctx); err != nil && !fault.Is(err, fault.Conflict) {
		out.Close()
		return fail(err)
	}
	if stdin != nil {
		go func() { _ = proc.WriteStdin(ctx, bytes.NewReader(stdin), true) }()
	}
	return &Execution{PID: info.PID, UID: info.UID, Out: out}, nil
}

// GetProcess describes one process.
func (c *Client) GetProcess(ctx context.Context, pid int) (wire.ProcessInfo, error) {
	return c.Proc(pid, "").Info(ctx)
}

// Start runs a gated process's program (idempotent; 409 once it has exited).
func (c *Client) Start(ctx context.Context, pid int) error { return c.Proc(pid, "").Start(ctx) }

// WriteStdin streams r into the process's stdin; eof closes stdin afterwards.
func (c *Client) WriteStdin(ctx context.Context, pid int, r io.Reader, eof bool) error {
	return c.Proc(pid, "").WriteStdin(ctx, r, eof)
}

// Signal sends a signal to the process's group.
func (c *Client) Signal(ctx context.Context, pid int, signal string) error {
	return c.Proc(pid, "").Signal(ctx, signal)
}

// Resize sets the terminal size of a PTY process.
func (c *Client) Resize(ctx context.Context, pid int, size wire.Size) error {
	return c.Proc(pid, "").Resize(ctx, size)
}

func procPath(pid int, suffix string) string {
	return "/v1/processes/" + strconv.Itoa(pid) + suffix
}

// Output opens the output stream of pid from journal offset from.
func (c *Client) Output(ctx context.Context, pid int, from int64, follow bool) (*OutputStream, error) {
	return c.Proc(pid, "").Output(ctx, from, follow)
}

// OutputStream reads the frames of a process's output.
type OutputStream struct {
	body   io.ReadCloser
	br     *bufio.Reader
	buf    []byte
	merged []byte
}

// After its exit frame, Next reads the rest of a stream (the end of the agent's
// answer) for at most drainTimeout and drainMax bytes.
const (
	drainTimeout = time.Second
	drainMax     = 64 << 10
)

// Next returns the next frame; io.EOF at the end of the stream. The payload is only
// valid until the next call.
//
// With the exit frame, Next also reads the stream to its end, which the agent sends
// right after the exit: an answer read to its end leaves its connection to the client's
// pool for the next call (whatever the caller does next: close the stream, cancel the
// request's context), where one closed early would close the connection, and the next
// call would pay a dial (and, under gVisor, an accept in the sandbox). An agent that
// holds its answer open after the exit gets drainTimeout.
func (s *OutputStream) Next() (wire.Frame, error) {
	f, err := wire.ReadFrame(s.br, s.buf)
	if err != nil {
		if errors.Is(err, io.ErrUnexpectedEOF) {
			return wire.Frame{}, fmt.Errorf("agent output: %w", err)
		}
		return wire.Frame{}, err
	}
	if cap(f.Payload) > cap(s.buf) {
		s.buf = f.Payload[:cap(f.Payload)]
	}
	if f.Type == wire.FrameExit {
		t := time.AfterFunc(drainTimeout, func() { _ = s.body.Close() })
		_, _ = io.Copy(io.Discard, io.LimitReader(s.br, drainMax))
		t.Stop()
	}
	return f, nil
}

// NextMerged is Next that appends to an output frame the payloads of the frames
// already received that continue it (same stream, contiguous offsets), up to max
// bytes. Processes write in small pieces (a pipe read is often 4 KiB); one event per
// piece would make a stream's cost per byte high.
func (s *OutputStream) NextMerged(max int) (wire.Frame, error) {
	f, err := s.Next()
	if err != nil || (f.Type != wire.FrameStdout && f.Type != wire.FrameStderr) {
		return f, err
	}
	s.merged = append(s.merged[:0], f.Payload...)
	for len(s.merged) < max && s.br.Buffered() >= wire.FrameHeaderSize {
		hdr, err := s.br.Peek(wire.FrameHeaderSize)
		if err != nil {
			break
		}
		next, n := wire.ParseHeader(hdr)
		if next.Type != f.Type || next.Offset != f.Offset+int64(len(s.merged)) ||
			s.br.Buffered() < wire.FrameHeaderSize+n || len(s.merged)+n > max {
			break
		}
		g, err := s.Next()
		if err != nil {
			break
		}
		s.merged = append(s.merged, g.Payload...)
	}
	f.Payload = s.merged
	return f, nil
}

// Buffered reports whether a whole frame header has been received but not read yet
// (a relay flushes its client when it has not).
func (s *OutputStream) Buffered() bool { return s.br.Buffered() >= wire.FrameHeaderSize }

// Close ends the stream.
func (s *OutputStream) Close() error { return s.body.Close() }

// WaitQuiesced waits (polling every 2 ms) until the agent whose run directory on the
// host is runDir has closed its listener and connections after Quiesce: then the
// sandbox can be checkpointed.
func WaitQuiesced(ctx context.Context, runDir string) error {
	marker := filepath.Join(runDir, wire.QuiescedFileName)
	t := time.NewTicker(2 * time.Millisecond)
	defer t.Stop()
	for {
		if _, err := os.Stat(marker); err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("wait for agent quiesce: %w", ctx.Err())
		case <-t.C:
		}
	}
}

// WriteResume ends a quiesce: it removes the agent's old socket file from runDir (the
// agent cannot under gVisor) and atomically writes the resume file with id, whose
// generation must be newer than the agent's. WaitReady then waits for the agent.
func WriteResume(runDir string, id wire.Identity) error {
	if err := os.Remove(filepath.Join(runDir, wire.AgentSocketName)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("resume agent: %w", err)
	}
	data, err := json.Marshal(id)
	if err != nil {
		return fmt.Errorf("resume agent: %w", err)
	}
	tmp, err := os.CreateTemp(runDir, ".resume-*")
	if err != nil {
		return fmt.Errorf("resume agent: %w", err)
	}
	_, err = tmp.Write(data)
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), filepath.Join(runDir, wire.ResumeFileName))
	}
	if err != nil {
		_ = os.Remove(tmp.Name())
		return fmt.Errorf("resume agent: %w", err)
	}
	return nil
}

// ReplayableBody is the largest request body Relay reads before it sends it (see
// there), so that it can be sent again; the node's agent gate counts a body this short
// as sent at once.
const ReplayableBody = 64 << 10

// Relay streams an HTTP request to the agent path (with query) and the agent's answer
// back to w, both ways without buffering (file contents, envd's Connect streams) but
// for a request body of at most ReplayableBody declared bytes, read first. An
// error answer of the agent is turned into an error (nothing written to w yet); a
// failure after the answer started only ends the stream.
func (c *Client) Relay(w http.ResponseWriter, r *http.Request, agentPath string, query url.Values, log *slog.Logger) error {
	target, err := url.Parse(c.base)
	if err != nil {
		return err
	}
	var token string
	if c.auth != nil {
		if token, err = c.auth(); err != nil {
			return err
		}
	}
	var relayErr error
	p := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(target)
			pr.Out.URL.Path = target.Path + agentPath
			pr.Out.URL.RawPath = ""
			pr.Out.URL.RawQuery = query.Encode()
			pr.Out.Host = target.Host
			pr.Out.Header.Del("Authorization")
			pr.Out.Header.Del("X-Api-Key")
			if token != "" {
				pr.Out.Header.Set("Authorization", "Bearer "+token)
			}
		},
		Transport:     c.transport,
		FlushInterval: -1,
		ModifyResponse: func(resp *http.Response) error {
			if resp.StatusCode < 300 {
				return nil
			}
			return DecodeError(resp)
		},
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) { relayErr = err },
		// A stream cut under it (the agent's connection closed: a stop, a suspend) is
		// logged here; it ends the request.
		ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelDebug),
	}
	// A short body of declared length (an envd unary or server-streaming call, a few
	// hundred bytes) is read first, so that the transport can send it again on another
	// connection when the one it took was closed under it (retry.go). A longer or a
	// streaming one goes through as it comes.
	if r.ContentLength > 0 && r.ContentLength <= ReplayableBody {
		body, err := io.ReadAll(io.LimitReader(r.Body, r.ContentLength))
		if err == nil && int64(len(body)) != r.ContentLength {
			err = io.ErrUnexpectedEOF
		}
		if err != nil {
			return fault.New(fault.Invalid, "read request body: %v", err)
		}
		r = r.Clone(r.Context())
		r.Body = io.NopCloser(bytes.NewReader(body))
		r.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
	}
	// The agent may answer before it has read the whole request body; without full
	// duplex Go's server closes the body when the answer starts, which cuts the
	// upstream connection mid-stream.
	_ = http.NewResponseController(w).EnableFullDuplex()
	p.ServeHTTP(w, r)
	if relayErr != nil && fault.KindOf(relayErr) == fault.Internal && r.Context().Err() == nil {
		return fault.New(fault.Unavailable, "sandbox agent unreachable: %v", relayErr)
	}
	return relayErr
}

// GetJSON reads one JSON document of at most limit bytes from an agent path (for
// endpoints this package has no method for, like envd's).
func (c *Client) GetJSON(ctx context.Context, path string, out any, limit int64) error {
	return c.doJSON(ctx, http.MethodGet, path, nil, nil, out, limit, http.StatusOK)
}
