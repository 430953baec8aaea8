package store

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/spacedev/space/api"
)

// Operation is a row of the operations table.
type Operation struct {
	ID               string
	Kind             string
	SandboxID        string
	Tenant           string
	TargetGeneration int64
	State            string
	Message          string
	Error            string
	Params           map[string]any
	CreatedAt        time.Time
	UpdatedAt        time.Time
	DoneAt           *time.Time
	// Timeline holds the phases recorded for the operation (api.TimelineEntry without
	// Ms; API() adds "accepted" and "done" and the offsets).
	Timeline []Mark
}

// Mark is one recorded phase of an operation.
type Mark struct {
	Phase string    `json:"phase"`
	At    time.Time `json:"at"`
}

// API converts the row to its wire form.
func (o *Operation) API() *api.Operation {
	out := &api.Operation{
		ID: o.ID, Kind: o.Kind, SandboxID: o.SandboxID, State: o.State, Message: o.Message,
		Error: o.Error, CreatedAt: o.CreatedAt, UpdatedAt: o.UpdatedAt, DoneAt: o.DoneAt,
	}
	if o.Kind == api.OpTemplateBuild {
		out.Template, _ = o.Params["template"].(string)
	}
	if o.Kind == api.OpSnapshot {
		out.SandboxID, _ = o.Params["source"].(string)
		out.Snapshot, _ = o.Params["snapshot"].(string)
	}
	if o.Kind == api.OpNodeDrain {
		out.Node, out.Moves = drainOf(o.Params)
	}
	if len(o.Timeline) > 0 {
		at := func(phase string, t time.Time) api.TimelineEntry {
			return api.TimelineEntry{Phase: phase, At: t, Ms: float64(t.Sub(o.CreatedAt).Microseconds()) / 1000}
		}
		out.Timeline = append(out.Timeline, at("accepted", o.CreatedAt))
		for _, m := range o.Timeline {
			out.Timeline = append(out.Timeline, at(m.Phase, m.At))
		}
		if o.DoneAt != nil {
			out.Timeline = append(out.Timeline, at("done", *o.DoneAt))
		}
	}
	return out
}

const opCols = `id, kind, coalesce(sandbox_id,''), tenant, target_generation, state, message, error, params,
	created_at, updated_at, done_at, timeline`

func scanOp(row pgx.Row) (*Operation, error) {
	var o Operation
	var params, timeline []byte
	if err := row.Scan(&o.ID, &o.Kind, &o.SandboxID, &o.Tenant, &o.TargetGeneration, &o.State, &o.Message,
		&o.Error, &params, &o.CreatedAt, &o.UpdatedAt, &o.DoneAt, &timeline); err != nil {
		return nil, err
	}
	if len(timeline) > 2 {
		if err := json.Unmarshal(timeline, &o.Timeline); err != nil {
			return nil, fmt.Errorf("decode operation timeline: %w", err)
		}
	}
	if len(params) > 0 {
		if err := json.Unmarshal(params, &o.Params); err != nil {
			return nil, fmt.Errorf("decode operation params: %w", err)
		}
	}
	return &o, nil
}

// InsertOperation inserts op (ID, Kind, SandboxID, Tenant, TargetGeneration, State,
// Message, Params) and fills its timestamps.
func (t *Tx) InsertOperation(ctx context.Context, op *Operation) error {
	if op.State == "" {
		op.State = api.OpPending
	}
	params, err := json.Marshal(op.Params)
	if err != nil {
		return err
	}
	var sb any
	if op.SandboxID != "" {
		sb = op.SandboxID
	}
	timeline, err := marksJSON(op.Timeline)
	if err != nil {
		return err
	}
	row := t.tx.QueryRow(ctx, `INSERT INTO operations (id, kind, sandbox_id, tenant, target_generation, state, message, params, timeline)
		VALUES ($1,$2,$3,$4,$5,$6,$7,$8,$9) RETURNING `+opCols,
		op.ID, op.Kind, sb, op.Tenant, op.TargetGeneration, op.State, op.Message, params, timeline)
	got, err := scanOp(row)
	if err != nil {
		return fmt.Errorf("insert operation: %w", err)
	}
	*op = *got
	return nil
}

// CreateOperation inserts a standalone operation (e.g. a template build).
func (s *Store) CreateOperation(ctx context.Context, op *Operation) error {
	return s.InTx(ctx, func(tx *Tx) error {
		if err := tx.InsertOperation(ctx, op); err != nil {
			return err
		}
		return tx.Notify(ctx, ChannelOperations, op.ID)
	})
}

