package node

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	goruntime "runtime"
	"strings"
	"sync"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/crash"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/guest/agentclient"
	"github.com/spacedev/space/internal/guest/wire"
	"github.com/spacedev/space/internal/ids"
	"github.com/spacedev/space/internal/runtime"
	"github.com/spacedev/space/internal/storage"
	"github.com/spacedev/space/internal/store"
	"github.com/spacedev/space/internal/template"
)

// Build sandboxes get at least these resources (more if the template asks for more).
const buildMemoryMB = 2048

// runBuilds executes the template builds queued for this node, one at a time, removes
// the files of releases deleted from the database and pushes the releases it holds
// that are not in the registry yet (with one), until ctx ends. It first
// publishes the node's template source allowlist (the API picks build nodes by it).
// Work is found through notifications on store.BuildChannel and, as a safety net, a
// periodic look at the queue.
func (n *Node) runBuilds(ctx context.Context) {
	b := n.cfg.Builder
	canBuild := b != nil
	if canBuild {
		for {
			err := n.st.SetNodeTemplateSources(ctx, n.cfg.ID, b.AllowedSources().Entries())
			if err == nil {
				break
			}
			if ctx.Err() != nil {
				return
			}
			n.log.Warn("publish template sources", "err", err)
			select {
			case <-ctx.Done():
				return
			case <-time.After(time.Second):
			}
		}
	}
	wake := make(chan struct{}, 1)
	poke := func() {
		select {
		case wake <- struct{}{}:
		default:
		}
	}
	var listening sync.WaitGroup
	defer listening.Wait()
	listening.Go(func() {
		if err := n.st.Listen(ctx, n.log, func(string, string) { poke() }, store.BuildChannel(n.cfg.ID)); err != nil && ctx.Err() == nil {
			n.log.Warn("listen for template builds", "err", err)
		}
	})
	tick := time.NewTicker(n.cfg.Resync)
	defer tick.Stop()
	poke()
	for {
		select {
		case <-ctx.Done():
			return
		case <-wake:
		case <-tick.C:
		}
		n.collectReleases(ctx)
		if canBuild {
			n.runQueuedBuilds(ctx, b)
		}
		n.pushUnshared(ctx)
		n.evictReleases(ctx)
		n.evictPulled(ctx)
	}
}

// beginWork registers in-flight work that shutdown waits for; false once shutdown
// began.
func (n *Node) beginWork() bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	select {
	case <-n.stopping:
		return false
	default:
	}
	n.wg.Add(1)
	return true
}

// runQueuedBuilds runs queued builds until the queue is empty.
func (n *Node) runQueuedBuilds(ctx context.Context, b TemplateBuilder) {
	for ctx.Err() == nil {
		n.collectReleases(ctx) // before a build that could produce a release awaiting removal
		ops, err := n.st.QueuedBuilds(ctx, n.cfg.ID)
		if err != nil {
			if ctx.Err() == nil {
				n.log.Warn("list queued template builds", "err", err)
			}
			return
		}
		if len(ops) == 0 || !n.beginWork() {
			return
		}
		n.runBuild(ctx, b, ops[0])
		n.wg.Done()
	}
}

