// Package controller owns space's cluster-wide control loops: scheduling pending
// sandboxes onto nodes, marking nodes dead after missed heartbeats, deleting sandboxes
// whose TTL ended, and purging old records. One controller is leader at a time, elected
// through a PostgreSQL advisory lock held on a dedicated connection; losing the
// connection loses leadership, and another replica takes over.
package controller

import (
	"context"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"golang.org/x/sync/errgroup"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/lifecycle"
	"github.com/spacedev/space/internal/store"
)

// leaderLockKey is the advisory lock that elects the controller leader.
const leaderLockKey = 0x5ace0001

// Defaults of Config, the one source for each.
const (
	DefaultNodeTimeout  = 15 * time.Second
	DefaultResync       = 5 * time.Second
	DefaultRetention    = 24 * time.Hour
	DefaultPlaceTimeout = time.Minute
)

// Config configures the controller.
type Config struct {
	Store  *store.Store
	Logger *slog.Logger
	// NodeTimeout is how long a node may miss heartbeats before it is marked dead.
	NodeTimeout time.Duration
	// Resync is the period of the full scheduling pass (the safety net behind
	// notifications).
	Resync time.Duration
	// Retention is how long deleted sandboxes and finished operations are kept.
	Retention time.Duration
	// PlaceTimeout is how long a sandbox no node can run (runtime, capacity, cordons)
	// waits before its create fails.
	PlaceTimeout time.Duration
	// Placement is the placement policy (default Spread).
	Placement Policy
	// Registry is the fleet's artifact store (space serve --registry), whose
	// unreferenced release artifacts the leader deletes (gc.go); nil: none.
	Registry Registry
	// GCGrace is how long a release artifact stays after nothing references it and
	// after its push (default DefaultGCGrace); GCInterval how often the leader looks
	// (default DefaultGCInterval).
	GCGrace, GCInterval time.Duration
}

// Controller runs the control loops.
type Controller struct {
	cfg  Config
	st   *store.Store
	log  *slog.Logger
	kick chan struct{}
	// leading is when this replica last became leader: nodes are judged by their
	// heartbeats only after a full NodeTimeout of watching them (markDead).
	leading time.Time
}

// New returns a controller.
func New(cfg Config) *Controller {
	if cfg.NodeTimeout == 0 {
		cfg.NodeTimeout = DefaultNodeTimeout
	}
	if cfg.Resync == 0 {
		cfg.Resync = DefaultResync
	}
	if cfg.Retention == 0 {
		cfg.Retention = DefaultRetention
	}
	if cfg.GCGrace == 0 {
		cfg.GCGrace = DefaultGCGrace
	}
	if cfg.GCInterval == 0 {
		cfg.GCInterval = DefaultGCInterval
	}
	if cfg.PlaceTimeout == 0 {
		cfg.PlaceTimeout = DefaultPlaceTimeout
	}
	if cfg.Placement == "" {
		cfg.Placement = Spread
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	return &Controller{cfg: cfg, st: cfg.Store, log: cfg.Logger, kick: make(chan struct{}, 1)}
}

// Run campaigns for leadership and runs the loops while leader, until ctx ends. Every
// goroutine it starts has ended when it returns.
func (c *Controller) Run(ctx context.Context) error {
	g, ctx := errgroup.WithContext(ctx)
	g.Go(func() error {
		return c.st.Listen(ctx, c.log, func(_, _ string) { c.wake() }, store.ChannelController)
	})
	g.Go(func() error { return c.campaignLoop(ctx) })
	return g.Wait()
}

// campaignLoop campaigns for leadership and leads while it holds it.
func (c *Controller) campaignLoop(ctx context.Context) error {
	for ctx.Err() == nil {
		conn, err := c.campaign(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			c.log.Warn("controller election", "err", err)
			sleep(ctx, 2*time.Second)
			continue
		}
		if conn == nil {
			sleep(ctx, 2*time.Second)
			continue
		}
		c.log.Info("controller: leader")
		c.lead(ctx, conn)
		conn.Close(context.WithoutCancel(ctx))
		c.log.Info("controller: no longer leader")
	}
	return nil
}

func sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}

func (c *Controller) wake() {
	select {
	case c.kick <- struct{}{}:
	default:
	}
}

// campaign returns a connection holding the leader lock, or nil if another replica
// leads.
func (c *Controller) campaign(ctx context.Context) (*pgx.Conn, error) {
	conn, err := c.st.Connect(ctx)
	if err != nil {
		return nil, err
	}
	var ok bool
	if err := conn.QueryRow(ctx, `SELECT pg_try_advisory_lock($1)`, leaderLockKey).Scan(&ok); err != nil {
		conn.Close(ctx)
		return nil, err
	}
	if !ok {
		conn.Close(ctx)
		return nil, nil
	}
	return conn, nil
}

