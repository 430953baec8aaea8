package server

import (
	"io"
	"mime"
	"net/http"

	"github.com/spacedev/space/internal/rest"
)

// registerTemplates adds the template routes.
func (a *API) registerTemplates(authed func(string, rest.HandlerFunc)) {
	authed("GET /v1/templates", a.listTemplates)
	authed("POST /v1/templates", a.buildTemplate)
	authed("GET /v1/templates/{name}", a.getTemplate)
	authed("DELETE /v1/templates/{ref}", a.deleteTemplate)
}

func (a *API) listTemplates(w http.ResponseWriter, r *http.Request) error {
	out, err := a.svc.Templates(r.Context(), principalFrom(r.Context()), tenantParam(r))
	if err != nil {
		return err
	}
	rest.WriteJSON(w, http.StatusOK, map[string]any{"templates": out})
	return nil
}

func (a *API) getTemplate(w http.ResponseWriter, r *http.Request) error {
	out, err := a.svc.Template(r.Context(), principalFrom(r.Context()), r.PathValue("name"), tenantParam(r))
	if err != nil {
		return err
	}
	rest.WriteJSON(w, http.StatusOK, out)
	return nil
}

// deleteTemplate removes a tag (name:tag) or deletes a release (name@sha256:…).
func (a *API) deleteTemplate(w http.ResponseWriter, r *http.Request) error {
	out, err := a.svc.DeleteTemplate(r.Context(), principalFrom(r.Context()), r.PathValue("ref"), tenantParam(r))
	if err != nil {
		return err
	}
	rest.WriteJSON(w, http.StatusOK, out)
	return nil
}

// buildTemplate queues a build of a spec (JSON, or YAML with a YAML content type).
// 202 with the operation. With an Idempotency-Key, a repeat gets the first answer and
// queues nothing; the key names the tenant an operator builds for too.
func (a *API) buildTemplate(w http.ResponseWriter, r *http.Request) error {
	if ct := r.Header.Get("Content-Type"); ct != "" {
		mt, _, err := mime.ParseMediaType(ct)
		if err != nil {
			return rest.Invalid("bad Content-Type %q", ct)
		}
		switch mt {
		case "application/json", "application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml":
		default:
			return rest.Invalid("Content-Type must be application/json or application/yaml")
		}
	}
	idem, err := idempotency(w, r)
	if err != nil {
		return err
	}
	tenant := tenantParam(r)
	if idem != nil && tenant != "" {
		idem.Path += "?tenant=" + tenant
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, rest.MaxBodyBytes))
	if err != nil {
		return rest.JSONError(err)
	}
	ans, err := a.svc.BuildTemplateKeyed(r.Context(), principalFrom(r.Context()), body, tenant, idem)
	if err != nil {
		return err
	}
	writeAnswer(w, ans)
	return nil
}
