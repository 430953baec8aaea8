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
	return s.InTx(ctx, func(tx *Tx) error {
		if err := tx.InsertOperation(ctx, op); err != nil {
			return err
		}
		if err := tx.Notify(ctx, ChannelOperations, op.ID); err != nil {
			return err
		}
		return tx.Notify(ctx, BuildChannel(nodeID), op.ID)
	})
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

// TemplateReleases returns the releases of one template, newest first, with their tags
// and the nodes that hold them.
func (s *Store) TemplateReleases(ctx context.Context, name string) ([]*Release, map[string][]string, error) {
	rows, err := s.pool.Query(ctx, `SELECT r.digest, r.name, r.config, r.size_bytes, r.created_at,
		coalesce((SELECT array_agg(t.tag ORDER BY t.tag) FROM template_tags t WHERE t.digest=r.digest AND t.name=r.name), '{}'),
		coalesce((SELECT array_agg(n.node_id ORDER BY n.node_id) FROM node_releases n WHERE n.digest=r.digest), '{}')
		FROM template_releases r WHERE r.name=$1 ORDER BY r.created_at DESC, r.digest`, name)
	if err != nil {
		return nil, nil, err
	}
	defer rows.Close()
	var out []*Release
	nodes := map[string][]string{}
	for rows.Next() {
		var r Release
		var ns []string
		if err := rows.Scan(&r.Digest, &r.Name, &r.Config, &r.SizeBytes, &r.CreatedAt, &r.Tags, &ns); err != nil {
			return nil, nil, err
		}
		nodes[r.Digest] = ns
		out = append(out, &r)
	}
	return out, nodes, rows.Err()
}

// DeleteTag removes the tag name:tag and returns the digest it pointed at.
func (s *Store) DeleteTag(ctx context.Context, name, tag string) (string, error) {
	var d string
	err := s.pool.QueryRow(ctx, `DELETE FROM template_tags WHERE name=$1 AND tag=$2 RETURNING digest`, name, tag).Scan(&d)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", fault.New(fault.NotFound, "template %s:%s not found", name, tag)
	}
	return d, err
}

// DeleteRelease deletes the release name@digest from the database with the tags that
// point at it, and queues the removal of its artifacts on the nodes that hold it (see
// PendingReleaseGC); it returns those nodes. It refuses (fault.Conflict) while a
// sandbox that is not deleted was created from it (or waits to be, by one of its
// tags), or an unfinished build starts from it.
func (s *Store) DeleteRelease(ctx context.Context, name, digest string) ([]string, error) {
	var nodes []string
	err := s.InTx(ctx, func(tx *Tx) error {
		var got string
		err := tx.tx.QueryRow(ctx, `SELECT name FROM template_releases WHERE digest=$1 FOR UPDATE`, digest).Scan(&got)
		if errors.Is(err, pgx.ErrNoRows) || err == nil && got != name {
			return fault.New(fault.NotFound, "template release %s@%s not found", name, digest)
		}
		if err != nil {
			return err
		}
		rows, err := tx.tx.Query(ctx, `SELECT id FROM sandboxes WHERE deleted_at IS NULL AND (template_digest=$1
			OR (template_digest IS NULL OR template_digest='') AND template_ref IN
				(SELECT t.name || ':' || t.tag FROM template_tags t WHERE t.digest=$1))
			ORDER BY created_at LIMIT 5`, digest)
		if err != nil {
			return err
		}
		users, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return err
		}
		if len(users) > 0 {
			return fault.New(fault.Conflict, "template release %s@%s is in use by sandbox %v; delete those sandboxes first", name, digest, users)
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
