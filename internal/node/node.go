// Package node owns the node role: the host agent that reconciles the sandboxes the
// store assigns to this host. It learns what to do only from PostgreSQL (notifications
// plus a periodic full resync) and asks internal/lifecycle's planner what the next step
// of each sandbox is; it drives the runtime and the disk to take that step, builds
// builtin templates on first need, adopts sandboxes that survived a restart, reclaims
// resources of ones that should not exist, and gives the data plane the sandboxes'
// agents.
package node

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sync/errgroup"
	"golang.org/x/sync/singleflight"

	"github.com/spacedev/space/internal/artifact"
	"github.com/spacedev/space/internal/guest/agentclient"
	"github.com/spacedev/space/internal/ids"
	"github.com/spacedev/space/internal/network"
	"github.com/spacedev/space/internal/runtime"
	"github.com/spacedev/space/internal/storage"
	"github.com/spacedev/space/internal/store"
	"github.com/spacedev/space/internal/template"
	"github.com/spacedev/space/internal/token"
)

// TemplateBuilder builds templates: the builtin templates (template.Builtins) and build
// specs (implemented by *template.Builder).
type TemplateBuilder interface {
	BuildBuiltin(ctx context.Context, name string, progress func(string)) (storage.Release, template.Config, error)
	Build(ctx context.Context, spec *template.Spec, opts template.BuildOptions) (storage.Release, template.Config, error)
	AllowedSources() template.Sources
}

// OpObserver records operation latencies.
type OpObserver interface {
	Observe(kind, result string, d time.Duration)
}

// Defaults of Config, the one source for each (space serve's flags use them).
const (
	DefaultResync            = 10 * time.Second
	DefaultHeartbeat         = 2 * time.Second
	DefaultAgentReadyTimeout = 60 * time.Second
	DefaultShutdownGrace     = 10 * time.Second
	activityPoll             = 2 * time.Second
	maxActivityPoll          = time.Minute
	measurePoll              = 3 * time.Second
	// maxStepsPerKick bounds how many planned steps one reconcile takes before it
	// yields (a sandbox that keeps failing cannot monopolize its worker).
	maxStepsPerKick = 8
)

// Config configures a node.
type Config struct {
	ID           string
	Name         string
	DataDir      string
	AdvertiseURL string
	Store        *store.Store
	Runtime      runtime.Runtime
	Storage      Disk
	// Builder builds templates; nil means this node builds none.
	Builder   TemplateBuilder
	AgentPath string
	AgentEnv  map[string]string
	Logger    *slog.Logger
	Metrics   OpObserver
	// Resync is the period of the full reconcile pass.
	Resync time.Duration
	// Heartbeat is the period of heartbeats.
	Heartbeat time.Duration
	// AgentReadyTimeout bounds how long a new sandbox's agent may take to answer.
	AgentReadyTimeout time.Duration
	// ShutdownGrace is how long in-flight work may continue after shutdown begins.
	ShutdownGrace time.Duration
	// NoBaseSnapshots disables base snapshots (every create boots).
	NoBaseSnapshots bool
	// PidsLimit bounds each sandbox's host tasks (0: the runtime's default).
	PidsLimit int
	// DefaultCPU and DefaultMemoryMB are the size class base snapshots are made for
	// right after a template build.
	DefaultCPU      int
	DefaultMemoryMB int
	// RuntimeReason says why this runtime was chosen; it is published with the node's
	// runtime details (the web console shows it).
	RuntimeReason string
	// Network sets up sandboxes' networks (*network.Manager); nil: this node runs no
	// sandbox that has a network policy.
	Network NetworkManager
	// Signer verifies the api role's node tokens on the node's internal routes
	// (RegisterRoutes).
	Signer *token.Signer
	// Capacity is what the node offers its sandboxes, published at registration for
	// the scheduler (0 in a field: unbounded; space serve --capacity, DefaultCapacity).
	Capacity store.Resources
	// Artifacts is the fleet's shared artifact store (space serve --registry): template
	// releases and snapshots are pushed there and pulled from it on demand. nil: this
	// node keeps its artifacts to itself (the single-machine default).
	Artifacts *artifact.Client
	// ReleaseCacheGrace is how long a release nothing uses stays in this node's store
	// before the node removes it (only with Artifacts: it can pull it again; default
	// DefaultReleaseCacheGrace). templates.go, evictReleases.
	ReleaseCacheGrace time.Duration
	// Fingerprint identifies this installation of the node (Fingerprint): a
	// registration of the node's id from another installation is refused
	// (store.ErrCopiedNode). '' skips the check.
	Fingerprint string
	// TakeOver accepts a changed fingerprint (space serve --node-takeover: the data
	// directory was moved and its old copy runs nowhere).
	TakeOver bool
}

