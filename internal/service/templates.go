package service

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/ids"
	"github.com/spacedev/space/internal/store"
	"github.com/spacedev/space/internal/template"
)

// Templates are shared (builtin ones, and what operators build: every tenant may use
// them, none may change them) or a tenant's own (what its admins build: invisible to
// other tenants, answering like missing ones). A tenant's template name takes
// precedence over a shared one for that tenant.

// Templates lists the templates p may see: its tenant's and the shared ones; an
// operator every tenant's, or tenant's and the shared ones.
func (s *Service) Templates(ctx context.Context, p *Principal, tenant string) ([]api.Template, error) {
	scope, err := s.scope(ctx, p, tenant)
	if err != nil {
		return nil, err
	}
	rels, err := s.st.ListReleases(ctx, scope, scope == "")
	if err != nil {
		return nil, err
	}
	out := make([]api.Template, 0, len(rels))
	for _, rel := range rels {
		out = append(out, api.Template{Tenant: rel.Tenant, Name: rel.Name, Tags: rel.Tags, Digest: rel.Digest,
			SizeBytes: rel.SizeBytes, CreatedAt: rel.CreatedAt})
	}
	return out, nil
}

// templateOwner returns whose template name is for p in the tenant it names: p's
// tenant's own, else the shared one; for an operator the named tenant's (or the
// shared one when it names none). A name p may not see is NotFound.
func (s *Service) templateOwner(ctx context.Context, p *Principal, tenant, name string) (string, error) {
	scope, err := s.scope(ctx, p, tenant)
	if err != nil {
		return "", err
	}
	owner, found, err := s.st.TemplateOwner(ctx, scope, name)
	if err != nil {
		return "", err
	}
	if !found {
		return "", fault.New(fault.NotFound, "template %q not found", name)
	}
	return owner, nil
}

