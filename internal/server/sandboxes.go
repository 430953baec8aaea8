package server

import (
	"bytes"
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/json"
	"io"
	"net/http"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/ids"
	"github.com/spacedev/space/internal/store"
)

// Limits on user-supplied maps.
const (
	maxMapEntries = 64
	maxKeyLen     = 128
	maxValueLen   = 4096
	maxTTL        = 30 * 24 * time.Hour
)

var (
	envKeyRe  = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)
	metaKeyRe = regexp.MustCompile(`^[A-Za-z0-9._/-]+$`)
	runtimes  = []string{"gvisor", "qemu", "firecracker"}
)

func validateMap(field string, m map[string]string, keyRe *regexp.Regexp) error {
	if len(m) > maxMapEntries {
		return invalid("%s has %d entries; at most %d are allowed", field, len(m), maxMapEntries)
	}
	for k, v := range m {
		if len(k) == 0 || len(k) > maxKeyLen || !keyRe.MatchString(k) {
			return invalid("%s key %q is invalid", field, k)
		}
		if len(v) > maxValueLen || strings.ContainsRune(v, 0) {
			return invalid("%s value for %q is too long or contains NUL", field, k)
		}
	}
	return nil
}

// newSandbox validates a create request and builds the sandbox row.
func (a *API) newSandbox(ctx context.Context, p *Principal, req *api.CreateSandboxRequest) (*store.Sandbox, error) {
	if req.Template == "" {
		req.Template = a.cfg.DefaultTemplate
	}
	ref, err := api.ParseTemplateRef(req.Template)
	if err != nil {
		return nil, fault.Wrap(fault.Invalid, err)
	}
	// Resources: the request's, else the template's defaults, else the server's.
	if req.CPU == 0 || req.MemoryMB == 0 {
		cpu, mem := a.templateDefaults(ctx, ref)
		if req.CPU == 0 {
			req.CPU = cmp.Or(cpu, a.cfg.DefaultCPU)
		}
		if req.MemoryMB == 0 {
			req.MemoryMB = cmp.Or(mem, a.cfg.DefaultMemoryMB)
		}
	}
	if req.CPU < 1 || req.CPU > a.cfg.MaxCPU {
		return nil, invalid("cpu must be between 1 and %d", a.cfg.MaxCPU)
	}
	if req.MemoryMB < 64 || req.MemoryMB > a.cfg.MaxMemoryMB {
		return nil, invalid("memory_mb must be between 64 and %d", a.cfg.MaxMemoryMB)
	}
	if err := validateMap("env", req.Env, envKeyRe); err != nil {
		return nil, err
	}
	if err := validateMap("metadata", req.Metadata, metaKeyRe); err != nil {
		return nil, err
	}
	if req.Runtime != "" && !slices.Contains(runtimes, req.Runtime) {
		return nil, invalid("runtime must be one of %s", strings.Join(runtimes, ", "))
	}
	sb := &store.Sandbox{
		ID:           ids.Sandbox(),
		Tenant:       p.Tenant,
		TemplateRef:  ref.String(),
		Spec:         store.SandboxSpec{CPU: req.CPU, MemoryMB: req.MemoryMB, Env: req.Env, Runtime: req.Runtime, FreshBoot: req.FreshBoot},
		Metadata:     req.Metadata,
		DesiredState: api.StateRunning,
		State:        api.StatePending,
	}
	if req.IdleTimeout != "" {
		d, err := time.ParseDuration(req.IdleTimeout)
		if err != nil || d < 0 || d > maxTTL || (d > 0 && d < time.Second) {
			return nil, invalid("idle_timeout must be a duration between 1s and %s, or 0 to never suspend", maxTTL)
		}
		sb.IdleTimeout = d
		if d == 0 {
			sb.IdleTimeout = -1
		}
	} else {
		sb.IdleTimeout = a.cfg.IdleTimeout
	}
	if req.TTL != "" {
		d, err := time.ParseDuration(req.TTL)
		if err != nil || d < time.Second || d > maxTTL {
			return nil, invalid("ttl must be a duration between 1s and %s, like \"30m\"", maxTTL)
		}
		t := time.Now().Add(d)
		sb.ExpiresAt = &t
	}
	// Resolve the reference now so an unknown template is a 404 and creates nothing.
	if ref.Digest != "" {
		if _, err := a.st.GetRelease(ctx, ref.Digest); err != nil {
			return nil, err
		}
		sb.TemplateDigest = ref.Digest
	} else {
		d, err := a.st.ResolveTag(ctx, ref.Name, ref.Tag)
		if err != nil {
			return nil, err
		}
		if d == "" && !(ref.Tag == "latest" && slices.Contains(a.cfg.BuiltinTemplates, ref.Name)) {
			return nil, fault.New(fault.NotFound, "template %q not found", ref.String())
		}
		// The digest is recorded by the node when it starts the sandbox (a builtin
		// template may still have to be built).
	}
	return sb, nil
}

