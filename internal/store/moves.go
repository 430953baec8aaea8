package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/spacedev/space/api"
)

// Moves: a suspended sandbox whose snapshot is in the fleet's registry
// (Sandbox.SnapshotDigest) can wake on another node. A move re-homes it: node_id
// becomes NULL (the scheduler places it like a new sandbox, on another node), move_from
// keeps the node it leaves, and the node it lands on pulls the snapshot and restores
// it (FinishMove records the downtime). The node it left never touches it again: its
// reconcile and its recovery after a restart both see a sandbox owned by another node
// and reclaim only what they hold of it.

// RecordSnapshotPush records the registry digest of a sandbox's suspend snapshot, if
// the sandbox is still suspended at generation gen on node nodeID (a wake since then
// made the snapshot stale: nothing is recorded) and the node is alive (fenced nodes
// record nothing). It reports whether it recorded.
func (s *Store) RecordSnapshotPush(ctx context.Context, id, nodeID string, gen int64, digest string) (bool, error) {
	tag, err := s.pool.Exec(ctx, `UPDATE sandboxes SET snapshot_digest=$4, snapshot_pushed_at=now()
		WHERE id=$1 AND node_id=$2 AND state='suspended' AND observed_generation=$3 AND deleted_at IS NULL
		AND EXISTS (SELECT 1 FROM nodes WHERE id=$2 AND state='alive')`, id, nodeID, gen, digest)
	if err != nil {
		return false, fmt.Errorf("record snapshot push: %w", err)
	}
	if tag.RowsAffected() == 0 {
		return false, nil
	}
	_, err = s.pool.Exec(ctx, `SELECT pg_notify($1, $2)`, ChannelController, id)
	return true, err
}

// Rehome takes a suspended sandbox with a pushed snapshot off its node (its node is
// dead, or being drained) and asks for it to run elsewhere: node_id becomes NULL and
// the scheduler places it (ChannelController is notified), desired becomes running
// with op (a wake) recording the request. sb must be locked by the transaction.
func (t *Tx) Rehome(ctx context.Context, sb *Sandbox, reason string, op *Operation) error {
	if sb.State != api.StateSuspended || sb.SnapshotDigest == "" || sb.NodeID == "" {
		return fmt.Errorf("rehome %s: not a suspended sandbox with a pushed snapshot on a node", sb.ID)
	}
	if _, err := t.tx.Exec(ctx, `UPDATE sandboxes SET node_id=NULL, move_from=$2,
		move_started_at=coalesce(CASE WHEN move_from=$2 THEN move_started_at END, now()), updated_at=now()
		WHERE id=$1`, sb.ID, sb.NodeID); err != nil {
		return fmt.Errorf("rehome %s: %w", sb.ID, err)
	}
	sb.MoveFrom, sb.NodeID = sb.NodeID, ""
	// The node it leaves drops what it holds of it (if it is alive to hear).
	if err := t.Notify(ctx, NodeChannel(sb.MoveFrom), sb.ID); err != nil {
		return err
	}
	return t.SetDesiredState(ctx, sb, api.StateRunning, reason, op)
}

// BeginMove marks a sandbox as moving off nodeID (a drain): its node pushes its suspend
// snapshot before anything else, and the controller re-homes it once pushed.
func (t *Tx) BeginMove(ctx context.Context, id, nodeID string) error {
	_, err := t.tx.Exec(ctx, `UPDATE sandboxes SET move_from=$2, move_started_at=now(), updated_at=now()
		WHERE id=$1 AND node_id=$2`, id, nodeID)
	return err
}

// MarkMoveDowntimeStart restarts the clock of a move (the moment the sandbox stops
// running: its checkpoint begins).
func (s *Store) MarkMoveDowntimeStart(ctx context.Context, id, nodeID string) error {
	_, err := s.pool.Exec(ctx, `UPDATE sandboxes SET move_started_at=now() WHERE id=$1 AND node_id=$2 AND move_from=$2`, id, nodeID)
	return err
}

