package server

import (
	"context"
	"net/http"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/rest"
	"github.com/spacedev/space/internal/service"
)

// eventWriteTimeout bounds one write to an event stream: a client that stopped
// reading is cut instead of holding the handler forever.
const eventWriteTimeout = time.Minute

// events handles GET /v1/events: the changes the caller may see (service.Subscribe)
// as SSE.
func (a *API) events(w http.ResponseWriter, r *http.Request) error {
	// At a stop the feed ends at once; clients reconnect (and resync) to the next process.
	ctx, cancel := context.WithCancelCause(r.Context())
	defer cancel(nil)
	defer rest.EndAtStop(r, cancel)()
	sub := a.svc.Subscribe(principalFrom(r.Context()))
	defer a.svc.Unsubscribe(sub)
	s := rest.NewSSE(w)
	hb := time.NewTicker(rest.HeartbeatEvery)
	defer hb.Stop()
	send := func(ev service.Event) bool {
		_ = s.SetWriteDeadline(time.Now().Add(eventWriteTimeout))
		return s.Event("", ev.Name, ev.Data) == nil
	}
	for {
		var ok bool
		select {
		case <-ctx.Done():
			return nil
		case ev := <-sub.C:
			ok = send(ev)
			// Send what is already queued before flushing once.
			for more := true; ok && more; {
				select {
				case ev := <-sub.C:
					ok = send(ev)
				default:
					more = false
				}
			}
		case <-sub.Lost:
			for len(sub.C) > 0 {
				<-sub.C
			}
			ok = send(service.Event{Name: "resync", Data: struct{}{}})
		case <-hb.C:
			// A revoked key ends its streams within a heartbeat.
			if _, err := a.svc.Authenticate(r.Context(), rest.Bearer(r), service.KeySpace); err != nil {
				_ = send(service.Event{Name: api.EventError, Data: api.ErrorBody{Code: fault.KindOf(err).String(), Message: err.Error()}})
				_ = s.Flush()
				return nil
			}
			_ = s.SetWriteDeadline(time.Now().Add(eventWriteTimeout))
			ok = s.Comment("keepalive") == nil
		}
		if !ok || s.Flush() != nil {
			return nil
		}
	}
}