// GetOperation returns an operation by id.
func (s *Store) GetOperation(ctx context.Context, id string) (*Operation, error) {
	o, err := scanOp(s.pool.QueryRow(ctx, `SELECT `+opCols+` FROM operations WHERE id=$1`, id))
	if err != nil {
		return nil, notFound(err, "operation", id)
	}
	return o, nil
}

// OpenOperations lists the unfinished operations of a sandbox, oldest first.
func (s *Store) OpenOperations(ctx context.Context, sandboxID string) ([]*Operation, error) {
	rows, err := s.pool.Query(ctx, `SELECT `+opCols+` FROM operations WHERE sandbox_id=$1 AND done_at IS NULL ORDER BY created_at`, sandboxID)
	if err != nil {
		return nil, err
	}
	return collectOps(rows)
}

// OpenOperationsOfKind lists unfinished operations of one kind (e.g. template builds).
func (s *Store) OpenOperationsOfKind(ctx context.Context, kind string) ([]*Operation, error) {
	rows, err := s.pool.Query(ctx, `SELECT `+opCols+` FROM operations WHERE kind=$1 AND done_at IS NULL ORDER BY created_at`, kind)
	if err != nil {
		return nil, err
	}
	return collectOps(rows)
}

// marksJSON encodes recorded phases for the timeline column.
func marksJSON(marks []Mark) ([]byte, error) {
	if len(marks) == 0 {
		return []byte("[]"), nil
	}
	return json.Marshal(marks)
}

// UpdateOperation sets an operation's state and message; a terminal state also sets
// done_at and the error. Finished operations are never changed again. marks are
// appended to its timeline in the same statement.
func (s *Store) UpdateOperation(ctx context.Context, id, state, message, errMsg string, marks ...Mark) error {
	timeline, err := marksJSON(marks)
	if err != nil {
		return err
	}
	_, err = s.pool.Exec(ctx, `UPDATE operations SET state=$2, message=$3, error=$4, updated_at=now(),
		done_at = CASE WHEN $2 IN ('succeeded','failed') THEN now() ELSE NULL END,
		timeline = timeline || $5::jsonb
		WHERE id=$1 AND done_at IS NULL`, id, state, message, errMsg, timeline)
	if err != nil {
		return fmt.Errorf("update operation: %w", err)
	}
	_, err = s.pool.Exec(ctx, `SELECT pg_notify($1, $2)`, ChannelOperations, id)
	return err
}

// ProgressSandboxOperations sets the message (and running state) of a sandbox's open
// operations up to a generation.
func (s *Store) ProgressSandboxOperations(ctx context.Context, sandboxID string, upTo int64, message string) error {
	return s.finishOps(ctx, sandboxID, upTo, api.OpRunning, message, "")
}

// FinishSandboxOperations completes every open operation of the sandbox whose target
// generation is at most upTo.
func (s *Store) FinishSandboxOperations(ctx context.Context, sandboxID string, upTo int64, state, errMsg string) error {
	msg := "done"
	if state == api.OpFailed {
		msg = "failed"
	}
	return s.finishOps(ctx, sandboxID, upTo, state, msg, errMsg)
}

func (s *Store) finishOps(ctx context.Context, sandboxID string, upTo int64, state, message, errMsg string) error {
	rows, err := s.pool.Query(ctx, `UPDATE operations SET state=$3, message=$4, error=$5, updated_at=now(),
		done_at = CASE WHEN $3 IN ('succeeded','failed') THEN now() ELSE NULL END
		WHERE sandbox_id=$1 AND target_generation <= $2 AND done_at IS NULL RETURNING id`,
		sandboxID, upTo, state, message, errMsg)
	if err != nil {
		return fmt.Errorf("finish operations: %w", err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return err
	}
	for _, id := range ids {
		if _, err := s.pool.Exec(ctx, `SELECT pg_notify($1, $2)`, ChannelOperations, id); err != nil {
			return err
		}
	}
	return nil
}

// AppendOperationLog adds a line to an operation's log (build output, progress).
func (s *Store) AppendOperationLog(ctx context.Context, opID, line string) error {
	_, err := s.pool.Exec(ctx, `WITH l AS (INSERT INTO operation_log (op_id, line) VALUES ($1, $2))
		UPDATE operations SET updated_at=now() WHERE id=$1`, opID, line)
	if err != nil {
		return err
	}
	_, err = s.pool.Exec(ctx, `SELECT pg_notify($1, $2)`, ChannelOperations, opID)
	return err
}

// LogLine is one line of an operation log.
type LogLine struct {
	Seq  int64     `json:"seq"`
	At   time.Time `json:"at"`
	Line string    `json:"line"`
}

// OperationLog returns log lines after seq.
func (s *Store) OperationLog(ctx context.Context, opID string, after int64, limit int) ([]LogLine, error) {
	rows, err := s.pool.Query(ctx, `SELECT seq, at, line FROM operation_log WHERE op_id=$1 AND seq > $2 ORDER BY seq LIMIT $3`, opID, after, limit)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (LogLine, error) {
		var l LogLine
		err := r.Scan(&l.Seq, &l.At, &l.Line)
		return l, err
	})
}