func (c *Controller) lead(ctx context.Context, conn *pgx.Conn) {
	c.leading = time.Now()
	resync := time.NewTicker(c.cfg.Resync)
	defer resync.Stop()
	ttl := time.NewTicker(time.Second)
	defer ttl.Stop()
	purge := time.NewTicker(10 * time.Minute)
	defer purge.Stop()
	gcCtx, stopGC := context.WithCancel(ctx)
	gcDone := make(chan struct{})
	go func() { defer close(gcDone); c.collectReleases(gcCtx) }()
	defer func() { stopGC(); <-gcDone }()
	c.pass(ctx)
	for {
		select {
		case <-ctx.Done():
			return
		case <-c.kick:
			c.pools(ctx)
			c.drains(ctx)
			c.schedule(ctx)
		case <-ttl.C:
			c.expire(ctx)
			c.idle(ctx)
		case <-resync.C:
			// Leadership lives as long as the lock's connection.
			if err := conn.Ping(ctx); err != nil {
				c.log.Warn("controller lost its lock connection", "err", err)
				return
			}
			c.pass(ctx)
		case <-purge.C:
			c.purge(ctx)
		}
	}
}

func (c *Controller) pass(ctx context.Context) {
	c.markDead(ctx)
	c.pools(ctx)
	c.drains(ctx)
	c.schedule(ctx)
	c.expire(ctx)
	if n, err := c.st.FinishOrphanOperations(ctx); err != nil {
		c.log.Warn("finish the operations of deleted sandboxes", "err", err)
	} else if n > 0 {
		c.log.Info("ended the open operations of deleted sandboxes", "count", n)
	}
}

// markDead marks nodes that missed their heartbeats dead, fences them and settles
// their sandboxes (store.MarkDeadNodes): lost, kept on the node's disk, or deleted.
func (c *Controller) markDead(ctx context.Context) {
	// A leader that just took over (after a restart of the whole service, say) has not
	// watched the nodes for NodeTimeout yet: heartbeats that went stale while nobody
	// led say nothing about the nodes, which are registering again meanwhile.
	if time.Since(c.leading) < c.cfg.NodeTimeout {
		return
	}
	dead, err := c.st.MarkDeadNodes(ctx, time.Now().Add(-c.cfg.NodeTimeout))
	if err != nil {
		c.log.Warn("mark dead nodes", "err", err)
		return
	}
	for _, d := range dead {
		c.log.Warn("node missed its heartbeats; marked dead and fenced", "node", d.Name, "id", d.ID, "why", d.Reason,
			"lost_sandboxes", d.Lost, "kept_sandboxes", d.Kept, "deleted_sandboxes", d.Deleted)
	}
}

// schedule places pending sandboxes on nodes (Pick). One that fits nowhere waits,
// with the reason on the sandbox and its create operation, and fails with that reason
// after PlaceTimeout — unless no node is alive at all: then it waits for one (a whole
// fleet restarting must not fail every create made meanwhile).
func (c *Controller) schedule(ctx context.Context) {
	pending, err := c.st.PendingSandboxes(ctx, 500)
	if err != nil {
		c.log.Warn("list pending sandboxes", "err", err)
		return
	}
	if len(pending) == 0 {
		return
	}
	nodes, err := c.st.ListNodes(ctx)
	if err != nil {
		c.log.Warn("list nodes", "err", err)
		return
	}
	releases, err := c.st.NodeReleases(ctx)
	if err != nil {
		c.log.Warn("list node releases", "err", err)
		return
	}
	for _, sb := range pending {
		if sb.MoveFrom != "" && sb.DesiredState != api.StateDeleted {
			c.placeMove(ctx, sb, nodes, releases) // moves.go
			continue
		}
		if sb.DesiredState == api.StateDeleted {
			c.finishUnscheduledDelete(ctx, sb)
			continue
		}
		want := Want{Runtime: sb.Spec.Runtime, CPU: sb.Spec.CPU, MemoryMB: int64(sb.Spec.MemoryMB),
			DiskMB: store.DefaultDiskEstimateMB, Digest: sb.TemplateDigest}
		n, why := Pick(nodes, want, c.cfg.Placement, releases)
		if n == nil {
			if why != NoNodeAlive && time.Since(sb.CreatedAt) > c.cfg.PlaceTimeout {
				c.failUnplaceable(ctx, sb, why)
				continue
			}
			c.waitForNode(ctx, sb, "waiting for a node: "+why)
			continue
		}
		if c.assign(ctx, sb, n, want) {
			c.log.Info("scheduled sandbox", "sandbox", sb.ID, "node", n.Name)
			_ = c.st.SetPendingReason(ctx, sb.ID, "scheduled on node "+n.Name)
			_ = c.st.ProgressSandboxOperations(ctx, sb.ID, sb.Generation, "scheduled on node "+n.Name)
		}
	}
}

