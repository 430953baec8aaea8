package service

import (
	"context"
	"slices"
	"strings"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/ids"
	"github.com/spacedev/space/internal/store"
)

// maxKeyName bounds API key names.
const maxKeyName = 128

var roles = []string{store.RoleOperator, store.RoleAdmin, store.RoleMember}

// CreateAPIKey creates an API key and returns it with its secret (shown once).
// Operators create keys in the tenant they name (required, except for operator keys,
// which live in "default"); a tenant's admin creates keys in its own tenant only (any
// other tenant answers like one that does not exist) and never operator keys.
func (s *Service) CreateAPIKey(ctx context.Context, p *Principal, req api.CreateAPIKeyRequest) (api.APIKey, error) {
	if !p.Operator() && req.Tenant != "" && req.Tenant != p.Tenant {
		return api.APIKey{}, tenantNotFound(req.Tenant) // before the role: another tenant is a missing one to everybody
	}
	if err := RequireAdmin(p); err != nil {
		return api.APIKey{}, err
	}
	if req.Kind == "" {
		req.Kind = KeySpace
	}
	if req.Kind != KeySpace && req.Kind != KeyE2B {
		return api.APIKey{}, invalid("kind must be %q or %q", KeySpace, KeyE2B)
	}
	if req.Name == "" || len(req.Name) > maxKeyName {
		return api.APIKey{}, invalid("name is required (at most %d characters)", maxKeyName)
	}
	if err := checkText("name", req.Name, false); err != nil {
		return api.APIKey{}, err
	}
	role := req.Role
	switch {
	case role == "" && req.Admin:
		role = store.RoleAdmin
	case role == "":
		role = store.RoleMember
	case req.Admin && role != store.RoleAdmin:
		return api.APIKey{}, invalid("admin and role %q contradict each other", role)
	case !slices.Contains(roles, role):
		return api.APIKey{}, invalid("role must be one of %s", strings.Join(roles, ", "))
	}
	if req.Kind == KeyE2B && role != store.RoleMember {
		return api.APIKey{}, invalid("E2B keys are member keys: the E2B-compatible API has no administration")
	}
	tenant := req.Tenant
	switch {
	case p.Operator() && role == store.RoleOperator:
		if tenant != "" && tenant != "default" {
			return api.APIKey{}, invalid("operator keys belong to no tenant of their own (their home tenant is \"default\"); omit tenant")
		}
		tenant = "default"
	case p.Operator():
		if tenant == "" {
			return api.APIKey{}, invalid("tenant is required: name the tenant the key belongs to (space tenant list)")
		}
	case role == store.RoleOperator:
		return api.APIKey{}, fault.New(fault.Forbidden, "only operators create operator keys")
	case tenant != "" && tenant != p.Tenant:
		return api.APIKey{}, tenantNotFound(tenant)
	default:
		tenant = p.Tenant
	}
	secret, prefix, err := store.NewKeySecret(req.Kind)
	if err != nil {
		return api.APIKey{}, err
	}
	k := &store.APIKey{ID: ids.APIKey(), Name: req.Name, Prefix: prefix, Kind: req.Kind, Tenant: tenant, Role: role}
	if err := s.st.CreateAPIKey(ctx, k, secret); err != nil {
		return api.APIKey{}, err
	}
	s.log.Info("api key created", "key", k.ID, "tenant", k.Tenant, "role", k.Role, "kind", k.Kind, "by", p.KeyID)
	out := k.API()
	out.Secret = secret
	return out, nil
}

// keyVisible reports whether p may see (and revoke) key k: operators every key, a
// tenant's admin its tenant's keys other than operator keys.
func keyVisible(p *Principal, k *store.APIKey) bool {
	return p.Operator() || p.Role == store.RoleAdmin && k.Tenant == p.Tenant && k.Role != store.RoleOperator
}

// APIKeys lists the keys p may see (admins: their tenant's; operators: every tenant's,
// or tenant's).
func (s *Service) APIKeys(ctx context.Context, p *Principal, tenant string) ([]api.APIKey, error) {
	scope, err := s.scope(ctx, p, tenant)
	if err != nil {
		return nil, err
	}
	if err := RequireAdmin(p); err != nil {
		return nil, err
	}
	keys, err := s.st.ListAPIKeys(ctx, scope)
	if err != nil {
		return nil, err
	}
	out := make([]api.APIKey, 0, len(keys))
	for _, k := range keys {
		if keyVisible(p, k) {
			out = append(out, k.API())
		}
	}
	return out, nil
}

// RevokeAPIKey revokes a key by its id (a prefix names no key). A key of another
// tenant (or, for a tenant's keys, an operator key) answers like one that does not
// exist; a member may revoke none.
func (s *Service) RevokeAPIKey(ctx context.Context, p *Principal, id string) (api.APIKey, error) {
	if !strings.HasPrefix(id, "key_") {
		return api.APIKey{}, invalid("revoke takes a key id (key_…, see space apikey list), not %q", id)
	}
	k, err := s.st.GetAPIKey(ctx, id)
	if err != nil {
		return api.APIKey{}, err
	}
	if !p.Operator() && (k.Tenant != p.Tenant || k.Role == store.RoleOperator) {
		return api.APIKey{}, fault.New(fault.NotFound, "api key %q not found", id)
	}
	if err := RequireAdmin(p); err != nil {
		return api.APIKey{}, err
	}
	k, err = s.st.RevokeAPIKey(ctx, id)
	s.fast.dropKeys(id) // this process does not wait for the notification
	if err != nil {
		return api.APIKey{}, err
	}
	s.log.Info("api key revoked", "key", k.ID, "tenant", k.Tenant, "by", p.KeyID)
	return k.API(), nil
}

