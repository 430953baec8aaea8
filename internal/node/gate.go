package node

import (
	"context"
	"net/http"
	"sync"
	"time"

	"github.com/spacedev/space/internal/fault"
)

// Agent gates: the node pauses a sandbox's agent now and then for work of its own (a
// checkpoint for clones, a named snapshot, a periodic checkpoint, a suspend). The agent
// closes its transport for the checkpoint, so a request that reached it in that instant
// would fail, and the caller could not tell whether a command it started ran. The gate
// closes that window: each request of the data plane passes the sandbox's gate on its
// way to the agent and counts as in flight until the agent's answer has begun (its
// headers: a process is started, a file written, a stream open); a pause closes the
// gate (new requests wait at it), waits for the requests in flight, and only then
// quiesces the agent. When the pause ends the waiting requests go on. A stream whose
// answer has begun is not waited for: it breaks at the pause and its client
// re-attaches (offsets make that lossless).

// drainTimeout bounds how long a pause waits for requests in flight (a large upload's
// answer begins once its body is in): after it the pause goes on, and such a request
// fails as it would have without the gate.
const drainTimeout = 5 * time.Second

// gateWaitTimeout bounds how long a request waits at a closed gate.
const gateWaitTimeout = startupTimeout

// gate is one sandbox's agent gate.
type gate struct {
	mu       sync.Mutex
	holds    int           // pauses under way (nested pauses share the gate)
	opened   chan struct{} // closed when the gate opens again
	inflight int
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

// enter passes the gate (waiting while it is closed, up to gateWaitTimeout) and counts
// a request in flight until the returned func is called.
func (g *gate) enter(ctx context.Context) (func(), error) {
	deadline := time.NewTimer(gateWaitTimeout)
	defer deadline.Stop()
	g.mu.Lock()
	for g.holds > 0 {
		opened := g.opened
		g.mu.Unlock()
		select {
		case <-opened:
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-deadline.C:
			return nil, fault.New(fault.Unavailable, "sandbox is paused by its node for longer than %s", gateWaitTimeout)
		}
		g.mu.Lock()
	}
	g.inflight++
	g.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			g.mu.Lock()
			defer g.mu.Unlock()
			g.inflight--
			if g.inflight == 0 && g.drained != nil {
				close(g.drained)
				g.drained = nil
			}
		})
	}, nil
}

// hold closes the gate and waits (up to drainTimeout, or ctx) until no request is in
// flight. It returns the func that opens the gate again; holds nest.
func (g *gate) hold(ctx context.Context) (release func()) {
	g.mu.Lock()
	if g.holds == 0 {
		g.opened = make(chan struct{})
	}
	g.holds++
	var drained chan struct{}
	if g.inflight > 0 {
		if g.drained == nil {
			g.drained = make(chan struct{})
		}
		drained = g.drained
	}
	g.mu.Unlock()
	if drained != nil {
		t := time.NewTimer(drainTimeout)
		select {
		case <-drained:
		case <-ctx.Done():
		case <-t.C:
		}
		t.Stop()
	}
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

// gatedTransport passes each round trip through a gate.
type gatedTransport struct {
	g     *gate
	inner http.RoundTripper
}

func (t *gatedTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	done, err := t.g.enter(req.Context())
	if err != nil {
		if req.Body != nil {
			_ = req.Body.Close()
		}
		return nil, err
	}
	defer done()
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
