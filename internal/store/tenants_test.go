package store_test

import (
	"database/sql"
	"log/slog"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/ids"
	"github.com/spacedev/space/internal/store"
	"github.com/spacedev/space/internal/testenv"
)

// TestTenantsAndUsage covers tenant rows, quotas, usage counting and removal.
func TestTenantsAndUsage(t *testing.T) {
	st, ctx := open(t)
	if _, err := st.CreateTenant(ctx, "acme"); err != nil {
		t.Fatal(err)
	}
	if _, err := st.CreateTenant(ctx, "acme"); !fault.Is(err, fault.Conflict) {
		t.Fatalf("second create: %v", err)
	}
	if _, err := st.GetTenant(ctx, "nosuch"); !fault.Is(err, fault.NotFound) || !strings.Contains(err.Error(), `tenant "nosuch" not found`) {
		t.Fatalf("missing tenant: %v", err)
	}
	tn, err := st.SetTenantQuota(ctx, "acme", store.Quota{store.QuotaRunning: 3, store.QuotaVCPUs: store.Unlimited}, nil)
	if err != nil || tn.Quota[store.QuotaRunning] != 3 || tn.Quota[store.QuotaVCPUs] != -1 || len(tn.Quota) != 2 {
		t.Fatalf("set quota: %+v %v", tn, err)
	}
	if tn, err = st.SetTenantQuota(ctx, "acme", nil, []string{store.QuotaVCPUs}); err != nil || len(tn.Quota) != 1 {
		t.Fatalf("reset quota: %+v %v", tn, err)
	}
	if _, err := st.SetTenantQuota(ctx, "acme", nil, []string{"nope"}); !fault.Is(err, fault.Invalid) {
		t.Fatalf("reset of an unknown quota: %v", err)
	}
	if _, err := st.SetTenantQuota(ctx, "nosuch", store.Quota{store.QuotaRunning: 1}, nil); !fault.Is(err, fault.NotFound) {
		t.Fatalf("quota of a missing tenant: %v", err)
	}
	list, err := st.ListTenants(ctx)
	if err != nil || len(list) != 2 || list[0].Name != "acme" || list[1].Name != "default" {
		t.Fatalf("tenants %v %v", list, err)
	}

	// Usage: running and paused sandboxes hold memory; suspended ones only disk (with
	// their memory snapshot); deleted ones nothing; pools reserve their size.
	spec := func(cpu, mem int) store.SandboxSpec { return store.SandboxSpec{CPU: cpu, MemoryMB: mem} }
	newSandbox(t, ctx, st, &store.Sandbox{Tenant: "acme", Spec: spec(2, 1024)})
	newSandbox(t, ctx, st, &store.Sandbox{Tenant: "acme", Spec: spec(1, 512), DesiredState: api.StatePaused})
	newSandbox(t, ctx, st, &store.Sandbox{Tenant: "acme", Spec: spec(4, 2048), DesiredState: api.StateSuspended, State: api.StateSuspended})
	big, _ := newSandbox(t, ctx, st, &store.Sandbox{Tenant: "acme", Spec: spec(1, 512), DesiredState: api.StateStopped})
	if err := st.SetDiskBytes(ctx, big.ID, 5000<<20); err != nil { // measured use above the estimate
		t.Fatal(err)
	}
	newSandbox(t, ctx, st, &store.Sandbox{Tenant: "acme", Spec: spec(8, 8192), DesiredState: api.StateDeleted})
	newSandbox(t, ctx, st, &store.Sandbox{Tenant: "default", Spec: spec(8, 8192)})
	if err := st.SetPool(ctx, store.Pool{Tenant: "acme", Template: "base:latest", CPU: 1, MemoryMB: 256, Size: 2}); err != nil {
		t.Fatal(err)
	}
	used, err := st.TenantUsage(ctx, "acme")
	if err != nil {
		t.Fatal(err)
	}
	want := store.Usage{
		store.QuotaRunning:    2 + 2,                                       // running, paused, 2 pool members
		store.QuotaVCPUs:      2 + 1 + 2,                                   //
		store.QuotaMemoryMB:   1024 + 512 + 512,                            //
		store.QuotaDiskMB:     1024 + 1024 + (1024 + 2048) + 5000 + 2*1024, // the deleted one: nothing
		store.QuotaOperations: 5,                                           // the creates, still open
	}
	for q, v := range want {
		if used[q] != v {
			t.Errorf("usage %s = %d, want %d", q, used[q], v)
		}
	}

	// A tenant with sandboxes or templates stays; without, it goes with its keys.
	if _, err := st.DeleteTenant(ctx, "acme"); !fault.Is(err, fault.Conflict) {
		t.Fatalf("delete of a tenant with sandboxes: %v", err)
	}
	if _, err := st.CreateTenant(ctx, "gone"); err != nil {
		t.Fatal(err)
	}
	secret, prefix, _ := store.NewKeySecret("space")
	k := &store.APIKey{ID: ids.APIKey(), Name: "k", Prefix: prefix, Kind: "space", Tenant: "gone", Role: store.RoleAdmin}
	if err := st.CreateAPIKey(ctx, k, secret); err != nil {
		t.Fatal(err)
	}
	if err := st.PutRelease(ctx, &store.Release{Digest: "sha256:" + strings.Repeat("9", 64), Name: "gt", Tenant: "gone"}, "latest", ""); err != nil {
		t.Fatal(err)
	}
	if _, err := st.DeleteTenant(ctx, "gone"); !fault.Is(err, fault.Conflict) || !strings.Contains(err.Error(), "templates") {
		t.Fatalf("delete of a tenant with a template: %v", err)
	}
	if _, err := st.DeleteTag(ctx, "gone", "gt", "latest"); err != nil {
		t.Fatal(err)
	}
	if _, err := st.DeleteRelease(ctx, "gone", "gt", "sha256:"+strings.Repeat("9", 64)); err != nil {
		t.Fatal(err)
	}
	if _, err := st.DeleteTenant(ctx, "gone"); err != nil {
		t.Fatal(err)
	}
	if _, err := st.LookupAPIKey(ctx, secret); !fault.Is(err, fault.NotFound) {
		t.Fatalf("the key of a removed tenant: %v", err)
	}
}