// AbortMove ends a move that cannot go on (its snapshot could not be pushed, or no
// node can take it): the sandbox returns to the node it was leaving, move_from is
// cleared and why becomes its status reason. If that node is alive the sandbox is
// woken there (a drain leaves it running where it was, reported, not lost); on a dead
// node it stays suspended, as before the wake, and its open operations fail with why.
// opID names the wake's operation.
func (s *Store) AbortMove(ctx context.Context, id, why, opID string) (bool, error) {
	var done bool
	err := s.InTx(ctx, func(tx *Tx) error {
		sb, err := tx.GetSandboxForUpdate(ctx, id)
		if err != nil {
			return err
		}
		if sb.MoveFrom == "" || sb.DeletedAt != nil || sb.DesiredState == api.StateDeleted ||
			sb.State != api.StateSuspended {
			return nil
		}
		var alive bool
		if err := tx.tx.QueryRow(ctx, `SELECT state='alive' FROM nodes WHERE id=$1`, sb.MoveFrom).Scan(&alive); err != nil {
			alive = false
		}
		if _, err := tx.tx.Exec(ctx, `UPDATE sandboxes SET node_id=$2, move_from='', move_started_at=NULL, updated_at=now()
			WHERE id=$1`, id, sb.MoveFrom); err != nil {
			return err
		}
		sb.NodeID, sb.MoveFrom = sb.MoveFrom, ""
		done = true
		if alive {
			if err := tx.endOps(ctx, []string{id}, "", api.OpFailed, "failed", why); err != nil {
				return err
			}
			return tx.SetDesiredState(ctx, sb, api.StateRunning, why, &Operation{ID: opID, Kind: api.OpWake, Message: why})
		}
		if _, err := tx.tx.Exec(ctx, `UPDATE sandboxes SET desired_state=state, observed_generation=generation,
			status_reason=$2, updated_at=now() WHERE id=$1`, id, why); err != nil {
			return err
		}
		if err := tx.endOps(ctx, []string{id}, "", api.OpFailed, "failed", why); err != nil {
			return err
		}
		return tx.Notify(ctx, ChannelSandboxes, id)
	})
	return done, err
}

// FinishMove records that a moving sandbox runs on nodeID now: moved_at, the downtime
// (since MoveStartedAt), the move in its status reason, and clears the move. It returns
// the downtime in milliseconds and the move's note (-1 and "" when the sandbox was not
// moving).
func (s *Store) FinishMove(ctx context.Context, id, nodeID string) (int64, string, error) {
	ms, note := int64(-1), ""
	err := s.pool.QueryRow(ctx, `UPDATE sandboxes s SET moved_at=now(),
			move_downtime_ms=GREATEST(0, (extract(epoch FROM now()-coalesce(s.move_started_at, now()))*1000)::bigint),
			move_from='', move_started_at=NULL,
			status_reason='moved from node '||coalesce((SELECT name FROM nodes WHERE id=s.move_from), s.move_from)||' to node '||
				coalesce((SELECT name FROM nodes WHERE id=$2), $2)||'; downtime '||
				GREATEST(0, (extract(epoch FROM now()-coalesce(s.move_started_at, now()))*1000)::bigint)||' ms'
			WHERE s.id=$1 AND s.node_id=$2 AND s.move_from<>'' RETURNING s.move_downtime_ms, s.status_reason`, id, nodeID).Scan(&ms, &note)
	if errors.Is(err, pgx.ErrNoRows) {
		return -1, "", nil
	}
	if err != nil {
		return -1, "", fmt.Errorf("finish move: %w", err)
	}
	return ms, note, nil
}

// NoteWakeOperation appends note to the message of the sandbox's latest operation
// that woke it (wake, restore, resume, start).
func (s *Store) NoteWakeOperation(ctx context.Context, id, note string) error {
	_, err := s.pool.Exec(ctx, `UPDATE operations SET message=message||'; '||$2
		WHERE id=(SELECT id FROM operations WHERE sandbox_id=$1 AND kind IN ('wake','restore','resume','start')
			ORDER BY created_at DESC LIMIT 1)`, id, note)
	if err == nil {
		_, err = s.pool.Exec(ctx, `SELECT pg_notify($1, $2)`, ChannelSandboxes, id)
	}
	return err
}

