package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
)

// BuildChannel is the channel that wakes one node's template builder (payload: a
// build operation id, or "gc" after a release was deleted).
func BuildChannel(nodeID string) string { return "space_build_" + nodeID }

// CreateBuildOperation inserts a queued template build assigned to nodeID (recorded in
// op.Params["node"] by the caller) and wakes that node when the transaction commits.
func (s *Store) CreateBuildOperation(ctx context.Context, op *Operation, nodeID string) error {
	return s.InTx(ctx, func(tx *Tx) error { return tx.CreateBuildOperation(ctx, op, nodeID) })
}

// CreateBuildOperation is CreateBuildOperation inside a transaction.
func (t *Tx) CreateBuildOperation(ctx context.Context, op *Operation, nodeID string) error {
	if err := t.InsertOperation(ctx, op); err != nil {
		return err
	}
	if err := t.Notify(ctx, ChannelOperations, op.ID); err != nil {
		return err
	}
	return t.Notify(ctx, BuildChannel(nodeID), op.ID)
}

// QueuedBuilds lists the pending template builds assigned to nodeID, oldest first.
func (s *Store) QueuedBuilds(ctx context.Context, nodeID string) ([]*Operation, error) {
	rows, err := s.pool.Query(ctx, `SELECT `+opCols+` FROM operations
		WHERE kind=$1 AND state=$2 AND done_at IS NULL AND params->>'node'=$3 ORDER BY created_at`,
		api.OpTemplateBuild, api.OpPending, nodeID)
	if err != nil {
		return nil, err
	}
	return collectOps(rows)
}

// ClaimBuild moves a pending build to running with message. It returns false if the
// build is no longer pending (claimed, failed or finished meanwhile).
func (s *Store) ClaimBuild(ctx context.Context, opID, message string) (bool, error) {
	tag, err := s.pool.Exec(ctx, `UPDATE operations SET state=$3, message=$4, updated_at=now()
		WHERE id=$1 AND state=$2 AND done_at IS NULL`, opID, api.OpPending, api.OpRunning, message)
	if err != nil {
		return false, fmt.Errorf("claim build: %w", err)
	}
	if tag.RowsAffected() != 1 {
		return false, nil
	}
	_, err = s.pool.Exec(ctx, `SELECT pg_notify($1, $2)`, ChannelOperations, opID)
	return true, err
}

// OpenBuildCounts returns the number of unfinished template builds per node.
func (s *Store) OpenBuildCounts(ctx context.Context) (map[string]int, error) {
	rows, err := s.pool.Query(ctx, `SELECT params->>'node', count(*) FROM operations
		WHERE kind=$1 AND done_at IS NULL AND params->>'node' IS NOT NULL GROUP BY 1`, api.OpTemplateBuild)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	out := map[string]int{}
	for rows.Next() {
		var node string
		var n int
		if err := rows.Scan(&node, &n); err != nil {
			return nil, err
		}
		out[node] = n
	}
	return out, rows.Err()
}

// SetNodeTemplateSources publishes the template sources a node allows.
func (s *Store) SetNodeTemplateSources(ctx context.Context, nodeID string, sources []string) error {
	if sources == nil {
		sources = []string{}
	}
	b, err := json.Marshal(sources)
	if err != nil {
		return err
	}
	_, err = s.pool.Exec(ctx, `INSERT INTO node_template_sources (node_id, sources) VALUES ($1,$2)
		ON CONFLICT (node_id) DO UPDATE SET sources=$2, updated_at=now()`, nodeID, b)
	if err != nil {
		return fmt.Errorf("publish template sources: %w", err)
	}
	return nil
}

// NodeTemplateSources returns the template sources each node published. A node that
// has not published (not started yet) is absent.
func (s *Store) NodeTemplateSources(ctx context.Context) (map[string][]string, error) {
	rows, err := s.pool.Query(ctx, `SELECT node_id, sources FROM node_template_sources`)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	out := map[string][]string{}
	for rows.Next() {
		var node string
		var b []byte
		if err := rows.Scan(&node, &b); err != nil {
			return nil, err
		}
		var list []string
		if err := json.Unmarshal(b, &list); err != nil {
			return nil, fmt.Errorf("decode template sources of node %s: %w", node, err)
		}
		out[node] = list
	}
	return out, rows.Err()
}

// TemplateReleases returns the releases of one template of owner ("" = shared), newest
// first, with the template's tags that point at each and the nodes that hold them.
func (s *Store) TemplateReleases(ctx context.Context, owner, name string) ([]*Release, map[string][]string, error) {
	rows, err := s.pool.Query(ctx, `SELECT r.digest, $2, r.config, r.size_bytes, r.created_at, $1,
		coalesce((SELECT array_agg(t.tag ORDER BY t.tag) FROM template_tags t WHERE t.digest=r.digest AND t.name=$2 AND t.tenant=$1), '{}'),
		coalesce((SELECT array_agg(n.node_id ORDER BY n.node_id) FROM node_releases n WHERE n.digest=r.digest), '{}')
		FROM template_releases r
		WHERE (r.name=$2 AND r.tenant=$1) OR r.digest IN (SELECT digest FROM template_tags WHERE name=$2 AND tenant=$1)
		ORDER BY r.created_at DESC, r.digest`, owner, name)
	if err != nil {
		return nil, nil, err
	}
	defer rows.Close()
	var out []*Release
	nodes := map[string][]string{}
	for rows.Next() {
		var r Release
		var ns []string
		if err := rows.Scan(&r.Digest, &r.Name, &r.Config, &r.SizeBytes, &r.CreatedAt, &r.Tenant, &r.Tags, &ns); err != nil {
			return nil, nil, err
		}
		nodes[r.Digest] = ns
		out = append(out, &r)
	}
	return out, nodes, rows.Err()
}

