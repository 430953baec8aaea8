package server

import (
	"context"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/store"
)

// This file exposes the API's operations to other front ends over the same resources
// (the E2B-compatible gateway), with the same validation, authorization and
// intent-recording as the HTTP handlers.

// AuthenticateKey checks an API key of the given kind ("space" or "e2b").
func (a *API) AuthenticateKey(ctx context.Context, secret, kind string) (*Principal, error) {
	secret = strings.TrimSpace(secret)
	if secret == "" {
		return nil, fault.New(fault.Unauthorized, "missing API key")
	}
	if len(secret) > 512 {
		return nil, fault.New(fault.Unauthorized, "invalid API key")
	}
	k, err := a.st.LookupAPIKey(ctx, secret)
	if fault.Is(err, fault.NotFound) {
		return nil, fault.New(fault.Unauthorized, "invalid API key")
	}
	if err != nil {
		return nil, err
	}
	if k.Kind != kind {
		return nil, fault.New(fault.Unauthorized, "this API key is not valid here")
	}
	return &Principal{KeyID: k.ID, Tenant: k.Tenant, Admin: k.Admin}, nil
}

// Create records a new sandbox (or claims a warm-pool member) for p.
func (a *API) Create(ctx context.Context, p *Principal, req api.CreateSandboxRequest) (*store.Sandbox, *store.Operation, error) {
	sb, op, _, err := a.create(ctx, p, &req, "", "", "", nil)
	return sb, op, err
}

// Sandbox loads a sandbox p may see (404 otherwise) and records activity on it.
func (a *API) Sandbox(ctx context.Context, p *Principal, id string) (*store.Sandbox, error) {
	sb, err := a.st.GetSandbox(ctx, id)
	if err != nil {
		return nil, err
	}
	if !p.visible(sb.Tenant) || sb.PoolKey != "" {
		return nil, fault.New(fault.NotFound, "sandbox %q not found", id)
	}
	if sb.DeletedAt == nil {
		a.touch(sb.ID)
	}
	return sb, nil
}

// Verb requests a lifecycle verb (pause, resume, suspend, restore, stop, start, wake).
func (a *API) Verb(ctx context.Context, p *Principal, id, kind, reason string) (*store.Operation, error) {
	v, ok := verbs[kind]
	if !ok {
		return nil, fault.New(fault.Invalid, "unknown lifecycle verb %q", kind)
	}
	return a.requestVerb(ctx, id, p, v, reason)
}

// Delete requests deletion of a sandbox.
func (a *API) Delete(ctx context.Context, p *Principal, id string) (*store.Operation, error) {
	_, op, err := a.requestTransition(ctx, p, id, api.StateDeleted, api.OpDelete, func(sb *store.Sandbox) error {
		if sb.DeletedAt != nil || sb.DesiredState == api.StateDeleted {
			return fault.New(fault.NotFound, "sandbox %q not found", sb.ID)
		}
		return nil
	})
	return op, err
}

// Wait waits until an operation is done or ctx ends and returns its latest state.
func (a *API) Wait(ctx context.Context, opID string) (*store.Operation, error) {
	return a.waitChange(ctx, opID, func(o *store.Operation) bool { return o.DoneAt != nil })
}

// Wake gets a sandbox running (resume, restore or start) and waits for it.
func (a *API) Wake(ctx context.Context, p *Principal, sb *store.Sandbox) (*store.Sandbox, error) {
	return a.awakeCtx(ctx, p, sb, false)
}

// ProxyToAgent relays an HTTP request to a path of the sandbox's agent through its node,
// streaming both ways. The sandbox must be running.
func (a *API) ProxyToAgent(w http.ResponseWriter, r *http.Request, sb *store.Sandbox, agentPath string, query url.Values) error {
	return a.proxyToAgent(w, r, sb, agentPath, query)
}

// AgentCall sends one JSON request to the sandbox's agent and decodes the answer.
func (a *API) AgentCall(ctx context.Context, sb *store.Sandbox, method, path string, in, out any) error {
	return a.agentCall(ctx, sb, method, path, in, out)
}

// SetExpiry changes when a sandbox expires and what happens then ("delete" or
// "suspend").
func (a *API) SetExpiry(ctx context.Context, sb *store.Sandbox, at *time.Time, action string) error {
	return a.st.SetExpiry(ctx, sb.ID, at, action)
}

// StatusOf maps an error to the HTTP status the API would answer with.
func (a *API) StatusOf(err error) int { return StatusOf(err) }
