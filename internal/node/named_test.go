package node_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
	"github.com/spacedev/space/internal/spacetest"
	"github.com/spacedev/space/internal/store"
)

// exec runs SQL as a crash at some instant would have left the database.
func exec(t *testing.T, s *spacetest.Space, sql string, args ...any) {
	t.Helper()
	conn, err := s.Store.Connect(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(ctx(t), sql, args...); err != nil {
		t.Fatal(err)
	}
}

func snapshotReady(t *testing.T, s *spacetest.Space, src string, req api.CreateSnapshotRequest) *api.Snapshot {
	t.Helper()
	sn, err := s.C.CreateSnapshot(ctx(t), src, req)
	if err != nil {
		t.Fatalf("snapshot %s: %v", src, err)
	}
	if sn.State != api.SnapshotCreating || sn.Operation == nil || sn.Operation.Kind != api.OpSnapshot ||
		sn.Operation.SandboxID != src || sn.Operation.Snapshot != sn.ID {
		t.Fatalf("create answer: %+v %+v", sn, sn.Operation)
	}
	s.WaitOp(sn.Operation.ID, api.OpSucceeded)
	got, err := s.C.GetSnapshot(ctx(t), sn.ID)
	if err != nil || got.State != api.SnapshotReady || got.ReadyAt == nil {
		t.Fatalf("snapshot after its operation: %+v %v", got, err)
	}
	got.Operation = sn.Operation
	return got
}

func status(err error) int {
	var ce *client.Error
	if errors.As(err, &ce) {
		return ce.Status
	}
	return 0
}

// A named snapshot keeps the source's disk on its own: the source keeps running, can
// be deleted, and sandboxes made from the snapshot get the disk, the snapshot's
// resources, their own id and identity, on the snapshot's node.
func TestNamedSnapshotOutlivesItsSource(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	src := s.Create(api.CreateSandboxRequest{CPU: 2, MemoryMB: 256, Env: map[string]string{"FROM_SOURCE": "1"}})
	intact := marker(t, s, src.ID)
	sn := snapshotReady(t, s, src.ID, api.CreateSnapshotRequest{Name: "warm"})
	if sn.Name != "warm" || sn.SourceSandbox != src.ID || sn.CPU != 2 || sn.MemoryMB != 256 || sn.Node != s.NodeID ||
		sn.TemplateDigest != src.TemplateDigest || sn.SizeBytes <= 0 {
		t.Fatalf("snapshot: %+v", sn)
	}
	dir, _ := s.Disk.SnapshotDir(sn.ID)
	if !s.Disk.IsComplete(filepath.Join(dir, "checkpoint")) || !dirExists(filepath.Join(dir, "disk", "marker")) {
		t.Fatalf("snapshot files incomplete in %s", dir)
	}
	// The source keeps running, with its disk, and nothing of the capture stays in it.
	intact()
	if got := get(t, s, src.ID); got.State != api.StateRunning || got.Error != "" {
		t.Fatalf("source after the snapshot: %+v", got)
	}
	run(t, s, src.ID, "true")
	srcDir, _ := s.Disk.SandboxDir(src.ID)
	if ents, _ := os.ReadDir(filepath.Join(srcDir, "clones")); len(ents) != 0 {
		t.Fatalf("the capture left %v in the source", ents)
	}
	// Names are unique: a second one is a conflict, unless it replaces.
	if _, err := s.C.CreateSnapshot(ctx(t), src.ID, api.CreateSnapshotRequest{Name: "warm"}); status(err) != 409 {
		t.Fatalf("duplicate name: %v", err)
	}
	if _, err := s.C.CreateSnapshot(ctx(t), src.ID, api.CreateSnapshotRequest{Name: "bad name!"}); status(err) != 400 {
		t.Fatalf("invalid name: %v", err)
	}
	// The source goes; the snapshot stays.
	del, err := s.C.DeleteSandbox(ctx(t), src.ID)
	if err != nil {
		t.Fatal(err)
	}
	s.WaitOp(del.ID, api.OpSucceeded)
	if got, err := s.C.GetSnapshot(ctx(t), "warm"); err != nil || got.ID != sn.ID || got.State != api.SnapshotReady {
		t.Fatalf("snapshot after its source was deleted: %+v %v", got, err)
	}
	// Two sandboxes from it, each its own.
	var made []string
	for i := range 2 {
		sb, err := s.C.CreateSandbox(ctx(t), api.CreateSandboxRequest{Snapshot: "warm", Env: map[string]string{"EXTRA": "x"},
			Metadata: map[string]string{"n": string(rune('a' + i))}, TTL: "1h"}, "")
		if err != nil {
			t.Fatal(err)
		}
		s.WaitOp(sb.Operation.ID, api.OpSucceeded)
		got := get(t, s, sb.ID)
		if got.Snapshot != sn.ID || got.StartPath != "snapshot" || got.CPU != 2 || got.MemoryMB != 256 || got.Node != s.NodeID ||
			got.Template != src.Template || got.TemplateDigest != src.TemplateDigest || got.ExpiresAt == nil || got.ID == src.ID {
			t.Fatalf("sandbox from snapshot: %+v", got)
		}
		root, _ := s.Disk.SandboxRoot(sb.ID)
		if b, err := os.ReadFile(filepath.Join(root, "marker")); err != nil || string(b) != src.ID {
			t.Fatalf("the sandbox from the snapshot has not its disk: %q %v", b, err)
		}
		if out := run(t, s, sb.ID, `echo "$FROM_SOURCE $EXTRA $FROM_TEMPLATE"; hostname`); !strings.HasPrefix(out, "1 x yes\n") ||
			!strings.Contains(out, sb.ID[:8]) {
			t.Fatalf("environment and identity: %q", out)
		}
		made = append(made, sb.ID)
	}
	// A clone of a sandbox made from a snapshot is a clone (it does not need the snapshot).
	clones, err := s.C.Clone(ctx(t), made[0], api.CloneRequest{})
	if err != nil {
		t.Fatal(err)
	}
	s.WaitOp(clones[0].Operation.ID, api.OpSucceeded)
	if got := get(t, s, clones[0].ID); got.Snapshot != "" || got.CloneOf != made[0] {
		t.Fatalf("clone of a sandbox from a snapshot: %+v", got)
	}
	// What a snapshot fixes cannot be changed.
	for _, req := range []api.CreateSandboxRequest{
		{Snapshot: "warm", CPU: 1}, {Snapshot: "warm", Template: "base"}, {Snapshot: "warm", FreshBoot: true},
		{Snapshot: "warm", TTL: "forever"},
	} {
		if _, err := s.C.CreateSandbox(ctx(t), req, ""); status(err) != 400 {
			t.Errorf("%+v: %v", req, err)
		}
	}
	if _, err := s.C.CreateSandbox(ctx(t), api.CreateSandboxRequest{Snapshot: "nosuch"}, ""); status(err) != 404 {
		t.Fatalf("unknown snapshot: %v", err)
	}
	if list, err := s.C.ListSnapshots(ctx(t), client.SnapshotListOptions{}); err != nil || len(list) != 1 || list[0].ID != sn.ID {
		t.Fatalf("list: %+v %v", list, err)
	}
	// Deleting: the name is free at once, the files and the row go.
	gone, err := s.C.DeleteSnapshot(ctx(t), "warm")
	if err != nil || gone.State != api.SnapshotDeleting {
		t.Fatalf("delete: %+v %v", gone, err)
	}
	s.Eventually(30*time.Second, "the snapshot's files and row to go", func() bool {
		_, err := s.C.GetSnapshot(ctx(t), sn.ID)
		return client.IsNotFound(err) && !dirExists(dir)
	})
	if _, err := s.C.DeleteSnapshot(ctx(t), "warm"); status(err) != 404 {
		t.Fatalf("delete again: %v", err)
	}
	// The sandboxes made from it do not need it.
	for _, id := range made {
		run(t, s, id, "test -f /etc/os-release || true")
		if got := get(t, s, id); got.State != api.StateRunning {
			t.Fatalf("%s after its snapshot was deleted: %+v", id, got)
		}
	}
}

// Snapshots of paused and suspended sandboxes leave them as they were; a stopped one
// has no memory to capture.
func TestNamedSnapshotOfPausedSuspendedStopped(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	sb := s.Create(api.CreateSandboxRequest{})
	for _, verb := range []string{api.OpPause, api.OpSuspend} {
		op, err := s.C.Lifecycle(ctx(t), sb.ID, verb)
		if err != nil {
			t.Fatal(err)
		}
		s.WaitOp(op.ID, api.OpSucceeded)
		state := get(t, s, sb.ID).State
		sn := snapshotReady(t, s, sb.ID, api.CreateSnapshotRequest{})
		if sn.Name != sn.ID || !strings.HasPrefix(sn.ID, "snap") {
			t.Fatalf("an unnamed snapshot is named by its id: %+v", sn)
		}
		if got := get(t, s, sb.ID); got.State != state || got.Error != "" {
			t.Fatalf("after a snapshot of a %s sandbox: %+v", state, got)
		}
		made, err := s.C.CreateAndWait(ctx(t), api.CreateSandboxRequest{Snapshot: sn.ID})
		if err != nil || made.State != api.StateRunning {
			t.Fatalf("from the snapshot of a %s sandbox: %+v %v", state, made, err)
		}
	}
	if cp, _ := s.Disk.CheckpointDir(sb.ID); !s.Disk.IsComplete(cp) {
		t.Fatal("the suspended source lost its checkpoint")
	}
	op, err := s.C.Lifecycle(ctx(t), sb.ID, api.OpStop)
	if err != nil {
		t.Fatal(err)
	}
	s.WaitOp(op.ID, api.OpSucceeded)
	if _, err := s.C.CreateSnapshot(ctx(t), sb.ID, api.CreateSnapshotRequest{}); status(err) != 409 || !strings.Contains(err.Error(), "no memory") {
		t.Fatalf("snapshot of a stopped sandbox: %v", err)
	}
}

// A snapshot that a sandbox is being created from cannot be deleted until it runs.
func TestSnapshotInUseIsNotDeleted(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	src := s.Create(api.CreateSandboxRequest{})
	sn := snapshotReady(t, s, src.ID, api.CreateSnapshotRequest{Name: "busy"})
	s.StopNode()
	sb, err := s.C.CreateSandbox(ctx(t), api.CreateSandboxRequest{Snapshot: "busy"}, "")
	if err != nil {
		t.Fatal(err)
	}
	// A conflict that passes on its own (the Go client would wait for it).
	if code, body, h := s.Request("DELETE", "/v1/snapshots/busy", ""); code != 409 || !strings.Contains(body, sb.ID) || h.Get("Retry-After") != "1" {
		t.Fatalf("delete while in use: %d %s, Retry-After %q", code, body, h.Get("Retry-After"))
	}
	s.StartNode()
	s.WaitOp(sb.Operation.ID, api.OpSucceeded)
	if _, err := s.C.DeleteSnapshot(ctx(t), sn.ID); err != nil {
		t.Fatalf("delete once it runs: %v", err)
	}
	// A sandbox cannot be made from a snapshot being deleted.
	if _, err := s.C.CreateSandbox(ctx(t), api.CreateSandboxRequest{Snapshot: sn.ID}, ""); status(err) != 409 && status(err) != 404 {
		t.Fatalf("create from a deleted snapshot: %v", err)
	}
}

// Replace moves a name to a new snapshot; the old one stays under its id.
func TestSnapshotReplaceName(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	src := s.Create(api.CreateSandboxRequest{})
	first := snapshotReady(t, s, src.ID, api.CreateSnapshotRequest{Name: "latest"})
	second := snapshotReady(t, s, src.ID, api.CreateSnapshotRequest{Name: "latest", Replace: true})
	if got, err := s.C.GetSnapshot(ctx(t), "latest"); err != nil || got.ID != second.ID {
		t.Fatalf("the name names %+v %v", got, err)
	}
	if got, err := s.C.GetSnapshot(ctx(t), first.ID); err != nil || got.Name != first.ID {
		t.Fatalf("the replaced snapshot: %+v %v", got, err)
	}
	list, err := s.C.ListSnapshots(ctx(t), client.SnapshotListOptions{Sandbox: src.ID})
	if err != nil || len(list) != 2 || list[0].ID != second.ID {
		t.Fatalf("list of the source's snapshots: %+v %v", list, err)
	}
	if page, err := s.C.ListSnapshots(ctx(t), client.SnapshotListOptions{Limit: 1, After: second.ID}); err != nil ||
		len(page) != 1 || page[0].ID != first.ID {
		t.Fatalf("second page: %+v %v", page, err)
	}
}

// What a crash leaves is recovered: a published snapshot whose row was not made ready
// becomes ready, files of no snapshot are removed, a snapshot whose source is gone
// fails with its operation, and a deletion cut short finishes.
func TestSnapshotRecovery(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	src := s.Create(api.CreateSandboxRequest{})
	sn := snapshotReady(t, s, src.ID, api.CreateSnapshotRequest{Name: "published"})
	gone := s.Create(api.CreateSandboxRequest{})
	s.StopNode()
	// 1. Published, row still creating, operation open (a crash before SnapshotReady).
	exec(t, s, `UPDATE snapshots SET state='creating', ready_at=NULL WHERE id=$1`, sn.ID)
	exec(t, s, `UPDATE operations SET state='running', done_at=NULL WHERE id=$1`, sn.Operation.ID)
	// 2. Files of no snapshot.
	orphan, _ := s.Disk.SnapshotDir("snaporphan")
	if err := os.MkdirAll(filepath.Join(orphan, "checkpoint"), 0o755); err != nil {
		t.Fatal(err)
	}
	// 3. A snapshot asked for of a sandbox deleted before it was taken.
	pending, err := s.C.CreateSnapshot(ctx(t), gone.ID, api.CreateSnapshotRequest{Name: "never"})
	if err != nil {
		t.Fatal(err)
	}
	exec(t, s, `UPDATE sandboxes SET state='deleted', desired_state='deleted', deleted_at=now() WHERE id=$1`, gone.ID)
	// 4. A deletion whose files went but whose row stayed.
	doomed := snapshotReadyOffline(t, s, src.ID)
	exec(t, s, `UPDATE snapshots SET state='deleting' WHERE id=$1`, doomed)
	s.StartNode()
	s.WaitOp(sn.Operation.ID, api.OpSucceeded)
	if got, err := s.C.GetSnapshot(ctx(t), sn.ID); err != nil || got.State != api.SnapshotReady {
		t.Fatalf("published snapshot after recovery: %+v %v", got, err)
	}
	op := s.WaitOp(pending.Operation.ID, api.OpFailed)
	if !strings.Contains(op.Error, "deleted") {
		t.Fatalf("snapshot of a deleted sandbox: %+v", op)
	}
	s.Eventually(30*time.Second, "leftovers to be removed", func() bool {
		_, e1 := s.C.GetSnapshot(ctx(t), "never")
		_, e2 := s.C.GetSnapshot(ctx(t), doomed)
		return !dirExists(orphan) && client.IsNotFound(e1) && client.IsNotFound(e2)
	})
}

// snapshotReadyOffline inserts a ready snapshot row without files (as if its files
// were removed before a crash).
func snapshotReadyOffline(t *testing.T, s *spacetest.Space, src string) string {
	t.Helper()
	id := "snapdoomed"
	exec(t, s, `INSERT INTO snapshots (id, tenant, name, state, source_sandbox, template_ref, spec, node_id)
		VALUES ($1, 'default', $1, 'ready', $2, 'base:latest', '{"cpu":1,"memory_mb":512}', $3)`, id, src, s.NodeID)
	return id
}

// The node samples its running sandboxes: the history says what the sandbox's limits
// are, and ages into bounded averages; a deleted sandbox's samples go.
func TestMetricsHistory(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	sb := s.Create(api.CreateSandboxRequest{CPU: 2, MemoryMB: 256, DiskMB: 1024})
	var m *api.MetricList
	s.Eventually(30*time.Second, "two samples", func() bool {
		var err error
		m, err = s.C.SandboxMetrics(ctx(t), sb.ID, time.Time{}, time.Time{})
		return err == nil && len(m.Samples) >= 2
	})
	for _, x := range m.Samples {
		if x.CPUCount != 2 || x.MemTotal != 256<<20 || x.DiskTotal != 1024<<20 || x.Resolution != "5s" ||
			x.CPUUsedPct < 0 || x.CPUUsedPct > 100 || x.MemUsed <= 0 || x.MemUsed > x.MemTotal {
			t.Fatalf("sample: %+v", x)
		}
	}
	if !m.Samples[0].Time.Before(m.Samples[len(m.Samples)-1].Time) {
		t.Fatalf("samples not oldest first: %+v", m.Samples)
	}
	// A range selects.
	last := m.Samples[len(m.Samples)-1].Time
	if r, err := s.C.SandboxMetrics(ctx(t), sb.ID, last, last); err != nil || len(r.Samples) != 1 {
		t.Fatalf("range of one sample: %+v %v", r, err)
	}
	// Ageing: raw samples of an hour ago become minute averages, of two days ago hour
	// averages, of two months ago nothing.
	now := time.Now().UTC().Truncate(time.Hour)
	var old []store.MetricSample
	for i := range 24 { // two minutes of raw samples, 1.5 hours ago
		old = append(old, store.MetricSample{SandboxID: sb.ID, At: now.Add(-90*time.Minute + time.Duration(i)*5*time.Second),
			Resolution: 5, CPUPct: float64(i), MemUsed: 100, DiskUsed: int64(i)})
	}
	for i := range 120 { // two hours of minutes, two days ago
		old = append(old, store.MetricSample{SandboxID: sb.ID, At: now.Add(-48*time.Hour + time.Duration(i)*time.Minute),
			Resolution: 60, CPUPct: 50, MemUsed: 200, DiskUsed: 7})
	}
	old = append(old, store.MetricSample{SandboxID: sb.ID, At: now.Add(-60 * 24 * time.Hour), Resolution: 3600})
	if err := s.Store.InsertMetrics(ctx(t), old); err != nil {
		t.Fatal(err)
	}
	if err := s.Store.CompactMetrics(ctx(t), s.NodeID, time.Now()); err != nil {
		t.Fatal(err)
	}
	all, err := s.Store.Metrics(ctx(t), sb.ID, time.Time{}, now.Add(-time.Hour), 1000)
	if err != nil {
		t.Fatal(err)
	}
	count := map[int]int{}
	for _, x := range all {
		count[x.Resolution]++
		if x.Resolution == 60 && x.At.Equal(now.Add(-90*time.Minute)) && (x.CPUPct != 5.5 || x.DiskUsed != 11) {
			t.Fatalf("minute average: %+v", x)
		}
		if x.Resolution == 3600 && (x.CPUPct != 50 || x.MemUsed != 200) {
			t.Fatalf("hour average: %+v", x)
		}
	}
	if count[5] != 0 || count[60] != 2 || count[3600] != 2 || len(all) != 4 {
		t.Fatalf("after ageing: %v (%+v)", count, all)
	}
	del, err := s.C.DeleteSandbox(ctx(t), sb.ID)
	if err != nil {
		t.Fatal(err)
	}
	s.WaitOp(del.ID, api.OpSucceeded)
	if err := s.Store.CompactMetrics(ctx(t), s.NodeID, time.Now()); err != nil {
		t.Fatal(err)
	}
	if left, _ := s.Store.Metrics(ctx(t), sb.ID, time.Time{}, time.Time{}, 10); len(left) != 0 {
		t.Fatalf("samples of a deleted sandbox: %d", len(left))
	}
}
