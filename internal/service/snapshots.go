package service

import (
	"context"
	"maps"
	"net/http"
	"regexp"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/ids"
	"github.com/spacedev/space/internal/lifecycle"
	"github.com/spacedev/space/internal/store"
)

// Named snapshots (docs/lifecycle.md, "Named snapshots"): a resource of the tenant that
// took it, made from a sandbox's memory and disk by the sandbox's node, which keeps its
// files. Sandboxes created from one run on that node.

var snapshotNameRe = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$`)

const maxSnapshotList = 1000

func snapshotNotFound(ref string) error {
	return fault.New(fault.NotFound, "snapshot %q not found", ref)
}

// ValidSnapshotName checks a snapshot name.
func ValidSnapshotName(name string) error {
	if !snapshotNameRe.MatchString(name) {
		return invalid("snapshot name %q is invalid: use 1 to 64 letters, digits, '.', '_' and '-', starting with a letter or digit", name)
	}
	return nil
}

// CreateSnapshot records a named snapshot of a sandbox p may see; the sandbox's node
// takes it (the returned operation ends when it is ready). The sandbox must have
// memory to capture (running, paused or suspended) and keeps running.
func (s *Service) CreateSnapshot(ctx context.Context, p *Principal, sandboxID string, req api.CreateSnapshotRequest) (*store.Snapshot, *store.Operation, error) {
	sn, op, _, err := s.createSnapshot(ctx, p, sandboxID, req, nil)
	return sn, op, err
}

// CreateSnapshotKeyed is CreateSnapshot for the API's endpoint: it answers with the
// snapshot and the operation that takes it (202), and with idem a retry gets the first
// answer.
func (s *Service) CreateSnapshotKeyed(ctx context.Context, p *Principal, sandboxID string, req api.CreateSnapshotRequest, idem *Idempotency) (*Answer, error) {
	return s.once(ctx, p, idem, func() (*Answer, error) {
		_, _, a, err := s.createSnapshot(ctx, p, sandboxID, req, idem)
		return a, err
	})
}

func (s *Service) createSnapshot(ctx context.Context, p *Principal, sandboxID string, req api.CreateSnapshotRequest, idem *Idempotency) (*store.Snapshot, *store.Operation, *Answer, error) {
	if req.Name != "" {
		if err := ValidSnapshotName(req.Name); err != nil {
			return nil, nil, nil, err
		}
	}
	sn := &store.Snapshot{ID: ids.Snapshot(), Name: req.Name}
	if sn.Name == "" {
		sn.Name = sn.ID
	}
	op := &store.Operation{ID: ids.Operation(), Kind: api.OpSnapshot, Message: "waiting for the sandbox's node"}
	var a *Answer
	err := s.st.InTx(ctx, func(tx *store.Tx) error {
		src, err := tx.GetSandboxForUpdate(ctx, sandboxID)
		if err != nil {
			return err
		}
		if !visible(p, src) {
			return notFound(sandboxID)
		}
		if err := lifecycle.Check(src.Lifecycle(), lifecycle.SnapshotVerb()); err != nil {
			return err
		}
		if err := nodeUp(ctx, tx, src); err != nil {
			return err
		}
		if src.NodeID == "" {
			return fault.New(fault.Conflict, "sandbox %s is not on a node yet", src.ID)
		}
		if err := roomOn(ctx, tx, src.NodeID, "take snapshots"); err != nil {
			return err
		}
		spec := src.Spec
		spec.Snapshot, spec.FreshBoot = "", false
		sn.Tenant, sn.SourceSandbox, sn.TemplateRef, sn.TemplateDigest = src.Tenant, src.ID, src.TemplateRef, src.TemplateDigest
		sn.Spec, sn.Runtime, sn.NodeID = spec, src.Runtime, src.NodeID
		op.Tenant = src.Tenant
		op.Params = map[string]any{"source": src.ID, "snapshot": sn.ID, "node": src.NodeID}
		if err := tx.InsertSnapshot(ctx, sn, op, req.Replace); err != nil {
			return err
		}
		// Wake the source's node: its worker takes the snapshot.
		if err := tx.NotifySandbox(ctx, src); err != nil {
			return err
		}
		out := sn.API()
		out.Operation = op.API()
		a, err = answer(ctx, tx, p, idem, http.StatusAccepted, out)
		return err
	})
	if err != nil {
		return nil, nil, nil, err
	}
	s.log.Info("snapshot requested", "snapshot", sn.ID, "name", sn.Name, "source", sandboxID, "op", op.ID)
	a.Location = "/v1/snapshots/" + sn.ID
	return sn, op, a, nil
}

// findSnapshot returns the snapshot named by ref (id or name) that p may see: its own
// tenant's, or for an admin any tenant's by id.
func (s *Service) findSnapshot(ctx context.Context, p *Principal, ref string) (*store.Snapshot, error) {
	if ref == "" {
		return nil, invalid("name a snapshot (its id or name)")
	}
	sn, err := s.st.FindSnapshot(ctx, p.Tenant, ref)
	if fault.Is(err, fault.NotFound) && p.Operator() {
		sn, err = s.st.FindSnapshot(ctx, "", ref)
	}
	if fault.Is(err, fault.NotFound) || err == nil && !p.Visible(sn.Tenant) {
		return nil, snapshotNotFound(ref)
	}
	return sn, err
}

// Snapshot returns a snapshot p may see, by id or name.
func (s *Service) Snapshot(ctx context.Context, p *Principal, ref string) (*store.Snapshot, error) {
	return s.findSnapshot(ctx, p, ref)
}

// SnapshotFilter selects snapshots for Snapshots.
type SnapshotFilter struct {
	// Source lists the snapshots of one sandbox.
	Source string
	// Name lists the snapshot with this name or id.
	Name string
	// After continues a listing after this snapshot id.
	After string
	Limit int
}

// Snapshots lists the snapshots p may see, newest first.
func (s *Service) Snapshots(ctx context.Context, p *Principal, f SnapshotFilter) ([]*store.Snapshot, error) {
	sf := store.SnapshotFilter{Source: f.Source, Name: f.Name, After: f.After, Limit: maxSnapshotList}
	if !p.Operator() {
		sf.Tenant = p.Tenant
	}
	if f.Limit != 0 {
		if f.Limit < 1 || f.Limit > maxSnapshotList {
			return nil, invalid("limit must be between 1 and %d", maxSnapshotList)
		}
		sf.Limit = f.Limit
	}
	return s.st.ListSnapshots(ctx, sf)
}

// DeleteSnapshot asks the snapshot's node to remove it; its name is free at once. A
// snapshot that sandboxes are being created from cannot be deleted until they run (409).
// Deleting a snapshot being taken fails its operation. Deleting one already being
// deleted returns it as it is.
func (s *Service) DeleteSnapshot(ctx context.Context, p *Principal, ref string) (*store.Snapshot, error) {
	sn, _, err := s.deleteSnapshot(ctx, p, ref, nil)
	return sn, err
}

// DeleteSnapshotKeyed is DeleteSnapshot for the API's endpoint: it answers with the
// snapshot, now deleting (202), and with idem a retry gets the first answer, also once
// the snapshot is gone and the same request without the key would be a 404.
func (s *Service) DeleteSnapshotKeyed(ctx context.Context, p *Principal, ref string, idem *Idempotency) (*Answer, error) {
	return s.once(ctx, p, idem, func() (*Answer, error) {
		_, a, err := s.deleteSnapshot(ctx, p, ref, idem)
		return a, err
	})
}

func (s *Service) deleteSnapshot(ctx context.Context, p *Principal, ref string, idem *Idempotency) (*store.Snapshot, *Answer, error) {
	found, err := s.findSnapshot(ctx, p, ref)
	if err != nil {
		return nil, nil, err
	}
	var out *store.Snapshot
	var a *Answer
	err = s.st.InTx(ctx, func(tx *store.Tx) error {
		sn, err := tx.FindSnapshotForUpdate(ctx, found.Tenant, found.ID)
		if fault.Is(err, fault.NotFound) {
			return snapshotNotFound(ref)
		}
		if err != nil {
			return err
		}
		out = sn
		if sn.State != api.SnapshotDeleting {
			users, err := tx.SnapshotUsers(ctx, sn.ID)
			if err != nil {
				return err
			}
			if len(users) > 0 {
				return fault.Later(fault.New(fault.Conflict, "snapshot %s is in use: sandbox %v is being created from it; delete it once they run", sn.Name, users), lifecycle.InFlightRetry)
			}
			if err := tx.MarkSnapshotDeleting(ctx, sn); err != nil {
				return err
			}
		}
		a, err = answer(ctx, tx, p, idem, http.StatusAccepted, sn.API())
		return err
	})
	if err != nil {
		return nil, nil, err
	}
	s.log.Info("snapshot delete requested", "snapshot", out.ID, "name", out.Name)
	return out, a, nil
}

// SnapshotBytes is the disk space the tenant's snapshots hold (what they add to its
// disk use besides its sandboxes).
func (s *Service) SnapshotBytes(ctx context.Context, tenant string) (int64, error) {
	return s.st.SnapshotBytes(ctx, tenant)
}

// createFromSnapshot records a sandbox restored from a named snapshot, on the node
// that holds it. Resources, template and runtime are the snapshot's; the request may
// repeat them but not change them.
func (s *Service) createFromSnapshot(ctx context.Context, p *Principal, req *api.CreateSandboxRequest, idem *Idempotency) (*Created, error) {
	found, err := s.findSnapshot(ctx, p, req.Snapshot)
	if err != nil {
		return nil, err
	}
	sp := found.Spec
	switch {
	case req.Template != "":
		return nil, invalid("template and snapshot exclude each other: a sandbox made from a snapshot has the snapshot's template (%s)", found.TemplateRef)
	case req.CPU != 0 && req.CPU != sp.CPU, req.MemoryMB != 0 && req.MemoryMB != sp.MemoryMB, req.DiskMB != 0 && req.DiskMB != sp.DiskMB:
		return nil, invalid("a sandbox made from snapshot %s has its resources (cpu %d, memory_mb %d, disk_mb %d)", found.Name, sp.CPU, sp.MemoryMB, sp.DiskMB)
	case req.Runtime != "" && req.Runtime != found.Runtime:
		return nil, invalid("a sandbox made from snapshot %s runs on %s", found.Name, found.Runtime)
	case req.FreshBoot:
		return nil, invalid("fresh_boot and snapshot exclude each other: a snapshot restores")
	}
	if err := ValidateMap("env", req.Env, true); err != nil {
		return nil, err
	}
	if err := ValidateMap("metadata", req.Metadata, false); err != nil {
		return nil, err
	}
	spec := sp
	spec.Env = maps.Clone(sp.Env)
	if len(req.Env) > 0 {
		if spec.Env == nil {
			spec.Env = map[string]string{}
		}
		maps.Copy(spec.Env, req.Env)
	}
	sb := &store.Sandbox{ID: ids.Sandbox(), Tenant: p.Tenant, TemplateRef: found.TemplateRef, TemplateDigest: found.TemplateDigest,
		Spec: spec, Metadata: req.Metadata, DesiredState: api.StateRunning, State: api.StatePending,
		NodeID: found.NodeID, Runtime: found.Runtime, IdleTimeout: s.cfg.IdleTimeout}
	if req.IdleTimeout != "" {
		d, err := time.ParseDuration(req.IdleTimeout)
		if err != nil || d < 0 || d > maxTTL || (d > 0 && d < time.Second) {
			return nil, invalid("idle_timeout must be a duration between 1s and %s, or 0 to never suspend", maxTTL)
		}
		sb.IdleTimeout = d
		if d == 0 {
			sb.IdleTimeout = -1
		}
	}
	if req.TTL != "" {
		if sb.ExpiresAt, err = parseTTL(req.TTL); err != nil {
			return nil, err
		}
	}
	node, err := s.st.GetNode(ctx, found.NodeID)
	if err != nil {
		return nil, err
	}
	msg := "restoring from snapshot " + found.Name + " on node " + node.Name
	if node.State != store.NodeAlive {
		// Pushed to the registry: any node that shares it restores it (the scheduler
		// places the sandbox; node.startFromSnapshot pulls).
		digest, err := s.st.SnapshotArtifact(ctx, found.ID)
		if err != nil {
			return nil, err
		}
		if digest == "" {
			return nil, fault.New(fault.Unavailable, "node %s, which holds snapshot %s, is down (the snapshot is not in a registry)", node.Name, found.Name)
		}
		sb.NodeID, sb.Spec.Runtime = "", found.Runtime
		msg = "restoring from snapshot " + found.Name + " (from the registry: node " + node.Name + " is down)"
	} else if err := roomOn(ctx, s.st, found.NodeID, "start sandboxes from snapshots"); err != nil {
		return nil, err
	}
	op := &store.Operation{ID: ids.Operation(), Kind: api.OpCreate, Tenant: p.Tenant, Message: msg}
	var a *Answer
	err = s.st.InTx(ctx, func(tx *store.Tx) error {
		// The share lock keeps the snapshot from being deleted until the sandbox that
		// needs it is recorded (DeleteSnapshot then sees it and refuses).
		sn, err := tx.FindSnapshotForShare(ctx, found.Tenant, found.ID)
		if fault.Is(err, fault.NotFound) {
			return snapshotNotFound(req.Snapshot)
		}
		if err != nil {
			return err
		}
		if sn.State != api.SnapshotReady {
			return fault.New(fault.Conflict, "snapshot %s is %s; sandboxes can be created from it once it is ready", sn.Name, sn.State)
		}
		sb.Spec.Snapshot = sn.ID
		if err := tx.CreateSandbox(ctx, sb, op); err != nil {
			return err
		}
		out := sb.API()
		out.Operation = op.API()
		a, err = answer(ctx, tx, p, idem, http.StatusAccepted, out)
		return err
	})
	if err != nil {
		return nil, err
	}
	a.Location = "/v1/sandboxes/" + sb.ID
	return &Created{Sandbox: sb, Op: op, Answer: *a}, nil
}
