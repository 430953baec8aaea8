package store

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/lifecycle"
)

// SandboxSpec is the part of a sandbox's desired state that the node needs to run it.
type SandboxSpec struct {
	CPU      int               `json:"cpu"`
	MemoryMB int               `json:"memory_mb"`
	DiskMB   int               `json:"disk_mb,omitempty"`
	Env      map[string]string `json:"env,omitempty"`
	Runtime  string            `json:"runtime,omitempty"`
	// Network is the sandbox's network policy; nil: no network at all (no network
	// namespace). A sandbox created with one keeps its namespace for life, also when a
	// later policy turns egress off.
	Network *api.Network `json:"network_policy,omitempty"`
	// FreshBoot skips warm pools and base snapshots.
	FreshBoot bool `json:"fresh_boot,omitempty"`
	// Snapshot is the named snapshot the sandbox is created from (restored instead of
	// made from its template).
	Snapshot string `json:"snapshot,omitempty"`
	// CheckpointInterval (seconds) asks its node to checkpoint it this often and push
	// the checkpoint to the registry (0: never).
	CheckpointInterval int `json:"checkpoint_interval,omitempty"`
}

// Sandbox is a row of the sandboxes table.
type Sandbox struct {
	ID                 string
	Tenant             string
	TemplateRef        string
	TemplateDigest     string
	Spec               SandboxSpec
	Metadata           map[string]string
	DesiredState       string
	State              string
	Generation         int64
	ObservedGeneration int64
	NodeID             string
	Runtime            string
	StartPath          string
	Error              string
	TokenEpoch         int64
	CreatedAt          time.Time
	UpdatedAt          time.Time
	ExpiresAt          *time.Time
	DeletedAt          *time.Time
	IdleTimeout        time.Duration
	LastActivityAt     time.Time
	StatusReason       string
	StatusChangedAt    *time.Time
	CloneOf            string
	CloneBatch         string
	CloneReady         bool
	PoolKey            string
	ClaimedAt          *time.Time
	DiskExclusiveBytes int64
	IdentityGeneration int64
	// ExpireAction is what happens at ExpiresAt: "delete", "suspend" or "stop".
	ExpireAction string
	// Transition is what the node is in the middle of ("" when resting).
	Transition lifecycle.Transition
	// AccessEpoch is what the sandbox's E2B envd access token is bound to.
	AccessEpoch int64
	// SnapshotDigest is the registry artifact of its current suspend snapshot ("" when
	// none is pushed); see moves.go.
	SnapshotDigest string
	// MoveFrom is the node a move in progress takes it off; MoveStartedAt when it began.
	MoveFrom      string
	MoveStartedAt *time.Time
	// MovedAt and MoveDowntimeMs describe its last completed move.
	MovedAt        *time.Time
	MoveDowntimeMs int64
	// CheckpointAt is when its last periodic checkpoint was pushed; CheckpointLossMs
	// how much a restore from one lost (moves.go).
	CheckpointAt     *time.Time
	CheckpointLossMs int64
}

// Lifecycle is the state machine's view of the row.
func (s *Sandbox) Lifecycle() lifecycle.Sandbox {
	return lifecycle.Sandbox{ID: s.ID, State: s.State, Desired: s.DesiredState, Generation: s.Generation,
		ObservedGeneration: s.ObservedGeneration, Deleted: s.DeletedAt != nil, Error: s.Error}
}

// API converts the row to its wire form.
func (s *Sandbox) API() api.Sandbox {
	out := api.Sandbox{
		ID:             s.ID,
		Tenant:         s.Tenant,
		Template:       s.TemplateRef,
		TemplateDigest: s.TemplateDigest,
		State:          s.State,
		DesiredState:   s.DesiredState,
		CPU:            s.Spec.CPU,
		MemoryMB:       s.Spec.MemoryMB,
		DiskMB:         s.Spec.DiskMB,
		Env:            s.Spec.Env,
		Metadata:       s.Metadata,
		Runtime:        s.Runtime,
		Node:           s.NodeID,
		StartPath:      s.StartPath,
		Error:          s.Error,
		CreatedAt:      s.CreatedAt,
		UpdatedAt:      s.UpdatedAt,
		ExpiresAt:      s.ExpiresAt,
		IdleTimeout:    s.IdleTimeout.String(),
		LastActivityAt: s.LastActivityAt,
		StatusReason:   s.StatusReason,
		StatusAt:       s.StatusChangedAt,
		CloneOf:        s.CloneOf,
		Snapshot:       s.Spec.Snapshot,
		DiskBytes:      s.DiskExclusiveBytes,
		Network:        s.Spec.Network.Redacted(),
	}
	s.moveAPI(&out) // moves.go
	return out
}

