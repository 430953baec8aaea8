package store

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
)

// ErrPlaced is returned by SetUnplacedSandboxNetwork when the sandbox has a node by
// now: its network policy must be changed through that node.
var ErrPlaced = fault.New(fault.Conflict, "the sandbox is placed on a node")

// SetSandboxNetwork records a sandbox's network policy (nil: none) in its spec. The
// node calls it once the policy is in force (or, for a sandbox without a live network,
// to have it applied at its next start).
func (s *Store) SetSandboxNetwork(ctx context.Context, id string, n *api.Network) error {
	return s.setNetwork(ctx, id, n, false)
}

// SetUnplacedSandboxNetwork records a sandbox's network policy only while no node has
// the sandbox (ErrPlaced otherwise): the node reads it when it creates the sandbox.
func (s *Store) SetUnplacedSandboxNetwork(ctx context.Context, id string, n *api.Network) error {
	return s.setNetwork(ctx, id, n, true)
}

func (s *Store) setNetwork(ctx context.Context, id string, n *api.Network, unplaced bool) error {
	var raw []byte
	if n != nil {
		var err error
		if raw, err = json.Marshal(n); err != nil {
			return fmt.Errorf("encode network policy: %w", err)
		}
	}
	// A nil policy (NULL) removes the key.
	tag, err := s.pool.Exec(ctx, `UPDATE sandboxes
		SET spec = CASE WHEN $2::jsonb IS NULL THEN spec - 'network_policy'
			ELSE jsonb_set(spec, '{network_policy}', $2::jsonb) END,
			updated_at = now()
		WHERE id = $1 AND deleted_at IS NULL AND (NOT $3 OR node_id IS NULL)`, id, raw, unplaced)
	if err != nil {
		return err
	}
	if tag.RowsAffected() == 0 {
		if unplaced {
			if _, err := s.GetSandbox(ctx, id); err == nil {
				return ErrPlaced
			}
		}
		return fault.New(fault.NotFound, "sandbox %q not found", id)
	}
	return nil
}
