package server

import (
	"context"
	"net/http"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/dataplane"
	"github.com/spacedev/space/internal/guest/wire"
	"github.com/spacedev/space/internal/rest"
)

// exec handles POST /v1/sandboxes/{id}/exec: start a command and answer with its
// output and exit status as one stream, the events of an attach stream from offset 0,
// in SSE or binary frames (?encoding=, Accept; docs/dataplane.md). Errors before the
// process exists are ordinary JSON errors. With an Idempotency-Key, a repeat streams the
// process the first request started (service.Exec).
func (a *API) exec(w http.ResponseWriter, r *http.Request) error {
	var req api.ExecRequest
	if err := rest.DecodeJSON(w, r, &req); err != nil {
		return err
	}
	nw, err := noWake(r)
	if err != nil {
		return err
	}
	enc, err := dataplane.ParseEncoding(r)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancelCause(r.Context())
	defer cancel(nil)
	x, err := a.svc.Exec(ctx, principalFrom(r.Context()), r.PathValue("id"), req, nw, r.Header.Get("Idempotency-Key"))
	if err != nil {
		return err
	}
	defer x.Close()
	e := dataplane.NewEncoder(w, enc)
	if err := e.Start(api.StartEvent{PID: x.PID, ProcessUID: x.UID}); err != nil {
		return nil
	}
	// At a stop the stream ends at once: the client re-attaches from its last event id.
	defer rest.EndAtStop(r, cancel)()
	for {
		f, err := dataplane.Next(x.Out, e)
		if err != nil {
			if r.Context().Err() == nil {
				// Cut (revoked), broken or stopping: the client re-attaches to
				// pid/process_uid through a session, from its last event id.
				msg := "exec stream ended before the process exited"
				if rest.Stopping(ctx) {
					msg = dataplane.Restarting
				} else if x.Ctx.Err() != nil {
					msg = "exec stream was cut: the sandbox's tokens or the API key were revoked, or the listener reconnected"
				}
				_ = e.Error(msg)
				_ = e.Flush()
			}
			return nil
		}
		if err := e.Frame(f); err != nil {
			return nil
		}
		if f.Type == wire.FrameExit {
			_ = e.Flush()
			return nil
		}
		if !x.Out.Buffered() {
			if e.Flush() != nil {
				return nil
			}
		}
	}
}
