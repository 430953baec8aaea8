package store_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/store"
)

// observe records what node n1 reports of a sandbox (fails the test on error).
func observe(t *testing.T, st *store.Store, sb *store.Sandbox, state string) {
	t.Helper()
	if _, err := st.ReportObserved(t.Context(), sb.ID, sb.NodeID, store.Observed{State: state, ObservedGeneration: sb.Generation}); err != nil {
		t.Fatalf("observe %s: %v", state, err)
	}
}

// snapshotOf records a named snapshot being taken of sb (ready unless creating).
func snapshotOf(t *testing.T, st *store.Store, sb *store.Sandbox, name string, creating bool) (*store.Snapshot, *store.Operation) {
	t.Helper()
	ctx := t.Context()
	sn := &store.Snapshot{ID: "snap-" + name, Tenant: sb.Tenant, Name: name, SourceSandbox: sb.ID, TemplateRef: sb.TemplateRef,
		Spec: sb.Spec, Runtime: "fake", NodeID: sb.NodeID}
	op := &store.Operation{ID: "op-snap-" + name, Kind: api.OpSnapshot, Tenant: sb.Tenant, SandboxID: sb.ID}
	if err := st.InTx(ctx, func(tx *store.Tx) error { return tx.InsertSnapshot(ctx, sn, op, false) }); err != nil {
		t.Fatal(err)
	}
	if !creating {
		if ok, err := st.SnapshotReady(ctx, sn.ID, 1); err != nil || !ok {
			t.Fatalf("snapshot ready: %v %v", ok, err)
		}
	}
	return sn, op
}

func TestNodeCapacityAndUsage(t *testing.T) {
	st, ctx := open(t)
	n := &store.Node{ID: "n1", Name: "one", Runtime: "fake", DataPlaneURL: "http://n1",
		Allocatable: store.Resources{CPU: 8, MemoryMB: 4096, DiskMB: 10240}}
	if err := st.RegisterNode(ctx, n); err != nil {
		t.Fatal(err)
	}
	running, _ := newSandbox(t, ctx, st, &store.Sandbox{NodeID: "n1", Spec: store.SandboxSpec{CPU: 2, MemoryMB: 1024}})
	observe(t, st, running, api.StateRunning)
	suspended, _ := newSandbox(t, ctx, st, &store.Sandbox{NodeID: "n1", DesiredState: api.StateSuspended,
		Spec: store.SandboxSpec{CPU: 4, MemoryMB: 2048}})
	observe(t, st, suspended, api.StateSuspended)
	failed, _ := newSandbox(t, ctx, st, &store.Sandbox{NodeID: "n1", Spec: store.SandboxSpec{CPU: 1, MemoryMB: 512}})
	observe(t, st, failed, api.StateFailed)
	got, err := st.FindNode(ctx, "one")
	if err != nil {
		t.Fatal(err)
	}
	// Memory and vCPUs: only the running one. Disk: the floor of each (nothing
	// measured yet), plus the suspended one's memory snapshot.
	want := store.Resources{CPU: 2, MemoryMB: 1024, DiskMB: 3*store.NodeDiskFloorMB + 2048}
	if got.Allocatable != n.Allocatable || got.Used != want || got.Sandboxes != 3 {
		t.Fatalf("node %+v: allocatable %+v used %+v, want %+v", got, got.Allocatable, got.Used, want)
	}

	// A cordoned node gets no placement; uncordoned it does.
	if _, err := st.SetCordoned(ctx, "one", true); err != nil {
		t.Fatal(err)
	}
	pending, _ := newSandbox(t, ctx, st, &store.Sandbox{})
	if ok, err := st.AssignNode(ctx, pending.ID, "n1", "fake"); err != nil || ok {
		t.Fatalf("assign to a cordoned node: %v %v", ok, err)
	}
	if c, err := st.SetCordoned(ctx, "n1", false); err != nil || c.Cordoned {
		t.Fatalf("uncordon: %+v %v", c, err)
	}
	if ok, err := st.AssignNode(ctx, pending.ID, "n1", "fake"); err != nil || !ok {
		t.Fatalf("assign to an uncordoned node: %v %v", ok, err)
	}
	if _, err := st.SetCordoned(ctx, "nosuch", true); !fault.Is(err, fault.NotFound) {
		t.Fatalf("cordon an unknown node: %v", err)
	}
}

