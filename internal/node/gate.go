package node

import (
	"context"
	"io"
	"net/http"
	"sync"
	"time"

	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/guest/agentclient"
)

// Agent gates: the node pauses a sandbox's agent now and then for work of its own (a
// checkpoint for clones, a named snapshot, a periodic checkpoint, a suspend). The agent
// closes its transport for the checkpoint, so a request that reached it in that instant
// would fail, and the caller could not tell whether a command it started ran. The gate
// closes that window: each request of the data plane passes the sandbox's gate on its
// way to the agent and is under way from when its body is all sent until the agent's
// answer has begun (its headers: a process is started, a file written, a stream open);
// a pause closes the gate (new requests wait at it), waits until no request is under
// way, and only then quiesces the agent. When the pause ends the waiting requests go
// on. Neither a stream whose answer has begun nor a request still sending its body
// (stdin streamed for as long as its client likes, an upload) is waited for: a stream
// breaks at the pause and its client re-attaches (offsets make that lossless); a body
// cut off fails its request, as it would have without the gate.

// drainTimeout bounds how long a pause waits for requests under way (an agent slow to
// answer): after it the pause goes on, and such a request fails as it would have
// without the gate.
const drainTimeout = 5 * time.Second

// gateWaitTimeout bounds how long a request waits at a closed gate.
const gateWaitTimeout = startupTimeout

// gate is one sandbox's agent gate.
type gate struct {
	mu       sync.Mutex
	holds    int           // pauses under way (nested pauses share the gate)
	opened   chan struct{} // closed when the gate opens again
	inflight int           // requests under way (flight)
	drained  chan struct{} // closed when inflight drops to 0 during a pause
}

// gates holds the gates of a node's sandboxes.
type gates struct {
	mu sync.Mutex
	m  map[string]*gate
}

func (gs *gates) get(id string) *gate {
	gs.mu.Lock()
	defer gs.mu.Unlock()
	if gs.m == nil {
		gs.m = map[string]*gate{}
	}
	g := gs.m[id]
	if g == nil {
		g = &gate{}
		gs.m[id] = g
	}
	return g
}

// forget drops an open gate nobody uses (a sandbox that is gone).
func (gs *gates) forget(id string) {
	gs.mu.Lock()
	defer gs.mu.Unlock()
	if g := gs.m[id]; g != nil {
		g.mu.Lock()
		idle := g.holds == 0 && g.inflight == 0
		g.mu.Unlock()
		if idle {
			delete(gs.m, id)
		}
	}
}

// enter passes the gate for f, waiting while it is closed (up to gateWaitTimeout).
// With now, f is under way from the instant it passes, in the same critical section
// that saw the gate open: a pause that closes the gate a moment later waits for it.
// (Counted later, when its body was sent, a request could pass, a pause drain and
// quiesce the agent, and the request reach the agent as it froze: a process it
// started then ran through the checkpoint.)
func (g *gate) enter(ctx context.Context, f *flight, now bool) error {
	deadline := time.NewTimer(gateWaitTimeout)
	defer deadline.Stop()
	for {
		g.mu.Lock()
		if g.holds == 0 {
			if now {
				f.countLocked()
			}
			g.mu.Unlock()
			return nil
		}
		opened := g.opened
		g.mu.Unlock()
		select {
		case <-opened:
		case <-ctx.Done():
			return ctx.Err()
		case <-deadline.C:
			return fault.New(fault.Unavailable, "sandbox is paused by its node for longer than %s", gateWaitTimeout)
		}
	}
}

// openedChan returns the channel closed when a closed gate opens again; nil when the
// gate is open.
func (g *gate) openedChan() <-chan struct{} {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.holds == 0 {
		return nil
	}
	return g.opened
}

// flight is one request past the gate. It is under way (counted in inflight) until
// its answer begins. A request without a body, with one in memory (replayable: the
// data plane's JSON) or with a short declared one (shortBody: a relayed envd call) is
// under way from when it passes the gate; one whose body streams (stdin, an upload)
// only from when that body is all sent: a pause does not wait for a client that may
// stream for as long as it likes.
type flight struct {
	g       *gate
	once    sync.Once
	counted bool // set under once
}

