package server

import (
	"context"
	"errors"
	"io"
	"net/http"
	"strconv"
	"strings"

	"github.com/spacedev/space/internal/rest"
)

// registerNetwork adds the routes of sandboxes' networks: the policy (read, changed
// by merge patch or replaced whole) and the egress audit log.
func (a *API) registerNetwork(authed func(string, rest.HandlerFunc)) {
	authed("GET /v1/sandboxes/{id}/network", a.getNetwork)
	authed("PATCH /v1/sandboxes/{id}/network", a.changeNetwork(true))
	authed("PUT /v1/sandboxes/{id}/network", a.changeNetwork(false))
	authed("GET /v1/sandboxes/{id}/netlog", a.netlog)
}

func (a *API) getNetwork(w http.ResponseWriter, r *http.Request) error {
	st, err := a.svc.Network(r.Context(), principalFrom(r.Context()), r.PathValue("id"))
	if err != nil {
		return err
	}
	rest.WriteJSON(w, http.StatusOK, st)
	return nil
}

// changeNetwork applies a JSON merge patch (PATCH) or a whole policy (PUT).
func (a *API) changeNetwork(merge bool) rest.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) error {
		// Another tenant's sandbox is a 404 whatever the body says.
		if _, err := a.svc.Sandbox(r.Context(), principalFrom(r.Context()), r.PathValue("id")); err != nil {
			return err
		}
		ct := r.Header.Get("Content-Type")
		if ct != "" && !strings.HasPrefix(ct, "application/json") && !(merge && strings.HasPrefix(ct, "application/merge-patch+json")) {
			return rest.Invalid("Content-Type must be application/json%s", map[bool]string{true: " or application/merge-patch+json"}[merge])
		}
		body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, rest.MaxBodyBytes))
		if err != nil {
			return rest.JSONError(err)
		}
		if len(strings.TrimSpace(string(body))) == 0 {
			return rest.Invalid("request body is empty: send a network policy")
		}
		st, err := a.svc.UpdateNetwork(r.Context(), principalFrom(r.Context()), r.PathValue("id"), body, merge)
		if err != nil {
			return err
		}
		rest.WriteJSON(w, http.StatusOK, st)
		return nil
	}
}

// netlog relays the sandbox's egress audit log from its node as SSE: "network" events
// whose ids are the offsets to resume from (Last-Event-ID or ?from=), "gap" when
// entries were dropped before this reader got them; ?follow=0 ends at the newest.
func (a *API) netlog(w http.ResponseWriter, r *http.Request) error {
	v := r.Header.Get("Last-Event-ID")
	if v == "" {
		v = r.URL.Query().Get("from")
	}
	var from int64
	if v != "" {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n < 0 {
			return rest.Invalid("offset %q must be a non-negative integer", v)
		}
		from = n
	}
	follow := true
	switch r.URL.Query().Get("follow") {
	case "", "1", "true":
	case "0", "false":
		follow = false
	default:
		return rest.Invalid("follow must be true or false")
	}
	ctx, cancel := context.WithCancelCause(r.Context())
	defer cancel(nil)
	body, err := a.svc.NetLog(ctx, principalFrom(r.Context()), r.PathValue("id"), from, follow)
	if err != nil {
		return err
	}
	defer body.Close()
	s := rest.NewSSE(w)
	if follow {
		defer rest.EndAtStop(r, cancel)() // at a stop a follower reconnects from its last id
	}
	buf := make([]byte, 32<<10)
	for {
		n, err := body.Read(buf)
		if n > 0 {
			if _, werr := w.Write(buf[:n]); werr != nil {
				return nil
			}
			_ = s.Flush()
		}
		if err != nil {
			if !errors.Is(err, io.EOF) && r.Context().Err() == nil {
				a.log.Debug("netlog relay ended", "sandbox", r.PathValue("id"), "err", err)
			}
			return nil
		}
	}
}
