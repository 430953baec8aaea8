// Package agentclient is the host side of the agent protocol (package wire): a Go
// client for space-agent over whatever stream connection the runtime provides (a unix
// socket, vsock, a yamux stream). Agent errors come back as *Error with the HTTP
// status, so callers can map them onward.
package agentclient

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"github.com/spacedev/space/internal/guest/wire"
)

// Client talks to one agent. It is safe for concurrent use.
type Client struct {
	hc        *http.Client
	transport *http.Transport
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
		DisableCompression:  true,
		MaxIdleConnsPerHost: 16,
		IdleConnTimeout:     30 * time.Second,
		ForceAttemptHTTP2:   false,
	}
	return &Client{hc: &http.Client{Transport: t}, transport: t}
}

// DialUnix returns a dial function for a unix socket path.
func DialUnix(path string) func(ctx context.Context) (net.Conn, error) {
	return func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", path)
	}
}

// CloseIdleConnections closes connections not in use.
func (c *Client) CloseIdleConnections() { c.transport.CloseIdleConnections() }

// Error is an error response of the agent.
type Error struct {
	Status  int
	Code    string
	Message string
}

func (e *Error) Error() string {
	if e.Code != "" {
		return fmt.Sprintf("agent: %d %s: %s", e.Status, e.Code, e.Message)
	}
	return fmt.Sprintf("agent: %d: %s", e.Status, e.Message)
}

// StatusOf returns the HTTP status of an agent error, or 0 for other errors.
func StatusOf(err error) int {
	var e *Error
	if errors.As(err, &e) {
		return e.Status
	}
	return 0
}

// request sends a request and returns the response when its status is wanted;
// otherwise it returns the decoded *Error.
func (c *Client) request(ctx context.Context, method, path string, query url.Values, body io.Reader, contentType string, want ...int) (*http.Response, error) {
	u := baseURL + path
	if len(query) > 0 {
		u += "?" + query.Encode()
	}
	req, err := http.NewRequestWithContext(ctx, method, u, body)
	if err != nil {
		return nil, fmt.Errorf("agent %s %s: %w", method, path, err)
	}
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		return nil, fmt.Errorf("agent %s %s: %w", method, path, err)
	}
	for _, s := range want {
		if resp.StatusCode == s {
			return resp, nil
		}
	}
	defer resp.Body.Close()
	return nil, decodeError(resp)
}

func decodeError(resp *http.Response) error {
	data, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	e := &Error{Status: resp.StatusCode}
	var we wire.Error
	if json.Unmarshal(data, &we) == nil && (we.Code != "" || we.Message != "") {
		e.Code, e.Message = we.Code, we.Message
	} else {
		e.Message = string(bytes.TrimSpace(data))
		if e.Message == "" {
			e.Message = http.StatusText(resp.StatusCode)
		}
	}
	return e
}

// doJSON sends in (JSON, if not nil) and decodes the response into out (if not nil).
func (c *Client) doJSON(ctx context.Context, method, path string, query url.Values, in, out any, want ...int) error {
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
		return err
	}
	defer resp.Body.Close()
	if out == nil {
		_, _ = io.Copy(io.Discard, resp.Body)
		return nil
	}
	if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
		return fmt.Errorf("agent %s %s: decode response: %w", method, path, err)
	}
	return nil
}

// Health returns the agent's health.
func (c *Client) Health(ctx context.Context) (wire.Health, error) {
	var h wire.Health
	err := c.doJSON(ctx, http.MethodGet, "/v1/health", nil, nil, &h, http.StatusOK)
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
	return c.doJSON(ctx, http.MethodPost, "/v1/identity", nil, id, nil, http.StatusNoContent)
}

// Quiesce asks the agent to close its listener and connections until the resume file
// appears in its run directory. Idle connections of this client are dropped too.
func (c *Client) Quiesce(ctx context.Context) error {
	err := c.doJSON(ctx, http.MethodPost, "/v1/quiesce", nil, nil, nil, http.StatusNoContent)
	c.CloseIdleConnections()
	return err
}

// StartProcess creates a process (running at once unless spec.Gated).
func (c *Client) StartProcess(ctx context.Context, spec wire.ProcessSpec) (wire.ProcessInfo, error) {
	var pi wire.ProcessInfo
	err := c.doJSON(ctx, http.MethodPost, "/v1/processes", nil, spec, &pi, http.StatusCreated)
	return pi, err
}

// ListProcesses lists running and retained exited processes, oldest first.
func (c *Client) ListProcesses(ctx context.Context) ([]wire.ProcessInfo, error) {
	var out []wire.ProcessInfo
	err := c.doJSON(ctx, http.MethodGet, "/v1/processes", nil, nil, &out, http.StatusOK)
	return out, err
}

// GetProcess describes one process.
func (c *Client) GetProcess(ctx context.Context, pid int) (wire.ProcessInfo, error) {
	var pi wire.ProcessInfo
	err := c.doJSON(ctx, http.MethodGet, procPath(pid, ""), nil, nil, &pi, http.StatusOK)
	return pi, err
}

// Start runs a gated process's program (idempotent; 409 once it has exited).
func (c *Client) Start(ctx context.Context, pid int) error {
	return c.doJSON(ctx, http.MethodPost, procPath(pid, "/start"), nil, nil, nil, http.StatusNoContent)
}

// WriteStdin streams r into the process's stdin; eof closes stdin afterwards (sends ^D
// to a terminal).
func (c *Client) WriteStdin(ctx context.Context, pid int, r io.Reader, eof bool) error {
	q := url.Values{}
	if eof {
		q.Set("eof", "1")
	}
	if r == nil {
		r = http.NoBody
	}
	resp, err := c.request(ctx, http.MethodPost, procPath(pid, "/stdin"), q, r, "application/octet-stream", http.StatusNoContent)
	if err != nil {
		return err
	}
	resp.Body.Close()
	return nil
}

// Signal sends a signal ("SIGTERM", "TERM", "9", ...) to the process's group.
func (c *Client) Signal(ctx context.Context, pid int, signal string) error {
	return c.doJSON(ctx, http.MethodPost, procPath(pid, "/signal"), nil, wire.Signal{Signal: signal}, nil, http.StatusNoContent)
}

// Resize sets the terminal size of a PTY process.
func (c *Client) Resize(ctx context.Context, pid int, size wire.Size) error {
	return c.doJSON(ctx, http.MethodPost, procPath(pid, "/resize"), nil, size, nil, http.StatusNoContent)
}

func procPath(pid int, suffix string) string {
	return "/v1/processes/" + strconv.Itoa(pid) + suffix
}

// OutputStream reads the frames of a process's output.
type OutputStream struct {
	body io.ReadCloser
	br   *bufio.Reader
	buf  []byte
}

// Output opens the output stream of pid from journal offset from. With follow it lasts
// until the exit frame; without, it ends after what exists now.
func (c *Client) Output(ctx context.Context, pid int, from int64, follow bool) (*OutputStream, error) {
	q := url.Values{"from": {strconv.FormatInt(from, 10)}}
	if follow {
		q.Set("follow", "1")
	}
	resp, err := c.request(ctx, http.MethodGet, procPath(pid, "/output"), q, nil, "", http.StatusOK)
	if err != nil {
		return nil, err
	}
	return &OutputStream{body: resp.Body, br: bufio.NewReaderSize(resp.Body, 64<<10)}, nil
}

// Next returns the next frame; io.EOF at the end of the stream. The payload is only
// valid until the next call.
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
	return f, nil
}

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