// Node is a running node role.
type Node struct {
	cfg   Config
	st    *store.Store
	rt    runtime.Runtime
	disk  Disk
	net   NetworkManager
	log   *slog.Logger
	epoch int64
	info  runtime.Info
	// opDone, when set, is told each operation this node completes (OnOperationDone).
	opDone atomic.Pointer[func(opID string)]

	work     context.Context // cancelled only after the shutdown grace period
	stopping chan struct{}   // closed when shutdown begins: idle workers exit
	adopted  chan struct{}   // closed once surviving sandboxes are adopted
	wg       sync.WaitGroup  // in-flight sandbox work, base snapshots and builds
	mu       sync.Mutex
	works    map[string]chan struct{}
	agents   map[string]*agentclient.Client
	// gated are the data plane's clients of the agents: agents' through their gate.
	gated  map[string]*agentclient.Client
	active map[string]time.Time
	ready  map[string]bool
	// brief marks sandboxes paused for a moment by the node itself (moves.go).
	brief map[string]bool
	// recovering marks the sandboxes that should run but that the node found without
	// their instance when it started (a host reboot, a runtime crash): until their
	// worker's first pass has booted them again (or found that it cannot), requests
	// for them wait instead of being told that they do not run (Agent).
	recovering map[string]bool
	// gates hold the data plane's agent requests back while the node pauses a
	// sandbox's agent (gate.go).
	gates gates
	// toMeasure holds sandboxes whose disk usage is to be measured.
	toMeasure map[string]bool
	// seenOutput is each agent's last-activity time as last polled.
	seenOutput map[string]time.Time
	// polled is when each agent was last asked for its activity; idleOf each running
	// sandbox's idle timeout as last read (0: never suspended), which sets how often.
	polled map[string]time.Time
	idleOf map[string]time.Duration
	// looked is each running sandbox's host CPU reading and last agent answer, for
	// runtimes that read CPU time on the host (samples.go).
	looked map[string]hostLook
	// memWatches end the memory watches of the sandboxes served (memwatch.go);
	// oomKills counts the processes their agents ended.
	memWatches map[string]context.CancelFunc
	oomKills   atomic.Int64
	// sampledBy counts resource samples by where they came from (samples.go).
	sampledBy sampleCounts

	netLocks netLocks
	// snapKick wakes the named snapshot loop (named.go).
	snapKick chan struct{}

	quotaOnce sync.Once
	buildMu   sync.Mutex
	snapJobs  snapshotJobs
	pushes    pushJobs
	agentHash string // of the agent binary sandboxes run
	// agentsMu is held while an agent binary is placed under <data-dir>/agents/ or
	// those nothing needs are removed (agentbin.go).
	agentsMu sync.Mutex
	marks    timelines
	syncs    pendingSyncs // suspend checkpoints made durable in the background (durability.go)

	// builtins shares one wait for a builtin template among this node's creates
	// (templates.go): one database connection waits for the fleet-wide build lock.
	builtins singleflight.Group
	// releaseUse is held (read) while a create resolves its release and makes its disk
	// from it, and (write) while the node removes a release from its cache.
	releaseUse sync.RWMutex
	// pulledUse is held (read) while a create uses a pulled snapshot and (write)
	// while pulled snapshots are removed (pulledcache.go).
	pulledUse sync.RWMutex
	health    healthState
	starts    startTimes // recent start durations by path (startpath.go)
}

