package client

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/spacedev/space/api"
)

// Event is one event of an attach stream.
type Event struct {
	ID   string
	Name string
	// Data is the event's JSON data; with Raw (a stdout or stderr event of a stream in
	// the frames encoding) the output bytes themselves, valid until the next Next.
	Data []byte
	Raw  bool
}

// Stream reads an attach stream: SSE, or binary frames (api.FramesContentType).
type Stream struct {
	resp   *http.Response
	br     *bufio.Reader
	frames bool
	buf    []byte
}

// acceptFrames asks for the frames encoding and takes SSE from a server without it.
const acceptFrames = api.FramesContentType + ", text/event-stream;q=0.5"

// newStream reads resp's body in the encoding its Content-Type names.
func newStream(resp *http.Response) *Stream {
	ct, _, _ := strings.Cut(resp.Header.Get("Content-Type"), ";")
	return &Stream{resp: resp, br: newReader(resp.Body), frames: strings.TrimSpace(ct) == api.FramesContentType}
}

// Attach opens the attach stream of a session (SSE), resuming after lastEventID when
// it is not empty.
func (c *Client) Attach(ctx context.Context, s *api.CommandSession, lastEventID string) (*Stream, error) {
	return c.attach(ctx, s, lastEventID, "text/event-stream")
}

func (c *Client) attach(ctx context.Context, s *api.CommandSession, lastEventID, accept string) (*Stream, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.AttachURL, nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Authorization", "Bearer "+s.Token)
	req.Header.Set("Accept", accept)
	if lastEventID != "" {
		req.Header.Set("Last-Event-ID", lastEventID)
	}
	resp, err := c.HTTP.Do(req)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		defer resp.Body.Close()
		return nil, decodeError(resp)
	}
	return newStream(resp), nil
}

// frameNames are the event names of the frame types.
var frameNames = map[byte]string{api.FrameStdout: api.EventStdout, api.FrameStderr: api.EventStderr,
	api.FrameGap: api.EventGap, api.FrameExit: api.EventExit, api.FrameStart: api.EventStart,
	api.FrameError: api.EventError, api.FrameLost: api.EventLost}

// nextFrame is Next for the frames encoding.
func (s *Stream) nextFrame() (Event, error) {
	for {
		var h [api.FrameHeaderSize]byte
		if _, err := io.ReadFull(s.br, h[:]); err != nil {
			return Event{}, err
		}
		typ, off, n := h[0], int64(binary.BigEndian.Uint64(h[1:9])), binary.BigEndian.Uint32(h[9:13])
		if n > api.MaxFramePayload {
			return Event{}, fmt.Errorf("frame of %d bytes exceeds %d", n, api.MaxFramePayload)
		}
		if cap(s.buf) < int(n) {
			s.buf = make([]byte, max(int(n), 64<<10))
		}
		data := s.buf[:n]
		if _, err := io.ReadFull(s.br, data); err != nil {
			return Event{}, io.ErrUnexpectedEOF
		}
		name, ok := frameNames[typ]
		if !ok {
			continue // heartbeats, and types newer than this client
		}
		ev := Event{Name: name, Data: data}
		switch typ {
		case api.FrameStdout, api.FrameStderr:
			ev.Raw = true
			ev.ID = strconv.FormatInt(off+int64(n), 10)
		case api.FrameGap, api.FrameExit:
			ev.ID = strconv.FormatInt(off, 10)
		}
		return ev, nil
	}
}

// Next returns the next event, skipping comments (heartbeats).
func (s *Stream) Next() (Event, error) {
	if s.frames {
		return s.nextFrame()
	}
	var ev Event
	var data bytes.Buffer
	seen := false
	for {
		line, err := s.br.ReadSlice('\n')
		if err == bufio.ErrBufferFull {
			// Long data line: copy what was read (the next read reuses the buffer),
			// then collect the rest.
			head := append([]byte{}, line...)
			rest, err2 := s.br.ReadBytes('\n')
			line = append(head, rest...)
			err = err2
		}
		if err != nil {
			if err == io.EOF && seen {
				return ev, io.ErrUnexpectedEOF
			}
			return ev, err
		}
		l := strings.TrimRight(string(line), "\r\n")
		if l == "" {
			if !seen {
				continue
			}
			if ev.Name == "" {
				ev.Name = "message"
			}
			ev.Data = bytes.TrimSuffix(data.Bytes(), []byte("\n"))
			return ev, nil
		}
		if l[0] == ':' {
			continue
		}
		seen = true
		field, value, _ := strings.Cut(l, ":")
		value = strings.TrimPrefix(value, " ")
		switch field {
		case "id":
			ev.ID = value
		case "event":
			ev.Name = value
		case "data":
			data.WriteString(value)
			data.WriteByte('\n')
		}
	}
}

