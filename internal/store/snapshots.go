package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
)

// Snapshot is a row of the snapshots table: a named snapshot of a sandbox's memory and
// disk, kept on the node that took it.
type Snapshot struct {
	ID             string
	Tenant         string
	Name           string
	State          string
	SourceSandbox  string
	TemplateRef    string
	TemplateDigest string
	// Spec is the source's spec (resources, env, runtime) that sandboxes made from the
	// snapshot get.
	Spec      SandboxSpec
	Runtime   string
	NodeID    string
	SizeBytes int64
	// OpID is the operation that takes the snapshot.
	OpID      string
	CreatedAt time.Time
	UpdatedAt time.Time
	ReadyAt   *time.Time
}

// API converts the row to its wire form.
func (s *Snapshot) API() api.Snapshot {
	return api.Snapshot{
		ID: s.ID, Name: s.Name, State: s.State, SourceSandbox: s.SourceSandbox, Template: s.TemplateRef,
		TemplateDigest: s.TemplateDigest, CPU: s.Spec.CPU, MemoryMB: s.Spec.MemoryMB, DiskMB: s.Spec.DiskMB,
		Runtime: s.Runtime, Node: s.NodeID, SizeBytes: s.SizeBytes, CreatedAt: s.CreatedAt, ReadyAt: s.ReadyAt,
	}
}

// SnapshotPayload prefixes the payload of a node channel notification about
// snapshots ("snapshot:<id>"): the node reconciles its snapshots. Sandbox ids never
// contain ':', so such a payload is never mistaken for one.
const SnapshotPayload = "snapshot:"

const snapshotCols = `id, tenant, name, state, source_sandbox, template_ref, template_digest, spec, runtime, node_id,
	size_bytes, op_id, created_at, updated_at, ready_at`

func scanSnapshot(row pgx.Row) (*Snapshot, error) {
	var s Snapshot
	var spec []byte
	if err := row.Scan(&s.ID, &s.Tenant, &s.Name, &s.State, &s.SourceSandbox, &s.TemplateRef, &s.TemplateDigest, &spec,
		&s.Runtime, &s.NodeID, &s.SizeBytes, &s.OpID, &s.CreatedAt, &s.UpdatedAt, &s.ReadyAt); err != nil {
		return nil, err
	}
	if err := json.Unmarshal(spec, &s.Spec); err != nil {
		return nil, fmt.Errorf("decode snapshot spec: %w", err)
	}
	return &s, nil
}

func collectSnapshots(rows pgx.Rows) ([]*Snapshot, error) {
	defer rows.Close()
	var out []*Snapshot
	for rows.Next() {
		s, err := scanSnapshot(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, s)
	}
	return out, rows.Err()
}

// InsertSnapshot records a new snapshot (state creating) with the operation that
// takes it, and wakes the node of the source. With replace, a snapshot of the tenant
// that has the name keeps existing under its id; without, a taken name is a
// fault.Conflict.
func (t *Tx) InsertSnapshot(ctx context.Context, s *Snapshot, op *Operation, replace bool) error {
	spec, err := json.Marshal(s.Spec)
	if err != nil {
		return err
	}
	if replace {
		if _, err := t.tx.Exec(ctx, `UPDATE snapshots SET name=id, updated_at=now()
			WHERE tenant=$1 AND name=$2 AND state <> 'deleting'`, s.Tenant, s.Name); err != nil {
			return fmt.Errorf("move snapshot name: %w", err)
		}
	}
	if err := t.InsertOperation(ctx, op); err != nil {
		return err
	}
	row := t.tx.QueryRow(ctx, `INSERT INTO snapshots (id, tenant, name, state, source_sandbox, template_ref,
		template_digest, spec, runtime, node_id, op_id) VALUES ($1,$2,$3,$4,$5,$6,$7,$8,$9,$10,$11) RETURNING `+snapshotCols,
		s.ID, s.Tenant, s.Name, api.SnapshotCreating, s.SourceSandbox, s.TemplateRef, s.TemplateDigest, spec, s.Runtime,
		s.NodeID, op.ID)
	got, err := scanSnapshot(row)
	if isUniqueViolation(err) {
		return fault.New(fault.Conflict, "a snapshot named %q exists already", s.Name)
	}
	if err != nil {
		return fmt.Errorf("insert snapshot: %w", err)
	}
	*s = *got
	return nil
}

