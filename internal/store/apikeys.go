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
	"github.com/spacedev/space/internal/fault"
)

// Key roles (docs/security.md, "Tenancy").
const (
	// RoleOperator sees and manages every tenant: tenants and quotas, nodes, metrics,
	// shared templates, every key. The bootstrap admin key is an operator key.
	RoleOperator = "operator"
	// RoleAdmin is a tenant's administrator: its keys, templates and pools.
	RoleAdmin = "admin"
	// RoleMember uses its tenant's sandboxes, sessions and operations.
	RoleMember = "member"
)

// APIKey is a row of the api_keys table.
type APIKey struct {
	ID     string
	Name   string
	Prefix string
	Kind   string
	// Tenant is the key's tenant (an operator key's home tenant: where its own
	// sandboxes go).
	Tenant    string
	Role      string
	CreatedAt time.Time
	RevokedAt *time.Time
}

// API converts the row to its wire form.
func (k *APIKey) API() api.APIKey {
	return api.APIKey{ID: k.ID, Name: k.Name, Prefix: k.Prefix, Kind: k.Kind, Tenant: k.Tenant, Role: k.Role,
		Admin: k.Role != RoleMember, CreatedAt: k.CreatedAt, RevokedAt: k.RevokedAt}
}

// HashKey is how key secrets are stored: SHA-256 (secrets are 256-bit random, so a
// fast hash is enough; no password stretching needed).
func HashKey(secret string) []byte {
	h := sha256.Sum256([]byte(secret))
	return h[:]
}

const keyCols = `id, name, prefix, kind, tenant, role, created_at, revoked_at`

func scanKey(row pgx.Row) (*APIKey, error) {
	var k APIKey
	err := row.Scan(&k.ID, &k.Name, &k.Prefix, &k.Kind, &k.Tenant, &k.Role, &k.CreatedAt, &k.RevokedAt)
	return &k, err
}

// CreateAPIKey stores a key (its hash only). The tenant must exist.
func (s *Store) CreateAPIKey(ctx context.Context, k *APIKey, secret string) error {
	if k.Role == "" {
		k.Role = RoleMember
	}
	row := s.pool.QueryRow(ctx, `INSERT INTO api_keys (id, name, prefix, hash, kind, tenant, role)
		VALUES ($1,$2,$3,$4,$5,$6,$7) RETURNING `+keyCols,
		k.ID, k.Name, k.Prefix, HashKey(secret), k.Kind, k.Tenant, k.Role)
	got, err := scanKey(row)
	if isForeignKeyViolation(err) {
		return fault.New(fault.NotFound, "tenant %q not found", k.Tenant)
	}
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

// GetAPIKey returns a key (revoked or not) by id.
func (s *Store) GetAPIKey(ctx context.Context, id string) (*APIKey, error) {
	k, err := scanKey(s.pool.QueryRow(ctx, `SELECT `+keyCols+` FROM api_keys WHERE id=$1`, id))
	if err != nil {
		return nil, notFound(err, "api key", id)
	}
	return k, nil
}

// ListAPIKeys lists the keys of a tenant ("" = every tenant), newest first.
func (s *Store) ListAPIKeys(ctx context.Context, tenant string) ([]*APIKey, error) {
	rows, err := s.pool.Query(ctx, `SELECT `+keyCols+` FROM api_keys WHERE $1 = '' OR tenant = $1 ORDER BY created_at DESC, id`, tenant)
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

// RevokeAPIKey revokes the key with this id (ids only: a prefix names no key) and
// announces it on ChannelKeys, so that the data plane cuts streams authorized by
// tokens the key minted. Revoking a revoked key changes nothing.
func (s *Store) RevokeAPIKey(ctx context.Context, id string) (*APIKey, error) {
	var k *APIKey
	err := s.InTx(ctx, func(tx *Tx) error {
		var err error
		k, err = scanKey(tx.tx.QueryRow(ctx, `UPDATE api_keys SET revoked_at=coalesce(revoked_at, now())
			WHERE id=$1 RETURNING `+keyCols, id))
		if err != nil {
			return notFound(err, "api key", id)
		}
		return tx.Notify(ctx, ChannelKeys, id)
	})
	return k, err
}

// KeyLive reports whether the key with this id exists and is not revoked.
func (s *Store) KeyLive(ctx context.Context, id string) (bool, error) {
	var live bool
	err := s.pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM api_keys WHERE id=$1 AND revoked_at IS NULL)`, id).Scan(&live)
	return live, err
}

// RevokedKeys returns which of ids are revoked or gone.
func (s *Store) RevokedKeys(ctx context.Context, ids []string) ([]string, error) {
	rows, err := s.pool.Query(ctx, `SELECT u.id FROM unnest($1::text[]) AS u(id)
		WHERE NOT EXISTS (SELECT 1 FROM api_keys k WHERE k.id = u.id AND k.revoked_at IS NULL)`, ids)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// CountOperatorKeys counts live operator keys.
func (s *Store) CountOperatorKeys(ctx context.Context) (int, error) {
	var n int
	err := s.pool.QueryRow(ctx, `SELECT count(*) FROM api_keys WHERE role=$1 AND revoked_at IS NULL`, RoleOperator).Scan(&n)
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
