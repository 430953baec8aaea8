package store

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/spacedev/space/api"
)

// MarkReleaseShared records that the release's artifact is in the fleet's registry
// under the manifest digest manifest: from now on any node may pull it.
func (s *Store) MarkReleaseShared(ctx context.Context, digest, manifest string) error {
	_, err := s.pool.Exec(ctx, `UPDATE template_releases SET registry_digest=$2, pushed_at=now()
		WHERE digest=$1 AND registry_digest <> $2`, digest, manifest)
	return err
}

// MarkReleaseUnshared records that the release's artifact is not in the registry (a
// pull found it missing: the registry lost it): a node that holds it pushes it again.
func (s *Store) MarkReleaseUnshared(ctx context.Context, digest string) error {
	_, err := s.pool.Exec(ctx, `UPDATE template_releases SET registry_digest='', pushed_at=NULL WHERE digest=$1`, digest)
	return err
}

// AddNodeRelease records that a node holds a release's artifacts (it pulled them).
func (s *Store) AddNodeRelease(ctx context.Context, nodeID, digest string) error {
	_, err := s.pool.Exec(ctx, `INSERT INTO node_releases (node_id, digest) VALUES ($1,$2) ON CONFLICT DO NOTHING`, nodeID, digest)
	return err
}

// UnsharedNodeReleases lists the releases a node holds that are not in the registry
// yet, oldest first: the node pushes them.
func (s *Store) UnsharedNodeReleases(ctx context.Context, nodeID string) ([]string, error) {
	rows, err := s.pool.Query(ctx, `SELECT r.digest FROM template_releases r JOIN node_releases n ON n.digest=r.digest
		WHERE n.node_id=$1 AND r.registry_digest='' ORDER BY r.created_at, r.digest`, nodeID)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// WithLock runs fn while holding the fleet-wide lock named key (a PostgreSQL session
// advisory lock on a connection of its own), waiting for whoever holds it. The lock
// goes with the connection: a process that dies holding it releases it.
func (s *Store) WithLock(ctx context.Context, key string, fn func(ctx context.Context) error) error {
	conn, err := s.pool.p.Acquire(ctx)
	if err != nil {
		return unavailable(err)
	}
	hijacked := false
	defer func() {
		if !hijacked {
			conn.Release()
		}
	}()
	if _, err := conn.Exec(ctx, `SELECT pg_advisory_lock(hashtextextended($1, 0))`, key); err != nil {
		// A cancelled wait may leave the connection in any state: drop it.
		hijacked = true
		_ = conn.Hijack().Close(context.WithoutCancel(ctx))
		return fmt.Errorf("wait for lock %s: %w", key, unavailable(err))
	}
	unlocked := false
	defer func() {
		if !unlocked {
			// fn panicked, or the unlock failed: the lock must not stay with a pooled
			// connection.
			hijacked = true
			_ = conn.Hijack().Close(context.WithoutCancel(ctx))
		}
	}()
	ferr := fn(ctx)
	if _, err := conn.Exec(context.WithoutCancel(ctx), `SELECT pg_advisory_unlock(hashtextextended($1, 0))`, key); err == nil {
		unlocked = true
	}
	return ferr
}

// ReleaseGCSweep is one step of the controller's mark-and-sweep collection of release
// artifacts in the registry (docs/operations.md, "Registry"). inRegistry lists the
// release digests the registry has, kept the ones to keep whatever the database says
// (releases of snapshot artifacts in the registry). A digest is referenced while a
// release row has it (a template version: tags need one), a sandbox that is not
// deleted starts or started from it, a snapshot was taken of it, or an unfinished
// template build starts from it. It returns the digests that stayed unreferenced for
// longer than grace (markAndSweep): those may be deleted.
func (s *Store) ReleaseGCSweep(ctx context.Context, inRegistry, kept []string, grace time.Duration) ([]string, error) {
	return s.markAndSweep(ctx, "registry_release_gc", func(d string) string {
		return fmt.Sprintf(`(%[1]s = ANY($2)
			OR EXISTS (SELECT 1 FROM template_releases r WHERE r.digest=%[1]s)
			OR EXISTS (SELECT 1 FROM sandboxes sb WHERE sb.template_digest=%[1]s AND sb.deleted_at IS NULL)
			OR EXISTS (SELECT 1 FROM snapshots sn WHERE sn.template_digest=%[1]s)
			OR EXISTS (SELECT 1 FROM operations o WHERE o.kind=$3 AND o.done_at IS NULL AND o.params->>'from_digest'=%[1]s))`, d)
	}, grace, inRegistry, kept, api.OpTemplateBuild)
}

// ReleaseGCDeleted forgets the mark of a release artifact the collection deleted.
func (s *Store) ReleaseGCDeleted(ctx context.Context, digest string) error {
	_, err := s.pool.Exec(ctx, `DELETE FROM registry_release_gc WHERE digest=$1`, digest)
	return err
}

// SnapshotGCSweep is the snapshot-artifact half of the controller's collection:
// inRegistry lists the manifest digests of the snapshot artifacts the registry has; a
// digest is referenced while a sandbox that is not deleted has it as its suspend
// snapshot or last periodic checkpoint, or a named snapshot has it. It returns the
// digests that stayed unreferenced for longer than grace (markAndSweep).
func (s *Store) SnapshotGCSweep(ctx context.Context, inRegistry []string, grace time.Duration) ([]string, error) {
	return s.markAndSweep(ctx, "registry_snapshot_gc", func(d string) string {
		return fmt.Sprintf(`(EXISTS (SELECT 1 FROM sandboxes sb WHERE sb.deleted_at IS NULL AND (sb.snapshot_digest=%[1]s OR sb.checkpoint_digest=%[1]s))
			OR EXISTS (SELECT 1 FROM snapshots sn WHERE sn.registry_digest=%[1]s))`, d)
	}, grace, inRegistry)
}

// SnapshotGCDeleted forgets the mark of a snapshot artifact the collection deleted.
func (s *Store) SnapshotGCDeleted(ctx context.Context, digest string) error {
	_, err := s.pool.Exec(ctx, `DELETE FROM registry_snapshot_gc WHERE digest=$1`, digest)
	return err
}

// markAndSweep is one mark-and-sweep step over table (digest, unreferenced_since):
// marks of digests no longer in the registry ($1, inRegistry) or referenced again
// (referenced(column) is the SQL condition; it may use args as $2…) are removed,
// digests in the registry that nothing references are marked with the time they were
// first seen so, and the digests marked for longer than grace are returned.
func (s *Store) markAndSweep(ctx context.Context, table string, referenced func(digest string) string, grace time.Duration, inRegistry []string, args ...any) ([]string, error) {
	var out []string
	params := append([]any{inRegistry}, args...)
	err := s.InTx(ctx, func(tx *Tx) error {
		if _, err := tx.tx.Exec(ctx, `DELETE FROM `+table+` g WHERE NOT (g.digest = ANY($1)) OR `+referenced("g.digest"), params...); err != nil {
			return fmt.Errorf("%s: unmark referenced artifacts: %w", table, err)
		}
		if _, err := tx.tx.Exec(ctx, `INSERT INTO `+table+` (digest)
			SELECT d FROM unnest($1::text[]) d WHERE NOT `+referenced("d")+`
			ON CONFLICT DO NOTHING`, params...); err != nil {
			return fmt.Errorf("%s: mark unreferenced artifacts: %w", table, err)
		}
		rows, err := tx.tx.Query(ctx, `SELECT digest FROM `+table+` WHERE unreferenced_since < now() - $1::interval ORDER BY digest`,
			interval(grace))
		if err != nil {
			return err
		}
		out, err = pgx.CollectRows(rows, pgx.RowTo[string])
		return err
	})
	return out, err
}

// evictableRelease is the condition under which node $1 may remove release d (a
// column or parameter) from its store: the registry has it (the node can pull it
// again), no tag points at it, no sandbox that is not deleted — or was deleted less than
// $2 ago — was made from it (pending ones included, also by a name@digest reference),
// no snapshot was taken of it, no unfinished build starts from it, and it was
// registered more than $2 ago.
const evictableRelease = `r.registry_digest <> '' AND r.created_at < now() - $2::interval
	AND NOT EXISTS (SELECT 1 FROM template_tags t WHERE t.digest=r.digest)
	AND NOT EXISTS (SELECT 1 FROM sandboxes sb WHERE (sb.template_digest=r.digest OR sb.template_ref LIKE '%@' || r.digest)
		AND (sb.deleted_at IS NULL OR sb.deleted_at > now() - $2::interval))
	AND NOT EXISTS (SELECT 1 FROM snapshots sn WHERE sn.template_digest=r.digest)
	AND NOT EXISTS (SELECT 1 FROM operations o WHERE o.kind='` + api.OpTemplateBuild + `' AND o.done_at IS NULL AND o.params->>'from_digest'=r.digest)`

func interval(d time.Duration) string { return fmt.Sprintf("%d microseconds", d.Microseconds()) }

// EvictableReleases lists the releases a node holds that it may remove from its store
// (node cache collection; see evictableRelease), oldest first.
func (s *Store) EvictableReleases(ctx context.Context, nodeID string, grace time.Duration) ([]string, error) {
	rows, err := s.pool.Query(ctx, `SELECT r.digest FROM template_releases r JOIN node_releases n ON n.digest=r.digest
		WHERE n.node_id=$1 AND `+evictableRelease+` ORDER BY r.created_at, r.digest`, nodeID, interval(grace))
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// ForgetNodeRelease records that a node no longer holds a release, if the release is
// still evictable (checked again in the same statement); false: it is not (anymore),
// and the node must keep it.
func (s *Store) ForgetNodeRelease(ctx context.Context, nodeID, digest string, grace time.Duration) (bool, error) {
	tag, err := s.pool.Exec(ctx, `DELETE FROM node_releases n USING template_releases r
		WHERE n.node_id=$1 AND n.digest=$3 AND r.digest=n.digest AND `+evictableRelease, nodeID, interval(grace), digest)
	if err != nil {
		return false, err
	}
	return tag.RowsAffected() == 1, nil
}
