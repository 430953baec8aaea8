package service_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/node"
	"github.com/spacedev/space/internal/runtime/fake"
	"github.com/spacedev/space/internal/service"
	"github.com/spacedev/space/internal/spacetest"
	"github.com/spacedev/space/internal/storage"
	"github.com/spacedev/space/internal/store"
	"github.com/spacedev/space/internal/template"
)

// specBuilder is a template builder over the fake disk: a build records a release
// whose content (and digest) follows from the spec's name.
type specBuilder struct{ disk *fake.Disk }

func (b *specBuilder) AllowedSources() template.Sources {
	src, _ := template.ParseSources()
	return src
}

func (b *specBuilder) BuildBuiltin(context.Context, string, func(string)) (storage.Release, template.Config, error) {
	return storage.Release{}, template.Config{}, nil
}

func (b *specBuilder) Build(_ context.Context, spec *template.Spec, _ template.BuildOptions) (storage.Release, template.Config, error) {
	sum := sha256.Sum256([]byte(spec.Name))
	raw, _ := json.Marshal(template.Config{})
	rel, err := b.disk.AddRelease(spec.Name, "sha256:"+hex.EncodeToString(sum[:]), raw, map[string]string{"built": spec.Name})
	return rel, template.Config{}, err
}

// TestTenantTemplateBuilds: a tenant's admin builds a template of its tenant (the node
// records it for that tenant without knowing tenants); its members start sandboxes
// from it; another tenant cannot see, use or delete it. Operators build shared
// templates, which every tenant uses and none may change or shadow.
func TestTenantTemplateBuilds(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{Node: func(c *node.Config) { c.Builder = &specBuilder{disk: c.Storage.(*fake.Disk)} }})
	_, a1Admin := s.NewKeyRole("t1", store.RoleAdmin, service.KeySpace)
	_, a1Member := s.NewKeyRole("t1", store.RoleMember, service.KeySpace)
	_, a2Admin := s.NewKeyRole("t2", store.RoleAdmin, service.KeySpace)
	t1, m1, t2 := principal(t, s, a1Admin, service.KeySpace), principal(t, s, a1Member, service.KeySpace), principal(t, s, a2Admin, service.KeySpace)
	op := principal(t, s, s.AdminKey, service.KeySpace)
	build := func(p *service.Principal, spec string) *store.Operation {
		t.Helper()
		var o *store.Operation
		s.Eventually(20*time.Second, "the node to publish its template sources", func() bool {
			var err error
			o, err = s.Service.BuildTemplate(ctx(t), p, []byte(spec))
			if err != nil && !fault.Is(err, fault.Unavailable) {
				t.Fatalf("build %q: %v", spec, err)
			}
			return err == nil
		})
		s.WaitOp(o.ID, api.OpSucceeded)
		return o
	}
	b := build(t1, "name: mine\nfrom:\n  template: base\n")
	if b.Tenant != "t1" {
		t.Fatalf("t1's build belongs to %q", b.Tenant)
	}
	if _, err := s.Service.BuildTemplate(ctx(t), m1, []byte("name: x\nfrom:\n  template: base\n")); !fault.Is(err, fault.Forbidden) {
		t.Fatalf("a member's build: %v", err)
	}
	build(op, "name: shared\nfrom:\n  template: base\n")

	has := func(p *service.Principal, name string) bool {
		list, err := s.Service.Templates(ctx(t), p, "")
		if err != nil {
			t.Fatal(err)
		}
		for _, tp := range list {
			if tp.Name == name {
				return true
			}
		}
		return false
	}
	for _, tc := range []struct {
		who  string
		p    *service.Principal
		name string
		sees bool
	}{{"t1", t1, "mine", true}, {"t1 member", m1, "mine", true}, {"t2", t2, "mine", false}, {"t2", t2, "shared", true}, {"t1", t1, "shared", true}} {
		if got := has(tc.p, tc.name); got != tc.sees {
			t.Errorf("%s sees %s: %v", tc.who, tc.name, got)
		}
	}
	// t1's member starts a sandbox of it (the node finds the release by its digest).
	created, err := s.Service.Create(ctx(t), m1, api.CreateSandboxRequest{Template: "mine"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	s.WaitOp(created.Op.ID, api.OpSucceeded)
	if created.Sandbox.TemplateDigest == "" {
		t.Fatal("a tenant template's digest was not pinned at create")
	}
	// t2 cannot use, see or delete it: like a template that does not exist.
	for name, err := range map[string]error{
		"create": func() error {
			_, err := s.Service.Create(ctx(t), t2, api.CreateSandboxRequest{Template: "mine"}, nil)
			return err
		}(),
		"get":    func() error { _, err := s.Service.Template(ctx(t), t2, "mine", ""); return err }(),
		"delete": func() error { _, err := s.Service.DeleteTemplate(ctx(t), t2, "mine:latest", ""); return err }(),
		"build from it": func() error {
			_, err := s.Service.BuildTemplate(ctx(t), t2, []byte("name: y\nfrom:\n  template: mine\n"))
			return err
		}(),
	} {
		if !fault.Is(err, fault.NotFound) || !strings.Contains(err.Error(), "mine") {
			t.Errorf("t2's %s of t1's template: %v", name, err)
		}
	}
	// Shared templates are read-only for tenants, and their names are taken.
	if _, err := s.Service.DeleteTemplate(ctx(t), t1, "shared:latest", ""); !fault.Is(err, fault.Forbidden) {
		t.Errorf("t1 deletes a shared template: %v", err)
	}
	for _, name := range []string{"shared", "base"} {
		if _, err := s.Service.BuildTemplate(ctx(t), t1, []byte("name: "+name+"\nfrom:\n  template: base\n")); !fault.Is(err, fault.Conflict) {
			t.Errorf("t1 builds a template named %s: %v", name, err)
		}
	}
	// The operator sees t1's template under t1 and may delete it there.
	if d, err := s.Service.Template(ctx(t), op, "mine", "t1"); err != nil || len(d.Releases) != 1 {
		t.Errorf("operator's view of t1's template: %+v %v", d, err)
	}
	if _, err := s.Service.Template(ctx(t), op, "mine", ""); !fault.Is(err, fault.NotFound) {
		t.Errorf("t1's template is not a shared one: %v", err)
	}
}