// Close ends the stream.
func (s *Stream) Close() error { return s.resp.Body.Close() }

// Output receives a process's output.
type Output struct {
	Stdout io.Writer
	Stderr io.Writer
	// OnGap is told when bytes fell out of the journal before they were read.
	OnGap func(api.GapEvent)
	// OnStart is called on every (re)attach.
	OnStart func(api.StartEvent)
}

// Follow reads a session's output until the process exits, reconnecting with the last
// event id after a dropped connection (and re-creating the session if its token
// expired), so no byte is lost or repeated.
func (c *Client) Follow(ctx context.Context, sess *api.CommandSession, out Output) (*api.ExitEvent, error) {
	return c.FollowFrom(ctx, sess, "", out)
}

// FollowFrom is Follow starting after the event id lastID (a byte offset; "" = the
// start of the journal).
func (c *Client) FollowFrom(ctx context.Context, sess *api.CommandSession, lastID string, out Output) (*api.ExitEvent, error) {
	failures := 0
	for {
		st, err := c.attach(ctx, sess, lastID, acceptFrames)
		if err != nil {
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			var ae *Error
			if errors.As(err, &ae) && ae.Status == http.StatusUnauthorized && c.APIKey != "" {
				// Token expired or revoked: ask for a new session on the same process.
				ns, err2 := c.CreateSession(ctx, sess.SandboxID, api.CreateSessionRequest{PID: sess.PID, ProcessUID: sess.ProcessUID})
				if err2 != nil {
					return nil, fmt.Errorf("re-attach: %w", err2)
				}
				sess = ns
				continue
			}
			if errors.As(err, &ae) && ae.Status < 500 {
				return nil, err
			}
			failures++
			if failures > 60 {
				return nil, err
			}
			sleepCtx(ctx, backoff(failures))
			continue
		}
		exit, err := readUntilExit(st, &lastID, out)
		st.Close()
		if exit != nil {
			return exit, nil
		}
		var lostErr *LostError
		if errors.As(err, &lostErr) {
			return nil, err
		}
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		failures++
		if failures > 60 {
			return nil, fmt.Errorf("attach stream keeps failing: %w", err)
		}
		sleepCtx(ctx, backoff(failures))
	}
}

// LostError ends a stream whose process the sandbox lost (its instance died and was
// booted again): there is no exit status and no more output.
type LostError struct {
	PID     int
	Message string
}

func (e *LostError) Error() string { return fmt.Sprintf("process %d lost: %s", e.PID, e.Message) }

func readUntilExit(st *Stream, lastID *string, out Output) (*api.ExitEvent, error) {
	for {
		ev, err := st.Next()
		if err != nil {
			return nil, err
		}
		switch ev.Name {
		case api.EventStart:
			if out.OnStart != nil {
				var s api.StartEvent
				_ = json.Unmarshal(ev.Data, &s)
				out.OnStart(s)
			}
		case api.EventStdout, api.EventStderr:
			b := ev.Data
			if !ev.Raw {
				var o api.OutputEvent
				if err := json.Unmarshal(ev.Data, &o); err != nil {
					return nil, fmt.Errorf("bad output event: %w", err)
				}
				b = []byte(o.Text)
				if o.Data != "" {
					if b, err = base64.StdEncoding.DecodeString(o.Data); err != nil {
						return nil, fmt.Errorf("bad output data: %w", err)
					}
				}
			}
			w := out.Stdout
			if ev.Name == api.EventStderr {
				w = out.Stderr
			}
			if w != nil {
				if _, err := w.Write(b); err != nil {
					return nil, err
				}
			}
		case api.EventGap:
			if out.OnGap != nil {
				var g api.GapEvent
				_ = json.Unmarshal(ev.Data, &g)
				out.OnGap(g)
			}
		case api.EventExit:
			var x api.ExitEvent
			if err := json.Unmarshal(ev.Data, &x); err != nil {
				return nil, fmt.Errorf("bad exit event: %w", err)
			}
			return &x, nil
		case api.EventError:
			return nil, fmt.Errorf("stream error: %s", ev.Data)
		case api.EventLost:
			var l api.LostEvent
			_ = json.Unmarshal(ev.Data, &l)
			return nil, &LostError{PID: l.PID, Message: l.Message}
		}
		if ev.ID != "" {
			*lastID = ev.ID
		}
	}
}

