package server

import (
	"net/http"
	"strconv"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/rest"
	"github.com/spacedev/space/internal/service"
)

// registerSnapshots adds the named snapshot routes and the sandbox metrics route.
func (a *API) registerSnapshots(authed func(string, rest.HandlerFunc)) {
	authed("POST /v1/sandboxes/{id}/snapshots", a.createSnapshot)
	authed("GET /v1/snapshots", a.listSnapshots)
	authed("GET /v1/snapshots/{ref}", a.getSnapshot)
	authed("DELETE /v1/snapshots/{ref}", a.deleteSnapshot)
	authed("GET /v1/sandboxes/{id}/metrics", a.sandboxMetrics)
}

// createSnapshot handles POST /v1/sandboxes/{id}/snapshots: 202 with the snapshot
// (creating) and the operation that takes it.
func (a *API) createSnapshot(w http.ResponseWriter, r *http.Request) error {
	idem, err := idempotency(w, r)
	if err != nil {
		return err
	}
	var req api.CreateSnapshotRequest
	if err := rest.DecodeOptionalJSON(w, r, &req); err != nil {
		return err
	}
	ans, err := a.svc.CreateSnapshotKeyed(r.Context(), principalFrom(r.Context()), r.PathValue("id"), req, idem)
	if err != nil {
		return err
	}
	writeAnswer(w, ans)
	return nil
}

func (a *API) listSnapshots(w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	f := service.SnapshotFilter{Source: q.Get("sandbox"), Name: q.Get("name"), After: q.Get("after")}
	if l := q.Get("limit"); l != "" {
		n, err := strconv.Atoi(l)
		if err != nil || n < 1 {
			return rest.Invalid("limit must be a positive integer")
		}
		f.Limit = n
	}
	list, err := a.svc.Snapshots(r.Context(), principalFrom(r.Context()), f)
	if err != nil {
		return err
	}
	out := api.SnapshotList{Snapshots: make([]api.Snapshot, 0, len(list))}
	for _, sn := range list {
		out.Snapshots = append(out.Snapshots, sn.API())
	}
	rest.WriteJSON(w, http.StatusOK, out)
	return nil
}

func (a *API) getSnapshot(w http.ResponseWriter, r *http.Request) error {
	sn, err := a.svc.Snapshot(r.Context(), principalFrom(r.Context()), r.PathValue("ref"))
	if err != nil {
		return err
	}
	rest.WriteJSON(w, http.StatusOK, sn.API())
	return nil
}

// deleteSnapshot handles DELETE /v1/snapshots/{ref}: 202 with the snapshot, now
// deleting (its node removes its files). With an Idempotency-Key, a repeat gets the
// first answer.
func (a *API) deleteSnapshot(w http.ResponseWriter, r *http.Request) error {
	idem, err := idempotency(w, r)
	if err != nil {
		return err
	}
	ans, err := a.svc.DeleteSnapshotKeyed(r.Context(), principalFrom(r.Context()), r.PathValue("ref"), idem)
	if err != nil {
		return err
	}
	writeAnswer(w, ans)
	return nil
}

// sandboxMetrics handles GET /v1/sandboxes/{id}/metrics?start=&end= (RFC 3339 times
// or unix seconds).
func (a *API) sandboxMetrics(w http.ResponseWriter, r *http.Request) error {
	var bounds [2]time.Time
	for i, name := range []string{"start", "end"} {
		t, err := parseTime(r.URL.Query().Get(name))
		if err != nil {
			return rest.Invalid("%s: %v", name, err)
		}
		bounds[i] = t
	}
	sb, samples, err := a.svc.Metrics(r.Context(), principalFrom(r.Context()), r.PathValue("id"), bounds[0], bounds[1])
	if err != nil {
		return err
	}
	rest.WriteJSON(w, http.StatusOK, api.MetricList{SandboxID: sb.ID, Samples: samples})
	return nil
}

// parseTime parses a time given as RFC 3339 or as unix seconds ("" is the zero time).
func parseTime(s string) (time.Time, error) {
	if s == "" {
		return time.Time{}, nil
	}
	if n, err := strconv.ParseInt(s, 10, 64); err == nil {
		return time.Unix(n, 0).UTC(), nil
	}
	t, err := time.Parse(time.RFC3339Nano, s)
	if err != nil {
		return time.Time{}, rest.Invalid("%q is neither an RFC 3339 time nor unix seconds", s)
	}
	return t, nil
}
