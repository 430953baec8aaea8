package store

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
)

// NodeDiskFloorMB is the least disk, in MiB, a sandbox is charged on its node.
const NodeDiskFloorMB = 64

// Resources is an amount of what nodes offer sandboxes: vCPUs, memory and disk.
type Resources struct {
	CPU      int
	MemoryMB int64
	DiskMB   int64
}

// usedSQL computes, as an array [cpu, memory_mb, disk_mb], what the live sandboxes
// placed on node n take of it. CPU and memory: sandboxes that hold (or are about to
// hold) the node's memory — neither failed nor resting suspended or stopped.
// Disk is thin-provisioned (copy-on-write), so a sandbox is charged its measured
// exclusive use, at least NodeDiskFloorMB, plus its memory while it is (being)
// suspended (the memory snapshot); the disk_mb limit is the sandbox's disk quota's
// and the tenant quota's business (a 1 GiB floor per sandbox there would cap a 16 GiB
// store at 14 sandboxes).
var usedSQL = `(SELECT ARRAY[
		coalesce(sum((u.spec->>'cpu')::bigint) FILTER (WHERE u.holds), 0),
		coalesce(sum((u.spec->>'memory_mb')::bigint) FILTER (WHERE u.holds), 0),
		coalesce(sum(u.disk), 0)]::bigint[]
	FROM (SELECT s.spec,
		s.state NOT IN ('failed','deleted') AND (s.desired_state IN ('running','paused') OR s.state NOT IN ('suspended','stopped')) AS holds,
		GREATEST(s.disk_exclusive_bytes / 1048576, ` + strconv.Itoa(NodeDiskFloorMB) + `)
			+ CASE WHEN s.state IN ('suspending','suspended') OR s.desired_state = 'suspended' THEN (s.spec->>'memory_mb')::bigint ELSE 0 END AS disk
		FROM sandboxes s WHERE s.node_id = n.id AND s.deleted_at IS NULL) u)`

// FindNode returns the node named (or with the id) ref.
func (s *Store) FindNode(ctx context.Context, ref string) (*Node, error) {
	n, err := scanNode(s.pool.QueryRow(ctx, `SELECT `+nodeCols+` FROM nodes n WHERE n.name=$1 OR n.id=$1
		ORDER BY n.name=$1 DESC LIMIT 1`, ref))
	if err != nil {
		return nil, notFound(err, "node", ref)
	}
	return n, nil
}

// SetCordoned cordons (on) or uncordons a node: a cordoned node gets no new
// placements; what runs on it keeps running.
func (s *Store) SetCordoned(ctx context.Context, ref string, on bool) (*Node, error) {
	var id string
	err := s.pool.QueryRow(ctx, `UPDATE nodes SET cordoned=$2 WHERE id=(SELECT id FROM nodes WHERE name=$1 OR id=$1
		ORDER BY name=$1 DESC LIMIT 1) RETURNING id`, ref, on).Scan(&id)
	if err != nil {
		return nil, notFound(err, "node", ref)
	}
	if !on {
		// Pending sandboxes may fit now.
		_ = s.Notify(ctx, ChannelController, "")
	}
	return s.FindNode(ctx, id)
}

// DeadNode is a node MarkDeadNodes marked dead, with what became of its sandboxes.
type DeadNode struct {
	ID, Name string
	Reason   string
	// Lost sandboxes held the node's memory: they failed with the reason. Kept ones
	// rest suspended or stopped on the node's disk until it returns. Deleted ones were
	// being deleted: their deletion completed at once.
	Lost, Kept, Deleted int
}