func (a *API) createSandbox(w http.ResponseWriter, r *http.Request) error {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBodyBytes))
	if err != nil {
		return jsonError(err)
	}
	r.Body = io.NopCloser(bytes.NewReader(body))
	var req api.CreateSandboxRequest
	if err := decodeJSON(w, r, &req); err != nil {
		return err
	}
	p := principalFrom(r.Context())
	idemKey := r.Header.Get("Idempotency-Key")
	var bodyHash []byte
	if idemKey != "" {
		if len(idemKey) > 255 {
			return invalid("Idempotency-Key is longer than 255 characters")
		}
		h := sha256.Sum256(body)
		bodyHash = h[:]
		prev, err := a.st.LookupIdempotency(r.Context(), p.Tenant, idemKey, r.Method, r.URL.Path, bodyHash)
		if err != nil {
			return err
		}
		if prev != nil {
			w.Header().Set("Content-Type", "application/json")
			w.Header().Set("Idempotent-Replayed", "true")
			w.WriteHeader(prev.Status)
			_, _ = w.Write(prev.Body)
			return nil
		}
	}
	sb, op, resp, err := a.create(r.Context(), p, &req, idemKey, r.Method, r.URL.Path, bodyHash)
	if err != nil {
		if idemKey != "" && fault.Is(err, fault.Conflict) {
			// A concurrent request with the same key won: answer with its response.
			if prev, err2 := a.st.LookupIdempotency(r.Context(), p.Tenant, idemKey, r.Method, r.URL.Path, bodyHash); err2 == nil && prev != nil {
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(prev.Status)
				_, _ = w.Write(prev.Body)
				return nil
			}
		}
		return err
	}
	a.log.Info("sandbox requested", "sandbox", sb.ID, "template", sb.TemplateRef, "op", op.ID)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Location", "/v1/sandboxes/"+sb.ID)
	w.WriteHeader(http.StatusAccepted)
	_, _ = w.Write(resp)
	return nil
}

func (a *API) getSandbox(w http.ResponseWriter, r *http.Request) error {
	sb, err := a.sandboxFor(r, r.PathValue("id"))
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, sb.API())
	return nil
}

// parseMetadataFilter accepts metadata=key=value (repeatable) or metadata=k1=v1&k2=v2
// URL-encoded in one parameter (the E2B form).
func parseMetadataFilter(vals []string) (map[string]string, error) {
	out := map[string]string{}
	for _, v := range vals {
		for _, pair := range strings.Split(v, "&") {
			if pair == "" {
				continue
			}
			k, val, ok := strings.Cut(pair, "=")
			if !ok || k == "" {
				return nil, invalid("metadata filter %q must look like key=value", pair)
			}
			out[k] = val
		}
	}
	return out, nil
}

func (a *API) listSandboxes(w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	f := store.SandboxFilter{Limit: 1000}
	if p := principalFrom(r.Context()); !p.Admin {
		f.Tenant = p.Tenant
	}
	for _, s := range q["state"] {
		for _, st := range strings.Split(s, ",") {
			if st == api.StateDeleted {
				f.IncludeDeleted = true
			}
			f.States = append(f.States, st)
		}
	}
	md, err := parseMetadataFilter(q["metadata"])
	if err != nil {
		return err
	}
	f.Metadata = md
	if l := q.Get("limit"); l != "" {
		n, err := strconv.Atoi(l)
		if err != nil || n < 1 || n > 1000 {
			return invalid("limit must be between 1 and 1000")
		}
		f.Limit = n
	}
	list, err := a.st.ListSandboxes(r.Context(), f)
	if err != nil {
		return err
	}
	out := api.SandboxList{Sandboxes: make([]api.Sandbox, 0, len(list))}
	for _, sb := range list {
		out.Sandboxes = append(out.Sandboxes, sb.API())
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}

// requestTransition records intent for a lifecycle verb and returns its operation.
func (a *API) requestTransition(ctx context.Context, p *Principal, id, desired, kind string, check func(sb *store.Sandbox) error) (*store.Sandbox, *store.Operation, error) {
	var sb *store.Sandbox
	op := &store.Operation{ID: ids.Operation(), Kind: kind}
	err := a.st.InTx(ctx, func(tx *store.Tx) error {
		var err error
		sb, err = tx.GetSandboxForUpdate(ctx, id)
		if err != nil {
			return err
		}
		if !p.visible(sb.Tenant) || sb.PoolKey != "" {
			return fault.New(fault.NotFound, "sandbox %q not found", id)
		}
		if err := check(sb); err != nil {
			return err
		}
		return tx.SetDesiredState(ctx, sb, desired, op)
	})
	return sb, op, err
}

func (a *API) deleteSandbox(w http.ResponseWriter, r *http.Request) error {
	id := r.PathValue("id")
	sb, op, err := a.requestTransition(r.Context(), principalFrom(r.Context()), id, api.StateDeleted, api.OpDelete, func(sb *store.Sandbox) error {
		if sb.DeletedAt != nil {
			return fault.New(fault.NotFound, "sandbox %q not found", sb.ID)
		}
		return nil
	})
	if err != nil {
		return err
	}
	a.log.Info("sandbox delete requested", "sandbox", sb.ID, "op", op.ID)
	writeJSON(w, http.StatusAccepted, op.API())
	return nil
}

func (a *API) listSandboxOperations(w http.ResponseWriter, r *http.Request) error {
	sb, err := a.sandboxFor(r, r.PathValue("id"))
	if err != nil {
		return err
	}
	ops, err := a.st.SandboxOperations(r.Context(), sb.ID, 100)
	if err != nil {
		return err
	}
	out := make([]*api.Operation, 0, len(ops))
	for _, o := range ops {
		out = append(out, o.API())
	}
	writeJSON(w, http.StatusOK, map[string]any{"operations": out})
	return nil
}

func (a *API) revokeTokens(w http.ResponseWriter, r *http.Request) error {
	sb, err := a.sandboxFor(r, r.PathValue("id"))
	if err != nil {
		return err
	}
	epoch, err := a.st.BumpTokenEpoch(r.Context(), sb.ID)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, map[string]any{"sandbox_id": sb.ID, "token_epoch": epoch})
	return nil
}