// PurgeOperations removes finished operations older than before that no longer
// belong to a sandbox row's latest intent.
func (s *Store) PurgeOperations(ctx context.Context, before time.Time) (int64, error) {
	tag, err := s.pool.Exec(ctx, `DELETE FROM operations WHERE done_at < $1`, before)
	if err != nil {
		return 0, err
	}
	return tag.RowsAffected(), nil
}

// SandboxOperations lists a sandbox's operations, newest first.
func (s *Store) SandboxOperations(ctx context.Context, sandboxID string, limit int) ([]*Operation, error) {
	rows, err := s.pool.Query(ctx, `SELECT `+opCols+` FROM operations WHERE sandbox_id=$1 ORDER BY created_at DESC LIMIT $2`, sandboxID, limit)
	if err != nil {
		return nil, err
	}
	return collectOps(rows)
}

// collectOps scans every row of rows as an operation and closes rows.
func collectOps(rows pgx.Rows) ([]*Operation, error) {
	defer rows.Close()
	var out []*Operation
	for rows.Next() {
		o, err := scanOp(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, o)
	}
	return out, rows.Err()
}

// FinishOrphanOperations ends the open operations of deleted sandboxes: a delete
// succeeded, anything else failed (the sandbox is gone). A node records a sandbox's
// deletion and then its operations in two statements; when the database goes away
// between them nothing else would ever end those operations (a deleted sandbox is
// never planned again), so the controller's resync does. It returns how many it ended.
func (s *Store) FinishOrphanOperations(ctx context.Context) (int, error) {
	rows, err := s.pool.Query(ctx, `UPDATE operations o SET
			state = CASE WHEN o.kind = 'delete' THEN 'succeeded' ELSE 'failed' END,
			message = CASE WHEN o.kind = 'delete' THEN 'deleted' ELSE 'failed' END,
			error = CASE WHEN o.kind = 'delete' THEN o.error ELSE 'the sandbox was deleted before this operation ended' END,
			updated_at = now(), done_at = now()
		FROM sandboxes s
		WHERE o.sandbox_id = s.id AND o.done_at IS NULL AND s.deleted_at IS NOT NULL
		RETURNING o.id`)
	if err != nil {
		return 0, fmt.Errorf("finish orphan operations: %w", err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return 0, fmt.Errorf("finish orphan operations: %w", err)
	}
	for _, id := range ids {
		if _, err := s.pool.Exec(ctx, `SELECT pg_notify($1, $2)`, ChannelOperations, id); err != nil {
			return len(ids), err
		}
	}
	return len(ids), nil
}

// Pending is what waits on a sandbox besides its desired state: what a node's planner
// needs from the database next to the sandbox's row (lifecycle.Facts).
type Pending struct {
	// OpenOps: operations up to the generation asked about are not done.
	OpenOps bool
	// Clones: clones of the sandbox wait for it to prepare their snapshot.
	Clones bool
	// Snapshots: named snapshots of the sandbox wait to be taken.
	Snapshots bool
}

// PendingWork reports, in one round trip, whether the sandbox has unfinished
// operations whose target generation is at most upTo (a crash came between reaching a
// state and completing them), clones waiting for their snapshot (ClonesPending), and
// named snapshots waiting to be taken.
func (s *Store) PendingWork(ctx context.Context, sandboxID string, upTo int64) (Pending, error) {
	var p Pending
	err := s.pool.QueryRow(ctx, `SELECT
		EXISTS (SELECT 1 FROM operations WHERE sandbox_id=$1 AND done_at IS NULL AND target_generation <= $2),
		EXISTS (SELECT 1 FROM sandboxes WHERE clone_of=$1 AND NOT clone_ready AND deleted_at IS NULL AND desired_state <> 'deleted'),
		EXISTS (SELECT 1 FROM snapshots WHERE source_sandbox=$1 AND state=$3)`,
		sandboxID, upTo, api.SnapshotCreating).Scan(&p.OpenOps, &p.Clones, &p.Snapshots)
	if err != nil {
		return p, fmt.Errorf("pending work of sandbox %s: %w", sandboxID, err)
	}
	return p, nil
}
