package service_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/service"
	"github.com/spacedev/space/internal/spacetest"
	"github.com/spacedev/space/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return c
}

func principal(t *testing.T, s *spacetest.Space, key, kind string) *service.Principal {
	t.Helper()
	p, err := s.Service.Authenticate(ctx(t), key, kind)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func TestAuthenticate(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{NoNode: true, NoController: true})
	e2bKey := s.NewKey("default", false, service.KeyE2B)
	for _, tc := range []struct {
		secret, kind, want string
	}{
		{"", service.KeySpace, "missing"},
		{strings.Repeat("x", 600), service.KeySpace, "invalid"},
		{"spt1.a.b", service.KeySpace, "attachment tokens"},
		{"nope", service.KeySpace, "invalid"},
		{e2bKey, service.KeySpace, "E2B-compatible API only"},
		{s.AdminKey, service.KeyE2B, "not valid here"},
	} {
		_, err := s.Service.Authenticate(ctx(t), tc.secret, tc.kind)
		if !fault.Is(err, fault.Unauthorized) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%.12q as %s: %v", tc.secret, tc.kind, err)
		}
	}
	if p := principal(t, s, e2bKey, service.KeyE2B); p.Operator() || p.Role != "member" || p.Tenant != "default" {
		t.Fatalf("e2b principal %+v", p)
	}
	if err := service.RequireAdmin(nil); !fault.Is(err, fault.Forbidden) {
		t.Fatal(err)
	}
}

