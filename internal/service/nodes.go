package service

import (
	"context"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
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
func (s *Service) nodeUp(ctx context.Context, sb *store.Sandbox) error {
	if sb.NodeID == "" {
		return nil
	}
	n, err := s.st.GetNode(ctx, sb.NodeID)
	if err != nil {
		return err
	}
	return deadNode(sb, n)
}

func deadNode(sb *store.Sandbox, n *store.Node) error {
	if n.State != store.NodeDead {
		return nil
	}
	return fault.New(fault.Conflict, "sandbox %s is on node %s, which is dead (%s); it stays %s there until the node returns, "+
		"and a delete completes at once", sb.ID, n.Name, n.DeadReason, sb.State)
}