// MovingSandboxes lists the sandboxes a move took off their node that wait for a new
// one (node_id NULL, move_from set).
func (s *Store) MovingSandboxes(ctx context.Context, limit int) ([]*Sandbox, error) {
	rows, err := s.pool.Query(ctx, `SELECT `+sandboxCols+` FROM sandboxes
		WHERE node_id IS NULL AND move_from<>'' AND deleted_at IS NULL ORDER BY move_started_at LIMIT $1`, limit)
	if err != nil {
		return nil, err
	}
	return collectSandboxes(rows)
}

// NodeSandboxes lists the live sandboxes on a node and those moving off it.
func (s *Store) NodeSandboxes(ctx context.Context, nodeID string) ([]*Sandbox, error) {
	rows, err := s.pool.Query(ctx, `SELECT `+sandboxCols+` FROM sandboxes
		WHERE (node_id=$1 OR (node_id IS NULL AND move_from=$1)) AND deleted_at IS NULL ORDER BY created_at`, nodeID)
	if err != nil {
		return nil, err
	}
	return collectSandboxes(rows)
}

// DrainParams is what a node_drain operation keeps in its params.
type DrainParams struct {
	Node     string                      `json:"node"`
	NodeName string                      `json:"node_name"`
	Moves    map[string]*api.SandboxMove `json:"moves"`
}

// drainOf decodes a drain operation's params for the API (moves sorted by sandbox).
func drainOf(params map[string]any) (string, []api.SandboxMove) {
	d, err := DecodeDrain(params)
	if err != nil {
		return "", nil
	}
	out := make([]api.SandboxMove, 0, len(d.Moves))
	for _, m := range d.Moves {
		out = append(out, *m)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].SandboxID < out[j].SandboxID })
	return d.NodeName, out
}

// DecodeDrain decodes a drain operation's params.
func DecodeDrain(params map[string]any) (*DrainParams, error) {
	b, err := json.Marshal(params)
	if err != nil {
		return nil, err
	}
	var d DrainParams
	if err := json.Unmarshal(b, &d); err != nil {
		return nil, err
	}
	if d.Moves == nil {
		d.Moves = map[string]*api.SandboxMove{}
	}
	return &d, nil
}

// UpdateDrain records a drain operation's params and message, and, when state is not
// empty, finishes it.
func (s *Store) UpdateDrain(ctx context.Context, id string, d *DrainParams, state, message, errMsg string) error {
	b, err := json.Marshal(d)
	if err != nil {
		return err
	}
	done := state == api.OpSucceeded || state == api.OpFailed
	if state == "" {
		state = api.OpRunning
	}
	tag, err := s.pool.Exec(ctx, `UPDATE operations SET params=$2, message=$3, error=$4, state=$5, updated_at=now(),
		done_at=CASE WHEN $6 THEN now() ELSE done_at END WHERE id=$1 AND done_at IS NULL`, id, b, message, errMsg, state, done)
	if err != nil {
		return fmt.Errorf("update drain: %w", err)
	}
	if tag.RowsAffected() == 1 {
		_, err = s.pool.Exec(ctx, `SELECT pg_notify($1, $2)`, ChannelOperations, id)
	}
	return err
}

// KickController wakes the controller leader (a drain was asked for).
func (s *Store) KickController(ctx context.Context) error {
	_, err := s.pool.Exec(ctx, `SELECT pg_notify($1, '')`, ChannelController)
	return err
}

// ClearMove ends a move that stays where it is (its checkpoint failed and the sandbox
// is stopped there): nothing moves it any more.
func (s *Store) ClearMove(ctx context.Context, id string) error {
	_, err := s.pool.Exec(ctx, `UPDATE sandboxes SET move_from='', move_started_at=NULL WHERE id=$1 AND node_id IS NOT NULL`, id)
	return err
}

