package node

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/ids"
	"github.com/spacedev/space/internal/storage"
	"github.com/spacedev/space/internal/store"
	"github.com/spacedev/space/internal/template"
)

// BaseTemplate is the default builtin template. Every name in template.Builtins()
// (base, code-interpreter-v1) is built on first use: once per fleet with a registry,
// on each node without one (see buildBuiltin).
const BaseTemplate = template.BaseTemplate

// resolveTemplate returns the digest of the release the sandbox starts from, making
// sure its artifacts are on this node: pulled from the fleet's registry when another
// node pushed it there, or built on first use (builtin templates, once per fleet with
// a registry; see buildBuiltin).
func (n *Node) resolveTemplate(ctx context.Context, sb *store.Sandbox) (string, error) {
	ref, err := api.ParseTemplateRef(sb.TemplateRef)
	if err != nil {
		return "", err
	}
	digest := sb.TemplateDigest
	if digest == "" {
		digest = ref.Digest
	}
	if digest == "" {
		if digest, err = n.st.ResolveTag(ctx, ref.Name, ref.Tag); err != nil {
			return "", fmt.Errorf("resolve %s: %w", ref, err)
		}
	}
	if digest != "" && n.disk.HasRelease(digest) {
		return digest, nil
	}
	if digest != "" && n.cfg.Artifacts != nil {
		if ok, err := n.pullIfShared(ctx, sb, digest); ok || err != nil {
			return digest, err
		}
	}
	if template.IsBuiltin(ref.Name) && ref.Tag == "latest" && sb.TemplateDigest == "" {
		return n.buildBuiltin(ctx, sb, ref.Name)
	}
	if digest == "" {
		return "", fmt.Errorf("template %s not found", ref)
	}
	if n.cfg.Artifacts == nil {
		return "", fault.New(fault.NotFound, "template release %s is not present on node %s (without --registry templates stay on the node that built them)", digest, n.cfg.Name)
	}
	return "", fault.New(fault.Unavailable, "template release %s is not present on node %s and not in registry %s yet (its node has not pushed it; it retries)",
		digest, n.cfg.Name, n.cfg.Artifacts.Registry())
}

// pullIfShared pulls the release from the registry if the database says it is there
// (false: it is not, nothing was done).
func (n *Node) pullIfShared(ctx context.Context, sb *store.Sandbox, digest string) (bool, error) {
	rel, err := n.st.GetRelease(ctx, digest)
	if fault.Is(err, fault.NotFound) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	if rel.Registry == "" {
		return false, nil
	}
	return true, n.pullRelease(ctx, sb, digest)
}

// pullRelease pulls a release from the registry into this node's store and records
// that the node holds it. Concurrent pulls of one digest share one download
// (artifact.Client). A failed pull leaves nothing behind: an unreachable registry fails
// with fault.Unavailable, a full disk with fault.InsufficientStorage, both naming what
// failed.
func (n *Node) pullRelease(ctx context.Context, sb *store.Sandbox, digest string) error {
	reg := n.cfg.Artifacts.Registry()
	n.progress(ctx, sb, fmt.Sprintf("pulling template release %s from registry %s onto node %s", digest, reg, n.cfg.Name))
	start := time.Now()
	if _, err := n.cfg.Artifacts.PullRelease(ctx, digest); err != nil {
		if fault.Is(err, fault.NotFound) {
			// The registry lost it: a node that holds it pushes it again (pushUnshared).
			if uerr := n.st.MarkReleaseUnshared(context.WithoutCancel(ctx), digest); uerr != nil {
				n.log.Warn("mark release not in the registry", "digest", digest, "err", uerr)
			}
			return fault.New(fault.Unavailable, "template release %s is missing from registry %s; a node that holds it pushes it again, retry later", digest, reg)
		}
		n.log.Warn("pull template release failed", "digest", digest, "registry", reg, "err", err)
		return fmt.Errorf("pull template release %s from registry %s onto node %s: %w", digest, reg, n.cfg.Name, err)
	}
	if err := n.st.AddNodeRelease(ctx, n.cfg.ID, digest); err != nil {
		return fmt.Errorf("record release %s on node %s: %w", digest, n.cfg.Name, err)
	}
	n.log.Info("pulled template release", "digest", digest, "registry", reg, "took", time.Since(start).Round(time.Millisecond))
	n.ensureBaseSnapshotLater(digest, store.SandboxSpec{CPU: n.cfg.DefaultCPU, MemoryMB: n.cfg.DefaultMemoryMB})
	return nil
}

