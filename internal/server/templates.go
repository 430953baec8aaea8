package server

import (
	"encoding/json"
	"fmt"
	"io"
	"mime"
	"net/http"
	"strings"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/ids"
	"github.com/spacedev/space/internal/store"
	"github.com/spacedev/space/internal/template"
)

// registerTemplates adds the template routes.
func (a *API) registerTemplates(authed func(string, handlerFunc)) {
	authed("GET /v1/templates", a.listTemplates)
	authed("POST /v1/templates", a.buildTemplate)
	authed("GET /v1/templates/{name}", a.getTemplate)
	authed("DELETE /v1/templates/{ref}", a.deleteTemplate)
}

func (a *API) listTemplates(w http.ResponseWriter, r *http.Request) error {
	rels, err := a.st.ListReleases(r.Context())
	if err != nil {
		return err
	}
	out := make([]api.Template, 0, len(rels))
	for _, rel := range rels {
		out = append(out, api.Template{Name: rel.Name, Tags: rel.Tags, Digest: rel.Digest, SizeBytes: rel.SizeBytes, CreatedAt: rel.CreatedAt})
	}
	writeJSON(w, http.StatusOK, map[string]any{"templates": out})
	return nil
}

// templateDetail is the body of GET /v1/templates/{name}.
type templateDetail struct {
	Name string `json:"name"`
	// Tags maps each tag to the digest it points at.
	Tags     map[string]string `json:"tags"`
	Releases []releaseDetail   `json:"releases"`
}

// releaseDetail describes one release of a template.
type releaseDetail struct {
	// Ref is the release's immutable reference, name@sha256:….
	Ref       string          `json:"ref"`
	Digest    string          `json:"digest"`
	Tags      []string        `json:"tags"`
	SizeBytes int64           `json:"size_bytes"`
	CreatedAt time.Time       `json:"created_at"`
	Config    json.RawMessage `json:"config"`
	// Nodes are the ids of the nodes that hold the release's files.
	Nodes []string `json:"nodes"`
}

// templateDeleted is the body of DELETE /v1/templates/{ref}.
type templateDeleted struct {
	// Deleted is the tag (name:tag) or release (name@sha256:…) removed.
	Deleted string `json:"deleted"`
	Digest  string `json:"digest"`
	// Nodes are the nodes asked to remove the release's files (release deletes only).
	Nodes []string `json:"nodes,omitempty"`
}

func (a *API) getTemplate(w http.ResponseWriter, r *http.Request) error {
	name := r.PathValue("name")
	if ref, err := api.ParseTemplateRef(name); err == nil {
		name = ref.Name
	} else {
		return fault.Wrap(fault.Invalid, err)
	}
	rels, nodes, err := a.st.TemplateReleases(r.Context(), name)
	if err != nil {
		return err
	}
	if len(rels) == 0 {
		return fault.New(fault.NotFound, "template %q not found", name)
	}
	out := templateDetail{Name: name, Tags: map[string]string{}, Releases: make([]releaseDetail, 0, len(rels))}
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
		out.Releases = append(out.Releases, releaseDetail{Ref: name + "@" + rel.Digest, Digest: rel.Digest, Tags: tags,
			SizeBytes: rel.SizeBytes, CreatedAt: rel.CreatedAt, Config: cfg, Nodes: ns})
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}

// deleteTemplate removes a tag (name:tag) or deletes a release (name@sha256:…) from
// the database; the nodes that hold the release remove its files.
func (a *API) deleteTemplate(w http.ResponseWriter, r *http.Request) error {
	if err := requireAdmin(r); err != nil {
		return err
	}
	raw := r.PathValue("ref")
	if !strings.ContainsAny(raw, ":@") {
		return invalid("say %s:TAG to remove a tag or %s@sha256:… to delete a release", raw, raw)
	}
	ref, err := api.ParseTemplateRef(raw)
	if err != nil {
		return fault.Wrap(fault.Invalid, err)
	}
	if ref.Digest != "" {
		nodes, err := a.st.DeleteRelease(r.Context(), ref.Name, ref.Digest)
		if err != nil {
			return err
		}
		a.log.Info("template release deleted", "ref", ref.String(), "nodes", nodes)
		writeJSON(w, http.StatusOK, templateDeleted{Deleted: ref.String(), Digest: ref.Digest, Nodes: nodes})
		return nil
	}
	d, err := a.st.DeleteTag(r.Context(), ref.Name, ref.Tag)
	if err != nil {
		return err
	}
	a.log.Info("template tag removed", "ref", ref.String(), "digest", d)
	writeJSON(w, http.StatusOK, templateDeleted{Deleted: ref.String(), Digest: d})
	return nil
}