// New returns a node. Run starts it.
func New(cfg Config) (*Node, error) {
	if cfg.Store == nil || cfg.Runtime == nil || cfg.Storage == nil {
		return nil, errors.New("node: Config.Store, Runtime and Storage are required")
	}
	if cfg.ReleaseCacheGrace == 0 {
		cfg.ReleaseCacheGrace = DefaultReleaseCacheGrace
	}
	if cfg.Resync == 0 {
		cfg.Resync = DefaultResync
	}
	if cfg.Heartbeat == 0 {
		cfg.Heartbeat = DefaultHeartbeat
	}
	if cfg.AgentReadyTimeout == 0 {
		cfg.AgentReadyTimeout = DefaultAgentReadyTimeout
	}
	if cfg.ShutdownGrace == 0 {
		cfg.ShutdownGrace = DefaultShutdownGrace
	}
	if cfg.Metrics == nil {
		cfg.Metrics = nopObserver{}
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	return &Node{
		cfg: cfg, st: cfg.Store, rt: cfg.Runtime, disk: cfg.Storage, net: cfg.Network, log: cfg.Logger,
		works: map[string]chan struct{}{}, agents: map[string]*agentclient.Client{}, memWatches: map[string]context.CancelFunc{}, gated: map[string]*agentclient.Client{},
		active: map[string]time.Time{}, ready: map[string]bool{}, recovering: map[string]bool{}, adopted: make(chan struct{}),
		seenOutput: map[string]time.Time{}, polled: map[string]time.Time{}, idleOf: map[string]time.Duration{}, looked: map[string]hostLook{}, toMeasure: map[string]bool{}, stopping: make(chan struct{}),
		snapKick: make(chan struct{}, 1),
	}, nil
}

type nopObserver struct{}

func (nopObserver) Observe(string, string, time.Duration) {}

// LoadOrCreateID returns the node id kept in dataDir/node-id, creating it once.
func LoadOrCreateID(dataDir string) (string, error) {
	p := filepath.Join(dataDir, "node-id")
	b, err := os.ReadFile(p)
	if err == nil {
		id := strings.TrimSpace(string(b))
		if ids.ValidSandbox(id) {
			return id, nil
		}
		return "", fmt.Errorf("node id file %s is corrupt", p)
	}
	if !errors.Is(err, os.ErrNotExist) {
		return "", err
	}
	id := ids.Node()
	if err := os.WriteFile(p+".tmp", []byte(id+"\n"), 0o644); err != nil {
		return "", err
	}
	return id, os.Rename(p+".tmp", p)
}

// Run registers the node, adopts surviving sandboxes, and reconciles until ctx ends.
// In-flight work gets ShutdownGrace to finish; what is cut off is resumed by the next
// start (every step is recoverable). Every goroutine it starts has ended when it
// returns; the first error of one of its loops ends them all and is returned.
func (n *Node) Run(ctx context.Context) error {
	info, err := n.rt.Info(ctx)
	if err != nil {
		return fmt.Errorf("runtime info: %w", err)
	}
	n.info = info
	agent, hash, err := installAgent(n.cfg.DataDir, n.cfg.AgentPath)
	if err != nil {
		return err
	}
	n.cfg.AgentPath, n.agentHash = agent, hash
	details := map[string]any{"version": info.Version}
	for k, v := range info.Details {
		details[k] = v
	}
	for k, v := range hostCapacity(n.cfg.RuntimeReason) {
		details[k] = v
	}
	// Sandboxes move only between nodes that share a registry (controller/moves.go).
	details["registry"] = n.cfg.Artifacts != nil
	// Warm-pool members wait running on this runtime (docs/lifecycle.md, Warm pools).
	details["park_running"] = info.Caps.ParkRunning
	reg := &store.Node{ID: n.cfg.ID, Name: n.cfg.Name, Runtime: info.Name, RuntimeInfo: details, DataPlaneURL: n.cfg.AdvertiseURL,
		Allocatable: n.cfg.Capacity, Fingerprint: n.cfg.Fingerprint, TakeOver: n.cfg.TakeOver}
	if err := n.st.RegisterNode(ctx, reg); err != nil {
		return err
	}
	n.mu.Lock()
	n.epoch = reg.Epoch
	n.mu.Unlock()
	n.health.set(func(h *healthState) { h.registered, h.hbOK = true, time.Now() })
	if reg.DeadReason != "" {
		n.log.Warn("node returns after being marked dead; its lost sandboxes stay failed and what is left of them is reclaimed",
			"node", n.cfg.Name, "was", reg.DeadReason)
	}
	if n.cfg.TakeOver {
		n.log.Warn("node took over its id with --node-takeover: its fingerprint is now this installation's",
			"node", n.cfg.Name, "fingerprint", n.cfg.Fingerprint)
	}
	n.log.Info("node registered", "node", n.cfg.Name, "id", n.cfg.ID, "epoch", n.epoch, "runtime", info.Name, "version", info.Version,
		"capacity_cpu", n.cfg.Capacity.CPU, "capacity_memory_mb", n.cfg.Capacity.MemoryMB, "capacity_disk_mb", n.cfg.Capacity.DiskMB,
		"cordoned", reg.Cordoned)

	work, cancelWork := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelWork()
	n.work = work

	if err := n.recover(ctx); err != nil {
		return fmt.Errorf("recover sandboxes: %w", err)
	}
	close(n.adopted)
	n.reportReleases(ctx)

	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { n.runBuilds(gctx); return nil })
	g.Go(func() error { return every(gctx, measurePoll, n.measureQueued) })
	g.Go(func() error {
		return n.st.Listen(gctx, n.log, func(_, id string) {
			if id == "" {
				n.resync(gctx)
				return
			}
			if strings.HasPrefix(id, store.SnapshotPayload) {
				n.kickSnapshots()
				return
			}
			n.kick(id)
		}, store.NodeChannel(n.cfg.ID))
	})
	g.Go(func() error { return every(gctx, n.cfg.Resync, n.resync) })
	g.Go(func() error {
		return every(gctx, activityPoll, func(ctx context.Context) {
			n.pollOutputActivity(ctx)
			n.flushActivity(ctx)
		})
	})
	g.Go(func() error { return n.heartbeat(gctx) })
	g.Go(func() error { return n.runSnapshots(gctx) })
	g.Go(func() error { return n.runSamples(gctx) })
	g.Go(func() error {
		n.pruneAgents(gctx)
		return every(gctx, agentPrunePeriod, func(ctx context.Context) {
			n.pruneBaseSnapshots(ctx)
			n.pruneAgents(ctx)
		})
	})
	g.Go(func() error {
		<-gctx.Done()
		n.health.set(func(h *healthState) { h.stopping = true })
		return nil
	})
	runErr := g.Wait()
	if ctx.Err() != nil && errors.Is(runErr, context.Canceled) {
		runErr = nil
	}

	n.mu.Lock()
	close(n.stopping)
	n.mu.Unlock()
	done := make(chan struct{})
	go func() { n.wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(n.cfg.ShutdownGrace):
		n.log.Warn("shutdown grace period over; interrupting in-flight work (it resumes at next start)")
		cancelWork()
		<-done
	}
	return runErr
}

