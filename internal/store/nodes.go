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
	// Fingerprint identifies the installation that registered the node's id (its
	// host, data directory and store: node.Fingerprint). A registration presenting
	// another fingerprint than the row's is refused (ErrCopiedNode) unless
	// TakeOver is set; '' skips the check (in-process test nodes).
	Fingerprint string
	// TakeOver lets RegisterNode accept a fingerprint change (the operator moved the
	// data directory, and says its old copy runs nowhere: space serve --node-takeover).
	TakeOver bool
	// Cache is what the node holds in its cache (ListNodes, FindNode).
	Cache NodeCache
}

// NodeCache is what a node holds that other nodes may not: template releases (and
// their size) and named snapshots (and their size).
type NodeCache struct {
	Releases      int
	ReleaseBytes  int64
	Snapshots     int
	SnapshotBytes int64
}

// ErrCopiedNode is the kind of error RegisterNode returns when another installation
// registered the node's id: its data directory (with its node-id file) was copied.
var ErrCopiedNode = errors.New("node id registered by another installation")

// RegisterNode creates or updates a node's row at start-up and bumps its epoch, which
// fences writes by an older incarnation of the same node. A node that was dead is alive
// again: n.DeadReason says why it had been marked dead (empty when it had not).
//
// The row keeps the fingerprint of the installation that registered it: a
// registration with another (non-empty) fingerprint is refused with a fault.Conflict
// wrapping ErrCopiedNode, and changes nothing, unless n.TakeOver — a data directory
// copied to a second host must never take over the first one's row (and mark its
// live sandboxes failed).
func (s *Store) RegisterNode(ctx context.Context, n *Node) error {
	info, err := json.Marshal(n.RuntimeInfo)
	if err != nil {
		return err
	}
	a := n.Allocatable
	err = s.pool.QueryRow(ctx, `WITH prev AS (SELECT dead_reason FROM nodes WHERE id=$1)
		INSERT INTO nodes (id, name, runtime, runtime_info, data_plane_url, alloc_cpu, alloc_memory_mb, alloc_disk_mb, fingerprint)
		VALUES ($1,$2,$3,$4,$5,$6,$7,$8,$9)
		ON CONFLICT (id) DO UPDATE SET name=$2, runtime=$3, runtime_info=$4, data_plane_url=$5,
			alloc_cpu=$6, alloc_memory_mb=$7, alloc_disk_mb=$8, dead_reason='',
			fingerprint=CASE WHEN $9='' THEN nodes.fingerprint ELSE $9 END,
			epoch=nodes.epoch+1, state='alive', started_at=now(), heartbeat_at=now()
		WHERE $9='' OR nodes.fingerprint IN ('', $9) OR $10
		RETURNING epoch, started_at, heartbeat_at, cordoned, coalesce((SELECT dead_reason FROM prev), '')`,
		n.ID, n.Name, n.Runtime, info, n.DataPlaneURL, a.CPU, a.MemoryMB, a.DiskMB, n.Fingerprint, n.TakeOver).
		Scan(&n.Epoch, &n.StartedAt, &n.HeartbeatAt, &n.Cordoned, &n.DeadReason)
	if errors.Is(err, pgx.ErrNoRows) {
		return s.copiedNode(ctx, n)
	}
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

// copiedNode is the error of a registration refused because another installation
// registered n.ID.
func (s *Store) copiedNode(ctx context.Context, n *Node) error {
	var name, fp, state string
	if err := s.pool.QueryRow(ctx, `SELECT name, fingerprint, state FROM nodes WHERE id=$1`, n.ID).Scan(&name, &fp, &state); err != nil {
		return fmt.Errorf("register node: %w", err)
	}
	return fault.Wrap(fault.Conflict, fmt.Errorf("register node: node id %s is node %q (%s), registered by another installation "+
		"(%s; this one is %s): its data directory was copied from another host or path, and may not take that node over. "+
		"If the old installation is gone for good, remove the node with `space node rm %s` and start again (its sandboxes "+
		"are deleted with it); to run this one as a new node, delete the node-id file in its data directory; if you moved "+
		"the data directory and the old copy runs nowhere, start with --node-takeover: %w",
		n.ID, name, state, fp, n.Fingerprint, name, ErrCopiedNode))
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

// nodeCols are a node's columns with its usage and cache (ListNodes, FindNode);
// nodeColsLight leave those out (GetNode, on the path of every data-plane request).
var (
	nodeColsLight = `n.id, n.name, n.runtime, n.runtime_info, n.data_plane_url, n.epoch, n.state, n.started_at, n.heartbeat_at,
	(SELECT count(*) FROM sandboxes s WHERE s.node_id=n.id AND s.deleted_at IS NULL), n.disk_low,
	n.alloc_cpu, n.alloc_memory_mb, n.alloc_disk_mb, n.cordoned, n.dead_reason, n.fingerprint, `
	nodeCols = nodeColsLight + usedSQL + `, ` + cacheSQL
	// nodeNoUsage stands for usedSQL and cacheSQL in nodeColsLight's queries.
	nodeNoUsage = `NULL::bigint[], NULL::bigint[]`
)

// cacheSQL computes, as an array [releases, release bytes, snapshots, snapshot bytes],
// what node n holds: the template releases on its disk and its ready named snapshots.
var cacheSQL = `(SELECT ARRAY[count(*), coalesce(sum(r.size_bytes), 0),
		(SELECT count(*) FROM snapshots sn WHERE sn.node_id = n.id AND sn.state = 'ready'),
		(SELECT coalesce(sum(sn.size_bytes), 0) FROM snapshots sn WHERE sn.node_id = n.id AND sn.state = 'ready')]::bigint[]
	FROM node_releases nr JOIN template_releases r ON r.digest = nr.digest WHERE nr.node_id = n.id)`

func scanNode(row pgx.Row) (*Node, error) {
	var n Node
	var info []byte
	var used, cache []int64
	if err := row.Scan(&n.ID, &n.Name, &n.Runtime, &info, &n.DataPlaneURL, &n.Epoch, &n.State, &n.StartedAt,
		&n.HeartbeatAt, &n.Sandboxes, &n.DiskLow, &n.Allocatable.CPU, &n.Allocatable.MemoryMB, &n.Allocatable.DiskMB,
		&n.Cordoned, &n.DeadReason, &n.Fingerprint, &used, &cache); err != nil {
		return nil, err
	}
	if len(used) == 3 {
		n.Used = Resources{CPU: int(used[0]), MemoryMB: used[1], DiskMB: used[2]}
	}
	if len(cache) == 4 {
		n.Cache = NodeCache{Releases: int(cache[0]), ReleaseBytes: cache[1], Snapshots: int(cache[2]), SnapshotBytes: cache[3]}
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

// GetNode returns one node, without its usage and cache (Node.Used and Node.Cache
// are zero: ListNodes and FindNode compute them).
func (s *Store) GetNode(ctx context.Context, id string) (*Node, error) {
	return getNode(ctx, s.pool, id)
}

// GetNode is Store.GetNode in the transaction: a check inside a transaction reads
// through it, never through the pool, whose connections the transaction may be
// waiting for (a transaction that holds a lock others queue on, each with a pool
// connection, would wait for one of theirs for ever).
func (t *Tx) GetNode(ctx context.Context, id string) (*Node, error) { return getNode(ctx, t.tx, id) }

func getNode(ctx context.Context, q querier, id string) (*Node, error) {
	n, err := scanNode(q.QueryRow(ctx, `SELECT `+nodeColsLight+nodeNoUsage+` FROM nodes n WHERE n.id=$1`, id))
	if err != nil {
		return nil, notFound(err, "node", id)
	}
	return n, nil
}

// AddNodeReleases records that node nodeID holds the template releases digests (those
// the fleet knows: others are skipped) and returns how many it had not recorded. A
// node reports what its store holds at start and at each resync, so that the
// scheduler's preference for nodes holding a release and `space node list` see
// releases it got by any path.
func (s *Store) AddNodeReleases(ctx context.Context, nodeID string, digests []string) (int, error) {
	if len(digests) == 0 {
		return 0, nil
	}
	tag, err := s.pool.Exec(ctx, `INSERT INTO node_releases (node_id, digest)
		SELECT $1, r.digest FROM template_releases r WHERE r.digest = ANY($2)
		ON CONFLICT DO NOTHING`, nodeID, digests)
	if err != nil {
		return 0, fmt.Errorf("record node releases: %w", err)
	}
	return int(tag.RowsAffected()), nil
}

// PoolUse says how busy this process's connection pool is: connections in use, its
// size, and how many acquisitions had to wait so far (a slow heartbeat logs it, to tell
// a starved pool from a slow server).
func (s *Store) PoolUse() (inUse, size int32, waited int64) {
	st := s.pool.p.Stat()
	return st.AcquiredConns(), st.MaxConns(), st.EmptyAcquireCount()
}