// GetSnapshot returns a snapshot by id.
func (s *Store) GetSnapshot(ctx context.Context, id string) (*Snapshot, error) {
	sn, err := scanSnapshot(s.pool.QueryRow(ctx, `SELECT `+snapshotCols+` FROM snapshots WHERE id=$1`, id))
	if err != nil {
		return nil, notFound(err, "snapshot", id)
	}
	return sn, nil
}

// FindSnapshot returns the snapshot of tenant ("" for any tenant) named by ref: its id,
// else its name (snapshots being deleted have no name).
func (s *Store) FindSnapshot(ctx context.Context, tenant, ref string) (*Snapshot, error) {
	return findSnapshot(ctx, s.pool, tenant, ref, "")
}

// FindSnapshotForShare is FindSnapshot that locks the row against deletion (FOR
// SHARE) for the rest of the transaction.
func (t *Tx) FindSnapshotForShare(ctx context.Context, tenant, ref string) (*Snapshot, error) {
	return findSnapshot(ctx, t.tx, tenant, ref, " FOR SHARE")
}

// FindSnapshotForUpdate is FindSnapshot that locks the row for the rest of the
// transaction.
func (t *Tx) FindSnapshotForUpdate(ctx context.Context, tenant, ref string) (*Snapshot, error) {
	return findSnapshot(ctx, t.tx, tenant, ref, " FOR UPDATE")
}

func findSnapshot(ctx context.Context, q querier, tenant, ref, lock string) (*Snapshot, error) {
	sn, err := scanSnapshot(q.QueryRow(ctx, `SELECT `+snapshotCols+` FROM snapshots
		WHERE ($2='' OR tenant=$2) AND (id=$1 OR name=$1 AND state <> 'deleting')
		ORDER BY id=$1 DESC, created_at DESC LIMIT 1`+lock, ref, tenant))
	if err != nil {
		return nil, notFound(err, "snapshot", ref)
	}
	return sn, nil
}

// SnapshotFilter selects snapshots for ListSnapshots.
type SnapshotFilter struct {
	Tenant string // "" = every tenant
	// Source lists only snapshots of this sandbox.
	Source string
	// Name lists only the snapshot with this name or id.
	Name string
	// After continues a listing after the snapshot with this id (newest first).
	After string
	Limit int
}

// ListSnapshots lists snapshots, newest first.
func (s *Store) ListSnapshots(ctx context.Context, f SnapshotFilter) ([]*Snapshot, error) {
	var where []string
	var args []any
	arg := func(v any) string {
		args = append(args, v)
		return fmt.Sprintf("$%d", len(args))
	}
	if f.Tenant != "" {
		where = append(where, "tenant="+arg(f.Tenant))
	}
	if f.Source != "" {
		where = append(where, "source_sandbox="+arg(f.Source))
	}
	if f.Name != "" {
		a := arg(f.Name)
		where = append(where, "(id="+a+" OR name="+a+")")
	}
	if f.After != "" {
		a := arg(f.After)
		where = append(where, "(created_at, id) < (SELECT created_at, id FROM snapshots WHERE id="+a+")")
	}
	sql := `SELECT ` + snapshotCols + ` FROM snapshots`
	if len(where) > 0 {
		sql += " WHERE " + strings.Join(where, " AND ")
	}
	sql += " ORDER BY created_at DESC, id DESC"
	if f.Limit > 0 {
		sql += " LIMIT " + arg(f.Limit)
	}
	rows, err := s.pool.Query(ctx, sql, args...)
	if err != nil {
		return nil, fmt.Errorf("list snapshots: %w", err)
	}
	return collectSnapshots(rows)
}

// SnapshotsPending lists the snapshots of a sandbox that wait to be taken.
func (s *Store) SnapshotsPending(ctx context.Context, sourceID string) ([]*Snapshot, error) {
	rows, err := s.pool.Query(ctx, `SELECT `+snapshotCols+` FROM snapshots
		WHERE source_sandbox=$1 AND state=$2 ORDER BY created_at`, sourceID, api.SnapshotCreating)
	if err != nil {
		return nil, err
	}
	return collectSnapshots(rows)
}

// NodeSnapshots lists every snapshot a node holds or is to take.
func (s *Store) NodeSnapshots(ctx context.Context, nodeID string) ([]*Snapshot, error) {
	rows, err := s.pool.Query(ctx, `SELECT `+snapshotCols+` FROM snapshots WHERE node_id=$1 ORDER BY created_at`, nodeID)
	if err != nil {
		return nil, err
	}
	return collectSnapshots(rows)
}

