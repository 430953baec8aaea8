package controller_test

import (
	"context"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/artifact"
	"github.com/spacedev/space/internal/controller"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/ids"
	"github.com/spacedev/space/internal/store"
	"github.com/spacedev/space/internal/testenv"
)

// fakeRegistry is an in-memory registry listing: what the collection sees and deletes.
type fakeRegistry struct {
	mu       sync.Mutex
	arts     map[artifact.Kind][]artifact.Artifact
	deleted  []string // release digests
	repushed string   // a release whose tag names another manifest by delete time
}

func (f *fakeRegistry) Registry() string { return "fake.example/space" }

func (f *fakeRegistry) List(_ context.Context, kind artifact.Kind) ([]artifact.Artifact, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.arts[kind]), nil
}

func (f *fakeRegistry) Delete(_ context.Context, kind artifact.Kind, tag, digest string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	for i, a := range f.arts[kind] {
		if a.Tag != tag {
			continue
		}
		if f.repushed != "" && a.Release == f.repushed || a.Digest != digest {
			return fault.New(fault.Conflict, "%s names another manifest now", tag)
		}
		f.arts[kind] = slices.Delete(f.arts[kind], i, i+1)
		f.deleted = append(f.deleted, a.Release)
		return nil
	}
	return nil
}

func release(d string, pushed time.Time) artifact.Artifact {
	return artifact.Artifact{Kind: artifact.KindRelease, Tag: "sha256-" + strings.TrimPrefix(d, "sha256:"),
		Digest: "sha256:" + strings.Repeat("f", 63) + d[len(d)-1:], Release: d, PushedAt: pushed}
}

