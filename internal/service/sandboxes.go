package service

import (
	"cmp"
	"context"
	"fmt"
	"net/http"
	"regexp"
	"slices"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/crash"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/ids"
	"github.com/spacedev/space/internal/lifecycle"
	"github.com/spacedev/space/internal/store"
	"github.com/spacedev/space/internal/template"
)

// Limits on user-supplied maps and durations.
const (
	maxMapEntries = 64
	maxKeyLen     = 128
	maxValueLen   = 4096
	maxTTL        = 30 * 24 * time.Hour
	maxClones     = 50
	maxListLimit  = 1000
	minMemoryMB   = 64
	minDiskMB     = 64
)

var (
	envKeyRe  = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)
	metaKeyRe = regexp.MustCompile(`^[A-Za-z0-9._/-]+$`)
	runtimes  = []string{"gvisor", "qemu", "firecracker"}
)

func invalid(format string, args ...any) error { return fault.New(fault.Invalid, format, args...) }

func notFound(id string) error { return fault.New(fault.NotFound, "sandbox %q not found", id) }

// checkText refuses invalid UTF-8 and control characters (C0, DEL, C1; a tab only when
// tab is true) in a user-supplied string: they end up in terminals, logs and headers.
func checkText(field, v string, tab bool) error {
	if !utf8.ValidString(v) {
		return invalid("%s is not valid UTF-8", field)
	}
	for _, r := range v {
		if r == '\t' && tab {
			continue
		}
		if unicode.IsControl(r) {
			return invalid("%s contains the control character %U; control characters are not allowed (tab only in values)", field, r)
		}
	}
	return nil
}

// ValidateMap checks a user-supplied string map (env, metadata): size, key syntax, and
// values of valid UTF-8 without control characters other than tab.
func ValidateMap(field string, m map[string]string, env bool) error {
	keyRe := metaKeyRe
	if env {
		keyRe = envKeyRe
	}
	if len(m) > maxMapEntries {
		return invalid("%s has %d entries; at most %d are allowed", field, len(m), maxMapEntries)
	}
	for k, v := range m {
		if len(k) == 0 || len(k) > maxKeyLen || !keyRe.MatchString(k) {
			return invalid("%s key %q is invalid", field, k)
		}
		if len(v) > maxValueLen {
			return invalid("%s value for %q is longer than %d bytes", field, k, maxValueLen)
		}
		if err := checkText(fmt.Sprintf("%s value for %q", field, k), v, true); err != nil {
			return err
		}
	}
	return nil
}

// sandbox loads a sandbox p may see, else a not-found error indistinguishable from a
// missing id. This is the authorization check of every sandbox-scoped request.
func (s *Service) sandbox(ctx context.Context, p *Principal, id string) (*store.Sandbox, error) {
	sb, err := s.st.GetSandbox(ctx, id)
	if err != nil {
		return nil, err
	}
	if !visible(p, sb) {
		return nil, notFound(id)
	}
	return sb, nil
}

// visible reports whether p may see sb (warm-pool members are nobody's until claimed).
func visible(p *Principal, sb *store.Sandbox) bool { return p.Visible(sb.Tenant) && sb.PoolKey == "" }

// Sandbox loads a sandbox p may see (404 otherwise) and records activity on it.
func (s *Service) Sandbox(ctx context.Context, p *Principal, id string) (*store.Sandbox, error) {
	sb, err := s.sandbox(ctx, p, id)
	if err != nil {
		return nil, err
	}
	if sb.DeletedAt == nil {
		s.touch(sb.ID)
	}
	return sb, nil
}

// ListFilter selects sandboxes for List.
type ListFilter struct {
	States   []string
	Metadata map[string]string
	Limit    int
	// Tenant narrows an operator's list to one tenant (others may name only their own).
	Tenant string
}

// List lists the sandboxes p may see, newest first.
func (s *Service) List(ctx context.Context, p *Principal, f ListFilter) ([]*store.Sandbox, error) {
	tenant, err := s.scope(ctx, p, f.Tenant)
	if err != nil {
		return nil, err
	}
	sf := store.SandboxFilter{Limit: maxListLimit, States: f.States, Metadata: f.Metadata, Tenant: tenant}
	for _, st := range f.States {
		if !lifecycle.IsState(st) {
			return nil, invalid("state %q is not a sandbox state (one of %s)", st, strings.Join(lifecycle.States(), ", "))
		}
		if st == api.StateDeleted {
			sf.IncludeDeleted = true
		}
	}
	if f.Limit != 0 {
		if f.Limit < 1 || f.Limit > maxListLimit {
			return nil, invalid("limit must be between 1 and %d", maxListLimit)
		}
		sf.Limit = f.Limit
	}
	return s.st.ListSandboxes(ctx, sf)
}

