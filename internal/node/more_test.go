package node_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/node"
	"github.com/spacedev/space/internal/runtime"
	"github.com/spacedev/space/internal/runtime/fake"
	"github.com/spacedev/space/internal/service"
	"github.com/spacedev/space/internal/spacetest"
	"github.com/spacedev/space/internal/storage"
	"github.com/spacedev/space/internal/store"
	"github.com/spacedev/space/internal/template"
)

// After a boot, the node saves the template's base snapshot; later creates restore it.
func TestBaseSnapshotThenRestore(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{Node: func(c *node.Config) { c.NoBaseSnapshots = false }})
	first := s.Create(api.CreateSandboxRequest{})
	if first.StartPath != "boot" {
		t.Fatalf("first create: %s", first.StartPath)
	}
	s.Eventually(30*time.Second, "the base snapshot", func() bool {
		m, _ := filepath.Glob(filepath.Join(s.DataDir, "store", "templates", "*", "snapshots", "*", "checkpoint", "complete"))
		return len(m) == 1
	})
	second := s.Create(api.CreateSandboxRequest{})
	if second.StartPath != "snapshot" {
		t.Fatalf("second create: %s", second.StartPath)
	}
	run(t, s, second.ID, "true")
	// A fresh boot skips the snapshot.
	if fresh := s.Create(api.CreateSandboxRequest{FreshBoot: true}); fresh.StartPath != "boot" {
		t.Fatalf("fresh boot: %s", fresh.StartPath)
	}
}

// A template's start command runs at boot and its ready check gates the create.
func TestTemplateStartAndReady(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	cfg := json.RawMessage(`{"user":"user","start":["sh","-c","echo up > started; sleep 600"],"ready":{"command":"test -f started","timeout":"20s"}}`)
	s.AddRelease("svc", "latest", cfg, map[string]string{"x": "y"})
	sb := s.Create(api.CreateSandboxRequest{Template: "svc"})
	procs, err := s.C.ListProcesses(ctx(t), sb.ID)
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, p := range procs {
		found = found || p.State == api.ProcRunning && strings.Contains(strings.Join(p.Argv, " "), "sleep 600")
	}
	if !found {
		t.Fatalf("the start command is not running: %+v", procs)
	}
	// A ready check that never passes fails the create with the reason.
	bad := json.RawMessage(`{"ready":{"command":"false","timeout":"1s"}}`)
	s.AddRelease("never", "latest", bad, map[string]string{"x": "z"})
	created, err := s.C.CreateSandbox(ctx(t), api.CreateSandboxRequest{Template: "never"}, "")
	if err != nil {
		t.Fatal(err)
	}
	op := s.WaitOp(created.Operation.ID, api.OpFailed)
	if !strings.Contains(op.Error, "ready check") {
		t.Fatalf("op %+v", op)
	}
}

// builder is a TemplateBuilder over the fake disk: a build runs its steps in a build
// sandbox (the real agent) and records a release.
type builder struct {
	disk  *fake.Disk
	steps int
}

func (b *builder) AllowedSources() template.Sources {
	src, _ := template.ParseSources()
	return src
}

func (b *builder) BuildBuiltin(ctx context.Context, name string, progress func(string)) (storage.Release, template.Config, error) {
	progress("building " + name + " (fake)")
	var cfg template.Config
	if err := json.Unmarshal(spacetest.BaseConfig, &cfg); err != nil {
		return storage.Release{}, cfg, err
	}
	rel, err := b.disk.AddRelease(name, "sha256:"+strings.Repeat("b", 64), spacetest.BaseConfig, map[string]string{"etc/os-release": "ID=built\n"})
	return rel, cfg, err
}

func (b *builder) Build(ctx context.Context, spec *template.Spec, opts template.BuildOptions) (storage.Release, template.Config, error) {
	dir, err := os.MkdirTemp("", "fakebuild")
	if err != nil {
		return storage.Release{}, template.Config{}, err
	}
	defer os.RemoveAll(dir)
	sb, err := opts.Sandbox(ctx, dir, template.Config{})
	if err != nil {
		return storage.Release{}, template.Config{}, err
	}
	defer sb.Close(context.WithoutCancel(ctx))
	h, err := sb.Agent().Health(ctx)
	if err != nil {
		return storage.Release{}, template.Config{}, err
	}
	b.steps++
	opts.Progress("step ran in a build sandbox (agent " + h.Version + ")")
	cfg := template.Config{User: "user"}
	raw, _ := json.Marshal(cfg)
	rel, err := b.disk.AddRelease(spec.Name, "sha256:"+strings.Repeat("c", 64), raw, map[string]string{"built": spec.Name})
	return rel, cfg, err
}

