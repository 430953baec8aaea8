package service

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/ids"
	"github.com/spacedev/space/internal/store"
	"github.com/spacedev/space/internal/template"
)

// Templates lists template releases.
func (s *Service) Templates(ctx context.Context, _ *Principal) ([]api.Template, error) {
	rels, err := s.st.ListReleases(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]api.Template, 0, len(rels))
	for _, rel := range rels {
		out = append(out, api.Template{Name: rel.Name, Tags: rel.Tags, Digest: rel.Digest, SizeBytes: rel.SizeBytes, CreatedAt: rel.CreatedAt})
	}
	return out, nil
}

// Template describes a template: its tags and releases.
func (s *Service) Template(ctx context.Context, _ *Principal, name string) (api.TemplateDetail, error) {
	ref, err := api.ParseTemplateRef(name)
	if err != nil {
		return api.TemplateDetail{}, fault.Wrap(fault.Invalid, err)
	}
	name = ref.Name
	rels, nodes, err := s.st.TemplateReleases(ctx, name)
	if err != nil {
		return api.TemplateDetail{}, err
	}
	if len(rels) == 0 {
		return api.TemplateDetail{}, fault.New(fault.NotFound, "template %q not found", name)
	}
	out := api.TemplateDetail{Name: name, Tags: map[string]string{}, Releases: make([]api.TemplateRelease, 0, len(rels))}
	for _, rel := range rels {
		for _, t := range rel.Tags {
			out.Tags[t] = rel.Digest
		}
		cfg := rel.Config
		if len(cfg) == 0 {
			cfg = json.RawMessage(`{}`)
		}
		ns := nodes[rel.Digest]
		if ns == nil {
			ns = []string{}
		}
		tags := rel.Tags
		if tags == nil {
			tags = []string{}
		}
		out.Releases = append(out.Releases, api.TemplateRelease{Ref: name + "@" + rel.Digest, Digest: rel.Digest, Tags: tags,
			SizeBytes: rel.SizeBytes, CreatedAt: rel.CreatedAt, Config: cfg, Nodes: ns})
	}
	return out, nil
}

// DeleteTemplate removes a tag (name:tag) or deletes a release (name@sha256:…) from
// the database; the nodes that hold the release remove its files. Admins only.
func (s *Service) DeleteTemplate(ctx context.Context, p *Principal, raw string) (api.TemplateDeleted, error) {
	if err := RequireAdmin(p); err != nil {
		return api.TemplateDeleted{}, err
	}
	if !strings.ContainsAny(raw, ":@") {
		return api.TemplateDeleted{}, invalid("say %s:TAG to remove a tag or %s@sha256:… to delete a release", raw, raw)
	}
	ref, err := api.ParseTemplateRef(raw)
	if err != nil {
		return api.TemplateDeleted{}, fault.Wrap(fault.Invalid, err)
	}
	if ref.Digest != "" {
		nodes, err := s.st.DeleteRelease(ctx, ref.Name, ref.Digest)
		if err != nil {
			return api.TemplateDeleted{}, err
		}
		s.log.Info("template release deleted", "ref", ref.String(), "nodes", nodes)
		return api.TemplateDeleted{Deleted: ref.String(), Digest: ref.Digest, Nodes: nodes}, nil
	}
	d, err := s.st.DeleteTag(ctx, ref.Name, ref.Tag)
	if err != nil {
		return api.TemplateDeleted{}, err
	}
	s.log.Info("template tag removed", "ref", ref.String(), "digest", d)
	return api.TemplateDeleted{Deleted: ref.String(), Digest: d}, nil
}

