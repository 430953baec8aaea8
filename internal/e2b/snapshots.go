package e2b

import (
	"context"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/rest"
	"github.com/spacedev/space/internal/service"
	"github.com/spacedev/space/internal/store"
)

// Fork and snapshots (docs/e2b.md). E2B's fork is a space clone (memory and disk); an
// E2B snapshot is a space named snapshot, and its id is what Sandbox.create takes as a
// template id. E2B deletes snapshots with DELETE /templates/{id} (snapshots are
// templates there).

// forkTimeout is E2B's default timeout of forks (SandboxForkRequest.timeout).
const forkTimeout = legacyTimeout

func (g *Gateway) snapshotRoutes(h func(string, apiHandler)) {
	h("POST /sandboxes/{id}/fork", g.fork)
	h("POST /v2/sandboxes/{id}/fork", g.fork)
	h("POST /sandboxes/{id}/snapshots", g.createSnapshot)
	h("GET /snapshots", g.listSnapshots)
	h("DELETE /templates/{templateID}", g.deleteSnapshot)
}

// forkResult is E2B's SandboxForkResult: the fork or why it did not start.
type forkResult struct {
	Sandbox *sandboxJSON `json:"sandbox,omitempty"`
	Error   *errorJSON   `json:"error,omitempty"`
}

type errorJSON struct {
	Code    int    `json:"code"`
	Message string `json:"message"`
}

// fork handles POST /sandboxes/{id}/fork (and /v2): count clones of the sandbox with
// its memory and disk, answered once each runs or failed (201, one result per fork).
// The source keeps running; the forks get the source's metadata and what it does at
// its timeout, and a timeout of their own.
func (g *Gateway) fork(w http.ResponseWriter, r *http.Request, p *service.Principal) error {
	var body struct {
		Count   *int `json:"count"`
		Timeout *int `json:"timeout"`
	}
	if err := decodeBody(r, &body); err != nil {
		return err
	}
	secs, err := g.timeout(body.Timeout, forkTimeout)
	if err != nil {
		return err
	}
	count := 1
	if body.Count != nil {
		count = *body.Count
	}
	ctx := r.Context()
	src, err := g.live(ctx, p, r.PathValue("id"))
	if err != nil {
		return err
	}
	out, err := g.api.Clone(ctx, p, src.ID, api.CloneRequest{Count: count,
		TTL: (time.Duration(secs)*time.Second + createAllowance).String()})
	if err != nil {
		return err
	}
	results := make([]forkResult, len(out.Sandboxes))
	for i, c := range out.Sandboxes {
		results[i] = g.awaitFork(r, p, c, secs, src.ExpireAction)
	}
	g.log.Info("E2B fork", "source", src.ID, "count", count, "timeout", secs)
	writeJSON(w, http.StatusCreated, results)
	return nil
}

// awaitFork waits for one fork to run and gives it its timeout; a fork that failed is
// deleted and reported.
func (g *Gateway) awaitFork(r *http.Request, p *service.Principal, c api.Sandbox, secs int, action string) forkResult {
	ctx := r.Context()
	fail := func(err error) forkResult {
		if _, derr := g.api.Delete(context.WithoutCancel(ctx), p, c.ID); derr != nil && !fault.Is(derr, fault.NotFound) {
			g.log.Warn("delete failed fork", "sandbox", c.ID, "err", derr)
		}
		return forkResult{Error: &errorJSON{Code: rest.StatusOf(err), Message: fault.Message(err)}}
	}
	op, err := g.api.WaitDone(ctx, p, c.Operation.ID)
	if err != nil {
		return fail(err)
	}
	if op.State == api.OpFailed {
		return fail(fault.New(fault.Internal, "fork failed to start: %s", op.Error))
	}
	sb, err := g.live(ctx, p, c.ID)
	if err != nil {
		return fail(err)
	}
	exp := time.Now().Add(time.Duration(secs) * time.Second)
	if err := g.api.SetExpiry(ctx, p, sb.ID, &exp, action); err != nil {
		return fail(err)
	}
	js := g.sandboxJSON(r, sb)
	return forkResult{Sandbox: &js}
}

// snapshotInfo is E2B's SnapshotInfo: its id (what Sandbox.create takes) and names.
type snapshotInfo struct {
	SnapshotID string   `json:"snapshotID"`
	Names      []string `json:"names"`
}

func snapshotJSON(sn *store.Snapshot) snapshotInfo {
	return snapshotInfo{SnapshotID: sn.Name, Names: []string{sn.Name}}
}

