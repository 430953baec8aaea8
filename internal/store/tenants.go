package store

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/spacedev/space/internal/fault"
)

// Quota names: the columns of the tenants table and the names API bodies use.
const (
	QuotaRunning    = "running_sandboxes" // sandboxes that hold a node's memory: desired running or paused
	QuotaVCPUs      = "vcpus"             // their vCPUs
	QuotaMemoryMB   = "memory_mb"         // their memory
	QuotaDiskMB     = "disk_mb"           // disk of every live sandbox (estimated, see TenantUsage)
	QuotaOperations = "operations"        // unfinished operations
	QuotaRate       = "request_rate"      // API requests per second (token bucket rate)
	QuotaBurst      = "request_burst"     // token bucket size
)

// QuotaNames lists the quotas in display order.
var QuotaNames = []string{QuotaRunning, QuotaVCPUs, QuotaMemoryMB, QuotaDiskMB, QuotaOperations, QuotaRate, QuotaBurst}

// Unlimited is the value of a quota without a limit.
const Unlimited = -1

// Quota maps quota names to limits (Unlimited for none). A tenant's row holds only the
// quotas set for it; the others take the server's defaults.
type Quota map[string]int64

// Disk estimates, in MiB, used where a sandbox has no disk size of its own: what a
// sandbox is charged for its disk until its measured exclusive use is larger.
const DefaultDiskEstimateMB = 1024

// Tenant is a row of the tenants table.
type Tenant struct {
	Name      string
	CreatedAt time.Time
	// Quota holds the limits set for this tenant (absent: the server's default).
	Quota Quota
}

const tenantCols = `name, created_at, running_sandboxes, vcpus, memory_mb, disk_mb, operations, request_rate, request_burst`

func scanTenant(row pgx.Row) (*Tenant, error) {
	var t Tenant
	vals := make([]*int64, len(QuotaNames))
	dest := []any{&t.Name, &t.CreatedAt}
	for i := range vals {
		dest = append(dest, &vals[i])
	}
	if err := row.Scan(dest...); err != nil {
		return nil, err
	}
	t.Quota = Quota{}
	for i, v := range vals {
		if v != nil {
			t.Quota[QuotaNames[i]] = *v
		}
	}
	return &t, nil
}

// CreateTenant records a new tenant; a tenant of that name already existing is a
// conflict.
func (s *Store) CreateTenant(ctx context.Context, name string) (*Tenant, error) {
	t, err := scanTenant(s.pool.QueryRow(ctx, `INSERT INTO tenants (name) VALUES ($1) RETURNING `+tenantCols, name))
	if isUniqueViolation(err) {
		return nil, fault.New(fault.Conflict, "tenant %q exists already", name)
	}
	if err != nil {
		return nil, fmt.Errorf("create tenant: %w", err)
	}
	return t, nil
}

// EnsureTenant creates a tenant unless it exists.
func (s *Store) EnsureTenant(ctx context.Context, name string) error {
	_, err := s.pool.Exec(ctx, `INSERT INTO tenants (name) VALUES ($1) ON CONFLICT DO NOTHING`, name)
	return err
}

// GetTenant returns a tenant.
func (s *Store) GetTenant(ctx context.Context, name string) (*Tenant, error) {
	t, err := scanTenant(s.pool.QueryRow(ctx, `SELECT `+tenantCols+` FROM tenants WHERE name=$1`, name))
	if err != nil {
		return nil, notFound(err, "tenant", name)
	}
	return t, nil
}

// ListTenants lists tenants by name.
func (s *Store) ListTenants(ctx context.Context) ([]*Tenant, error) {
	rows, err := s.pool.Query(ctx, `SELECT `+tenantCols+` FROM tenants ORDER BY name`)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []*Tenant
	for rows.Next() {
		t, err := scanTenant(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, t)
	}
	return out, rows.Err()
}

// SetTenantQuota sets the given quotas of a tenant and resets the quotas named in reset
// to the server's defaults.
func (s *Store) SetTenantQuota(ctx context.Context, name string, set Quota, reset []string) (*Tenant, error) {
	var sets []string
	args := []any{name}
	for _, q := range QuotaNames { // fixed column names: never user input
		if v, ok := set[q]; ok {
			args = append(args, v)
			sets = append(sets, fmt.Sprintf("%s=$%d", q, len(args)))
		}
	}
	for _, q := range reset {
		if !isQuotaName(q) {
			return nil, fault.New(fault.Invalid, "unknown quota %q (quotas: %s)", q, strings.Join(QuotaNames, ", "))
		}
		sets = append(sets, q+"=NULL")
	}
	if len(sets) == 0 {
		return s.GetTenant(ctx, name)
	}
	t, err := scanTenant(s.pool.QueryRow(ctx, `UPDATE tenants SET `+strings.Join(sets, ", ")+` WHERE name=$1 RETURNING `+tenantCols, args...))
	if err != nil {
		return nil, notFound(err, "tenant", name)
	}
	return t, nil
}

func isQuotaName(q string) bool {
	for _, n := range QuotaNames {
		if n == q {
			return true
		}
	}
	return false
}