// DeleteTag removes owner's tag name:tag ("" = shared) and returns the digest it
// pointed at.
func (s *Store) DeleteTag(ctx context.Context, owner, name, tag string) (string, error) {
	var d string
	err := s.pool.QueryRow(ctx, `DELETE FROM template_tags WHERE tenant=$1 AND name=$2 AND tag=$3 RETURNING digest`, owner, name, tag).Scan(&d)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", fault.New(fault.NotFound, "template %s:%s not found", name, tag)
	}
	return d, err
}

// DeleteRelease deletes owner's release name@digest ("" = shared) from the database
// with the tags that point at it, and queues the removal of its artifacts on the nodes
// that hold it (see PendingReleaseGC); it returns those nodes. It refuses
// (fault.Conflict) while a sandbox that is not deleted was created from it (or waits to
// be, by one of its tags), an unfinished build starts from it, or another tenant's tag
// points at it (a build of identical content). Sandboxes are named only when they are
// owner's (shared: any).
func (s *Store) DeleteRelease(ctx context.Context, owner, name, digest string) ([]string, error) {
	var nodes []string
	err := s.InTx(ctx, func(tx *Tx) error {
		var got, gotOwner string
		err := tx.tx.QueryRow(ctx, `SELECT name, tenant FROM template_releases WHERE digest=$1 FOR UPDATE`, digest).Scan(&got, &gotOwner)
		if errors.Is(err, pgx.ErrNoRows) || err == nil && (got != name || gotOwner != owner) {
			return fault.New(fault.NotFound, "template release %s@%s not found", name, digest)
		}
		if err != nil {
			return err
		}
		rows, err := tx.tx.Query(ctx, `SELECT id, tenant FROM sandboxes WHERE deleted_at IS NULL AND (template_digest=$1
			OR (template_digest IS NULL OR template_digest='') AND template_ref IN
				(SELECT t.name || ':' || t.tag FROM template_tags t WHERE t.digest=$1))
			ORDER BY created_at LIMIT 5`, digest)
		if err != nil {
			return err
		}
		var users []string
		inUse := false
		for rows.Next() {
			var id, tenant string
			if err := rows.Scan(&id, &tenant); err != nil {
				rows.Close()
				return err
			}
			inUse = true
			if owner == "" || tenant == owner {
				users = append(users, id)
			}
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return err
		}
		if inUse {
			return fault.New(fault.Conflict, "template release %s@%s is in use by sandboxes %v; delete those sandboxes first", name, digest, users)
		}
		var others int
		if err := tx.tx.QueryRow(ctx, `SELECT count(*) FROM template_tags WHERE digest=$1 AND tenant <> $2`, digest, owner).Scan(&others); err != nil {
			return err
		}
		if others > 0 {
			return fault.New(fault.Conflict, "template release %s@%s is also the release of other templates", name, digest)
		}
		var builds []string
		rows, err = tx.tx.Query(ctx, `SELECT id FROM operations WHERE kind=$1 AND done_at IS NULL AND params->>'from_digest'=$2`,
			api.OpTemplateBuild, digest)
		if err != nil {
			return err
		}
		if builds, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
			return err
		}
		if len(builds) > 0 {
			return fault.New(fault.Conflict, "template release %s@%s is the source of build %v, which is not finished", name, digest, builds)
		}
		rows, err = tx.tx.Query(ctx, `SELECT node_id FROM node_releases WHERE digest=$1 ORDER BY node_id`, digest)
		if err != nil {
			return err
		}
		if nodes, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
			return err
		}
		for _, n := range nodes {
			if _, err := tx.tx.Exec(ctx, `INSERT INTO template_gc (node_id, digest) VALUES ($1,$2) ON CONFLICT DO NOTHING`, n, digest); err != nil {
				return fmt.Errorf("queue release removal: %w", err)
			}
			if err := tx.Notify(ctx, BuildChannel(n), "gc"); err != nil {
				return err
			}
		}
		if _, err := tx.tx.Exec(ctx, `DELETE FROM template_tags WHERE digest=$1`, digest); err != nil {
			return fmt.Errorf("delete tags: %w", err)
		}
		if _, err := tx.tx.Exec(ctx, `DELETE FROM template_releases WHERE digest=$1`, digest); err != nil {
			return fmt.Errorf("delete release: %w", err)
		}
		return nil
	})
	return nodes, err
}

// PendingReleaseGC lists the digests of deleted releases whose artifacts nodeID still
// has to remove.
func (s *Store) PendingReleaseGC(ctx context.Context, nodeID string) ([]string, error) {
	rows, err := s.pool.Query(ctx, `SELECT digest FROM template_gc WHERE node_id=$1 ORDER BY requested_at`, nodeID)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// ReleaseGCDone records that nodeID removed the artifacts of a deleted release.
func (s *Store) ReleaseGCDone(ctx context.Context, nodeID, digest string) error {
	_, err := s.pool.Exec(ctx, `DELETE FROM template_gc WHERE node_id=$1 AND digest=$2`, nodeID, digest)
	return err
}