// RecordSnapshotArtifact records the registry digest of a ready named snapshot (false
// when it is gone or no longer ready).
func (s *Store) RecordSnapshotArtifact(ctx context.Context, id, digest string) (bool, error) {
	tag, err := s.pool.Exec(ctx, `UPDATE snapshots SET registry_digest=$2, updated_at=now() WHERE id=$1 AND state='ready'`, id, digest)
	if err != nil {
		return false, fmt.Errorf("record snapshot artifact: %w", err)
	}
	return tag.RowsAffected() == 1, nil
}

// SnapshotArtifact returns the registry digest of a named snapshot ("" when it is not
// pushed).
func (s *Store) SnapshotArtifact(ctx context.Context, id string) (string, error) {
	var d string
	err := s.pool.QueryRow(ctx, `SELECT registry_digest FROM snapshots WHERE id=$1`, id).Scan(&d)
	if err != nil {
		return "", notFound(err, "snapshot", id)
	}
	return d, nil
}

// RecordCheckpointPush records the registry digest of a running sandbox's periodic
// checkpoint, taken at at, if the sandbox still runs on nodeID and the node is alive.
func (s *Store) RecordCheckpointPush(ctx context.Context, id, nodeID, digest string, at time.Time) (bool, error) {
	tag, err := s.pool.Exec(ctx, `UPDATE sandboxes SET checkpoint_digest=$3, checkpoint_at=$4
		WHERE id=$1 AND node_id=$2 AND deleted_at IS NULL AND desired_state<>'deleted'
		AND (checkpoint_at IS NULL OR checkpoint_at < $4)
		AND EXISTS (SELECT 1 FROM nodes WHERE id=$2 AND state='alive')`, id, nodeID, digest, at)
	if err != nil {
		return false, fmt.Errorf("record checkpoint push: %w", err)
	}
	return tag.RowsAffected() == 1, nil
}

// restoreFromCheckpoints re-homes the sandboxes of a dead node that hold its memory
// (running or paused, or in a transition) and have a pushed periodic checkpoint: they
// become suspended from that checkpoint, with no node, moving off the dead one, desired
// running, so the scheduler places them on another node which restores them
// (store.Tx.Rehome's path). checkpoint_loss_ms records what they lost. Their open
// operations fail with the reason. It returns their ids.
func (t *Tx) restoreFromCheckpoints(ctx context.Context, nodeID string, only any, why string) ([]string, error) {
	ids, err := t.ids(ctx, `UPDATE sandboxes SET state='suspended', desired_state='running', node_id=NULL, move_from=$1,
		move_started_at=now(), snapshot_digest=checkpoint_digest,
		checkpoint_loss_ms=GREATEST(0, (extract(epoch FROM now()-checkpoint_at)*1000)::bigint),
		observed_generation=generation, generation=generation+1, transition='', updated_at=now(), status_changed_at=now(),
		status_reason='its node died ('||$3||'): restored on another node from its checkpoint of '||
			to_char(checkpoint_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"')||'; what it did since was lost'
		WHERE node_id=$1 AND ($2::text IS NULL OR id=$2) AND deleted_at IS NULL AND desired_state<>'deleted'
		AND state NOT IN ('failed','suspended','stopped','pending') AND checkpoint_digest<>''
		RETURNING id`, nodeID, only, why)
	if err != nil {
		return nil, err
	}
	if err := t.endOps(ctx, ids, "", api.OpFailed, "failed", "its node died ("+why+"); it is restored on another node from its last checkpoint"); err != nil {
		return nil, err
	}
	for _, id := range ids {
		if err := t.Notify(ctx, ChannelController, id); err != nil {
			return nil, err
		}
	}
	return ids, nil
}

// moveAPI fills the wire form's move and checkpoint fields.
func (s *Sandbox) moveAPI(out *api.Sandbox) {
	out.SnapshotPushed = s.SnapshotDigest != ""
	out.MovedAt, out.MoveDowntimeMs = s.MovedAt, s.MoveDowntimeMs
	out.CheckpointAt, out.CheckpointLossMs = s.CheckpointAt, s.CheckpointLossMs
	if s.Spec.CheckpointInterval > 0 {
		out.CheckpointInterval = (time.Duration(s.Spec.CheckpointInterval) * time.Second).String()
	}
}