// TestTenantTemplates: a tenant's tags and releases are its own; shared ones are
// everybody's; a node's PutRelease gives a build's release to the tenant that queued
// it.
func TestTenantTemplates(t *testing.T) {
	st, ctx := open(t)
	registerNode(t, ctx, st, "n1")
	for _, tn := range []string{"t1", "t2"} {
		if _, err := st.CreateTenant(ctx, tn); err != nil {
			t.Fatal(err)
		}
	}
	d := func(c string) string { return "sha256:" + strings.Repeat(c, 64) }
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(st.PutRelease(ctx, &store.Release{Digest: d("1"), Name: "py"}, "latest", "n1"))               // shared
	must(st.PutRelease(ctx, &store.Release{Digest: d("2"), Name: "py", Tenant: "t1"}, "latest", "n1")) // t1's own py
	// A build t2 queued, running on n1: the node's PutRelease (no tenant) is t2's.
	build := &store.Operation{ID: ids.Operation(), Kind: api.OpTemplateBuild, Tenant: "t2", State: api.OpRunning,
		Params: map[string]any{"node": "n1", "template": "app:v1", "owner": "t2", "spec": map[string]any{"name": "app"}}}
	must(st.CreateOperation(ctx, build))
	must(st.PutRelease(ctx, &store.Release{Digest: d("3"), Name: "app"}, "v1", "n1"))
	// A build of the shared namespace (an operator's): no owner.
	shared := &store.Operation{ID: ids.Operation(), Kind: api.OpTemplateBuild, Tenant: "default", State: api.OpRunning,
		Params: map[string]any{"node": "n1", "template": "tool:latest", "owner": "", "spec": map[string]any{"name": "tool"}}}
	must(st.CreateOperation(ctx, shared))
	must(st.PutRelease(ctx, &store.Release{Digest: d("4"), Name: "tool"}, "latest", "n1"))

	for _, tc := range []struct {
		tenant, name, tag, digest, owner string
	}{
		{"", "py", "latest", d("1"), ""},
		{"t1", "py", "latest", d("2"), "t1"},
		{"t2", "py", "latest", d("1"), ""},
		{"t2", "app", "v1", d("3"), "t2"},
		{"t1", "app", "v1", "", ""},
		{"", "app", "v1", "", ""},
		{"t1", "tool", "latest", d("4"), ""},
	} {
		got, owner, err := st.ResolveTenantTag(ctx, tc.tenant, tc.name, tc.tag)
		if err != nil || got != tc.digest || owner != tc.owner {
			t.Errorf("resolve %s:%s for %q: %q %q %v, want %q %q", tc.name, tc.tag, tc.tenant, got, owner, err, tc.digest, tc.owner)
		}
	}
	if dg, _ := st.ResolveTag(ctx, "app", "v1"); dg != "" {
		t.Errorf("a tenant's tag resolves as a shared one: %s", dg)
	}
	names := func(tenant string, all bool) []string {
		rels, err := st.ListReleases(ctx, tenant, all)
		must(err)
		var out []string
		for _, r := range rels {
			out = append(out, r.Tenant+"/"+r.Name+":"+strings.Join(r.Tags, ","))
		}
		return out
	}
	if got := names("t1", false); !slices.Equal(got, []string{"/py:latest", "t1/py:latest", "/tool:latest"}) {
		t.Errorf("t1's templates %v", got)
	}
	if got := names("t2", false); !slices.Equal(got, []string{"t2/app:v1", "/py:latest", "/tool:latest"}) {
		t.Errorf("t2's templates %v", got)
	}
	if got := names("", true); len(got) != 4 {
		t.Errorf("every template %v", got)
	}
	for _, tc := range []struct {
		tenant, digest string
		ok             bool
	}{{"t1", d("2"), true}, {"t2", d("2"), false}, {"t2", d("1"), true}, {"", d("3"), false}, {"t2", d("3"), true}} {
		if ok, err := st.ReleaseVisible(ctx, tc.tenant, tc.digest); err != nil || ok != tc.ok {
			t.Errorf("release %s visible to %q: %v %v", tc.digest[:9], tc.tenant, ok, err)
		}
	}
	if owner, found, err := st.TemplateOwner(ctx, "t1", "py"); err != nil || !found || owner != "t1" {
		t.Errorf("owner of py for t1: %q %v %v", owner, found, err)
	}
	if _, found, _ := st.TemplateOwner(ctx, "t1", "app"); found {
		t.Error("t2's template is found for t1")
	}
	// Deleting: only the owner's.
	if _, err := st.DeleteRelease(ctx, "t1", "app", d("3")); !fault.Is(err, fault.NotFound) {
		t.Errorf("t1 deletes t2's release: %v", err)
	}
	if _, err := st.DeleteTag(ctx, "t1", "app", "v1"); !fault.Is(err, fault.NotFound) {
		t.Errorf("t1 deletes t2's tag: %v", err)
	}
	if _, err := st.DeleteRelease(ctx, "t2", "app", d("3")); err != nil {
		t.Errorf("t2 deletes its release: %v", err)
	}
	// Pools resolve in their tenant.
	if dg, err := st.ResolvePoolTag(ctx, store.Pool{Tenant: "t1", Template: "py:latest"}); err != nil || dg != d("2") {
		t.Errorf("t1's pool of py: %q %v", dg, err)
	}
}

