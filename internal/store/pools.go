package store

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// Pool is a row of the pools table.
type Pool struct {
	// Tenant is the tenant whose creates claim the pool's members.
	Tenant   string
	Template string
	CPU      int
	MemoryMB int
	Size     int
	Ready    int
}

// Key identifies the pool's members (sandboxes.pool_key).
func (p *Pool) Key() string { return PoolKey(p.Tenant, p.Template, p.CPU, p.MemoryMB) }

// PoolKey is the pool key of a tenant's pool of a template reference and size class.
func PoolKey(tenant, template string, cpu, memoryMB int) string {
	return fmt.Sprintf("%s/%s/%dcpu/%dmb", tenant, template, cpu, memoryMB)
}

// poolKeySQL is PoolKey in SQL, over the pools row p.
const poolKeySQL = `p.tenant || '/' || p.template || '/' || p.cpu || 'cpu/' || p.memory_mb || 'mb'`

// SetPool creates, resizes or (size 0) removes a pool and wakes the controller.
func (s *Store) SetPool(ctx context.Context, p Pool) error {
	return s.InTx(ctx, func(tx *Tx) error { return tx.SetPool(ctx, p) })
}

// SetPool is SetPool inside a transaction (after a quota check under LockTenant).
func (t *Tx) SetPool(ctx context.Context, p Pool) error {
	var err error
	if p.Size == 0 {
		_, err = t.tx.Exec(ctx, `DELETE FROM pools WHERE tenant=$1 AND template=$2 AND cpu=$3 AND memory_mb=$4`, p.Tenant, p.Template, p.CPU, p.MemoryMB)
	} else {
		_, err = t.tx.Exec(ctx, `INSERT INTO pools (tenant, template, cpu, memory_mb, size) VALUES ($1,$2,$3,$4,$5)
			ON CONFLICT (tenant, template, cpu, memory_mb) DO UPDATE SET size=$5, updated_at=now()`, p.Tenant, p.Template, p.CPU, p.MemoryMB, p.Size)
	}
	if err != nil {
		return fmt.Errorf("set pool: %w", err)
	}
	return t.Notify(ctx, ChannelController, "")
}

// PoolSize returns the size of a pool (0 if it does not exist).
func (t *Tx) PoolSize(ctx context.Context, p Pool) (int, error) {
	var n int
	err := t.tx.QueryRow(ctx, `SELECT coalesce((SELECT size FROM pools WHERE tenant=$1 AND template=$2 AND cpu=$3 AND memory_mb=$4), 0)`,
		p.Tenant, p.Template, p.CPU, p.MemoryMB).Scan(&n)
	return n, err
}

// ListPools lists every tenant's pools with how many members are ready to be claimed.
func (s *Store) ListPools(ctx context.Context) ([]Pool, error) { return s.TenantPools(ctx, "") }

// TenantPools lists a tenant's pools ("" = every tenant's) with how many members are
// ready to be claimed.
func (s *Store) TenantPools(ctx context.Context, tenant string) ([]Pool, error) {
	rows, err := s.pool.Query(ctx, `SELECT p.tenant, p.template, p.cpu, p.memory_mb, p.size,
		(SELECT count(*) FROM sandboxes s WHERE s.pool_key = `+poolKeySQL+`
			AND s.state='paused' AND s.desired_state='paused' AND s.deleted_at IS NULL)
		FROM pools p WHERE $1 = '' OR p.tenant = $1 ORDER BY p.tenant, p.template, p.cpu, p.memory_mb`, tenant)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Pool, error) {
		var p Pool
		err := r.Scan(&p.Tenant, &p.Template, &p.CPU, &p.MemoryMB, &p.Size, &p.Ready)
		return p, err
	})
}

// PoolMembers lists the live members of a pool (any state).
func (s *Store) PoolMembers(ctx context.Context, key string) ([]*Sandbox, error) {
	rows, err := s.pool.Query(ctx, `SELECT `+sandboxCols+` FROM sandboxes
		WHERE pool_key=$1 AND deleted_at IS NULL AND desired_state <> 'deleted' ORDER BY created_at`, key)
	if err != nil {
		return nil, err
	}
	return collectSandboxes(rows)
}

// OrphanPoolMembers lists live pool members whose pool no longer exists.
func (s *Store) OrphanPoolMembers(ctx context.Context) ([]*Sandbox, error) {
	rows, err := s.pool.Query(ctx, `SELECT `+sandboxCols+` FROM sandboxes s
		WHERE pool_key IS NOT NULL AND deleted_at IS NULL AND desired_state <> 'deleted'
		AND NOT EXISTS (SELECT 1 FROM pools p WHERE s.pool_key = `+poolKeySQL+`)`)
	if err != nil {
		return nil, err
	}
	return collectSandboxes(rows)
}

// ClaimPoolMember takes one parked member of pool key built from digest, atomically
// (SKIP LOCKED: concurrent claims never get the same member), and turns it into the
// caller's sandbox: tenant, metadata, env, expiry, desired state running, a new
// generation, and the create operation. It returns nil when the pool has no member ready.
func (t *Tx) ClaimPoolMember(ctx context.Context, key, digest string, want *Sandbox, op *Operation) (*Sandbox, error) {
	spec, meta, err := encodeSpec(want)
	if err != nil {
		return nil, err
	}
	idle := idleSeconds(want.IdleTimeout)
	// One statement, one round trip: pick the oldest ready member nobody else is
	// claiming and make it the caller's.
	row := t.tx.QueryRow(ctx, `UPDATE sandboxes SET pool_key=NULL, claimed_at=now(), tenant=$3, template_ref=$4, spec=$5,
		metadata=$6, expires_at=$7, idle_timeout_seconds=$8, desired_state='running', generation=generation+1,
		start_path='pool', created_at=now(), updated_at=now(), last_activity_at=now(), token_epoch=token_epoch+1
		WHERE id = (SELECT id FROM sandboxes WHERE pool_key=$1 AND template_digest=$2 AND state='paused'
			AND desired_state='paused' AND deleted_at IS NULL ORDER BY created_at LIMIT 1 FOR UPDATE SKIP LOCKED)
		RETURNING `+sandboxCols, key, digest, want.Tenant, want.TemplateRef, spec, meta, want.ExpiresAt, idle)
	sb, err := scanSandbox(row)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("claim pool member: %w", err)
	}
	op.Timeline = append(op.Timeline, Mark{Phase: "claimed", At: time.Now()})
	op.SandboxID = sb.ID
	op.TargetGeneration = sb.Generation
	op.Tenant = sb.Tenant
	if err := t.InsertOperation(ctx, op); err != nil {
		return nil, err
	}
	if err := t.NotifySandbox(ctx, sb); err != nil {
		return nil, err
	}
	// The pool is one short now: let the controller refill it.
	return sb, t.Notify(ctx, ChannelController, "")
}