// newSandbox validates a create request and builds the sandbox row.
func (s *Service) newSandbox(ctx context.Context, p *Principal, req *api.CreateSandboxRequest) (*store.Sandbox, error) {
	if req.Template == "" {
		req.Template = s.cfg.DefaultTemplate
	}
	ref, err := api.ParseTemplateRef(req.Template)
	if err != nil {
		return nil, fault.Wrap(fault.Invalid, err)
	}
	// Resources: the request's, else the template's defaults, else the server's.
	if req.CPU == 0 || req.MemoryMB == 0 || req.DiskMB == 0 {
		cfg := s.templateConfig(ctx, p.Tenant, ref)
		if req.CPU == 0 {
			req.CPU = cmp.Or(cfg.CPU, s.cfg.DefaultCPU)
		}
		if req.MemoryMB == 0 {
			req.MemoryMB = cmp.Or(cfg.MemoryMB, s.cfg.DefaultMemoryMB)
		}
		if req.DiskMB == 0 {
			req.DiskMB = cmp.Or(cfg.DiskMB, s.cfg.DefaultDiskMB)
		}
	}
	if req.DiskMB < minDiskMB || req.DiskMB > s.cfg.MaxDiskMB {
		return nil, invalid("disk_mb must be between %d and %d", minDiskMB, s.cfg.MaxDiskMB)
	}
	if req.CPU < 1 || req.CPU > s.cfg.MaxCPU {
		return nil, invalid("cpu must be between 1 and %d", s.cfg.MaxCPU)
	}
	if req.MemoryMB < minMemoryMB || req.MemoryMB > s.cfg.MaxMemoryMB {
		return nil, invalid("memory_mb must be between %d and %d", minMemoryMB, s.cfg.MaxMemoryMB)
	}
	if err := ValidateMap("env", req.Env, true); err != nil {
		return nil, err
	}
	if err := ValidateMap("metadata", req.Metadata, false); err != nil {
		return nil, err
	}
	if req.Runtime != "" {
		if !slices.Contains(runtimes, req.Runtime) {
			return nil, invalid("runtime must be one of %s", strings.Join(runtimes, ", "))
		}
		offer, err := s.RuntimesOnOffer(ctx)
		if err != nil {
			return nil, err
		}
		if !slices.Contains(offer, req.Runtime) {
			on := "none (no node is alive)"
			if len(offer) > 0 {
				on = strings.Join(offer, ", ")
			}
			return nil, fault.New(fault.Unprocessable, "runtime %q is not offered by any live node; runtimes on offer: %s", req.Runtime, on)
		}
	}
	netSpec, err := s.networkForCreate(req.Network)
	if err != nil {
		return nil, err
	}
	sb := &store.Sandbox{
		ID:          ids.Sandbox(),
		Tenant:      p.Tenant,
		TemplateRef: ref.String(),
		Spec: store.SandboxSpec{CPU: req.CPU, MemoryMB: req.MemoryMB, DiskMB: req.DiskMB, Env: req.Env, Runtime: req.Runtime,
			FreshBoot: req.FreshBoot, Network: netSpec},
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
		sb.IdleTimeout = s.cfg.IdleTimeout
	}
	if req.TTL != "" {
		exp, err := parseTTL(req.TTL)
		if err != nil {
			return nil, err
		}
		sb.ExpiresAt = exp
	}
	if req.CheckpointInterval != "" {
		d, err := time.ParseDuration(req.CheckpointInterval)
		if err != nil || d < minCheckpointInterval || d > 24*time.Hour {
			return nil, invalid("checkpoint_interval must be a duration between %s and 24h", minCheckpointInterval)
		}
		sb.Spec.CheckpointInterval = int(d / time.Second)
	}
	// Resolve the reference now so an unknown template is a 404 and creates nothing.
	// Another tenant's template answers exactly like a missing one.
	if ref.Digest != "" {
		if _, err := s.st.GetRelease(ctx, ref.Digest); err != nil {
			return nil, err
		}
		if ok, err := s.st.ReleaseVisible(ctx, p.Tenant, ref.Digest); err != nil {
			return nil, err
		} else if !ok {
			return nil, fault.New(fault.NotFound, "template release %q not found", ref.Digest)
		}
		sb.TemplateDigest = ref.Digest
	} else {
		d, owner, err := s.st.ResolveTenantTag(ctx, p.Tenant, ref.Name, ref.Tag)
		if err != nil {
			return nil, err
		}
		if d == "" && !(ref.Tag == "latest" && slices.Contains(s.cfg.BuiltinTemplates, ref.Name)) {
			return nil, fault.New(fault.NotFound, "template %q not found", ref.String())
		}
		// A shared tag's digest is recorded by the node when it starts the sandbox (a
		// builtin template may still have to be built); a tenant's tag is pinned now,
		// as nodes resolve shared tags only.
		if owner != "" {
			sb.TemplateDigest = d
		}
	}
	return sb, nil
}