const sandboxCols = `id, tenant, template_ref, coalesce(template_digest,''), spec, metadata, desired_state, state,
	generation, observed_generation, coalesce(node_id,''), runtime, start_path, error, token_epoch,
	created_at, updated_at, expires_at, deleted_at, idle_timeout_seconds, last_activity_at, status_reason,
	status_changed_at, coalesce(clone_of,''), coalesce(clone_batch,''), clone_ready, coalesce(pool_key,''), claimed_at,
	disk_exclusive_bytes, identity_generation, expire_action, transition, access_epoch,
	snapshot_digest, move_from, move_started_at, moved_at, move_downtime_ms, checkpoint_at, checkpoint_loss_ms`

func scanSandbox(row pgx.Row) (*Sandbox, error) {
	var s Sandbox
	var spec, meta []byte
	var idle int64
	err := row.Scan(&s.ID, &s.Tenant, &s.TemplateRef, &s.TemplateDigest, &spec, &meta, &s.DesiredState, &s.State,
		&s.Generation, &s.ObservedGeneration, &s.NodeID, &s.Runtime, &s.StartPath, &s.Error, &s.TokenEpoch,
		&s.CreatedAt, &s.UpdatedAt, &s.ExpiresAt, &s.DeletedAt, &idle, &s.LastActivityAt, &s.StatusReason,
		&s.StatusChangedAt, &s.CloneOf, &s.CloneBatch, &s.CloneReady, &s.PoolKey, &s.ClaimedAt,
		&s.DiskExclusiveBytes, &s.IdentityGeneration, &s.ExpireAction, &s.Transition, &s.AccessEpoch,
		&s.SnapshotDigest, &s.MoveFrom, &s.MoveStartedAt, &s.MovedAt, &s.MoveDowntimeMs, &s.CheckpointAt, &s.CheckpointLossMs)
	if err != nil {
		return nil, err
	}
	s.IdleTimeout = time.Duration(idle) * time.Second
	if err := json.Unmarshal(spec, &s.Spec); err != nil {
		return nil, fmt.Errorf("decode sandbox spec: %w", err)
	}
	if err := json.Unmarshal(meta, &s.Metadata); err != nil {
		return nil, fmt.Errorf("decode sandbox metadata: %w", err)
	}
	return &s, nil
}

func collectSandboxes(rows pgx.Rows) ([]*Sandbox, error) {
	defer rows.Close()
	var out []*Sandbox
	for rows.Next() {
		s, err := scanSandbox(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, s)
	}
	return out, rows.Err()
}

// CreateSandbox inserts a new sandbox together with its create operation and wakes the
// controller, all in tx.
func (t *Tx) CreateSandbox(ctx context.Context, s *Sandbox, op *Operation) error {
	spec, meta, err := encodeSpec(s)
	if err != nil {
		return err
	}
	var digest any
	if s.TemplateDigest != "" {
		digest = s.TemplateDigest
	}
	idle := idleSeconds(s.IdleTimeout)
	row := t.tx.QueryRow(ctx, `INSERT INTO sandboxes (id, tenant, template_ref, template_digest, spec, metadata,
		desired_state, state, expires_at, idle_timeout_seconds, clone_of, clone_batch, pool_key, node_id, runtime,
		expire_action)
		VALUES ($1,$2,$3,$4,$5,$6,$7,$8,$9,$10,$11,$12,$13,$14,$15,$16)
		RETURNING `+sandboxCols,
		s.ID, s.Tenant, s.TemplateRef, digest, spec, meta, s.DesiredState, s.State, s.ExpiresAt, idle,
		nullable(s.CloneOf), nullable(s.CloneBatch), nullable(s.PoolKey), nullable(s.NodeID), s.Runtime, expireAction(s.ExpireAction))
	got, err := scanSandbox(row)
	if err != nil {
		return fmt.Errorf("insert sandbox: %w", err)
	}
	*s = *got
	op.SandboxID = s.ID
	op.TargetGeneration = s.Generation
	if err := t.InsertOperation(ctx, op); err != nil {
		return err
	}
	if err := t.Notify(ctx, ChannelSandboxes, s.ID); err != nil {
		return err
	}
	return t.NotifySandbox(ctx, s)
}

