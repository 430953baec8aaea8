package server

import (
	"net/http"
	"net/http/pprof"
)

// DebugPprof serves Go's profiles (GET /debug/pprof/…: cpu as /debug/pprof/profile,
// heap, goroutine, trace, …) on the operator's metrics address (space serve
// --metrics-listen), never on the API's: what docs/benchmarks.md's breakdowns are
// measured with.
func DebugPprof(w http.ResponseWriter, r *http.Request) {
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
}
