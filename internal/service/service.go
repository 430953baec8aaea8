// Package service is space's transport-free domain layer: sandboxes (validation,
// lifecycle verbs through internal/lifecycle, clones, idempotent creates), command
// sessions and processes, operations, templates, pools, API keys and nodes. The
// control-plane HTTP API (internal/server) and the E2B gateway (internal/e2b) both
// call it; neither encodes domain rules itself. Authorization is one check here: a
// caller (Principal) sees a resource only if it may (Service.sandbox), and a resource
// it may not see answers exactly like one that does not exist. Every resource belongs
// to one tenant; quotas per tenant are checked under a lock of the tenant's row in the
// transaction that records the request (quota.go).
package service

import (
	"context"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/store"
	"github.com/spacedev/space/internal/token"
)

// Defaults of Config, the one source for each (space serve's flags use them).
const (
	DefaultTokenTTL        = 15 * time.Minute
	DefaultMaxTokenTTL     = 24 * time.Hour
	DefaultCPU             = 1
	DefaultMemoryMB        = 512
	DefaultMaxCPU          = 8
	DefaultMaxMemoryMB     = 16384
	DefaultDiskMB          = 10240
	DefaultMaxDiskMB       = 102400
	DefaultIdleTimeout     = store.DefaultIdleTimeout
	DefaultTemplate        = "base"
	nodeTokenTTL           = time.Minute
	wakeTimeout            = 2 * time.Minute
	activityEvery          = 5 * time.Second
	maxTrackedActivity     = 100000
	operationPollFallback  = 2 * time.Second
	sandboxPollWhileWaking = 50 * time.Millisecond
)

// Config configures the service.
type Config struct {
	Store  *store.Store
	Signer *token.Signer
	Logger *slog.Logger
	// TokenTTL is the default lifetime of attachment tokens; MaxTokenTTL caps requests.
	TokenTTL    time.Duration
	MaxTokenTTL time.Duration
	// Defaults and limits for sandbox resources.
	DefaultCPU      int
	DefaultMemoryMB int
	MaxCPU          int
	MaxMemoryMB     int
	// DefaultDiskMB and MaxDiskMB bound what a sandbox may write to its disk.
	DefaultDiskMB int
	MaxDiskMB     int
	// IdleTimeout is the idle timeout of sandboxes that ask for none.
	IdleTimeout time.Duration
	// DefaultTemplate is used when a create request names none.
	DefaultTemplate string
	// BuiltinTemplates can be created on first use although no release exists yet.
	BuiltinTemplates []string
	// NodeClient is used for calls to nodes' internal endpoints.
	NodeClient *http.Client
	// DefaultQuota holds the quotas of tenants that have none set (store.Unlimited
	// for none); missing names are unlimited.
	DefaultQuota store.Quota
	// Network is the operator's network configuration (default policy, validation).
	Network NetworkConfig
}

// Service is the domain layer over the store.
type Service struct {
	cfg    Config
	log    *slog.Logger
	st     *store.Store
	ops    *opWatch
	act    activity
	events *eventHub
	rates  *rateLimits
	fast   *fastPath
	local  atomic.Pointer[LocalNode]
}

