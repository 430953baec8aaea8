package store

import (
	"context"
	"crypto/rand"
	"fmt"
)

// SigningKey returns the server's token signing key with the given id, creating it on
// first use. Every replica reads the same key, so tokens survive restarts and work on
// any api or node process sharing the database.
func (s *Store) SigningKey(ctx context.Context, id string) ([]byte, error) {
	secret := make([]byte, 32)
	if _, err := rand.Read(secret); err != nil {
		return nil, err
	}
	_, err := s.pool.Exec(ctx, `INSERT INTO signing_keys (id, secret) VALUES ($1,$2) ON CONFLICT (id) DO NOTHING`, id, secret)
	if err != nil {
		return nil, fmt.Errorf("create signing key: %w", err)
	}
	var got []byte
	if err := s.pool.QueryRow(ctx, `SELECT secret FROM signing_keys WHERE id=$1`, id).Scan(&got); err != nil {
		return nil, fmt.Errorf("read signing key: %w", err)
	}
	return got, nil
}