// DefaultIdleTimeout is the idle timeout of sandboxes that ask for none.
const DefaultIdleTimeout = 6 * time.Hour

func nullable(s string) any {
	if s == "" {
		return nil
	}
	return s
}

func nonNil(m map[string]string) map[string]string {
	if m == nil {
		return map[string]string{}
	}
	return m
}

// GetSandbox returns a sandbox by id (including deleted ones still retained).
func (s *Store) GetSandbox(ctx context.Context, id string) (*Sandbox, error) {
	return getSandbox(ctx, s.pool, id, false)
}

// GetSandboxForUpdate locks the sandbox row for the rest of the transaction.
func (t *Tx) GetSandboxForUpdate(ctx context.Context, id string) (*Sandbox, error) {
	return getSandbox(ctx, t.tx, id, true)
}

func getSandbox(ctx context.Context, q querier, id string, lock bool) (*Sandbox, error) {
	sql := `SELECT ` + sandboxCols + ` FROM sandboxes WHERE id=$1`
	if lock {
		sql += ` FOR UPDATE`
	}
	s, err := scanSandbox(q.QueryRow(ctx, sql, id))
	if err != nil {
		return nil, notFound(err, "sandbox", id)
	}
	return s, nil
}

// SandboxFilter selects sandboxes for ListSandboxes.
type SandboxFilter struct {
	Tenant         string // empty = all tenants
	States         []string
	Metadata       map[string]string
	IncludeDeleted bool
	NodeID         string
	Limit          int
	// IncludePool lists warm-pool members too (they are hidden from users).
	IncludePool bool
}

// ListSandboxes lists sandboxes, newest first.
func (s *Store) ListSandboxes(ctx context.Context, f SandboxFilter) ([]*Sandbox, error) {
	var where []string
	var args []any
	arg := func(v any) string {
		args = append(args, v)
		return fmt.Sprintf("$%d", len(args))
	}
	if f.Tenant != "" {
		where = append(where, "tenant="+arg(f.Tenant))
	}
	if len(f.States) > 0 {
		where = append(where, "state = ANY("+arg(f.States)+")")
	}
	if len(f.Metadata) > 0 {
		b, _ := json.Marshal(f.Metadata)
		where = append(where, "metadata @> "+arg(string(b))+"::jsonb")
	}
	if !f.IncludeDeleted {
		where = append(where, "deleted_at IS NULL")
	}
	if f.NodeID != "" {
		where = append(where, "node_id="+arg(f.NodeID))
	}
	if !f.IncludePool {
		where = append(where, "pool_key IS NULL")
	}
	sql := `SELECT ` + sandboxCols + ` FROM sandboxes`
	if len(where) > 0 {
		sql += " WHERE " + strings.Join(where, " AND ")
	}
	sql += " ORDER BY created_at DESC, id"
	if f.Limit > 0 {
		sql += " LIMIT " + arg(f.Limit)
	}
	rows, err := s.pool.Query(ctx, sql, args...)
	if err != nil {
		return nil, fmt.Errorf("list sandboxes: %w", err)
	}
	return collectSandboxes(rows)
}

