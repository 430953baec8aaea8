package server

import (
	"context"
	"net/http"
	"time"

	"github.com/spacedev/space/internal/rest"
)

// Bounds of operation waits.
const (
	defaultWait = 30 * time.Second
	maxWait     = 10 * time.Minute
	maxLogLines = 100000
)

func (a *API) getOperation(w http.ResponseWriter, r *http.Request) error {
	op, err := a.svc.Operation(r.Context(), principalFrom(r.Context()), r.PathValue("id"))
	if err != nil {
		return err
	}
	rest.WriteJSON(w, http.StatusOK, op.API())
	return nil
}

// waitOperation long-polls until the operation is done or the timeout passes, then
// returns it (done or not: the caller checks its state).
func (a *API) waitOperation(w http.ResponseWriter, r *http.Request) error {
	timeout := defaultWait
	if t := r.URL.Query().Get("timeout"); t != "" {
		d, err := time.ParseDuration(t)
		if err != nil || d < 0 || d > maxWait {
			return rest.Invalid("timeout must be a duration up to %s, like \"30s\"", maxWait)
		}
		timeout = d
	}
	ctx, cancel := context.WithTimeout(r.Context(), timeout)
	defer cancel()
	op, err := a.svc.WaitDone(ctx, principalFrom(r.Context()), r.PathValue("id"))
	if err != nil {
		return err
	}
	rest.WriteJSON(w, http.StatusOK, op.API())
	return nil
}

// operationEvents streams the operation's updates as SSE "operation" events and its log
// lines as "log" events, ending after the terminal state.
func (a *API) operationEvents(w http.ResponseWriter, r *http.Request) error {
	id := r.PathValue("id")
	p := principalFrom(r.Context())
	op, err := a.svc.Operation(r.Context(), p, id)
	if err != nil {
		return err
	}
	s := rest.NewSSE(w)
	ctx := r.Context()
	var lastSeq int64
	var last time.Time
	for {
		lines, err := a.svc.OperationLog(ctx, p, id, lastSeq, 1000)
		if err != nil {
			return nil
		}
		for _, l := range lines {
			lastSeq = l.Seq
			if s.Event("", "log", l) != nil {
				return nil
			}
		}
		if !op.UpdatedAt.Equal(last) {
			last = op.UpdatedAt
			if s.Event("", "operation", op.API()) != nil {
				return nil
			}
		}
		if s.Flush() != nil || op.DoneAt != nil && len(lines) == 0 {
			return nil
		}
		wctx, cancel := context.WithTimeout(ctx, rest.HeartbeatEvery)
		prev := op.UpdatedAt
		op, err = a.svc.WaitChange(wctx, id, prev)
		cancel()
		if ctx.Err() != nil || err != nil {
			return nil
		}
		if op.UpdatedAt.Equal(prev) {
			if s.Comment("keepalive") != nil {
				return nil
			}
		}
	}
}

func (a *API) operationLog(w http.ResponseWriter, r *http.Request) error {
	lines, err := a.svc.OperationLog(r.Context(), principalFrom(r.Context()), r.PathValue("id"), 0, maxLogLines)
	if err != nil {
		return err
	}
	rest.WriteJSON(w, http.StatusOK, map[string]any{"lines": lines})
	return nil
}
