package store

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base32"
	"encoding/hex"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/spacedev/space/api"
)

// APIKey is a row of the api_keys table.
type APIKey struct {
	ID        string
	Name      string
	Prefix    string
	Kind      string
	Tenant    string
	Admin     bool
	CreatedAt time.Time
	RevokedAt *time.Time
}

// API converts the row to its wire form.
func (k *APIKey) API() api.APIKey {
	return api.APIKey{ID: k.ID, Name: k.Name, Prefix: k.Prefix, Kind: k.Kind, Admin: k.Admin,
		CreatedAt: k.CreatedAt, RevokedAt: k.RevokedAt}
}

// HashKey is how key secrets are stored: SHA-256 (secrets are 256-bit random, so a
// fast hash is enough; no password stretching needed).
func HashKey(secret string) []byte {
	h := sha256.Sum256([]byte(secret))
	return h[:]
}

const keyCols = `id, name, prefix, kind, tenant, admin, created_at, revoked_at`

func scanKey(row pgx.Row) (*APIKey, error) {
	var k APIKey
	err := row.Scan(&k.ID, &k.Name, &k.Prefix, &k.Kind, &k.Tenant, &k.Admin, &k.CreatedAt, &k.RevokedAt)
	return &k, err
}

// CreateAPIKey stores a key (its hash only).
func (s *Store) CreateAPIKey(ctx context.Context, k *APIKey, secret string) error {
	row := s.pool.QueryRow(ctx, `INSERT INTO api_keys (id, name, prefix, hash, kind, tenant, admin)
		VALUES ($1,$2,$3,$4,$5,$6,$7) RETURNING `+keyCols,
		k.ID, k.Name, k.Prefix, HashKey(secret), k.Kind, k.Tenant, k.Admin)
	got, err := scanKey(row)
	if err != nil {
		return fmt.Errorf("create api key: %w", err)
	}
	*k = *got
	return nil
}

// LookupAPIKey finds the live key with this secret.
func (s *Store) LookupAPIKey(ctx context.Context, secret string) (*APIKey, error) {
	k, err := scanKey(s.pool.QueryRow(ctx, `SELECT `+keyCols+` FROM api_keys WHERE hash=$1 AND revoked_at IS NULL`, HashKey(secret)))
	if err != nil {
		return nil, notFound(err, "api key", "")
	}
	return k, nil
}

// ListAPIKeys lists keys, newest first.
func (s *Store) ListAPIKeys(ctx context.Context) ([]*APIKey, error) {
	rows, err := s.pool.Query(ctx, `SELECT `+keyCols+` FROM api_keys ORDER BY created_at DESC`)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []*APIKey
	for rows.Next() {
		k, err := scanKey(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, k)
	}
	return out, rows.Err()
}

// RevokeAPIKey revokes a key by id or prefix.
func (s *Store) RevokeAPIKey(ctx context.Context, idOrPrefix string) (*APIKey, error) {
	k, err := scanKey(s.pool.QueryRow(ctx, `UPDATE api_keys SET revoked_at=coalesce(revoked_at, now())
		WHERE id=$1 OR prefix=$1 RETURNING `+keyCols, idOrPrefix))
	if err != nil {
		return nil, notFound(err, "api key", idOrPrefix)
	}
	return k, nil
}

// CountAdminKeys counts live admin keys.
func (s *Store) CountAdminKeys(ctx context.Context) (int, error) {
	var n int
	err := s.pool.QueryRow(ctx, `SELECT count(*) FROM api_keys WHERE admin AND revoked_at IS NULL`).Scan(&n)
	return n, err
}

// NewKeySecret returns a new random key secret of the given kind and its display
// prefix. Space keys look like "space_<40 base32>"; E2B keys like "e2b_<40 hex>" (the
// shape E2B SDKs validate).
func NewKeySecret(kind string) (secret, prefix string, err error) {
	b := make([]byte, 25)
	if _, err := rand.Read(b); err != nil {
		return "", "", err
	}
	switch kind {
	case "e2b":
		secret = "e2b_" + hex.EncodeToString(b[:20])
	default:
		secret = "space_" + strings.ToLower(base32.StdEncoding.WithPadding(base32.NoPadding).EncodeToString(b))
	}
	return secret, secret[:strings.IndexByte(secret, '_')+7], nil
}
