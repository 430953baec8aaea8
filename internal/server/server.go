// Package server owns space's HTTP surfaces: the public control-plane API (api role),
// the data plane each node serves for its sandboxes (attach streams, stdin, signals and
// the internal agent proxy), API-key and attachment-token authentication, the SSE
// writer, Prometheus metrics and the single mapping from error kinds to HTTP status.
package server

import (
	"context"
	"log/slog"
	"net/http"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/store"
	"github.com/spacedev/space/internal/token"
)

// Config configures the control-plane API.
type Config struct {
	Store    *store.Store
	Signer   *token.Signer
	Logger   *slog.Logger
	Registry *prometheus.Registry
	// TokenTTL is the default lifetime of attachment tokens; MaxTokenTTL caps requests.
	TokenTTL    time.Duration
	MaxTokenTTL time.Duration
	// Defaults and limits for sandbox resources.
	DefaultCPU      int
	DefaultMemoryMB int
	MaxCPU          int
	MaxMemoryMB     int
	// IdleTimeout is the idle timeout of sandboxes that ask for none.
	IdleTimeout time.Duration
	// DefaultTemplate is used when a create request names none.
	DefaultTemplate string
	// BuiltinTemplates can be created on first use although no release exists yet.
	BuiltinTemplates []string
	// NodeClient is used for calls to nodes' internal endpoints.
	NodeClient *http.Client
	// BenchFile is where `space bench` saves its last results on this host (served at
	// GET /v1/bench for the web console); empty serves none.
	BenchFile string
}

// API is the control-plane HTTP API.
type API struct {
	cfg     Config
	log     *slog.Logger
	st      *store.Store
	ops     *opWatch
	metrics *apiMetrics
	act     activity
}

// NewAPI returns the control-plane API. Run must be running for operation waits to
// wake promptly (they fall back to polling otherwise).
func NewAPI(cfg Config) *API {
	if cfg.TokenTTL == 0 {
		cfg.TokenTTL = 15 * time.Minute
	}
	if cfg.MaxTokenTTL == 0 {
		cfg.MaxTokenTTL = 24 * time.Hour
	}
	if cfg.NodeClient == nil {
		cfg.NodeClient = &http.Client{}
	}
	if cfg.IdleTimeout == 0 {
		cfg.IdleTimeout = store.DefaultIdleTimeout
	}
	if cfg.DefaultTemplate == "" {
		cfg.DefaultTemplate = "base"
	}
	a := &API{cfg: cfg, log: cfg.Logger, st: cfg.Store, ops: newOpWatch(), act: activity{last: map[string]time.Time{}}}
	a.metrics = newAPIMetrics(cfg.Registry, cfg.Store)
	return a
}

// Run listens for operation notifications until ctx ends.
func (a *API) Run(ctx context.Context) error {
	return a.st.Listen(ctx, a.log, func(ch, payload string) {
		a.ops.notify(payload)
	}, store.ChannelOperations)
}

// Handler returns the API's routes.
func (a *API) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", a.healthz)
	mux.Handle("GET /metrics", promhttp.HandlerFor(a.cfg.Registry, promhttp.HandlerOpts{}))
	mux.HandleFunc("GET /v1/openapi.json", serveOpenAPI)

	authed := func(pattern string, h handlerFunc) {
		mux.Handle(pattern, a.withKey(h))
	}
	authed("POST /v1/sandboxes", a.createSandbox)
	authed("GET /v1/sandboxes", a.listSandboxes)
	authed("GET /v1/sandboxes/{id}", a.getSandbox)
	authed("DELETE /v1/sandboxes/{id}", a.deleteSandbox)
	authed("GET /v1/sandboxes/{id}/operations", a.listSandboxOperations)
	authed("POST /v1/sandboxes/{id}/sessions", a.createSession)
	authed("POST /v1/sandboxes/{id}/pause", a.lifecycle(api.OpPause))
	authed("POST /v1/sandboxes/{id}/resume", a.lifecycle(api.OpResume))
	authed("POST /v1/sandboxes/{id}/suspend", a.lifecycle(api.OpSuspend))
	authed("POST /v1/sandboxes/{id}/restore", a.lifecycle("restore"))
	authed("POST /v1/sandboxes/{id}/stop", a.lifecycle(api.OpStop))
	authed("POST /v1/sandboxes/{id}/start", a.lifecycle(api.OpStart))
	authed("POST /v1/sandboxes/{id}/wake", a.lifecycle(api.OpWake))
	authed("POST /v1/sandboxes/{id}/clone", a.clone)
	authed("GET /v1/pools", a.listPools)
	authed("PUT /v1/pools", a.setPool)
	authed("POST /v1/sandboxes/{id}/revoke-tokens", a.revokeTokens)
	authed("GET /v1/sandboxes/{id}/processes", a.listProcesses)
	authed("GET /v1/sandboxes/{id}/processes/{pid}", a.getProcess)
	a.registerFiles(authed)
	authed("GET /v1/operations/{id}", a.getOperation)
	authed("GET /v1/operations/{id}/wait", a.waitOperation)
	authed("GET /v1/operations/{id}/events", a.operationEvents)
	authed("GET /v1/operations/{id}/log", a.operationLog)
	authed("POST /v1/apikeys", a.createAPIKey)
	authed("GET /v1/apikeys", a.listAPIKeys)
	authed("DELETE /v1/apikeys/{id}", a.revokeAPIKey)
	authed("GET /v1/nodes", a.listNodes)
	a.registerTemplates(authed)
	a.registerConsole(mux, authed)
	mux.Handle("/v1/", a.withKey(func(w http.ResponseWriter, r *http.Request) error {
		return notFoundRoute(r)
	}))
	return a.metrics.instrument(mux)
}

func (a *API) healthz(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
	defer cancel()
	if err := a.st.Ping(ctx); err != nil {
		writeJSON(w, http.StatusServiceUnavailable, map[string]string{"status": "unhealthy", "database": err.Error()})
		return
	}
	writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
}

// opWatch wakes operation waiters when an operation changes.
type opWatch struct {
	mu      sync.Mutex
	waiters map[string][]chan struct{}
}

func newOpWatch() *opWatch { return &opWatch{waiters: map[string][]chan struct{}{}} }

// wait returns a channel closed at the next change of operation id.
func (o *opWatch) wait(id string) (<-chan struct{}, func()) {
	ch := make(chan struct{})
	o.mu.Lock()
	o.waiters[id] = append(o.waiters[id], ch)
	o.mu.Unlock()
	return ch, func() {
		o.mu.Lock()
		defer o.mu.Unlock()
		list := o.waiters[id]
		for i, c := range list {
			if c == ch {
				o.waiters[id] = append(list[:i], list[i+1:]...)
				break
			}
		}
		if len(o.waiters[id]) == 0 {
			delete(o.waiters, id)
		}
	}
}

// notify wakes the waiters of id; an empty id (after a reconnect) wakes everyone.
func (o *opWatch) notify(id string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	wake := func(k string) {
		for _, c := range o.waiters[k] {
			close(c)
		}
		delete(o.waiters, k)
	}
	if id == "" {
		for k := range o.waiters {
			wake(k)
		}
		return
	}
	wake(id)
}

func opFromStore(o *store.Operation) *api.Operation { return o.API() }