// MarkDeadNodes marks alive nodes whose heartbeat is older than before as dead and
// fences them: their epoch is bumped, so the incarnation that stopped heartbeating
// can change nothing when it comes back (its heartbeat fails with ErrFenced, and its
// reports are refused while the node is dead). In the same transaction, the node's
// sandboxes are settled so that no request on them waits for the dead node: see
// settleOnDeadNode.
func (s *Store) MarkDeadNodes(ctx context.Context, before time.Time) ([]DeadNode, error) {
	var out []DeadNode
	err := s.InTx(ctx, func(tx *Tx) error {
		rows, err := tx.tx.Query(ctx, `SELECT id, name, heartbeat_at FROM nodes WHERE state='alive' AND heartbeat_at < $1
			ORDER BY name FOR UPDATE SKIP LOCKED`, before)
		if err != nil {
			return err
		}
		type cand struct {
			id, name string
			hb       time.Time
		}
		cands, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (cand, error) {
			var c cand
			return c, r.Scan(&c.id, &c.name, &c.hb)
		})
		if err != nil {
			return err
		}
		for _, c := range cands {
			d := DeadNode{ID: c.id, Name: c.name,
				Reason: fmt.Sprintf("node %s stopped sending heartbeats (last at %s)", c.name, c.hb.UTC().Format(time.RFC3339))}
			if _, err := tx.tx.Exec(ctx, `UPDATE nodes SET state='dead', epoch=epoch+1, dead_reason=$2 WHERE id=$1`, c.id, d.Reason); err != nil {
				return err
			}
			if d.Lost, d.Kept, d.Deleted, err = tx.settleOnDeadNode(ctx, c.id, "", d.Reason); err != nil {
				return err
			}
			// Named snapshots it was taking and template builds queued on it or
			// running there will not be finished.
			if _, err := tx.dropNodeSnapshots(ctx, c.id, true, "its node is dead: "+d.Reason); err != nil {
				return err
			}
			if err := tx.failNodeBuilds(ctx, c.id, "its node is dead: "+d.Reason); err != nil {
				return err
			}
			out = append(out, d)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("mark dead nodes: %w", err)
	}
	return out, nil
}

// settleOnDeadNode settles the live sandboxes of a dead node (only sandboxID when not
// empty), so that nothing waits for that node:
//   - a sandbox being deleted is deleted at once (the node removes what is left of it
//     when it returns: it reclaims whatever no live sandbox owns);
//   - one resting suspended or stopped keeps its state (its disk and snapshot are on
//     the node); a request in flight on it (a wake) fails with the reason;
//   - every other one held the node's memory: it is lost — failed, with the reason as
//     its error, and desired stopped, so it no longer counts as running against its
//     tenant's quotas. Its open operations fail with that reason.
func (t *Tx) settleOnDeadNode(ctx context.Context, nodeID, sandboxID, why string) (lost, kept, deleted int, err error) {
	only := nullable(sandboxID)
	deletedIDs, err := t.ids(ctx, `UPDATE sandboxes SET state='deleted', deleted_at=now(), observed_generation=generation,
		transition='', updated_at=now(), status_changed_at=now(), status_reason=$3
		WHERE node_id=$1 AND ($2::text IS NULL OR id=$2) AND deleted_at IS NULL AND desired_state='deleted' RETURNING id`,
		nodeID, only, "deleted at once: "+why)
	if err != nil {
		return 0, 0, 0, err
	}
	if err := t.endOps(ctx, deletedIDs, api.OpDelete, api.OpSucceeded, "deleted at once: "+why+
		"; the node removes what is left when it returns", ""); err != nil {
		return 0, 0, 0, err
	}
	if err := t.endOps(ctx, deletedIDs, "", api.OpFailed, "superseded", "the sandbox was deleted"); err != nil {
		return 0, 0, 0, err
	}
	keptIDs, err := t.ids(ctx, `UPDATE sandboxes SET desired_state=state, observed_generation=generation, transition='',
		updated_at=now(), status_reason='its node is dead: '||$3||'; it stays '||state||' on that node until the node returns'
		WHERE node_id=$1 AND ($2::text IS NULL OR id=$2) AND deleted_at IS NULL AND state IN ('suspended','stopped') RETURNING id`,
		nodeID, only, why)
	if err != nil {
		return 0, 0, 0, err
	}
	if err := t.endOps(ctx, keptIDs, "", api.OpFailed, "failed", "its node is dead: "+why+
		"; the sandbox stays on that node until the node returns"); err != nil {
		return 0, 0, 0, err
	}
	// Those with a periodic checkpoint in the registry are restored elsewhere (moves.go).
	restored, err := t.restoreFromCheckpoints(ctx, nodeID, only, why)
	if err != nil {
		return 0, 0, 0, err
	}
	lostReason := LostReason(why)
	lostIDs, err := t.ids(ctx, `UPDATE sandboxes SET state='failed', desired_state='stopped', error=$3, status_reason=$3,
		observed_generation=generation, transition='', updated_at=now(), status_changed_at=now()
		WHERE node_id=$1 AND ($2::text IS NULL OR id=$2) AND deleted_at IS NULL AND state NOT IN ('failed','suspended','stopped')
		RETURNING id`, nodeID, only, lostReason)
	if err != nil {
		return 0, 0, 0, err
	}
	if err := t.endOps(ctx, lostIDs, "", api.OpFailed, "failed", lostReason); err != nil {
		return 0, 0, 0, err
	}
	for _, group := range [][]string{deletedIDs, keptIDs, lostIDs} {
		for _, id := range group {
			if err := t.Notify(ctx, ChannelSandboxes, id); err != nil {
				return 0, 0, 0, err
			}
		}
	}
	return len(lostIDs), len(keptIDs) + len(restored), len(deletedIDs), nil
}

// LostReason is the error of a sandbox lost with its node (why: why the node is dead).
func LostReason(why string) string {
	return "lost: " + why + "; its memory and processes are gone (delete it)"
}

func (t *Tx) ids(ctx context.Context, sql string, args ...any) ([]string, error) {
	rows, err := t.tx.Query(ctx, sql, args...)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// endOps completes the open operations of the sandboxes (of kind, or of any kind when
// empty) and notifies their waiters.
func (t *Tx) endOps(ctx context.Context, sandboxes []string, kind, state, message, errMsg string) error {
	if len(sandboxes) == 0 {
		return nil
	}
	ops, err := t.ids(ctx, `UPDATE operations SET state=$3, message=$4, error=$5, updated_at=now(), done_at=now()
		WHERE sandbox_id = ANY($1) AND ($2 = '' OR kind = $2) AND done_at IS NULL RETURNING id`,
		sandboxes, kind, state, message, errMsg)
	if err != nil {
		return err
	}
	for _, id := range ops {
		if err := t.Notify(ctx, ChannelOperations, id); err != nil {
			return err
		}
	}
	return nil
}

// DeleteIfNodeDead completes, at once, the deletion just requested of sb when its node
// is dead (nothing would act on it there). It reports whether it did.
func (t *Tx) DeleteIfNodeDead(ctx context.Context, sb *Sandbox) (bool, error) {
	if sb.NodeID == "" {
		return false, nil
	}
	var state, why string
	err := t.tx.QueryRow(ctx, `SELECT state, dead_reason FROM nodes WHERE id=$1 FOR SHARE`, sb.NodeID).Scan(&state, &why)
	if err != nil || state != NodeDead {
		return false, err
	}
	_, _, n, err := t.settleOnDeadNode(ctx, sb.NodeID, sb.ID, why)
	return n == 1, err
}

// RemovedNode is what RemoveNode did.
type RemovedNode struct {
	Node *Node
	// Sandboxes counts the sandboxes that were still recorded on the (dead) node: they
	// are deleted with it.
	Sandboxes int
	// Snapshots counts the named snapshots that were kept on the node, deleted with it.
	Snapshots int
}

// dropNodeSnapshots deletes the named snapshots recorded on a node (only those being
// taken when creatingOnly) and fails the operations that were taking them with why.
func (t *Tx) dropNodeSnapshots(ctx context.Context, nodeID string, creatingOnly bool, why string) (int, error) {
	rows, err := t.tx.Query(ctx, `DELETE FROM snapshots WHERE node_id=$1 AND (NOT $2 OR state=$3) RETURNING coalesce(op_id,'')`,
		nodeID, creatingOnly, api.SnapshotCreating)
	if err != nil {
		return 0, err
	}
	ops, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return 0, err
	}
	for _, op := range ops {
		if err := t.finishOp(ctx, op, api.OpFailed, "failed", why); err != nil {
			return 0, err
		}
	}
	return len(ops), nil
}

// RemoveNode removes a node's row, freeing its name for a replacement. Only a dead
// node, or a cordoned one that holds no sandbox, can be removed (fault.Conflict
// otherwise). A dead node's remaining sandboxes (suspended or stopped on its disk,
// or lost) are deleted with it: what they held is on that host only. A removed node
// that comes back registers afresh and reclaims everything it holds.
func (s *Store) RemoveNode(ctx context.Context, ref string) (*RemovedNode, error) {
	n, err := s.FindNode(ctx, ref)
	if err != nil {
		return nil, err
	}
	out := &RemovedNode{Node: n}
	err = s.InTx(ctx, func(tx *Tx) error {
		var state string
		var cordoned bool
		if err := tx.tx.QueryRow(ctx, `SELECT state, cordoned FROM nodes WHERE id=$1 FOR UPDATE`, n.ID).Scan(&state, &cordoned); err != nil {
			return notFound(err, "node", ref)
		}
		var live int
		if err := tx.tx.QueryRow(ctx, `SELECT count(*) FROM sandboxes WHERE node_id=$1 AND deleted_at IS NULL`, n.ID).Scan(&live); err != nil {
			return err
		}
		if state == NodeAlive {
			if !cordoned {
				return fault.New(fault.Conflict, "node %s is alive and not cordoned: cordon it (space node cordon %s), "+
					"let its sandboxes be deleted, stop its process, then remove it", n.Name, n.Name)
			}
			if live > 0 {
				return fault.New(fault.Conflict, "node %s is alive and still holds %d sandbox(es): only an empty cordoned node, or a dead one, can be removed",
					n.Name, live)
			}
		}
		why := fmt.Sprintf("its node %s was removed (space node rm)", n.Name)
		ids, err := tx.ids(ctx, `UPDATE sandboxes SET state='deleted', desired_state='deleted', deleted_at=now(),
			observed_generation=generation, transition='', updated_at=now(), status_changed_at=now(), status_reason=$2,
			error=CASE WHEN error='' THEN $2 ELSE error END
			WHERE node_id=$1 AND deleted_at IS NULL RETURNING id`, n.ID, why)
		if err != nil {
			return err
		}
		out.Sandboxes = len(ids)
		if err := tx.endOps(ctx, ids, "", api.OpFailed, "failed", why); err != nil {
			return err
		}
		// Its named snapshots' files were on that host only.
		if out.Snapshots, err = tx.dropNodeSnapshots(ctx, n.ID, false, why); err != nil {
			return err
		}
		if err := tx.failNodeBuilds(ctx, n.ID, why); err != nil {
			return err
		}
		if _, err := tx.tx.Exec(ctx, `UPDATE sandboxes SET node_id=NULL WHERE node_id=$1`, n.ID); err != nil {
			return err
		}
		if _, err := tx.tx.Exec(ctx, `DELETE FROM nodes WHERE id=$1`, n.ID); err != nil {
			return err
		}
		for _, id := range ids {
			if err := tx.Notify(ctx, ChannelSandboxes, id); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// NodeReleases maps each node id to the template release digests the node holds.
func (s *Store) NodeReleases(ctx context.Context) (map[string]map[string]bool, error) {
	rows, err := s.pool.Query(ctx, `SELECT node_id, digest FROM node_releases`)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	out := map[string]map[string]bool{}
	for rows.Next() {
		var node, digest string
		if err := rows.Scan(&node, &digest); err != nil {
			return nil, err
		}
		if out[node] == nil {
			out[node] = map[string]bool{}
		}
		out[node][digest] = true
	}
	return out, rows.Err()
}

// SetPendingReason records on a sandbox that waits for a node why it waits.
func (s *Store) SetPendingReason(ctx context.Context, id, reason string) error {
	_, err := s.pool.Exec(ctx, `UPDATE sandboxes SET status_reason=$2 WHERE id=$1 AND node_id IS NULL
		AND deleted_at IS NULL AND status_reason <> $2`, id, reason)
	return err
}

// failNodeBuilds fails the unfinished template builds assigned to a node with why.
func (t *Tx) failNodeBuilds(ctx context.Context, nodeID, why string) error {
	ops, err := t.ids(ctx, `UPDATE operations SET state=$3, message='failed', error=$4, updated_at=now(), done_at=now()
		WHERE kind=$1 AND done_at IS NULL AND params->>'node'=$2 RETURNING id`, api.OpTemplateBuild, nodeID, api.OpFailed, why)
	if err != nil {
		return err
	}
	for _, id := range ops {
		if err := t.Notify(ctx, ChannelOperations, id); err != nil {
			return err
		}
	}
	return nil
}