// every runs fn every period until ctx ends.
func every(ctx context.Context, period time.Duration, fn func(context.Context)) error {
	t := time.NewTicker(period)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			fn(ctx)
		}
	}
}

// heartbeat records that the node is alive until ctx ends. It fails when another
// incarnation of the node took over (store.ErrFenced): this one must stop.
func (n *Node) heartbeat(ctx context.Context) error {
	t := time.NewTicker(n.cfg.Heartbeat)
	defer t.Stop()
	n.probeRuntime(ctx)
	for beat := 1; ; beat++ {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		diskLow := ""
		if err := n.disk.CheckSpace(0); err != nil {
			diskLow = err.Error()
		}
		hb0 := time.Now()
		err := n.st.Heartbeat(ctx, n.cfg.ID, n.epoch, diskLow)
		if took := time.Since(hb0); took > n.cfg.Heartbeat && ctx.Err() == nil {
			inUse, size, waited := n.st.PoolUse()
			n.log.Warn("heartbeat slow: the node may be marked dead if they keep taking this long", "took", took.Round(time.Millisecond),
				"db_conns_in_use", inUse, "db_pool_size", size, "db_acquires_waited", waited)
		}
		n.health.set(func(h *healthState) {
			h.diskLow = diskLow
			switch {
			case err == nil:
				h.hbOK, h.hbErr = time.Now(), ""
			case ctx.Err() == nil:
				h.hbErr = err.Error()
				h.hbFailures++
			}
		})
		switch {
		case err == nil || ctx.Err() != nil:
		case errors.Is(err, store.ErrFenced):
			n.health.set(func(h *healthState) { h.fenced = err.Error() })
			return fmt.Errorf("node %s was fenced (another process took over its id, or it was marked dead after missed "+
				"heartbeats, or removed): it stops and, restarted, registers again and reclaims what it holds: %w", n.cfg.Name, err)
		default:
			n.log.Warn("heartbeat failed", "err", err)
		}
		if beat%runtimeProbeEvery == 0 {
			n.probeRuntime(ctx)
		}
	}
}