func sleepCtx(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}

// Exec runs a command in a sandbox, streams its output and returns its exit code
// (128+n for a signal n, -1 if the exit status is unknown). A command that needs no
// stdin and no terminal runs in one request (Run); others through a command session.
func (c *Client) Exec(ctx context.Context, sandboxID string, req api.CreateSessionRequest, out Output) (int, error) {
	exit, err := c.ExecExit(ctx, sandboxID, req, out)
	if err != nil {
		return -1, err
	}
	return ExitCode(exit), nil
}

// ExecExit is Exec returning the command's exit event (its exit code or signal, why it
// could not be run, whether it timed out) instead of a shell-style exit code.
func (c *Client) ExecExit(ctx context.Context, sandboxID string, req api.CreateSessionRequest, out Output) (*api.ExitEvent, error) {
	if req.PTY == nil && !req.Stdin && req.PID == 0 && len(req.Rights) == 0 && req.TokenTTL == "" {
		exit, err := c.Run(ctx, sandboxID, api.ExecRequest{Argv: req.Argv, Command: req.Command, Env: req.Env,
			Cwd: req.Cwd, User: req.User, Timeout: req.Timeout}, out)
		if !errors.Is(err, errNoExecRoute) {
			return exit, err
		}
	}
	sess, err := c.CreateSession(ctx, sandboxID, req)
	if err != nil {
		return nil, err
	}
	return c.Follow(ctx, sess, out)
}

// ExitCode turns an exit event into a shell-style exit code.
func ExitCode(x *api.ExitEvent) int {
	switch {
	case x.ExitCode != nil:
		return *x.ExitCode
	case x.Signal != "":
		if n, ok := signalNumbers[strings.TrimPrefix(x.Signal, "SIG")]; ok {
			return 128 + n
		}
		return 128
	default:
		return -1
	}
}

var signalNumbers = map[string]int{"HUP": 1, "INT": 2, "QUIT": 3, "ILL": 4, "TRAP": 5, "ABRT": 6, "BUS": 7, "FPE": 8,
	"KILL": 9, "USR1": 10, "SEGV": 11, "USR2": 12, "PIPE": 13, "ALRM": 14, "TERM": 15}

// dataPlane sends a small POST to a session's data-plane endpoint (stdin, signal, resize).
func (c *Client) dataPlane(ctx context.Context, s *api.CommandSession, verb string, body io.Reader, ctype string) error {
	u := strings.TrimSuffix(s.AttachURL, "/attach")
	if i := strings.Index(u, "/attach?"); i >= 0 {
		u = u[:i]
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, u+"/"+verb, body)
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+s.Token)
	if ctype != "" {
		req.Header.Set("Content-Type", ctype)
	}
	resp, err := c.HTTP.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 300 {
		return decodeError(resp)
	}
	return nil
}

// WriteStdin sends data to the process's stdin; eof closes stdin afterwards.
func (c *Client) WriteStdin(ctx context.Context, s *api.CommandSession, data io.Reader, eof bool) error {
	verb := "stdin"
	if eof {
		verb += "?eof=1"
	}
	return c.dataPlane(ctx, s, verb, data, "application/octet-stream")
}

// Resize changes the process's terminal size.
func (c *Client) Resize(ctx context.Context, s *api.CommandSession, rows, cols int) error {
	b, _ := json.Marshal(api.PTYSize{Rows: rows, Cols: cols})
	return c.dataPlane(ctx, s, "resize", bytes.NewReader(b), "application/json")
}