// parseTTL turns a TTL ("30m") into an expiry time.
func parseTTL(ttl string) (*time.Time, error) {
	d, err := time.ParseDuration(ttl)
	if err != nil || d < time.Second || d > maxTTL {
		return nil, invalid("ttl must be a duration between 1s and %s, like \"30m\"", maxTTL)
	}
	t := time.Now().Add(d)
	return &t, nil
}

// Created is the result of Create: the answer (the sandbox with its operation), and
// unless it was replayed the sandbox and operation it recorded.
type Created struct {
	Sandbox *store.Sandbox
	Op      *store.Operation
	Answer
}

// Create validates a create request and records it (claiming a warm-pool member when
// one fits). With idem, a retry of the same request returns the first response.
func (s *Service) Create(ctx context.Context, p *Principal, req api.CreateSandboxRequest, idem *Idempotency) (*Created, error) {
	var out *Created
	a, err := s.once(ctx, p, idem, func() (*Answer, error) {
		c, err := s.create(ctx, p, &req, idem)
		if err != nil {
			return nil, err
		}
		out = c
		return &c.Answer, nil
	})
	if err != nil {
		return nil, err
	}
	if a.Replayed {
		return &Created{Answer: *a}, nil
	}
	s.log.Info("sandbox requested", "sandbox", out.Sandbox.ID, "template", out.Sandbox.TemplateRef, "op", out.Op.ID)
	return out, nil
}

func (s *Service) create(ctx context.Context, p *Principal, req *api.CreateSandboxRequest, idem *Idempotency) (*Created, error) {
	if req.Snapshot != "" {
		return s.createFromSnapshot(ctx, p, req, idem) // snapshots.go
	}
	sb, err := s.newSandbox(ctx, p, req)
	if err != nil {
		return nil, err
	}
	if err := s.roomForNew(ctx); err != nil {
		return nil, err
	}
	poolKey, poolDigest := s.poolFor(ctx, sb)
	op := &store.Operation{ID: ids.Operation(), Kind: api.OpCreate, Tenant: sb.Tenant}
	var a *Answer
	err = s.st.InTx(ctx, func(tx *store.Tx) error {
		if err := s.checkQuota(ctx, tx, sb.Tenant, sandboxNeed(sb.Spec, 1)); err != nil {
			return err
		}
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
		a, err = answer(ctx, tx, p, idem, http.StatusAccepted, out)
		return err
	})
	if err != nil {
		return nil, err
	}
	if sb.ClaimedAt != nil {
		crash.Point("pool.claimed")
		s.kickLocal(sb)
	}
	a.Location = "/v1/sandboxes/" + sb.ID
	return &Created{Sandbox: sb, Op: op, Answer: *a}, nil
}

// poolFor returns the warm pool a new sandbox could be claimed from (its key and the
// digest its members must have), or "" when the template's tag does not resolve yet.
func (s *Service) poolFor(ctx context.Context, sb *store.Sandbox) (string, string) {
	ref, err := api.ParseTemplateRef(sb.TemplateRef)
	// Warm-pool members run without a network: a sandbox with one cannot be claimed
	// from the pool (its network must exist before its instance starts).
	if err != nil || ref.Digest != "" || sb.Spec.Runtime != "" || sb.Spec.FreshBoot || sb.Spec.Network != nil || sb.Spec.CheckpointInterval > 0 {
		return "", ""
	}
	d, _, err := s.st.ResolveTenantTag(ctx, sb.Tenant, ref.Name, ref.Tag)
	if err != nil || d == "" {
		return "", ""
	}
	return store.PoolKey(sb.Tenant, ref.String(), sb.Spec.CPU, sb.Spec.MemoryMB), d
}

