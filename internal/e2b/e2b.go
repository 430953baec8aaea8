// Package e2b owns space's E2B-compatible gateway: the listener (--e2b-listen) that
// unmodified E2B SDKs talk to. It serves E2B's control-plane REST API (v1 and v2
// sandbox endpoints) on top of space's service layer (internal/service), and routes
// envd traffic — requests carrying E2b-Sandbox-Id / E2b-Sandbox-Port headers, or for
// a <port>-<sandbox id>.<domain> host — to the sandbox's agent, which implements envd
// (internal/guest/agent). The wire details it must match are in
// ../shared/research/e2b-protocol.md; the user-facing guide is docs/e2b.md.
//
// Mapping: an E2B pause is a space suspend (a stop without its memory), resume/connect
// is a wake, fork is a clone, an E2B snapshot is a named snapshot; E2B's timeout
// is the sandbox's expiry (deleted at endAt, or suspended when created with
// autoPause). The envd access token of a sandbox is an HMAC of its tenant, id and
// access epoch, so every replica computes the same one; revoke-tokens and explicit
// pause and resume bump the epoch, which replaces the token (connect returns the
// current one), while automatic suspends and autoResume keep it.
//
// Authentication comes first on the sandbox plane: nothing wakes a sandbox, extends
// its timeout or tells whether it exists before the request's access token (or signed
// URL) is verified, and every request that fails that check gets the same answer.
package e2b

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/guest/agentclient"
	"github.com/spacedev/space/internal/rest"
	"github.com/spacedev/space/internal/service"
	"github.com/spacedev/space/internal/store"
)

// Platform is what the gateway needs from space's service layer (implemented by
// *service.Service).
type Platform interface {
	Authenticate(ctx context.Context, secret, kind string) (*service.Principal, error)
	Allow(ctx context.Context, p *service.Principal) error
	Create(ctx context.Context, p *service.Principal, req api.CreateSandboxRequest, idem *service.Idempotency) (*service.Created, error)
	Sandbox(ctx context.Context, p *service.Principal, id string) (*store.Sandbox, error)
	RequestVerb(ctx context.Context, p *service.Principal, id, kind, reason string) (*store.Operation, error)
	RotateAccess(ctx context.Context, p *service.Principal, id string) (*store.Sandbox, error)
	Templates(ctx context.Context, p *service.Principal, tenant string) ([]api.Template, error)
	Delete(ctx context.Context, p *service.Principal, id string) (*store.Operation, error)
	WaitDone(ctx context.Context, p *service.Principal, opID string) (*store.Operation, error)
	Awake(ctx context.Context, p *service.Principal, sb *store.Sandbox, noWake bool) (*store.Sandbox, error)
	Running(ctx context.Context, p *service.Principal, id string, noWake bool) (*service.Target, error)
	Agent(ctx context.Context, t *service.Target) (*agentclient.Client, error)
	// Reach is Running and Agent in one, without a query when a recent target is known.
	Reach(ctx context.Context, p *service.Principal, id string, noWake bool) (*agentclient.Client, error)
	SetExpiry(ctx context.Context, p *service.Principal, id string, at *time.Time, action string) error
	UpdateNetwork(ctx context.Context, p *service.Principal, id string, body []byte, merge bool) (api.NetworkState, error)
	// Fork, snapshots and metrics (snapshots.go, metrics.go).
	Clone(ctx context.Context, p *service.Principal, id string, req api.CloneRequest) (api.CloneResponse, error)
	CreateSnapshot(ctx context.Context, p *service.Principal, sandboxID string, req api.CreateSnapshotRequest) (*store.Snapshot, *store.Operation, error)
	Snapshot(ctx context.Context, p *service.Principal, ref string) (*store.Snapshot, error)
	Snapshots(ctx context.Context, p *service.Principal, f service.SnapshotFilter) ([]*store.Snapshot, error)
	DeleteSnapshot(ctx context.Context, p *service.Principal, ref string) (*store.Snapshot, error)
	Metrics(ctx context.Context, p *service.Principal, id string, start, end time.Time) (*store.Sandbox, []api.MetricSample, error)
}

var (
	_ Platform = (*service.Service)(nil)
	_ Store    = (*store.Store)(nil)
)

// Store is what the gateway reads directly: sandbox listings, a sandbox to check an
// access token against, and its token key.
type Store interface {
	ListSandboxes(ctx context.Context, f store.SandboxFilter) ([]*store.Sandbox, error)
	GetSandbox(ctx context.Context, id string) (*store.Sandbox, error)
	SigningKey(ctx context.Context, id string) ([]byte, error)
}

