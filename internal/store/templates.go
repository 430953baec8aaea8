package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// Release is a row of template_releases.
type Release struct {
	Digest    string
	Name      string
	Config    json.RawMessage
	SizeBytes int64
	CreatedAt time.Time
	Tags      []string
}

// PutRelease records a release and points name:tag at it, in one transaction, and
// records that nodeID holds its artifacts.
func (s *Store) PutRelease(ctx context.Context, r *Release, tag, nodeID string) error {
	cfg := r.Config
	if len(cfg) == 0 {
		cfg = json.RawMessage(`{}`)
	}
	return s.InTx(ctx, func(tx *Tx) error {
		if _, err := tx.tx.Exec(ctx, `INSERT INTO template_releases (digest, name, config, size_bytes) VALUES ($1,$2,$3,$4)
			ON CONFLICT (digest) DO NOTHING`, r.Digest, r.Name, cfg, r.SizeBytes); err != nil {
			return fmt.Errorf("insert release: %w", err)
		}
		if tag != "" {
			if _, err := tx.tx.Exec(ctx, `INSERT INTO template_tags (name, tag, digest) VALUES ($1,$2,$3)
				ON CONFLICT (name, tag) DO UPDATE SET digest=$3, updated_at=now()`, r.Name, tag, r.Digest); err != nil {
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

// ResolveTag returns the digest name:tag points at, or "" if the tag does not exist.
func (s *Store) ResolveTag(ctx context.Context, name, tag string) (string, error) {
	var d string
	err := s.pool.QueryRow(ctx, `SELECT digest FROM template_tags WHERE name=$1 AND tag=$2`, name, tag).Scan(&d)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", nil
	}
	return d, err
}

// GetRelease returns a release by digest.
func (s *Store) GetRelease(ctx context.Context, digest string) (*Release, error) {
	var r Release
	err := s.pool.QueryRow(ctx, `SELECT digest, name, config, size_bytes, created_at FROM template_releases WHERE digest=$1`, digest).
		Scan(&r.Digest, &r.Name, &r.Config, &r.SizeBytes, &r.CreatedAt)
	if err != nil {
		return nil, notFound(err, "template release", digest)
	}
	return &r, nil
}

// ListReleases lists releases with their tags.
func (s *Store) ListReleases(ctx context.Context) ([]*Release, error) {
	rows, err := s.pool.Query(ctx, `SELECT r.digest, r.name, r.config, r.size_bytes, r.created_at,
		coalesce(array_agg(t.tag ORDER BY t.tag) FILTER (WHERE t.tag IS NOT NULL), '{}')
		FROM template_releases r LEFT JOIN template_tags t ON t.digest=r.digest
		GROUP BY r.digest ORDER BY r.name, r.created_at DESC`)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []*Release
	for rows.Next() {
		var r Release
		if err := rows.Scan(&r.Digest, &r.Name, &r.Config, &r.SizeBytes, &r.CreatedAt, &r.Tags); err != nil {
			return nil, err
		}
		out = append(out, &r)
	}
	return out, rows.Err()
}

// NodeHasRelease reports whether a node recorded holding the release's artifacts.
func (s *Store) NodeHasRelease(ctx context.Context, nodeID, digest string) (bool, error) {
	var ok bool
	err := s.pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM node_releases WHERE node_id=$1 AND digest=$2)`, nodeID, digest).Scan(&ok)
	return ok, err
}
