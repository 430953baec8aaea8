package server

import (
	"context"
	"net/http"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/store"
)

// opPoll is the fallback poll interval when notifications are lost.
const opPoll = 2 * time.Second

func (a *API) operationFor(r *http.Request, id string) (*store.Operation, error) {
	op, err := a.st.GetOperation(r.Context(), id)
	if err != nil {
		return nil, err
	}
	if !principalFrom(r.Context()).visible(op.Tenant) {
		return nil, fault.New(fault.NotFound, "operation %q not found", id)
	}
	return op, nil
}

func (a *API) getOperation(w http.ResponseWriter, r *http.Request) error {
	op, err := a.operationFor(r, r.PathValue("id"))
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, op.API())
	return nil
}

// waitOperation long-polls until the operation is done or the timeout passes, then
// returns it (done or not: the caller checks its state).
func (a *API) waitOperation(w http.ResponseWriter, r *http.Request) error {
	timeout := 30 * time.Second
	if t := r.URL.Query().Get("timeout"); t != "" {
		d, err := time.ParseDuration(t)
		if err != nil || d < 0 || d > 10*time.Minute {
			return invalid("timeout must be a duration up to 10m, like \"30s\"")
		}
		timeout = d
	}
	id := r.PathValue("id")
	if _, err := a.operationFor(r, id); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(r.Context(), timeout)
	defer cancel()
	op, err := a.waitChange(ctx, id, func(o *store.Operation) bool { return o.DoneAt != nil })
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, op.API())
	return nil
}

// waitChange returns the operation once done(op) holds or ctx ends (then it returns the
// latest state without error).
func (a *API) waitChange(ctx context.Context, id string, done func(*store.Operation) bool) (*store.Operation, error) {
	for {
		ch, cancel := a.ops.wait(id)
		op, err := a.st.GetOperation(context.WithoutCancel(ctx), id)
		if err != nil {
			cancel()
			return nil, err
		}
		if done(op) {
			cancel()
			return op, nil
		}
		t := time.NewTimer(opPoll)
		select {
		case <-ch:
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			cancel()
			return op, nil
		}
		t.Stop()
		cancel()
	}
}

// operationEvents streams the operation's updates as SSE "operation" events and its log
// lines as "log" events, ending after the terminal state.
func (a *API) operationEvents(w http.ResponseWriter, r *http.Request) error {
	id := r.PathValue("id")
	op, err := a.operationFor(r, id)
	if err != nil {
		return err
	}
	s := newSSE(w)
	ctx := r.Context()
	var lastSeq int64
	var last time.Time
	for {
		lines, err := a.st.OperationLog(ctx, id, lastSeq, 1000)
		if err != nil {
			return nil
		}
		for _, l := range lines {
			lastSeq = l.Seq
			if s.event("", "log", l) != nil {
				return nil
			}
		}
		if !op.UpdatedAt.Equal(last) {
			last = op.UpdatedAt
			if s.event("", "operation", op.API()) != nil {
				return nil
			}
		}
		if s.flush() != nil || op.DoneAt != nil && len(lines) == 0 {
			return nil
		}
		wctx, cancel := context.WithTimeout(ctx, heartbeatEvery)
		prev := op.UpdatedAt
		op, err = a.waitChange(wctx, id, func(o *store.Operation) bool { return !o.UpdatedAt.Equal(prev) })
		cancel()
		if ctx.Err() != nil || err != nil {
			return nil
		}
		if op.UpdatedAt.Equal(prev) {
			if s.comment("keepalive") != nil {
				return nil
			}
		}
	}
}

func (a *API) operationLog(w http.ResponseWriter, r *http.Request) error {
	id := r.PathValue("id")
	if _, err := a.operationFor(r, id); err != nil {
		return err
	}
	lines, err := a.st.OperationLog(r.Context(), id, 0, 100000)
	if err != nil {
		return err
	}
	if lines == nil {
		lines = []store.LogLine{}
	}
	writeJSON(w, http.StatusOK, map[string]any{"lines": lines})
	return nil
}

var _ = api.OpCreate