// CountSandboxesByState counts live sandboxes per observed state.
func (s *Store) CountSandboxesByState(ctx context.Context) (map[string]int, error) {
	rows, err := s.pool.Query(ctx, `SELECT state, count(*) FROM sandboxes WHERE deleted_at IS NULL GROUP BY state`)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	out := map[string]int{}
	for rows.Next() {
		var st string
		var n int
		if err := rows.Scan(&st, &n); err != nil {
			return nil, err
		}
		out[st] = n
	}
	return out, rows.Err()
}

// SetDesiredState records new intent for a sandbox: desired state, a bumped generation,
// why (shown on the sandbox when not empty) and the operation that tracks it, then wakes
// whoever acts on it. A desired state that ends the sandbox's processes' reachability
// (lifecycle.RevokesTokens) bumps its token epoch. It runs inside tx so that callers
// can check the current state first (GetSandboxForUpdate).
func (t *Tx) SetDesiredState(ctx context.Context, s *Sandbox, desired, reason string, op *Operation) error {
	revoke := lifecycle.RevokesTokens(desired)
	row := t.tx.QueryRow(ctx, `UPDATE sandboxes SET desired_state=$2, generation=generation+1, updated_at=now(),
		token_epoch = CASE WHEN $4 THEN token_epoch+1 ELSE token_epoch END,
		status_reason = CASE WHEN $3 <> '' THEN $3 ELSE status_reason END,
		last_activity_at = now()
		WHERE id=$1 RETURNING `+sandboxCols, s.ID, desired, reason, revoke)
	got, err := scanSandbox(row)
	if err != nil {
		return fmt.Errorf("set desired state: %w", err)
	}
	*s = *got
	op.SandboxID = s.ID
	op.TargetGeneration = s.Generation
	op.Tenant = s.Tenant
	if err := t.InsertOperation(ctx, op); err != nil {
		return err
	}
	if revoke {
		if err := t.Notify(ctx, ChannelTokens, s.ID); err != nil {
			return err
		}
	}
	// Watchers of sandboxes (event streams) see the new intent at once.
	if err := t.Notify(ctx, ChannelSandboxes, s.ID); err != nil {
		return err
	}
	return t.NotifySandbox(ctx, s)
}

// NotifySandbox wakes the node that runs s, or the controller when s has no node.
func (t *Tx) NotifySandbox(ctx context.Context, s *Sandbox) error {
	if s.NodeID == "" {
		return t.Notify(ctx, ChannelController, s.ID)
	}
	return t.Notify(ctx, NodeChannel(s.NodeID), s.ID)
}

// BumpTokenEpoch revokes every attachment token issued for the sandbox so far, and its
// E2B envd access token.
func (s *Store) BumpTokenEpoch(ctx context.Context, id string) (int64, error) {
	var epoch int64
	err := s.pool.QueryRow(ctx, `UPDATE sandboxes SET token_epoch=token_epoch+1, access_epoch=access_epoch+1, updated_at=now()
		WHERE id=$1 AND deleted_at IS NULL RETURNING token_epoch`, id).Scan(&epoch)
	if err != nil {
		return 0, notFound(err, "sandbox", id)
	}
	_, err = s.pool.Exec(ctx, `SELECT pg_notify($1, $2)`, ChannelTokens, id)
	return epoch, err
}

// AssignNode places an unassigned sandbox on a node. It returns false if the sandbox
// was assigned (or deleted) meanwhile.
func (s *Store) AssignNode(ctx context.Context, id, nodeID, runtime string) (bool, error) {
	var ok bool
	err := s.InTx(ctx, func(tx *Tx) error {
		tag, err := tx.tx.Exec(ctx, `UPDATE sandboxes SET node_id=$2, runtime=$3, updated_at=now()
			WHERE id=$1 AND node_id IS NULL AND deleted_at IS NULL
			AND EXISTS (SELECT 1 FROM nodes WHERE id=$2 AND state='alive' AND NOT cordoned)`, id, nodeID, runtime)
		if err != nil {
			return err
		}
		ok = tag.RowsAffected() == 1
		if ok {
			return tx.Notify(ctx, NodeChannel(nodeID), id)
		}
		return nil
	})
	return ok, err
}