func TestDeadNodeSettlesItsSandboxes(t *testing.T) {
	st, ctx := open(t)
	n := registerNode(t, ctx, st, "n1")
	running, runOp := newSandbox(t, ctx, st, &store.Sandbox{NodeID: "n1"})
	observe(t, st, running, api.StateRunning)
	paused, _ := newSandbox(t, ctx, st, &store.Sandbox{NodeID: "n1", DesiredState: api.StatePaused})
	observe(t, st, paused, api.StatePaused)
	creating, createOp := newSandbox(t, ctx, st, &store.Sandbox{NodeID: "n1"})
	observe(t, st, creating, api.StateCreating)
	resting, _ := newSandbox(t, ctx, st, &store.Sandbox{NodeID: "n1", DesiredState: api.StateSuspended})
	observe(t, st, resting, api.StateSuspended)
	waking, _ := newSandbox(t, ctx, st, &store.Sandbox{NodeID: "n1", DesiredState: api.StateStopped})
	observe(t, st, waking, api.StateStopped)
	_, wakeOp := setDesired(t, ctx, st, waking.ID, api.StateRunning, "", api.OpWake)
	deleting, _ := newSandbox(t, ctx, st, &store.Sandbox{NodeID: "n1"})
	observe(t, st, deleting, api.StateRunning)
	_, delOp := setDesired(t, ctx, st, deleting.ID, api.StateDeleted, "", api.OpDelete)

	_, snapOp := snapshotOf(t, st, resting, "taking", true)
	build := &store.Operation{ID: "op-build", Kind: api.OpTemplateBuild, Tenant: "default", Params: map[string]any{"node": "n1"}}
	if err := st.CreateBuildOperation(ctx, build, "n1"); err != nil {
		t.Fatal(err)
	}
	kept, _ := snapshotOf(t, st, resting, "kept", false)

	dead, err := st.MarkDeadNodes(ctx, time.Now().Add(time.Hour))
	if err != nil || len(dead) != 1 {
		t.Fatalf("mark dead: %+v %v", dead, err)
	}
	// A snapshot being taken there is dropped and its operation fails; a ready one
	// stays for when the node returns.
	if op, _ := st.GetOperation(ctx, snapOp.ID); op.State != api.OpFailed || !strings.Contains(op.Error, "its node is dead") {
		t.Fatalf("snapshot op on a dead node: %+v", op)
	}
	if op, _ := st.GetOperation(ctx, build.ID); op.State != api.OpFailed || !strings.Contains(op.Error, "its node is dead") {
		t.Fatalf("template build on a dead node: %+v", op)
	}
	if _, err := st.GetSnapshot(ctx, "snap-taking"); !fault.Is(err, fault.NotFound) {
		t.Fatalf("snapshot being taken on a dead node: %v", err)
	}
	if _, err := st.GetSnapshot(ctx, kept.ID); err != nil {
		t.Fatalf("ready snapshot on a dead node: %v", err)
	}
	d := dead[0]
	if d.Lost != 3 || d.Kept != 2 || d.Deleted != 1 || !strings.Contains(d.Reason, "node name-n1 stopped sending heartbeats") {
		t.Fatalf("dead node %+v", d)
	}
	for _, sb := range []*store.Sandbox{running, paused, creating} {
		got := get(t, ctx, st, sb.ID)
		if got.State != api.StateFailed || !strings.HasPrefix(got.Error, "lost: node name-n1") ||
			got.StatusReason != got.Error || got.DesiredState != api.StateStopped || !got.Lifecycle().Settled() {
			t.Fatalf("lost sandbox %s: state %s desired %s error %q reason %q", sb.ID, got.State, got.DesiredState, got.Error, got.StatusReason)
		}
	}
	for _, op := range []*store.Operation{runOp, createOp} {
		got, _ := st.GetOperation(ctx, op.ID)
		if op == createOp && (got.State != api.OpFailed || !strings.HasPrefix(got.Error, "lost: ")) {
			t.Fatalf("create op of a lost sandbox: %+v", got)
		}
		if got.DoneAt == nil {
			t.Fatalf("op %s still open", op.ID)
		}
	}
	for _, sb := range []*store.Sandbox{resting, waking} {
		got := get(t, ctx, st, sb.ID)
		if got.State != got.DesiredState || !got.Lifecycle().Settled() || !strings.Contains(got.StatusReason, "its node is dead") {
			t.Fatalf("kept sandbox %s: state %s desired %s reason %q", sb.ID, got.State, got.DesiredState, got.StatusReason)
		}
	}
	if op, _ := st.GetOperation(ctx, wakeOp.ID); op.State != api.OpFailed || !strings.Contains(op.Error, "its node is dead") {
		t.Fatalf("wake of a sandbox on a dead node: %+v", op)
	}
	if got := get(t, ctx, st, deleting.ID); got.DeletedAt == nil || got.State != api.StateDeleted {
		t.Fatalf("sandbox being deleted: %+v", got)
	}
	if op, _ := st.GetOperation(ctx, delOp.ID); op.State != api.OpSucceeded || !strings.Contains(op.Message, "deleted at once") {
		t.Fatalf("delete op: %+v", op)
	}
	node, _ := st.FindNode(ctx, "n1")
	if node.State != store.NodeDead || node.DeadReason != d.Reason || node.Epoch != n.Epoch+1 || node.Used.CPU != 0 {
		t.Fatalf("dead node row %+v", node)
	}

	// Fenced: the incarnation that stopped cannot heartbeat or report.
	if err := st.Heartbeat(ctx, "n1", n.Epoch, ""); !errors.Is(err, store.ErrFenced) {
		t.Fatalf("heartbeat after death: %v", err)
	}
	if _, err := st.ReportObserved(ctx, running.ID, "n1", store.Observed{State: api.StateRunning, ObservedGeneration: 99}); err == nil {
		t.Fatal("a dead node's report was accepted")
	}
	if got := get(t, ctx, st, running.ID); got.State != api.StateFailed {
		t.Fatalf("a dead node's report resurrected %s: %s", running.ID, got.State)
	}

	// A delete of a dead node's sandbox completes at once.
	var delNow *store.Operation
	err = st.InTx(ctx, func(tx *store.Tx) error {
		sb, err := tx.GetSandboxForUpdate(ctx, resting.ID)
		if err != nil {
			return err
		}
		delNow = &store.Operation{ID: "op-delnow", Kind: api.OpDelete}
		if err := tx.SetDesiredState(ctx, sb, api.StateDeleted, "", delNow); err != nil {
			return err
		}
		ok, err := tx.DeleteIfNodeDead(ctx, sb)
		if err == nil && !ok {
			err = errors.New("not deleted at once")
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if op, _ := st.GetOperation(ctx, delNow.ID); op.State != api.OpSucceeded {
		t.Fatalf("delete on a dead node: %+v", op)
	}
	// The node returns: what it kept no longer says it waits for it.
	registerNode(t, ctx, st, "n1")
	if got := get(t, ctx, st, waking.ID); got.StatusReason != "its node returned" || got.State != api.StateStopped {
		t.Fatalf("kept sandbox after its node returned: %s %q", got.State, got.StatusReason)
	}
}

func TestRemoveNode(t *testing.T) {
	st, ctx := open(t)
	registerNode(t, ctx, st, "n1")
	sb, _ := newSandbox(t, ctx, st, &store.Sandbox{NodeID: "n1", DesiredState: api.StateSuspended})
	observe(t, st, sb, api.StateSuspended)
	if _, err := st.RemoveNode(ctx, "name-n1"); !fault.Is(err, fault.Conflict) || !strings.Contains(err.Error(), "not cordoned") {
		t.Fatalf("remove an alive node: %v", err)
	}
	if _, err := st.SetCordoned(ctx, "name-n1", true); err != nil {
		t.Fatal(err)
	}
	if _, err := st.RemoveNode(ctx, "name-n1"); !fault.Is(err, fault.Conflict) || !strings.Contains(err.Error(), "holds 1 sandbox") {
		t.Fatalf("remove a cordoned node that holds a sandbox: %v", err)
	}
	if _, err := st.RemoveNode(ctx, "nosuch"); !fault.Is(err, fault.NotFound) {
		t.Fatalf("remove an unknown node: %v", err)
	}
	// Dead, it can be removed: what it still held goes with it.
	snapshotOf(t, st, sb, "kept", false)
	if _, err := st.MarkDeadNodes(ctx, time.Now().Add(time.Hour)); err != nil {
		t.Fatal(err)
	}
	rm, err := st.RemoveNode(ctx, "name-n1")
	if err != nil || rm.Sandboxes != 1 || rm.Snapshots != 1 || rm.Node.ID != "n1" {
		t.Fatalf("remove a dead node: %+v %v", rm, err)
	}
	if _, err := st.GetSnapshot(ctx, "snap-kept"); !fault.Is(err, fault.NotFound) {
		t.Fatalf("snapshot of a removed node: %v", err)
	}
	if got := get(t, ctx, st, sb.ID); got.DeletedAt == nil || got.NodeID != "" || !strings.Contains(got.StatusReason, "was removed") {
		t.Fatalf("sandbox of a removed node: %+v", got)
	}
	// The name is free: a replacement host (another id) registers under it.
	if err := st.RegisterNode(ctx, &store.Node{ID: "n2", Name: "name-n1", Runtime: "fake", DataPlaneURL: "http://n2"}); err != nil {
		t.Fatalf("replacement: %v", err)
	}
	// While it lives, another id under the same name is refused with advice.
	err = st.RegisterNode(ctx, &store.Node{ID: "n3", Name: "name-n1", Runtime: "fake", DataPlaneURL: "http://n3"})
	if !fault.Is(err, fault.Conflict) || !strings.Contains(err.Error(), "space node rm") {
		t.Fatalf("a second node under a taken name: %v", err)
	}
	// An empty cordoned node can be removed while alive (its process is fenced).
	if _, err := st.SetCordoned(ctx, "n2", true); err != nil {
		t.Fatal(err)
	}
	if _, err := st.RemoveNode(ctx, "name-n1"); err != nil {
		t.Fatal(err)
	}
	if err := st.Heartbeat(ctx, "n2", 1, ""); !errors.Is(err, store.ErrFenced) {
		t.Fatalf("heartbeat of a removed node: %v", err)
	}
}

// A sandbox recorded deleted whose operations could not be ended (the database went
// away between the two writes) has them ended by the controller's resync.
func TestFinishOrphanOperations(t *testing.T) {
	st, ctx := open(t)
	n := &store.Node{ID: "n1", Name: "one", Runtime: "fake", DataPlaneURL: "http://n1"}
	if err := st.RegisterNode(ctx, n); err != nil {
		t.Fatal(err)
	}
	sb, op := newSandbox(t, ctx, st, &store.Sandbox{NodeID: "n1", DesiredState: api.StateDeleted})
	live, liveOp := newSandbox(t, ctx, st, &store.Sandbox{NodeID: "n1"})
	if _, err := st.ReportObserved(ctx, sb.ID, "n1", store.Observed{State: api.StateDeleted, ObservedGeneration: sb.Generation, Deleted: true}); err != nil {
		t.Fatal(err)
	}
	if got, err := st.GetOperation(ctx, op.ID); err != nil || got.DoneAt != nil {
		t.Fatalf("before: %+v %v", got, err)
	}
	if n, err := st.FinishOrphanOperations(ctx); err != nil || n != 1 {
		t.Fatalf("finished %d: %v", n, err)
	}
	if got, err := st.GetOperation(ctx, op.ID); err != nil || got.DoneAt == nil || got.State != api.OpFailed {
		t.Fatalf("the deleted sandbox's open operation: %+v %v", got, err)
	}
	if got, err := st.GetOperation(ctx, liveOp.ID); err != nil || got.DoneAt != nil {
		t.Fatalf("a live sandbox's (%s) operation was ended: %+v %v", live.ID, got, err)
	}
}

// TestCopiedNodeIDRefused: a registration of a known node id from another
// installation (another fingerprint) is refused and changes nothing; a restart of the
// same installation, an old row without a fingerprint, and a take-over asked for are
// accepted. The cache columns count the releases and ready snapshots a node holds.
func TestCopiedNodeIDRefused(t *testing.T) {
	st, ctx := open(t)
	orig := &store.Node{ID: "n1", Name: "one", Runtime: "fake", DataPlaneURL: "http://n1", Fingerprint: "host-a:/srv/space:fs1"}
	if err := st.RegisterNode(ctx, orig); err != nil {
		t.Fatal(err)
	}
	running, _ := newSandbox(t, ctx, st, &store.Sandbox{NodeID: "n1"})
	observe(t, st, running, api.StateRunning)

	// The same installation restarting (after kill -9 too) registers again.
	again := &store.Node{ID: "n1", Name: "one", Runtime: "fake", DataPlaneURL: "http://n1", Fingerprint: "host-a:/srv/space:fs1"}
	if err := st.RegisterNode(ctx, again); err != nil {
		t.Fatalf("restart of the same installation refused: %v", err)
	}
	if again.Epoch != orig.Epoch+1 {
		t.Fatalf("restart epoch %d, want %d", again.Epoch, orig.Epoch+1)
	}

	// A copy on another host, even under another name and URL, is refused.
	copied := &store.Node{ID: "n1", Name: "two", Runtime: "fake", DataPlaneURL: "http://n2", Fingerprint: "host-b:/srv/space:fs1"}
	err := st.RegisterNode(ctx, copied)
	if !errors.Is(err, store.ErrCopiedNode) || fault.KindOf(err) != fault.Conflict {
		t.Fatalf("copied node id: got %v (kind %v), want a conflict wrapping ErrCopiedNode", err, fault.KindOf(err))
	}
	for _, want := range []string{"space node rm one", "node-id", "--node-takeover"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("refusal %q does not name the remedy %q", err, want)
		}
	}
	n, err := st.FindNode(ctx, "n1")
	if err != nil {
		t.Fatal(err)
	}
	if n.Name != "one" || n.DataPlaneURL != "http://n1" || n.Epoch != again.Epoch || n.Fingerprint != "host-a:/srv/space:fs1" {
		t.Fatalf("a refused registration changed the row: %+v", n)
	}
	if sb, err := st.GetSandbox(ctx, running.ID); err != nil || sb.State != api.StateRunning {
		t.Fatalf("the original node's sandbox after a refused copy: %+v %v", sb, err)
	}
	// The original keeps heartbeating: it was not fenced.
	if err := st.Heartbeat(ctx, "n1", again.Epoch, ""); err != nil {
		t.Fatalf("original node fenced by a refused copy: %v", err)
	}

	// A take-over asked for is accepted, and fences the original.
	moved := &store.Node{ID: "n1", Name: "one", Runtime: "fake", DataPlaneURL: "http://n1b", Fingerprint: "host-a:/data/space:fs1", TakeOver: true}
	if err := st.RegisterNode(ctx, moved); err != nil {
		t.Fatalf("take-over: %v", err)
	}
	if err := st.Heartbeat(ctx, "n1", again.Epoch, ""); !errors.Is(err, store.ErrFenced) {
		t.Fatalf("old incarnation after a take-over: %v, want fenced", err)
	}
	if n, _ := st.FindNode(ctx, "n1"); n == nil || n.Fingerprint != "host-a:/data/space:fs1" {
		t.Fatalf("take-over did not record the new fingerprint: %+v", n)
	}

	// A row registered without a fingerprint takes the first one presented.
	legacy := &store.Node{ID: "n3", Name: "three", Runtime: "fake", DataPlaneURL: "http://n3"}
	if err := st.RegisterNode(ctx, legacy); err != nil {
		t.Fatal(err)
	}
	legacy.Fingerprint = "host-c:/srv/space:fs3"
	if err := st.RegisterNode(ctx, legacy); err != nil {
		t.Fatalf("first fingerprint on an old row: %v", err)
	}
	legacy.Fingerprint = "host-d:/srv/space:fs3"
	if err := st.RegisterNode(ctx, legacy); !errors.Is(err, store.ErrCopiedNode) {
		t.Fatalf("after the first fingerprint, another is refused: %v", err)
	}

	// Cache: a release the node holds and a ready snapshot on it.
	if err := st.PutRelease(ctx, &store.Release{Digest: "sha256:" + strings.Repeat("a", 64), Name: "base", SizeBytes: 5 << 20}, "latest", "n1"); err != nil {
		t.Fatal(err)
	}
	snapshotOf(t, st, running, "kept", false) // ready, of 1 byte
	snapshotOf(t, st, running, "taking", true)
	n, err = st.FindNode(ctx, "one")
	if err != nil {
		t.Fatal(err)
	}
	if want := (store.NodeCache{Releases: 1, ReleaseBytes: 5 << 20, Snapshots: 1, SnapshotBytes: 1}); n.Cache != want {
		t.Fatalf("cache %+v, want %+v", n.Cache, want)
	}
}
