package server

import (
	"net/http"

	"github.com/spacedev/space/api"
)

// registerTemplates adds the template routes.
func (a *API) registerTemplates(authed func(string, handlerFunc)) {
	authed("GET /v1/templates", a.listTemplates)
}

func (a *API) listTemplates(w http.ResponseWriter, r *http.Request) error {
	rels, err := a.st.ListReleases(r.Context())
	if err != nil {
		return err
	}
	out := make([]api.Template, 0, len(rels))
	for _, rel := range rels {
		out = append(out, api.Template{Name: rel.Name, Tags: rel.Tags, Digest: rel.Digest, SizeBytes: rel.SizeBytes, CreatedAt: rel.CreatedAt})
	}
	writeJSON(w, http.StatusOK, map[string]any{"templates": out})
	return nil
}