// New returns the service. Run must be running for operation waits to wake promptly
// (they fall back to polling otherwise).
func New(cfg Config) *Service {
	if cfg.TokenTTL == 0 {
		cfg.TokenTTL = DefaultTokenTTL
	}
	if cfg.MaxTokenTTL == 0 {
		cfg.MaxTokenTTL = DefaultMaxTokenTTL
	}
	if cfg.DefaultCPU == 0 {
		cfg.DefaultCPU = DefaultCPU
	}
	if cfg.DefaultMemoryMB == 0 {
		cfg.DefaultMemoryMB = DefaultMemoryMB
	}
	if cfg.MaxCPU == 0 {
		cfg.MaxCPU = DefaultMaxCPU
	}
	if cfg.MaxMemoryMB == 0 {
		cfg.MaxMemoryMB = DefaultMaxMemoryMB
	}
	if cfg.DefaultDiskMB == 0 {
		cfg.DefaultDiskMB = DefaultDiskMB
	}
	if cfg.MaxDiskMB == 0 {
		cfg.MaxDiskMB = DefaultMaxDiskMB
	}
	if cfg.IdleTimeout == 0 {
		cfg.IdleTimeout = DefaultIdleTimeout
	}
	if cfg.DefaultTemplate == "" {
		cfg.DefaultTemplate = DefaultTemplate
	}
	if cfg.NodeClient == nil {
		cfg.NodeClient = &http.Client{}
	}
	if cfg.NodeClient.Transport == nil {
		// Calls to nodes' agent proxies are many and small (exec, files, processes):
		// keep enough idle connections per node that they are reused, not redialled
		// (http.DefaultTransport keeps 2).
		t := http.DefaultTransport.(*http.Transport).Clone()
		t.MaxIdleConnsPerHost = 64
		cfg.NodeClient = &http.Client{Transport: t, Timeout: cfg.NodeClient.Timeout}
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.DefaultQuota == nil {
		cfg.DefaultQuota = DefaultQuota()
	}
	return &Service{cfg: cfg, log: cfg.Logger, st: cfg.Store, ops: newOpWatch(), act: activity{last: map[string]time.Time{}},
		events: newEventHub(cfg.Store, cfg.Logger), rates: newRateLimits(), fast: newFastPath()}
}

// Store returns the store the service works on (for read-only listings by gateways).
func (s *Service) Store() *store.Store { return s.st }

// Run listens for operation notifications until ctx ends, and for the changes of
// sandboxes, tokens and keys that invalidate the one-request exec's cache (exec.go).
func (s *Service) Run(ctx context.Context) error {
	defer s.fast.stop()
	return s.st.Listen(ctx, s.log, func(channel, payload string) {
		if channel == store.ChannelOperations {
			s.ops.notify(payload)
			return
		}
		s.fast.notify(channel, payload)
		if channel == store.ChannelKeys && payload == "" {
			go s.recheckStreams(ctx)
		}
	}, store.ChannelOperations, store.ChannelSandboxes, store.ChannelTokens, store.ChannelKeys)
}

// Ping checks the database answers.
func (s *Service) Ping(ctx context.Context) error { return s.st.Ping(ctx) }

// Principal is the authenticated caller of a request.
type Principal struct {
	KeyID string
	// Tenant is the caller's tenant (an operator's home tenant: where the sandboxes it
	// creates go).
	Tenant string
	// Role is store.RoleOperator, RoleAdmin or RoleMember.
	Role string
}

// Operator reports whether p is an operator: it sees every tenant.
func (p *Principal) Operator() bool { return p != nil && p.Role == store.RoleOperator }

// ManagesTenant reports whether p administers its tenant (operators: every tenant).
func (p *Principal) ManagesTenant() bool {
	return p != nil && (p.Role == store.RoleOperator || p.Role == store.RoleAdmin)
}

// Visible reports whether p may see a resource of tenant.
func (p *Principal) Visible(tenant string) bool {
	return p != nil && (p.Operator() || p.Tenant == tenant)
}

// Key kinds: keys for the space API and keys for the E2B-compatible API.
const (
	KeySpace = "space"
	KeyE2B   = "e2b"
)

// maxSecretLen bounds credentials before they are hashed.
const maxSecretLen = 512

// Authenticate checks an API key of the given kind (KeySpace or KeyE2B).
func (s *Service) Authenticate(ctx context.Context, secret, kind string) (*Principal, error) {
	secret = strings.TrimSpace(secret)
	if secret == "" {
		return nil, fault.New(fault.Unauthorized, "missing API key: send Authorization: Bearer <key> or X-API-Key")
	}
	if strings.HasPrefix(secret, "spt1.") {
		return nil, fault.New(fault.Unauthorized, "attachment tokens do not authorize control-plane requests")
	}
	if len(secret) > maxSecretLen {
		return nil, fault.New(fault.Unauthorized, "invalid API key")
	}
	// A key seen in the last seconds is not read again (revocations drop it at once:
	// see fastPath.key); only valid keys are cached.
	hash := string(store.HashKey(secret))
	p, seq := s.fast.key(hash, kind)
	if p != nil {
		return p, nil
	}
	k, err := s.st.LookupAPIKey(ctx, secret)
	if fault.Is(err, fault.NotFound) {
		return nil, fault.New(fault.Unauthorized, "invalid API key")
	}
	if err != nil {
		return nil, err
	}
	if k.Kind == kind {
		s.fast.rememberKey(hash, kind, Principal{KeyID: k.ID, Tenant: k.Tenant, Role: k.Role}, seq)
	}
	if k.Kind != kind {
		if kind == KeySpace {
			return nil, fault.New(fault.Unauthorized, "this API key is for the E2B-compatible API only")
		}
		return nil, fault.New(fault.Unauthorized, "this API key is not valid here")
	}
	return &Principal{KeyID: k.ID, Tenant: k.Tenant, Role: k.Role}, nil
}

// RequireAdmin fails unless p is an admin of its tenant or an operator.
func RequireAdmin(p *Principal) error {
	if !p.ManagesTenant() {
		return fault.New(fault.Forbidden, "this request needs an admin API key (of the tenant, or an operator's)")
	}
	return nil
}

// RequireOperator fails unless p is an operator.
func RequireOperator(p *Principal) error {
	if !p.Operator() {
		return fault.New(fault.Forbidden, "this request needs an operator API key")
	}
	return nil
}

// scope returns the tenant a request acts in or lists: a non-operator's own tenant
// (naming another is answered like a tenant that does not exist), or for an operator
// the tenant it names ("" = every tenant, or for templates the shared ones).
func (s *Service) scope(ctx context.Context, p *Principal, tenant string) (string, error) {
	if !p.Operator() {
		if tenant != "" && tenant != p.Tenant {
			return "", tenantNotFound(tenant)
		}
		return p.Tenant, nil
	}
	if tenant != "" {
		if _, err := s.st.GetTenant(ctx, tenant); err != nil {
			return "", err
		}
	}
	return tenant, nil
}

func tenantNotFound(name string) error { return fault.New(fault.NotFound, "tenant %q not found", name) }

// activity throttles last-activity writes to one per sandbox every few seconds.
type activity struct {
	mu   sync.Mutex
	last map[string]time.Time
}

// touch records activity on a sandbox (for idle suspend), at most every activityEvery.
func (s *Service) touch(id string) {
	s.act.mu.Lock()
	if time.Since(s.act.last[id]) < activityEvery {
		s.act.mu.Unlock()
		return
	}
	s.act.last[id] = time.Now()
	if len(s.act.last) > maxTrackedActivity {
		clear(s.act.last)
	}
	s.act.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := s.st.TouchSandboxes(ctx, []string{id}); err != nil {
		s.log.Warn("record activity", "sandbox", id, "err", err)
	}
}