// Another tenant's sandbox answers exactly like one that does not exist.
func TestOtherTenantsSandboxIsNotFound(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{NoNode: true, NoController: true})
	a := principal(t, s, s.NewKey("a", false, service.KeySpace), service.KeySpace)
	b := principal(t, s, s.NewKey("b", false, service.KeySpace), service.KeySpace)
	created, err := s.Service.Create(ctx(t), a, api.CreateSandboxRequest{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	id := created.Sandbox.ID
	checks := map[string]func(p *service.Principal, id string) error{
		"get": func(p *service.Principal, id string) error { _, err := s.Service.Sandbox(ctx(t), p, id); return err },
		"verb": func(p *service.Principal, id string) error {
			_, err := s.Service.Verb(ctx(t), p, id, api.OpPause, "")
			return err
		},
		"delete": func(p *service.Principal, id string) error { _, err := s.Service.Delete(ctx(t), p, id); return err },
		"clone": func(p *service.Principal, id string) error {
			_, err := s.Service.Clone(ctx(t), p, id, api.CloneRequest{})
			return err
		},
		"expiry": func(p *service.Principal, id string) error { return s.Service.SetExpiry(ctx(t), p, id, nil, "") },
		"ops": func(p *service.Principal, id string) error {
			_, err := s.Service.SandboxOperations(ctx(t), p, id)
			return err
		},
		"revoke": func(p *service.Principal, id string) error {
			_, err := s.Service.RevokeTokens(ctx(t), p, id)
			return err
		},
		"session": func(p *service.Principal, id string) error {
			_, err := s.Service.CreateSession(ctx(t), p, id, api.CreateSessionRequest{Command: "true"}, true, "")
			return err
		},
	}
	for name, check := range checks {
		other := check(b, id)
		missing := check(b, "aaaaaaaaaaaaaaaaaaaa")
		if !fault.Is(other, fault.NotFound) || other.Error() != strings.Replace(missing.Error(), "aaaaaaaaaaaaaaaaaaaa", id, 1) {
			t.Errorf("%s: other tenant %v, missing %v", name, other, missing)
		}
	}
	if _, err := s.Service.Operation(ctx(t), b, created.Op.ID); !fault.Is(err, fault.NotFound) {
		t.Errorf("other tenant's operation: %v", err)
	}
	list, err := s.Service.List(ctx(t), b, service.ListFilter{})
	if err != nil || len(list) != 0 {
		t.Fatalf("b lists %d sandboxes (%v)", len(list), err)
	}
}

func TestVerbsAndWake(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	p := principal(t, s, s.AdminKey, service.KeySpace)
	sb := s.Create(api.CreateSandboxRequest{})
	if _, err := s.Service.Verb(ctx(t), p, sb.ID, "explode", ""); !fault.Is(err, fault.Invalid) {
		t.Fatalf("unknown verb: %v", err)
	}
	if _, err := s.Service.Verb(ctx(t), p, sb.ID, api.OpClone, ""); !fault.Is(err, fault.Invalid) {
		t.Fatalf("clone as a verb: %v", err)
	}
	op, err := s.Service.Verb(ctx(t), p, sb.ID, api.OpStop, "tidying up")
	if err != nil {
		t.Fatal(err)
	}
	s.WaitOp(op.ID, api.OpSucceeded)
	row, err := s.Service.Sandbox(ctx(t), p, sb.ID)
	if err != nil || row.StatusReason != "tidying up" {
		t.Fatalf("reason: %+v %v", row, err)
	}
	if _, err := s.Service.Clone(ctx(t), p, sb.ID, api.CloneRequest{}); err == nil || !strings.Contains(err.Error(), "no memory") {
		t.Fatalf("clone of a stopped sandbox: %v", err)
	}
	same, err := s.Service.Awake(ctx(t), p, row, true)
	if err != nil || same.State != api.StateStopped {
		t.Fatalf("no wake: %+v %v", same, err)
	}
	woken, err := s.Service.Awake(ctx(t), p, row, false)
	if err != nil || woken.State != api.StateRunning {
		t.Fatalf("wake: %+v %v", woken, err)
	}
	at := time.Now().Add(time.Hour)
	if err := s.Service.SetExpiry(ctx(t), p, sb.ID, &at, "suspend"); err != nil {
		t.Fatal(err)
	}
	if row, _ := s.Service.Sandbox(ctx(t), p, sb.ID); row.ExpiresAt == nil || row.ExpireAction != "suspend" {
		t.Fatalf("expiry %+v", row)
	}
	procs, err := s.Service.Processes(ctx(t), p, sb.ID, false)
	if err != nil {
		t.Fatal(err)
	}
	_ = procs
	if _, err := s.Service.Process(ctx(t), p, sb.ID, "x", false); !fault.Is(err, fault.Invalid) {
		t.Fatalf("bad pid: %v", err)
	}
	if _, err := s.Service.CreateSession(ctx(t), p, sb.ID, api.CreateSessionRequest{PID: 5, Command: "x"}, false, ""); !fault.Is(err, fault.Invalid) {
		t.Fatalf("pid with command: %v", err)
	}
	for _, req := range []api.CreateSessionRequest{
		{}, {Argv: []string{"a"}, Command: "b"}, {Argv: []string{""}}, {Command: "x", User: "Root!"},
		{Command: "x", Cwd: "rel"}, {Command: "x", Timeout: "soon"}, {Command: "x", PTY: &api.PTYSize{Rows: 0, Cols: 1}},
		{Command: "x", Rights: []string{"fly"}}, {Command: "x", TokenTTL: "1000h"},
	} {
		if _, err := s.Service.CreateSession(ctx(t), p, sb.ID, req, false, ""); !fault.Is(err, fault.Invalid) {
			t.Errorf("%+v: %v", req, err)
		}
	}
}

func TestTemplatesPoolsKeysNodes(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	admin := principal(t, s, s.AdminKey, service.KeySpace)
	user := principal(t, s, s.NewKey("default", false, service.KeySpace), service.KeySpace)
	list, err := s.Service.Templates(ctx(t), user, "")
	if err != nil || len(list) != 1 || list[0].Name != "base" {
		t.Fatalf("templates %+v %v", list, err)
	}
	detail, err := s.Service.Template(ctx(t), admin, "base", "")
	if err != nil || detail.Tags["latest"] != s.Base || len(detail.Releases) != 1 || len(detail.Releases[0].Nodes) != 1 {
		t.Fatalf("detail %+v %v", detail, err)
	}
	if d, err := s.Service.Template(ctx(t), user, "base", ""); err != nil || len(d.Releases[0].Nodes) != 0 {
		t.Fatalf("nodes shown to a member: %+v %v", d, err) // nodes are the operator's
	}
	if _, err := s.Service.Template(ctx(t), user, "nope", ""); !fault.Is(err, fault.NotFound) {
		t.Fatal(err)
	}
	if _, err := s.Service.DeleteTemplate(ctx(t), user, "base:latest", ""); !fault.Is(err, fault.Forbidden) {
		t.Fatal(err)
	}
	other := s.AddRelease("other", "v1", nil, map[string]string{"a": "b"})
	if d, err := s.Service.DeleteTemplate(ctx(t), admin, "other:v1", ""); err != nil || d.Digest != other {
		t.Fatalf("delete tag: %+v %v", d, err)
	}
	if d, err := s.Service.DeleteTemplate(ctx(t), admin, "other@"+other, ""); err != nil || len(d.Nodes) != 1 {
		t.Fatalf("delete release: %+v %v", d, err)
	}
	// No node published what it may build from: no node can build.
	if _, err := s.Service.BuildTemplate(ctx(t), admin, []byte("name: x\nfrom:\n  template: base\n")); err == nil {
		t.Fatal("build queued on a node that builds nothing")
	}
	if _, err := s.Service.BuildTemplate(ctx(t), admin, []byte(" ")); !fault.Is(err, fault.Invalid) {
		t.Fatal(err)
	}
	pool, err := s.Service.SetPool(ctx(t), admin, api.SetPoolRequest{Template: "base", Size: 1})
	if err != nil || pool.CPU != service.DefaultCPU || pool.MemoryMB != service.DefaultMemoryMB {
		t.Fatalf("pool %+v %v", pool, err)
	}
	if _, err := s.Service.SetPool(ctx(t), admin, api.SetPoolRequest{Template: "missing", Size: 1}); !fault.Is(err, fault.NotFound) {
		t.Fatal(err)
	}
	s.Eventually(time.Minute, "the pool to fill", func() bool {
		pools, err := s.Service.Pools(ctx(t), user, "")
		return err == nil && len(pools) == 1 && pools[0].Ready == 1
	})
	created, err := s.Service.Create(ctx(t), user, api.CreateSandboxRequest{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	s.WaitOp(created.Op.ID, api.OpSucceeded)
	if sb, _ := s.Service.Sandbox(ctx(t), user, created.Sandbox.ID); sb.StartPath != "pool" && sb.ClaimedAt == nil {
		t.Fatalf("not claimed from the pool: %+v", sb)
	}
	if _, err := s.Service.SetPool(ctx(t), admin, api.SetPoolRequest{Template: "base", Size: 0}); err != nil {
		t.Fatal(err)
	}
	key, err := s.Service.CreateAPIKey(ctx(t), admin, api.CreateAPIKeyRequest{Name: "ci", Tenant: "default"})
	if err != nil || key.Secret == "" {
		t.Fatalf("key %+v %v", key, err)
	}
	keys, err := s.Service.APIKeys(ctx(t), admin, "")
	if err != nil || len(keys) < 2 {
		t.Fatalf("keys %v %v", keys, err)
	}
	if _, err := s.Service.RevokeAPIKey(ctx(t), admin, key.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Service.Authenticate(ctx(t), key.Secret, service.KeySpace); !fault.Is(err, fault.Unauthorized) {
		t.Fatalf("revoked key: %v", err)
	}
	nodes, err := s.Service.Nodes(ctx(t), admin)
	if err != nil || len(nodes) != 1 || nodes[0].State != "alive" {
		t.Fatalf("nodes %+v %v", nodes, err)
	}
}
