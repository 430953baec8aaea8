package server

import (
	"context"
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
)

// This file holds what the web console (internal/console, served at /ui/) needs from
// the API beyond the resources every client uses: who the caller is, recent template
// builds, and the last benchmark results.

// consoleHandler returns the handler of /ui/.
func (a *API) consoleHandler() http.Handler {
	h, err := console.New(console.Config{Logger: a.log, DataPlaneOrigins: a.dataPlaneOrigins})
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

// dataPlaneOrigins lists the data-plane URLs of the nodes, which the console's pages
// connect to for attach streams.
func (a *API) dataPlaneOrigins(ctx context.Context) ([]string, error) {
	nodes, err := a.st.ListNodes(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]string, 0, len(nodes))
	for _, n := range nodes {
		out = append(out, n.DataPlaneURL)
	}
	return out, nil
}

// whoAmI is the body of GET /v1/whoami.
type whoAmI struct {
	KeyID  string `json:"key_id"`
	Tenant string `json:"tenant"`
	Admin  bool   `json:"admin"`
}

// whoami describes the caller's API key, so that a client (the console's sign-in)
// can check a key and learn whether it is an admin key.
func (a *API) whoami(w http.ResponseWriter, r *http.Request) error {
	p := principalFrom(r.Context())
	writeJSON(w, http.StatusOK, whoAmI{KeyID: p.KeyID, Tenant: p.Tenant, Admin: p.Admin})
	return nil
}

// buildOperation is an operation of a template build with the template it builds.
type buildOperation struct {
	api.Operation
	Template string `json:"template,omitempty"`
}

// listOperations handles GET /v1/operations?kind=template_build: the newest
// operations of one kind (only template builds are listed this way; a sandbox's
// operations are under the sandbox).
func (a *API) listOperations(w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	kind := q.Get("kind")
	if kind != api.OpTemplateBuild {
		return invalid("kind must be %q (a sandbox's operations are at /v1/sandboxes/{id}/operations)", api.OpTemplateBuild)
	}
	limit := 50
	if l := q.Get("limit"); l != "" {
		n, err := strconv.Atoi(l)
		if err != nil || n < 1 || n > 500 {
			return invalid("limit must be between 1 and 500")
		}
		limit = n
	}
	tenant := ""
	if p := principalFrom(r.Context()); !p.Admin {
		tenant = p.Tenant
	}
	ops, err := a.st.RecentOperations(r.Context(), kind, tenant, limit)
	if err != nil {
		return err
	}
	out := make([]buildOperation, 0, len(ops))
	for _, o := range ops {
		b := buildOperation{Operation: *o.API()}
		b.Template, _ = o.Params["template"].(string)
		out = append(out, b)
	}
	writeJSON(w, http.StatusOK, map[string]any{"operations": out})
	return nil
}

// maxBenchBytes bounds the benchmark file the API serves.
const maxBenchBytes = 4 << 20

// benchResults handles GET /v1/bench: the results `space bench` saved last on this
// host (Config.BenchFile), as it wrote them.
func (a *API) benchResults(w http.ResponseWriter, r *http.Request) error {
	if a.cfg.BenchFile == "" {
		return fault.New(fault.NotFound, "this server keeps no benchmark results")
	}
	f, err := os.Open(a.cfg.BenchFile)
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
		return fault.New(fault.Unprocessable, "the saved benchmark results in %s are unreadable: %v", a.cfg.BenchFile, err)
	}
	var mod time.Time
	if st, err := f.Stat(); err == nil {
		mod = st.ModTime()
	}
	w.Header().Set("Last-Modified", mod.UTC().Format(http.TimeFormat))
	writeJSON(w, http.StatusOK, doc)
	return nil
}

// registerConsole adds the web console (/ui/) and the endpoints made for it.
func (a *API) registerConsole(mux *http.ServeMux, authed func(string, handlerFunc)) {
	mux.Handle("/ui/", a.consoleHandler())
	authed("GET /v1/whoami", a.whoami)
	authed("GET /v1/events", a.events(newEventHub(a.st, a.log)))
	authed("GET /v1/operations", a.listOperations)
	authed("GET /v1/bench", a.benchResults)
}
