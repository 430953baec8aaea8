package server

import (
	"net/http"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/rest"
)

func (a *API) createAPIKey(w http.ResponseWriter, r *http.Request) error {
	var req api.CreateAPIKeyRequest
	if err := rest.DecodeJSON(w, r, &req); err != nil {
		return err
	}
	k, err := a.svc.CreateAPIKey(r.Context(), principalFrom(r.Context()), req)
	if err != nil {
		return err
	}
	rest.WriteJSON(w, http.StatusCreated, k)
	return nil
}

func (a *API) listAPIKeys(w http.ResponseWriter, r *http.Request) error {
	keys, err := a.svc.APIKeys(r.Context(), principalFrom(r.Context()))
	if err != nil {
		return err
	}
	rest.WriteJSON(w, http.StatusOK, map[string]any{"api_keys": keys})
	return nil
}

func (a *API) revokeAPIKey(w http.ResponseWriter, r *http.Request) error {
	k, err := a.svc.RevokeAPIKey(r.Context(), principalFrom(r.Context()), r.PathValue("id"))
	if err != nil {
		return err
	}
	rest.WriteJSON(w, http.StatusOK, k)
	return nil
}

func (a *API) listNodes(w http.ResponseWriter, r *http.Request) error {
	nodes, err := a.svc.Nodes(r.Context(), principalFrom(r.Context()))
	if err != nil {
		return err
	}
	rest.WriteJSON(w, http.StatusOK, map[string]any{"nodes": nodes})
	return nil
}

func (a *API) setPool(w http.ResponseWriter, r *http.Request) error {
	var req api.SetPoolRequest
	if err := rest.DecodeJSON(w, r, &req); err != nil {
		return err
	}
	p, err := a.svc.SetPool(r.Context(), principalFrom(r.Context()), req)
	if err != nil {
		return err
	}
	rest.WriteJSON(w, http.StatusOK, p)
	return nil
}

func (a *API) listPools(w http.ResponseWriter, r *http.Request) error {
	pools, err := a.svc.Pools(r.Context(), principalFrom(r.Context()))
	if err != nil {
		return err
	}
	rest.WriteJSON(w, http.StatusOK, map[string]any{"pools": pools})
	return nil
}
