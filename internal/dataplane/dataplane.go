// Package dataplane owns the data plane each node serves for its sandboxes: attach
// streams (SSE with offsets, replay and gaps), stdin, signals and resizes, authorized by
// attachment tokens, and the internal agent proxy the api role uses (authorized by
// node tokens). It reaches agents through the node (Agents), with the one agent client.
package dataplane

import (
	"context"
	"encoding/base64"
	"io"
	"log/slog"
	"net/http"
	"net/http/httputil"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/guest/agentclient"
	"github.com/spacedev/space/internal/guest/wire"
	"github.com/spacedev/space/internal/rest"
	"github.com/spacedev/space/internal/store"
	"github.com/spacedev/space/internal/token"
)

// Agents gives the data plane the agents of the sandboxes running on this node.
type Agents interface {
	// Agent returns a client for the agent of a sandbox running on this node; it fails
	// with a NotFound or Conflict fault otherwise.
	Agent(ctx context.Context, sandboxID string) (*agentclient.Client, error)
	// Touch records activity on the sandbox (for idle detection).
	Touch(sandboxID string)
	// InstanceRunning reports whether the sandbox's runtime instance runs (asking the
	// runtime itself, not the agent).
	InstanceRunning(ctx context.Context, sandboxID string) bool
}

// Config configures a node's data plane.
type Config struct {
	Store  *store.Store
	Signer *token.Signer
	Logger *slog.Logger
	Node   Agents
	NodeID string
}

// DataPlane serves attach streams, stdin, signals and resizes for the sandboxes of one
// node, and the internal agent proxy that the api role uses.
type DataPlane struct {
	cfg     Config
	log     *slog.Logger
	mu      sync.Mutex
	streams map[string]map[*liveStream]struct{}
}

type liveStream struct {
	epoch  int64
	key    string // the API key that minted the stream's token
	cancel context.CancelFunc
}

// New returns the data plane of a node.
func New(cfg Config) *DataPlane {
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	return &DataPlane{cfg: cfg, log: cfg.Logger, streams: map[string]map[*liveStream]struct{}{}}
}

// Run cuts streams whose tokens were revoked until ctx ends: by a new token epoch of
// their sandbox (ChannelTokens) or the revocation of the API key that minted them
// (ChannelKeys). After every (re)connect of the listener, when notifications may have
// been missed, every open stream is checked again.
func (d *DataPlane) Run(ctx context.Context) error {
	return d.cfg.Store.Listen(ctx, d.log, func(channel, id string) {
		switch {
		case channel == store.ChannelKeys && id != "":
			d.cutKeys([]string{id})
		case channel == store.ChannelKeys || id == "":
			d.recheck(ctx)
		default:
			d.cutEpoch(ctx, id)
		}
	}, store.ChannelTokens, store.ChannelKeys)
}

// cutEpoch ends the open streams of sandbox id authorized by an epoch older than its
// current one.
func (d *DataPlane) cutEpoch(ctx context.Context, id string) {
	epoch, _, err := d.cfg.Store.TokenEpoch(ctx, id)
	if err != nil {
		epoch = 1 << 62 // deleted: cut everything
	}
	d.cut(id, epoch)
}

// recheck checks every open stream's sandbox epoch and minting key.
func (d *DataPlane) recheck(ctx context.Context) {
	d.mu.Lock()
	var sandboxes, keys []string
	seen := map[string]bool{}
	for id, set := range d.streams {
		sandboxes = append(sandboxes, id)
		for s := range set {
			if !seen[s.key] {
				seen[s.key] = true
				keys = append(keys, s.key)
			}
		}
	}
	d.mu.Unlock()
	for _, id := range sandboxes {
		d.cutEpoch(ctx, id)
	}
	if len(keys) == 0 {
		return
	}
	revoked, err := d.cfg.Store.RevokedKeys(ctx, keys)
	if err != nil {
		if ctx.Err() == nil {
			d.log.Warn("check the keys of open streams", "err", err)
		}
		return
	}
	d.cutKeys(revoked)
}

// cutKeys ends the open streams whose tokens one of keys minted.
func (d *DataPlane) cutKeys(keys []string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, set := range d.streams {
		for s := range set {
			if slices.Contains(keys, s.key) {
				s.cancel()
			}
		}
	}
}

// cut ends the open streams of sandbox id authorized by an epoch older than epoch.
func (d *DataPlane) cut(id string, epoch int64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for s := range d.streams[id] {
		if s.epoch < epoch {
			s.cancel()
		}
	}
}