// SignalSession sends a signal ("TERM", "SIGKILL", "9", …) to the session's process.
func (c *Client) SignalSession(ctx context.Context, s *api.CommandSession, sig string) error {
	b, _ := json.Marshal(map[string]string{"signal": sig})
	return c.dataPlane(ctx, s, "signal", bytes.NewReader(b), "application/json")
}

// Signal sends a signal to a process by pid.
func (c *Client) Signal(ctx context.Context, sandboxID string, pid int, sig string) error {
	s, err := c.CreateSession(ctx, sandboxID, api.CreateSessionRequest{PID: pid, Rights: []string{api.RightSignal}})
	if err != nil {
		return err
	}
	return c.SignalSession(ctx, s, sig)
}

// Snapshot prints the output a process has produced so far without waiting for more.
func (c *Client) Snapshot(ctx context.Context, sandboxID string, pid int, out Output) error {
	s, err := c.CreateSession(ctx, sandboxID, api.CreateSessionRequest{PID: pid, Rights: []string{api.RightRead}})
	if err != nil {
		return err
	}
	s.AttachURL += "?follow=0"
	st, err := c.Attach(ctx, s, "")
	if err != nil {
		return err
	}
	defer st.Close()
	last := ""
	_, err = readUntilExit(st, &last, out)
	if err == io.EOF {
		return nil
	}
	return err
}

func newReader(r io.Reader) *bufio.Reader { return bufio.NewReaderSize(r, 64<<10) }

// errNoExecRoute is Run's answer from a server without POST /v1/sandboxes/{id}/exec.
var errNoExecRoute = errors.New("the server has no exec route")

// Run starts a command with one request (POST /v1/sandboxes/{id}/exec) and streams its
// output until it exits. If the stream breaks after the process started, Run
// re-attaches to the process through a command session from the last event id, so no
// byte is lost or repeated. The request carries an Idempotency-Key of the call's own,
// and one that failed transiently before its stream began is sent again under it: the
// command runs once, also when the first request started it and only its answer was
// lost (the repeat streams that process from the start).
func (c *Client) Run(ctx context.Context, sandboxID string, req api.ExecRequest, out Output) (*api.ExitEvent, error) {
	b, err := json.Marshal(req)
	if err != nil {
		return nil, err
	}
	key := newKey()
	var resp *http.Response
	err = repeatTransient(ctx, func() error {
		hr, err := http.NewRequestWithContext(ctx, http.MethodPost, c.BaseURL+"/v1/sandboxes/"+url.PathEscape(sandboxID)+"/exec", bytes.NewReader(b))
		if err != nil {
			return err
		}
		hr.Header.Set("Content-Type", "application/json")
		hr.Header.Set("Accept", acceptFrames)
		hr.Header.Set("Idempotency-Key", key)
		if c.APIKey != "" {
			hr.Header.Set("Authorization", "Bearer "+c.APIKey)
		}
		if resp, err = c.HTTP.Do(hr); err != nil {
			return err
		}
		if resp.StatusCode != http.StatusOK {
			defer resp.Body.Close()
			return decodeError(resp)
		}
		return nil
	})
	if err != nil {
		var ae *Error
		if errors.As(err, &ae) && ae.Status == http.StatusNotFound && strings.HasPrefix(ae.Message, "no route for") {
			return nil, errNoExecRoute
		}
		return nil, err
	}
	st := newStream(resp)
	var start api.StartEvent
	started := false
	inner := out.OnStart
	out.OnStart = func(s api.StartEvent) {
		start, started = s, true
		if inner != nil {
			inner(s)
		}
	}
	lastID := ""
	exit, err := readUntilExit(st, &lastID, out)
	st.Close()
	if exit != nil {
		return exit, nil
	}
	var lostErr *LostError
	if errors.As(err, &lostErr) || ctx.Err() != nil {
		return nil, err
	}
	if !started || start.ProcessUID == "" {
		return nil, fmt.Errorf("exec stream: %w", err)
	}
	out.OnStart = inner
	sess, err := c.CreateSession(ctx, sandboxID, api.CreateSessionRequest{PID: start.PID, ProcessUID: start.ProcessUID})
	if err != nil {
		return nil, fmt.Errorf("re-attach after a broken exec stream: %w", err)
	}
	return c.FollowFrom(ctx, sess, lastID, out)
}
