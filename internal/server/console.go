package server

import (
	"encoding/json"
	"errors"
	"io/fs"
	"net/http"
	"os"
	"strconv"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/console"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/rest"
)

// This file holds what the web console (internal/console, served at /ui/) needs from
// the API beyond the resources every client uses: who the caller is, recent template
// builds, and the last benchmark results.

// consoleHandler returns the handler of /ui/.
func (a *API) consoleHandler() http.Handler {
	h, err := console.New(console.Config{Logger: a.log, DataPlaneOrigins: a.svc.DataPlaneOrigins})
	if err != nil {
		// The files are embedded at build time: this is a broken build, not a runtime
		// condition. Say so on every request instead of failing the whole server.
		a.log.Error("web console unavailable", "err", err)
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			http.Error(w, "the web console is not available in this build", http.StatusInternalServerError)
		})
	}
	return h
}

// whoami describes the caller's API key, so that a client (the console's sign-in)
// can check a key and learn whether it is an admin key.
func (a *API) whoami(w http.ResponseWriter, r *http.Request) error {
	p := principalFrom(r.Context())
	rest.WriteJSON(w, http.StatusOK, api.WhoAmI{KeyID: p.KeyID, Tenant: p.Tenant, Role: p.Role, Admin: p.ManagesTenant()})
	return nil
}

// listOperations handles GET /v1/operations?kind=template_build: the newest
// operations of one kind (only template builds are listed this way; a sandbox's
// operations are under the sandbox).
func (a *API) listOperations(w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	limit := 50
	if l := q.Get("limit"); l != "" {
		n, err := strconv.Atoi(l)
		if err != nil {
			return rest.Invalid("limit must be an integer")
		}
		limit = n
	}
	ops, err := a.svc.RecentOperations(r.Context(), principalFrom(r.Context()), q.Get("kind"), q.Get("tenant"), limit)
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

// maxBenchBytes bounds the benchmark file the API serves.
const maxBenchBytes = 4 << 20

// benchResults handles GET /v1/bench: the results `space bench` saved last on this
// host (Config.BenchFile), as it wrote them.
func (a *API) benchResults(w http.ResponseWriter, r *http.Request) error {
	if a.benchFile == "" {
		return fault.New(fault.NotFound, "this server keeps no benchmark results")
	}
	f, err := os.Open(a.benchFile)
	if errors.Is(err, fs.ErrNotExist) {
		return fault.New(fault.NotFound, "no benchmark results yet: run `space bench` on the server's host")
	}
	if err != nil {
		return err
	}
	defer f.Close()
	var doc json.RawMessage
	dec := json.NewDecoder(http.MaxBytesReader(nil, f, maxBenchBytes))
	if err := dec.Decode(&doc); err != nil {
		return fault.New(fault.Unprocessable, "the saved benchmark results in %s are unreadable: %v", a.benchFile, err)
	}
	var mod time.Time
	if st, err := f.Stat(); err == nil {
		mod = st.ModTime()
	}
	w.Header().Set("Last-Modified", mod.UTC().Format(http.TimeFormat))
	rest.WriteJSON(w, http.StatusOK, doc)
	return nil
}

// registerConsole adds the web console (/ui/) and the endpoints made for it.
func (a *API) registerConsole(mux *http.ServeMux, authed func(string, rest.HandlerFunc)) {
	mux.Handle("/ui/", a.consoleHandler())
	authed("GET /v1/whoami", a.whoami)
	authed("GET /v1/events", a.events)
	authed("GET /v1/operations", a.listOperations)
	authed("GET /v1/bench", a.benchResults)
}