func (d *DataPlane) track(id string, epoch int64, key string, cancel context.CancelFunc) func() {
	s := &liveStream{epoch: epoch, key: key, cancel: cancel}
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
	h := func(pattern string, fn rest.HandlerFunc) {
		mux.Handle(pattern, rest.Handle(d.log, fn))
	}
	h("GET /v1/dp/sandboxes/{id}/processes/{pid}/attach", d.attach)
	h("POST /v1/dp/sandboxes/{id}/processes/{pid}/stdin", d.stdin)
	h("POST /v1/dp/sandboxes/{id}/processes/{pid}/signal", d.signal)
	h("POST /v1/dp/sandboxes/{id}/processes/{pid}/resize", d.resize)
	h("/internal/v1/sandboxes/{id}/agent/{path...}", d.agentProxy)
}

// tokenFrom returns the attachment token of a data-plane request.
func tokenFrom(r *http.Request) string {
	if t := rest.Bearer(r); t != "" {
		return t
	}
	return r.URL.Query().Get("token")
}

// grant is what an authorized data-plane request may act on: one process, by pid and
// identity.
type grant struct {
	id    string
	pid   int
	epoch int64
	key   string
	agent *agentclient.Client
	proc  agentclient.Proc
}

// authorize checks the request's token for right on sandbox/pid and returns the agent
// of the sandbox with the sandbox's current epoch.
func (d *DataPlane) authorize(r *http.Request, right string) (*grant, error) {
	id := r.PathValue("id")
	pid := 0
	if p := r.PathValue("pid"); p != "" {
		n, err := strconv.Atoi(p)
		if err != nil || n <= 0 {
			return nil, rest.Invalid("pid must be a positive integer")
		}
		pid = n
	}
	tok := tokenFrom(r)
	if tok == "" {
		return nil, fault.New(fault.Unauthorized, "missing attachment token: send Authorization: Bearer <token> or ?token=")
	}
	claims, err := d.cfg.Signer.Verify(tok)
	if err != nil {
		return nil, err
	}
	if claims.Sandbox != id {
		// Another sandbox (another tenant's, or none) answers like a missing one.
		return nil, sandboxNotFound(id)
	}
	if claims.Key == "" {
		return nil, fault.New(fault.Unauthorized, "token was revoked: it names no API key (minted by an older version)")
	}
	epoch, nodeID, keyLive, err := d.cfg.Store.TokenState(r.Context(), id, claims.Key)
	if fault.Is(err, fault.NotFound) {
		return nil, fault.New(fault.Unauthorized, "token was revoked")
	}
	if err != nil {
		// Not known now (the database is away: a 503 the client retries); until
		// 2026-12-07 "token was revoked", which a client takes as final.
		return nil, err
	}
	if !keyLive {
		return nil, fault.New(fault.Unauthorized, "token was revoked: the API key that minted it was revoked")
	}
	if err := token.Authorize(claims, id, pid, right, epoch); err != nil {
		return nil, err
	}
	if nodeID != d.cfg.NodeID {
		return nil, fault.New(fault.NotFound, "sandbox %s is not on this node", id)
	}
	agent, err := d.cfg.Node.Agent(r.Context(), id)
	if err != nil {
		return nil, err
	}
	d.cfg.Node.Touch(id)
	return &grant{id: id, pid: pid, epoch: epoch, key: claims.Key, agent: agent, proc: agent.Proc(pid, claims.Proc)}, nil
}

func sandboxNotFound(id string) error { return fault.New(fault.NotFound, "sandbox %q not found", id) }

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
		return 0, rest.Invalid("offset %q must be a non-negative integer", v)
	}
	return n, nil
}

// MaxEventBytes bounds the output carried by one SSE event.
const MaxEventBytes = 1 << 20

