package server

import (
	"context"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/ids"
	"github.com/spacedev/space/internal/store"
)

// verb is a lifecycle request: the desired state it records and the observed states it
// may start from.
type verb struct {
	kind    string
	desired string
	from    []string
}

var verbs = map[string]verb{
	api.OpPause:   {api.OpPause, api.StatePaused, []string{api.StateRunning}},
	api.OpResume:  {api.OpResume, api.StateRunning, []string{api.StatePaused}},
	api.OpSuspend: {api.OpSuspend, api.StateSuspended, []string{api.StateRunning, api.StatePaused}},
	"restore":     {"restore", api.StateRunning, []string{api.StateSuspended}},
	api.OpStop:    {api.OpStop, api.StateStopped, []string{api.StateRunning, api.StatePaused, api.StateSuspended}},
	api.OpStart:   {api.OpStart, api.StateRunning, []string{api.StateStopped}},
	api.OpWake:    {api.OpWake, api.StateRunning, []string{api.StatePaused, api.StateSuspended, api.StateStopped, api.StateRunning}},
}

// resting reports whether the node has acted on the sandbox's latest intent (no
// transition in flight). A failed transition is resting too: its state is what the
// node reported.
func resting(sb *store.Sandbox) bool {
	return sb.ObservedGeneration >= sb.Generation
}

// checkVerb explains why v is not allowed now, as a 409.
func checkVerb(sb *store.Sandbox, v verb) error {
	if sb.DeletedAt != nil || sb.DesiredState == api.StateDeleted {
		return fault.New(fault.Conflict, "sandbox %s is deleted; it cannot %s", sb.ID, v.kind)
	}
	if sb.State == api.StateFailed {
		return fault.New(fault.Conflict, "sandbox %s failed (%s); delete it", sb.ID, sb.Error)
	}
	if !resting(sb) {
		return fault.New(fault.Conflict, "sandbox %s is %s (desired %s); wait for that to finish", sb.ID, sb.State, sb.DesiredState)
	}
	if !slices.Contains(v.from, sb.State) {
		return fault.New(fault.Conflict, "cannot %s a sandbox that is %s", v.kind, sb.State)
	}
	return nil
}

// lifecycle handles POST /v1/sandboxes/{id}/<verb>.
func (a *API) lifecycle(kind string) handlerFunc {
	v := verbs[kind]
	return func(w http.ResponseWriter, r *http.Request) error {
		op, err := a.requestVerb(r.Context(), r.PathValue("id"), principalFrom(r.Context()), v, "")
		if err != nil {
			return err
		}
		writeJSON(w, http.StatusAccepted, op.API())
		return nil
	}
}

// requestVerb records a lifecycle verb. A wake of a running sandbox returns an
// operation that is already done.
func (a *API) requestVerb(ctx context.Context, id string, p *Principal, v verb, reason string) (*store.Operation, error) {
	op := &store.Operation{ID: ids.Operation(), Kind: v.kind}
	err := a.st.InTx(ctx, func(tx *store.Tx) error {
		sb, err := tx.GetSandboxForUpdate(ctx, id)
		if err != nil {
			return err
		}
		if p != nil && !p.visible(sb.Tenant) || sb.PoolKey != "" {
			return fault.New(fault.NotFound, "sandbox %q not found", id)
		}
		if err := checkVerb(sb, v); err != nil {
			return err
		}
		if sb.State == v.desired {
			op.State, op.Message = api.OpSucceeded, "already "+sb.State
			op.SandboxID, op.Tenant, op.TargetGeneration = sb.ID, sb.Tenant, sb.Generation
			return tx.InsertOperation(ctx, op)
		}
		if reason == "" {
			reason = v.kind + " requested"
		}
		return tx.SetDesiredStateWithReason(ctx, sb, v.desired, reason, op)
	})
	if err != nil {
		return nil, err
	}
	if op.State == api.OpSucceeded {
		_ = a.st.UpdateOperation(ctx, op.ID, api.OpSucceeded, op.Message, "")
	}
	return op, nil
}

// needsWake reports whether a sandbox is resting in a state a wake would leave.
func needsWake(sb *store.Sandbox) bool {
	return sb.DesiredState == api.StatePaused || sb.DesiredState == api.StateSuspended || sb.DesiredState == api.StateStopped
}