// Nodes lists the nodes (operators only: nodes are the operator's, not a tenant's).
func (s *Service) Nodes(ctx context.Context, p *Principal) ([]api.Node, error) {
	if err := RequireOperator(p); err != nil {
		return nil, err
	}
	nodes, err := s.st.ListNodes(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]api.Node, 0, len(nodes))
	for _, n := range nodes {
		out = append(out, nodeAPI(n))
	}
	return out, nil
}

// maxPoolSize bounds a warm pool.
const maxPoolSize = 500

// SetPool creates, resizes or (size 0) removes a tenant's warm pool: admins for their
// tenant, operators for the tenant they name (default: their own). A pool's parked
// sandboxes count against its tenant's quotas.
func (s *Service) SetPool(ctx context.Context, p *Principal, req api.SetPoolRequest) (api.Pool, error) {
	tenant, err := s.scope(ctx, p, req.Tenant)
	if err != nil {
		return api.Pool{}, err
	}
	if err := RequireAdmin(p); err != nil {
		return api.Pool{}, err
	}
	if tenant == "" {
		tenant = p.Tenant
	}
	ref, err := api.ParseTemplateRef(req.Template)
	if err != nil {
		return api.Pool{}, fault.Wrap(fault.Invalid, err)
	}
	if ref.Digest != "" {
		return api.Pool{}, invalid("pools follow a tag (name:tag), not a digest")
	}
	if req.CPU == 0 {
		req.CPU = s.cfg.DefaultCPU
	}
	if req.MemoryMB == 0 {
		req.MemoryMB = s.cfg.DefaultMemoryMB
	}
	if req.Size < 0 || req.Size > maxPoolSize {
		return api.Pool{}, invalid("size must be between 0 and %d", maxPoolSize)
	}
	if req.CPU < 1 || req.CPU > s.cfg.MaxCPU || req.MemoryMB < minMemoryMB || req.MemoryMB > s.cfg.MaxMemoryMB {
		return api.Pool{}, invalid("cpu or memory_mb out of range")
	}
	if d, _, err := s.st.ResolveTenantTag(ctx, tenant, ref.Name, ref.Tag); err != nil {
		return api.Pool{}, err
	} else if d == "" && !slices.Contains(s.cfg.BuiltinTemplates, ref.Name) {
		return api.Pool{}, fault.New(fault.NotFound, "template %q not found", ref.String())
	}
	pool := store.Pool{Tenant: tenant, Template: ref.String(), CPU: req.CPU, MemoryMB: req.MemoryMB, Size: req.Size}
	err = s.st.InTx(ctx, func(tx *store.Tx) error {
		old, err := tx.PoolSize(ctx, pool)
		if err != nil {
			return err
		}
		if grow := int64(pool.Size - old); grow > 0 {
			n := sandboxNeed(store.SandboxSpec{CPU: pool.CPU, MemoryMB: pool.MemoryMB}, grow)
			delete(n, store.QuotaOperations) // members are the controller's work, not the tenant's requests
			if err := s.checkQuota(ctx, tx, tenant, n); err != nil {
				return err
			}
		}
		return tx.SetPool(ctx, pool)
	})
	if err != nil {
		return api.Pool{}, err
	}
	return api.Pool{Tenant: pool.Tenant, Template: pool.Template, CPU: pool.CPU, MemoryMB: pool.MemoryMB, Size: pool.Size}, nil
}

// Pools lists the warm pools p may see (operators: every tenant's, or tenant's).
func (s *Service) Pools(ctx context.Context, p *Principal, tenant string) ([]api.Pool, error) {
	scope, err := s.scope(ctx, p, tenant)
	if err != nil {
		return nil, err
	}
	pools, err := s.st.TenantPools(ctx, scope)
	if err != nil {
		return nil, err
	}
	out := make([]api.Pool, 0, len(pools))
	for _, pl := range pools {
		out = append(out, api.Pool{Tenant: pl.Tenant, Template: pl.Template, CPU: pl.CPU, MemoryMB: pl.MemoryMB, Size: pl.Size, Ready: pl.Ready})
	}
	return out, nil
}

// DataPlaneOrigins lists the data-plane URLs of the nodes (where clients' attach
// streams go).
func (s *Service) DataPlaneOrigins(ctx context.Context) ([]string, error) {
	nodes, err := s.st.ListNodes(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]string, 0, len(nodes))
	for _, n := range nodes {
		out = append(out, n.DataPlaneURL)
	}
	return out, nil
}

// RuntimesOnOffer lists the runtimes the alive nodes run, sorted.
func (s *Service) RuntimesOnOffer(ctx context.Context) ([]string, error) {
	nodes, err := s.st.ListNodes(ctx)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, n := range nodes {
		if n.State == store.NodeAlive && !slices.Contains(out, n.Runtime) {
			out = append(out, n.Runtime)
		}
	}
	slices.Sort(out)
	return out, nil
}