// Template describes a template: its tags and releases.
func (s *Service) Template(ctx context.Context, p *Principal, name, tenant string) (api.TemplateDetail, error) {
	ref, err := api.ParseTemplateRef(name)
	if err != nil {
		return api.TemplateDetail{}, fault.Wrap(fault.Invalid, err)
	}
	name = ref.Name
	owner, err := s.templateOwner(ctx, p, tenant, name)
	if err != nil {
		return api.TemplateDetail{}, err
	}
	rels, nodes, err := s.st.TemplateReleases(ctx, owner, name)
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
		if ns == nil || !p.Operator() {
			ns = []string{} // nodes are the operator's business
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
// the database; the nodes that hold the release remove its files. A tenant's admins
// delete their tenant's templates (shared ones are read-only for them); operators the
// shared ones, or a tenant's when they name it.
func (s *Service) DeleteTemplate(ctx context.Context, p *Principal, raw, tenant string) (api.TemplateDeleted, error) {
	if !strings.ContainsAny(raw, ":@") {
		return api.TemplateDeleted{}, invalid("say %s:TAG to remove a tag or %s@sha256:… to delete a release", raw, raw)
	}
	ref, err := api.ParseTemplateRef(raw)
	if err != nil {
		return api.TemplateDeleted{}, fault.Wrap(fault.Invalid, err)
	}
	owner := tenant
	if !p.Operator() {
		if owner, err = s.templateOwner(ctx, p, tenant, ref.Name); err != nil {
			if fault.Is(err, fault.NotFound) && ref.Digest != "" {
				return api.TemplateDeleted{}, fault.New(fault.NotFound, "template release %s@%s not found", ref.Name, ref.Digest)
			}
			if fault.Is(err, fault.NotFound) {
				return api.TemplateDeleted{}, fault.New(fault.NotFound, "template %s:%s not found", ref.Name, ref.Tag)
			}
			return api.TemplateDeleted{}, err
		}
		if owner == "" {
			return api.TemplateDeleted{}, fault.New(fault.Forbidden, "template %s is shared: only operators change it", ref.Name)
		}
		if err := RequireAdmin(p); err != nil {
			return api.TemplateDeleted{}, err
		}
	} else if _, err := s.scope(ctx, p, tenant); err != nil {
		return api.TemplateDeleted{}, err
	}
	if ref.Digest != "" {
		nodes, err := s.st.DeleteRelease(ctx, owner, ref.Name, ref.Digest)
		if err != nil {
			return api.TemplateDeleted{}, err
		}
		s.log.Info("template release deleted", "ref", ref.String(), "tenant", owner, "nodes", nodes)
		if !p.Operator() {
			nodes = nil
		}
		return api.TemplateDeleted{Deleted: ref.String(), Digest: ref.Digest, Nodes: nodes}, nil
	}
	d, err := s.st.DeleteTag(ctx, owner, ref.Name, ref.Tag)
	if err != nil {
		return api.TemplateDeleted{}, err
	}
	s.log.Info("template tag removed", "ref", ref.String(), "tenant", owner, "digest", d)
	return api.TemplateDeleted{Deleted: ref.String(), Digest: d}, nil
}

// BuildTemplate validates a build spec (JSON or YAML), checks its sources against the
// allowlists the nodes published, picks the least loaded node that may build it and
// queues the build there. A tenant's admins build their tenant's templates (names of
// shared templates are taken); operators build shared ones. The build is an operation
// of the tenant (quota "operations").
func (s *Service) BuildTemplate(ctx context.Context, p *Principal, body []byte) (*store.Operation, error) {
	return s.BuildTemplateFor(ctx, p, body, "")
}

// BuildTemplateFor is BuildTemplate in the tenant an operator names ("" = shared).
func (s *Service) BuildTemplateFor(ctx context.Context, p *Principal, body []byte, tenant string) (*store.Operation, error) {
	op, _, err := s.buildTemplate(ctx, p, body, tenant, nil)
	return op, err
}

// BuildTemplateKeyed is BuildTemplateFor for a request with idem (nil: no
// Idempotency-Key): a repeat gets the first request's answer (202 with its operation)
// and queues no second build.
func (s *Service) BuildTemplateKeyed(ctx context.Context, p *Principal, body []byte, tenant string, idem *Idempotency) (*Answer, error) {
	return s.once(ctx, p, idem, func() (*Answer, error) {
		_, a, err := s.buildTemplate(ctx, p, body, tenant, idem)
		return a, err
	})
}

func (s *Service) buildTemplate(ctx context.Context, p *Principal, body []byte, tenant string, idem *Idempotency) (*store.Operation, *Answer, error) {
	owner, err := s.scope(ctx, p, tenant)
	if err != nil {
		return nil, nil, err
	}
	if len(strings.TrimSpace(string(body))) == 0 {
		return nil, nil, invalid("request body is empty: send a template spec")
	}
	spec, err := template.ParseSpec(body)
	if err != nil {
		return nil, nil, err
	}
	if owner != "" {
		if slices.Contains(s.cfg.BuiltinTemplates, spec.Name) {
			return nil, nil, fault.New(fault.Conflict, "template name %q is a builtin template's", spec.Name)
		}
		if _, shared, err := s.st.TemplateOwner(ctx, "", spec.Name); err != nil {
			return nil, nil, err
		} else if shared {
			if mine, _, err := s.st.TemplateOwner(ctx, owner, spec.Name); err != nil || mine == "" {
				return nil, nil, fault.New(fault.Conflict, "template name %q is taken by a shared template", spec.Name)
			}
		}
	}
	params := map[string]any{"spec": spec, "template": spec.Ref(), "owner": owner}
	parent := ""
	if spec.From.Template != "" {
		if parent, err = s.resolveRelease(ctx, owner, spec.From.Template); err != nil {
			return nil, nil, err
		}
		params["from_digest"] = parent
	}
	// The role is checked after the names are resolved, so that another tenant's
	// template answers like a missing one to every key.
	if err := RequireAdmin(p); err != nil {
		return nil, nil, err
	}
	node, err := s.pickBuildNode(ctx, spec, parent)
	if err != nil {
		return nil, nil, err
	}
	params["node"] = node.ID
	opTenant := owner
	if opTenant == "" {
		opTenant = p.Tenant
	}
	op := &store.Operation{
		ID: ids.Operation(), Kind: api.OpTemplateBuild, State: api.OpPending,
		Tenant:  opTenant,
		Message: fmt.Sprintf("queued: build %s on node %s", spec.Ref(), node.Name),
		Params:  params,
	}
	var a *Answer
	err = s.st.InTx(ctx, func(tx *store.Tx) error {
		if err := s.checkQuota(ctx, tx, opTenant, need{store.QuotaOperations: 1}); err != nil {
			return err
		}
		if err := tx.CreateBuildOperation(ctx, op, node.ID); err != nil {
			return err
		}
		var err error
		a, err = answer(ctx, tx, p, idem, http.StatusAccepted, op.API())
		return err
	})
	if err != nil {
		return nil, nil, err
	}
	s.log.Info("template build queued", "template", spec.Ref(), "tenant", owner, "node", node.Name, "op", op.ID)
	a.Location = "/v1/operations/" + op.ID
	return op, a, nil
}

// resolveRelease returns the digest a template reference names for tenant ("" =
// shared only); 404 if none it may use.
func (s *Service) resolveRelease(ctx context.Context, tenant, raw string) (string, error) {
	ref, err := api.ParseTemplateRef(raw)
	if err != nil {
		return "", fault.Wrap(fault.Invalid, err)
	}
	d := ref.Digest
	if d == "" {
		if d, _, err = s.st.ResolveTenantTag(ctx, tenant, ref.Name, ref.Tag); err != nil {
			return "", err
		}
		if d == "" {
			return "", fault.New(fault.NotFound, "template %q not found", ref.String())
		}
	} else if ok, err := s.st.ReleaseVisible(ctx, tenant, d); err != nil {
		return "", err
	} else if !ok {
		return "", fault.New(fault.NotFound, "template %q not found", ref.String())
	}
	rel, err := s.st.GetRelease(ctx, d)
	if err != nil {
		return "", err
	}
	if ref.Digest != "" && rel.Name != ref.Name {
		return "", fault.New(fault.NotFound, "template %q not found", ref.String())
	}
	return d, nil
}

// pickBuildNode returns the alive, uncordoned node with the fewest unfinished builds
// (then the fewest sandboxes) whose published allowlist admits the spec's sources and
// which holds the parent release, if any, or can pull it from the registry. A spec no
// node admits is fault.Forbidden.
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
		if n.State != store.NodeAlive || n.Cordoned || !ok {
			continue // a cordoned node gets no new work
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
			has, err := s.st.NodeCanGetRelease(ctx, n.ID, parent) // holds it, or it is in the registry
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
		return nil, fault.New(fault.Unavailable, "no node can build templates now (none is alive and uncordoned, or none has started yet); retry shortly")
	}
}