// reportReleases records in the store the template releases this node's disk holds
// (its cache, for the scheduler and space node list), whichever way they came.
func (n *Node) reportReleases(ctx context.Context) {
	rels, err := n.disk.ListReleases()
	if err != nil {
		n.log.Debug("list releases", "err", err)
		return
	}
	digests := make([]string, 0, len(rels))
	for _, r := range rels {
		digests = append(digests, r.Digest)
	}
	if added, err := n.st.AddNodeReleases(ctx, n.cfg.ID, digests); err != nil {
		if ctx.Err() == nil {
			n.log.Debug("report releases", "err", err)
		}
	} else if added > 0 {
		n.log.Info("reported template releases held on disk", "new", added)
	}
}

// resync kicks every sandbox assigned to this node.
func (n *Node) resync(ctx context.Context) {
	n.reportReleases(ctx)
	list, err := n.st.ListSandboxes(ctx, store.SandboxFilter{NodeID: n.cfg.ID, IncludePool: true})
	if err != nil {
		if ctx.Err() == nil {
			n.log.Warn("resync", "err", err)
		}
		return
	}
	for _, sb := range list {
		n.kick(sb.ID)
	}
}

// Kick asks the node to reconcile sandbox id now: the api role in the same process
// hands it a warm-pool claim this way, ahead of the database's notification.
func (n *Node) Kick(id string) { n.kick(id) }

// OnOperationDone has fn told the id of each operation this node completes, after the
// completion is committed (the api role in the same process wakes its waiters with
// it, ahead of the database's notification).
func (n *Node) OnOperationDone(fn func(opID string)) { n.opDone.Store(&fn) }

