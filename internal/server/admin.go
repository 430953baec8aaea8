package server

import (
	"encoding/json"
	"net/http"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/ids"
	"github.com/spacedev/space/internal/store"
)

func (a *API) createAPIKey(w http.ResponseWriter, r *http.Request) error {
	if err := requireAdmin(r); err != nil {
		return err
	}
	var req api.CreateAPIKeyRequest
	if err := decodeJSON(w, r, &req); err != nil {
		return err
	}
	if req.Kind == "" {
		req.Kind = "space"
	}
	if req.Kind != "space" && req.Kind != "e2b" {
		return invalid("kind must be \"space\" or \"e2b\"")
	}
	if req.Name == "" || len(req.Name) > 128 {
		return invalid("name is required (at most 128 characters)")
	}
	k, err := CreateKey(r, a.st, req)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusCreated, k)
	return nil
}

// CreateKey creates an API key and returns it with its secret.
func CreateKey(r *http.Request, st *store.Store, req api.CreateAPIKeyRequest) (api.APIKey, error) {
	tenant := "default"
	if p := principalFrom(r.Context()); p != nil {
		tenant = p.Tenant
	}
	secret, prefix, err := store.NewKeySecret(req.Kind)
	if err != nil {
		return api.APIKey{}, err
	}
	k := &store.APIKey{ID: ids.APIKey(), Name: req.Name, Prefix: prefix, Kind: req.Kind, Tenant: tenant, Admin: req.Admin}
	if err := st.CreateAPIKey(r.Context(), k, secret); err != nil {
		return api.APIKey{}, err
	}
	out := k.API()
	out.Secret = secret
	return out, nil
}

func (a *API) listAPIKeys(w http.ResponseWriter, r *http.Request) error {
	if err := requireAdmin(r); err != nil {
		return err
	}
	keys, err := a.st.ListAPIKeys(r.Context())
	if err != nil {
		return err
	}
	out := make([]api.APIKey, 0, len(keys))
	for _, k := range keys {
		out = append(out, k.API())
	}
	writeJSON(w, http.StatusOK, map[string]any{"api_keys": out})
	return nil
}

func (a *API) revokeAPIKey(w http.ResponseWriter, r *http.Request) error {
	if err := requireAdmin(r); err != nil {
		return err
	}
	k, err := a.st.RevokeAPIKey(r.Context(), r.PathValue("id"))
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, k.API())
	return nil
}

func (a *API) listNodes(w http.ResponseWriter, r *http.Request) error {
	nodes, err := a.st.ListNodes(r.Context())
	if err != nil {
		return err
	}
	out := make([]api.Node, 0, len(nodes))
	for _, n := range nodes {
		out = append(out, api.Node{ID: n.ID, Name: n.Name, Runtime: n.Runtime, RuntimeInfo: n.RuntimeInfo,
			DataPlaneURL: n.DataPlaneURL, State: n.State, HeartbeatAt: n.HeartbeatAt, Sandboxes: n.Sandboxes})
	}
	writeJSON(w, http.StatusOK, map[string]any{"nodes": out})
	return nil
}

var _ = json.Marshal
