package controller

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/ids"
	"github.com/spacedev/space/internal/store"
)

// Moves and drains (docs/operations.md, "When a node dies" and "Drain").
//
// A move takes a suspended sandbox whose snapshot is in the registry off its node
// (store.Tx.Rehome): the service does it for a wake of a sandbox whose node is dead,
// the drain loop below for every running sandbox of a node being drained. The
// scheduler then places it like a new sandbox, on a node of its runtime that shares the
// registry (placeMove), and that node pulls and restores it.

// placeMove places a sandbox a move took off its node. One that fits nowhere waits,
// with the reason; after PlaceTimeout it goes back where it was (store.AbortMove).
func (c *Controller) placeMove(ctx context.Context, sb *store.Sandbox, nodes []*store.Node, releases map[string]map[string]bool) {
	want := Want{Runtime: sb.Runtime, CPU: sb.Spec.CPU, MemoryMB: int64(sb.Spec.MemoryMB),
		DiskMB: store.DefaultDiskEstimateMB, Digest: sb.TemplateDigest}
	var shared []*store.Node
	for _, n := range nodes {
		if n.ID != sb.MoveFrom && hasRegistry(n) {
			shared = append(shared, n)
		}
	}
	n, why := Pick(shared, want, c.cfg.Placement, releases)
	if n == nil {
		if why == NoNodeAlive {
			why = "no other alive node shares the registry"
		}
		started := sb.UpdatedAt
		if sb.MoveStartedAt != nil {
			started = *sb.MoveStartedAt
		}
		if time.Since(started) > c.cfg.PlaceTimeout {
			if _, err := c.st.AbortMove(ctx, sb.ID, "no other node can take it: "+why, ids.Operation()); err != nil {
				c.log.Warn("abort move", "sandbox", sb.ID, "err", err)
			}
			return
		}
		c.waitForNode(ctx, sb, "moving: waiting for a node: "+why)
		return
	}
	if c.assign(ctx, sb, n, want) {
		c.log.Info("moving sandbox placed", "sandbox", sb.ID, "from", sb.MoveFrom, "node", n.Name)
		_ = c.st.ProgressSandboxOperations(ctx, sb.ID, sb.Generation, "moving to node "+n.Name)
	}
}

// hasRegistry reports whether a node pulls and pushes through the fleet's registry.
func hasRegistry(n *store.Node) bool {
	r, _ := n.RuntimeInfo["registry"].(bool)
	return r
}

// drains advances every open node_drain operation.
func (c *Controller) drains(ctx context.Context) {
	ops, err := c.st.OpenOperationsOfKind(ctx, api.OpNodeDrain)
	if err != nil {
		c.log.Warn("list drains", "err", err)
		return
	}
	for _, op := range ops {
		if err := c.drain1(ctx, op); err != nil && ctx.Err() == nil {
			c.log.Warn("drain", "op", op.ID, "err", err)
		}
	}
}

// Move states of a drain (api.SandboxMove.State).
const (
	moveMoving  = "moving"
	moveMoved   = "moved"
	moveFailed  = "failed"
	moveDeleted = "deleted"
)