// createSnapshot handles POST /sandboxes/{id}/snapshots: a named snapshot of the
// sandbox, answered (201) once it is ready. As on E2B, a name that exists is given to
// the new snapshot (space keeps the old one under its id: delete it by that id).
func (g *Gateway) createSnapshot(w http.ResponseWriter, r *http.Request, p *service.Principal) error {
	var body struct {
		Name string `json:"name"`
	}
	if err := decodeBody(r, &body); err != nil {
		return err
	}
	ctx := r.Context()
	src, err := g.live(ctx, p, r.PathValue("id"))
	if err != nil {
		return err
	}
	name := snapshotName(body.Name)
	sn, op, err := g.api.CreateSnapshot(ctx, p, src.ID, api.CreateSnapshotRequest{Name: name, Replace: name != ""})
	if err != nil {
		return err
	}
	if op, err = g.api.WaitDone(ctx, p, op.ID); err != nil {
		return err
	}
	if op.State == api.OpFailed {
		return fault.New(fault.Internal, "snapshot of %s failed: %s", src.ID, op.Error)
	}
	g.log.Info("E2B snapshot created", "snapshot", sn.ID, "name", sn.Name, "source", src.ID)
	writeJSON(w, http.StatusCreated, snapshotJSON(sn))
	return nil
}

// snapshotName turns an E2B snapshot or template id ("team/name:tag") into a space
// snapshot name or id: the namespace goes, and so does the tag, which must be
// "default" or "latest" (space snapshots have no other tags; "" is returned then).
func snapshotName(id string) string {
	if i := strings.LastIndex(id, "/"); i >= 0 {
		id = id[i+1:]
	}
	if name, tag, ok := strings.Cut(id, ":"); ok {
		if tag != "default" && tag != "latest" {
			return ""
		}
		id = name
	}
	return id
}

// snapshotFor returns the snapshot an E2B template id names, or nil if it names none
// (it is then a template).
func (g *Gateway) snapshotFor(ctx context.Context, p *service.Principal, templateID string) (*store.Snapshot, error) {
	name := snapshotName(templateID)
	if name == "" || service.ValidSnapshotName(name) != nil {
		return nil, nil
	}
	sn, err := g.api.Snapshot(ctx, p, name)
	if fault.Is(err, fault.NotFound) {
		return nil, nil
	}
	return sn, err
}

// listSnapshots handles GET /snapshots?sandboxID=&name=&limit=&nextToken=, newest
// first, paginated like the sandbox list (X-Next-Token).
func (g *Gateway) listSnapshots(w http.ResponseWriter, r *http.Request, p *service.Principal) error {
	q := r.URL.Query()
	limit := maxListLimit
	if l := q.Get("limit"); l != "" {
		n, err := strconv.Atoi(l)
		if err != nil || n < 1 || n > maxListLimit {
			return fault.New(fault.Invalid, "limit must be between 1 and %d", maxListLimit)
		}
		limit = n
	}
	f := service.SnapshotFilter{Source: q.Get("sandboxID"), After: q.Get("nextToken"), Limit: limit + 1}
	if n := q.Get("name"); n != "" {
		if f.Name = snapshotName(n); f.Name == "" {
			writeJSON(w, http.StatusOK, []snapshotInfo{})
			return nil
		}
	}
	list, err := g.api.Snapshots(r.Context(), p, f)
	if err != nil {
		return err
	}
	out := []snapshotInfo{}
	for i, sn := range list {
		if i == limit {
			w.Header().Set("X-Next-Token", list[i-1].ID)
			break
		}
		if sn.State == api.SnapshotReady {
			out = append(out, snapshotJSON(sn))
		}
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}

// deleteSnapshot handles DELETE /templates/{templateID} for snapshots (204; 404 for
// what is not a snapshot of the caller: templates are managed with space's own API).
func (g *Gateway) deleteSnapshot(w http.ResponseWriter, r *http.Request, p *service.Principal) error {
	id := r.PathValue("templateID")
	sn, err := g.snapshotFor(r.Context(), p, id)
	if err != nil {
		return err
	}
	if sn == nil || sn.State == api.SnapshotDeleting {
		return fault.New(fault.NotFound, "snapshot %q not found (templates are deleted with space's API: space template rm)", id)
	}
	if _, err := g.api.DeleteSnapshot(r.Context(), p, sn.ID); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}
