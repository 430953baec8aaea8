package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// Node states.
const (
	NodeAlive = "alive"
	NodeDead  = "dead"
)

// ErrFenced is returned by Heartbeat when another incarnation of the node (a newer
// epoch) took over: the caller must stop.
var ErrFenced = errors.New("node epoch superseded by another incarnation")

// Node is a row of the nodes table.
type Node struct {
	ID           string
	Name         string
	Runtime      string
	RuntimeInfo  map[string]any
	DataPlaneURL string
	Epoch        int64
	State        string
	StartedAt    time.Time
	HeartbeatAt  time.Time
	Sandboxes    int
	// DiskLow says why the node refuses new disk use ('' when it has room).
	DiskLow string
}

// RegisterNode creates or updates a node's row at start-up and bumps its epoch, which
// fences writes by an older incarnation of the same node.
func (s *Store) RegisterNode(ctx context.Context, n *Node) error {
	info, err := json.Marshal(n.RuntimeInfo)
	if err != nil {
		return err
	}
	err = s.pool.QueryRow(ctx, `INSERT INTO nodes (id, name, runtime, runtime_info, data_plane_url)
		VALUES ($1,$2,$3,$4,$5)
		ON CONFLICT (id) DO UPDATE SET name=$2, runtime=$3, runtime_info=$4, data_plane_url=$5,
			epoch=nodes.epoch+1, state='alive', started_at=now(), heartbeat_at=now()
		RETURNING epoch, started_at, heartbeat_at`, n.ID, n.Name, n.Runtime, info, n.DataPlaneURL).
		Scan(&n.Epoch, &n.StartedAt, &n.HeartbeatAt)
	if err != nil {
		return fmt.Errorf("register node: %w", err)
	}
	n.State = "alive"
	return s.Notify(ctx, ChannelController, "")
}

// Heartbeat records that the node is alive, and its disk status (diskLow: why it
// refuses new disk use, ” when it has room). It fails if another incarnation took over.
func (s *Store) Heartbeat(ctx context.Context, id string, epoch int64, diskLow string) error {
	tag, err := s.pool.Exec(ctx, `UPDATE nodes SET heartbeat_at=now(), state='alive', disk_low=$3 WHERE id=$1 AND epoch=$2`, id, epoch, diskLow)
	if err != nil {
		return fmt.Errorf("heartbeat: %w", err)
	}
	if tag.RowsAffected() != 1 {
		return fmt.Errorf("heartbeat: node %s epoch %d: %w", id, epoch, ErrFenced)
	}
	return nil
}

const nodeCols = `n.id, n.name, n.runtime, n.runtime_info, n.data_plane_url, n.epoch, n.state, n.started_at, n.heartbeat_at,
	(SELECT count(*) FROM sandboxes s WHERE s.node_id=n.id AND s.deleted_at IS NULL), n.disk_low`

func scanNode(row pgx.Row) (*Node, error) {
	var n Node
	var info []byte
	if err := row.Scan(&n.ID, &n.Name, &n.Runtime, &info, &n.DataPlaneURL, &n.Epoch, &n.State, &n.StartedAt,
		&n.HeartbeatAt, &n.Sandboxes, &n.DiskLow); err != nil {
		return nil, err
	}
	_ = json.Unmarshal(info, &n.RuntimeInfo)
	return &n, nil
}

// ListNodes lists all nodes.
func (s *Store) ListNodes(ctx context.Context) ([]*Node, error) {
	rows, err := s.pool.Query(ctx, `SELECT `+nodeCols+` FROM nodes n ORDER BY n.name`)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []*Node
	for rows.Next() {
		n, err := scanNode(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, n)
	}
	return out, rows.Err()
}

// GetNode returns one node.
func (s *Store) GetNode(ctx context.Context, id string) (*Node, error) {
	n, err := scanNode(s.pool.QueryRow(ctx, `SELECT `+nodeCols+` FROM nodes n WHERE n.id=$1`, id))
	if err != nil {
		return nil, notFound(err, "node", id)
	}
	return n, nil
}

// MarkDeadNodes marks nodes whose heartbeat is older than before as dead and returns
// their ids.
func (s *Store) MarkDeadNodes(ctx context.Context, before time.Time) ([]string, error) {
	rows, err := s.pool.Query(ctx, `UPDATE nodes SET state='dead' WHERE state='alive' AND heartbeat_at < $1 RETURNING id`, before)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}