// The builtin base template is built on first use, by the node, once.
func TestBuildsBaseOnFirstUse(t *testing.T) {
	var b *builder
	s := spacetest.Start(t, spacetest.Options{NoBase: true,
		Service: func(c *service.Config) { c.BuiltinTemplates = []string{node.BaseTemplate} },
		Node: func(c *node.Config) {
			b = &builder{disk: c.Storage.(*fake.Disk)}
			c.Builder = b
		}})
	sb := s.Create(api.CreateSandboxRequest{})
	if !strings.HasPrefix(sb.TemplateDigest, "sha256:bbbb") {
		t.Fatalf("built base: %+v", sb)
	}
	// A template build: queued on the node, run in a build sandbox, recorded. Sent with
	// an Idempotency-Key by four twins at once, and again after, it gets one answer
	// and is queued once; the key with another spec is a 422.
	spec := "name: built\nfrom:\n  template: base\n"
	keyed := func(spec string) (int, string, http.Header) {
		return s.Request("POST", "/v1/templates", spec, "Content-Type", "application/yaml", "Idempotency-Key", "build-1")
	}
	s.Eventually(20*time.Second, "the node to publish its template sources", func() bool {
		published, err := s.Store.NodeTemplateSources(ctx(t))
		_, ok := published[s.NodeID]
		return err == nil && ok
	})
	answers := make([]string, 4)
	var wg sync.WaitGroup
	for i := range answers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			code, body, _ := keyed(spec)
			answers[i] = fmt.Sprint(code, " ", body)
		}()
	}
	wg.Wait()
	for _, a := range answers {
		if a != answers[0] || !strings.HasPrefix(a, "202 ") {
			t.Fatalf("twin builds answered differently: %q", answers)
		}
	}
	if code, again, h := keyed(spec); code != 202 || "202 "+again != answers[0] || h.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("the build sent again with its key: %d %s %v", code, again, h)
	}
	if code, body, _ := keyed("name: other\nfrom:\n  template: base\n"); code != 422 {
		t.Fatalf("the build's key with another spec: %d %s", code, body)
	}
	var builds int
	if err := s.Store.DB().QueryRowContext(ctx(t), `SELECT count(*) FROM operations WHERE kind=$1 AND params->>'template' LIKE 'built%'`,
		api.OpTemplateBuild).Scan(&builds); err != nil || builds != 1 {
		t.Fatalf("%d builds queued (%v), want 1", builds, err)
	}
	s.Eventually(time.Minute, "the build", func() bool {
		tpl, err := s.C.ListTemplates(ctx(t))
		if err != nil {
			return false
		}
		for _, x := range tpl {
			if x.Name == "built" {
				return true
			}
		}
		return false
	})
	if b.steps != 1 {
		t.Fatalf("steps run: %d", b.steps)
	}
}

// Pool members are parked paused and claimed by creates, which give them their
// owner's identity.
func TestPoolClaimGivesIdentity(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	if _, err := s.C.SetPool(ctx(t), api.SetPoolRequest{Template: "base", Size: 1}); err != nil {
		t.Fatal(err)
	}
	s.Eventually(time.Minute, "the pool to fill", func() bool {
		pools, err := s.C.ListPools(ctx(t))
		return err == nil && len(pools) == 1 && pools[0].Ready == 1
	})
	sb := s.Create(api.CreateSandboxRequest{Env: map[string]string{"OWNER": "me"}})
	if sb.StartPath != "pool" {
		t.Fatalf("start path %s", sb.StartPath)
	}
	if out := run(t, s, sb.ID, "echo $OWNER"); strings.TrimSpace(out) != "me" {
		t.Fatalf("identity: %q", out)
	}
	// The create operation's timeline says where the time went, in order.
	ops, err := s.C.SandboxOperations(ctx(t), sb.ID)
	if err != nil {
		t.Fatal(err)
	}
	var create *api.Operation
	for i := range ops { // newest first: the member's own create (a boot) is older
		if ops[i].Kind == api.OpCreate && create == nil {
			create = &ops[i]
		}
	}
	if create == nil {
		t.Fatalf("no create operation in %+v", ops)
	}
	var phases []string
	for i, e := range create.Timeline {
		phases = append(phases, e.Phase)
		if i > 0 && (e.Ms < create.Timeline[i-1].Ms-1 || e.At.IsZero()) { // 1 ms: api and node clocks may round apart
			t.Errorf("timeline out of order: %+v", create.Timeline)
		}
	}
	if want := "accepted claimed node recorded resumed agent identity reported done"; strings.Join(phases, " ") != want {
		t.Fatalf("timeline phases %q, want %q", strings.Join(phases, " "), want)
	}
}