// wakeTimeout bounds how long a request waits for an automatic wake.
const wakeTimeout = 2 * time.Minute

// awake returns the sandbox running, waking it first when it is paused, suspended or
// stopped — unless the request says ?wake=false.
func (a *API) awake(r *http.Request, sb *store.Sandbox) (*store.Sandbox, error) {
	w := r.URL.Query().Get("wake")
	return a.awakeCtx(r.Context(), principalFrom(r.Context()), sb, w == "false" || w == "0")
}

func (a *API) awakeCtx(ctx context.Context, p *Principal, sb *store.Sandbox, noWake bool) (*store.Sandbox, error) {
	if !needsWake(sb) {
		if sb.DesiredState == api.StateRunning && sb.State != api.StateRunning && sb.ObservedGeneration < sb.Generation {
			return a.waitRunning(ctx, sb, "")
		}
		return sb, nil
	}
	if noWake {
		return sb, nil
	}
	op, err := a.requestVerb(ctx, sb.ID, p, verbs[api.OpWake], "woken by a request that needs it running")
	if fault.Is(err, fault.Conflict) {
		// Another request is waking it already.
		return a.waitRunning(ctx, sb, "")
	}
	if err != nil {
		return nil, err
	}
	return a.waitRunning(ctx, sb, op.ID)
}

// waitRunning waits until the sandbox runs (or opID finishes).
func (a *API) waitRunning(ctx context.Context, sb *store.Sandbox, opID string) (*store.Sandbox, error) {
	ctx, cancel := context.WithTimeout(ctx, wakeTimeout)
	defer cancel()
	if opID != "" {
		op, err := a.waitChange(ctx, opID, func(o *store.Operation) bool { return o.DoneAt != nil })
		if err != nil {
			return nil, err
		}
		if op.State == api.OpFailed {
			return nil, fault.New(fault.Conflict, "waking sandbox %s failed: %s", sb.ID, op.Error)
		}
	}
	for {
		cur, err := a.st.GetSandbox(ctx, sb.ID)
		if err != nil {
			return nil, err
		}
		if cur.State == api.StateRunning || cur.DesiredState != api.StateRunning || cur.State == api.StateFailed {
			return cur, nil
		}
		t := time.NewTimer(50 * time.Millisecond)
		select {
		case <-ctx.Done():
			t.Stop()
			return cur, nil
		case <-t.C:
		}
	}
}

// activity throttles last-activity writes to one per sandbox every few seconds.
type activity struct {
	mu   sync.Mutex
	last map[string]time.Time
}

const activityEvery = 5 * time.Second

func (a *API) touch(id string) {
	a.act.mu.Lock()
	if time.Since(a.act.last[id]) < activityEvery {
		a.act.mu.Unlock()
		return
	}
	a.act.last[id] = time.Now()
	if len(a.act.last) > 100000 {
		clear(a.act.last)
	}
	a.act.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := a.st.TouchSandboxes(ctx, []string{id}); err != nil {
		a.log.Warn("record activity", "sandbox", id, "err", err)
	}
}