// Observed is what a node reports about a sandbox.
type Observed struct {
	State              string
	ObservedGeneration int64
	Error              string
	StartPath          string // empty = unchanged
	TemplateDigest     string // empty = unchanged
	Deleted            bool
	// Reason replaces the sandbox's status reason when not empty.
	Reason string
	// Transition is what the node is doing now (lifecycle.TNone when it rests).
	Transition lifecycle.Transition
	// IdentityGeneration, when not 0, records the identity generation the sandbox's
	// agent took (a claimed warm-pool member's owner identity).
	IdentityGeneration int64
	// Progress, when not empty, becomes the message of the sandbox's open operations
	// up to its generation (ProgressSandboxOperations), in the same statement.
	Progress string
}

// ReportObserved records a node's observation of a sandbox. It is fenced by node id: a
// node that no longer owns the sandbox cannot overwrite it, and a node marked dead
// cannot report at all (MarkDeadNodes settled its sandboxes). Returns the updated row.
func (s *Store) ReportObserved(ctx context.Context, id, nodeID string, o Observed) (*Sandbox, error) {
	// One statement, one round trip: the row, the notification, and (with Progress) the
	// open operations' message and their notifications.
	row := s.pool.QueryRow(ctx, `WITH u AS (UPDATE sandboxes SET state=$3, observed_generation=GREATEST(observed_generation,$4),
		error=$5, start_path=CASE WHEN $6='' THEN start_path ELSE $6 END,
		template_digest=CASE WHEN $7='' THEN template_digest ELSE $7 END,
		deleted_at=CASE WHEN $8 THEN now() ELSE deleted_at END, updated_at=now(),
		status_changed_at=CASE WHEN state <> $3 THEN now() ELSE status_changed_at END,
		status_reason=CASE WHEN $9 <> '' THEN $9 ELSE status_reason END, transition=$10,
		snapshot_digest=CASE WHEN $3='suspended' THEN snapshot_digest ELSE '' END,
		identity_generation=CASE WHEN $11::bigint > 0 THEN $11 ELSE identity_generation END
		WHERE id=$1 AND node_id=$2 AND EXISTS (SELECT 1 FROM nodes WHERE id=$2 AND state='alive') RETURNING *),
	p AS (UPDATE operations SET state='running', message=$12, error='', updated_at=now(), done_at=NULL
		WHERE $12 <> '' AND sandbox_id=$1 AND done_at IS NULL AND target_generation <= (SELECT generation FROM u) RETURNING id)
	SELECT `+sandboxCols+` FROM u, LATERAL (SELECT pg_notify($13, u.id)) n,
		LATERAL (SELECT count(pg_notify($14, p.id)) AS notified FROM p) o`,
		id, nodeID, o.State, o.ObservedGeneration, o.Error, o.StartPath, o.TemplateDigest, o.Deleted, o.Reason, string(o.Transition),
		o.IdentityGeneration, o.Progress, ChannelSandboxes, ChannelOperations)
	sb, err := scanSandbox(row)
	if err != nil {
		return nil, notFound(err, "sandbox on this node", id)
	}
	return sb, nil
}

// FinishUnassigned marks a sandbox that never reached a node (deleted before
// scheduling) as deleted.
func (s *Store) FinishUnassigned(ctx context.Context, id string, gen int64) (bool, error) {
	tag, err := s.pool.Exec(ctx, `UPDATE sandboxes SET state='deleted', deleted_at=now(), observed_generation=$2, updated_at=now()
		WHERE id=$1 AND node_id IS NULL AND desired_state='deleted' AND deleted_at IS NULL`, id, gen)
	if err != nil {
		return false, err
	}
	return tag.RowsAffected() == 1, nil
}

// PendingSandboxes lists sandboxes that wait for a node.
func (s *Store) PendingSandboxes(ctx context.Context, limit int) ([]*Sandbox, error) {
	rows, err := s.pool.Query(ctx, `SELECT `+sandboxCols+` FROM sandboxes
		WHERE node_id IS NULL AND deleted_at IS NULL ORDER BY created_at LIMIT $1`, limit)
	if err != nil {
		return nil, err
	}
	return collectSandboxes(rows)
}

