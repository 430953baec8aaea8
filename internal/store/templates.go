package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/spacedev/space/api"
)

// Release is a row of template_releases.
type Release struct {
	Digest    string
	Name      string
	Config    json.RawMessage
	SizeBytes int64
	CreatedAt time.Time
	Tags      []string
	// Tenant owns the release ("" = shared: builtin templates, operators' builds).
	// Listings set it to the owner of the tags listed.
	Tenant string
	// Registry is the manifest digest of the release's artifact in the fleet's registry
	// ("" while it is only on the nodes that hold it; see MarkReleaseShared).
	Registry string
	// KeepTag makes PutRelease point the tag at the release only when the tag does not
	// exist yet (builtin templates: the first release registered keeps the tag).
	KeepTag bool
}

// PutRelease records a release and points name:tag at it, in one transaction, and
// records that nodeID holds its artifacts. The release and tag belong to r.Tenant;
// when that is empty and the node is running a template build of name:tag queued by a
// tenant (service.BuildTemplate records the owner in the build's params), they belong
// to that build's owner — the node does not need to know about tenants.
func (s *Store) PutRelease(ctx context.Context, r *Release, tag, nodeID string) error {
	cfg := r.Config
	if len(cfg) == 0 {
		cfg = json.RawMessage(`{}`)
	}
	return s.InTx(ctx, func(tx *Tx) error {
		owner := r.Tenant
		if owner == "" && nodeID != "" && tag != "" {
			err := tx.tx.QueryRow(ctx, `SELECT coalesce(params->>'owner','') FROM operations
				WHERE kind=$1 AND state=$2 AND done_at IS NULL AND params ? 'spec' AND params->>'node'=$3 AND params->>'template'=$4
				ORDER BY updated_at DESC LIMIT 1`, api.OpTemplateBuild, api.OpRunning, nodeID, r.Name+":"+tag).Scan(&owner)
			if err != nil && !errors.Is(err, pgx.ErrNoRows) {
				return fmt.Errorf("find the build's owner: %w", err)
			}
		}
		if _, err := tx.tx.Exec(ctx, `INSERT INTO template_releases (digest, name, config, size_bytes, tenant, registry_digest, pushed_at)
			VALUES ($1,$2,$3,$4,$5,$6, CASE WHEN $6 = '' THEN NULL ELSE now() END)
			ON CONFLICT (digest) DO UPDATE SET registry_digest=$6, pushed_at=now()
				WHERE $6 <> '' AND template_releases.registry_digest = ''`, r.Digest, r.Name, cfg, r.SizeBytes, owner, r.Registry); err != nil {
			return fmt.Errorf("insert release: %w", err)
		}
		if tag != "" && r.KeepTag {
			if _, err := tx.tx.Exec(ctx, `INSERT INTO template_tags (tenant, name, tag, digest) VALUES ($1,$2,$3,$4)
				ON CONFLICT (tenant, name, tag) DO NOTHING`, owner, r.Name, tag, r.Digest); err != nil {
				return fmt.Errorf("set tag: %w", err)
			}
		} else if tag != "" {
			if _, err := tx.tx.Exec(ctx, `INSERT INTO template_tags (tenant, name, tag, digest) VALUES ($1,$2,$3,$4)
				ON CONFLICT (tenant, name, tag) DO UPDATE SET digest=$4, updated_at=now()`, owner, r.Name, tag, r.Digest); err != nil {
				return fmt.Errorf("set tag: %w", err)
			}
		}
		if nodeID != "" {
			if _, err := tx.tx.Exec(ctx, `INSERT INTO node_releases (node_id, digest) VALUES ($1,$2) ON CONFLICT DO NOTHING`,
				nodeID, r.Digest); err != nil {
				return fmt.Errorf("record node release: %w", err)
			}
		}
		return nil
	})
}

// ResolveTag returns the digest the shared tag name:tag points at, or "" if there is
// no such shared tag. (Nodes resolve only shared tags: a sandbox of a tenant's template
// has its digest recorded at create.)
func (s *Store) ResolveTag(ctx context.Context, name, tag string) (string, error) {
	d, _, err := s.ResolveTenantTag(ctx, "", name, tag)
	return d, err
}

// ResolveTenantTag returns the digest name:tag points at for a tenant — its own tag,
// else a shared one — and the tag's owner ("" shared); "" if neither exists.
func (s *Store) ResolveTenantTag(ctx context.Context, tenant, name, tag string) (digest, owner string, err error) {
	err = s.pool.QueryRow(ctx, `SELECT digest, tenant FROM template_tags WHERE name=$2 AND tag=$3 AND tenant IN ('', $1)
		ORDER BY tenant DESC LIMIT 1`, tenant, name, tag).Scan(&digest, &owner)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", "", nil
	}
	return digest, owner, err
}