// TestRegistryGC: the leader's collection deletes a release artifact only when nothing
// has referenced it for the grace period and it was pushed longer ago than that; a
// release a pending sandbox waits for, a tagged release, a release of a snapshot, a
// fresh push and one pushed again meanwhile all survive.
func TestRegistryGC(t *testing.T) {
	c := ctx(t)
	st, err := store.Open(c, store.Config{URL: testenv.Postgres(t), Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	d := func(ch string) string { return "sha256:" + strings.Repeat(ch, 64) }
	orphan, fresh, pending, tagged, ofSnapshot, repushed := d("1"), d("2"), d("3"), d("4"), d("5"), d("6")
	old := time.Now().Add(-3 * time.Hour)
	reg := &fakeRegistry{repushed: repushed, arts: map[artifact.Kind][]artifact.Artifact{
		artifact.KindRelease: {release(orphan, old), release(fresh, time.Now()), release(pending, old), release(tagged, old),
			release(ofSnapshot, old), release(repushed, old)},
		artifact.KindSnapshot: {{Kind: artifact.KindSnapshot, Tag: "sb1", Release: ofSnapshot, PushedAt: old}},
	}}
	if err := st.PutRelease(c, &store.Release{Digest: tagged, Name: "base", Registry: "sha256:m"}, "latest", ""); err != nil {
		t.Fatal(err)
	}
	// A sandbox not placed yet, pinned to a release whose row is gone.
	sb := &store.Sandbox{ID: ids.Sandbox(), Tenant: "default", TemplateRef: "py@" + pending, TemplateDigest: pending,
		DesiredState: api.StateRunning, State: api.StatePending, Spec: store.SandboxSpec{CPU: 1, MemoryMB: 512}}
	if err := st.InTx(c, func(tx *store.Tx) error {
		return tx.CreateSandbox(c, sb, &store.Operation{ID: ids.Operation(), Kind: api.OpCreate, Tenant: "default"})
	}); err != nil {
		t.Fatal(err)
	}
	ctl := controller.New(controller.Config{Store: st, Logger: slog.New(slog.DiscardHandler), Registry: reg, GCGrace: time.Hour})
	got, err := ctl.CollectReleases(c)
	if err != nil || len(got) != 0 {
		t.Fatalf("first pass deleted %v (%v): it only marks", got, err)
	}
	// The grace period passes for what was marked.
	db := st.DB()
	defer db.Close()
	if _, err := db.ExecContext(c, `UPDATE registry_release_gc SET unreferenced_since = now() - interval '2 hours'`); err != nil {
		t.Fatal(err)
	}
	got, err = ctl.CollectReleases(c)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got, []string{orphan}) || !slices.Equal(reg.deleted, []string{orphan}) {
		t.Fatalf("deleted %v (registry: %v), want only %s", got, reg.deleted, orphan)
	}
	// The fresh push ages past the grace period and is collected; the re-pushed one
	// stays marked and is looked at again.
	reg.mu.Lock()
	for i, a := range reg.arts[artifact.KindRelease] {
		if a.Release == fresh {
			reg.arts[artifact.KindRelease][i].PushedAt = old
		}
	}
	reg.mu.Unlock()
	if got, err = ctl.CollectReleases(c); err != nil || !slices.Equal(got, []string{fresh}) {
		t.Fatalf("third pass deleted %v (%v), want %s", got, err, fresh)
	}
	var marked []string
	rows, err := db.QueryContext(c, `SELECT digest FROM registry_release_gc ORDER BY digest`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var s string
		_ = rows.Scan(&s)
		marked = append(marked, s)
	}
	rows.Close()
	if !slices.Equal(marked, []string{repushed}) {
		t.Fatalf("marks left: %v, want only the re-pushed %s", marked, repushed)
	}
}

// TestRegistrySnapshotGC: a snapshot artifact is deleted once no sandbox (its suspend
// snapshot or last checkpoint) and no named snapshot has referenced it for the grace
// period and it was pushed longer ago than that; referenced ones and fresh pushes stay.
func TestRegistrySnapshotGC(t *testing.T) {
	c := ctx(t)
	st, err := store.Open(c, store.Config{URL: testenv.Postgres(t), Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	d := func(ch string) string { return "sha256:" + strings.Repeat(ch, 64) }
	suspended, checkpoint, named, orphan, fresh := d("a"), d("b"), d("c"), d("d"), d("e")
	old := time.Now().Add(-3 * time.Hour)
	snap := func(tag, digest string, pushed time.Time) artifact.Artifact {
		return artifact.Artifact{Kind: artifact.KindSnapshot, Tag: tag, Digest: digest, PushedAt: pushed, Snapshot: tag}
	}
	reg := &fakeRegistry{arts: map[artifact.Kind][]artifact.Artifact{artifact.KindSnapshot: {
		snap("sb1-g1", suspended, old), snap("sb1-cp1", checkpoint, old), snap("named-s1", named, old),
		snap("sb2-g1", orphan, old), snap("sb3-g1", fresh, time.Now()),
	}}}
	sb := &store.Sandbox{ID: ids.Sandbox(), Tenant: "default", TemplateRef: "base",
		DesiredState: api.StateRunning, State: api.StatePending, Spec: store.SandboxSpec{CPU: 1, MemoryMB: 512}}
	if err := st.InTx(c, func(tx *store.Tx) error {
		return tx.CreateSandbox(c, sb, &store.Operation{ID: ids.Operation(), Kind: api.OpCreate, Tenant: "default"})
	}); err != nil {
		t.Fatal(err)
	}
	db := st.DB()
	defer db.Close()
	if _, err := db.ExecContext(c, `UPDATE sandboxes SET snapshot_digest=$2, checkpoint_digest=$3 WHERE id=$1`, sb.ID, suspended, checkpoint); err != nil {
		t.Fatal(err)
	}
	if _, err := db.ExecContext(c, `INSERT INTO snapshots (id, name, state, source_sandbox, template_ref, spec, node_id, registry_digest)
		VALUES ('s1', 'kept', 'ready', $1, 'base', '{}', 'n1', $2)`, sb.ID, named); err != nil {
		t.Fatal(err)
	}
	ctl := controller.New(controller.Config{Store: st, Logger: slog.New(slog.DiscardHandler), Registry: reg, GCGrace: time.Hour})
	if got, err := ctl.CollectSnapshots(c); err != nil || len(got) != 0 {
		t.Fatalf("first pass deleted %v (%v): it only marks", got, err)
	}
	if _, err := db.ExecContext(c, `UPDATE registry_snapshot_gc SET unreferenced_since = now() - interval '2 hours'`); err != nil {
		t.Fatal(err)
	}
	got, err := ctl.CollectSnapshots(c)
	if err != nil || !slices.Equal(got, []string{orphan}) {
		t.Fatalf("second pass deleted %v (%v), want only %s", got, err, orphan)
	}
	// The sandbox is deleted: its snapshot and checkpoint go after their own grace
	// period; the named snapshot stays while its row does.
	if _, err := db.ExecContext(c, `UPDATE sandboxes SET deleted_at=now() WHERE id=$1`, sb.ID); err != nil {
		t.Fatal(err)
	}
	if got, err := ctl.CollectSnapshots(c); err != nil || len(got) != 0 {
		t.Fatalf("deleted %v (%v) right after the sandbox was: the grace period must pass first", got, err)
	}
	if _, err := db.ExecContext(c, `UPDATE registry_snapshot_gc SET unreferenced_since = now() - interval '2 hours'`); err != nil {
		t.Fatal(err)
	}
	got, err = ctl.CollectSnapshots(c)
	if err != nil || !slices.Equal(got, []string{suspended, checkpoint}) {
		t.Fatalf("after the sandbox's deletion: deleted %v (%v), want %s and %s", got, err, suspended, checkpoint)
	}
	reg.mu.Lock()
	var left []string
	for _, a := range reg.arts[artifact.KindSnapshot] {
		left = append(left, a.Tag)
	}
	reg.mu.Unlock()
	if !slices.Equal(left, []string{"named-s1", "sb3-g1"}) {
		t.Fatalf("left in the registry: %v, want the named snapshot and the fresh push", left)
	}
}