// drain1 takes the next steps of one drain: it asks each running sandbox of the node
// to move (suspend with push), re-homes those whose snapshot is pushed, records what
// became of each, and finishes the drain once nothing runs on the node any more.
func (c *Controller) drain1(ctx context.Context, op *store.Operation) error {
	d, err := store.DecodeDrain(op.Params)
	if err != nil {
		return err
	}
	node, err := c.st.GetNode(ctx, d.Node)
	if err != nil {
		return c.st.UpdateDrain(ctx, op.ID, d, api.OpFailed, "failed", "the node was removed during the drain")
	}
	if node.State != store.NodeAlive {
		return c.st.UpdateDrain(ctx, op.ID, d, api.OpFailed, "failed",
			fmt.Sprintf("node %s died during the drain (%s); its suspended sandboxes wake on other nodes when woken", node.Name, node.DeadReason))
	}
	if !hasRegistry(node) {
		return c.st.UpdateDrain(ctx, op.ID, d, api.OpFailed, "failed",
			fmt.Sprintf("node %s has no registry (space serve --registry): its sandboxes cannot move; it stays cordoned", node.Name))
	}
	list, err := c.st.NodeSandboxes(ctx, d.Node)
	if err != nil {
		return err
	}
	here := map[string]bool{}
	for _, sb := range list {
		here[sb.ID] = true
		m := d.Moves[sb.ID]
		settled := sb.ObservedGeneration >= sb.Generation && sb.Transition == ""
		switch {
		case sb.DesiredState == api.StateDeleted:
			continue
		case sb.NodeID == "":
			continue // re-homed: waiting for, or on its way to, another node
		case m != nil && m.State == moveFailed:
			continue // reported; it stays
		case sb.PoolKey != "" && sb.ClaimedAt == nil && (sb.State == api.StateRunning || sb.State == api.StatePaused) && settled:
			// An unclaimed warm-pool member: its pool refills on another node.
			err = c.request(ctx, sb.ID, api.StateDeleted, api.OpDelete, "draining node "+node.Name+": warm-pool member removed",
				func(cur *store.Sandbox) bool { return cur.DesiredState != api.StateDeleted })
			d.Moves[sb.ID] = &api.SandboxMove{SandboxID: sb.ID, State: moveDeleted}
		case sb.MoveFrom == "" && settled && (sb.State == api.StateRunning || sb.State == api.StatePaused):
			if m != nil && m.State == moveMoving {
				// Its move was aborted: it runs here again (store.AbortMove).
				m.State, m.Error = moveFailed, sb.StatusReason
				continue
			}
			err = c.beginMove(ctx, sb, node)
			d.Moves[sb.ID] = &api.SandboxMove{SandboxID: sb.ID, State: moveMoving}
		case sb.MoveFrom == d.Node && sb.State == api.StateSuspended && settled && sb.SnapshotDigest != "":
			err = c.rehome(ctx, sb.ID, "draining node "+node.Name+": waking on another node")
		case sb.MoveFrom == d.Node && sb.State == api.StateSuspended && settled && sb.DesiredState == api.StateSuspended:
			// Suspended; its node pushes its snapshot.
		case sb.MoveFrom == d.Node && settled && sb.DesiredState == api.StateSuspended &&
			(sb.State == api.StateRunning || sb.State == api.StatePaused):
			// Its checkpoint was refused or failed and it ran on as it was (no room for
			// the snapshot; under gVisor a socket on its disk): it stays here, meant to
			// run again, reported.
			d.Moves[sb.ID] = &api.SandboxMove{SandboxID: sb.ID, State: moveFailed,
				Error: "its checkpoint failed; it runs on on node " + node.Name + ": " + sb.Error}
			kind := api.OpWake
			if sb.State == api.StatePaused {
				kind = api.OpPause
			}
			err = c.request(ctx, sb.ID, sb.State, kind, "draining node "+node.Name+": its move failed; it stays here",
				func(cur *store.Sandbox) bool { return cur.MoveFrom == d.Node && cur.DesiredState == api.StateSuspended })
			if err == nil {
				err = c.st.ClearMove(ctx, sb.ID)
			}
		case sb.MoveFrom == d.Node && settled && (sb.State == api.StateStopped || sb.State == api.StateFailed):
			// Its checkpoint failed and its memory was lost: it stays, reported.
			d.Moves[sb.ID] = &api.SandboxMove{SandboxID: sb.ID, State: moveFailed,
				Error: "its checkpoint failed; it is " + sb.State + " on node " + node.Name + ": " + sb.Error}
			err = c.st.ClearMove(ctx, sb.ID)
		}
		if err != nil {
			c.log.Warn("drain: move sandbox", "sandbox", sb.ID, "err", err)
			err = nil
		}
	}
	// Those no longer here moved (or were deleted).
	moving := 0
	for id, m := range d.Moves {
		if m.State != moveMoving {
			continue
		}
		if here[id] {
			moving++
			continue
		}
		sb, err := c.st.GetSandbox(ctx, id)
		switch {
		case err != nil || sb.DeletedAt != nil || sb.DesiredState == api.StateDeleted:
			m.State = moveDeleted
		case sb.MoveFrom == "" && sb.MovedAt != nil && sb.State == api.StateRunning:
			m.State, m.To, m.DowntimeMs = moveMoved, c.nodeName(ctx, sb.NodeID), sb.MoveDowntimeMs
		default:
			moving++ // restoring on its new node
		}
	}
	// Anything still running here that the drain has not asked to move yet (in a
	// transition) keeps the drain open.
	waiting := 0
	for _, sb := range list {
		if sb.NodeID != d.Node || sb.DesiredState == api.StateDeleted {
			continue
		}
		if m := d.Moves[sb.ID]; m != nil && m.State != moveMoving {
			continue
		}
		if sb.State != api.StateSuspended && sb.State != api.StateStopped && sb.State != api.StateFailed && d.Moves[sb.ID] == nil {
			waiting++
		}
	}
	msg, errMsg := summary(d)
	if moving > 0 || waiting > 0 {
		msg = fmt.Sprintf("draining node %s: %d moving, %d waiting for a transition to end; %s", node.Name, moving, waiting, msg)
		return c.st.UpdateDrain(ctx, op.ID, d, "", msg, "")
	}
	state := api.OpSucceeded
	if errMsg != "" {
		state = api.OpFailed
	}
	c.log.Info("drain finished", "node", node.Name, "result", msg, "err", errMsg)
	return c.st.UpdateDrain(ctx, op.ID, d, state, "node "+node.Name+" drained: "+msg, errMsg)
}

