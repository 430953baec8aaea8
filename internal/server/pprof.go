package server

import (
	"net/http"
	"net/http/pprof"

	"github.com/spacedev/space/internal/service"
)

// debugPprof serves Go's profiles (GET /debug/pprof/…: cpu as /debug/pprof/profile,
// heap, goroutine, trace, …) to operators: what docs/benchmarks.md's breakdowns are
// measured with. Profiles reveal nothing of a tenant's data but cost CPU, hence the
// operator key.
func (a *API) debugPprof(w http.ResponseWriter, r *http.Request) error {
	if err := service.RequireOperator(principalFrom(r.Context())); err != nil {
		return err
	}
	switch name := r.PathValue("name"); name {
	case "":
		pprof.Index(w, r)
	case "cmdline":
		pprof.Cmdline(w, r)
	case "profile":
		pprof.Profile(w, r)
	case "symbol":
		pprof.Symbol(w, r)
	case "trace":
		pprof.Trace(w, r)
	default:
		pprof.Handler(name).ServeHTTP(w, r)
	}
	return nil
}
