// Package node owns the node role: the host agent that reconciles the sandboxes the
// store assigns to this host. It learns what to do only from PostgreSQL (notifications
// plus a periodic full resync), drives the runtime and the btrfs store, builds builtin
// templates on first need, adopts sandboxes that survived a restart, reclaims resources
// of ones that should not exist, and gives the data plane transports to the agents.
package node

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/guest/wire"
	"github.com/spacedev/space/internal/ids"
	"github.com/spacedev/space/internal/runtime"
	"github.com/spacedev/space/internal/storage"
	"github.com/spacedev/space/internal/store"
	"github.com/spacedev/space/internal/template"
)

// TemplateBuilder builds builtin templates (template.Builtins).
type TemplateBuilder interface {
	BuildBuiltin(ctx context.Context, name string, progress func(string)) (storage.Release, template.Config, error)
}

// OpObserver records operation latencies.
type OpObserver interface {
	Observe(kind, result string, d time.Duration)
}

// Config configures a node.
type Config struct {
	ID           string
	Name         string
	DataDir      string
	AdvertiseURL string
	Store        *store.Store
	Runtime      runtime.Runtime
	Storage      *storage.Store
	Builder      TemplateBuilder
	AgentPath    string
	AgentEnv     map[string]string
	Logger       *slog.Logger
	Metrics      OpObserver
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
	// DefaultCPU and DefaultMemoryMB are the size class base snapshots are made for
	// right after a template build.
	DefaultCPU      int
	DefaultMemoryMB int
}

// Node is a running node role.
type Node struct {
	cfg   Config
	st    *store.Store
	rt    runtime.Runtime
	disk  *storage.Store
	log   *slog.Logger
	epoch int64
	info  runtime.Info

	work     context.Context // cancelled only after the shutdown grace period
	stopping chan struct{}   // closed when shutdown begins: idle workers exit
	adopted  chan struct{}   // closed once surviving sandboxes are adopted
	wg       sync.WaitGroup
	mu       sync.Mutex
	works    map[string]chan struct{}
	agents   map[string]*http.Transport
	active   map[string]time.Time
	ready    map[string]bool
	// toMeasure holds sandboxes whose disk usage is to be measured.
	toMeasure map[string]bool
	// seenOutput is each agent's last-activity time as last polled.
	seenOutput map[string]time.Time

	buildMu   sync.Mutex
	snapJobs  snapshotJobs
	agentHash string // of the agent binary sandboxes run
}

// New returns a node. Run starts it.
func New(cfg Config) (*Node, error) {
	if cfg.Resync == 0 {
		cfg.Resync = 10 * time.Second
	}
	if cfg.Heartbeat == 0 {
		cfg.Heartbeat = 2 * time.Second
	}
	if cfg.AgentReadyTimeout == 0 {
		cfg.AgentReadyTimeout = 60 * time.Second
	}
	if cfg.ShutdownGrace == 0 {
		cfg.ShutdownGrace = 10 * time.Second
	}
	if cfg.Metrics == nil {
		cfg.Metrics = nopObserver{}
	}
	return &Node{
		cfg: cfg, st: cfg.Store, rt: cfg.Runtime, disk: cfg.Storage, log: cfg.Logger,
		works: map[string]chan struct{}{}, agents: map[string]*http.Transport{},
		active: map[string]time.Time{}, ready: map[string]bool{}, adopted: make(chan struct{}),
		seenOutput: map[string]time.Time{}, toMeasure: map[string]bool{},
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
// start (every step is restartable).
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
	reg := &store.Node{ID: n.cfg.ID, Name: n.cfg.Name, Runtime: info.Name, RuntimeInfo: details, DataPlaneURL: n.cfg.AdvertiseURL}
	if err := n.st.RegisterNode(ctx, reg); err != nil {
		return err
	}
	n.epoch = reg.Epoch
	n.log.Info("node registered", "node", n.cfg.Name, "id", n.cfg.ID, "epoch", n.epoch, "runtime", info.Name, "version", info.Version)

	work, cancelWork := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelWork()
	n.work = work
	n.stopping = make(chan struct{})

	if err := n.recover(ctx); err != nil {
		return fmt.Errorf("recover sandboxes: %w", err)
	}
	close(n.adopted)
	go n.runBuilds(ctx)
	go func() {
		t := time.NewTicker(3 * time.Second)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				n.measureQueued(ctx)
			}
		}
	}()

	errc := make(chan error, 1)
	go func() {
		errc <- n.st.Listen(ctx, n.log, func(_, id string) {
			if id == "" {
				n.resync(ctx)
				return
			}
			n.kick(id)
		}, store.NodeChannel(n.cfg.ID))
	}()
	hb := time.NewTicker(n.cfg.Heartbeat)
	defer hb.Stop()
	act := time.NewTicker(2 * time.Second)
	defer act.Stop()
	rs := time.NewTicker(n.cfg.Resync)
	defer rs.Stop()
	var runErr error