// ExpiredSandboxes lists live sandboxes whose expiry has passed and whose expire action
// has not been requested yet (not deleted, or for "suspend" not already suspended).
func (s *Store) ExpiredSandboxes(ctx context.Context, now time.Time, limit int) ([]*Sandbox, error) {
	rows, err := s.pool.Query(ctx, `SELECT `+sandboxCols+` FROM sandboxes
		WHERE expires_at <= $1 AND deleted_at IS NULL AND desired_state <> 'deleted'
		AND NOT (expire_action IN ('suspend','stop') AND desired_state IN ('suspended','stopped'))
		ORDER BY expires_at LIMIT $2`, now, limit)
	if err != nil {
		return nil, err
	}
	return collectSandboxes(rows)
}

// PurgeDeleted removes sandboxes deleted before the given time (and, by cascade, their
// operations).
func (s *Store) PurgeDeleted(ctx context.Context, before time.Time) (int64, error) {
	tag, err := s.pool.Exec(ctx, `DELETE FROM sandboxes WHERE deleted_at < $1`, before)
	if err != nil {
		return 0, err
	}
	return tag.RowsAffected(), nil
}

// RotateAccess replaces the sandbox's E2B envd access token (explicit pause and resume).
func (t *Tx) RotateAccess(ctx context.Context, s *Sandbox) error {
	err := t.tx.QueryRow(ctx, `UPDATE sandboxes SET access_epoch=access_epoch+1 WHERE id=$1 RETURNING access_epoch`, s.ID).Scan(&s.AccessEpoch)
	if err != nil {
		return fmt.Errorf("rotate access token: %w", err)
	}
	return nil
}

// TokenState is what the data plane checks a token against: the sandbox's current
// epoch and node, and whether the API key that minted the token is live.
func (s *Store) TokenState(ctx context.Context, sandboxID, keyID string) (epoch int64, nodeID string, keyLive bool, err error) {
	err = s.pool.QueryRow(ctx, `SELECT token_epoch, coalesce(node_id,''),
		EXISTS (SELECT 1 FROM api_keys WHERE id=$2 AND revoked_at IS NULL)
		FROM sandboxes WHERE id=$1 AND deleted_at IS NULL`, sandboxID, keyID).Scan(&epoch, &nodeID, &keyLive)
	if err != nil {
		return 0, "", false, notFound(err, "sandbox", sandboxID)
	}
	return epoch, nodeID, keyLive, nil
}

// TokenEpoch returns the current token epoch of a live sandbox.
func (s *Store) TokenEpoch(ctx context.Context, id string) (epoch int64, nodeID string, err error) {
	err = s.pool.QueryRow(ctx, `SELECT token_epoch, coalesce(node_id,'') FROM sandboxes WHERE id=$1 AND deleted_at IS NULL`, id).Scan(&epoch, &nodeID)
	if err != nil {
		return 0, "", notFound(err, "sandbox", id)
	}
	return epoch, nodeID, nil
}

// ErrSandboxGone is returned when acting on a deleted sandbox.
var ErrSandboxGone = fault.New(fault.NotFound, "sandbox is deleted")

// TouchSandboxes records activity on sandboxes (for idle suspend).
func (s *Store) TouchSandboxes(ctx context.Context, ids []string) error {
	if len(ids) == 0 {
		return nil
	}
	_, err := s.pool.Exec(ctx, `UPDATE sandboxes SET last_activity_at=now() WHERE id = ANY($1) AND deleted_at IS NULL`, ids)
	return err
}

// IdleSandboxes lists running sandboxes idle for longer than their idle timeout: those
// meant to run, and those whose suspend failed (desired suspended, settled running).
func (s *Store) IdleSandboxes(ctx context.Context, now time.Time, limit int) ([]*Sandbox, error) {
	rows, err := s.pool.Query(ctx, `SELECT `+sandboxCols+` FROM sandboxes
		WHERE state='running' AND deleted_at IS NULL AND pool_key IS NULL
		AND (desired_state='running' OR (desired_state='suspended' AND observed_generation >= generation))
		AND idle_timeout_seconds > 0 AND last_activity_at + make_interval(secs => idle_timeout_seconds) < $1
		ORDER BY last_activity_at LIMIT $2`, now, limit)
	if err != nil {
		return nil, err
	}
	return collectSandboxes(rows)
}

