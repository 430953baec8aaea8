// Package server owns space's control-plane HTTP API (the api role): routes, request
// decoding and response encoding, API-key authentication, HTTP metrics and the OpenAPI
// document. Every domain rule (validation, lifecycle, authorization, idempotency) is in
// internal/service; the HTTP conventions (error→status, JSON, SSE) in internal/rest.
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
	"github.com/spacedev/space/internal/rest"
	"github.com/spacedev/space/internal/service"
)

// Config configures the control-plane API.
type Config struct {
	Service  *service.Service
	Logger   *slog.Logger
	Registry *prometheus.Registry
	// BenchFile is where `space bench` saves its last results on this host (served at
	// GET /v1/bench for the web console); empty serves none.
	BenchFile string
}

// API is the control-plane HTTP API.
type API struct {
	svc       *service.Service
	benchFile string
	log       *slog.Logger
	reg       *prometheus.Registry
	metrics   *apiMetrics
	portsOnce sync.Once
	ports     *http.Transport
}

// NewAPI returns the control-plane API.
func NewAPI(cfg Config) *API {
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Registry == nil {
		cfg.Registry = prometheus.NewRegistry()
	}
	a := &API{svc: cfg.Service, log: cfg.Logger, reg: cfg.Registry, benchFile: cfg.BenchFile}
	a.metrics = newAPIMetrics(cfg.Registry, cfg.Service.Store())
	return a
}

// Handler returns the API's routes.
func (a *API) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", a.healthz)
	mux.HandleFunc("GET /v1/openapi.json", serveOpenAPI)

	authed := func(pattern string, h rest.HandlerFunc) {
		mux.Handle(pattern, a.withKey(h))
	}
	// On the API's address metrics need an operator key; space serve --metrics-listen
	// serves them without one on an address of their own (MetricsHandler).
	authed("GET /metrics", a.metricsForOperators)
	authed("POST /v1/sandboxes", a.createSandbox)
	authed("GET /v1/sandboxes", a.listSandboxes)
	authed("GET /v1/sandboxes/{id}", a.getSandbox)
	authed("DELETE /v1/sandboxes/{id}", a.deleteSandbox)
	authed("GET /v1/sandboxes/{id}/operations", a.listSandboxOperations)
	authed("POST /v1/sandboxes/{id}/sessions", a.createSession)
	authed("POST /v1/sandboxes/{id}/exec", a.exec)
	authed("POST /v1/sandboxes/{id}/pause", a.lifecycle(api.OpPause))
	authed("POST /v1/sandboxes/{id}/resume", a.lifecycle(api.OpResume))
	authed("POST /v1/sandboxes/{id}/suspend", a.lifecycle(api.OpSuspend))
	authed("POST /v1/sandboxes/{id}/restore", a.lifecycle(api.OpRestore))
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
	a.registerNodes(authed)
	a.registerTenants(authed)
	a.registerTemplates(authed)
	a.registerNetwork(authed)
	a.registerPorts(authed)
	a.registerSnapshots(authed)
	a.registerConsole(mux, authed)
	mux.Handle("/v1/", a.withKey(func(w http.ResponseWriter, r *http.Request) error {
		return notFoundRoute(r)
	}))
	return a.metrics.instrument(mux)
}

// MetricsHandler serves the Prometheus metrics without authentication, for a listener
// of their own (space serve --metrics-listen) that only the scraper can reach.
func (a *API) MetricsHandler() http.Handler {
	return promhttp.HandlerFor(a.reg, promhttp.HandlerOpts{})
}

// metricsForOperators serves GET /metrics on the API's address: operators only (the
// metrics describe every tenant and the hosts).
func (a *API) metricsForOperators(w http.ResponseWriter, r *http.Request) error {
	if err := service.RequireOperator(principalFrom(r.Context())); err != nil {
		return err
	}
	a.MetricsHandler().ServeHTTP(w, r)
	return nil
}

func (a *API) healthz(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
	defer cancel()
	if err := a.svc.Ping(ctx); err != nil {
		rest.WriteJSON(w, http.StatusServiceUnavailable, map[string]string{"status": "unhealthy", "database": err.Error()})
		return
	}
	rest.WriteJSON(w, http.StatusOK, map[string]string{"status": "ok"})
}