// clone handles POST /v1/sandboxes/{id}/clone: count new sandboxes with the source's
// memory and disk, copy-on-write, on the source's node.
func (a *API) clone(w http.ResponseWriter, r *http.Request) error {
	var req api.CloneRequest
	if err := decodeOptionalJSON(w, r, &req); err != nil {
		return err
	}
	if req.Count == 0 {
		req.Count = 1
	}
	if req.Count < 1 || req.Count > 50 {
		return invalid("count must be between 1 and 50")
	}
	if err := validateMap("metadata", req.Metadata, metaKeyRe); err != nil {
		return err
	}
	var expires *time.Time
	if req.TTL != "" {
		d, err := time.ParseDuration(req.TTL)
		if err != nil || d < time.Second || d > maxTTL {
			return invalid("ttl must be a duration between 1s and %s", maxTTL)
		}
		t := time.Now().Add(d)
		expires = &t
	}
	p := principalFrom(r.Context())
	id := r.PathValue("id")
	var out api.CloneResponse
	batch := ids.Operation()
	err := a.st.InTx(r.Context(), func(tx *store.Tx) error {
		src, err := tx.GetSandboxForUpdate(r.Context(), id)
		if err != nil {
			return err
		}
		if !p.visible(src.Tenant) || src.PoolKey != "" {
			return fault.New(fault.NotFound, "sandbox %q not found", id)
		}
		if err := checkVerb(src, verb{kind: "clone", from: []string{api.StateRunning, api.StatePaused, api.StateSuspended}}); err != nil {
			if src.State == api.StateStopped {
				return fault.New(fault.Conflict, "cannot clone sandbox %s: it is stopped, so it has no memory to clone; start it first", src.ID)
			}
			return err
		}
		meta := req.Metadata
		if meta == nil {
			meta = src.Metadata
		}
		for i := 0; i < req.Count; i++ {
			sb := &store.Sandbox{
				ID: ids.Sandbox(), Tenant: src.Tenant, TemplateRef: src.TemplateRef, TemplateDigest: src.TemplateDigest,
				Spec: src.Spec, Metadata: meta, DesiredState: api.StateRunning, State: api.StatePending,
				ExpiresAt: expires, IdleTimeout: src.IdleTimeout, CloneOf: src.ID, CloneBatch: batch,
				NodeID: src.NodeID, Runtime: src.Runtime,
			}
			op := &store.Operation{ID: ids.Operation(), Kind: api.OpClone, Tenant: src.Tenant,
				Message: "waiting for the source's snapshot", Params: map[string]any{"source": src.ID, "batch": batch}}
			if err := tx.CreateSandbox(r.Context(), sb, op); err != nil {
				return err
			}
			v := sb.API()
			v.Operation = op.API()
			out.Sandboxes = append(out.Sandboxes, v)
		}
		// Wake the source's node: its worker prepares the clones' snapshots.
		return tx.NotifySandbox(r.Context(), src)
	})
	if err != nil {
		return err
	}
	a.log.Info("clone requested", "source", id, "count", req.Count, "batch", batch)
	writeJSON(w, http.StatusAccepted, out)
	return nil
}

// Pools.

func (a *API) setPool(w http.ResponseWriter, r *http.Request) error {
	if err := requireAdmin(r); err != nil {
		return err
	}
	var req api.SetPoolRequest
	if err := decodeJSON(w, r, &req); err != nil {
		return err
	}
	ref, err := api.ParseTemplateRef(req.Template)
	if err != nil {
		return fault.Wrap(fault.Invalid, err)
	}
	if ref.Digest != "" {
		return invalid("pools follow a tag (name:tag), not a digest")
	}
	if req.CPU == 0 {
		req.CPU = a.cfg.DefaultCPU
	}
	if req.MemoryMB == 0 {
		req.MemoryMB = a.cfg.DefaultMemoryMB
	}
	if req.Size < 0 || req.Size > 500 {
		return invalid("size must be between 0 and 500")
	}
	if req.CPU < 1 || req.CPU > a.cfg.MaxCPU || req.MemoryMB < 64 || req.MemoryMB > a.cfg.MaxMemoryMB {
		return invalid("cpu or memory_mb out of range")
	}
	if d, err := a.st.ResolveTag(r.Context(), ref.Name, ref.Tag); err != nil {
		return err
	} else if d == "" && !slices.Contains(a.cfg.BuiltinTemplates, ref.Name) {
		return fault.New(fault.NotFound, "template %q not found", ref.String())
	}
	p := store.Pool{Template: ref.String(), CPU: req.CPU, MemoryMB: req.MemoryMB, Size: req.Size}
	if err := a.st.SetPool(r.Context(), p); err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, api.Pool{Template: p.Template, CPU: p.CPU, MemoryMB: p.MemoryMB, Size: p.Size})
	return nil
}

func (a *API) listPools(w http.ResponseWriter, r *http.Request) error {
	pools, err := a.st.ListPools(r.Context())
	if err != nil {
		return err
	}
	out := make([]api.Pool, 0, len(pools))
	for _, p := range pools {
		out = append(out, api.Pool{Template: p.Template, CPU: p.CPU, MemoryMB: p.MemoryMB, Size: p.Size, Ready: p.Ready})
	}
	writeJSON(w, http.StatusOK, map[string]any{"pools": out})
	return nil
}