// templateConfig returns the configuration a template's release records for a tenant
// (zero if none yet).
func (s *Service) templateConfig(ctx context.Context, tenant string, ref api.TemplateRef) template.Config {
	digest := ref.Digest
	if digest == "" {
		d, _, err := s.st.ResolveTenantTag(ctx, tenant, ref.Name, ref.Tag)
		if err != nil || d == "" {
			return template.Config{}
		}
		digest = d
	}
	rel, err := s.st.GetRelease(ctx, digest)
	if err != nil {
		return template.Config{}
	}
	cfg, _ := template.ParseConfig(rel.Config)
	return cfg
}

// Verb requests a lifecycle verb (pause, resume, suspend, restore, stop, start, wake)
// with a reason shown on the sandbox. A verb that asks for the state the sandbox is in
// (a wake of a running sandbox) returns an operation that is already done. A verb that
// makes a sandbox hold a node's memory again (a wake of a suspended sandbox) counts
// against the tenant's quotas, and every verb is an operation of the tenant.
func (s *Service) Verb(ctx context.Context, p *Principal, id, kind, reason string) (*store.Operation, error) {
	op, _, err := s.verb(ctx, p, id, kind, reason, false, nil)
	return op, err
}

// RequestVerb is Verb asked for explicitly by a client (E2B pause and resume; the
// lifecycle endpoints through RequestVerbKeyed): it also replaces the sandbox's E2B
// envd access token. Wakes that a request needing the sandbox makes on its own (Awake)
// do not, so an SDK holding the token keeps working across idle suspends and
// autoResume.
func (s *Service) RequestVerb(ctx context.Context, p *Principal, id, kind, reason string) (*store.Operation, error) {
	op, _, err := s.verb(ctx, p, id, kind, reason, true, nil)
	return op, err
}

// RequestVerbKeyed is RequestVerb for the lifecycle endpoints: it answers with the
// operation (202), and with idem a retry gets the first answer, also once the verb has
// taken effect (when asking again would be a conflict: "cannot pause a sandbox that is
// paused").
func (s *Service) RequestVerbKeyed(ctx context.Context, p *Principal, id, kind string, idem *Idempotency) (*Answer, error) {
	return s.once(ctx, p, idem, func() (*Answer, error) {
		_, a, err := s.verb(ctx, p, id, kind, "", true, idem)
		return a, err
	})
}

// minCheckpointInterval bounds checkpoint_interval: each checkpoint pauses the sandbox
// and uploads what changed.
const minCheckpointInterval = 10 * time.Second

// holdsMemory reports whether a sandbox of this desired state holds a node's memory
// (what the running_sandboxes, vcpus and memory_mb quotas count).
func holdsMemory(desired string) bool {
	return desired == api.StateRunning || desired == api.StatePaused
}