// runBuild claims one queued build and runs it to completion: the release is recorded
// and tagged, or the operation fails and no release remains.
func (n *Node) runBuild(ctx context.Context, b TemplateBuilder, op *store.Operation) {
	ref, _ := op.Params["template"].(string)
	claimed, err := n.st.ClaimBuild(ctx, op.ID, fmt.Sprintf("building %s on node %s", ref, n.cfg.Name))
	if claimed {
		crash.Point("build.claimed")
	}
	if err != nil || !claimed {
		if err != nil && ctx.Err() == nil {
			n.log.Warn("claim template build", "op", op.ID, "err", err)
		}
		return
	}
	start := time.Now()
	bg := context.WithoutCancel(ctx)
	logLine := func(line string) {
		n.log.Debug("template build", "template", ref, "op", op.ID, "line", line)
		if err := n.st.AppendOperationLog(bg, op.ID, line); err != nil {
			n.log.Warn("append build log", "op", op.ID, "err", err)
		}
	}
	finish := func(state, msg string, err error) {
		errMsg := ""
		if err != nil {
			errMsg = err.Error()
			logLine("build failed: " + errMsg)
		}
		if uerr := n.st.UpdateOperation(bg, op.ID, state, msg, errMsg); uerr != nil {
			n.log.Warn("finish template build", "op", op.ID, "err", uerr)
		}
		n.cfg.Metrics.Observe(api.OpTemplateBuild, state, time.Since(start))
	}
	n.log.Info("building template", "template", ref, "op", op.ID)

	spec, parent, err := n.buildInput(ctx, op)
	if err != nil {
		finish(api.OpFailed, "failed", err)
		return
	}
	n.buildMu.Lock()
	rel, cfg, err := b.Build(ctx, spec, template.BuildOptions{Progress: logLine, Parent: parent, Sandbox: n.startBuildSandbox})
	n.buildMu.Unlock()
	if err != nil {
		if ctx.Err() != nil {
			finish(api.OpFailed, "interrupted", fmt.Errorf("the build was interrupted: node %s is shutting down", n.cfg.Name))
			return
		}
		n.log.Warn("template build failed", "template", ref, "op", op.ID, "err", err)
		finish(api.OpFailed, "failed", err)
		return
	}
	crash.Point("build.built")
	// With a registry the release is pushed before it is recorded: once its tag exists,
	// every node can pull it. A failed push leaves a build that only this node holds
	// until pushUnshared gets it into the registry.
	manifest := n.pushRelease(ctx, rel.Digest, logLine)
	cfgJSON, err := json.Marshal(cfg)
	if err == nil {
		err = n.st.PutRelease(bg, &store.Release{Digest: rel.Digest, Name: spec.Name, Config: cfgJSON, SizeBytes: rel.SizeBytes,
			Registry: manifest}, spec.Tag, n.cfg.ID)
	}
	if err != nil {
		finish(api.OpFailed, "failed", fmt.Errorf("record release %s: %w", rel.Digest, err))
		return
	}
	crash.Point("build.recorded")
	n.afterBuild(ctx, rel)
	msg := fmt.Sprintf("built %s: %s", spec.Ref(), rel.Digest)
	if n.cfg.Artifacts != nil && manifest == "" {
		msg += fmt.Sprintf(" (only on node %s: the push to the registry failed; retried)", n.cfg.Name)
	}
	finish(api.OpSucceeded, msg, nil)
	n.log.Info("template built", "template", spec.Ref(), "digest", rel.Digest, "took", time.Since(start).Round(time.Millisecond))
}

// afterBuild runs after a build's release is committed and recorded, before its
// operation succeeds: base snapshots are taken here. Failures are logged, not fatal
// (sandboxes then boot instead of restoring).
func (n *Node) afterBuild(ctx context.Context, rel storage.Release) {
	n.ensureBaseSnapshotLater(rel.Digest, store.SandboxSpec{CPU: n.cfg.DefaultCPU, MemoryMB: n.cfg.DefaultMemoryMB})
}

// buildInput decodes a build operation's spec and resolves its parent release.
func (n *Node) buildInput(ctx context.Context, op *store.Operation) (*template.Spec, *template.Parent, error) {
	raw, err := json.Marshal(op.Params["spec"])
	if err != nil {
		return nil, nil, fmt.Errorf("decode build spec: %w", err)
	}
	spec, err := template.ParseSpec(raw)
	if err != nil {
		return nil, nil, err
	}
	d, _ := op.Params["from_digest"].(string)
	if spec.From.Template == "" {
		return spec, nil, nil
	}
	if d == "" {
		return nil, nil, errors.New("the build has no resolved parent release")
	}
	rel, err := n.st.GetRelease(ctx, d)
	if err != nil {
		return nil, nil, fmt.Errorf("parent template %s: %w", spec.From.Template, err)
	}
	cfg, err := template.ParseConfig(rel.Config)
	if err != nil {
		return nil, nil, err
	}
	if !n.disk.HasRelease(d) && n.cfg.Artifacts != nil && rel.Registry != "" {
		if _, err := n.cfg.Artifacts.PullRelease(ctx, d); err != nil {
			return nil, nil, fmt.Errorf("pull parent template %s (%s) from registry %s: %w", spec.From.Template, d, n.cfg.Artifacts.Registry(), err)
		}
		if err := n.st.AddNodeRelease(ctx, n.cfg.ID, d); err != nil {
			return nil, nil, err
		}
	}
	if !n.disk.HasRelease(d) {
		return nil, nil, fault.New(fault.NotFound, "parent template %s (%s) is not on node %s", spec.From.Template, d, n.cfg.Name)
	}
	return spec, &template.Parent{Digest: d, Config: cfg}, nil
}