// Config configures the gateway.
type Config struct {
	API    Platform
	Store  Store
	Logger *slog.Logger
	// Domain is the sandbox domain returned to SDKs (they build <port>-<id>.<domain>
	// host names from it). Empty derives it from the request's Host: "api.<domain>"
	// gives <domain>, localhost or an IP address itself.
	Domain string
	// MaxTimeout caps sandbox timeouts (default 24 h).
	MaxTimeout time.Duration
	// MaxSignedURLTTL caps how far in the future a signed /files URL may expire
	// (default DefaultMaxSignedURLTTL); URLs without an expiration are refused.
	MaxSignedURLTTL time.Duration
	// BuiltinTemplates are listed although they may not be built yet (base).
	BuiltinTemplates []string
	// Network says sandbox networking is on: E2B's egress options (and its default of
	// open egress) become network policies. Off, sandboxes have no network and
	// egress options are refused.
	Network bool
}

// Gateway is the E2B-compatible HTTP front end.
type Gateway struct {
	cfg      Config
	api      Platform
	st       Store
	log      *slog.Logger
	tokenKey []byte
	handler  http.Handler
	// ports carries traffic to sandbox ports other than envd's (ports.go).
	ports *http.Transport
}

// tokenKeyID is the signing key the envd access tokens derive from.
const tokenKeyID = "e2b-envd-v1"

// DefaultMaxSignedURLTTL is the default of Config.MaxSignedURLTTL.
const DefaultMaxSignedURLTTL = time.Hour

// New returns the gateway; it reads (or creates) its token key in the store.
func New(ctx context.Context, cfg Config) (*Gateway, error) {
	if cfg.API == nil || cfg.Store == nil {
		return nil, errors.New("e2b: Config.API and Config.Store are required")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.MaxTimeout <= 0 {
		cfg.MaxTimeout = 24 * time.Hour
	}
	if cfg.MaxSignedURLTTL <= 0 {
		cfg.MaxSignedURLTTL = DefaultMaxSignedURLTTL
	}
	key, err := cfg.Store.SigningKey(ctx, tokenKeyID)
	if err != nil {
		return nil, fmt.Errorf("e2b: token key: %w", err)
	}
	g := &Gateway{cfg: cfg, api: cfg.API, st: cfg.Store, log: cfg.Logger, tokenKey: key}
	g.handler = g.routes()
	g.ports = g.newPortTransport()
	return g, nil
}

// ServeHTTP sends sandbox (envd) traffic to the sandbox plane and everything else to
// the control plane.
func (g *Gateway) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	id, port, isSandbox, err := route(r)
	switch {
	case err != nil:
		writeError(w, http.StatusBadRequest, err.Error())
	case isSandbox:
		g.serveSandbox(w, r, id, port)
	case r.URL.Path == "/files" && (r.Method == http.MethodGet || r.Method == http.MethodPost):
		g.serveUnroutedFiles(w, r) // a signed link behind a single E2B_SANDBOX_URL
	default:
		g.handler.ServeHTTP(w, r)
	}
}

// Serve serves ln until ctx ends, then drains (rest.Serve): requests and streams in
// flight get d.Grace to finish, since the E2B SDKs resume none of them.
func (g *Gateway) Serve(ctx context.Context, ln net.Listener, d rest.Drain) error {
	srv := &http.Server{
		Handler:           g,
		ReadHeaderTimeout: 10 * time.Second,
		MaxHeaderBytes:    64 << 10,
		ErrorLog:          slog.NewLogLogger(g.log.Handler(), slog.LevelDebug),
	}
	g.log.Info("E2B-compatible API serving", "listen", ln.Addr().String())
	return rest.Serve(ctx, srv, ln, d)
}

// accessToken is the envd access token of a sandbox: bound to its tenant, its id and
// its access epoch.
func (g *Gateway) accessToken(sb *store.Sandbox) string {
	return g.accessTokenOf(sb.Tenant, sb.ID, sb.AccessEpoch)
}

func (g *Gateway) accessTokenOf(tenant, id string, epoch int64) string {
	m := hmac.New(sha256.New, g.tokenKey)
	m.Write([]byte("envd-access-token/v2\x00" + tenant + "\x00" + id + "\x00" + strconv.FormatInt(epoch, 10)))
	return hex.EncodeToString(m.Sum(nil))
}