// summary describes a drain's moves: a message, and an error naming the sandboxes
// that could not move.
func summary(d *store.DrainParams) (string, string) {
	var moved, deleted int
	var downs []int64
	var failed []string
	for _, m := range d.Moves {
		switch m.State {
		case moveMoved:
			moved++
			downs = append(downs, m.DowntimeMs)
		case moveDeleted:
			deleted++
		case moveFailed:
			failed = append(failed, m.SandboxID+": "+m.Error)
		}
	}
	sort.Strings(failed)
	msg := fmt.Sprintf("%d moved", moved)
	if len(downs) > 0 {
		sort.Slice(downs, func(i, j int) bool { return downs[i] < downs[j] })
		var sum int64
		for _, x := range downs {
			sum += x
		}
		msg += fmt.Sprintf(" (downtime min %d ms, mean %d ms, max %d ms)", downs[0], sum/int64(len(downs)), downs[len(downs)-1])
	}
	if deleted > 0 {
		msg += fmt.Sprintf(", %d deleted", deleted)
	}
	if len(failed) > 0 {
		msg += fmt.Sprintf(", %d could not move", len(failed))
		return msg, "could not move: " + strings.Join(failed, "; ")
	}
	return msg, ""
}

// beginMove asks a running (or paused) sandbox to move off node: it is suspended, its
// node pushes the snapshot, and the drain re-homes it then.
func (c *Controller) beginMove(ctx context.Context, sb *store.Sandbox, node *store.Node) error {
	op := &store.Operation{ID: ids.Operation(), Kind: api.OpSuspend, Message: "draining node " + node.Name}
	return c.st.InTx(ctx, func(tx *store.Tx) error {
		cur, err := tx.GetSandboxForUpdate(ctx, sb.ID)
		if err != nil {
			return err
		}
		if cur.NodeID != node.ID || cur.MoveFrom != "" || cur.DeletedAt != nil || cur.Generation != sb.Generation {
			return nil // changed meanwhile: the next pass looks again
		}
		if err := tx.BeginMove(ctx, cur.ID, node.ID); err != nil {
			return err
		}
		cur.MoveFrom = node.ID
		return tx.SetDesiredState(ctx, cur, api.StateSuspended, "draining node "+node.Name+": moving to another node", op)
	})
}

// rehome re-homes a moving sandbox whose snapshot is pushed (store.Tx.Rehome).
func (c *Controller) rehome(ctx context.Context, id, reason string) error {
	op := &store.Operation{ID: ids.Operation(), Kind: api.OpWake, Message: reason}
	return c.st.InTx(ctx, func(tx *store.Tx) error {
		cur, err := tx.GetSandboxForUpdate(ctx, id)
		if err != nil {
			return err
		}
		if cur.State != api.StateSuspended || cur.SnapshotDigest == "" || cur.NodeID == "" || cur.MoveFrom != cur.NodeID ||
			cur.DeletedAt != nil || cur.DesiredState != api.StateSuspended {
			return nil
		}
		return tx.Rehome(ctx, cur, reason, op)
	})
}

// nodeName returns a node's name (its id if unknown).
func (c *Controller) nodeName(ctx context.Context, id string) string {
	if n, err := c.st.GetNode(ctx, id); err == nil {
		return n.Name
	}
	return id
}