// verb records a verb and its answer (the operation, 202) in one transaction; with
// idem it records the answer under the request's Idempotency-Key.
func (s *Service) verb(ctx context.Context, p *Principal, id, kind, reason string, rotate bool, idem *Idempotency) (*store.Operation, *Answer, error) {
	v, ok := lifecycle.VerbOf(kind)
	if !ok || kind == api.OpClone {
		return nil, nil, invalid("unknown lifecycle verb %q", kind)
	}
	// The tenant's row is locked before the sandbox's (the order every quota check
	// takes), so look at the sandbox first to learn its tenant.
	peek, err := s.sandbox(ctx, p, id)
	if err != nil {
		return nil, nil, err
	}
	op := &store.Operation{ID: ids.Operation(), Kind: v.Kind}
	var changed *store.Sandbox // the sandbox whose node acts on the change
	record := func(tx *store.Tx) error {
		changed = nil
		if _, err := tx.LockTenant(ctx, peek.Tenant); err != nil {
			return err
		}
		sb, err := tx.GetSandboxForUpdate(ctx, id)
		if err != nil {
			return err
		}
		if !visible(p, sb) || sb.Tenant != peek.Tenant {
			return notFound(id)
		}
		if err := lifecycle.Check(sb.Lifecycle(), v); err != nil {
			return err
		}
		// A suspended sandbox whose snapshot is in the registry wakes on another node
		// when its own is dead (nodes.go).
		rehome := false
		if err := nodeUp(ctx, tx, sb); err != nil {
			if !canRehome(sb, v) {
				return err
			}
			rehome = true
		} else if sb.MoveFrom != "" {
			// Moving off a node being drained: a wake sends it on at once when its
			// snapshot is pushed; anything else waits for the move.
			if sb.MoveFrom != sb.NodeID || !canRehome(sb, v) {
				return fault.Later(fault.New(fault.Conflict, "sandbox %s is moving to another node (its node is drained); it runs there shortly", sb.ID), lifecycle.InFlightRetry)
			}
			rehome = true
		}
		if v.Desired == api.StateRunning && !lifecycle.AlreadyThere(sb.Lifecycle(), v) && sb.NodeID != "" && !rehome {
			if err := roomOn(ctx, tx, sb.NodeID, "wake sandboxes"); err != nil {
				return err
			}
		}
		if lifecycle.AlreadyThere(sb.Lifecycle(), v) {
			op.State, op.Message = api.OpSucceeded, "already "+sb.State
			op.SandboxID, op.Tenant, op.TargetGeneration = sb.ID, sb.Tenant, sb.Generation
			return tx.InsertOperation(ctx, op)
		}
		n := need{store.QuotaOperations: 1}
		if holdsMemory(v.Desired) && !holdsMemory(sb.DesiredState) {
			n = sandboxNeed(sb.Spec, 1)
			delete(n, store.QuotaDiskMB) // its disk is counted already
		}
		if err := s.checkQuota(ctx, tx, sb.Tenant, n); err != nil {
			return err
		}
		if reason == "" {
			reason = v.Kind + " requested"
		}
		if rehome {
			err = tx.Rehome(ctx, sb, reason+"; it wakes on another node from its snapshot in the registry", op)
		} else {
			err = tx.SetDesiredState(ctx, sb, v.Desired, reason, op)
			changed = sb
		}
		if err != nil {
			return err
		}
		if rotate {
			return tx.RotateAccess(ctx, sb)
		}
		return nil
	}
	var a *Answer
	err = s.st.InTx(ctx, func(tx *store.Tx) error {
		if err := record(tx); err != nil {
			return err
		}
		var err error
		a, err = answer(ctx, tx, p, idem, http.StatusAccepted, op.API())
		return err
	})
	if err != nil {
		return nil, nil, err
	}
	if op.State == api.OpSucceeded {
		_ = s.st.UpdateOperation(ctx, op.ID, api.OpSucceeded, op.Message, "")
	} else if changed != nil {
		s.kickLocal(changed)
	}
	return op, a, nil
}

// Delete requests deletion of a sandbox. Asking again while it is being deleted gives
// another operation that completes with the deletion.
func (s *Service) Delete(ctx context.Context, p *Principal, id string) (*store.Operation, error) {
	op, _, err := s.delete(ctx, p, id, nil)
	return op, err
}

// DeleteKeyed is Delete for the API's endpoint: it answers with the operation (202),
// and with idem a retry gets the first answer, also once the sandbox is gone and the
// same request without the key would be a 404.
func (s *Service) DeleteKeyed(ctx context.Context, p *Principal, id string, idem *Idempotency) (*Answer, error) {
	return s.once(ctx, p, idem, func() (*Answer, error) {
		_, a, err := s.delete(ctx, p, id, idem)
		return a, err
	})
}

func (s *Service) delete(ctx context.Context, p *Principal, id string, idem *Idempotency) (*store.Operation, *Answer, error) {
	op := &store.Operation{ID: ids.Operation(), Kind: api.OpDelete}
	var changed *store.Sandbox
	var a *Answer
	err := s.st.InTx(ctx, func(tx *store.Tx) error {
		sb, err := tx.GetSandboxForUpdate(ctx, id)
		if err != nil {
			return err
		}
		if !visible(p, sb) || sb.DeletedAt != nil {
			return notFound(id)
		}
		if err := tx.SetDesiredState(ctx, sb, api.StateDeleted, "", op); err != nil {
			return err
		}
		changed = sb
		// On a dead node nothing would act on it: the delete completes now (the node
		// reclaims what is left when it returns).
		done, err := tx.DeleteIfNodeDead(ctx, sb)
		if err != nil {
			return err
		}
		if done {
			op.State, op.Message = api.OpSucceeded, "deleted at once: its node is dead"
		}
		a, err = answer(ctx, tx, p, idem, http.StatusAccepted, op.API())
		return err
	})
	if err != nil {
		return nil, nil, err
	}
	s.log.Info("sandbox delete requested", "sandbox", id, "op", op.ID)
	if op.State != api.OpSucceeded {
		s.kickLocal(changed)
	}
	return op, a, nil
}