// attach streams a process's output as SSE, starting a gated process once the stream
// is connected, so the client sees every byte from the first.
func (d *DataPlane) attach(w http.ResponseWriter, r *http.Request) error {
	g, err := d.authorize(r, token.RightRead)
	if err != nil {
		return err
	}
	from, err := parseFrom(r)
	if err != nil {
		return err
	}
	enc, err := ParseEncoding(r)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancelCause(r.Context())
	defer cancel(nil)
	defer d.track(g.id, g.epoch, g.key, func() { cancel(context.Canceled) })()

	info, err := g.proc.Info(ctx)
	if fault.Is(err, fault.Gone) {
		// The token's process is gone with a lost instance; the pid is another's now.
		lost(NewEncoder(w, enc), g.pid, err.Error())
		return nil
	}
	if err != nil {
		return err
	}
	follow := true
	if f := r.URL.Query().Get("follow"); f == "0" || f == "false" {
		follow = false
	}
	out, err := g.proc.Output(ctx, from, follow)
	if err != nil {
		return err
	}
	defer out.Close()
	if info.State == wire.StateCreated && follow {
		if err := g.proc.Start(ctx); err != nil && !fault.Is(err, fault.Conflict) {
			return err
		}
	}
	e := NewEncoder(w, enc)
	if err := e.Start(api.StartEvent{PID: g.pid, Offset: from}); err != nil {
		return nil
	}
	_ = e.Flush()
	if follow {
		// At a stop the stream ends at once: the client reconnects from its last event id.
		defer rest.EndAtStop(r, cancel)()
	}
	for {
		f, err := Next(out, e)
		if err != nil {
			if ctx.Err() == nil {
				d.ended(ctx, e, g, err)
			} else if rest.Stopping(ctx) {
				_ = e.Error(Restarting)
			}
			_ = e.Flush()
			return nil
		}
		if err := e.Frame(f); err != nil {
			return nil
		}
		if f.Type == wire.FrameStdout || f.Type == wire.FrameStderr || f.Type == wire.FrameHeartbeat {
			d.cfg.Node.Touch(g.id) // output and an open stream both count as activity
		}
		if !out.Buffered() {
			if e.Flush() != nil {
				return nil
			}
		}
		if f.Type == wire.FrameExit {
			_ = e.Flush()
			return nil
		}
	}
}

// Next reads the next agent frame for e: output frames merged when e wants them so.
func Next(out *agentclient.OutputStream, e Encoder) (wire.Frame, error) {
	if e.Merge() {
		return out.NextMerged(MaxEventBytes)
	}
	return out.Next()
}

// ended tells an attached client why its stream ended before the process's exit: the
// sandbox lost the process (its instance died; "lost"), or the stream broke (the client
// reconnects with Last-Event-ID; "error").
//
// The look is repeated while the agent does not answer and the instance still looks
// running: an agent's connections close as it dies, a moment before the runtime shows
// the instance stopped, and an instance booted in its place answers only once it is
// ready (then with Gone: the process is not one of its own). A single look in that
// moment called a lost process's stream merely broken.
func (d *DataPlane) ended(ctx context.Context, e Encoder, g *grant, cause error) {
	hctx, cancel := context.WithTimeout(ctx, lostCheckTimeout)
	defer cancel()
	for {
		agent, err := d.cfg.Node.Agent(hctx, g.id)
		if err == nil {
			_, err = agent.Proc(g.pid, g.proc.UID()).Info(hctx)
		}
		if fault.Is(err, fault.Gone) || err != nil && !d.cfg.Node.InstanceRunning(hctx, g.id) {
			lost(e, g.pid, "the sandbox lost this process: its instance stopped before the process exited")
			return
		}
		if err == nil {
			break // the process lives on: only the stream broke
		}
		select {
		case <-hctx.Done():
		case <-time.After(lostCheckInterval):
		}
		if hctx.Err() != nil {
			break
		}
	}
	msg := "agent stream ended"
	if cause != io.EOF {
		msg += ": " + cause.Error()
	}
	_ = e.Error(msg)
}

// Restarting is the error event that ends an attach or exec stream when space stops
// (a restart): the client reconnects from its last event id, to the next process.
const Restarting = "space is restarting: reconnect from the last event id"

// lostCheckTimeout bounds the look at why a stream ended; lostCheckInterval spaces its
// repeats.
const (
	lostCheckTimeout  = 5 * time.Second
	lostCheckInterval = 50 * time.Millisecond
)

// lost writes the "lost" event that ends a stream whose process is gone.
func lost(e Encoder, pid int, msg string) {
	_ = e.Lost(api.LostEvent{PID: pid, Message: msg})
	_ = e.Flush()
}

