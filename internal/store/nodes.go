package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/spacedev/space/internal/fault"
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
	// Allocatable is what the node offers its sandboxes (0 in a field: not reported,
	// unbounded); Used is what the sandboxes placed on it take of it (see usedSQL;
	// not filled by GetNode).
	Allocatable Resources
	Used        Resources
	// Cordoned nodes get no new placements.
	Cordoned bool
	// DeadReason says why and since when the node is dead ('' while alive).
	DeadReason string
}

// RegisterNode creates or updates a node's row at start-up and bumps its epoch, which
// fences writes by an older incarnation of the same node. A node that was dead is alive
// again: n.DeadReason says why it had been marked dead (empty when it had not).
func (s *Store) RegisterNode(ctx context.Context, n *Node) error {
	info, err := json.Marshal(n.RuntimeInfo)
	if err != nil {
		return err
	}
	a := n.Allocatable
	err = s.pool.QueryRow(ctx, `WITH prev AS (SELECT dead_reason FROM nodes WHERE id=$1)
		INSERT INTO nodes (id, name, runtime, runtime_info, data_plane_url, alloc_cpu, alloc_memory_mb, alloc_disk_mb)
		VALUES ($1,$2,$3,$4,$5,$6,$7,$8)
		ON CONFLICT (id) DO UPDATE SET name=$2, runtime=$3, runtime_info=$4, data_plane_url=$5,
			alloc_cpu=$6, alloc_memory_mb=$7, alloc_disk_mb=$8, dead_reason='',
			epoch=nodes.epoch+1, state='alive', started_at=now(), heartbeat_at=now()
		RETURNING epoch, started_at, heartbeat_at, cordoned, coalesce((SELECT dead_reason FROM prev), '')`,
		n.ID, n.Name, n.Runtime, info, n.DataPlaneURL, a.CPU, a.MemoryMB, a.DiskMB).
		Scan(&n.Epoch, &n.StartedAt, &n.HeartbeatAt, &n.Cordoned, &n.DeadReason)
	if err == nil && n.DeadReason != "" {
		// Its kept sandboxes no longer wait for it.
		_, err = s.pool.Exec(ctx, `UPDATE sandboxes SET status_reason='its node returned', updated_at=now()
			WHERE node_id=$1 AND deleted_at IS NULL AND status_reason LIKE 'its node is dead:%'`, n.ID)
	}
	if isUniqueViolation(err) {
		return fault.New(fault.Conflict, "register node: another node (another id) is registered as %q; "+
			"if it is gone for good, remove it with `space node rm %s`, or pick another --node-name", n.Name, n.Name)
	}
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

// nodeCols are a node's columns with its usage (ListNodes, FindNode); nodeColsLight
// leave the usage out (GetNode, on the path of every data-plane request).
var (
	nodeColsLight = `n.id, n.name, n.runtime, n.runtime_info, n.data_plane_url, n.epoch, n.state, n.started_at, n.heartbeat_at,
	(SELECT count(*) FROM sandboxes s WHERE s.node_id=n.id AND s.deleted_at IS NULL), n.disk_low,
	n.alloc_cpu, n.alloc_memory_mb, n.alloc_disk_mb, n.cordoned, n.dead_reason, `
	nodeCols = nodeColsLight + usedSQL
)

func scanNode(row pgx.Row) (*Node, error) {
	var n Node
	var info []byte
	var used []int64
	if err := row.Scan(&n.ID, &n.Name, &n.Runtime, &info, &n.DataPlaneURL, &n.Epoch, &n.State, &n.StartedAt,
		&n.HeartbeatAt, &n.Sandboxes, &n.DiskLow, &n.Allocatable.CPU, &n.Allocatable.MemoryMB, &n.Allocatable.DiskMB,
		&n.Cordoned, &n.DeadReason, &used); err != nil {
		return nil, err
	}
	if len(used) == 3 {
		n.Used = Resources{CPU: int(used[0]), MemoryMB: used[1], DiskMB: used[2]}
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

// GetNode returns one node, without its usage (Node.Used is zero: ListNodes and
// FindNode compute it).
func (s *Store) GetNode(ctx context.Context, id string) (*Node, error) {
	n, err := scanNode(s.pool.QueryRow(ctx, `SELECT `+nodeColsLight+`NULL::bigint[] FROM nodes n WHERE n.id=$1`, id))
	if err != nil {
		return nil, notFound(err, "node", id)
	}
	return n, nil
}
