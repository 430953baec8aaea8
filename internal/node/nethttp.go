package node

import (
	"context"
	"net/http"
	"strconv"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/rest"
	"github.com/spacedev/space/internal/token"
)

// The node's internal network endpoints, for the api role (authorized by its node
// tokens, like the data plane's agent proxy): a sandbox's network state, policy
// changes, and its egress audit log as SSE. They sit beside the data plane under
// /internal/ on the node's listener.

// RegisterRoutes adds the node's internal network routes to mux.
func (n *Node) RegisterRoutes(mux *http.ServeMux) {
	h := func(pattern string, fn rest.HandlerFunc) { mux.Handle(pattern, rest.Handle(n.log, fn)) }
	h("GET /internal/v1/sandboxes/{id}/network", n.getNetworkHTTP)
	h("PUT /internal/v1/sandboxes/{id}/network", n.putNetworkHTTP)
	h("GET /internal/v1/sandboxes/{id}/netlog", n.netlogHTTP)
}

// authorizeInternal checks the api role's node token for the sandbox in the path.
func (n *Node) authorizeInternal(r *http.Request) (string, error) {
	id := r.PathValue("id")
	if n.cfg.Signer == nil {
		return "", fault.New(fault.Unavailable, "this node serves no internal API")
	}
	claims, err := n.cfg.Signer.Verify(rest.Bearer(r))
	if err != nil {
		return "", err
	}
	if !claims.Has(token.RightNode) || claims.Sandbox != id {
		return "", fault.New(fault.Forbidden, "this endpoint is for space's api role only")
	}
	return id, nil
}

func (n *Node) getNetworkHTTP(w http.ResponseWriter, r *http.Request) error {
	id, err := n.authorizeInternal(r)
	if err != nil {
		return err
	}
	st, err := n.NetworkStateOf(r.Context(), id)
	if err != nil {
		return err
	}
	rest.WriteJSON(w, http.StatusOK, st)
	return nil
}

func (n *Node) putNetworkHTTP(w http.ResponseWriter, r *http.Request) error {
	id, err := n.authorizeInternal(r)
	if err != nil {
		return err
	}
	var spec api.Network
	if err := rest.DecodeJSON(w, r, &spec); err != nil {
		return err
	}
	st, err := n.ApplyNetwork(r.Context(), id, &spec)
	if err != nil {
		return err
	}
	rest.WriteJSON(w, http.StatusOK, st)
	return nil
}

// netlogHTTP streams the sandbox's egress audit journal from ?from= (or Last-Event-ID):
// one "network" event per entry, id = the offset to resume from; "gap" when entries
// were dropped before the reader got them. ?follow=0 ends at the newest entry.
func (n *Node) netlogHTTP(w http.ResponseWriter, r *http.Request) error {
	id, err := n.authorizeInternal(r)
	if err != nil {
		return err
	}
	from, err := offsetParam(r)
	if err != nil {
		return err
	}
	follow := true
	if f := r.URL.Query().Get("follow"); f == "0" || f == "false" {
		follow = false
	}
	if n.net == nil {
		return n.errNoNetworking()
	}
	jr, err := n.net.Events(id)
	if err != nil {
		return fault.New(fault.Conflict, "sandbox %s has no network on its node now (it has none, or is not set up yet)", id)
	}
	if _, end := jr.Bounds(); from > end {
		// The journal is newer than the reader's offset: the node restarted (journals
		// live in its memory). Start over from what it has.
		from = 0
	}
	n.Touch(id)
	s := rest.NewSSE(w)
	ctx, cancel := context.WithCancelCause(r.Context())
	defer cancel(nil)
	if follow {
		defer rest.EndAtStop(r, cancel)() // at a stop a follower reconnects from its last id
	}
	hb := time.NewTicker(rest.HeartbeatEvery)
	defer hb.Stop()
	for {
		ch := jr.Changed()
		evs, gap := jr.Read(from, 256)
		if gap > 0 {
			if err := s.Event(strconv.FormatInt(from+gap, 10), api.EventGap, api.GapEvent{Offset: from + gap, Dropped: gap}); err != nil {
				return nil
			}
			from += gap
		}
		for _, ev := range evs {
			if err := s.Event(strconv.FormatInt(ev.Offset+1, 10), api.EventNetwork, ev); err != nil {
				return nil
			}
			from = ev.Offset + 1
		}
		if len(evs) > 0 || gap > 0 {
			_ = s.Flush()
			continue
		}
		if !follow || jr.Closed() {
			return nil
		}
		select {
		case <-ctx.Done():
			return nil
		case <-ch:
		case <-hb.C:
			if s.Comment("heartbeat") != nil || s.Flush() != nil {
				return nil
			}
		}
	}
}

// offsetParam reads the resume offset from Last-Event-ID or ?from=.
func offsetParam(r *http.Request) (int64, error) {
	v := r.Header.Get("Last-Event-ID")
	if v == "" {
		v = r.URL.Query().Get("from")
	}
	if v == "" {
		return 0, nil
	}
	o, err := strconv.ParseInt(v, 10, 64)
	if err != nil || o < 0 {
		return 0, rest.Invalid("offset %q must be a non-negative integer", v)
	}
	return o, nil
}