loop:
	for {
		select {
		case <-ctx.Done():
			break loop
		case <-hb.C:
			if err := n.st.Heartbeat(ctx, n.cfg.ID, n.epoch); err != nil && ctx.Err() == nil {
				if strings.Contains(err.Error(), "superseded") {
					runErr = fmt.Errorf("another process took over node %s: %w", n.cfg.Name, err)
					break loop
				}
				n.log.Warn("heartbeat failed", "err", err)
			}
		case <-rs.C:
			n.resync(ctx)
		case <-act.C:
			n.pollOutputActivity(ctx)
			n.flushActivity(ctx)
		}
	}
	close(n.stopping)
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

// resync kicks every sandbox assigned to this node.
func (n *Node) resync(ctx context.Context) {
	list, err := n.st.ListSandboxes(ctx, store.SandboxFilter{NodeID: n.cfg.ID})
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

// reconcile drives one sandbox toward its desired state. It returns true when the
// sandbox no longer exists on this node.
func (n *Node) reconcile(ctx context.Context, id string) bool {
	sb, err := n.st.GetSandbox(ctx, id)
	if fault.Is(err, fault.NotFound) {
		n.cleanupLocal(ctx, id)
		return true
	}
	if err != nil {
		if ctx.Err() == nil {
			n.log.Warn("load sandbox", "sandbox", id, "err", err)
		}
		return false
	}
	if sb.NodeID != n.cfg.ID || sb.DeletedAt != nil {
		n.cleanupLocal(ctx, id)
		return true
	}
	switch sb.DesiredState {
	case api.StateDeleted:
		n.delete(ctx, sb)
		return true
	case api.StateRunning, api.StatePaused, api.StateSuspended, api.StateStopped:
		if sb.State == api.StateFailed && sb.ObservedGeneration >= sb.Generation {
			return false
		}
		n.converge(ctx, sb)
	}
	return false
}

func (n *Node) stateDir(id string) string { return filepath.Join(n.cfg.DataDir, "runtime", id) }

func (n *Node) spec(sb *store.Sandbox, root string) runtime.Spec {
	return runtime.Spec{
		ID: sb.ID, RootFS: root, StateDir: n.stateDir(sb.ID), AgentPath: n.cfg.AgentPath,
		CPU: sb.Spec.CPU, MemoryMB: sb.Spec.MemoryMB, Network: sb.Spec.Network, AgentEnv: n.cfg.AgentEnv,
	}
}

// report records observed state, logging failures (the next resync retries).
func (n *Node) report(ctx context.Context, sb *store.Sandbox, o store.Observed) *store.Sandbox {
	got, err := n.st.ReportObserved(context.WithoutCancel(ctx), sb.ID, n.cfg.ID, o)
	if err != nil {
		n.log.Warn("report observed state", "sandbox", sb.ID, "err", err)
		return sb
	}
	return got
}

// progress updates the message of the sandbox's open operations.
func (n *Node) progress(ctx context.Context, sb *store.Sandbox, msg string) {
	_ = n.st.ProgressSandboxOperations(context.WithoutCancel(ctx), sb.ID, sb.Generation, msg)
}

// finishOps completes the sandbox's open operations up to its generation: those that
// asked for the state it reached succeed (or fail with failErr), others are superseded.
func (n *Node) finishOps(ctx context.Context, sb *store.Sandbox, failErr error) {
	ctx = context.WithoutCancel(ctx)
	ops, err := n.st.OpenOperations(ctx, sb.ID)
	if err != nil {
		n.log.Warn("list operations", "sandbox", sb.ID, "err", err)
		return
	}
	ok := completes[sb.DesiredState]
	for _, op := range ops {
		if op.TargetGeneration > sb.Generation {
			continue
		}
		state, msg, errMsg := api.OpSucceeded, "done", ""
		switch {
		case !slices.Contains(ok, op.Kind):
			state, msg, errMsg = api.OpFailed, "superseded", "superseded by a later request (the sandbox is now to be "+sb.DesiredState+")"
		case failErr != nil:
			state, msg, errMsg = api.OpFailed, "failed", failErr.Error()
		}
		if err := n.st.UpdateOperation(ctx, op.ID, state, msg, errMsg); err != nil {
			n.log.Warn("finish operation", "op", op.ID, "err", err)
			continue
		}
		n.cfg.Metrics.Observe(op.Kind, state, time.Since(op.CreatedAt))
	}
}

// create builds the sandbox's disk and starts it: restored from the template's base
// snapshot when one fits, else booted. A previous attempt cut off by a crash is cleaned
// up first, so create is safe to repeat. A warm-pool member (desired paused) is paused
// once it runs.
func (n *Node) create(ctx context.Context, sb *store.Sandbox) {
	n.log.Info("creating sandbox", "sandbox", sb.ID, "template", sb.TemplateRef)
	sb = n.report(ctx, sb, store.Observed{State: api.StateCreating, ObservedGeneration: sb.ObservedGeneration})
	n.progress(ctx, sb, "creating on node "+n.cfg.Name)
	n.cleanupLocal(ctx, sb.ID)

	path := "boot"
	digest, err := n.resolveTemplate(ctx, sb)
	if err == nil {
		path, err = n.startNew(ctx, sb, digest)
	}
	if err == nil && sb.DesiredState == api.StatePaused {
		var snap runtime.Snapshotter
		if snap, err = n.snapshotter(); err == nil {
			if err = snap.Pause(ctx, sb.ID); err == nil {
				n.setReady(sb.ID, false)
			}
		}
	}
	if err != nil {
		if n.work.Err() != nil {
			return // shutting down: the next start resumes this create
		}
		n.log.Error("create sandbox failed", "sandbox", sb.ID, "err", err)
		n.cleanupLocal(ctx, sb.ID)
		sb = n.report(ctx, sb, store.Observed{State: api.StateFailed, ObservedGeneration: sb.Generation, Error: err.Error(), TemplateDigest: digest})
		n.finishOps(ctx, sb, err)
		return
	}
	state := api.StateRunning
	if sb.DesiredState == api.StatePaused {
		state = api.StatePaused
	}
	sb = n.report(ctx, sb, store.Observed{State: state, ObservedGeneration: sb.Generation, StartPath: path, TemplateDigest: digest})
	n.finishOps(ctx, sb, nil)
	n.log.Info("sandbox "+state, "sandbox", sb.ID, "start_path", path)
	n.measureLater(sb.ID)
}

// startNew makes the disk of a new sandbox and starts it, from the release's base
// snapshot when one fits (start path "snapshot"), else by booting ("boot").
func (n *Node) startNew(ctx context.Context, sb *store.Sandbox, digest string) (string, error) {
	sb.TemplateDigest = digest
	if snap, dir, ok := n.baseSnapshotFor(digest, sb.Spec); ok && !sb.Spec.FreshBoot {
		root, err := n.createDiskFrom(ctx, sb.ID, filepath.Join(dir, "disk"))
		if err == nil {
			if err = n.restoreFrom(ctx, snap, sb, filepath.Join(dir, "checkpoint"), root); err == nil {
				return "snapshot", nil
			}
		}
		n.log.Warn("restore from base snapshot failed; booting", "sandbox", sb.ID, "err", err)
		n.cleanupLocal(ctx, sb.ID)
	}
	root, err := n.createDisk(ctx, sb.ID, digest)
	if err != nil {
		return "", fmt.Errorf("create disk: %w", err)
	}
	if err := n.boot(ctx, sb, root); err != nil {
		return "", err
	}
	n.ensureBaseSnapshotLater(digest, sb.Spec)
	return "boot", nil
}

// boot starts the runtime instance on root and waits for its agent.
func (n *Node) boot(ctx context.Context, sb *store.Sandbox, root string) error {
	dir := n.stateDir(sb.ID)
	if err := os.RemoveAll(dir); err != nil {
		return err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	if err := n.rt.Create(ctx, n.spec(sb, root)); err != nil {
		return fmt.Errorf("start %s instance: %w", n.info.Name, err)
	}
	if err := n.waitAgent(ctx, sb.ID, n.cfg.AgentReadyTimeout); err != nil {
		return err
	}
	if err := n.setIdentity(ctx, sb); err != nil {
		return fmt.Errorf("give sandbox its identity: %w", err)
	}
	if err := n.runTemplateStart(ctx, sb); err != nil {
		return err
	}
	n.setReady(sb.ID, true)
	return nil
}

// ensureRunning checks a running sandbox's instance and boots it again from its disk if
// it vanished (host reboot, runtime crash).
func (n *Node) ensureRunning(ctx context.Context, sb *store.Sandbox) {
	st, err := n.rt.Status(ctx, sb.ID)
	if err == nil && st != runtime.StatusStopped {
		n.setReady(sb.ID, true)
		n.checkOutputActivity(ctx, sb)
		return
	}
	if ctx.Err() != nil {
		return
	}
	n.dropAgent(sb.ID)
	_ = n.rt.Destroy(ctx, sb.ID)
	// A crash between checkpointing a clone source and restoring it leaves its memory in
	// the clone batch: restore from there rather than lose it.
	if n.restoreFromCloneBatch(ctx, sb) {
		return
	}
	n.log.Warn("sandbox instance is gone; booting it again from its disk", "sandbox", sb.ID, "status", st, "err", err)
	root, err := n.diskPath(sb.ID)
	if err == nil {
		if _, statErr := os.Stat(root); statErr != nil {
			err = fmt.Errorf("root filesystem missing: %w", statErr)
		}
	}
	if err == nil {
		err = n.boot(ctx, sb, root)
	}
	if err != nil {
		if n.work.Err() != nil {
			return
		}
		n.report(ctx, sb, store.Observed{State: api.StateFailed, ObservedGeneration: sb.Generation, Error: "restart after instance loss: " + err.Error()})
		return
	}
	n.report(ctx, sb, store.Observed{State: api.StateRunning, ObservedGeneration: sb.Generation, StartPath: "boot",
		Error: "restarted from disk at " + time.Now().UTC().Format(time.RFC3339) + " after its instance was lost"})
}

// delete destroys the sandbox's instance and storage.
func (n *Node) delete(ctx context.Context, sb *store.Sandbox) {
	if sb.State != api.StateDeleting {
		sb = n.report(ctx, sb, store.Observed{State: api.StateDeleting, ObservedGeneration: sb.ObservedGeneration, Error: sb.Error})
	}
	if err := n.cleanupLocal(ctx, sb.ID); err != nil {
		if n.work.Err() != nil {
			return
		}
		n.log.Error("delete sandbox", "sandbox", sb.ID, "err", err)
		n.report(ctx, sb, store.Observed{State: api.StateDeleting, ObservedGeneration: sb.ObservedGeneration, Error: "delete: " + err.Error()})
		n.finishOps(ctx, sb, err)
		return
	}
	sb = n.report(ctx, sb, store.Observed{State: api.StateDeleted, ObservedGeneration: sb.Generation, Deleted: true, Error: sb.Error})
	n.finishOps(ctx, sb, nil)
	n.log.Info("sandbox deleted", "sandbox", sb.ID)
}

// cleanupLocal removes everything this node holds for a sandbox. Idempotent.
func (n *Node) cleanupLocal(ctx context.Context, id string) error {
	n.dropAgent(id)
	var errs []error
	if err := n.rt.Destroy(ctx, id); err != nil {
		errs = append(errs, fmt.Errorf("destroy instance: %w", err))
	}
	if err := n.disk.DeleteSandbox(ctx, id); err != nil {
		errs = append(errs, fmt.Errorf("delete storage: %w", err))
	}
	if err := os.RemoveAll(n.stateDir(id)); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// recover adopts the sandboxes that survived a restart and reclaims everything that
// should not exist.
func (n *Node) recover(ctx context.Context) error {
	list, err := n.st.ListSandboxes(ctx, store.SandboxFilter{NodeID: n.cfg.ID})
	if err != nil {
		return err
	}
	live := map[string]bool{}
	for _, sb := range list {
		live[sb.ID] = true
		if sb.State != api.StateRunning || sb.DesiredState != api.StateRunning {
			continue
		}
		root, _ := n.diskPath(sb.ID)
		if err := n.rt.Adopt(ctx, n.spec(sb, root)); err != nil {
			n.log.Warn("could not adopt sandbox; it will be booted again", "sandbox", sb.ID, "err", err)
			continue
		}
		n.mu.Lock()
		n.ready[sb.ID] = true
		n.mu.Unlock()
		n.log.Info("adopted sandbox", "sandbox", sb.ID)
	}
	instances, err := n.rt.List(ctx)
	if err != nil {
		return fmt.Errorf("list runtime instances: %w", err)
	}
	for _, in := range instances {
		if !live[in.ID] {
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
	if err := n.failInterruptedBuilds(ctx); err != nil {
		n.log.Warn("fail interrupted builds", "err", err)
	}
	for _, sb := range list {
		n.kick(sb.ID)
	}
	return nil
}

// AgentTransport returns an HTTP transport to the agent of a running sandbox on this
// node.
func (n *Node) AgentTransport(ctx context.Context, id string) (http.RoundTripper, error) {
	// Right after a start, wait until surviving sandboxes are adopted.
	select {
	case <-n.adopted:
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-time.After(30 * time.Second):
		return nil, fault.New(fault.Unavailable, "node is still starting up")
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if !n.ready[id] {
		return nil, fault.New(fault.Conflict, "sandbox %s is not running on this node", id)
	}
	return n.transportLocked(id), nil
}

func (n *Node) transportLocked(id string) *http.Transport {
	t := n.agents[id]
	if t == nil {
		t = &http.Transport{
			DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
				return n.rt.Dial(ctx, id)
			},
			MaxIdleConnsPerHost: 8,
			IdleConnTimeout:     30 * time.Second,
			DisableCompression:  true,
		}
		n.agents[id] = t
	}
	return t
}

func (n *Node) dropAgent(id string) {
	n.mu.Lock()
	t := n.agents[id]
	delete(n.agents, id)
	delete(n.ready, id)
	delete(n.active, id)
	delete(n.seenOutput, id)
	n.mu.Unlock()
	if t != nil {
		t.CloseIdleConnections()
	}
}

// Touch records activity on a sandbox (data-plane requests, attached streams, process
// output); flushActivity writes it to the database for idle detection.
func (n *Node) Touch(id string) {
	n.mu.Lock()
	n.active[id] = time.Now()
	n.mu.Unlock()
}

// flushActivity records the sandboxes touched since the last flush.
func (n *Node) flushActivity(ctx context.Context) {
	n.mu.Lock()
	var touched []string
	for id, t := range n.active {
		if !t.IsZero() {
			touched = append(touched, id)
			n.active[id] = time.Time{}
		}
	}
	n.mu.Unlock()
	if err := n.st.TouchSandboxes(ctx, touched); err != nil && ctx.Err() == nil {
		n.log.Warn("record activity", "err", err)
	}
}

func randomSeed() []byte {
	b := make([]byte, 64)
	_, _ = rand.Read(b)
	return b
}

// checkOutputActivity counts process output since the last look as activity.
func (n *Node) checkOutputActivity(ctx context.Context, sb *store.Sandbox) {
	n.pollAgentActivity(ctx, sb.ID)
}

// pollOutputActivity asks every running agent when its processes last wrote output.
func (n *Node) pollOutputActivity(ctx context.Context) {
	n.mu.Lock()
	ready := make([]string, 0, len(n.ready))
	for id := range n.ready {
		ready = append(ready, id)
	}
	n.mu.Unlock()
	for _, id := range ready {
		n.pollAgentActivity(ctx, id)
	}
}

func (n *Node) pollAgentActivity(ctx context.Context, id string) {
	hctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	var h wire.Health
	if err := n.agentJSON(hctx, id, http.MethodGet, "/v1/health", nil, &h); err != nil {
		return
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if h.LastActivity.After(n.seenOutput[id]) {
		if !n.seenOutput[id].IsZero() {
			n.active[id] = time.Now()
		}
		n.seenOutput[id] = h.LastActivity
	}
}