// collectReleases removes the files of releases deleted from the database.
func (n *Node) collectReleases(ctx context.Context) {
	digests, err := n.st.PendingReleaseGC(ctx, n.cfg.ID)
	if err != nil {
		if ctx.Err() == nil {
			n.log.Warn("list deleted releases", "err", err)
		}
		return
	}
	for _, d := range digests {
		_, err := n.st.GetRelease(ctx, d)
		switch {
		case err == nil:
			// Built again since it was deleted: keep it.
		case fault.Is(err, fault.NotFound):
			if err := n.disk.DeleteRelease(ctx, d); err != nil {
				n.log.Warn("delete release files", "digest", d, "err", err)
				continue
			}
			n.log.Info("deleted template release files", "digest", d)
		default:
			continue
		}
		if err := n.st.ReleaseGCDone(ctx, n.cfg.ID, d); err != nil {
			n.log.Warn("record release removal", "digest", d, "err", err)
		}
	}
}

// buildSandbox is a runtime instance on a root filesystem being built.
type buildSandbox struct {
	n      *Node
	id     string
	rootfs string
	agent  *agentclient.Client
}

// startBuildSandbox starts a build sandbox: the node's runtime on rootfs with
// space-agent as PID 1, no network, at least buildMemoryMB of memory and every CPU of
// the host. Its id never names a sandbox, so a node restart reclaims an instance left
// behind by a crash like any orphan.
func (n *Node) startBuildSandbox(ctx context.Context, rootfs string, cfg template.Config) (template.Sandbox, error) {
	id := "bld" + ids.Secret(17)
	dir := n.stateDir(id)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	spec := runtime.Spec{
		ID: id, RootFS: rootfs, StateDir: dir, AgentPath: n.cfg.AgentPath,
		CPU: max(cfg.CPU, goruntime.NumCPU()), MemoryMB: max(cfg.MemoryMB, buildMemoryMB), AgentEnv: n.cfg.AgentEnv,
	}
	bs := &buildSandbox{n: n, id: id, rootfs: rootfs}
	bs.agent = agentclient.New(func(ctx context.Context) (net.Conn, error) { return n.rt.Dial(ctx, id) })
	if err := n.rt.Create(ctx, spec); err != nil {
		_ = bs.Close(context.WithoutCancel(ctx))
		return nil, fmt.Errorf("start %s instance: %w", n.info.Name, err)
	}
	wctx, cancel := context.WithTimeout(ctx, n.cfg.AgentReadyTimeout)
	_, err := bs.agent.WaitReady(wctx)
	cancel()
	if err == nil {
		env := map[string]string{}
		n.preload(env)
		err = bs.agent.SetIdentity(ctx, wire.Identity{Generation: time.Now().UnixNano(), Seed: randomSeed(),
			UnixNano: time.Now().UnixNano(), Env: env, Hostname: "build"})
	}
	if err != nil {
		_ = bs.Close(context.WithoutCancel(ctx))
		return nil, err
	}
	n.log.Debug("build sandbox started", "instance", id, "rootfs", rootfs)
	return bs, nil
}

func (b *buildSandbox) Agent() *agentclient.Client { return b.agent }

// Close destroys the instance and removes the empty files the runtime created in the
// root filesystem to bind-mount the agent (and its compatibility shim) onto.
func (b *buildSandbox) Close(ctx context.Context) error {
	b.agent.CloseIdleConnections()
	err := b.n.rt.Destroy(ctx, b.id)
	if rerr := os.RemoveAll(b.n.stateDir(b.id)); err == nil {
		err = rerr
	}
	if err != nil {
		return fmt.Errorf("destroy build sandbox %s: %w", b.id, err)
	}
	root, err := os.OpenRoot(b.rootfs)
	if err != nil {
		return err
	}
	defer root.Close()
	for _, p := range []string{wire.AgentPath, b.n.info.Caps.Preload} {
		name := strings.TrimPrefix(p, "/")
		if name == "" {
			continue
		}
		if fi, err := root.Lstat(name); err == nil && fi.Mode().IsRegular() && fi.Size() == 0 {
			if err := root.Remove(name); err != nil && !errors.Is(err, fs.ErrNotExist) {
				return err
			}
		}
	}
	return nil
}
