package store

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/spacedev/space/internal/fault"
)

// IdempotentResponse is a stored response to a request made with an Idempotency-Key.
type IdempotentResponse struct {
	Status int
	Body   []byte
}

// LookupIdempotency returns the stored response for (tenant, key), or nil. A key reused
// with a different request is an error (422).
func (s *Store) LookupIdempotency(ctx context.Context, tenant, key, method, path string, bodyHash []byte) (*IdempotentResponse, error) {
	var r IdempotentResponse
	var m, p string
	var h []byte
	err := s.pool.QueryRow(ctx, `SELECT method, path, body_hash, status, response FROM idempotency_keys WHERE tenant=$1 AND key=$2`,
		tenant, key).Scan(&m, &p, &h, &r.Status, &r.Body)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("lookup idempotency key: %w", err)
	}
	if m != method || p != path || !bytes.Equal(h, bodyHash) {
		return nil, fault.New(fault.Unprocessable, "Idempotency-Key %q was used with a different request", key)
	}
	return &r, nil
}

// SaveIdempotency stores a response inside tx (the same transaction that created the
// resource, so a crash cannot separate them). It returns a conflict if a concurrent
// request with the same key won.
func (t *Tx) SaveIdempotency(ctx context.Context, tenant, key, method, path string, bodyHash []byte, status int, body []byte) error {
	_, err := t.tx.Exec(ctx, `INSERT INTO idempotency_keys (tenant, key, method, path, body_hash, status, response)
		VALUES ($1,$2,$3,$4,$5,$6,$7)`, tenant, key, method, path, bodyHash, status, body)
	if isUniqueViolation(err) {
		return fault.New(fault.Conflict, "a request with Idempotency-Key %q is already in progress", key)
	}
	return err
}

// PurgeIdempotency removes records older than before.
func (s *Store) PurgeIdempotency(ctx context.Context, before time.Time) error {
	_, err := s.pool.Exec(ctx, `DELETE FROM idempotency_keys WHERE created_at < $1`, before)
	return err
}