// DeleteTenant removes a tenant with its API keys (revoked or not), pools and
// idempotency records. It refuses (fault.Conflict) while the tenant has a sandbox that
// is not deleted or a template of its own.
func (s *Store) DeleteTenant(ctx context.Context, name string) (*Tenant, error) {
	var t *Tenant
	err := s.InTx(ctx, func(tx *Tx) error {
		var err error
		if t, err = tx.LockTenant(ctx, name); err != nil {
			return err
		}
		var sandboxes, templates int
		if err := tx.tx.QueryRow(ctx, `SELECT
			(SELECT count(*) FROM sandboxes WHERE tenant=$1 AND deleted_at IS NULL),
			(SELECT count(*) FROM template_tags WHERE tenant=$1) + (SELECT count(*) FROM template_releases WHERE tenant=$1)`,
			name).Scan(&sandboxes, &templates); err != nil {
			return err
		}
		if sandboxes > 0 {
			return fault.New(fault.Conflict, "tenant %q has %d sandboxes that are not deleted; delete them first", name, sandboxes)
		}
		if templates > 0 {
			return fault.New(fault.Conflict, "tenant %q has templates of its own; delete them first", name)
		}
		for _, q := range []string{
			`DELETE FROM pools WHERE tenant=$1`,
			`DELETE FROM idempotency_keys WHERE tenant=$1`,
			`DELETE FROM tenants WHERE name=$1`, // cascades to api_keys
		} {
			if _, err := tx.tx.Exec(ctx, q, name); err != nil {
				return fmt.Errorf("delete tenant: %w", err)
			}
		}
		// Streams authorized by the tenant's keys are cut (internal/dataplane).
		if err := tx.Notify(ctx, ChannelKeys, ""); err != nil {
			return err
		}
		return tx.Notify(ctx, ChannelController, "")
	})
	return t, err
}

// LockTenant locks the tenant's row for the rest of the transaction: every request that
// may raise a tenant's usage takes this lock before it counts and records, so quota
// checks of one tenant never race.
func (t *Tx) LockTenant(ctx context.Context, name string) (*Tenant, error) {
	tn, err := scanTenant(t.tx.QueryRow(ctx, `SELECT `+tenantCols+` FROM tenants WHERE name=$1 FOR UPDATE`, name))
	if err != nil {
		return nil, notFound(err, "tenant", name)
	}
	return tn, nil
}

// Usage maps quota names (not the rate ones) to what a tenant uses.
type Usage map[string]int64

// usageSQL computes a tenant's usage. A sandbox counts from the request that creates
// it until its delete is requested. "Running" sandboxes are those that hold a node's
// memory: desired state running or paused. Disk: every live sandbox is charged the
// larger of its measured exclusive bytes and an estimate — its disk_mb (when the spec
// has one) or DefaultDiskEstimateMB, plus its memory while it is (being) suspended, for
// the memory snapshot. Parked warm-pool members are reserved for their pool's tenant:
// each counts like a paused sandbox of the pool's size class.
var usageSQL = `WITH live AS (
	SELECT (spec->>'cpu')::bigint AS cpu, (spec->>'memory_mb')::bigint AS mem,
		desired_state IN ('running','paused') AS holds,
		GREATEST(coalesce((spec->>'disk_mb')::bigint, ` + diskEstimate + `)
			+ CASE WHEN desired_state = 'suspended' OR state IN ('suspending','suspended') THEN (spec->>'memory_mb')::bigint ELSE 0 END,
			disk_exclusive_bytes / 1048576) AS disk
	FROM sandboxes WHERE tenant=$1 AND deleted_at IS NULL AND desired_state <> 'deleted' AND pool_key IS NULL
	UNION ALL
	SELECT cpu::bigint, memory_mb::bigint, true, ` + diskEstimate + `::bigint FROM pools, generate_series(1, size) WHERE tenant=$1
)
SELECT count(*) FILTER (WHERE holds), coalesce(sum(cpu) FILTER (WHERE holds), 0),
	coalesce(sum(mem) FILTER (WHERE holds), 0), coalesce(sum(disk), 0),
	(SELECT count(*) FROM operations WHERE tenant=$1 AND done_at IS NULL)
FROM live`

var diskEstimate = strconv.Itoa(DefaultDiskEstimateMB)

func tenantUsage(ctx context.Context, q querier, tenant string) (Usage, error) {
	var run, cpu, mem, disk, ops int64
	if err := q.QueryRow(ctx, usageSQL, tenant).Scan(&run, &cpu, &mem, &disk, &ops); err != nil {
		return nil, fmt.Errorf("tenant usage: %w", err)
	}
	return Usage{QuotaRunning: run, QuotaVCPUs: cpu, QuotaMemoryMB: mem, QuotaDiskMB: disk, QuotaOperations: ops}, nil
}

// TenantUsage returns what a tenant uses now.
func (s *Store) TenantUsage(ctx context.Context, tenant string) (Usage, error) {
	return tenantUsage(ctx, s.pool, tenant)
}

// TenantUsage returns what a tenant uses, inside the transaction (after LockTenant).
func (t *Tx) TenantUsage(ctx context.Context, tenant string) (Usage, error) {
	return tenantUsage(ctx, t.tx, tenant)
}