// pushRelease pushes a release this node holds to the registry and returns its
// manifest digest; "" without a registry or when the push failed (logged, and said
// through note; pushUnshared retries it).
func (n *Node) pushRelease(ctx context.Context, digest string, note func(string)) string {
	if n.cfg.Artifacts == nil {
		return ""
	}
	reg := n.cfg.Artifacts.Registry()
	note(fmt.Sprintf("pushing release %s to registry %s", digest, reg))
	start := time.Now()
	a, err := n.cfg.Artifacts.PushRelease(ctx, digest)
	if err != nil {
		n.log.Warn("push template release failed; it stays on this node until a later push succeeds", "digest", digest, "registry", reg, "err", err)
		note(fmt.Sprintf("release %s is not shared: push to registry %s failed (retried every resync): %v", digest, reg, err))
		return ""
	}
	n.log.Info("pushed template release", "digest", digest, "registry", reg, "manifest", a.Digest, "took", time.Since(start).Round(time.Millisecond))
	return a.Digest
}

// pushUnshared pushes the releases this node holds that are not in the registry yet
// (a push that failed, releases built before the node had a registry), and records
// each one pushed.
func (n *Node) pushUnshared(ctx context.Context) {
	if n.cfg.Artifacts == nil {
		return
	}
	digests, err := n.st.UnsharedNodeReleases(ctx, n.cfg.ID)
	if err != nil {
		if ctx.Err() == nil {
			n.log.Warn("list releases to push", "err", err)
		}
		return
	}
	for _, d := range digests {
		if ctx.Err() != nil || !n.disk.HasRelease(d) {
			continue
		}
		m := n.pushRelease(ctx, d, func(string) {})
		if m == "" {
			return // the registry fails: try again at the next pass
		}
		if err := n.st.MarkReleaseShared(ctx, d, m); err != nil {
			n.log.Warn("record pushed release", "digest", d, "err", err)
		}
	}
}

// DefaultReleaseCacheGrace is Config.ReleaseCacheGrace's default.
const DefaultReleaseCacheGrace = time.Hour

// evictReleases removes from this node's store the releases it may pull again and
// nothing uses (store.EvictableReleases: in the registry, no tag, no sandbox, snapshot
// or build, nothing for ReleaseCacheGrace). Without a registry nothing is evicted: a
// node's releases exist nowhere else. A create that is resolving a release or making
// its disk from one holds releaseUse: the pass then waits for the next resync.
func (n *Node) evictReleases(ctx context.Context) {
	if n.cfg.Artifacts == nil {
		return
	}
	grace := n.cfg.ReleaseCacheGrace
	digests, err := n.st.EvictableReleases(ctx, n.cfg.ID, grace)
	if err != nil {
		if ctx.Err() == nil {
			n.log.Warn("list releases to evict", "err", err)
		}
		return
	}
	for _, d := range digests {
		if !n.releaseUse.TryLock() {
			return
		}
		ok, err := n.st.ForgetNodeRelease(ctx, n.cfg.ID, d, grace)
		if err == nil && ok && n.disk.HasRelease(d) {
			err = n.disk.DeleteRelease(ctx, d)
			if err != nil {
				// The files stay; record that the node still holds them.
				_ = n.st.AddNodeRelease(context.WithoutCancel(ctx), n.cfg.ID, d)
			}
		}
		n.releaseUse.Unlock()
		if err != nil {
			n.log.Warn("evict release", "digest", d, "err", err)
			return
		}
		if ok {
			n.log.Info("evicted unused template release from this node's store (it is in the registry)", "digest", d)
		}
	}
}