// On a runtime that parks warm-pool members running (gVisor), a member waits recorded
// paused with its instance running, a node restart leaves it so, and its claim
// resumes nothing yet gives it its owner's identity.
func TestPoolMembersParkRunning(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{ParkRunning: true})
	if _, err := s.C.SetPool(ctx(t), api.SetPoolRequest{Template: "base", Size: 1}); err != nil {
		t.Fatal(err)
	}
	s.Eventually(time.Minute, "the pool to fill", func() bool {
		pools, err := s.C.ListPools(ctx(t))
		return err == nil && len(pools) == 1 && pools[0].Ready == 1
	})
	members, err := s.Store.PoolMembers(ctx(t), store.PoolKey("default", "base:latest", 1, 512))
	if err != nil || len(members) != 1 {
		t.Fatalf("members %v, %v", members, err)
	}
	m := members[0]
	running := func() {
		t.Helper()
		if st, err := s.Runtime.Status(ctx(t), m.ID); err != nil || st != runtime.StatusRunning {
			t.Fatalf("the parked member's instance is %s (%v), want running", st, err)
		}
		if got, err := s.Store.GetSandbox(ctx(t), m.ID); err != nil || got.State != api.StatePaused {
			t.Fatalf("the parked member is recorded %+v (%v), want paused", got, err)
		}
	}
	running()
	s.StopNode()
	seen := s.Runtime.StatusCalls(m.ID)
	s.StartNode()
	// The restarted node plans for the member: observed, planned, the step taken, and
	// observed again by its next pass. The plan must leave it parked.
	s.Eventually(30*time.Second, "the restarted node to plan for the member twice", func() bool {
		return s.Runtime.StatusCalls(m.ID) >= seen+2
	})
	running()
	sb := s.Create(api.CreateSandboxRequest{Env: map[string]string{"OWNER": "me"}})
	if sb.StartPath != "pool" || sb.ID != m.ID {
		t.Fatalf("start path %s, id %s (member %s)", sb.StartPath, sb.ID, m.ID)
	}
	if out := run(t, s, sb.ID, "echo $OWNER"); strings.TrimSpace(out) != "me" {
		t.Fatalf("identity: %q", out)
	}
	if got := get(t, s, sb.ID); got.State != api.StateRunning || got.Error != "" {
		t.Fatalf("claimed member: %s %q", got.State, got.Error)
	}
}