// Clone records count new sandboxes with the source's memory and disk,
// copy-on-write, on the source's node.
func (s *Service) Clone(ctx context.Context, p *Principal, id string, req api.CloneRequest) (api.CloneResponse, error) {
	out, _, err := s.clone(ctx, p, id, req, nil)
	return out, err
}

// CloneKeyed is Clone for the API's endpoint: it answers with the clones and their
// operations (api.CloneResponse, 202), and with idem a retry gets the first answer.
func (s *Service) CloneKeyed(ctx context.Context, p *Principal, id string, req api.CloneRequest, idem *Idempotency) (*Answer, error) {
	return s.once(ctx, p, idem, func() (*Answer, error) {
		_, a, err := s.clone(ctx, p, id, req, idem)
		return a, err
	})
}

func (s *Service) clone(ctx context.Context, p *Principal, id string, req api.CloneRequest, idem *Idempotency) (api.CloneResponse, *Answer, error) {
	var out api.CloneResponse
	if req.Count == 0 {
		req.Count = 1
	}
	if req.Count < 1 || req.Count > maxClones {
		return out, nil, invalid("count must be between 1 and %d", maxClones)
	}
	if err := ValidateMap("metadata", req.Metadata, false); err != nil {
		return out, nil, err
	}
	var expires *time.Time
	if req.TTL != "" {
		exp, err := parseTTL(req.TTL)
		if err != nil {
			return out, nil, err
		}
		expires = exp
	}
	clone, _ := lifecycle.VerbOf(api.OpClone)
	batch := ids.Operation()
	peek, err := s.sandbox(ctx, p, id)
	if err != nil {
		return out, nil, err
	}
	var source *store.Sandbox
	var a *Answer
	err = s.st.InTx(ctx, func(tx *store.Tx) error {
		out.Sandboxes = nil
		if err := s.checkQuota(ctx, tx, peek.Tenant, sandboxNeed(peek.Spec, int64(req.Count))); err != nil {
			return err
		}
		src, err := tx.GetSandboxForUpdate(ctx, id)
		if err != nil {
			return err
		}
		if !visible(p, src) || src.Tenant != peek.Tenant {
			return notFound(id)
		}
		if err := lifecycle.Check(src.Lifecycle(), clone); err != nil {
			return err
		}
		if err := nodeUp(ctx, tx, src); err != nil {
			return err
		}
		// A clone writes a snapshot of the source's memory and the clones' own.
		if err := roomOn(ctx, tx, src.NodeID, "clone sandboxes"); err != nil {
			return err
		}
		meta := req.Metadata
		if meta == nil {
			meta = src.Metadata
		}
		spec := src.Spec
		spec.Snapshot = "" // a clone restores from its source, not from the source's snapshot
		for range req.Count {
			sb := &store.Sandbox{
				ID: ids.Sandbox(), Tenant: src.Tenant, TemplateRef: src.TemplateRef, TemplateDigest: src.TemplateDigest,
				Spec: spec, Metadata: meta, DesiredState: api.StateRunning, State: api.StatePending,
				ExpiresAt: expires, IdleTimeout: src.IdleTimeout, CloneOf: src.ID, CloneBatch: batch,
				NodeID: src.NodeID, Runtime: src.Runtime,
			}
			op := &store.Operation{ID: ids.Operation(), Kind: api.OpClone, Tenant: src.Tenant,
				Message: "waiting for the source's snapshot", Params: map[string]any{"source": src.ID, "batch": batch}}
			if err := tx.CreateSandbox(ctx, sb, op); err != nil {
				return err
			}
			v := sb.API()
			v.Operation = op.API()
			out.Sandboxes = append(out.Sandboxes, v)
		}
		// Wake the source's node: its worker prepares the clones' snapshots.
		source = src
		if err := tx.NotifySandbox(ctx, src); err != nil {
			return err
		}
		a, err = answer(ctx, tx, p, idem, http.StatusAccepted, out)
		return err
	})
	if err != nil {
		return api.CloneResponse{}, nil, err
	}
	s.log.Info("clone requested", "source", id, "count", req.Count, "batch", batch)
	s.kickLocal(source)
	return out, a, nil
}

