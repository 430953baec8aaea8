package node

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"time"

	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/guest/agentclient"
	"github.com/spacedev/space/internal/guest/wire"
	"github.com/spacedev/space/internal/runtime"
	"github.com/spacedev/space/internal/store"
	"github.com/spacedev/space/internal/template"
)

// Bounds of the node's own agent calls.
const (
	healthTimeout = 2 * time.Second
	// reviveGrace is how long revive waits for an agent that neither answers nor
	// shows that it waits for a resume file (answersOrQuiesced).
	reviveGrace    = 10 * time.Second
	adoptTimeout   = 30 * time.Second
	startupTimeout = 30 * time.Second
)

// ID is the node's id (its row in the nodes table).
func (n *Node) ID() string { return n.cfg.ID }

// Agent returns a client for the agent of a sandbox running on this node (the data
// plane's way in). It fails with a Conflict fault when the sandbox is not running here.
// The client's requests pass the sandbox's agent gate (gate.go): while the node pauses
// the agent for a checkpoint they wait, and the pause waits for those under way.
func (n *Node) Agent(ctx context.Context, id string) (*agentclient.Client, error) {
	// Right after a start, wait until surviving sandboxes are adopted.
	select {
	case <-n.adopted:
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-time.After(startupTimeout):
		return nil, fault.New(fault.Unavailable, "node is still starting up")
	}
	// A sandbox the node pauses for a moment of its own (a periodic checkpoint) is
	// waited for: a client's stream broken by the pause re-attaches at once. So is one
	// the node is booting again after it found it without its instance at start-up
	// (recover): it was recorded running, and until its worker's first pass the API
	// still says so.
	deadline := time.Now().Add(startupTimeout)
	for {
		n.mu.Lock()
		ready, brief := n.ready[id], n.brief[id] || n.recovering[id]
		if ready {
			c := n.gated[id]
			if c == nil {
				g := n.gates.get(id)
				c = n.agentLocked(id).Through(func(rt http.RoundTripper) http.RoundTripper { return &gatedTransport{g: g, inner: rt} })
				n.gated[id] = c
			}
			n.mu.Unlock()
			return c, nil
		}
		n.mu.Unlock()
		if !brief || time.Now().After(deadline) {
			return nil, fault.New(fault.Conflict, "sandbox %s is not running on this node", id)
		}
		// The pause holds the agent's gate: its end opens it (gate.go).
		if opened := n.gates.get(id).openedChan(); opened != nil {
			select {
			case <-ctx.Done():
				return nil, ctx.Err()
			case <-opened:
			case <-time.After(time.Until(deadline)):
			}
			continue
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// InstanceRunning reports whether the runtime runs the sandbox's instance now.
func (n *Node) InstanceRunning(ctx context.Context, id string) bool {
	st, err := n.rt.Status(ctx, id)
	return err == nil && st == runtime.StatusRunning
}

// agent returns the client of a sandbox's agent, ready or not (the node's own calls).
func (n *Node) agent(id string) *agentclient.Client {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.agentLocked(id)
}

func (n *Node) agentLocked(id string) *agentclient.Client {
	c := n.agents[id]
	if c == nil {
		c = agentclient.New(func(ctx context.Context) (net.Conn, error) { return n.rt.Dial(ctx, id) })
		n.agents[id] = c
	}
	return c
}

func (n *Node) dropAgent(id string) {
	n.mu.Lock()
	c := n.agents[id]
	delete(n.agents, id)
	delete(n.gated, id)
	delete(n.ready, id)
	delete(n.active, id)
	delete(n.seenOutput, id)
	delete(n.polled, id)
	delete(n.idleOf, id)
	delete(n.looked, id)
	n.stopMemoryWatchLocked(id)
	n.mu.Unlock()
	if c != nil {
		c.CloseIdleConnections()
	}
}

func (n *Node) setReady(id string, ready bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if ready {
		n.ready[id] = true
	} else {
		delete(n.ready, id)
		n.stopMemoryWatchLocked(id)
	}
}

// waitAgent polls the agent's health endpoint until it answers or the timeout passes,
// or until the instance stops (whileAlive).
func (n *Node) waitAgent(ctx context.Context, id string, timeout time.Duration) (wire.Health, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	ctx, stop := n.whileAlive(ctx, id)
	defer stop()
	h, err := n.agent(id).WaitReady(ctx)
	if err != nil {
		if cause := context.Cause(ctx); errors.Is(cause, errInstanceStopped) {
			return h, fmt.Errorf("agent did not answer: %w", cause)
		}
		return h, fmt.Errorf("agent did not answer within %s: %w", timeout, err)
	}
	return h, nil
}

// errInstanceStopped ends a wait for an agent whose instance stopped meanwhile.
var errInstanceStopped = errors.New("the instance stopped (its agent, PID 1, exited)")

// aliveCheckEvery is how often a wait for an agent asks the runtime whether the
// instance still runs. An agent answers a start or a restore within tens of
// milliseconds, so a wait that ends well asks rarely or never.
const aliveCheckEvery = 250 * time.Millisecond

// whileAlive returns ctx ended also once the runtime reports instance id stopped or
// gone (with errInstanceStopped as its cause), and a function that ends the watch. A
// restored agent that dies (given another binary than its own; killed; out of memory)
// takes its instance with it: the node then falls back at once (a restore boots the
// sandbox from its disk) instead of waiting out AgentReadyTimeout, 60 s.
func (n *Node) whileAlive(ctx context.Context, id string) (context.Context, func()) {
	ctx, cancel := context.WithCancelCause(ctx)
	done := make(chan struct{})
	go func() {
		tick := time.NewTicker(aliveCheckEvery)
		defer tick.Stop()
		for {
			select {
			case <-done:
				return
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			st, err := n.rt.Status(ctx, id)
			if errors.Is(err, runtime.ErrNotFound) || err == nil && st == runtime.StatusStopped {
				cancel(errInstanceStopped)
				return
			}
		}
	}()
	return ctx, func() {
		close(done)
		cancel(nil)
	}
}

// identity returns a new identity for the sandbox: fresh entropy, the host's clock and
// its environment (the template's defaults overlaid by the sandbox's own).
func (n *Node) identity(sb *store.Sandbox) wire.Identity {
	env := map[string]string{}
	if sb.TemplateDigest != "" {
		if rel, err := n.disk.Release(sb.TemplateDigest); err == nil {
			if cfg, err := template.ParseConfig(rel.Config); err == nil {
				maps.Copy(env, cfg.Env)
			}
		}
	}
	maps.Copy(env, sb.Spec.Env)
	networkEnv(sb, env)
	n.preload(env)
	return wire.Identity{
		Generation: time.Now().UnixNano(),
		Seed:       randomSeed(),
		UnixNano:   time.Now().UnixNano(),
		Env:        env,
		Hostname:   "sandbox-" + sb.ID[:8],
	}
}

// preload adds the library the runtime needs preloaded into every process (if any)
// to env's LD_PRELOAD.
func (n *Node) preload(env map[string]string) {
	p := n.info.Caps.Preload
	if p == "" {
		return
	}
	if cur := env["LD_PRELOAD"]; cur != "" {
		p += ":" + cur
	}
	env["LD_PRELOAD"] = p
}

// setIdentity gives a running agent the sandbox's identity.
func (n *Node) setIdentity(ctx context.Context, sb *store.Sandbox) error {
	id := n.identity(sb)
	if err := n.agent(sb.ID).SetIdentity(ctx, id); err != nil {
		return err
	}
	if sb.ClaimedAt != nil {
		return n.st.SetIdentityGeneration(context.WithoutCancel(ctx), sb.ID, id.Generation)
	}
	return nil
}

// runDir is the agent's run directory on the host (file-resumed runtimes).
func (n *Node) runDir(id string) string { return filepath.Join(n.stateDir(id), "run") }

// quiesce asks the agent to freeze every user process until its next identity and,
// for file-resumed runtimes, to close its host socket; it returns once the sandbox can
// be checkpointed.
func (n *Node) quiesce(ctx context.Context, id string) error {
	if n.info.Caps.AgentResume != runtime.ResumeByFile {
		if err := n.agent(id).Quiesce(ctx, true); err != nil {
			return fmt.Errorf("quiesce agent: %w", err)
		}
		n.dropAgent(id)
		return nil
	}
	wctx, cancel := context.WithTimeout(ctx, adoptTimeout)
	defer cancel()
	err := n.agent(id).QuiesceClosing(wctx, n.runDir(id))
	n.dropAgent(id)
	if err != nil {
		return fmt.Errorf("quiesce agent: %w", err)
	}
	return nil
}

// resumeAgent ends a quiesce: the agent gets a new identity (fresh entropy, the host's
// clock, the sandbox's environment) and then lets user processes continue. A
// file-resumed agent learns it from a resume file in its run directory (it cannot hold
// a host socket across a checkpoint); others over their transport.
func (n *Node) resumeAgent(ctx context.Context, sb *store.Sandbox) error {
	id := n.identity(sb)
	if n.info.Caps.AgentResume == runtime.ResumeByFile {
		run := n.runDir(sb.ID)
		if err := os.MkdirAll(run, 0o700); err != nil {
			return err
		}
		if err := agentclient.WriteResume(run, id); err != nil {
			return err
		}
		return n.waitGeneration(ctx, sb.ID, id.Generation)
	}
	if _, err := n.waitAgent(ctx, sb.ID, n.cfg.AgentReadyTimeout); err != nil {
		return err
	}
	return n.agent(sb.ID).SetIdentity(ctx, id)
}

// waitGeneration waits until the agent reports identity generation gen exactly.
func (n *Node) waitGeneration(ctx context.Context, id string, gen int64) error {
	ctx, cancel := context.WithTimeout(ctx, n.cfg.AgentReadyTimeout)
	defer cancel()
	ctx, stop := n.whileAlive(ctx, id)
	defer stop()
	c := n.agent(id)
	for {
		hctx, hcancel := context.WithTimeout(ctx, healthTimeout)
		h, err := c.Health(hctx)
		hcancel()
		if err == nil && h.Generation == gen {
			return nil
		}
		if err == nil && h.Generation > gen {
			return fmt.Errorf("agent reports identity generation %d, newer than the %d it was given", h.Generation, gen)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("agent did not take its new identity: %w", context.Cause(ctx))
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// revive makes sure the agent of a surviving instance serves with a current identity:
// an agent still quiesced (a checkpoint or restore was interrupted) is resumed with a
// fresh identity; one that serves normally is left as it is.
func (n *Node) revive(ctx context.Context, sb *store.Sandbox) error {
	ctx, cancel := context.WithTimeout(ctx, adoptTimeout)
	defer cancel()
	hctx, hcancel := context.WithTimeout(ctx, healthTimeout)
	h, err := n.agent(sb.ID).Health(hctx)
	hcancel()
	switch {
	case err == nil && !h.Frozen:
		return nil
	case err == nil:
		// Frozen behind a kept transport (VM runtimes): give it its identity.
		return n.agent(sb.ID).SetIdentity(ctx, n.identity(sb))
	case n.info.Caps.AgentResume == runtime.ResumeByFile:
		// A file-resumed agent that does not answer waits for its resume file (its
		// quiesce, or a restore, was interrupted before the host wrote one), or is on its
		// way back: an agent that connects to the node does so again within a second of
		// a node restart. The quiesced marker tells them apart.
		quiesced, err := n.answersOrQuiesced(ctx, sb.ID)
		if err != nil {
			return err
		}
		if !quiesced {
			return n.revive(ctx, sb)
		}
		n.dropAgent(sb.ID)
		return n.resumeAgent(ctx, sb)
	default:
		if _, err := n.waitAgent(ctx, sb.ID, adoptTimeout); err != nil {
			return err
		}
		return n.revive(ctx, sb)
	}
}

// answersOrQuiesced waits until the file-resumed agent of sandbox id answers (false) or
// its quiesced marker shows that it waits for a resume file (true): the agent writes
// the marker once it has closed its transport for a checkpoint, and the runtime writes
// it into the run directory of every restored instance, whose agent waits for its
// resume file from the start. After reviveGrace with neither it answers true, as
// before the marker was looked at: an instance restored by an older node has none.
// Bounded by ctx.
func (n *Node) answersOrQuiesced(ctx context.Context, id string) (bool, error) {
	marker := filepath.Join(n.runDir(id), wire.QuiescedFileName)
	deadline := time.Now().Add(reviveGrace)
	for {
		if _, err := os.Stat(marker); err == nil || time.Now().After(deadline) {
			return true, nil
		}
		hctx, cancel := context.WithTimeout(ctx, 250*time.Millisecond)
		_, err := n.agent(id).Health(hctx)
		cancel()
		if err == nil {
			return false, nil
		}
		select {
		case <-ctx.Done():
			return false, fmt.Errorf("agent neither answered nor waits for a resume file: %w", err)
		case <-time.After(10 * time.Millisecond):
		}
	}
}

var errShuttingDown = errors.New("node is shutting down")