// SnapshotReady records that a snapshot's files are complete: it becomes ready with its
// size and its operation succeeds, in one transaction. It returns false when the
// snapshot is no longer being created (deleted meanwhile): nothing changes then.
func (s *Store) SnapshotReady(ctx context.Context, id string, size int64) (bool, error) {
	var ok bool
	err := s.InTx(ctx, func(tx *Tx) error {
		var op string
		err := tx.tx.QueryRow(ctx, `UPDATE snapshots SET state=$2, size_bytes=$3, ready_at=now(), updated_at=now()
			WHERE id=$1 AND state=$4 RETURNING op_id`, id, api.SnapshotReady, size, api.SnapshotCreating).Scan(&op)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil
		}
		if err != nil {
			return err
		}
		ok = true
		return tx.finishOp(ctx, op, api.OpSucceeded, "done", "")
	})
	return ok, err
}

// FailSnapshot removes a snapshot that could not be taken and fails its operation
// with reason, in one transaction (its files must be gone already). A snapshot that is
// no longer being created is left alone.
func (s *Store) FailSnapshot(ctx context.Context, id, reason string) error {
	return s.InTx(ctx, func(tx *Tx) error {
		var op string
		err := tx.tx.QueryRow(ctx, `DELETE FROM snapshots WHERE id=$1 AND state=$2 RETURNING op_id`,
			id, api.SnapshotCreating).Scan(&op)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil
		}
		if err != nil {
			return err
		}
		return tx.finishOp(ctx, op, api.OpFailed, "failed", reason)
	})
}

// finishOp ends an open operation in tx and announces it.
func (t *Tx) finishOp(ctx context.Context, id, state, message, errMsg string) error {
	if id == "" {
		return nil
	}
	if _, err := t.tx.Exec(ctx, `UPDATE operations SET state=$2, message=$3, error=$4, updated_at=now(), done_at=now()
		WHERE id=$1 AND done_at IS NULL`, id, state, message, errMsg); err != nil {
		return fmt.Errorf("finish operation: %w", err)
	}
	return t.Notify(ctx, ChannelOperations, id)
}

// SnapshotUsers lists (up to 5) sandboxes being created from a snapshot: they still
// read its files.
func (t *Tx) SnapshotUsers(ctx context.Context, id string) ([]string, error) {
	rows, err := t.tx.Query(ctx, `SELECT id FROM sandboxes WHERE spec->>'snapshot'=$1 AND spec ? 'snapshot'
		AND deleted_at IS NULL AND state IN ('pending','creating') ORDER BY created_at LIMIT 5`, id)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// MarkSnapshotDeleting asks the snapshot's node to remove it (its name is free from
// now on) and wakes that node. A snapshot being taken fails: its operation says so.
func (t *Tx) MarkSnapshotDeleting(ctx context.Context, sn *Snapshot) error {
	if _, err := t.tx.Exec(ctx, `UPDATE snapshots SET state=$2, updated_at=now() WHERE id=$1`, sn.ID, api.SnapshotDeleting); err != nil {
		return fmt.Errorf("delete snapshot: %w", err)
	}
	if sn.State == api.SnapshotCreating {
		if err := t.finishOp(ctx, sn.OpID, api.OpFailed, "failed", "the snapshot was deleted before it was taken"); err != nil {
			return err
		}
	}
	sn.State = api.SnapshotDeleting
	return t.Notify(ctx, NodeChannel(sn.NodeID), SnapshotPayload+sn.ID)
}

// DeleteSnapshotRow removes a snapshot being deleted whose files are gone.
func (s *Store) DeleteSnapshotRow(ctx context.Context, id string) error {
	_, err := s.pool.Exec(ctx, `DELETE FROM snapshots WHERE id=$1 AND state=$2`, id, api.SnapshotDeleting)
	return err
}

// SnapshotBytes is the disk space the snapshots of a tenant hold ("" for every
// tenant); they count toward the tenant's disk like its sandboxes.
func (s *Store) SnapshotBytes(ctx context.Context, tenant string) (int64, error) {
	var n int64
	err := s.pool.QueryRow(ctx, `SELECT coalesce(sum(size_bytes),0)::bigint FROM snapshots WHERE $1='' OR tenant=$1`,
		tenant).Scan(&n)
	return n, err
}