// RevokeTokens ends every attachment token issued for the sandbox so far.
func (s *Service) RevokeTokens(ctx context.Context, p *Principal, id string) (int64, error) {
	sb, err := s.Sandbox(ctx, p, id)
	if err != nil {
		return 0, err
	}
	return s.st.BumpTokenEpoch(ctx, sb.ID)
}

// SetExpiry changes when a sandbox p may see expires and what happens then ("delete"
// or "suspend"); a nil time removes the expiry.
func (s *Service) SetExpiry(ctx context.Context, p *Principal, id string, at *time.Time, action string) error {
	sb, err := s.sandbox(ctx, p, id)
	if err != nil {
		return err
	}
	return s.st.SetExpiry(ctx, sb.ID, at, action)
}

// SandboxOperations lists a sandbox's operations, newest first.
func (s *Service) SandboxOperations(ctx context.Context, p *Principal, id string) ([]*store.Operation, error) {
	sb, err := s.Sandbox(ctx, p, id)
	if err != nil {
		return nil, err
	}
	return s.st.SandboxOperations(ctx, sb.ID, 100)
}

// Awake returns the sandbox running, waking it first when it is paused, suspended or
// stopped — unless noWake, which returns it as it is.
func (s *Service) Awake(ctx context.Context, p *Principal, sb *store.Sandbox, noWake bool) (*store.Sandbox, error) {
	if sb.MoveFrom != "" && sb.DesiredState != api.StateDeleted {
		// Moving to another node (a drain, or a wake after its node died): it runs
		// there shortly; a request that needs it waits for that.
		cur, err := s.waitMoved(ctx, sb)
		if err != nil || cur.MoveFrom != "" || cur.State == api.StateRunning {
			return cur, err
		}
		sb = cur // the move ended without it running (aborted): as any sandbox
	}
	if !lifecycle.NeedsWake(sb.DesiredState) {
		// On its way to running: asked to (a start or resume under way), or brought back
		// by its node (booted again from its disk after its instance was lost, a
		// transition interrupted by a crash resumed). Until 2026-12-07 the second kind
		// answered 409 "starting" while the node recovered it after a host reboot.
		// A node that is dead brings nothing back: its sandbox is answered at once.
		if sb.DesiredState == api.StateRunning && sb.State != api.StateRunning &&
			(sb.ObservedGeneration < sb.Generation || !lifecycle.IsResting(sb.State) && s.nodeAlive(ctx, sb)) {
			return s.waitRunning(ctx, sb, "")
		}
		return sb, nil
	}
	if noWake {
		return sb, nil
	}
	for attempt := 1; ; attempt++ {
		op, err := s.Verb(ctx, p, sb.ID, api.OpWake, "woken by a request that needs it running")
		if err == nil {
			return s.waitRunning(ctx, sb, op.ID)
		}
		if !fault.Is(err, fault.Conflict) || attempt == wakeAttempts {
			return nil, err
		}
		// A transition is under way: another request's wake, or the suspend or pause
		// the request came during (an idle suspend as its user returns). Once it is
		// over, the sandbox runs, or it rests and is woken.
		cur, werr := s.waitSettled(ctx, sb)
		if werr != nil {
			return nil, werr
		}
		if cur.State == api.StateRunning || !lifecycle.NeedsWake(cur.DesiredState) {
			return s.waitRunning(ctx, cur, "")
		}
	}
}

// nodeAlive reports whether sb is on a node that is not dead.
func (s *Service) nodeAlive(ctx context.Context, sb *store.Sandbox) bool {
	if sb.NodeID == "" {
		return false
	}
	n, err := s.st.GetNode(ctx, sb.NodeID)
	return err == nil && n.State != store.NodeDead
}

// wakeAttempts bounds how often Awake asks for a wake that conflicts with a transition
// under way (it waits for each to end first).
const wakeAttempts = 3

// waitSettled waits (up to wakeTimeout) until the node has acted on the sandbox's
// latest intent, and returns the sandbox as it is then.
func (s *Service) waitSettled(ctx context.Context, sb *store.Sandbox) (*store.Sandbox, error) {
	return s.pollSandbox(ctx, sb.ID, wakeTimeout, func(cur *store.Sandbox) bool {
		return cur.Lifecycle().Settled() || cur.DeletedAt != nil
	})
}

