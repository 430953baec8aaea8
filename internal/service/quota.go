package service

import (
	"context"
	"fmt"
	"math"
	"regexp"
	"strings"
	"sync"
	"time"

	"golang.org/x/time/rate"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/store"
)

// Tenants and their quotas (docs/security.md, "Tenancy"; docs/operations.md).
//
// A request that may raise a tenant's usage (create, clone, a verb that makes a
// sandbox hold a node's memory again, a template build, a larger pool) locks the
// tenant's row in the transaction that records it, counts what the tenant uses, and is
// refused (fault.QuotaExceeded, 403) before anything is stored when the request would
// take the tenant over a limit. Two requests of one tenant therefore never both pass
// on the same headroom. Requests that only lower usage (delete) are never refused.
//
// The request rate is a token bucket per tenant and API process (golang.org/x/time/
// rate): a fleet of N api replicas admits up to N times the rate. Operators' keys are
// not rate limited.

// Default quotas (space serve's --quota-* flags default to these).
const (
	DefaultQuotaRunning    = 100
	DefaultQuotaVCPUs      = 256
	DefaultQuotaMemoryMB   = 512 * 1024
	DefaultQuotaDiskMB     = 1024 * 1024
	DefaultQuotaOperations = 200
	DefaultQuotaRate       = 100
	DefaultQuotaBurst      = 200
)

// DefaultQuota returns the default quotas.
func DefaultQuota() store.Quota {
	return store.Quota{
		store.QuotaRunning: DefaultQuotaRunning, store.QuotaVCPUs: DefaultQuotaVCPUs,
		store.QuotaMemoryMB: DefaultQuotaMemoryMB, store.QuotaDiskMB: DefaultQuotaDiskMB,
		store.QuotaOperations: DefaultQuotaOperations, store.QuotaRate: DefaultQuotaRate,
		store.QuotaBurst: DefaultQuotaBurst,
	}
}

// rateRefresh is how long a tenant's rate limit is used before it is read again (so
// that set-quota takes effect within it on every replica).
const rateRefresh = 5 * time.Second

var tenantNameRe = regexp.MustCompile(`^[a-z][a-z0-9-]{0,62}$`)

// ValidTenantName checks a tenant name.
func ValidTenantName(name string) error {
	if !tenantNameRe.MatchString(name) {
		return invalid("tenant name %q is invalid: use 1 to 63 lowercase letters, digits and '-', starting with a letter", name)
	}
	return nil
}

// limits returns a tenant's effective quotas: its own, else the server's defaults.
func (s *Service) limits(t *store.Tenant) store.Quota {
	out := store.Quota{}
	for _, q := range store.QuotaNames {
		v, ok := t.Quota[q]
		if !ok {
			if v, ok = s.cfg.DefaultQuota[q]; !ok {
				v = store.Unlimited
			}
		}
		out[q] = v
	}
	return out
}

// need is what a request adds to a tenant's usage.
type need store.Usage

// sandboxNeed is what one more sandbox of spec that holds memory adds.
func sandboxNeed(spec store.SandboxSpec, n int64) need {
	disk := int64(store.DefaultDiskEstimateMB)
	if spec.DiskMB > 0 {
		disk = int64(spec.DiskMB)
	}
	return need{store.QuotaRunning: n, store.QuotaVCPUs: n * int64(spec.CPU), store.QuotaMemoryMB: n * int64(spec.MemoryMB),
		store.QuotaDiskMB: n * disk, store.QuotaOperations: n}
}

// checkQuota locks the tenant and refuses the request when what it needs would take
// the tenant over one of its limits. It must run inside the transaction that then
// records the request.
func (s *Service) checkQuota(ctx context.Context, tx *store.Tx, tenant string, n need) error {
	t, err := tx.LockTenant(ctx, tenant)
	if err != nil {
		return err
	}
	lim := s.limits(t)
	used, err := tx.TenantUsage(ctx, tenant)
	if err != nil {
		return err
	}
	for _, q := range store.QuotaNames {
		add := n[q]
		if add <= 0 || lim[q] == store.Unlimited {
			continue
		}
		if used[q]+add > lim[q] {
			return quotaExceeded(tenant, q, lim[q], used[q], add)
		}
	}
	return nil
}

