package server

import (
	"context"
	"net/http"
	"strings"

	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/store"
)

// Principal is the authenticated caller of a control-plane request.
type Principal struct {
	KeyID  string
	Tenant string
	Admin  bool
}

type principalKey struct{}

func principalFrom(ctx context.Context) *Principal {
	p, _ := ctx.Value(principalKey{}).(*Principal)
	return p
}

// bearer returns the credential from "Authorization: Bearer …" or "X-API-Key".
func bearer(r *http.Request) string {
	if h := r.Header.Get("Authorization"); h != "" {
		if v, ok := strings.CutPrefix(h, "Bearer "); ok {
			return strings.TrimSpace(v)
		}
		return ""
	}
	return strings.TrimSpace(r.Header.Get("X-API-Key"))
}

// withKey authenticates a control-plane request by API key.
func (a *API) withKey(h handlerFunc) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p, err := a.authenticate(r)
		if err != nil {
			writeError(w, r, a.log, err)
			return
		}
		r = r.WithContext(context.WithValue(r.Context(), principalKey{}, p))
		if err := h(w, r); err != nil {
			writeError(w, r, a.log, err)
		}
	})
}

func (a *API) authenticate(r *http.Request) (*Principal, error) {
	secret := bearer(r)
	if secret == "" {
		return nil, fault.New(fault.Unauthorized, "missing API key: send Authorization: Bearer <key> or X-API-Key")
	}
	if strings.HasPrefix(secret, "spt1.") {
		return nil, fault.New(fault.Unauthorized, "attachment tokens do not authorize control-plane requests")
	}
	if len(secret) > 512 {
		return nil, fault.New(fault.Unauthorized, "invalid API key")
	}
	k, err := a.st.LookupAPIKey(r.Context(), secret)
	if fault.Is(err, fault.NotFound) {
		return nil, fault.New(fault.Unauthorized, "invalid API key")
	}
	if err != nil {
		return nil, err
	}
	if k.Kind != "space" {
		return nil, fault.New(fault.Unauthorized, "this API key is for the E2B-compatible API only")
	}
	return &Principal{KeyID: k.ID, Tenant: k.Tenant, Admin: k.Admin}, nil
}

// visible reports whether the caller may see a sandbox of tenant.
func (p *Principal) visible(tenant string) bool { return p.Admin || p.Tenant == tenant }

func requireAdmin(r *http.Request) error {
	if p := principalFrom(r.Context()); p == nil || !p.Admin {
		return fault.New(fault.Forbidden, "this request needs an admin API key")
	}
	return nil
}

// sandboxFor loads a sandbox the caller may see (404 otherwise, so that other tenants'
// sandboxes are indistinguishable from missing ones).
func (a *API) sandboxFor(r *http.Request, id string) (*store.Sandbox, error) {
	sb, err := a.st.GetSandbox(r.Context(), id)
	if err != nil {
		return nil, err
	}
	if !principalFrom(r.Context()).visible(sb.Tenant) || sb.PoolKey != "" {
		return nil, fault.New(fault.NotFound, "sandbox %q not found", id)
	}
	if sb.DeletedAt == nil {
		a.touch(sb.ID)
	}
	return sb, nil
}

func notFoundRoute(r *http.Request) error {
	return fault.New(fault.NotFound, "no route for %s %s", r.Method, r.URL.Path)
}