// countLocked puts the flight under way; g.mu is held.
func (f *flight) countLocked() {
	f.once.Do(func() {
		f.g.inflight++
		f.counted = true
	})
}

// sent marks the request's body as all sent.
func (f *flight) sent() {
	f.g.mu.Lock()
	defer f.g.mu.Unlock()
	f.countLocked()
}

// answered ends the flight (its answer began, or it failed).
func (f *flight) answered() {
	f.once.Do(func() {}) // a body finishing later no longer counts
	if !f.counted {
		return
	}
	f.g.mu.Lock()
	defer f.g.mu.Unlock()
	f.g.inflight--
	if f.g.inflight == 0 && f.g.drained != nil {
		close(f.g.drained)
		f.g.drained = nil
	}
}

// sentBody calls sent once the transport has read the whole body.
type sentBody struct {
	io.ReadCloser
	f    *flight
	left int64 // bytes to the declared length (-1: unknown)
}

func (b *sentBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if b.left > 0 {
		b.left -= int64(n)
	}
	if err == io.EOF || b.left == 0 {
		b.f.sent()
	}
	return n, err
}

// hold closes the gate and waits (up to drainTimeout, or ctx) until no request is
// under way. It returns the func that opens the gate again; holds nest.
func (g *gate) hold(ctx context.Context) (release func()) {
	g.mu.Lock()
	if g.holds == 0 {
		g.opened = make(chan struct{})
	}
	g.holds++
	g.mu.Unlock()
	g.drain(ctx)
	var once sync.Once
	return func() {
		once.Do(func() {
			g.mu.Lock()
			defer g.mu.Unlock()
			g.holds--
			if g.holds == 0 {
				close(g.opened)
			}
		})
	}
}

// drain waits (up to drainTimeout, or ctx) until no request is under way.
func (g *gate) drain(ctx context.Context) {
	t := time.NewTimer(drainTimeout)
	defer t.Stop()
	for {
		g.mu.Lock()
		if g.inflight == 0 {
			g.mu.Unlock()
			return
		}
		if g.drained == nil {
			g.drained = make(chan struct{})
		}
		drained := g.drained
		g.mu.Unlock()
		select {
		case <-drained:
		case <-ctx.Done():
			return
		case <-t.C:
			return
		}
	}
}

// gatedTransport passes each round trip through a gate.
type gatedTransport struct {
	g     *gate
	inner http.RoundTripper
}

// shortBody is the largest declared body that counts as sent at once (see flight): an
// envd call relayed for an E2B SDK declares its few hundred bytes, and the relay reads
// a body this short before it sends it. A client that declares a short body and then
// withholds it holds a pause for drainTimeout at most.
const shortBody = agentclient.ReplayableBody

func (t *gatedTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	f := &flight{g: t.g}
	inMemory := req.Body == nil || req.Body == http.NoBody || req.GetBody != nil ||
		(req.ContentLength > 0 && req.ContentLength <= shortBody)
	if err := t.g.enter(req.Context(), f, inMemory); err != nil {
		if req.Body != nil {
			_ = req.Body.Close()
		}
		return nil, err
	}
	defer f.answered()
	if !inMemory {
		left := req.ContentLength
		if left <= 0 {
			left = -1
		}
		r := req.Clone(req.Context())
		r.Body = &sentBody{ReadCloser: req.Body, f: f, left: left}
		req = r
	}
	return t.inner.RoundTrip(req)
}

func (t *gatedTransport) CloseIdleConnections() {
	if c, ok := t.inner.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}

// holdAgent closes a sandbox's agent gate for a pause of the node's own and waits for
// the requests in flight; the returned func opens it again.
func (n *Node) holdAgent(ctx context.Context, id string) func() {
	return n.gates.get(id).hold(ctx)
}

// pauseBriefly is holdAgent for a pause after which the sandbox runs on (a checkpoint
// of a clone source, a named snapshot, a periodic checkpoint): the data plane's
// requests that arrive meanwhile wait for it instead of failing.
func (n *Node) pauseBriefly(ctx context.Context, id string) func() {
	n.setBrief(id, true)
	release := n.holdAgent(ctx, id)
	return func() {
		release()
		n.setBrief(id, false)
	}
}