// WriteFrame converts one agent frame to an SSE event (the one conversion, shared by
// attach streams and the api role's one-request exec): output with its offset (base64,
// or UTF-8 text when text), gaps, the exit status, and heartbeats as comments.
func WriteFrame(s *rest.SSE, f wire.Frame, text bool) error {
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
		return s.Event(strconv.FormatInt(f.Offset+int64(len(f.Payload)), 10), name, ev)
	case wire.FrameGap:
		return s.Event(strconv.FormatInt(f.Offset, 10), api.EventGap, api.GapEvent{Offset: f.Offset, Dropped: gapDropped(f)})
	case wire.FrameExit:
		return s.Event(strconv.FormatInt(f.Offset, 10), api.EventExit, exitEvent(f))
	case wire.FrameHeartbeat:
		return s.Comment("keepalive")
	default:
		return nil
	}
}

func (d *DataPlane) stdin(w http.ResponseWriter, r *http.Request) error {
	g, err := d.authorize(r, token.RightStdin)
	if err != nil {
		return err
	}
	eof := r.URL.Query().Get("eof")
	if err := g.proc.WriteStdin(r.Context(), r.Body, eof == "1" || eof == "true"); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

func (d *DataPlane) signal(w http.ResponseWriter, r *http.Request) error {
	g, err := d.authorize(r, token.RightSignal)
	if err != nil {
		return err
	}
	var req wire.Signal
	if err := rest.DecodeJSON(w, r, &req); err != nil {
		return err
	}
	if err := g.proc.Signal(r.Context(), req.Signal); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

func (d *DataPlane) resize(w http.ResponseWriter, r *http.Request) error {
	g, err := d.authorize(r, token.RightResize)
	if err != nil {
		return err
	}
	var req api.PTYSize
	if err := rest.DecodeJSON(w, r, &req); err != nil {
		return err
	}
	if req.Rows < 1 || req.Rows > 1000 || req.Cols < 1 || req.Cols > 1000 {
		return rest.Invalid("rows and cols must be between 1 and 1000")
	}
	if err := g.proc.Resize(r.Context(), wire.Size{Rows: uint16(req.Rows), Cols: uint16(req.Cols)}); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

// agentProxy relays an api-role request to the sandbox's agent verbatim (streaming both
// ways). Only node tokens minted by an api process are accepted.
func (d *DataPlane) agentProxy(w http.ResponseWriter, r *http.Request) error {
	id := r.PathValue("id")
	claims, err := d.cfg.Signer.Verify(rest.Bearer(r))
	if err != nil {
		return err
	}
	if claims.Sandbox != id {
		return sandboxNotFound(id)
	}
	if !claims.Has(token.RightNode) {
		return fault.New(fault.Forbidden, "this endpoint is for space's api role only")
	}
	agent, err := d.cfg.Node.Agent(r.Context(), id)
	if err != nil {
		return err
	}
	d.cfg.Node.Touch(id)
	path := "/" + r.PathValue("path")
	// A stream its caller resumes by itself (the api's exec and watch streams) ends at
	// once when this node stops, once the agent's answer has begun: the api's client
	// goes on from its last event id, and the stop is not held for the stream.
	// Everything before the answer (an exec's start) gets the stop's grace.
	ctx, cancel := context.WithCancelCause(r.Context())
	defer cancel(nil)
	r = r.WithContext(ctx)
	resumable := r.Header.Get(wire.ResumableHeader) != ""
	endAtStop := func() bool { return false }
	defer func() { endAtStop() }()
	proxy := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.Out.URL = &url.URL{Scheme: "http", Host: "agent", Path: path, RawQuery: r.URL.RawQuery}
			pr.Out.Host = "agent"
			pr.Out.Header.Del("Authorization")
			pr.Out.Header.Del(wire.ResumableHeader)
		},
		ModifyResponse: func(*http.Response) error {
			if resumable {
				endAtStop = rest.EndAtStop(r, cancel)
			}
			return nil
		},
		Transport:     agent.Transport(),
		FlushInterval: -1,
		ErrorLog:      slog.NewLogLogger(d.log.Handler(), slog.LevelDebug), // a stream cut under it
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			if r.Context().Err() != nil && !rest.ShuttingDown(r) {
				return // the client is gone
			}
			rest.WriteError(w, r, d.log, fault.New(fault.Unavailable, "sandbox agent unreachable: %v", err))
		},
	}
	// The agent may answer before it has read the whole request body; without full
	// duplex Go's server closes the body when the answer starts, which cuts the
	// upstream connection mid-stream.
	_ = http.NewResponseController(w).EnableFullDuplex()
	proxy.ServeHTTP(w, r)
	return nil
}