// buildBuiltin makes the builtin template name:latest usable on this node.
//
// With a registry it is built once per fleet: the build runs under a fleet-wide lock
// (store.WithLock), and a node that gets the lock after another built and pushed it
// pulls that release instead. Without one (or when the tagged release never reached
// the registry) every node uses its own build. Either way the tag stays on the first
// release registered (store.Release.KeepTag): it never flips between nodes' builds.
func (n *Node) buildBuiltin(ctx context.Context, sb *store.Sandbox, name string) (string, error) {
	ref := name + ":latest"
	if n.cfg.Artifacts == nil {
		return n.buildBuiltinHere(ctx, sb, name)
	}
	n.progress(ctx, sb, "waiting for template "+ref+" (first use in the fleet: built once by one node, then pulled from the registry)")
	v, err, _ := n.builtins.Do(name, func() (any, error) { return n.builtinOnce(ctx, sb, name) })
	if err != nil && ctx.Err() == nil && errors.Is(err, context.Canceled) {
		// The create whose wait this one shared went away: wait for ourselves.
		v, err, _ = n.builtins.Do(name, func() (any, error) { return n.builtinOnce(ctx, sb, name) })
	}
	if err != nil {
		return "", err
	}
	f := v.(builtinRelease)
	if f.pull {
		return f.digest, n.pullRelease(ctx, sb, f.digest)
	}
	return f.digest, nil
}

// builtinRelease is the release a node uses for a builtin template, and whether it
// must pull it first.
type builtinRelease struct {
	digest string
	pull   bool
}

// builtinOnce finds or makes the release of a builtin template under the fleet-wide
// lock: the tagged release this node holds, or the tagged release in the registry (to
// pull), or a release of this node's own (buildBuiltinHere).
func (n *Node) builtinOnce(ctx context.Context, sb *store.Sandbox, name string) (builtinRelease, error) {
	var digest string
	pull := false
	err := n.st.WithLock(ctx, "space:builtin:"+name, func(ctx context.Context) error {
		d, err := n.st.ResolveTag(ctx, name, "latest")
		if err != nil {
			return err
		}
		if d != "" && n.disk.HasRelease(d) {
			digest = d
			return nil
		}
		if d != "" {
			rel, err := n.st.GetRelease(ctx, d)
			if err != nil && !fault.Is(err, fault.NotFound) {
				return err
			}
			if err == nil && rel.Registry != "" {
				digest, pull = d, true
				return nil
			}
		}
		digest, err = n.buildBuiltinHere(ctx, sb, name)
		return err
	})
	return builtinRelease{digest, pull}, err
}

