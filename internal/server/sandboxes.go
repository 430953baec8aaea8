package server

import (
	"bytes"
	"crypto/sha256"
	"io"
	"net/http"
	"strconv"
	"strings"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/rest"
	"github.com/spacedev/space/internal/service"
)

func (a *API) createSandbox(w http.ResponseWriter, r *http.Request) error {
	idem, err := idempotency(w, r)
	if err != nil {
		return err
	}
	var req api.CreateSandboxRequest
	if err := rest.DecodeJSON(w, r, &req); err != nil {
		return err
	}
	out, err := a.svc.Create(r.Context(), principalFrom(r.Context()), req, idem)
	if err != nil {
		return err
	}
	writeAnswer(w, &out.Answer)
	return nil
}

// idempotency returns the request's Idempotency-Key with what identifies the request
// (method, path, the body's hash), or nil when it has none. It reads the body and gives
// r a copy to decode.
func idempotency(w http.ResponseWriter, r *http.Request) (*service.Idempotency, error) {
	key := r.Header.Get("Idempotency-Key")
	if key == "" {
		return nil, nil
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, rest.MaxBodyBytes))
	if err != nil {
		return nil, rest.JSONError(err)
	}
	r.Body = io.NopCloser(bytes.NewReader(body))
	h := sha256.Sum256(body)
	return &service.Idempotency{Key: key, Method: r.Method, Path: r.URL.Path, BodyHash: h[:]}, nil
}

// writeAnswer writes a recorded answer: a replayed one says so (Idempotent-Replayed),
// a new one names what it made (Location) when it made something.
func writeAnswer(w http.ResponseWriter, ans *service.Answer) {
	w.Header().Set("Content-Type", "application/json")
	if ans.Replayed {
		w.Header().Set("Idempotent-Replayed", "true")
	} else if ans.Location != "" {
		w.Header().Set("Location", ans.Location)
	}
	w.WriteHeader(ans.Status)
	_, _ = w.Write(ans.Body)
}

func (a *API) getSandbox(w http.ResponseWriter, r *http.Request) error {
	sb, err := a.svc.Sandbox(r.Context(), principalFrom(r.Context()), r.PathValue("id"))
	if err != nil {
		return err
	}
	rest.WriteJSON(w, http.StatusOK, sb.API())
	return nil
}

// parseMetadataFilter accepts metadata=key=value (repeatable) or metadata=k1=v1&k2=v2
// URL-encoded in one parameter (the E2B form).
func parseMetadataFilter(vals []string) (map[string]string, error) {
	out := map[string]string{}
	for _, v := range vals {
		for _, pair := range strings.Split(v, "&") {
			if pair == "" {
				continue
			}
			k, val, ok := strings.Cut(pair, "=")
			if !ok || k == "" {
				return nil, rest.Invalid("metadata filter %q must look like key=value", pair)
			}
			out[k] = val
		}
	}
	return out, nil
}

func (a *API) listSandboxes(w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	var f service.ListFilter
	for _, s := range q["state"] {
		f.States = append(f.States, strings.Split(s, ",")...)
	}
	md, err := parseMetadataFilter(q["metadata"])
	if err != nil {
		return err
	}
	f.Metadata = md
	f.Tenant = q.Get("tenant")
	if l := q.Get("limit"); l != "" {
		n, err := strconv.Atoi(l)
		if err != nil || n < 1 {
			return rest.Invalid("limit must be a positive integer")
		}
		f.Limit = n
	}
	list, err := a.svc.List(r.Context(), principalFrom(r.Context()), f)
	if err != nil {
		return err
	}
	out := api.SandboxList{Sandboxes: make([]api.Sandbox, 0, len(list))}
	for _, sb := range list {
		out.Sandboxes = append(out.Sandboxes, sb.API())
	}
	rest.WriteJSON(w, http.StatusOK, out)
	return nil
}

// deleteSandbox handles DELETE /v1/sandboxes/{id}: 202 with the delete's operation.
// With an Idempotency-Key, a repeat gets the first answer.
func (a *API) deleteSandbox(w http.ResponseWriter, r *http.Request) error {
	idem, err := idempotency(w, r)
	if err != nil {
		return err
	}
	ans, err := a.svc.DeleteKeyed(r.Context(), principalFrom(r.Context()), r.PathValue("id"), idem)
	if err != nil {
		return err
	}
	writeAnswer(w, ans)
	return nil
}

// lifecycle handles POST /v1/sandboxes/{id}/<verb>.
func (a *API) lifecycle(kind string) rest.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) error {
		idem, err := idempotency(w, r)
		if err != nil {
			return err
		}
		ans, err := a.svc.RequestVerbKeyed(r.Context(), principalFrom(r.Context()), r.PathValue("id"), kind, idem)
		if err != nil {
			return err
		}
		writeAnswer(w, ans)
		return nil
	}
}

// clone handles POST /v1/sandboxes/{id}/clone.
func (a *API) clone(w http.ResponseWriter, r *http.Request) error {
	idem, err := idempotency(w, r)
	if err != nil {
		return err
	}
	var req api.CloneRequest
	if err := rest.DecodeOptionalJSON(w, r, &req); err != nil {
		return err
	}
	ans, err := a.svc.CloneKeyed(r.Context(), principalFrom(r.Context()), r.PathValue("id"), req, idem)
	if err != nil {
		return err
	}
	writeAnswer(w, ans)
	return nil
}

func (a *API) listSandboxOperations(w http.ResponseWriter, r *http.Request) error {
	ops, err := a.svc.SandboxOperations(r.Context(), principalFrom(r.Context()), r.PathValue("id"))
	if err != nil {
		return err
	}
	out := make([]*api.Operation, 0, len(ops))
	for _, o := range ops {
		out = append(out, o.API())
	}
	rest.WriteJSON(w, http.StatusOK, map[string]any{"operations": out})
	return nil
}

func (a *API) revokeTokens(w http.ResponseWriter, r *http.Request) error {
	id := r.PathValue("id")
	epoch, err := a.svc.RevokeTokens(r.Context(), principalFrom(r.Context()), id)
	if err != nil {
		return err
	}
	rest.WriteJSON(w, http.StatusOK, map[string]any{"sandbox_id": id, "token_epoch": epoch})
	return nil
}

func (a *API) createSession(w http.ResponseWriter, r *http.Request) error {
	var req api.CreateSessionRequest
	if err := rest.DecodeJSON(w, r, &req); err != nil {
		return err
	}
	nw, err := noWake(r)
	if err != nil {
		return err
	}
	sess, err := a.svc.CreateSession(r.Context(), principalFrom(r.Context()), r.PathValue("id"), req, nw, r.Header.Get("Idempotency-Key"))
	if err != nil {
		return err
	}
	rest.WriteJSON(w, http.StatusCreated, sess)
	return nil
}

func (a *API) listProcesses(w http.ResponseWriter, r *http.Request) error {
	nw, err := noWake(r)
	if err != nil {
		return err
	}
	out, err := a.svc.Processes(r.Context(), principalFrom(r.Context()), r.PathValue("id"), nw)
	if err != nil {
		return err
	}
	rest.WriteJSON(w, http.StatusOK, map[string]any{"processes": out})
	return nil
}

func (a *API) getProcess(w http.ResponseWriter, r *http.Request) error {
	nw, err := noWake(r)
	if err != nil {
		return err
	}
	p, err := a.svc.Process(r.Context(), principalFrom(r.Context()), r.PathValue("id"), r.PathValue("pid"), nw)
	if err != nil {
		return err
	}
	rest.WriteJSON(w, http.StatusOK, p)
	return nil
}