func quotaExceeded(tenant, name string, limit, usage, requested int64) error {
	err := fault.New(fault.QuotaExceeded, "quota exceeded: tenant %q may use %d %s, uses %d, and this request needs %d more",
		tenant, limit, quotaUnit(name), usage, requested)
	return fault.WithDetail(err, &api.LimitExceeded{Name: name, Limit: limit, Usage: usage, Requested: requested})
}

func quotaUnit(name string) string {
	switch name {
	case store.QuotaRunning:
		return "running sandboxes"
	case store.QuotaVCPUs:
		return "vCPUs"
	case store.QuotaMemoryMB:
		return "MiB of memory"
	case store.QuotaDiskMB:
		return "MiB of disk"
	case store.QuotaOperations:
		return "unfinished operations"
	}
	return name
}

// rateLimits holds a token bucket per tenant.
type rateLimits struct {
	mu      sync.Mutex
	tenants map[string]*tenantRate
}

type tenantRate struct {
	lim         *rate.Limiter
	rate, burst int64
	read        time.Time
}

func newRateLimits() *rateLimits { return &rateLimits{tenants: map[string]*tenantRate{}} }

// Allow takes one request from the caller's tenant's token bucket, refusing it
// (fault.TooManyRequests, 429) when the bucket is empty. Operators are not limited.
func (s *Service) Allow(ctx context.Context, p *Principal) error {
	if p == nil || p.Operator() {
		return nil
	}
	return s.allowTenant(ctx, p.Tenant)
}

// allowTenant takes one request from tenant's bucket.
func (s *Service) allowTenant(ctx context.Context, tenant string) error {
	s.rates.mu.Lock()
	tr := s.rates.tenants[tenant]
	stale := tr == nil || time.Since(tr.read) > rateRefresh
	s.rates.mu.Unlock()
	if stale {
		t, err := s.st.GetTenant(ctx, tenant)
		if err != nil {
			return err
		}
		lim := s.limits(t)
		s.rates.mu.Lock()
		if tr = s.rates.tenants[tenant]; tr == nil {
			tr = &tenantRate{}
			s.rates.tenants[tenant] = tr
		}
		if tr.lim == nil || tr.rate != lim[store.QuotaRate] || tr.burst != lim[store.QuotaBurst] {
			tr.rate, tr.burst = lim[store.QuotaRate], lim[store.QuotaBurst]
			r, b := rate.Limit(tr.rate), int(min(tr.burst, math.MaxInt32))
			if tr.rate == store.Unlimited {
				r = rate.Inf
			}
			if tr.burst == store.Unlimited {
				b = math.MaxInt32
			}
			if tr.lim == nil {
				tr.lim = rate.NewLimiter(r, b)
			} else {
				tr.lim.SetLimit(r)
				tr.lim.SetBurst(b)
			}
		}
		tr.read = time.Now()
		s.rates.mu.Unlock()
	}
	s.rates.mu.Lock()
	lim, r, b := tr.lim, tr.rate, tr.burst
	s.rates.mu.Unlock()
	if lim.Allow() {
		return nil
	}
	err := fault.New(fault.TooManyRequests, "request rate exceeded: tenant %q may make %d requests per second (bursts of %d); retry shortly",
		tenant, r, b)
	return fault.WithDetail(err, &api.LimitExceeded{Name: store.QuotaRate, Limit: r, Requested: 1})
}

// tenantAPI converts a tenant with its usage to its wire form.
func (s *Service) tenantAPI(t *store.Tenant, used store.Usage) api.Tenant {
	lim := s.limits(t)
	out := api.Tenant{Name: t.Name, CreatedAt: t.CreatedAt, Quota: make([]api.QuotaUsage, 0, len(store.QuotaNames))}
	for _, q := range store.QuotaNames {
		_, own := t.Quota[q]
		out.Quota = append(out.Quota, api.QuotaUsage{Name: q, Limit: lim[q], Default: !own, Usage: used[q]})
	}
	return out
}

// CreateTenant creates a tenant (operators only).
func (s *Service) CreateTenant(ctx context.Context, p *Principal, req api.CreateTenantRequest) (api.Tenant, error) {
	if err := RequireOperator(p); err != nil {
		return api.Tenant{}, err
	}
	if err := ValidTenantName(req.Name); err != nil {
		return api.Tenant{}, err
	}
	t, err := s.st.CreateTenant(ctx, req.Name)
	if err != nil {
		return api.Tenant{}, err
	}
	s.log.Info("tenant created", "tenant", t.Name, "by", p.KeyID)
	return s.tenantAPI(t, store.Usage{}), nil
}