// SetCloneReady marks a clone's snapshot as prepared by its source's node.
func (s *Store) SetCloneReady(ctx context.Context, id string) error {
	_, err := s.pool.Exec(ctx, `UPDATE sandboxes SET clone_ready=true, updated_at=now() WHERE id=$1`, id)
	if err != nil {
		return err
	}
	return s.notifyNodeOf(ctx, id)
}

func (s *Store) notifyNodeOf(ctx context.Context, id string) error {
	_, err := s.pool.Exec(ctx, `SELECT pg_notify('space_node_' || node_id, id) FROM sandboxes WHERE id=$1 AND node_id IS NOT NULL`, id)
	return err
}

// ClonesPending lists live clones of a sandbox whose snapshot is not prepared yet.
func (s *Store) ClonesPending(ctx context.Context, sourceID string) ([]*Sandbox, error) {
	rows, err := s.pool.Query(ctx, `SELECT `+sandboxCols+` FROM sandboxes
		WHERE clone_of=$1 AND NOT clone_ready AND deleted_at IS NULL AND desired_state <> 'deleted' ORDER BY created_at`, sourceID)
	if err != nil {
		return nil, err
	}
	return collectSandboxes(rows)
}

// SetDiskBytes records a sandbox's exclusive disk usage.
func (s *Store) SetDiskBytes(ctx context.Context, id string, n int64) error {
	_, err := s.pool.Exec(ctx, `UPDATE sandboxes SET disk_exclusive_bytes=$2 WHERE id=$1`, id, n)
	return err
}

// SetIdentityGeneration records the identity generation last given to a sandbox.
func (s *Store) SetIdentityGeneration(ctx context.Context, id string, gen int64) error {
	_, err := s.pool.Exec(ctx, `UPDATE sandboxes SET identity_generation=$2 WHERE id=$1`, id, gen)
	return err
}

func encodeSpec(s *Sandbox) (spec, meta []byte, err error) {
	if spec, err = json.Marshal(s.Spec); err != nil {
		return nil, nil, err
	}
	meta, err = json.Marshal(nonNil(s.Metadata))
	return spec, meta, err
}

// idleSeconds stores an idle timeout: 0 means the default, negative means never (0).
func idleSeconds(d time.Duration) int64 {
	switch {
	case d < 0:
		return 0
	case d == 0:
		return int64(DefaultIdleTimeout / time.Second)
	default:
		return int64(d / time.Second)
	}
}

func expireAction(a string) string {
	if a == "" {
		return "delete"
	}
	return a
}

// SetExpiry sets when a sandbox expires and what happens then ("delete" or "suspend";
// empty keeps the current action). A nil time removes the expiry.
func (s *Store) SetExpiry(ctx context.Context, id string, at *time.Time, action string) error {
	tag, err := s.pool.Exec(ctx, `UPDATE sandboxes SET expires_at=$2,
		expire_action=CASE WHEN $3='' THEN expire_action ELSE $3 END, updated_at=now()
		WHERE id=$1 AND deleted_at IS NULL`, id, at, action)
	if err != nil {
		return err
	}
	if tag.RowsAffected() == 0 {
		return fault.New(fault.NotFound, "sandbox %q not found", id)
	}
	return nil
}

// FailUnassigned marks a sandbox that could not be placed on any node as failed.
func (s *Store) FailUnassigned(ctx context.Context, id string, gen int64, reason string) (bool, error) {
	tag, err := s.pool.Exec(ctx, `UPDATE sandboxes SET state='failed', error=$3, observed_generation=$2, updated_at=now(),
		status_changed_at=now(), status_reason=$3 WHERE id=$1 AND node_id IS NULL AND deleted_at IS NULL AND state='pending'`, id, gen, reason)
	if err != nil {
		return false, err
	}
	return tag.RowsAffected() == 1, nil
}
