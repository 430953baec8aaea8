package node

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/ids"
	"github.com/spacedev/space/internal/storage"
	"github.com/spacedev/space/internal/store"
)

// BaseTemplate is the builtin template built on first use.
const BaseTemplate = "base"

// resolveTemplate returns the digest of the release the sandbox starts from, making
// sure its artifacts are on this node (building the builtin base template on first use).
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
	if ref.Name == BaseTemplate && ref.Tag == "latest" && sb.TemplateDigest == "" {
		return n.buildBase(ctx, sb)
	}
	if digest == "" {
		return "", fmt.Errorf("template %s not found", ref)
	}
	return "", fmt.Errorf("template release %s is not present on node %s", digest, n.cfg.Name)
}

// buildBase builds the base template once; concurrent creates wait for the same build.
func (n *Node) buildBase(ctx context.Context, sb *store.Sandbox) (string, error) {
	n.progress(ctx, sb, "waiting for template base:latest to be built on node "+n.cfg.Name+" (first use; about a minute)")
	n.buildMu.Lock()
	defer n.buildMu.Unlock()
	if d, err := n.st.ResolveTag(ctx, BaseTemplate, "latest"); err == nil && d != "" && n.disk.HasRelease(d) {
		return d, nil
	}
	// A base release already on this node's disk (the database was reset, or the
	// release was imported with space template import) is registered, not rebuilt.
	if d, ok, err := n.registerLocalBase(ctx); err != nil || ok {
		return d, err
	}
	op := &store.Operation{ID: ids.Operation(), Kind: api.OpTemplateBuild, State: api.OpRunning,
		Tenant:  sb.Tenant,
		Message: "building template base:latest",
		Params:  map[string]any{"template": "base:latest", "node": n.cfg.ID}}
	if err := n.st.CreateOperation(ctx, op); err != nil {
		return "", err
	}
	n.progress(ctx, sb, fmt.Sprintf("waiting for template base:latest to be built (first use; operation %s)", op.ID))
	n.log.Info("building template base:latest", "op", op.ID)
	progress := func(line string) {
		n.log.Info("template build", "template", "base:latest", "line", line)
		_ = n.st.AppendOperationLog(context.WithoutCancel(ctx), op.ID, line)
	}
	if n.cfg.Builder == nil {
		_ = n.st.UpdateOperation(context.WithoutCancel(ctx), op.ID, api.OpFailed, "failed", "this node builds no templates")
		return "", fmt.Errorf("build template base:latest: node %s builds no templates", n.cfg.Name)
	}
	rel, err := n.cfg.Builder.BuildBase(ctx, progress)
	if err != nil {
		_ = n.st.UpdateOperation(context.WithoutCancel(ctx), op.ID, api.OpFailed, "failed", err.Error())
		return "", fmt.Errorf("build template base:latest: %w", err)
	}
	cfg, _ := json.Marshal(rel.Config)
	if err := n.st.PutRelease(ctx, &store.Release{Digest: rel.Digest, Name: BaseTemplate, Config: cfg, SizeBytes: rel.SizeBytes}, "latest", n.cfg.ID); err != nil {
		_ = n.st.UpdateOperation(context.WithoutCancel(ctx), op.ID, api.OpFailed, "failed", err.Error())
		return "", err
	}
	_ = n.st.UpdateOperation(ctx, op.ID, api.OpSucceeded, "built "+rel.Digest, "")
	n.log.Info("template built", "template", "base:latest", "digest", rel.Digest)
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
				msg = "the build was interrupted by a restart of its node; the next create builds base again"
			}
			if err := n.st.UpdateOperation(ctx, op.ID, api.OpFailed, "interrupted", msg); err != nil {
				return err
			}
		}
	}
	return nil
}

// registerLocalBase tags the newest base release found on disk as base:latest.
func (n *Node) registerLocalBase(ctx context.Context) (string, bool, error) {
	rels, err := n.disk.ListReleases()
	if err != nil {
		return "", false, err
	}
	var best *storage.Release
	for i := range rels {
		if rels[i].Name == BaseTemplate && (best == nil || rels[i].CreatedAt.After(best.CreatedAt)) {
			best = &rels[i]
		}
	}
	if best == nil {
		return "", false, nil
	}
	cfg, _ := json.Marshal(best.Config)
	if err := n.st.PutRelease(ctx, &store.Release{Digest: best.Digest, Name: BaseTemplate, Config: cfg, SizeBytes: best.SizeBytes}, "latest", n.cfg.ID); err != nil {
		return "", false, err
	}
	n.log.Info("registered base release found on disk", "digest", best.Digest)
	return best.Digest, true, nil
}