// kick asks the sandbox's worker to reconcile it (coalescing repeated kicks).
func (n *Node) kick(id string) {
	if !ids.ValidSandbox(id) {
		return
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	select {
	case <-n.stopping:
		return
	default:
	}
	ch, ok := n.works[id]
	if !ok {
		ch = make(chan struct{}, 1)
		n.works[id] = ch
		n.wg.Add(1)
		go n.worker(id, ch)
	}
	select {
	case ch <- struct{}{}:
	default:
	}
}

// worker serializes all work on one sandbox.
func (n *Node) worker(id string, ch chan struct{}) {
	defer n.wg.Done()
	for {
		select {
		case <-ch:
		case <-n.stopping:
			return
		}
		gone := n.reconcile(n.work, id)
		n.mu.Lock()
		if gone && len(ch) == 0 {
			delete(n.works, id)
			n.mu.Unlock()
			return
		}
		n.mu.Unlock()
	}
}

func (n *Node) stateDir(id string) string { return filepath.Join(n.cfg.DataDir, "runtime", id) }

// spec is the runtime spec of a sandbox; att is its network (nil: none).
func (n *Node) spec(sb *store.Sandbox, root string, att *network.Attachment) runtime.Spec {
	s := runtime.Spec{
		ID: sb.ID, RootFS: root, StateDir: n.stateDir(sb.ID), AgentPath: n.cfg.AgentPath,
		CPU: sb.Spec.CPU, MemoryMB: sb.Spec.MemoryMB, AgentEnv: n.cfg.AgentEnv,
		PidsLimit: n.cfg.PidsLimit,
	}
	if att != nil && att.Netns != "" {
		s.Network, s.NetNS = true, att.Netns
	}
	return s
}

// recover adopts the sandboxes that survived a restart and reclaims everything that
// should not exist.
func (n *Node) recover(ctx context.Context) error {
	list, err := n.st.ListSandboxes(ctx, store.SandboxFilter{NodeID: n.cfg.ID, IncludePool: true})
	if err != nil {
		return err
	}
	live := map[string]bool{}
	// A failed sandbox runs nothing: a sandbox lost while its node was dead (or
	// fenced) must not come back to life with the node, so its instance, if it
	// survived, is reclaimed; its disk stays until it is deleted.
	runs := map[string]bool{}
	for _, sb := range list {
		live[sb.ID] = true
		runs[sb.ID] = sb.State != "failed"
		// A crash may have cut a suspend's background sync short (durability.go).
		n.syncWrittenLater(sb.ID)
		if sb.State != "running" || sb.DesiredState != "running" || sb.Transition != "" {
			continue // anything else is adopted (or not) by its worker's plan
		}
		root, _ := n.diskPath(sb.ID)
		if err := n.rt.Adopt(ctx, n.spec(sb, root, nil)); err != nil {
			n.log.Warn("could not adopt sandbox; its worker will recover it", "sandbox", sb.ID, "err", err)
			n.mu.Lock()
			n.recovering[sb.ID] = true
			n.mu.Unlock()
			continue
		}
		n.serving(sb)
		n.log.Info("adopted sandbox", "sandbox", sb.ID)
	}
	instances, err := n.rt.List(ctx)
	if err != nil {
		return fmt.Errorf("list runtime instances: %w", err)
	}
	for _, in := range instances {
		if !runs[in.ID] {
			n.log.Warn("reclaiming orphan runtime instance", "instance", in.ID)
			if err := n.rt.Destroy(ctx, in.ID); err != nil {
				n.log.Warn("destroy orphan", "instance", in.ID, "err", err)
			}
		}
	}
	disks, err := n.disk.ListSandboxes()
	if err != nil {
		return fmt.Errorf("list sandbox storage: %w", err)
	}
	for _, id := range disks {
		if !live[id] {
			n.log.Warn("reclaiming orphan sandbox storage", "sandbox", id)
			if err := n.disk.DeleteSandbox(ctx, id); err != nil {
				n.log.Warn("delete orphan storage", "sandbox", id, "err", err)
			}
		}
	}
	if ents, err := os.ReadDir(filepath.Join(n.cfg.DataDir, "runtime")); err == nil {
		for _, e := range ents {
			if !live[e.Name()] {
				_ = os.RemoveAll(filepath.Join(n.cfg.DataDir, "runtime", e.Name()))
			}
		}
	}
	n.recoverNetworks(ctx, list)
	if err := n.failInterruptedBuilds(ctx); err != nil {
		n.log.Warn("fail interrupted builds", "err", err)
	}
	for _, sb := range list {
		n.kick(sb.ID)
	}
	return nil
}

func randomSeed() []byte {
	b := make([]byte, 64)
	_, _ = rand.Read(b)
	return b
}
