package service

import (
	"context"
	"encoding/json"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/ids"
	"github.com/spacedev/space/internal/lifecycle"
	"github.com/spacedev/space/internal/store"
)

func resources(r store.Resources) api.NodeResources {
	return api.NodeResources{CPU: r.CPU, MemoryMB: r.MemoryMB, DiskMB: r.DiskMB}
}

func nodeAPI(n *store.Node) api.Node {
	return api.Node{ID: n.ID, Name: n.Name, Runtime: n.Runtime, RuntimeInfo: n.RuntimeInfo,
		DataPlaneURL: n.DataPlaneURL, State: n.State, HeartbeatAt: n.HeartbeatAt, Sandboxes: n.Sandboxes,
		Cordoned: n.Cordoned, DeadReason: n.DeadReason, Capacity: resources(n.Allocatable), Used: resources(n.Used),
		Cache: api.NodeCache{Releases: n.Cache.Releases, ReleaseBytes: n.Cache.ReleaseBytes,
			Snapshots: n.Cache.Snapshots, SnapshotBytes: n.Cache.SnapshotBytes}}
}

// Cordon cordons (on) or uncordons the node named (or with the id) ref: a cordoned
// node gets no new placements; what runs there keeps running. Operators only.
func (s *Service) Cordon(ctx context.Context, p *Principal, ref string, on bool) (api.Node, error) {
	if err := RequireOperator(p); err != nil {
		return api.Node{}, err
	}
	n, err := s.st.SetCordoned(ctx, ref, on)
	if err != nil {
		return api.Node{}, err
	}
	s.log.Info("node cordon changed", "node", n.Name, "cordoned", on)
	return nodeAPI(n), nil
}

// RemoveNode removes a dead node, or a cordoned one that holds no sandbox, freeing
// its name for a replacement (store.RemoveNode). Operators only.
func (s *Service) RemoveNode(ctx context.Context, p *Principal, ref string) (api.RemovedNode, error) {
	if err := RequireOperator(p); err != nil {
		return api.RemovedNode{}, err
	}
	rm, err := s.st.RemoveNode(ctx, ref)
	if err != nil {
		return api.RemovedNode{}, err
	}
	s.log.Warn("node removed", "node", rm.Node.Name, "id", rm.Node.ID, "state", rm.Node.State,
		"sandboxes_deleted", rm.Sandboxes, "snapshots_deleted", rm.Snapshots)
	return api.RemovedNode{Node: nodeAPI(rm.Node), SandboxesDeleted: rm.Sandboxes, SnapshotsDeleted: rm.Snapshots}, nil
}

// nodeUp refuses (409), with the reason, a request that needs the node of sb when
// that node is dead: nothing there would act on it, so the request must not wait. A
// conflict, not a 503: clients retry 503s, and this lasts until the node returns.
func nodeUp(ctx context.Context, q nodeReader, sb *store.Sandbox) error {
	if sb.NodeID == "" {
		return nil
	}
	n, err := q.GetNode(ctx, sb.NodeID)
	if err != nil {
		return err
	}
	return deadNode(sb, n)
}

// nodeReader reads a node: a *store.Tx inside a transaction (never the pool there: see
// store.Tx.GetNode), else the *store.Store.
type nodeReader interface {
	GetNode(ctx context.Context, id string) (*store.Node, error)
}

func deadNode(sb *store.Sandbox, n *store.Node) error {
	if n.State != store.NodeDead {
		return nil
	}
	why := ""
	switch sb.State {
	case api.StateSuspended:
		why = " (its snapshot is not in a registry, so no other node can wake it)"
	case api.StateStopped:
		why = " (a stopped sandbox's disk is kept on its node only)"
	}
	return fault.New(fault.Conflict, "sandbox %s is on node %s, which is dead (%s); it stays %s there until the node returns%s, "+
		"and a delete completes at once", sb.ID, n.Name, n.DeadReason, sb.State, why)
}

// canRehome reports whether verb v of a sandbox on a dead node can be carried out on
// another node instead: a wake (or restore) of a suspended sandbox whose snapshot its
// node pushed to the fleet's registry (store.Tx.Rehome). Stopped sandboxes are not
// moved: only suspend snapshots are pushed, a stopped sandbox's disk stays on its node.
func canRehome(sb *store.Sandbox, v lifecycle.Verb) bool {
	return v.Desired == api.StateRunning && sb.State == api.StateSuspended && sb.SnapshotDigest != "" &&
		sb.Lifecycle().Settled() && sb.DesiredState == api.StateSuspended
}

// Drain cordons the node named (or with the id) ref and asks the controller to move
// every running sandbox on it to other nodes (controller/drain.go): each is suspended
// with its snapshot pushed to the registry, re-homed and woken elsewhere. It returns
// the node_drain operation, which finishes once nothing runs on the node any more
// (its Moves say what became of each sandbox); a drain of a node being drained
// returns the drain in progress. Operators only.
func (s *Service) Drain(ctx context.Context, p *Principal, ref string) (*store.Operation, error) {
	if err := RequireOperator(p); err != nil {
		return nil, err
	}
	n, err := s.st.FindNode(ctx, ref)
	if err != nil {
		return nil, err
	}
	if n.State != store.NodeAlive {
		return nil, fault.New(fault.Conflict, "node %s is %s: nothing runs there to move (a dead node's suspended sandboxes "+
			"whose snapshots are in the registry wake on other nodes when woken)", n.Name, n.State)
	}
	open, err := s.st.OpenOperationsOfKind(ctx, api.OpNodeDrain)
	if err != nil {
		return nil, err
	}
	for _, op := range open {
		if d, err := store.DecodeDrain(op.Params); err == nil && d.Node == n.ID {
			return op, nil
		}
	}
	if _, err := s.st.SetCordoned(ctx, n.ID, true); err != nil {
		return nil, err
	}
	d := &store.DrainParams{Node: n.ID, NodeName: n.Name}
	b, err := json.Marshal(d)
	if err != nil {
		return nil, err
	}
	var params map[string]any
	if err := json.Unmarshal(b, &params); err != nil {
		return nil, err
	}
	op := &store.Operation{ID: ids.Operation(), Kind: api.OpNodeDrain, Tenant: "", Params: params,
		Message: "draining node " + n.Name + ": cordoned; moving its running sandboxes"}
	if err := s.st.CreateOperation(ctx, op); err != nil {
		return nil, err
	}
	if err := s.st.KickController(ctx); err != nil {
		s.log.Warn("kick the controller", "err", err)
	}
	s.log.Info("node drain requested", "node", n.Name, "op", op.ID)
	return op, nil
}
