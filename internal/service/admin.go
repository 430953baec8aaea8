package service

import (
	"context"
	"slices"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/ids"
	"github.com/spacedev/space/internal/store"
)

// maxKeyName bounds API key names.
const maxKeyName = 128

// CreateAPIKey creates an API key in p's tenant and returns it with its secret (shown
// once). Only admins may.
func (s *Service) CreateAPIKey(ctx context.Context, p *Principal, req api.CreateAPIKeyRequest) (api.APIKey, error) {
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
	secret, prefix, err := store.NewKeySecret(req.Kind)
	if err != nil {
		return api.APIKey{}, err
	}
	k := &store.APIKey{ID: ids.APIKey(), Name: req.Name, Prefix: prefix, Kind: req.Kind, Tenant: p.Tenant, Admin: req.Admin}
	if err := s.st.CreateAPIKey(ctx, k, secret); err != nil {
		return api.APIKey{}, err
	}
	out := k.API()
	out.Secret = secret
	return out, nil
}

// APIKeys lists API keys (admins only).
func (s *Service) APIKeys(ctx context.Context, p *Principal) ([]api.APIKey, error) {
	if err := RequireAdmin(p); err != nil {
		return nil, err
	}
	keys, err := s.st.ListAPIKeys(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]api.APIKey, 0, len(keys))
	for _, k := range keys {
		out = append(out, k.API())
	}
	return out, nil
}

// RevokeAPIKey revokes a key (admins only).
func (s *Service) RevokeAPIKey(ctx context.Context, p *Principal, id string) (api.APIKey, error) {
	if err := RequireAdmin(p); err != nil {
		return api.APIKey{}, err
	}
	k, err := s.st.RevokeAPIKey(ctx, id)
	if err != nil {
		return api.APIKey{}, err
	}
	return k.API(), nil
}

// Nodes lists the nodes.
func (s *Service) Nodes(ctx context.Context, _ *Principal) ([]api.Node, error) {
	nodes, err := s.st.ListNodes(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]api.Node, 0, len(nodes))
	for _, n := range nodes {
		out = append(out, api.Node{ID: n.ID, Name: n.Name, Runtime: n.Runtime, RuntimeInfo: n.RuntimeInfo,
			DataPlaneURL: n.DataPlaneURL, State: n.State, HeartbeatAt: n.HeartbeatAt, Sandboxes: n.Sandboxes})
	}
	return out, nil
}

// maxPoolSize bounds a warm pool.
const maxPoolSize = 500

// SetPool creates, resizes or (size 0) removes a warm pool (admins only).
func (s *Service) SetPool(ctx context.Context, p *Principal, req api.SetPoolRequest) (api.Pool, error) {
	if err := RequireAdmin(p); err != nil {
		return api.Pool{}, err
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
	if d, err := s.st.ResolveTag(ctx, ref.Name, ref.Tag); err != nil {
		return api.Pool{}, err
	} else if d == "" && !slices.Contains(s.cfg.BuiltinTemplates, ref.Name) {
		return api.Pool{}, fault.New(fault.NotFound, "template %q not found", ref.String())
	}
	pool := store.Pool{Template: ref.String(), CPU: req.CPU, MemoryMB: req.MemoryMB, Size: req.Size}
	if err := s.st.SetPool(ctx, pool); err != nil {
		return api.Pool{}, err
	}
	return api.Pool{Template: pool.Template, CPU: pool.CPU, MemoryMB: pool.MemoryMB, Size: pool.Size}, nil
}

// Pools lists the warm pools.
func (s *Service) Pools(ctx context.Context, _ *Principal) ([]api.Pool, error) {
	pools, err := s.st.ListPools(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]api.Pool, 0, len(pools))
	for _, pl := range pools {
		out = append(out, api.Pool{Template: pl.Template, CPU: pl.CPU, MemoryMB: pl.MemoryMB, Size: pl.Size, Ready: pl.Ready})
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
