package server

import (
	"net/http"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/rest"
)

// tenantParam is the ?tenant= filter of listings (operators: any tenant; others: only
// their own).
func tenantParam(r *http.Request) string { return r.URL.Query().Get("tenant") }

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
	keys, err := a.svc.APIKeys(r.Context(), principalFrom(r.Context()), tenantParam(r))
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
	pools, err := a.svc.Pools(r.Context(), principalFrom(r.Context()), tenantParam(r))
	if err != nil {
		return err
	}
	rest.WriteJSON(w, http.StatusOK, map[string]any{"pools": pools})
	return nil
}

// registerTenants adds the tenant routes (operators; a tenant's keys may read their
// own tenant).
func (a *API) registerTenants(authed func(string, rest.HandlerFunc)) {
	authed("GET /v1/tenants", a.listTenants)
	authed("POST /v1/tenants", a.createTenant)
	authed("GET /v1/tenants/{name}", a.getTenant)
	authed("DELETE /v1/tenants/{name}", a.deleteTenant)
	authed("PUT /v1/tenants/{name}/quota", a.setQuota)
}

func (a *API) listTenants(w http.ResponseWriter, r *http.Request) error {
	out, err := a.svc.Tenants(r.Context(), principalFrom(r.Context()))
	if err != nil {
		return err
	}
	rest.WriteJSON(w, http.StatusOK, map[string]any{"tenants": out})
	return nil
}

func (a *API) createTenant(w http.ResponseWriter, r *http.Request) error {
	var req api.CreateTenantRequest
	if err := rest.DecodeJSON(w, r, &req); err != nil {
		return err
	}
	t, err := a.svc.CreateTenant(r.Context(), principalFrom(r.Context()), req)
	if err != nil {
		return err
	}
	w.Header().Set("Location", "/v1/tenants/"+t.Name)
	rest.WriteJSON(w, http.StatusCreated, t)
	return nil
}

func (a *API) getTenant(w http.ResponseWriter, r *http.Request) error {
	t, err := a.svc.Tenant(r.Context(), principalFrom(r.Context()), r.PathValue("name"))
	if err != nil {
		return err
	}
	rest.WriteJSON(w, http.StatusOK, t)
	return nil
}

func (a *API) deleteTenant(w http.ResponseWriter, r *http.Request) error {
	t, err := a.svc.DeleteTenant(r.Context(), principalFrom(r.Context()), r.PathValue("name"))
	if err != nil {
		return err
	}
	rest.WriteJSON(w, http.StatusOK, t)
	return nil
}

func (a *API) setQuota(w http.ResponseWriter, r *http.Request) error {
	var req api.SetQuotaRequest
	if err := rest.DecodeJSON(w, r, &req); err != nil {
		return err
	}
	t, err := a.svc.SetQuota(r.Context(), principalFrom(r.Context()), r.PathValue("name"), req)
	if err != nil {
		return err
	}
	rest.WriteJSON(w, http.StatusOK, t)
	return nil
}