// A source whose instance vanished while it was checkpointed for clones comes back
// from that checkpoint, not from its disk.
func TestCloneSourceRestoredFromItsCheckpoint(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	sb := s.Create(api.CreateSandboxRequest{})
	s.StopNode()
	// The crash left: the source recorded as clone-source, its instance gone, and a
	// complete checkpoint in a clone batch.
	_ = s.Runtime.Destroy(ctx(t), sb.ID)
	dir, _ := s.Disk.SandboxDir(sb.ID)
	cp := filepath.Join(dir, "clones", "batch1", "checkpoint")
	if err := os.MkdirAll(cp, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(cp, "fake-checkpoint.json"), []byte(`{}`), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := s.Disk.MarkComplete(cp); err != nil {
		t.Fatal(err)
	}
	setRow(t, s, sb.ID, `transition='clone-source'`)
	s.StartNode()
	s.Eventually(30*time.Second, "the source to run again from its clone checkpoint", func() bool {
		got := get(t, s, sb.ID)
		_, err := os.Stat(filepath.Dir(cp)) // removed once used
		return got.State == api.StateRunning && s.Runtime.PID(sb.ID) != 0 && err != nil
	})
	if got := get(t, s, sb.ID); strings.Contains(got.Error, "lost") {
		t.Fatalf("restored from its checkpoint, yet it says: %s", got.Error)
	}
}

// A node fenced by a newer incarnation of itself stops with store.ErrFenced.
func TestFencedNodeStops(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{NoNode: true})
	n, err := node.New(node.Config{ID: s.NodeID, Name: "fenced", DataDir: t.TempDir(), AdvertiseURL: s.URL,
		Store: s.Store, Runtime: s.Runtime, Storage: s.Disk, AgentPath: s.AgentPath(), Heartbeat: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	c, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { done <- n.Run(c) }()
	s.Eventually(10*time.Second, "the node to register", func() bool {
		nd, err := s.Store.GetNode(ctx(t), s.NodeID)
		return err == nil && nd.Name == "fenced"
	})
	// Another process registers the same node: the first must stop.
	if err := s.Store.RegisterNode(ctx(t), &store.Node{ID: s.NodeID, Name: "fenced", Runtime: "fake", DataPlaneURL: s.URL}); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), "took over") {
			t.Fatalf("Run returned %v", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the fenced node keeps running")
	}
}

// Clones get the source's disk, and deleting removes everything a sandbox had.
func TestClonesAndDelete(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	src := s.Create(api.CreateSandboxRequest{})
	intact := marker(t, s, src.ID)
	clones, err := s.C.Clone(ctx(t), src.ID, api.CloneRequest{Count: 2, Metadata: map[string]string{"c": "1"}})
	if err != nil || len(clones) != 2 {
		t.Fatalf("clone: %v %v", clones, err)
	}
	for _, c := range clones {
		s.WaitOp(c.Operation.ID, api.OpSucceeded)
		root, _ := s.Disk.SandboxRoot(c.ID)
		if b, err := os.ReadFile(filepath.Join(root, "marker")); err != nil || string(b) != src.ID {
			t.Fatalf("clone %s has not the source's disk: %q %v", c.ID, b, err)
		}
		run(t, s, c.ID, "true")
	}
	intact()
	if got := get(t, s, src.ID); got.State != api.StateRunning || got.Error != "" {
		t.Fatalf("source after cloning: %+v", got)
	}
	// A clone of a suspended source uses its snapshot.
	op, err := s.C.Lifecycle(ctx(t), src.ID, api.OpSuspend)
	if err != nil {
		t.Fatal(err)
	}
	s.WaitOp(op.ID, api.OpSucceeded)
	more, err := s.C.Clone(ctx(t), src.ID, api.CloneRequest{})
	if err != nil {
		t.Fatal(err)
	}
	s.WaitOp(more[0].Operation.ID, api.OpSucceeded)
	for _, id := range []string{src.ID, clones[0].ID, more[0].ID} {
		del, err := s.C.DeleteSandbox(ctx(t), id)
		if err != nil {
			t.Fatal(err)
		}
		s.WaitOp(del.ID, api.OpSucceeded)
		if dir, _ := s.Disk.SandboxDir(id); dirExists(dir) {
			t.Fatalf("%s: storage left after delete", id)
		}
		if s.Runtime.PID(id) != 0 {
			t.Fatalf("%s: instance left after delete", id)
		}
	}
}

func dirExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

// A clone whose source is deleted before it prepared the snapshot fails, saying why.
func TestCloneOfDeletedSourceFails(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	src := s.Create(api.CreateSandboxRequest{})
	s.StopNode()
	clones, err := s.C.Clone(ctx(t), src.ID, api.CloneRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.C.DeleteSandbox(ctx(t), src.ID); err != nil {
		t.Fatal(err)
	}
	s.StartNode()
	op := s.WaitOp(clones[0].Operation.ID, api.OpFailed)
	if !strings.Contains(op.Error, "deleted") {
		t.Fatalf("op %+v", op)
	}
}

// A clone whose source lost its memory before it prepared the snapshot (its instance
// vanished while it was paused: it settles stopped) fails, saying why, instead of
// waiting for it forever (seen in TestChaos).
func TestCloneOfSourceWithoutMemoryFails(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	src := s.Create(api.CreateSandboxRequest{})
	op, err := s.C.Lifecycle(ctx(t), src.ID, api.OpPause)
	if err != nil {
		t.Fatal(err)
	}
	s.WaitOp(op.ID, api.OpSucceeded)
	s.StopNode()
	clones, err := s.C.Clone(ctx(t), src.ID, api.CloneRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Runtime.Destroy(ctx(t), src.ID); err != nil {
		t.Fatal(err)
	}
	s.StartNode()
	failed := s.WaitOp(clones[0].Operation.ID, api.OpFailed)
	if !strings.Contains(failed.Error, "no memory to clone") {
		t.Fatalf("op %+v", failed)
	}
	if got := get(t, s, src.ID); got.State != api.StateStopped {
		t.Fatalf("source %s", got.State)
	}
}

func TestLoadOrCreateID(t *testing.T) {
	dir := t.TempDir()
	a, err := node.LoadOrCreateID(dir)
	if err != nil {
		t.Fatal(err)
	}
	if b, err := node.LoadOrCreateID(dir); err != nil || b != a {
		t.Fatalf("second load: %s %v, want %s", b, err, a)
	}
	if err := os.WriteFile(filepath.Join(dir, "node-id"), []byte("Not/An-Id"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := node.LoadOrCreateID(dir); err == nil {
		t.Fatal("a corrupt node id was accepted")
	}
}
