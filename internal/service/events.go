package service

import (
	"context"
	"log/slog"
	"sync"

	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/store"
)

// Events: changes of the sandboxes and operations a caller may see, for clients that
// keep a list current without polling (GET /v1/events, the web console):
//
//	ready      {}                 the stream is live: (re)load what you show
//	resync     {}                 changes may have been missed: reload
//	sandbox    api.Sandbox        a sandbox changed (observed or desired state)
//	operation  api.Operation      an operation changed (lifecycle verbs, builds)
//
// It is driven by PostgreSQL notifications: ChannelSandboxes (a node reported an
// observed state) and ChannelOperations (an operation was created or progressed, which
// also covers new intent such as a requested suspend). One listener per API process
// serves every stream; it runs while at least one stream is open. Each notification is
// looked up once and fanned out to the streams whose key may see it. A stream that
// falls behind never slows the others: its queue is dropped and it gets a resync.

// eventQueue bounds the events queued for one stream.
const eventQueue = 256

// Event is one change a subscriber may see.
type Event struct {
	Name   string
	tenant string // "" for events every stream gets
	Data   any
}

// Subscription receives the events its caller may see.
type Subscription struct {
	p *Principal
	// C delivers events; Lost is signalled when C overflowed (the subscriber then
	// drains C and tells its client to reload).
	C    chan Event
	Lost chan struct{}
}

// eventHub fans store notifications out to open event streams.
type eventHub struct {
	st  *store.Store
	log *slog.Logger

	mu   sync.Mutex
	subs map[*Subscription]struct{}
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
	return &eventHub{st: st, log: log, subs: map[*Subscription]struct{}{}}
}

// subscribe registers a stream for p, starting the listener if needed.
func (h *eventHub) subscribe(p *Principal) *Subscription {
	s := &Subscription{p: p, C: make(chan Event, eventQueue), Lost: make(chan struct{}, 1)}
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
		s.C <- Event{Name: "ready", Data: struct{}{}}
	}
	// Otherwise the listener's first (re)connect sends every stream a resync.
	return s
}

func (h *eventHub) unsubscribe(s *Subscription) {
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
			h.fanOut(Event{Name: "resync", Data: struct{}{}})
		}
		for id := range ops {
			op, err := h.st.GetOperation(ctx, id)
			if err != nil {
				if !fault.Is(err, fault.NotFound) && ctx.Err() == nil {
					h.log.Warn("event streams: load operation", "op", id, "err", err)
				}
				continue
			}
			h.fanOut(Event{Name: "operation", tenant: op.Tenant, Data: op.API()})
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
			h.fanOut(Event{Name: "sandbox", tenant: sb.Tenant, Data: sb.API()})
		}
	}
}

// fanOut queues ev on every stream that may see it, never blocking: a full queue
// marks its stream as lost instead.
func (h *eventHub) fanOut(ev Event) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for s := range h.subs {
		if ev.tenant != "" && !s.p.Visible(ev.tenant) {
			continue
		}
		select {
		case s.C <- ev:
		default:
			select {
			case s.Lost <- struct{}{}:
			default:
			}
		}
	}
}

// Subscribe starts delivering the events p may see; end it with Unsubscribe.
func (s *Service) Subscribe(p *Principal) *Subscription { return s.events.subscribe(p) }

// Unsubscribe ends a subscription.
func (s *Service) Unsubscribe(sub *Subscription) { s.events.unsubscribe(sub) }