// ResolvePoolTag returns the digest a pool's template tag points at for the pool's
// tenant ("" if none).
func (s *Store) ResolvePoolTag(ctx context.Context, p Pool) (string, error) {
	ref, err := api.ParseTemplateRef(p.Template)
	if err != nil {
		return "", err
	}
	d, _, err := s.ResolveTenantTag(ctx, p.Tenant, ref.Name, ref.Tag)
	return d, err
}

// GetRelease returns a release by digest.
func (s *Store) GetRelease(ctx context.Context, digest string) (*Release, error) {
	var r Release
	err := s.pool.QueryRow(ctx, `SELECT digest, name, config, size_bytes, created_at, tenant, registry_digest FROM template_releases WHERE digest=$1`, digest).
		Scan(&r.Digest, &r.Name, &r.Config, &r.SizeBytes, &r.CreatedAt, &r.Tenant, &r.Registry)
	if err != nil {
		return nil, notFound(err, "template release", digest)
	}
	return &r, nil
}

// ReleaseVisible reports whether a tenant may use a release: a shared one, its own,
// or one a tag of its own points at. tenant "" asks for shared releases only.
func (s *Store) ReleaseVisible(ctx context.Context, tenant, digest string) (bool, error) {
	var ok bool
	err := s.pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM template_releases WHERE digest=$2 AND tenant IN ('', $1))
		OR EXISTS (SELECT 1 FROM template_tags WHERE digest=$2 AND tenant=$1)`, tenant, digest).Scan(&ok)
	return ok, err
}

// ListReleases lists the templates a tenant may see (its own and the shared ones;
// all: every tenant's): one entry per release and template name, with the tags of that
// name pointing at it. Releases no tag points at are listed under their own name.
func (s *Store) ListReleases(ctx context.Context, tenant string, all bool) ([]*Release, error) {
	rows, err := s.pool.Query(ctx, `SELECT r.digest, t.name, r.config, r.size_bytes, r.created_at, t.tenant,
			array_agg(t.tag ORDER BY t.tag)
		FROM template_tags t JOIN template_releases r ON r.digest = t.digest
		WHERE $2 OR t.tenant IN ('', $1)
		GROUP BY r.digest, t.name, t.tenant
		UNION ALL
		SELECT r.digest, r.name, r.config, r.size_bytes, r.created_at, r.tenant, '{}'::text[]
		FROM template_releases r
		WHERE ($2 OR r.tenant IN ('', $1))
			AND NOT EXISTS (SELECT 1 FROM template_tags t WHERE t.digest = r.digest AND t.name = r.name AND t.tenant = r.tenant)
		ORDER BY 2, 6, 5 DESC, 1`, tenant, all)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []*Release
	for rows.Next() {
		var r Release
		if err := rows.Scan(&r.Digest, &r.Name, &r.Config, &r.SizeBytes, &r.CreatedAt, &r.Tenant, &r.Tags); err != nil {
			return nil, err
		}
		out = append(out, &r)
	}
	return out, rows.Err()
}

// TemplateOwner returns whose template name is for a tenant: the tenant's own when it
// has a tag or release of that name, else shared ("") when one exists; found is false
// when the name names nothing the tenant may see.
func (s *Store) TemplateOwner(ctx context.Context, tenant, name string) (owner string, found bool, err error) {
	err = s.pool.QueryRow(ctx, `SELECT tenant FROM (
			SELECT tenant FROM template_tags WHERE name=$2 AND tenant IN ('', $1)
			UNION SELECT tenant FROM template_releases WHERE name=$2 AND tenant IN ('', $1)) o
		ORDER BY tenant DESC LIMIT 1`, tenant, name).Scan(&owner)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", false, nil
	}
	return owner, err == nil, err
}

// NodeHasRelease reports whether a node recorded holding the release's artifacts.
func (s *Store) NodeHasRelease(ctx context.Context, nodeID, digest string) (bool, error) {
	var ok bool
	err := s.pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM node_releases WHERE node_id=$1 AND digest=$2)`, nodeID, digest).Scan(&ok)
	return ok, err
}

// NodeCanGetRelease reports whether a node holds the release's artifacts or can pull
// them: the release is in the fleet's registry.
func (s *Store) NodeCanGetRelease(ctx context.Context, nodeID, digest string) (bool, error) {
	var ok bool
	err := s.pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM node_releases WHERE node_id=$1 AND digest=$2)
		OR EXISTS (SELECT 1 FROM template_releases WHERE digest=$2 AND registry_digest <> '')`, nodeID, digest).Scan(&ok)
	return ok, err
}
