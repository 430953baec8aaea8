package store

import "context"

// RecentOperations lists the newest operations of one kind (e.g. template builds),
// newest first; tenant "" lists every tenant's.
func (s *Store) RecentOperations(ctx context.Context, kind, tenant string, limit int) ([]*Operation, error) {
	rows, err := s.pool.Query(ctx, `SELECT `+opCols+` FROM operations
		WHERE kind=$1 AND ($2 = '' OR tenant=$2) ORDER BY created_at DESC LIMIT $3`, kind, tenant, limit)
	if err != nil {
		return nil, err
	}
	return collectOps(rows)
}