// TestMigrateTenancy: a database of the version before tenants were a resource keeps
// its data: every tenant it names exists, admin keys become operators, templates stay
// shared, pools go to "default".
func TestMigrateTenancy(t *testing.T) {
	url := testenv.Postgres(t)
	db, err := sql.Open("pgx", url)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	_ = stdlib.GetDefaultDriver()
	p, err := goose.NewProvider(goose.DialectPostgres, db, os.DirFS("migrations"))
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	if _, err := p.UpTo(ctx, 4); err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{
		`INSERT INTO api_keys (id, name, prefix, hash, kind, tenant, admin) VALUES ('key_admin','admin','space_a','\x01','space','default',true)`,
		`INSERT INTO api_keys (id, name, prefix, hash, kind, tenant, admin) VALUES ('key_user','user','space_b','\x02','space','team',false)`,
		`INSERT INTO sandboxes (id, tenant, template_ref, spec, desired_state, state) VALUES ('sbold','other','base:latest','{"cpu":1,"memory_mb":512}','running','running')`,
		`INSERT INTO template_releases (digest, name) VALUES ('sha256:1','py')`,
		`INSERT INTO template_tags (name, tag, digest) VALUES ('py','latest','sha256:1')`,
		`INSERT INTO pools (template, cpu, memory_mb, size) VALUES ('py:latest', 1, 512, 2)`,
	} {
		if _, err := db.ExecContext(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	st, err := store.Open(ctx, store.Config{URL: url, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	tenants, err := st.ListTenants(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, tn := range tenants {
		names = append(names, tn.Name)
	}
	if !slices.Equal(names, []string{"default", "other", "team"}) {
		t.Fatalf("tenants after the migration %v", names)
	}
	for id, role := range map[string]string{"key_admin": store.RoleOperator, "key_user": store.RoleMember} {
		if k, err := st.GetAPIKey(ctx, id); err != nil || k.Role != role {
			t.Errorf("key %s: %+v %v", id, k, err)
		}
	}
	if n, err := st.CountOperatorKeys(ctx); err != nil || n != 1 {
		t.Errorf("operators %d %v", n, err)
	}
	if dg, err := st.ResolveTag(ctx, "py", "latest"); err != nil || dg != "sha256:1" {
		t.Errorf("shared tag after the migration: %q %v", dg, err)
	}
	if pools, err := st.ListPools(ctx); err != nil || len(pools) != 1 || pools[0].Tenant != "default" {
		t.Errorf("pools after the migration %+v %v", pools, err)
	}
	if sb, err := st.GetSandbox(ctx, "sbold"); err != nil || sb.Tenant != "other" || sb.AccessEpoch != 1 {
		t.Errorf("sandbox after the migration %+v %v", sb, err)
	}
}