// Tenants lists the tenants with their usage (operators only).
func (s *Service) Tenants(ctx context.Context, p *Principal) ([]api.Tenant, error) {
	if err := RequireOperator(p); err != nil {
		return nil, err
	}
	list, err := s.st.ListTenants(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]api.Tenant, 0, len(list))
	for _, t := range list {
		used, err := s.st.TenantUsage(ctx, t.Name)
		if err != nil {
			return nil, err
		}
		out = append(out, s.tenantAPI(t, used))
	}
	return out, nil
}

// Tenant describes a tenant, its quotas and usage: operators any, others their own.
func (s *Service) Tenant(ctx context.Context, p *Principal, name string) (api.Tenant, error) {
	if !p.Visible(name) {
		return api.Tenant{}, tenantNotFound(name)
	}
	t, err := s.st.GetTenant(ctx, name)
	if err != nil {
		return api.Tenant{}, err
	}
	used, err := s.st.TenantUsage(ctx, name)
	if err != nil {
		return api.Tenant{}, err
	}
	return s.tenantAPI(t, used), nil
}

// SetQuota sets or resets a tenant's quotas (operators only).
func (s *Service) SetQuota(ctx context.Context, p *Principal, name string, req api.SetQuotaRequest) (api.Tenant, error) {
	if !p.Visible(name) {
		return api.Tenant{}, tenantNotFound(name) // another tenant is a missing one, whatever the role
	}
	if err := RequireOperator(p); err != nil {
		return api.Tenant{}, err
	}
	set := store.Quota{}
	for q, v := range map[string]*int64{
		store.QuotaRunning: req.RunningSandboxes, store.QuotaVCPUs: req.VCPUs, store.QuotaMemoryMB: req.MemoryMB,
		store.QuotaDiskMB: req.DiskMB, store.QuotaOperations: req.Operations, store.QuotaRate: req.RequestRate,
		store.QuotaBurst: req.RequestBurst,
	} {
		if v == nil {
			continue
		}
		if *v < store.Unlimited {
			return api.Tenant{}, invalid("%s must be -1 (unlimited) or at least 0, not %d", q, *v)
		}
		if (q == store.QuotaRate || q == store.QuotaBurst) && *v == 0 {
			return api.Tenant{}, invalid("%s must be at least 1 (or -1, unlimited)", q)
		}
		set[q] = *v
	}
	for _, q := range req.Reset {
		if _, dup := set[q]; dup {
			return api.Tenant{}, invalid("quota %q is both set and reset", q)
		}
	}
	if len(set) == 0 && len(req.Reset) == 0 {
		return api.Tenant{}, invalid("name at least one quota to set or reset (%s)", strings.Join(store.QuotaNames, ", "))
	}
	t, err := s.st.SetTenantQuota(ctx, name, set, req.Reset)
	if err != nil {
		return api.Tenant{}, err
	}
	s.rates.mu.Lock()
	delete(s.rates.tenants, name) // this replica applies the new rate at once
	s.rates.mu.Unlock()
	used, err := s.st.TenantUsage(ctx, name)
	if err != nil {
		return api.Tenant{}, err
	}
	s.log.Info("tenant quota set", "tenant", name, "set", fmt.Sprint(set), "reset", req.Reset, "by", p.KeyID)
	return s.tenantAPI(t, used), nil
}

// DeleteTenant removes a tenant with its keys and pools (operators only; not while it
// has sandboxes or templates; never "default").
func (s *Service) DeleteTenant(ctx context.Context, p *Principal, name string) (api.Tenant, error) {
	if !p.Visible(name) {
		return api.Tenant{}, tenantNotFound(name) // another tenant is a missing one, whatever the role
	}
	if err := RequireOperator(p); err != nil {
		return api.Tenant{}, err
	}
	if name == "default" {
		return api.Tenant{}, fault.New(fault.Conflict, "tenant \"default\" cannot be removed (operator keys live in it)")
	}
	t, err := s.st.DeleteTenant(ctx, name)
	s.fast.dropKeys("") // this process does not wait for the notification
	if err != nil {
		return api.Tenant{}, err
	}
	s.log.Info("tenant removed", "tenant", name, "by", p.KeyID)
	return s.tenantAPI(t, store.Usage{}), nil
}