// poolFor returns the warm pool a new sandbox could be claimed from (its key and the
// digest its members must have), or "" when the template's tag does not resolve yet.
func (a *API) poolFor(ctx context.Context, sb *store.Sandbox) (string, string) {
	ref, err := api.ParseTemplateRef(sb.TemplateRef)
	if err != nil || ref.Digest != "" || sb.Spec.Runtime != "" || sb.Spec.FreshBoot {
		return "", ""
	}
	d, err := a.st.ResolveTag(ctx, ref.Name, ref.Tag)
	if err != nil || d == "" {
		return "", ""
	}
	return store.PoolKey(ref.String(), sb.Spec.CPU, sb.Spec.MemoryMB), d
}

// create validates a create request and records it (claiming a warm-pool member when
// one fits), saving the response under idemKey when given.
func (a *API) create(ctx context.Context, p *Principal, req *api.CreateSandboxRequest, idemKey, method, path string, bodyHash []byte) (*store.Sandbox, *store.Operation, []byte, error) {
	sb, err := a.newSandbox(ctx, p, req)
	if err != nil {
		return nil, nil, nil, err
	}
	poolKey, poolDigest := a.poolFor(ctx, sb)
	op := &store.Operation{ID: ids.Operation(), Kind: api.OpCreate, Tenant: sb.Tenant}
	var resp []byte
	err = a.st.InTx(ctx, func(tx *store.Tx) error {
		var claimed *store.Sandbox
		if poolKey != "" {
			op.Message = "resuming a sandbox from the warm pool"
			c, err := tx.ClaimPoolMember(ctx, poolKey, poolDigest, sb, op)
			if err != nil {
				return err
			}
			claimed = c
		}
		if claimed != nil {
			sb = claimed
		} else {
			op.Message = "waiting for a node"
			if err := tx.CreateSandbox(ctx, sb, op); err != nil {
				return err
			}
		}
		out := sb.API()
		out.Operation = op.API()
		var err error
		if resp, err = json.Marshal(out); err != nil {
			return err
		}
		if idemKey != "" {
			return tx.SaveIdempotency(ctx, p.Tenant, idemKey, method, path, bodyHash, http.StatusAccepted, resp)
		}
		return nil
	})
	if err != nil {
		return nil, nil, nil, err
	}
	return sb, op, resp, nil
}

// templateDefaults returns the cpu and memory a template's release asks for (0 if none).
func (a *API) templateDefaults(ctx context.Context, ref api.TemplateRef) (int, int) {
	digest := ref.Digest
	if digest == "" {
		d, err := a.st.ResolveTag(ctx, ref.Name, ref.Tag)
		if err != nil || d == "" {
			return 0, 0
		}
		digest = d
	}
	rel, err := a.st.GetRelease(ctx, digest)
	if err != nil {
		return 0, 0
	}
	var cfg struct {
		CPU      int `json:"cpu"`
		MemoryMB int `json:"memory_mb"`
	}
	_ = json.Unmarshal(rel.Config, &cfg)
	return cfg.CPU, cfg.MemoryMB
}