// buildTemplate validates a build spec (JSON, or YAML with a YAML content type),
// checks its sources against the allowlists the nodes published, picks the least
// loaded node that may build it and queues the build there. 202 with the operation.
func (a *API) buildTemplate(w http.ResponseWriter, r *http.Request) error {
	if err := requireAdmin(r); err != nil {
		return err
	}
	if ct := r.Header.Get("Content-Type"); ct != "" {
		mt, _, err := mime.ParseMediaType(ct)
		if err != nil {
			return invalid("bad Content-Type %q", ct)
		}
		switch mt {
		case "application/json", "application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml":
		default:
			return invalid("Content-Type must be application/json or application/yaml")
		}
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBodyBytes))
	if err != nil {
		return jsonError(err)
	}
	if len(strings.TrimSpace(string(body))) == 0 {
		return invalid("request body is empty: send a template spec")
	}
	spec, err := template.ParseSpec(body)
	if err != nil {
		return err
	}
	params := map[string]any{"spec": spec, "template": spec.Ref()}
	parent := ""
	if spec.From.Template != "" {
		if parent, err = a.resolveRelease(r, spec.From.Template); err != nil {
			return err
		}
		params["from_digest"] = parent
	}
	node, err := a.pickBuildNode(r, spec, parent)
	if err != nil {
		return err
	}
	params["node"] = node.ID
	op := &store.Operation{
		ID: ids.Operation(), Kind: api.OpTemplateBuild, State: api.OpPending,
		Tenant:  principalFrom(r.Context()).Tenant,
		Message: fmt.Sprintf("queued: build %s on node %s", spec.Ref(), node.Name),
		Params:  params,
	}
	if err := a.st.CreateBuildOperation(r.Context(), op, node.ID); err != nil {
		return err
	}
	a.log.Info("template build queued", "template", spec.Ref(), "node", node.Name, "op", op.ID)
	w.Header().Set("Location", "/v1/operations/"+op.ID)
	writeJSON(w, http.StatusAccepted, op.API())
	return nil
}

// resolveRelease returns the digest a template reference names (404 if none).
func (a *API) resolveRelease(r *http.Request, s string) (string, error) {
	ref, err := api.ParseTemplateRef(s)
	if err != nil {
		return "", fault.Wrap(fault.Invalid, err)
	}
	d := ref.Digest
	if d == "" {
		if d, err = a.st.ResolveTag(r.Context(), ref.Name, ref.Tag); err != nil {
			return "", err
		}
		if d == "" {
			return "", fault.New(fault.NotFound, "template %q not found", ref.String())
		}
	}
	rel, err := a.st.GetRelease(r.Context(), d)
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
func (a *API) pickBuildNode(r *http.Request, spec *template.Spec, parent string) (*store.Node, error) {
	ctx := r.Context()
	nodes, err := a.st.ListNodes(ctx)
	if err != nil {
		return nil, err
	}
	published, err := a.st.NodeTemplateSources(ctx)
	if err != nil {
		return nil, err
	}
	builds, err := a.st.OpenBuildCounts(ctx)
	if err != nil {
		return nil, err
	}
	var best *store.Node
	var refusal error
	missingParent := false
	for _, n := range nodes {
		list, ok := published[n.ID]
		if n.State != "alive" || !ok {
			continue
		}
		allowed, err := template.ParseSources(list...)
		if err != nil {
			a.log.Warn("node published bad template sources", "node", n.Name, "err", err)
			continue
		}
		if err := allowed.CheckSpec(spec, false); err != nil {
			if refusal == nil || fault.Is(err, fault.Forbidden) && !fault.Is(refusal, fault.Forbidden) {
				refusal = err
			}
			continue
		}
		if parent != "" {
			has, err := a.st.NodeHasRelease(ctx, n.ID, parent)
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
