package store_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/ids"
	"github.com/spacedev/space/internal/lifecycle"
	"github.com/spacedev/space/internal/rest"
	"github.com/spacedev/space/internal/store"
	"github.com/spacedev/space/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

// open returns a store on a fresh, migrated database and a context for the test.
func open(t *testing.T) (*store.Store, context.Context) {
	t.Helper()
	st, ctx, _ := openURL(t)
	return st, ctx
}

// openURL is open that also returns the database's URL.
func openURL(t *testing.T) (*store.Store, context.Context, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	url := testenv.Postgres(t)
	st, err := store.Open(ctx, store.Config{URL: url, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatalf("open store: %v", err)
	}
	t.Cleanup(st.Close)
	return st, ctx, url
}

// exec runs raw SQL for setups the store offers no query for (back-dating rows).
func exec(t *testing.T, st *store.Store, sql string, args ...any) {
	t.Helper()
	db := st.DB()
	defer db.Close()
	if _, err := db.Exec(sql, args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

func registerNode(t *testing.T, ctx context.Context, st *store.Store, id string) *store.Node {
	t.Helper()
	n := &store.Node{ID: id, Name: "name-" + id, Runtime: "fake", DataPlaneURL: "http://" + id,
		RuntimeInfo: map[string]any{"version": "1"}}
	if err := st.RegisterNode(ctx, n); err != nil {
		t.Fatal(err)
	}
	return n
}

// newSandbox creates a sandbox row (with its create operation) from sb's fields.
func newSandbox(t *testing.T, ctx context.Context, st *store.Store, sb *store.Sandbox) (*store.Sandbox, *store.Operation) {
	t.Helper()
	if sb.ID == "" {
		sb.ID = ids.Sandbox()
	}
	if sb.Tenant == "" {
		sb.Tenant = "default"
	}
	if sb.TemplateRef == "" {
		sb.TemplateRef = "base:latest"
	}
	if sb.DesiredState == "" {
		sb.DesiredState = api.StateRunning
	}
	if sb.State == "" {
		sb.State = api.StatePending
	}
	if sb.Spec.CPU == 0 {
		sb.Spec = store.SandboxSpec{CPU: 1, MemoryMB: 512, Env: map[string]string{"A": "b"}}
	}
	op := &store.Operation{ID: ids.Operation(), Kind: api.OpCreate, Tenant: sb.Tenant}
	if err := st.InTx(ctx, func(tx *store.Tx) error { return tx.CreateSandbox(ctx, sb, op) }); err != nil {
		t.Fatalf("create sandbox: %v", err)
	}
	return sb, op
}

func get(t *testing.T, ctx context.Context, st *store.Store, id string) *store.Sandbox {
	t.Helper()
	sb, err := st.GetSandbox(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	return sb
}

func setDesired(t *testing.T, ctx context.Context, st *store.Store, id, desired, reason, kind string) (*store.Sandbox, *store.Operation) {
	t.Helper()
	var sb *store.Sandbox
	op := &store.Operation{ID: ids.Operation(), Kind: kind}
	err := st.InTx(ctx, func(tx *store.Tx) error {
		var err error
		if sb, err = tx.GetSandboxForUpdate(ctx, id); err != nil {
			return err
		}
		return tx.SetDesiredState(ctx, sb, desired, reason, op)
	})
	if err != nil {
		t.Fatalf("set desired state %s: %v", desired, err)
	}
	return sb, op
}

func sandboxIDs(list []*store.Sandbox) []string {
	out := make([]string, 0, len(list))
	for _, sb := range list {
		out = append(out, sb.ID)
	}
	slices.Sort(out)
	return out
}

func sorted(s ...string) []string {
	s = slices.Clone(s)
	slices.Sort(s)
	return s
}

func TestOpenPingAndMigrateTwice(t *testing.T) {
	st, ctx, url := openURL(t)
	if err := st.Ping(ctx); err != nil {
		t.Fatal(err)
	}
	// A second replica on the same database finds nothing left to migrate.
	again, err := store.Open(ctx, store.Config{URL: url, MaxConns: 2, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatalf("second open: %v", err)
	}
	again.Close()
	if _, err := store.Open(ctx, store.Config{URL: "postgres://%zz", Logger: slog.New(slog.DiscardHandler)}); err == nil ||
		!strings.Contains(err.Error(), "parse database url") {
		t.Fatalf("bad url: %v", err)
	}
	conn, err := st.Connect(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var n int
	if err := conn.QueryRow(ctx, `SELECT count(*) FROM api_keys`).Scan(&n); err != nil || n != 0 {
		t.Fatalf("dedicated connection: %d %v", n, err)
	}
	conn.Close(ctx)
	// A failing transaction leaves nothing behind.
	boom := errors.New("boom")
	err = st.InTx(ctx, func(tx *store.Tx) error {
		if err := tx.InsertOperation(ctx, &store.Operation{ID: ids.Operation(), Kind: api.OpCreate}); err != nil {
			return err
		}
		return boom
	})
	if !errors.Is(err, boom) {
		t.Fatalf("tx error %v", err)
	}
	if ops, err := st.OpenOperationsOfKind(ctx, api.OpCreate); err != nil || len(ops) != 0 {
		t.Fatalf("rolled back operation visible: %v %v", ops, err)
	}
}

func TestAPIKeys(t *testing.T) {
	st, ctx := open(t)
	secret, prefix, err := store.NewKeySecret("space")
	if err != nil {
		t.Fatal(err)
	}
	if !regexp.MustCompile(`^space_[a-z2-7]{40}$`).MatchString(secret) || prefix != secret[:12] {
		t.Fatalf("space secret %q prefix %q", secret, prefix)
	}
	e2bSecret, e2bPrefix, err := store.NewKeySecret("e2b")
	if err != nil {
		t.Fatal(err)
	}
	if !regexp.MustCompile(`^e2b_[0-9a-f]{40}$`).MatchString(e2bSecret) || e2bPrefix != e2bSecret[:10] {
		t.Fatalf("e2b secret %q prefix %q", e2bSecret, e2bPrefix)
	}
	// A key's tenant must exist.
	if err := st.CreateAPIKey(ctx, &store.APIKey{ID: ids.APIKey(), Name: "x", Prefix: "x", Kind: "space", Tenant: "t1"}, "s"); !fault.Is(err, fault.NotFound) ||
		!strings.Contains(err.Error(), `tenant "t1" not found`) {
		t.Fatalf("key of a missing tenant: %v", err)
	}
	for _, tn := range []string{"t1", "t2"} {
		if _, err := st.CreateTenant(ctx, tn); err != nil {
			t.Fatal(err)
		}
	}
	admin := &store.APIKey{ID: ids.APIKey(), Name: "admin", Prefix: prefix, Kind: "space", Tenant: "t1", Role: store.RoleOperator}
	if err := st.CreateAPIKey(ctx, admin, secret); err != nil {
		t.Fatal(err)
	}
	if admin.CreatedAt.IsZero() || admin.RevokedAt != nil || admin.Role != store.RoleOperator {
		t.Fatalf("created key %+v", admin)
	}
	user := &store.APIKey{ID: ids.APIKey(), Name: "user", Prefix: e2bPrefix, Kind: "e2b", Tenant: "t2"}
	if err := st.CreateAPIKey(ctx, user, e2bSecret); err != nil || user.Role != store.RoleMember {
		t.Fatal(user.Role, err)
	}
	// The same secret twice is refused (its hash is unique).
	if err := st.CreateAPIKey(ctx, &store.APIKey{ID: ids.APIKey(), Name: "dup", Prefix: "x", Kind: "space", Tenant: "t1"}, secret); err == nil {
		t.Fatal("duplicate secret accepted")
	}

	got, err := st.LookupAPIKey(ctx, secret)
	if err != nil || got.ID != admin.ID || got.Role != store.RoleOperator || got.Tenant != "t1" || got.Kind != "space" {
		t.Fatalf("lookup: %+v %v", got, err)
	}
	if got.API().Prefix != prefix || got.API().ID != admin.ID {
		t.Fatalf("wire form %+v", got.API())
	}
	if _, err := st.LookupAPIKey(ctx, secret+"x"); !fault.Is(err, fault.NotFound) {
		t.Fatalf("unknown secret: %v", err)
	}
	list, err := st.ListAPIKeys(ctx, "")
	if err != nil || len(list) != 2 {
		t.Fatalf("list: %v %v", list, err)
	}
	if t2, err := st.ListAPIKeys(ctx, "t2"); err != nil || len(t2) != 1 || t2[0].ID != user.ID {
		t.Fatalf("list of t2: %v %v", t2, err)
	}
	if !list[0].CreatedAt.After(list[1].CreatedAt) && !list[0].CreatedAt.Equal(list[1].CreatedAt) {
		t.Fatalf("list not newest first: %v, %v", list[0].CreatedAt, list[1].CreatedAt)
	}
	if n, err := st.CountOperatorKeys(ctx); err != nil || n != 1 {
		t.Fatalf("operators %d %v", n, err)
	}

	// A prefix names no key: revoking by one revokes nothing.
	if _, err := st.RevokeAPIKey(ctx, prefix); !fault.Is(err, fault.NotFound) {
		t.Fatalf("revoke by prefix: %v", err)
	}
	if live, err := st.KeyLive(ctx, admin.ID); err != nil || !live {
		t.Fatalf("key after a revoke by prefix: %v %v", live, err)
	}
	// Revoke by id: the key stops working; revoking again keeps the first time.
	rev, err := st.RevokeAPIKey(ctx, admin.ID)
	if err != nil || rev.ID != admin.ID || rev.RevokedAt == nil {
		t.Fatalf("revoke: %+v %v", rev, err)
	}
	if live, err := st.KeyLive(ctx, admin.ID); err != nil || live {
		t.Fatalf("revoked key live: %v %v", live, err)
	}
	if gone, err := st.RevokedKeys(ctx, []string{admin.ID, user.ID, "key_nosuch"}); err != nil || !slices.Equal(gone, []string{admin.ID, "key_nosuch"}) {
		t.Fatalf("revoked keys %v %v", gone, err)
	}
	if _, err := st.LookupAPIKey(ctx, secret); !fault.Is(err, fault.NotFound) {
		t.Fatalf("revoked key still found: %v", err)
	}
	again, err := st.RevokeAPIKey(ctx, admin.ID)
	if err != nil || !again.RevokedAt.Equal(*rev.RevokedAt) {
		t.Fatalf("second revoke moved revoked_at: %v -> %v (%v)", rev.RevokedAt, again.RevokedAt, err)
	}
	if n, err := st.CountOperatorKeys(ctx); err != nil || n != 0 {
		t.Fatalf("operators after revoke %d %v", n, err)
	}
	if rev, err := st.RevokeAPIKey(ctx, user.ID); err != nil || rev.RevokedAt == nil || rev.Kind != "e2b" {
		t.Fatalf("revoke by id: %+v %v", rev, err)
	}
	if _, err := st.LookupAPIKey(ctx, e2bSecret); !fault.Is(err, fault.NotFound) {
		t.Fatalf("revoked e2b key still found: %v", err)
	}
	if _, err := st.RevokeAPIKey(ctx, "key_nosuch"); !fault.Is(err, fault.NotFound) || !strings.Contains(err.Error(), "key_nosuch") {
		t.Fatalf("revoke unknown: %v", err)
	}
}

func TestSigningKey(t *testing.T) {
	st, ctx := open(t)
	a, err := st.SigningKey(ctx, "attach-v1")
	if err != nil || len(a) != 32 {
		t.Fatalf("key %x %v", a, err)
	}
	again, err := st.SigningKey(ctx, "attach-v1")
	if err != nil || string(again) != string(a) {
		t.Fatalf("second read differs: %x vs %x (%v)", again, a, err)
	}
	other, err := st.SigningKey(ctx, "other")
	if err != nil || string(other) == string(a) {
		t.Fatalf("other key %x %v", other, err)
	}
	// Concurrent first uses all get the one key that was stored.
	var wg sync.WaitGroup
	got := make([][]byte, 8)
	for i := range got {
		wg.Add(1)
		go func() {
			defer wg.Done()
			got[i], _ = st.SigningKey(ctx, "race")
		}()
	}
	wg.Wait()
	for _, k := range got {
		if len(k) != 32 || string(k) != string(got[0]) {
			t.Fatalf("concurrent first use: %x vs %x", k, got[0])
		}
	}
}

func TestNodes(t *testing.T) {
	st, ctx := open(t)
	n := registerNode(t, ctx, st, "n1")
	if n.Epoch != 1 || n.State != store.NodeAlive || n.StartedAt.IsZero() {
		t.Fatalf("registered %+v", n)
	}
	first := n.Epoch
	// A restart (a new incarnation) bumps the epoch and fences the old one.
	n2 := registerNode(t, ctx, st, "n1")
	if n2.Epoch != first+1 {
		t.Fatalf("epoch after re-register %d", n2.Epoch)
	}
	err := st.Heartbeat(ctx, "n1", first, "")
	if !errors.Is(err, store.ErrFenced) {
		t.Fatalf("stale heartbeat: %v", err)
	}
	if err := st.Heartbeat(ctx, "nosuch", 1, ""); !errors.Is(err, store.ErrFenced) {
		t.Fatalf("unknown node heartbeat: %v", err)
	}
	if err := st.Heartbeat(ctx, "n1", n2.Epoch, ""); err != nil {
		t.Fatal(err)
	}
	registerNode(t, ctx, st, "n2")
	newSandbox(t, ctx, st, &store.Sandbox{NodeID: "n1"})
	gone, _ := newSandbox(t, ctx, st, &store.Sandbox{NodeID: "n1"})
	if _, err := st.ReportObserved(ctx, gone.ID, "n1", store.Observed{State: api.StateDeleted, Deleted: true}); err != nil {
		t.Fatal(err)
	}

	got, err := st.GetNode(ctx, "n1")
	if err != nil || got.Epoch != n2.Epoch || got.RuntimeInfo["version"] != "1" || got.Sandboxes != 1 || got.DataPlaneURL != "http://n1" {
		t.Fatalf("get node: %+v %v", got, err)
	}
	if _, err := st.GetNode(ctx, "nosuch"); !fault.Is(err, fault.NotFound) {
		t.Fatalf("unknown node: %v", err)
	}
	list, err := st.ListNodes(ctx)
	if err != nil || len(list) != 2 || list[0].ID != "n1" || list[1].ID != "n2" || list[1].Sandboxes != 0 {
		t.Fatalf("list nodes: %+v %v", list, err)
	}

	// Nothing is dead yet; with a cut-off in the future both are.
	if dead, err := st.MarkDeadNodes(ctx, time.Now().Add(-time.Hour)); err != nil || len(dead) != 0 {
		t.Fatalf("dead before: %v %v", dead, err)
	}
	dead, err := st.MarkDeadNodes(ctx, time.Now().Add(time.Hour))
	if err != nil || len(dead) != 2 || !slices.Equal(sorted(dead[0].ID, dead[1].ID), []string{"n1", "n2"}) {
		t.Fatalf("dead: %v %v", dead, err)
	}
	if got, _ := st.GetNode(ctx, "n2"); got.State != store.NodeDead {
		t.Fatalf("state after mark dead: %s", got.State)
	}
	// Already dead nodes are not reported again.
	if dead, err := st.MarkDeadNodes(ctx, time.Now().Add(time.Hour)); err != nil || len(dead) != 0 {
		t.Fatalf("dead again: %v %v", dead, err)
	}
	// Marking a node dead fences it: the incarnation that stopped heartbeating cannot
	// come back by heartbeating; a new one registers (a restart) and is alive.
	if err := st.Heartbeat(ctx, "n1", n2.Epoch, ""); !errors.Is(err, store.ErrFenced) {
		t.Fatalf("heartbeat of a dead node's old incarnation: %v", err)
	}
	if back := registerNode(t, ctx, st, "n1"); !strings.Contains(back.DeadReason, "stopped sending heartbeats") {
		t.Fatalf("a returning node is not told it was dead: %+v", back)
	}
	if got, _ := st.GetNode(ctx, "n1"); got.State != store.NodeAlive || got.DeadReason != "" {
		t.Fatalf("state after re-registering: %s %q", got.State, got.DeadReason)
	}
}

func TestReleasesTagsAndGC(t *testing.T) {
	st, ctx := open(t)
	registerNode(t, ctx, st, "n1")
	registerNode(t, ctx, st, "n2")
	r1 := &store.Release{Digest: "sha256:111", Name: "py", Config: []byte(`{"user":"u"}`), SizeBytes: 10}
	if err := st.PutRelease(ctx, r1, "latest", "n1"); err != nil {
		t.Fatal(err)
	}
	// The same release arriving on a second node: no tag, one more holder.
	if err := st.PutRelease(ctx, &store.Release{Digest: "sha256:111", Name: "py"}, "", "n2"); err != nil {
		t.Fatal(err)
	}
	if d, err := st.ResolveTag(ctx, "py", "latest"); err != nil || d != "sha256:111" {
		t.Fatalf("resolve: %q %v", d, err)
	}
	if d, err := st.ResolveTag(ctx, "py", "nope"); err != nil || d != "" {
		t.Fatalf("resolve missing: %q %v", d, err)
	}
	rel, err := st.GetRelease(ctx, "sha256:111")
	if err != nil || rel.Name != "py" || rel.SizeBytes != 10 || string(rel.Config) != `{"user": "u"}` {
		t.Fatalf("get release %+v %v", rel, err)
	}
	if _, err := st.GetRelease(ctx, "sha256:none"); !fault.Is(err, fault.NotFound) {
		t.Fatalf("unknown release: %v", err)
	}
	for node, want := range map[string]bool{"n1": true, "n2": true, "n3": false} {
		if ok, err := st.NodeHasRelease(ctx, node, "sha256:111"); err != nil || ok != want {
			t.Fatalf("node %s has release: %v %v", node, ok, err)
		}
	}

	// A second release takes latest; the first keeps tag "old". No config means {}.
	r2 := &store.Release{Digest: "sha256:222", Name: "py"}
	if err := st.PutRelease(ctx, r2, "latest", "n1"); err != nil {
		t.Fatal(err)
	}
	if err := st.PutRelease(ctx, r1, "old", ""); err != nil {
		t.Fatal(err)
	}
	if d, _ := st.ResolveTag(ctx, "py", "latest"); d != "sha256:222" {
		t.Fatalf("latest moved to %q", d)
	}
	if err := st.PutRelease(ctx, &store.Release{Digest: "sha256:333", Name: "other"}, "v1", ""); err != nil {
		t.Fatal(err)
	}
	all, err := st.ListReleases(ctx, "", true)
	if err != nil || len(all) != 3 {
		t.Fatalf("list releases %v %v", all, err)
	}
	tags := map[string][]string{}
	for _, r := range all {
		tags[r.Digest] = r.Tags
	}
	if !slices.Equal(tags["sha256:111"], []string{"old"}) || !slices.Equal(tags["sha256:222"], []string{"latest"}) {
		t.Fatalf("tags %v", tags)
	}
	rels, nodes, err := st.TemplateReleases(ctx, "", "py")
	if err != nil || len(rels) != 2 || !slices.Equal(nodes["sha256:111"], []string{"n1", "n2"}) || !slices.Equal(nodes["sha256:222"], []string{"n1"}) {
		t.Fatalf("template releases %v %v %v", rels, nodes, err)
	}
	if rels[0].Digest != "sha256:222" || string(rels[0].Config) != "{}" || !slices.Equal(rels[1].Tags, []string{"old"}) {
		t.Fatalf("template releases newest first, no config stored as {}: %+v %+v", rels[0], rels[1])
	}

	// Deleting a tag returns what it pointed at, once.
	if d, err := st.DeleteTag(ctx, "", "other", "v1"); err != nil || d != "sha256:333" {
		t.Fatalf("delete tag: %q %v", d, err)
	}
	if _, err := st.DeleteTag(ctx, "", "other", "v1"); !fault.Is(err, fault.NotFound) {
		t.Fatalf("delete tag twice: %v", err)
	}

	// Deleting a release: refused under the wrong name, while a sandbox uses it (by
	// digest, or waiting for it by tag), and while a build starts from it.
	if _, err := st.DeleteRelease(ctx, "", "other", "sha256:111"); !fault.Is(err, fault.NotFound) {
		t.Fatalf("delete under wrong name: %v", err)
	}
	if _, err := st.DeleteRelease(ctx, "", "py", "sha256:none"); !fault.Is(err, fault.NotFound) {
		t.Fatalf("delete unknown: %v", err)
	}
	user, _ := newSandbox(t, ctx, st, &store.Sandbox{TemplateRef: "py:old", TemplateDigest: "sha256:111"})
	if _, err := st.DeleteRelease(ctx, "", "py", "sha256:111"); !fault.Is(err, fault.Conflict) || !strings.Contains(err.Error(), user.ID) {
		t.Fatalf("delete in use: %v", err)
	}
	exec(t, st, `UPDATE sandboxes SET template_digest=NULL WHERE id=$1`, user.ID)
	if _, err := st.DeleteRelease(ctx, "", "py", "sha256:111"); !fault.Is(err, fault.Conflict) {
		t.Fatalf("delete while a pending sandbox waits for its tag: %v", err)
	}
	exec(t, st, `UPDATE sandboxes SET deleted_at=now() WHERE id=$1`, user.ID)
	build := &store.Operation{ID: ids.Operation(), Kind: api.OpTemplateBuild, Params: map[string]any{"node": "n1", "from_digest": "sha256:111"}}
	if err := st.CreateBuildOperation(ctx, build, "n1"); err != nil {
		t.Fatal(err)
	}
	if _, err := st.DeleteRelease(ctx, "", "py", "sha256:111"); !fault.Is(err, fault.Conflict) || !strings.Contains(err.Error(), build.ID) {
		t.Fatalf("delete while a build starts from it: %v", err)
	}
	if err := st.UpdateOperation(ctx, build.ID, api.OpFailed, "failed", "x"); err != nil {
		t.Fatal(err)
	}
	holders, err := st.DeleteRelease(ctx, "", "py", "sha256:111")
	if err != nil || !slices.Equal(holders, []string{"n1", "n2"}) {
		t.Fatalf("delete release: %v %v", holders, err)
	}
	if _, err := st.GetRelease(ctx, "sha256:111"); !fault.Is(err, fault.NotFound) {
		t.Fatalf("deleted release still there: %v", err)
	}
	if d, _ := st.ResolveTag(ctx, "py", "old"); d != "" {
		t.Fatalf("tag of deleted release still resolves to %q", d)
	}
	for _, n := range []string{"n1", "n2"} {
		if gc, err := st.PendingReleaseGC(ctx, n); err != nil || !slices.Equal(gc, []string{"sha256:111"}) {
			t.Fatalf("gc of %s: %v %v", n, gc, err)
		}
	}
	if err := st.ReleaseGCDone(ctx, "n1", "sha256:111"); err != nil {
		t.Fatal(err)
	}
	if gc, _ := st.PendingReleaseGC(ctx, "n1"); len(gc) != 0 {
		t.Fatalf("gc after done: %v", gc)
	}
	if gc, _ := st.PendingReleaseGC(ctx, "n2"); len(gc) != 1 {
		t.Fatalf("other node's gc gone: %v", gc)
	}

	// Template sources per node.
	if err := st.SetNodeTemplateSources(ctx, "n1", []string{"docker", "dir"}); err != nil {
		t.Fatal(err)
	}
	if err := st.SetNodeTemplateSources(ctx, "n2", nil); err != nil {
		t.Fatal(err)
	}
	if err := st.SetNodeTemplateSources(ctx, "n1", []string{"dir"}); err != nil {
		t.Fatal(err)
	}
	src, err := st.NodeTemplateSources(ctx)
	if err != nil || !slices.Equal(src["n1"], []string{"dir"}) || src["n2"] == nil || len(src["n2"]) != 0 {
		t.Fatalf("sources %v %v", src, err)
	}
	if err := st.SetNodeTemplateSources(ctx, "nosuch", nil); err == nil {
		t.Fatal("sources of an unknown node accepted")
	}
}

func TestBuildQueue(t *testing.T) {
	st, ctx := open(t)
	registerNode(t, ctx, st, "n1")
	var ops []*store.Operation
	for range 2 {
		op := &store.Operation{ID: ids.Operation(), Kind: api.OpTemplateBuild, Tenant: "t", Message: "queued",
			Params: map[string]any{"node": "n1", "name": "py"}}
		if err := st.CreateBuildOperation(ctx, op, "n1"); err != nil {
			t.Fatal(err)
		}
		if op.State != api.OpPending || op.CreatedAt.IsZero() || op.Params["name"] != "py" {
			t.Fatalf("created %+v", op)
		}
		ops = append(ops, op)
	}
	q, err := st.QueuedBuilds(ctx, "n1")
	if err != nil || len(q) != 2 || q[0].ID != ops[0].ID {
		t.Fatalf("queued: %v %v", q, err)
	}
	if q, _ := st.QueuedBuilds(ctx, "n2"); len(q) != 0 {
		t.Fatalf("another node's queue: %v", q)
	}
	if c, err := st.OpenBuildCounts(ctx); err != nil || c["n1"] != 2 || len(c) != 1 {
		t.Fatalf("open counts %v %v", c, err)
	}
	ok, err := st.ClaimBuild(ctx, ops[0].ID, "building")
	if err != nil || !ok {
		t.Fatalf("claim: %v %v", ok, err)
	}
	if ok, err := st.ClaimBuild(ctx, ops[0].ID, "building"); err != nil || ok {
		t.Fatalf("second claim: %v %v", ok, err)
	}
	if got, _ := st.GetOperation(ctx, ops[0].ID); got.State != api.OpRunning || got.Message != "building" {
		t.Fatalf("claimed op %+v", got)
	}
	if q, _ := st.QueuedBuilds(ctx, "n1"); len(q) != 1 || q[0].ID != ops[1].ID {
		t.Fatalf("queued after claim: %v", q)
	}
	if c, _ := st.OpenBuildCounts(ctx); c["n1"] != 2 {
		t.Fatalf("a running build is still open: %v", c)
	}
	if open, err := st.OpenOperationsOfKind(ctx, api.OpTemplateBuild); err != nil || len(open) != 2 {
		t.Fatalf("open builds %v %v", open, err)
	}
	if err := st.UpdateOperation(ctx, ops[0].ID, api.OpSucceeded, "done", ""); err != nil {
		t.Fatal(err)
	}
	if err := st.UpdateOperation(ctx, ops[1].ID, api.OpFailed, "failed", "no"); err != nil {
		t.Fatal(err)
	}
	if c, _ := st.OpenBuildCounts(ctx); len(c) != 0 {
		t.Fatalf("counts after finishing: %v", c)
	}
	// A failed build can no longer be claimed.
	if ok, _ := st.ClaimBuild(ctx, ops[1].ID, "building"); ok {
		t.Fatal("claimed a failed build")
	}
}

func TestSandboxRows(t *testing.T) {
	st, ctx := open(t)
	registerNode(t, ctx, st, "n1")
	registerNode(t, ctx, st, "n2")
	exp := time.Now().Add(time.Hour).Truncate(time.Microsecond)
	a, op := newSandbox(t, ctx, st, &store.Sandbox{Tenant: "t1", Metadata: map[string]string{"owner": "alice", "team": "x"},
		IdleTimeout: 90 * time.Second, ExpiresAt: &exp})
	if a.Generation != 1 || a.TokenEpoch != 1 || a.ExpireAction != "delete" || a.IdleTimeout != 90*time.Second ||
		a.Spec.Env["A"] != "b" || a.Metadata["owner"] != "alice" || !a.ExpiresAt.Equal(exp) {
		t.Fatalf("created %+v", a)
	}
	if op.SandboxID != a.ID || op.TargetGeneration != 1 || op.State != api.OpPending {
		t.Fatalf("create op %+v", op)
	}
	if wire := a.API(); wire.ID != a.ID || wire.CPU != 1 || wire.IdleTimeout != "1m30s" || wire.Metadata["team"] != "x" {
		t.Fatalf("wire form %+v", wire)
	}
	if lc := a.Lifecycle(); lc.ID != a.ID || lc.Generation != 1 || lc.Deleted {
		t.Fatalf("lifecycle view %+v", lc)
	}
	// Defaults: idle timeout 0 means the default, negative never; nil metadata is {}.
	b, _ := newSandbox(t, ctx, st, &store.Sandbox{Tenant: "t1", NodeID: "n1", State: api.StateRunning, ExpireAction: "suspend"})
	if b.IdleTimeout != store.DefaultIdleTimeout || b.Metadata == nil || len(b.Metadata) != 0 || b.NodeID != "n1" {
		t.Fatalf("defaults %+v", b)
	}
	c, _ := newSandbox(t, ctx, st, &store.Sandbox{Tenant: "t2", IdleTimeout: -1, Metadata: map[string]string{"owner": "alice"}})
	if c.IdleTimeout != 0 {
		t.Fatalf("never idle: %v", c.IdleTimeout)
	}
	pool, _ := newSandbox(t, ctx, st, &store.Sandbox{PoolKey: "base/1cpu/512mb", State: api.StatePaused, DesiredState: api.StatePaused})
	dup := &store.Sandbox{ID: a.ID, Tenant: "t1", TemplateRef: "x", DesiredState: "running", State: "pending"}
	if err := st.InTx(ctx, func(tx *store.Tx) error {
		return tx.CreateSandbox(ctx, dup, &store.Operation{ID: ids.Operation(), Kind: api.OpCreate})
	}); err == nil {
		t.Fatal("duplicate sandbox id accepted")
	}
	if _, err := st.GetSandbox(ctx, "nosuch"); !fault.Is(err, fault.NotFound) {
		t.Fatalf("unknown sandbox: %v", err)
	}

	// Filters.
	for name, tc := range map[string]struct {
		f    store.SandboxFilter
		want []string
	}{
		"all":              {store.SandboxFilter{}, sorted(a.ID, b.ID, c.ID)},
		"with pool":        {store.SandboxFilter{IncludePool: true}, sorted(a.ID, b.ID, c.ID, pool.ID)},
		"tenant":           {store.SandboxFilter{Tenant: "t1"}, sorted(a.ID, b.ID)},
		"state":            {store.SandboxFilter{States: []string{api.StateRunning}}, []string{b.ID}},
		"states":           {store.SandboxFilter{States: []string{api.StateRunning, api.StatePending}}, sorted(a.ID, b.ID, c.ID)},
		"metadata":         {store.SandboxFilter{Metadata: map[string]string{"owner": "alice"}}, sorted(a.ID, c.ID)},
		"metadata two":     {store.SandboxFilter{Metadata: map[string]string{"owner": "alice", "team": "x"}}, []string{a.ID}},
		"metadata none":    {store.SandboxFilter{Metadata: map[string]string{"owner": "bob"}}, []string{}},
		"tenant+metadata":  {store.SandboxFilter{Tenant: "t2", Metadata: map[string]string{"owner": "alice"}}, []string{c.ID}},
		"node":             {store.SandboxFilter{NodeID: "n1"}, []string{b.ID}},
		"other tenant":     {store.SandboxFilter{Tenant: "t3"}, []string{}},
		"limit":            {store.SandboxFilter{Limit: 1}, []string{c.ID}},
		"pending filtered": {store.SandboxFilter{States: []string{api.StatePending}, Tenant: "t1"}, []string{a.ID}},
	} {
		got, err := st.ListSandboxes(ctx, tc.f)
		if err != nil || !slices.Equal(sandboxIDs(got), tc.want) {
			t.Errorf("%s: %v %v, want %v", name, sandboxIDs(got), err, tc.want)
		}
	}
	if counts, err := st.CountSandboxesByState(ctx); err != nil || counts[api.StatePending] != 2 || counts[api.StateRunning] != 1 || counts[api.StatePaused] != 1 {
		t.Fatalf("counts %v %v", counts, err)
	}
	if pend, err := st.PendingSandboxes(ctx, 10); err != nil || !slices.Equal(sandboxIDs(pend), sorted(a.ID, c.ID, pool.ID)) {
		t.Fatalf("pending %v %v", sandboxIDs(pend), err)
	}
	if pend, _ := st.PendingSandboxes(ctx, 1); len(pend) != 1 || pend[0].ID != a.ID {
		t.Fatalf("pending oldest first: %v", sandboxIDs(pend))
	}

	// Assign once.
	if ok, err := st.AssignNode(ctx, a.ID, "n2", "fake"); err != nil || !ok {
		t.Fatalf("assign: %v %v", ok, err)
	}
	if ok, err := st.AssignNode(ctx, a.ID, "n1", "fake"); err != nil || ok {
		t.Fatalf("second assign: %v %v", ok, err)
	}
	if got := get(t, ctx, st, a.ID); got.NodeID != "n2" || got.Runtime != "fake" {
		t.Fatalf("assigned %+v", got)
	}
	if epoch, node, err := st.TokenEpoch(ctx, a.ID); err != nil || epoch != 1 || node != "n2" {
		t.Fatalf("token epoch %d %q %v", epoch, node, err)
	}

	// Observations are fenced by node id.
	if _, err := st.ReportObserved(ctx, a.ID, "n1", store.Observed{State: api.StateRunning}); !fault.Is(err, fault.NotFound) {
		t.Fatalf("report from the wrong node: %v", err)
	}
	got, err := st.ReportObserved(ctx, a.ID, "n2", store.Observed{State: api.StateCreating, ObservedGeneration: 0,
		Transition: lifecycle.TCreate, StartPath: "boot", TemplateDigest: "sha256:abc"})
	if err != nil || got.State != api.StateCreating || got.Transition != lifecycle.TCreate || got.StartPath != "boot" ||
		got.TemplateDigest != "sha256:abc" || got.StatusChangedAt == nil {
		t.Fatalf("observed creating: %+v %v", got, err)
	}
	changed := *got.StatusChangedAt
	got, err = st.ReportObserved(ctx, a.ID, "n2", store.Observed{State: api.StateCreating, ObservedGeneration: 0, Reason: "slow"})
	if err != nil || !got.StatusChangedAt.Equal(changed) || got.StatusReason != "slow" || got.StartPath != "boot" || got.Transition != lifecycle.TNone {
		t.Fatalf("same state again: %+v %v", got, err)
	}
	got, err = st.ReportObserved(ctx, a.ID, "n2", store.Observed{State: api.StateRunning, ObservedGeneration: 1})
	if err != nil || got.State != api.StateRunning || got.ObservedGeneration != 1 || got.TemplateDigest != "sha256:abc" || got.StatusReason != "slow" {
		t.Fatalf("observed running: %+v %v", got, err)
	}
	// The observed generation never goes back.
	if got, _ = st.ReportObserved(ctx, a.ID, "n2", store.Observed{State: api.StateRunning, ObservedGeneration: 0, Error: "hiccup"}); got.ObservedGeneration != 1 || got.Error != "hiccup" {
		t.Fatalf("observed generation went back: %+v", got)
	}

	// Desired state: a pause keeps tokens, a suspend revokes them.
	sb, pop := setDesired(t, ctx, st, a.ID, api.StatePaused, "", api.OpPause)
	if sb.Generation != 2 || sb.TokenEpoch != 1 || sb.DesiredState != api.StatePaused || pop.TargetGeneration != 2 || pop.SandboxID != a.ID || pop.Tenant != "t1" {
		t.Fatalf("pause: %+v %+v", sb, pop)
	}
	for i, desired := range []string{api.StateSuspended, api.StateStopped} {
		sb, _ = setDesired(t, ctx, st, a.ID, desired, "because", api.OpSuspend)
		if sb.Generation != int64(3+i) || sb.TokenEpoch != int64(2+i) || sb.StatusReason != "because" {
			t.Fatalf("%s: generation %d token epoch %d reason %q", desired, sb.Generation, sb.TokenEpoch, sb.StatusReason)
		}
	}
	sb, _ = setDesired(t, ctx, st, a.ID, api.StateRunning, "", api.OpWake)
	if sb.TokenEpoch != 3 || sb.StatusReason != "because" {
		t.Fatalf("wake: %+v", sb)
	}
	if e, err := st.BumpTokenEpoch(ctx, a.ID); err != nil || e != 4 {
		t.Fatalf("bump token epoch %d %v", e, err)
	}
	if _, err := st.BumpTokenEpoch(ctx, "nosuch"); !fault.Is(err, fault.NotFound) {
		t.Fatalf("bump unknown: %v", err)
	}
	if err := st.InTx(ctx, func(tx *store.Tx) error {
		_, err := tx.GetSandboxForUpdate(ctx, "nosuch")
		return err
	}); !fault.Is(err, fault.NotFound) {
		t.Fatalf("lock unknown: %v", err)
	}

	// Disk bytes, identity generation, clones.
	if err := st.SetDiskBytes(ctx, a.ID, 12345); err != nil {
		t.Fatal(err)
	}
	if err := st.SetIdentityGeneration(ctx, a.ID, 7); err != nil {
		t.Fatal(err)
	}
	if got := get(t, ctx, st, a.ID); got.DiskExclusiveBytes != 12345 || got.IdentityGeneration != 7 || got.API().DiskBytes != 12345 {
		t.Fatalf("disk/identity %+v", got)
	}
	cl1, _ := newSandbox(t, ctx, st, &store.Sandbox{CloneOf: a.ID, CloneBatch: "batch1", NodeID: "n2"})
	cl2, _ := newSandbox(t, ctx, st, &store.Sandbox{CloneOf: a.ID, CloneBatch: "batch1", NodeID: "n2"})
	if pend, err := st.ClonesPending(ctx, a.ID); err != nil || !slices.Equal(sandboxIDs(pend), sorted(cl1.ID, cl2.ID)) || pend[0].CloneBatch != "batch1" {
		t.Fatalf("clones pending %v %v", sandboxIDs(pend), err)
	}
	if p, err := st.PendingWork(ctx, a.ID, 1<<40); err != nil || !p.Clones || p.Snapshots {
		t.Fatalf("pending work with clones waiting: %+v %v", p, err)
	}
	if err := st.SetCloneReady(ctx, cl1.ID); err != nil {
		t.Fatal(err)
	}
	if pend, _ := st.ClonesPending(ctx, a.ID); len(pend) != 1 || pend[0].ID != cl2.ID {
		t.Fatalf("clones pending after ready: %v", sandboxIDs(pend))
	}
	if got := get(t, ctx, st, cl1.ID); !got.CloneReady || got.CloneOf != a.ID || got.API().CloneOf != a.ID {
		t.Fatalf("ready clone %+v", got)
	}
	setDesired(t, ctx, st, cl2.ID, api.StateDeleted, "", api.OpDelete)
	if pend, _ := st.ClonesPending(ctx, a.ID); len(pend) != 0 {
		t.Fatalf("a clone being deleted is pending: %v", sandboxIDs(pend))
	}
	if p, err := st.PendingWork(ctx, a.ID, 1<<40); err != nil || p.Clones {
		t.Fatalf("pending work after the clones: %+v %v", p, err)
	}

	// Unassigned sandboxes: failed when unplaceable, finished when deleted before placing.
	if ok, err := st.FailUnassigned(ctx, c.ID, 1, "no node fits"); err != nil || !ok {
		t.Fatalf("fail unassigned: %v %v", ok, err)
	}
	if ok, _ := st.FailUnassigned(ctx, c.ID, 1, "again"); ok {
		t.Fatal("failed twice")
	}
	if got := get(t, ctx, st, c.ID); got.State != api.StateFailed || got.Error != "no node fits" || got.ObservedGeneration != 1 {
		t.Fatalf("failed %+v", got)
	}
	if ok, _ := st.FailUnassigned(ctx, a.ID, 1, "x"); ok {
		t.Fatal("failed an assigned sandbox")
	}
	if ok, _ := st.FinishUnassigned(ctx, c.ID, 2); ok {
		t.Fatal("finished a sandbox nobody deleted")
	}
	setDesired(t, ctx, st, c.ID, api.StateDeleted, "", api.OpDelete)
	if ok, err := st.FinishUnassigned(ctx, c.ID, 2); err != nil || !ok {
		t.Fatalf("finish unassigned: %v %v", ok, err)
	}
	if ok, _ := st.FinishUnassigned(ctx, c.ID, 2); ok {
		t.Fatal("finished twice")
	}
	if got := get(t, ctx, st, c.ID); got.State != api.StateDeleted || got.DeletedAt == nil || !got.Lifecycle().Deleted {
		t.Fatalf("finished %+v", got)
	}
	if _, _, err := st.TokenEpoch(ctx, c.ID); !fault.Is(err, fault.NotFound) {
		t.Fatalf("token epoch of a deleted sandbox: %v", err)
	}
	if list, _ := st.ListSandboxes(ctx, store.SandboxFilter{Tenant: "t2", IncludeDeleted: true}); len(list) != 1 {
		t.Fatalf("include deleted: %v", sandboxIDs(list))
	}
	if list, _ := st.ListSandboxes(ctx, store.SandboxFilter{Tenant: "t2"}); len(list) != 0 {
		t.Fatalf("deleted listed: %v", sandboxIDs(list))
	}
}

func TestExpiryIdleTouchPurge(t *testing.T) {
	st, ctx := open(t)
	registerNode(t, ctx, st, "n1")
	now := time.Now()
	past := now.Add(-time.Minute)
	del, _ := newSandbox(t, ctx, st, &store.Sandbox{NodeID: "n1", State: api.StateRunning})
	sus, _ := newSandbox(t, ctx, st, &store.Sandbox{NodeID: "n1", State: api.StateRunning})
	later, _ := newSandbox(t, ctx, st, &store.Sandbox{NodeID: "n1", State: api.StateRunning, IdleTimeout: time.Hour})
	never, _ := newSandbox(t, ctx, st, &store.Sandbox{NodeID: "n1", State: api.StateRunning, IdleTimeout: -1})
	if err := st.SetExpiry(ctx, del.ID, &past, ""); err != nil {
		t.Fatal(err)
	}
	if err := st.SetExpiry(ctx, sus.ID, &past, "suspend"); err != nil {
		t.Fatal(err)
	}
	fut := now.Add(time.Hour)
	if err := st.SetExpiry(ctx, later.ID, &fut, ""); err != nil {
		t.Fatal(err)
	}
	if err := st.SetExpiry(ctx, "nosuch", &past, ""); !fault.Is(err, fault.NotFound) {
		t.Fatalf("expiry of unknown: %v", err)
	}
	if got := get(t, ctx, st, del.ID); got.ExpireAction != "delete" {
		t.Fatalf("empty action changed it: %q", got.ExpireAction)
	}
	exp, err := st.ExpiredSandboxes(ctx, now, 10)
	if err != nil || !slices.Equal(sandboxIDs(exp), sorted(del.ID, sus.ID)) {
		t.Fatalf("expired %v %v", sandboxIDs(exp), err)
	}
	if exp, _ := st.ExpiredSandboxes(ctx, now, 1); len(exp) != 1 {
		t.Fatalf("limit: %v", sandboxIDs(exp))
	}
	// Once their action was asked for they are no longer expired.
	setDesired(t, ctx, st, del.ID, api.StateDeleted, "expired", api.OpDelete)
	setDesired(t, ctx, st, sus.ID, api.StateSuspended, "expired", api.OpSuspend)
	if exp, _ := st.ExpiredSandboxes(ctx, now, 10); len(exp) != 0 {
		t.Fatalf("expired after acting: %v", sandboxIDs(exp))
	}
	// A suspended sandbox with a delete expiry still expires; nil removes the expiry.
	if err := st.SetExpiry(ctx, sus.ID, &past, "delete"); err != nil {
		t.Fatal(err)
	}
	if exp, _ := st.ExpiredSandboxes(ctx, now, 10); len(exp) != 1 || exp[0].ID != sus.ID {
		t.Fatalf("suspended with delete expiry: %v", sandboxIDs(exp))
	}
	if err := st.SetExpiry(ctx, sus.ID, nil, ""); err != nil {
		t.Fatal(err)
	}
	if got := get(t, ctx, st, sus.ID); got.ExpiresAt != nil {
		t.Fatalf("expiry not removed: %v", got.ExpiresAt)
	}

	// Idle: later (1 h) is idle two hours on, sus (the default 6 h) seven hours on;
	// never is never idle.
	exec(t, st, `UPDATE sandboxes SET desired_state='running', state='running' WHERE id=$1`, sus.ID)
	if idle, err := st.IdleSandboxes(ctx, now.Add(2*time.Hour), 10); err != nil || !slices.Equal(sandboxIDs(idle), []string{later.ID}) {
		t.Fatalf("idle in 2h: %v %v", sandboxIDs(idle), err)
	}
	if idle, err := st.IdleSandboxes(ctx, now.Add(7*time.Hour), 10); err != nil || !slices.Equal(sandboxIDs(idle), sorted(later.ID, sus.ID)) {
		t.Fatalf("idle in 7h: %v %v", sandboxIDs(idle), err)
	}
	if idle, _ := st.IdleSandboxes(ctx, now.Add(7*time.Hour), 1); len(idle) != 1 {
		t.Fatalf("idle limit: %v", sandboxIDs(idle))
	}
	if idle, _ := st.IdleSandboxes(ctx, now.Add(30*time.Minute), 10); len(idle) != 0 {
		t.Fatalf("idle in 30m: %v", sandboxIDs(idle))
	}
	exec(t, st, `UPDATE sandboxes SET last_activity_at=now()-interval '2 hours'`)
	if idle, _ := st.IdleSandboxes(ctx, time.Now(), 10); !slices.Equal(sandboxIDs(idle), []string{later.ID}) {
		t.Fatalf("idle after back-dating: %v", sandboxIDs(idle))
	}
	if err := st.TouchSandboxes(ctx, nil); err != nil {
		t.Fatal(err)
	}
	if err := st.TouchSandboxes(ctx, []string{later.ID, never.ID}); err != nil {
		t.Fatal(err)
	}
	if idle, _ := st.IdleSandboxes(ctx, time.Now(), 10); len(idle) != 0 {
		t.Fatalf("idle after touch: %v", sandboxIDs(idle))
	}
	if got := get(t, ctx, st, later.ID); time.Since(got.LastActivityAt) > time.Minute {
		t.Fatalf("touch did not move last activity: %v", got.LastActivityAt)
	}

	// Purge: only sandboxes deleted before the cut-off go, with their operations.
	if _, err := st.ReportObserved(ctx, del.ID, "n1", store.Observed{State: api.StateDeleted, ObservedGeneration: 2, Deleted: true}); err != nil {
		t.Fatal(err)
	}
	if n, err := st.PurgeDeleted(ctx, time.Now().Add(-time.Hour)); err != nil || n != 0 {
		t.Fatalf("purge old: %d %v", n, err)
	}
	opsBefore, _ := st.SandboxOperations(ctx, del.ID, 10)
	if len(opsBefore) != 2 {
		t.Fatalf("operations of deleted sandbox: %d", len(opsBefore))
	}
	if n, err := st.PurgeDeleted(ctx, time.Now().Add(time.Minute)); err != nil || n != 1 {
		t.Fatalf("purge: %d %v", n, err)
	}
	if _, err := st.GetSandbox(ctx, del.ID); !fault.Is(err, fault.NotFound) {
		t.Fatalf("purged sandbox: %v", err)
	}
	if _, err := st.GetOperation(ctx, opsBefore[0].ID); !fault.Is(err, fault.NotFound) {
		t.Fatalf("purged sandbox's operation: %v", err)
	}
}

func TestOperations(t *testing.T) {
	st, ctx := open(t)
	op := &store.Operation{ID: ids.Operation(), Kind: api.OpTemplateBuild, Tenant: "t", Params: map[string]any{"k": "v"}}
	if err := st.CreateOperation(ctx, op); err != nil {
		t.Fatal(err)
	}
	if op.State != api.OpPending || op.SandboxID != "" || op.DoneAt != nil {
		t.Fatalf("created %+v", op)
	}
	if dup := (&store.Operation{ID: op.ID, Kind: api.OpCreate}); st.CreateOperation(ctx, dup) == nil {
		t.Fatal("duplicate operation id accepted")
	}
	if _, err := st.GetOperation(ctx, "op_nosuch"); !fault.Is(err, fault.NotFound) {
		t.Fatalf("unknown op: %v", err)
	}
	if err := st.UpdateOperation(ctx, op.ID, api.OpRunning, "working", ""); err != nil {
		t.Fatal(err)
	}
	got, _ := st.GetOperation(ctx, op.ID)
	if got.State != api.OpRunning || got.Message != "working" || got.DoneAt != nil || got.Params["k"] != "v" {
		t.Fatalf("running %+v", got)
	}
	if err := st.UpdateOperation(ctx, op.ID, api.OpFailed, "failed", "broke"); err != nil {
		t.Fatal(err)
	}
	// Terminal states are final.
	if err := st.UpdateOperation(ctx, op.ID, api.OpSucceeded, "done", ""); err != nil {
		t.Fatal(err)
	}
	got, _ = st.GetOperation(ctx, op.ID)
	if got.State != api.OpFailed || got.Error != "broke" || got.DoneAt == nil {
		t.Fatalf("final %+v", got)
	}
	if w := got.API(); w.State != api.OpFailed || w.Error != "broke" || w.DoneAt == nil || w.ID != op.ID {
		t.Fatalf("wire form %+v", w)
	}

	// Log lines, paged by seq.
	for i := range 5 {
		if err := st.AppendOperationLog(ctx, op.ID, fmt.Sprintf("line %d", i)); err != nil {
			t.Fatal(err)
		}
	}
	var lines []string
	var after int64
	for page := 0; page < 10; page++ {
		got, err := st.OperationLog(ctx, op.ID, after, 2)
		if err != nil {
			t.Fatal(err)
		}
		if len(got) == 0 {
			break
		}
		if len(got) > 2 {
			t.Fatalf("page of %d lines", len(got))
		}
		for _, l := range got {
			if l.Seq <= after || l.At.IsZero() {
				t.Fatalf("line %+v after %d", l, after)
			}
			after = l.Seq
			lines = append(lines, l.Line)
		}
	}
	if !slices.Equal(lines, []string{"line 0", "line 1", "line 2", "line 3", "line 4"}) {
		t.Fatalf("log %v", lines)
	}
	if err := st.AppendOperationLog(ctx, "op_nosuch", "x"); err == nil {
		t.Fatal("log line for an unknown operation accepted")
	}

	// A sandbox's operations complete by generation.
	registerNode(t, ctx, st, "n1")
	sb, create := newSandbox(t, ctx, st, &store.Sandbox{NodeID: "n1"})
	_, pause := setDesired(t, ctx, st, sb.ID, api.StatePaused, "", api.OpPause)
	_, resume := setDesired(t, ctx, st, sb.ID, api.StateRunning, "", api.OpResume)
	if open, err := st.OpenOperations(ctx, sb.ID); err != nil || len(open) != 3 || open[0].ID != create.ID || open[2].ID != resume.ID {
		t.Fatalf("open %v %v", open, err)
	}
	if err := st.ProgressSandboxOperations(ctx, sb.ID, 1, "booting"); err != nil {
		t.Fatal(err)
	}
	if got, _ := st.GetOperation(ctx, create.ID); got.State != api.OpRunning || got.Message != "booting" || got.DoneAt != nil {
		t.Fatalf("progress %+v", got)
	}
	if got, _ := st.GetOperation(ctx, pause.ID); got.State != api.OpPending {
		t.Fatalf("progress reached a later generation: %+v", got)
	}
	if err := st.FinishSandboxOperations(ctx, sb.ID, 2, api.OpSucceeded, ""); err != nil {
		t.Fatal(err)
	}
	for id, want := range map[string]string{create.ID: api.OpSucceeded, pause.ID: api.OpSucceeded, resume.ID: api.OpPending} {
		if got, _ := st.GetOperation(ctx, id); got.State != want {
			t.Fatalf("op %s: %s, want %s", id, got.State, want)
		}
	}
	if err := st.FinishSandboxOperations(ctx, sb.ID, 3, api.OpFailed, "lost"); err != nil {
		t.Fatal(err)
	}
	if got, _ := st.GetOperation(ctx, resume.ID); got.State != api.OpFailed || got.Message != "failed" || got.Error != "lost" || got.DoneAt == nil {
		t.Fatalf("failed %+v", got)
	}
	if got, _ := st.GetOperation(ctx, create.ID); got.State != api.OpSucceeded || got.Message != "done" {
		t.Fatalf("a finished op changed: %+v", got)
	}
	if open, _ := st.OpenOperations(ctx, sb.ID); len(open) != 0 {
		t.Fatalf("open after finishing: %v", open)
	}
	list, err := st.SandboxOperations(ctx, sb.ID, 2)
	if err != nil || len(list) != 2 || list[0].ID != resume.ID || list[1].ID != pause.ID {
		t.Fatalf("sandbox operations newest first: %v %v", list, err)
	}

	// Purge: finished operations before the cut-off; open ones stay.
	open := &store.Operation{ID: ids.Operation(), Kind: api.OpTemplateBuild}
	if err := st.CreateOperation(ctx, open); err != nil {
		t.Fatal(err)
	}
	if n, err := st.PurgeOperations(ctx, time.Now().Add(-time.Hour)); err != nil || n != 0 {
		t.Fatalf("purge old: %d %v", n, err)
	}
	n, err := st.PurgeOperations(ctx, time.Now().Add(time.Minute))
	if err != nil || n != 4 {
		t.Fatalf("purge: %d %v", n, err)
	}
	if _, err := st.GetOperation(ctx, open.ID); err != nil {
		t.Fatalf("open operation purged: %v", err)
	}
	if l, _ := st.OperationLog(ctx, op.ID, 0, 10); len(l) != 0 {
		t.Fatalf("log of a purged operation: %v", l)
	}
}

func TestIdempotency(t *testing.T) {
	st, ctx := open(t)
	hash := []byte("h1")
	if r, err := st.LookupIdempotency(ctx, "t", "k", "POST", "/v1/sandboxes", hash); err != nil || r != nil {
		t.Fatalf("lookup before save: %v %v", r, err)
	}
	save := func(tenant, key string, body []byte) error {
		return st.InTx(ctx, func(tx *store.Tx) error {
			return tx.SaveIdempotency(ctx, tenant, key, "POST", "/v1/sandboxes", hash, 202, body)
		})
	}
	if err := save("t", "k", []byte(`{"id":"x"}`)); err != nil {
		t.Fatal(err)
	}
	r, err := st.LookupIdempotency(ctx, "t", "k", "POST", "/v1/sandboxes", hash)
	if err != nil || r == nil || r.Status != 202 || string(r.Body) != `{"id":"x"}` {
		t.Fatalf("lookup: %+v %v", r, err)
	}
	for name, args := range map[string][3]string{
		"other body":   {"POST", "/v1/sandboxes", "h2"},
		"other path":   {"POST", "/v1/other", "h1"},
		"other method": {"PUT", "/v1/sandboxes", "h1"},
	} {
		_, err := st.LookupIdempotency(ctx, "t", "k", args[0], args[1], []byte(args[2]))
		if !fault.Is(err, fault.Unprocessable) || rest.StatusOf(err) != 422 || !strings.Contains(err.Error(), `"k"`) {
			t.Errorf("%s: %v", name, err)
		}
	}
	// Keys are per tenant.
	if r, err := st.LookupIdempotency(ctx, "u", "k", "POST", "/v1/sandboxes", hash); err != nil || r != nil {
		t.Fatalf("other tenant: %v %v", r, err)
	}
	if err := save("t", "k", []byte(`{}`)); !fault.Is(err, fault.Conflict) {
		t.Fatalf("second save: %v", err)
	}
	if err := save("u", "k", []byte(`{}`)); err != nil {
		t.Fatal(err)
	}
	if err := st.PurgeIdempotency(ctx, time.Now().Add(-time.Hour)); err != nil {
		t.Fatal(err)
	}
	if r, _ := st.LookupIdempotency(ctx, "t", "k", "POST", "/v1/sandboxes", hash); r == nil {
		t.Fatal("purged a fresh record")
	}
	if err := st.PurgeIdempotency(ctx, time.Now().Add(time.Minute)); err != nil {
		t.Fatal(err)
	}
	if r, _ := st.LookupIdempotency(ctx, "t", "k", "POST", "/v1/sandboxes", hash); r != nil {
		t.Fatalf("record survived the purge: %+v", r)
	}
}

func TestPools(t *testing.T) {
	st, ctx := open(t)
	registerNode(t, ctx, st, "n1")
	if k := store.PoolKey("t1", "base:latest", 2, 1024); k != "t1/base:latest/2cpu/1024mb" {
		t.Fatalf("pool key %q", k)
	}
	p := store.Pool{Tenant: "t1", Template: "base:latest", CPU: 1, MemoryMB: 512, Size: 2}
	if err := st.SetPool(ctx, p); err != nil {
		t.Fatal(err)
	}
	if err := st.SetPool(ctx, store.Pool{Tenant: "t1", Template: "py:latest", CPU: 1, MemoryMB: 512, Size: 1}); err != nil {
		t.Fatal(err)
	}
	// Another tenant's pool of the same template and size: a pool of its own.
	if err := st.SetPool(ctx, store.Pool{Tenant: "t2", Template: "base:latest", CPU: 1, MemoryMB: 512, Size: 1}); err != nil {
		t.Fatal(err)
	}
	if t2, err := st.TenantPools(ctx, "t2"); err != nil || len(t2) != 1 || t2[0].Tenant != "t2" || t2[0].Key() == p.Key() {
		t.Fatalf("t2's pools %+v %v", t2, err)
	}
	if err := st.SetPool(ctx, store.Pool{Tenant: "t2", Template: "base:latest", CPU: 1, MemoryMB: 512}); err != nil {
		t.Fatal(err)
	}
	p.Size = 3
	if err := st.SetPool(ctx, p); err != nil {
		t.Fatal(err)
	}
	pools, err := st.ListPools(ctx)
	if err != nil || len(pools) != 2 || pools[0].Template != "base:latest" || pools[0].Size != 3 || pools[0].Ready != 0 {
		t.Fatalf("pools %+v %v", pools, err)
	}

	// Three parked members, one still being made, one of another digest.
	key := p.Key()
	var members []string
	for range 3 {
		m, _ := newSandbox(t, ctx, st, &store.Sandbox{Tenant: "pool", PoolKey: key, TemplateDigest: "sha256:b", NodeID: "n1",
			State: api.StatePaused, DesiredState: api.StatePaused})
		members = append(members, m.ID)
	}
	making, _ := newSandbox(t, ctx, st, &store.Sandbox{Tenant: "pool", PoolKey: key, TemplateDigest: "sha256:b", NodeID: "n1",
		State: api.StateCreating, DesiredState: api.StatePaused})
	newSandbox(t, ctx, st, &store.Sandbox{Tenant: "pool", PoolKey: key, TemplateDigest: "sha256:old", NodeID: "n1",
		State: api.StatePaused, DesiredState: api.StatePaused})
	if pools, _ := st.ListPools(ctx); pools[0].Ready != 4 || pools[1].Ready != 0 {
		t.Fatalf("ready %+v", pools)
	}
	if m, err := st.PoolMembers(ctx, key); err != nil || len(m) != 5 || m[0].ID != members[0] {
		t.Fatalf("members %v %v", sandboxIDs(m), err)
	}
	if o, err := st.OrphanPoolMembers(ctx); err != nil || len(o) != 0 {
		t.Fatalf("orphans %v %v", sandboxIDs(o), err)
	}
	if l, _ := st.ListSandboxes(ctx, store.SandboxFilter{}); len(l) != 0 {
		t.Fatalf("pool members listed to users: %v", sandboxIDs(l))
	}

	// Concurrent claims: each parked member of the digest goes to exactly one caller.
	const callers = 8
	var wg sync.WaitGroup
	var mu sync.Mutex
	claimed := map[string]*store.Operation{}
	var errs []error
	empty := 0
	start := make(chan struct{})
	for i := range callers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			op := &store.Operation{ID: ids.Operation(), Kind: api.OpCreate}
			want := &store.Sandbox{Tenant: "t1", TemplateRef: "base:latest", Metadata: map[string]string{"caller": fmt.Sprint(i)},
				Spec: store.SandboxSpec{CPU: 1, MemoryMB: 512}, IdleTimeout: time.Minute}
			var got *store.Sandbox
			err := st.InTx(ctx, func(tx *store.Tx) error {
				var err error
				got, err = tx.ClaimPoolMember(ctx, key, "sha256:b", want, op)
				return err
			})
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err != nil:
				errs = append(errs, err)
			case got == nil:
				empty++
			default:
				if _, dup := claimed[got.ID]; dup {
					errs = append(errs, fmt.Errorf("member %s claimed twice", got.ID))
				}
				if got.Tenant != "t1" || got.PoolKey != "" || got.DesiredState != api.StateRunning || got.StartPath != "pool" ||
					got.Generation != 2 || got.TokenEpoch != 2 || got.ClaimedAt == nil || got.Metadata["caller"] != fmt.Sprint(i) ||
					got.IdleTimeout != time.Minute || op.SandboxID != got.ID || op.TargetGeneration != 2 || op.Tenant != "t1" {
					errs = append(errs, fmt.Errorf("claimed row %+v, op %+v", got, op))
				}
				claimed[got.ID] = op
			}
		}()
	}
	close(start)
	wg.Wait()
	if len(errs) > 0 {
		t.Fatal(errors.Join(errs...))
	}
	var won []string
	for id := range claimed {
		won = append(won, id)
	}
	if !slices.Equal(sorted(won...), sorted(members...)) || empty != callers-3 {
		t.Fatalf("claimed %v (%d empty), want %v", won, empty, members)
	}
	for id, op := range claimed {
		if got, err := st.GetOperation(ctx, op.ID); err != nil || got.SandboxID != id {
			t.Fatalf("claim op %+v %v", got, err)
		}
	}
	if l, _ := st.ListSandboxes(ctx, store.SandboxFilter{Tenant: "t1"}); len(l) != 3 {
		t.Fatalf("claimed sandboxes listed: %v", sandboxIDs(l))
	}
	if pools, _ := st.ListPools(ctx); pools[0].Ready != 1 {
		t.Fatalf("ready after claims %+v", pools)
	}
	if m, _ := st.PoolMembers(ctx, key); len(m) != 2 {
		t.Fatalf("members after claims %v", sandboxIDs(m))
	}

	// Removing the pool orphans its remaining members.
	p.Size = 0
	if err := st.SetPool(ctx, p); err != nil {
		t.Fatal(err)
	}
	if pools, _ := st.ListPools(ctx); len(pools) != 1 || pools[0].Template != "py:latest" {
		t.Fatalf("pools after removal %+v", pools)
	}
	o, err := st.OrphanPoolMembers(ctx)
	if err != nil || len(o) != 2 || !slices.Contains(sandboxIDs(o), making.ID) {
		t.Fatalf("orphans %v %v", sandboxIDs(o), err)
	}
}

// TestListenResyncMeansListening: the empty-payload calls come once the connection
// listens on every channel, so a notification sent from the first of them, on any
// channel, arrives. (Before, the first channel's call came before the next channel's
// LISTEN, and the notification on a later channel was lost.)
func TestListenResyncMeansListening(t *testing.T) {
	st, ctx := open(t)
	channels := []string{store.NodeChannel("a"), store.NodeChannel("b"), store.NodeChannel("c")}
	got := make(chan string, 16)
	lctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var once sync.Once
	go st.Listen(lctx, slog.New(slog.DiscardHandler), func(c, p string) {
		if p == "" {
			// Notify every channel from the first resync call, before Listen goes on.
			once.Do(func() {
				for _, ch := range channels {
					if err := st.Notify(ctx, ch, "after "+c); err != nil {
						t.Error(err)
					}
				}
			})
			return
		}
		got <- c
	}, channels...)
	seen := map[string]bool{}
	for len(seen) < len(channels) {
		select {
		case c := <-got:
			seen[c] = true
		case <-time.After(10 * time.Second):
			t.Fatalf("notifications sent at the first resync call reached only %v of %v", seen, channels)
		}
	}
}

func TestListenNotify(t *testing.T) {
	st, ctx := open(t)
	type note struct{ channel, payload string }
	notes := make(chan note, 64)
	lctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	node := store.NodeChannel("n1")
	go func() {
		done <- st.Listen(lctx, slog.New(slog.DiscardHandler), func(c, p string) { notes <- note{c, p} },
			store.ChannelController, node, store.ChannelTokens)
	}()
	next := func() note {
		t.Helper()
		select {
		case n := <-notes:
			return n
		case <-time.After(30 * time.Second):
			t.Fatal("no notification within 30s")
		}
		return note{}
	}
	// After connecting, every channel gets a call with an empty payload (resync).
	backlog := map[string]bool{}
	for range 3 {
		n := next()
		if n.payload != "" {
			t.Fatalf("backlog call %+v", n)
		}
		backlog[n.channel] = true
	}
	if !backlog[store.ChannelController] || !backlog[node] || !backlog[store.ChannelTokens] {
		t.Fatalf("backlog calls %v", backlog)
	}
	if err := st.Notify(ctx, store.ChannelController, "hello"); err != nil {
		t.Fatal(err)
	}
	if n := next(); n != (note{store.ChannelController, "hello"}) {
		t.Fatalf("got %+v", n)
	}
	// In a transaction: delivered on commit only.
	_ = st.InTx(ctx, func(tx *store.Tx) error {
		if err := tx.Notify(ctx, node, "rolled back"); err != nil {
			t.Fatal(err)
		}
		return errors.New("abort")
	})
	if err := st.InTx(ctx, func(tx *store.Tx) error { return tx.Notify(ctx, node, "committed") }); err != nil {
		t.Fatal(err)
	}
	if n := next(); n != (note{node, "committed"}) {
		t.Fatalf("got %+v", n)
	}
	// The store's own writes announce themselves: a node assignment wakes its node, a
	// suspend announces the token revocation, an unassigned sandbox wakes the controller.
	registerNode(t, ctx, st, "n1")
	if n := next(); n != (note{store.ChannelController, ""}) {
		t.Fatalf("register: got %+v", n)
	}
	sb, _ := newSandbox(t, ctx, st, &store.Sandbox{})
	if n := next(); n != (note{store.ChannelController, sb.ID}) {
		t.Fatalf("create: got %+v", n)
	}
	if ok, err := st.AssignNode(ctx, sb.ID, "n1", "fake"); err != nil || !ok {
		t.Fatal(ok, err)
	}
	if n := next(); n != (note{node, sb.ID}) {
		t.Fatalf("assign: got %+v", n)
	}
	setDesired(t, ctx, st, sb.ID, api.StateSuspended, "", api.OpSuspend)
	got := map[note]bool{next(): true, next(): true}
	if !got[note{store.ChannelTokens, sb.ID}] || !got[note{node, sb.ID}] {
		t.Fatalf("suspend: got %v", got)
	}
	cancel()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("Listen did not return after its context ended")
	}
}

// TestReportObservedInOneStatement: a report also sets the open operations' progress
// message and the identity generation when asked, and announces the sandbox and each
// operation it touched, all in the one statement.
func TestReportObservedInOneStatement(t *testing.T) {
	st, ctx := open(t)
	registerNode(t, ctx, st, "n1")
	sb, op := newSandbox(t, ctx, st, &store.Sandbox{})
	if ok, err := st.AssignNode(ctx, sb.ID, "n1", "fake"); err != nil || !ok {
		t.Fatal(ok, err)
	}
	notes := make(chan string, 16)
	lctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		_ = st.Listen(lctx, slog.New(slog.DiscardHandler), func(c, p string) {
			if p != "" {
				notes <- c + " " + p
			}
		}, store.ChannelSandboxes, store.ChannelOperations)
	}()
	// The listener is connected once a notification of ours arrives.
	deadline := time.Now().Add(30 * time.Second)
	for connected := false; !connected; {
		if err := st.Notify(ctx, store.ChannelSandboxes, "hello"); err != nil {
			t.Fatal(err)
		}
		select {
		case <-notes:
			connected = true
		case <-time.After(100 * time.Millisecond):
			if time.Now().After(deadline) {
				t.Fatal("the listener never connected")
			}
		}
	}
	for len(notes) > 0 {
		<-notes
	}
	got, err := st.ReportObserved(ctx, sb.ID, "n1", store.Observed{State: api.StateCreating, Transition: lifecycle.TCreate,
		Progress: "creating on node n1", IdentityGeneration: 7})
	if err != nil || got.State != api.StateCreating || got.IdentityGeneration != 7 {
		t.Fatalf("report: %+v %v", got, err)
	}
	if o, err := st.GetOperation(ctx, op.ID); err != nil || o.Message != "creating on node n1" || o.State != api.OpRunning {
		t.Fatalf("operation after the report: %+v %v", o, err)
	}
	want := map[string]bool{store.ChannelSandboxes + " " + sb.ID: false, store.ChannelOperations + " " + op.ID: false}
	for range want {
		select {
		case n := <-notes:
			want[n] = true
		case <-time.After(30 * time.Second):
			t.Fatalf("notifications: %v", want)
		}
	}
	for n, seen := range want {
		if !seen {
			t.Errorf("no notification %q", n)
		}
	}
	// Without Progress and IdentityGeneration neither changes.
	got, err = st.ReportObserved(ctx, sb.ID, "n1", store.Observed{State: api.StateRunning, ObservedGeneration: got.Generation})
	if err != nil || got.IdentityGeneration != 7 {
		t.Fatalf("second report: %+v %v", got, err)
	}
	if o, _ := st.GetOperation(ctx, op.ID); o.Message != "creating on node n1" {
		t.Fatalf("the message changed without Progress: %q", o.Message)
	}
	// PendingWork sees the open operation up to its target generation only.
	if p, err := st.PendingWork(ctx, sb.ID, op.TargetGeneration); err != nil || !p.OpenOps || p.Clones || p.Snapshots {
		t.Fatalf("pending work: %+v %v", p, err)
	}
	if p, _ := st.PendingWork(ctx, sb.ID, op.TargetGeneration-1); p.OpenOps {
		t.Fatal("an operation of a later generation counted as open")
	}
	if err := st.FinishSandboxOperations(ctx, sb.ID, op.TargetGeneration, api.OpSucceeded, ""); err != nil {
		t.Fatal(err)
	}
	if p, _ := st.PendingWork(ctx, sb.ID, op.TargetGeneration); p.OpenOps {
		t.Fatal("a finished operation counted as open")
	}
}

// TestLostConnectionIsUnavailable: a query on a connection PostgreSQL has dropped (it
// restarted, or an operator ended the session) either runs again on a fresh connection
// (when it was not sent: TestStatementsRunAgainOnDroppedConnections) or fails as
// fault.Unavailable — a 503 clients retry — also when the failure only shows while
// reading the rows; never as another error.
func TestLostConnectionIsUnavailable(t *testing.T) {
	st, ctx := open(t)
	if _, err := st.ListSandboxes(ctx, store.SandboxFilter{}); err != nil {
		t.Fatal(err)
	}
	conn, err := st.Connect(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity
		WHERE datname = current_database() AND pid <> pg_backend_pid()`); err != nil {
		t.Fatal(err)
	}
	_, err = st.ListSandboxes(ctx, store.SandboxFilter{})
	if err != nil && !fault.Is(err, fault.Unavailable) {
		t.Fatalf("a list on a terminated connection: %v (%s), want unavailable", err, fault.KindOf(err))
	}
	// The pool replaces the connections (each dropped one fails once, as above).
	for i := 0; ; i++ {
		_, err := st.ListSandboxes(ctx, store.SandboxFilter{})
		if err == nil {
			break
		}
		if !fault.Is(err, fault.Unavailable) || i == 20 {
			t.Fatalf("after the pool reconnected: %v", err)
		}
	}
}