// pollSandbox reads the sandbox every sandboxPollWhileWaking until done holds, or
// until timeout or ctx ends (then it returns the sandbox as last read). The sandboxes'
// own notifications reach only the node and the controller, so requests poll. Its
// reads are not cut by ctx (as waitOp's): a caller whose ctx ran out while it waited
// for an operation gets the sandbox as it is, not the deadline's error.
func (s *Service) pollSandbox(ctx context.Context, id string, timeout time.Duration, done func(*store.Sandbox) bool) (*store.Sandbox, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	for {
		cur, err := s.st.GetSandbox(context.WithoutCancel(ctx), id)
		if err != nil {
			return nil, err
		}
		if done(cur) {
			return cur, nil
		}
		t := time.NewTimer(sandboxPollWhileWaking)
		select {
		case <-ctx.Done():
			t.Stop()
			return cur, nil
		case <-t.C:
		}
	}
}

// moveTimeout bounds how long a request waits for a moving sandbox: a drain's first
// move of a release may upload the release before the sandbox's checkpoint.
const moveTimeout = 10 * time.Minute

// waitMoved waits until a moving sandbox's move ends (or moveTimeout passes): it runs
// on its new node, or the move was aborted.
func (s *Service) waitMoved(ctx context.Context, sb *store.Sandbox) (*store.Sandbox, error) {
	return s.pollSandbox(ctx, sb.ID, moveTimeout, func(cur *store.Sandbox) bool {
		return cur.MoveFrom == "" || cur.State == api.StateFailed || cur.DeletedAt != nil
	})
}

// waitRunning waits until the sandbox runs (or opID finishes), wakeTimeout in all: the
// operation and the state after it share one deadline.
func (s *Service) waitRunning(ctx context.Context, sb *store.Sandbox, opID string) (*store.Sandbox, error) {
	ctx, cancel := context.WithTimeout(ctx, wakeTimeout)
	defer cancel()
	if opID != "" {
		op, err := s.waitOp(ctx, opID, func(o *store.Operation) bool { return o.DoneAt != nil })
		if err != nil {
			return nil, err
		}
		if op.State == api.OpFailed {
			return nil, fault.New(fault.Conflict, "waking sandbox %s failed: %s", sb.ID, op.Error)
		}
	}
	return s.pollSandbox(ctx, sb.ID, wakeTimeout, func(cur *store.Sandbox) bool {
		return cur.State == api.StateRunning || cur.DesiredState != api.StateRunning || cur.State == api.StateFailed
	})
}

// roomForNew refuses a new sandbox (507) when no alive node has disk space above its
// reserve: nothing is stored.
func (s *Service) roomForNew(ctx context.Context) error {
	nodes, err := s.st.ListNodes(ctx)
	if err != nil {
		return err
	}
	reason := ""
	for _, n := range nodes {
		if n.State != store.NodeAlive {
			continue
		}
		if n.DiskLow == "" {
			return nil
		}
		reason = n.DiskLow
	}
	if reason == "" {
		return nil // no alive node: the create waits for one, saying so
	}
	return fault.New(fault.InsufficientStorage, "no node has disk space for a new sandbox: %s", reason)
}

// roomOn refuses (507) what would write a sandbox's memory or disk on a node whose disk
// is at its reserve; what says what that is ("wake sandboxes").
func roomOn(ctx context.Context, q nodeReader, nodeID, what string) error {
	n, err := q.GetNode(ctx, nodeID)
	if err != nil || n.DiskLow == "" {
		return nil
	}
	return fault.New(fault.InsufficientStorage, "node %s has no disk space to %s: %s", n.Name, what, n.DiskLow)
}

// RotateAccess replaces the E2B envd access token of a sandbox p may see (after an
// explicit resume) and returns the sandbox with its new access epoch.
func (s *Service) RotateAccess(ctx context.Context, p *Principal, id string) (*store.Sandbox, error) {
	var out *store.Sandbox
	err := s.st.InTx(ctx, func(tx *store.Tx) error {
		sb, err := tx.GetSandboxForUpdate(ctx, id)
		if err != nil {
			return err
		}
		if !visible(p, sb) || sb.DeletedAt != nil {
			return notFound(id)
		}
		out = sb
		return tx.RotateAccess(ctx, sb)
	})
	return out, err
}
