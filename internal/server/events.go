package server

import (
	"context"
	"log/slog"
	"net/http"
	"sync"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/store"
)

// GET /v1/events streams changes of the caller's sandboxes and operations as SSE, so
// that a client (the web console) can keep a list current without polling:
//
//	event: ready      {}                 the stream is live: (re)load what you show
//	event: resync     {}                 changes may have been missed: reload
//	event: sandbox    api.Sandbox        a sandbox changed (observed or desired state)
//	event: operation  api.Operation      an operation changed (lifecycle verbs, builds)
//
// It is driven by PostgreSQL notifications: ChannelSandboxes (a node reported an
// observed state) and ChannelOperations (an operation was created or progressed, which
// also covers new intent such as a requested suspend). One listener per API process
// serves every stream; it runs while at least one stream is open. Each notification is
// looked up once and fanned out to the streams whose key may see it. A stream that
// falls behind never slows the others: its queue is dropped and it gets a resync.

// eventQueue bounds the events queued for one stream.
const eventQueue = 256

type streamEvent struct {
	name   string
	tenant string // "" for events every stream gets
	data   any
}

type subscriber struct {
	p    *Principal
	ch   chan streamEvent
	lost chan struct{} // signalled when ch overflowed
}

// eventHub fans store notifications out to open event streams.
type eventHub struct {
	st  *store.Store
	log *slog.Logger

	mu   sync.Mutex
	subs map[*subscriber]struct{}
	run  *hubRun // the running listener, nil when no stream is open
}

// hubRun is one listener's lifetime: it starts with the first stream and ends when
// the last one closes.
type hubRun struct {
	cancel    context.CancelFunc
	connected bool

	mu      sync.Mutex
	sbs     map[string]bool
	ops     map[string]bool
	resync  bool
	pending chan struct{}
}

func newEventHub(st *store.Store, log *slog.Logger) *eventHub {
	return &eventHub{st: st, log: log, subs: map[*subscriber]struct{}{}}
}

// subscribe registers a stream for p, starting the listener if needed.
func (h *eventHub) subscribe(p *Principal) *subscriber {
	s := &subscriber{p: p, ch: make(chan streamEvent, eventQueue), lost: make(chan struct{}, 1)}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.subs[s] = struct{}{}
	if h.run == nil {
		ctx, cancel := context.WithCancel(context.Background())
		r := &hubRun{cancel: cancel, sbs: map[string]bool{}, ops: map[string]bool{}, pending: make(chan struct{}, 1)}
		h.run = r
		go h.listen(ctx, r)
		go h.work(ctx, r)
	} else if h.run.connected {
		s.ch <- streamEvent{name: "ready", data: struct{}{}}
	}
	// Otherwise the listener's first (re)connect sends every stream a resync.
	return s
}

func (h *eventHub) unsubscribe(s *subscriber) {
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.subs, s)
	if len(h.subs) == 0 && h.run != nil {
		h.run.cancel()
		h.run = nil
	}
}

// listen queues notifications for the worker; the store's Listen calls back with an
// empty payload after every (re)connect.
func (h *eventHub) listen(ctx context.Context, r *hubRun) {
	err := h.st.Listen(ctx, h.log, func(channel, payload string) {
		r.mu.Lock()
		switch {
		case payload == "":
			r.resync = true
		case channel == store.ChannelSandboxes:
			r.sbs[payload] = true
		case channel == store.ChannelOperations:
			r.ops[payload] = true
		}
		r.mu.Unlock()
		select {
		case r.pending <- struct{}{}:
		default:
		}
	}, store.ChannelSandboxes, store.ChannelOperations)
	if err != nil && ctx.Err() == nil {
		h.log.Warn("event streams: listen", "err", err)
	}
}

// work looks up what changed (once per notification, coalesced) and fans it out.
func (h *eventHub) work(ctx context.Context, r *hubRun) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-r.pending:
		}
		r.mu.Lock()
		sbs, ops, resync := r.sbs, r.ops, r.resync
		r.sbs, r.ops, r.resync = map[string]bool{}, map[string]bool{}, false
		r.mu.Unlock()
		if resync {
			h.mu.Lock()
			if h.run == r {
				r.connected = true
			}
			h.mu.Unlock()
			h.fanOut(streamEvent{name: "resync", data: struct{}{}})
		}
		for id := range ops {
			op, err := h.st.GetOperation(ctx, id)
			if err != nil {
				if !fault.Is(err, fault.NotFound) && ctx.Err() == nil {
					h.log.Warn("event streams: load operation", "op", id, "err", err)
				}
				continue
			}
			h.fanOut(streamEvent{name: "operation", tenant: op.Tenant, data: op.API()})
			if op.SandboxID != "" {
				sbs[op.SandboxID] = true
			}
		}
		for id := range sbs {
			sb, err := h.st.GetSandbox(ctx, id)
			if err != nil {
				if !fault.Is(err, fault.NotFound) && ctx.Err() == nil {
					h.log.Warn("event streams: load sandbox", "sandbox", id, "err", err)
				}
				continue
			}
			if sb.PoolKey != "" {
				continue // warm-pool members are not users' sandboxes
			}
			h.fanOut(streamEvent{name: "sandbox", tenant: sb.Tenant, data: sb.API()})
		}
	}
}

// fanOut queues ev on every stream that may see it, never blocking: a full queue
// marks its stream as lost instead.
func (h *eventHub) fanOut(ev streamEvent) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for s := range h.subs {
		if ev.tenant != "" && !s.p.visible(ev.tenant) {
			continue
		}
		select {
		case s.ch <- ev:
		default:
			select {
			case s.lost <- struct{}{}:
			default:
			}
		}
	}
}

// eventWriteTimeout bounds one write to an event stream: a client that stopped
// reading is cut instead of holding the handler forever.
const eventWriteTimeout = time.Minute

// events handles GET /v1/events.
func (a *API) events(hub *eventHub) handlerFunc {
	return func(w http.ResponseWriter, r *http.Request) error {
		sub := hub.subscribe(principalFrom(r.Context()))
		defer hub.unsubscribe(sub)
		s := newSSE(w)
		hb := time.NewTicker(heartbeatEvery)
		defer hb.Stop()
		send := func(ev streamEvent) bool {
			_ = s.rc.SetWriteDeadline(time.Now().Add(eventWriteTimeout))
			return s.event("", ev.name, ev.data) == nil
		}
		for {
			var ok bool
			select {
			case <-r.Context().Done():
				return nil
			case ev := <-sub.ch:
				ok = send(ev)
				// Send what is already queued before flushing once.
				for more := true; ok && more; {
					select {
					case ev := <-sub.ch:
						ok = send(ev)
					default:
						more = false
					}
				}
			case <-sub.lost:
				for len(sub.ch) > 0 {
					<-sub.ch
				}
				ok = send(streamEvent{name: "resync", data: struct{}{}})
			case <-hb.C:
				// A revoked key ends its streams within a heartbeat.
				if _, err := a.authenticate(r); err != nil {
					_ = send(streamEvent{name: api.EventError, data: api.ErrorBody{Code: fault.KindOf(err).String(), Message: err.Error()}})
					_ = s.flush()
					return nil
				}
				_ = s.rc.SetWriteDeadline(time.Now().Add(eventWriteTimeout))
				ok = s.comment("keepalive") == nil
			}
			if !ok || s.flush() != nil {
				return nil
			}
		}
	}
}