// BuildTemplate validates a build spec (JSON or YAML), checks its sources against the
// allowlists the nodes published, picks the least loaded node that may build it and
// queues the build there. Admins only.
func (s *Service) BuildTemplate(ctx context.Context, p *Principal, body []byte) (*store.Operation, error) {
	if err := RequireAdmin(p); err != nil {
		return nil, err
	}
	if len(strings.TrimSpace(string(body))) == 0 {
		return nil, invalid("request body is empty: send a template spec")
	}
	spec, err := template.ParseSpec(body)
	if err != nil {
		return nil, err
	}
	params := map[string]any{"spec": spec, "template": spec.Ref()}
	parent := ""
	if spec.From.Template != "" {
		if parent, err = s.resolveRelease(ctx, spec.From.Template); err != nil {
			return nil, err
		}
		params["from_digest"] = parent
	}
	node, err := s.pickBuildNode(ctx, spec, parent)
	if err != nil {
		return nil, err
	}
	params["node"] = node.ID
	op := &store.Operation{
		ID: ids.Operation(), Kind: api.OpTemplateBuild, State: api.OpPending,
		Tenant:  p.Tenant,
		Message: fmt.Sprintf("queued: build %s on node %s", spec.Ref(), node.Name),
		Params:  params,
	}
	if err := s.st.CreateBuildOperation(ctx, op, node.ID); err != nil {
		return nil, err
	}
	s.log.Info("template build queued", "template", spec.Ref(), "node", node.Name, "op", op.ID)
	return op, nil
}

// resolveRelease returns the digest a template reference names (404 if none).
func (s *Service) resolveRelease(ctx context.Context, raw string) (string, error) {
	ref, err := api.ParseTemplateRef(raw)
	if err != nil {
		return "", fault.Wrap(fault.Invalid, err)
	}
	d := ref.Digest
	if d == "" {
		if d, err = s.st.ResolveTag(ctx, ref.Name, ref.Tag); err != nil {
			return "", err
		}
		if d == "" {
			return "", fault.New(fault.NotFound, "template %q not found", ref.String())
		}
	}
	rel, err := s.st.GetRelease(ctx, d)
	if err != nil {
		return "", err
	}
	if rel.Name != ref.Name {
		return "", fault.New(fault.NotFound, "template %q not found", ref.String())
	}
	return d, nil
}

// pickBuildNode returns the alive node with the fewest unfinished builds (then the
// fewest sandboxes) whose published allowlist admits the spec's sources and which
// holds the parent release, if any. A spec no node admits is fault.Forbidden.
func (s *Service) pickBuildNode(ctx context.Context, spec *template.Spec, parent string) (*store.Node, error) {
	nodes, err := s.st.ListNodes(ctx)
	if err != nil {
		return nil, err
	}
	published, err := s.st.NodeTemplateSources(ctx)
	if err != nil {
		return nil, err
	}
	builds, err := s.st.OpenBuildCounts(ctx)
	if err != nil {
		return nil, err
	}
	var best *store.Node
	var refusal error
	missingParent := false
	for _, n := range nodes {
		list, ok := published[n.ID]
		if n.State != store.NodeAlive || !ok {
			continue
		}
		allowed, err := template.ParseSources(list...)
		if err != nil {
			s.log.Warn("node published bad template sources", "node", n.Name, "err", err)
			continue
		}
		if err := allowed.CheckSpec(spec, false); err != nil {
			if refusal == nil || fault.Is(err, fault.Forbidden) && !fault.Is(refusal, fault.Forbidden) {
				refusal = err
			}
			continue
		}
		if parent != "" {
			has, err := s.st.NodeHasRelease(ctx, n.ID, parent)
			if err != nil {
				return nil, err
			}
			if !has {
				missingParent = true
				continue
			}
		}
		if best == nil || builds[n.ID] < builds[best.ID] || builds[n.ID] == builds[best.ID] && n.Sandboxes < best.Sandboxes {
			best = n
		}
	}
	switch {
	case best != nil:
		return best, nil
	case refusal != nil:
		return nil, refusal
	case missingParent:
		return nil, fault.New(fault.Unavailable, "no alive node holds the files of %s", spec.From.Template)
	default:
		return nil, fault.New(fault.Unavailable, "no node can build templates now (none is alive, or none has started yet); retry shortly")
	}
}