// waitForNode records why a sandbox is not placed yet, on it and its operations.
func (c *Controller) waitForNode(ctx context.Context, sb *store.Sandbox, reason string) {
	_ = c.st.SetPendingReason(ctx, sb.ID, reason)
	_ = c.st.ProgressSandboxOperations(ctx, sb.ID, sb.Generation, reason)
}

// assign places sb on n and counts what it takes there (so that the rest of this pass
// sees n fuller); false when it was not assigned (the sandbox changed meanwhile, or
// the database failed: logged, the next pass tries again).
func (c *Controller) assign(ctx context.Context, sb *store.Sandbox, n *store.Node, want Want) bool {
	ok, err := c.st.AssignNode(ctx, sb.ID, n.ID, n.Runtime)
	if err != nil {
		c.log.Warn("assign node", "sandbox", sb.ID, "err", err)
		return false
	}
	if ok {
		n.Sandboxes++
		n.Used.CPU += want.CPU
		n.Used.MemoryMB += want.MemoryMB
		n.Used.DiskMB += want.DiskMB
	}
	return ok
}

func (c *Controller) finishUnscheduledDelete(ctx context.Context, sb *store.Sandbox) {
	ok, err := c.st.FinishUnassigned(ctx, sb.ID, sb.Generation)
	if err != nil || !ok {
		return
	}
	ops, err := c.st.OpenOperations(ctx, sb.ID)
	if err != nil {
		return
	}
	for _, op := range ops {
		if op.Kind == api.OpDelete {
			_ = c.st.UpdateOperation(ctx, op.ID, api.OpSucceeded, "deleted", "")
		} else {
			_ = c.st.UpdateOperation(ctx, op.ID, api.OpFailed, "superseded", "the sandbox was deleted before it started")
		}
	}
}

// expire deletes sandboxes whose TTL ended.
func (c *Controller) expire(ctx context.Context) {
	list, err := c.st.ExpiredSandboxes(ctx, time.Now(), 100)
	if err != nil {
		c.log.Warn("list expired sandboxes", "err", err)
		return
	}
	for _, sb := range list {
		desired, kind, reason := api.StateDeleted, api.OpDelete, "ttl expired"
		switch sb.ExpireAction {
		case "suspend":
			desired, kind, reason = api.StateSuspended, api.OpSuspend, "timeout reached (auto-pause)"
		case "stop": // E2B's auto-pause without memory
			desired, kind, reason = api.StateStopped, api.OpStop, "timeout reached (auto-pause, memory not kept)"
		}
		verb, _ := lifecycle.VerbOf(kind)
		err := c.request(ctx, sb.ID, desired, kind, reason, func(cur *store.Sandbox) bool {
			if desired == api.StateDeleted {
				return cur.DesiredState != api.StateDeleted
			}
			// An auto-pause waits for a transition in flight to settle.
			return cur.DesiredState != desired && lifecycle.Check(cur.Lifecycle(), verb) == nil
		})
		if err != nil {
			c.log.Warn("expire sandbox", "sandbox", sb.ID, "err", err)
			continue
		}
		c.log.Info("sandbox expired", "sandbox", sb.ID, "action", sb.ExpireAction)
	}
}

func (c *Controller) purge(ctx context.Context) {
	before := time.Now().Add(-c.cfg.Retention)
	if n, err := c.st.PurgeDeleted(ctx, before); err == nil && n > 0 {
		c.log.Info("purged deleted sandboxes", "count", n)
	}
	if _, err := c.st.PurgeOperations(ctx, before); err != nil {
		c.log.Warn("purge operations", "err", err)
	}
	if err := c.st.PurgeIdempotency(ctx, time.Now().Add(-24*time.Hour)); err != nil {
		c.log.Warn("purge idempotency keys", "err", err)
	}
}

func (c *Controller) failUnplaceable(ctx context.Context, sb *store.Sandbox, why string) {
	reason := "no node can run it: " + why
	ok, err := c.st.FailUnassigned(ctx, sb.ID, sb.Generation, reason)
	if err != nil || !ok {
		return
	}
	_ = c.st.FinishSandboxOperations(ctx, sb.ID, sb.Generation, api.OpFailed, reason)
	c.log.Warn("sandbox cannot be placed", "sandbox", sb.ID, "runtime", sb.Spec.Runtime, "why", why)
}