// buildBuiltinHere makes this node hold a release of the builtin template name: the
// newest one already on its disk (the database was reset, the store was seeded, the
// node built it before) or a new build. The release is pushed to the registry if
// there is one, then registered; the tag name:latest is set only if it does not exist.
// It returns the release this node uses.
func (n *Node) buildBuiltinHere(ctx context.Context, sb *store.Sandbox, name string) (string, error) {
	ref := name + ":latest"
	if d, ok, err := n.registerLocalBuiltin(ctx, sb, name); err != nil || ok {
		return d, err
	}
	if parent := template.BuiltinParent(name); parent != "" && n.cfg.Artifacts != nil {
		// The parent as the fleet has it (pulled, or built once and pushed), rather than
		// a build of this node's own.
		if _, err := n.buildBuiltin(ctx, sb, parent); err != nil {
			return "", fmt.Errorf("template %s starts from %s: %w", ref, parent, err)
		}
	}
	n.progress(ctx, sb, "waiting for template "+ref+" to be built on node "+n.cfg.Name+" (first use; a few minutes)")
	n.buildMu.Lock()
	defer n.buildMu.Unlock()
	if d, ok, err := n.registerLocalBuiltin(ctx, sb, name); err != nil || ok {
		return d, err // built by a concurrent create meanwhile
	}
	op := &store.Operation{ID: ids.Operation(), Kind: api.OpTemplateBuild, State: api.OpRunning,
		Tenant:  sb.Tenant,
		Message: "building template " + ref,
		Params:  map[string]any{"template": ref, "node": n.cfg.ID}}
	if err := n.st.CreateOperation(ctx, op); err != nil {
		return "", err
	}
	n.progress(ctx, sb, fmt.Sprintf("waiting for template %s to be built (first use; operation %s)", ref, op.ID))
	n.log.Info("building template", "template", ref, "op", op.ID)
	progress := func(line string) {
		n.log.Info("template build", "template", ref, "line", line)
		_ = n.st.AppendOperationLog(context.WithoutCancel(ctx), op.ID, line)
	}
	if n.cfg.Builder == nil {
		_ = n.st.UpdateOperation(context.WithoutCancel(ctx), op.ID, api.OpFailed, "failed", "this node builds no templates")
		return "", fmt.Errorf("build template %s: node %s builds no templates", ref, n.cfg.Name)
	}
	rel, tcfg, err := n.cfg.Builder.BuildBuiltin(ctx, name, progress)
	if err != nil {
		_ = n.st.UpdateOperation(context.WithoutCancel(ctx), op.ID, api.OpFailed, "failed", err.Error())
		return "", fmt.Errorf("build template %s: %w", ref, err)
	}
	cfg, _ := json.Marshal(tcfg)
	manifest := n.pushRelease(ctx, rel.Digest, progress)
	if err := n.st.PutRelease(ctx, &store.Release{Digest: rel.Digest, Name: name, Config: cfg, SizeBytes: rel.SizeBytes,
		Registry: manifest, KeepTag: true}, "latest", n.cfg.ID); err != nil {
		_ = n.st.UpdateOperation(context.WithoutCancel(ctx), op.ID, api.OpFailed, "failed", err.Error())
		return "", err
	}
	msg := "built " + rel.Digest
	if n.cfg.Artifacts != nil && manifest == "" {
		msg += "; not in the registry yet (the push failed; retried)"
	}
	_ = n.st.UpdateOperation(ctx, op.ID, api.OpSucceeded, msg, "")
	n.log.Info("template built", "template", ref, "digest", rel.Digest)
	return rel.Digest, nil
}

// failInterruptedBuilds fails template builds this node was running when it stopped.
func (n *Node) failInterruptedBuilds(ctx context.Context) error {
	ops, err := n.st.OpenOperationsOfKind(ctx, api.OpTemplateBuild)
	if err != nil {
		return err
	}
	for _, op := range ops {
		if node, _ := op.Params["node"].(string); node == n.cfg.ID && op.State == api.OpRunning {
			msg := "the build was interrupted by a restart of its node; submit it again"
			if op.Params["spec"] == nil {
				msg = "the build was interrupted by a restart of its node; the next create builds it again"
			}
			if err := n.st.UpdateOperation(ctx, op.ID, api.OpFailed, "interrupted", msg); err != nil {
				return err
			}
		}
	}
	return nil
}

// registerLocalBuiltin registers the newest release of the builtin template name
// found on this node's disk (with the config recorded in its tree), pushing it to the
// registry first if there is one and it is not there yet; name:latest is pointed at it
// only if the tag does not exist. false: there is none.
func (n *Node) registerLocalBuiltin(ctx context.Context, sb *store.Sandbox, name string) (string, bool, error) {
	rels, err := n.disk.ListReleases()
	if err != nil {
		return "", false, err
	}
	var best *storage.Release
	for i := range rels {
		if rels[i].Name == name && (best == nil || rels[i].CreatedAt.After(best.CreatedAt)) {
			best = &rels[i]
		}
	}
	if best == nil {
		return "", false, nil
	}
	manifest := ""
	if n.cfg.Artifacts != nil {
		if cur, err := n.st.GetRelease(ctx, best.Digest); err == nil && cur.Registry != "" {
			manifest = cur.Registry
		} else {
			manifest = n.pushRelease(ctx, best.Digest, func(msg string) { n.progress(ctx, sb, msg) })
		}
	}
	if err := n.st.PutRelease(ctx, &store.Release{Digest: best.Digest, Name: name, Config: best.Config, SizeBytes: best.SizeBytes,
		Registry: manifest, KeepTag: true}, "latest", n.cfg.ID); err != nil {
		return "", false, err
	}
	n.log.Debug("using builtin release found on disk", "template", name, "digest", best.Digest)
	return best.Digest, true, nil
}
