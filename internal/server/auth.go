package server

import (
	"context"
	"net/http"

	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/rest"
	"github.com/spacedev/space/internal/service"
)

type principalKey struct{}

func principalFrom(ctx context.Context) *service.Principal {
	p, _ := ctx.Value(principalKey{}).(*service.Principal)
	return p
}

// withKey authenticates a control-plane request by API key, then runs h with the
// caller in the request's context.
func (a *API) withKey(h rest.HandlerFunc) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p, err := a.svc.Authenticate(r.Context(), rest.Bearer(r), service.KeySpace)
		if err == nil {
			err = a.svc.Allow(r.Context(), p) // the tenant's request rate
		}
		if err != nil {
			rest.WriteError(w, r, a.log, err)
			return
		}
		r = r.WithContext(context.WithValue(r.Context(), principalKey{}, p))
		if err := h(w, r); err != nil {
			rest.WriteError(w, r, a.log, err)
		}
	})
}

// noWake reports whether the request asks not to wake a resting sandbox (?wake=false);
// a value other than true/false/1/0 is refused.
func noWake(r *http.Request) (bool, error) {
	switch w := r.URL.Query().Get("wake"); w {
	case "", "true", "1":
		return false, nil
	case "false", "0":
		return true, nil
	default:
		return false, rest.Invalid("wake must be true or false, not %q", w)
	}
}

func notFoundRoute(r *http.Request) error {
	return fault.New(fault.NotFound, "no route for %s %s", r.Method, r.URL.Path)
}
