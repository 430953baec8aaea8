package store_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/spacedev/space/internal/store"
)

func TestReleaseSharing(t *testing.T) {
	st, ctx := open(t)
	registerNode(t, ctx, st, "n1")
	registerNode(t, ctx, st, "n2")
	d1, d2 := "sha256:"+hex64('1'), "sha256:"+hex64('2')
	if err := st.PutRelease(ctx, &store.Release{Digest: d1, Name: "base", KeepTag: true}, "latest", "n1"); err != nil {
		t.Fatal(err)
	}
	if got, err := st.UnsharedNodeReleases(ctx, "n1"); err != nil || !slices.Equal(got, []string{d1}) {
		t.Fatalf("unshared releases of n1: %v %v", got, err)
	}
	// A second node's own build of a builtin does not move the tag.
	if err := st.PutRelease(ctx, &store.Release{Digest: d2, Name: "base", KeepTag: true, Registry: "sha256:m2"}, "latest", "n2"); err != nil {
		t.Fatal(err)
	}
	if d, err := st.ResolveTag(ctx, "base", "latest"); err != nil || d != d1 {
		t.Fatalf("base:latest = %s %v, want the first registered %s", d, err, d1)
	}
	if r, err := st.GetRelease(ctx, d2); err != nil || r.Registry != "sha256:m2" {
		t.Fatalf("release pushed before it was recorded: %+v %v", r, err)
	}
	if err := st.MarkReleaseShared(ctx, d1, "sha256:m1"); err != nil {
		t.Fatal(err)
	}
	if r, err := st.GetRelease(ctx, d1); err != nil || r.Registry != "sha256:m1" {
		t.Fatalf("shared release: %+v %v", r, err)
	}
	if got, err := st.UnsharedNodeReleases(ctx, "n1"); err != nil || len(got) != 0 {
		t.Fatalf("unshared releases of n1 after the push: %v %v", got, err)
	}
	// A pull that found it missing: its holder pushes it again.
	if err := st.MarkReleaseUnshared(ctx, d1); err != nil {
		t.Fatal(err)
	}
	if got, _ := st.UnsharedNodeReleases(ctx, "n1"); !slices.Equal(got, []string{d1}) {
		t.Fatalf("unshared releases of n1 after the registry lost it: %v", got)
	}
	// Any node can get a release in the registry (a build from it may go anywhere).
	if ok, err := st.NodeCanGetRelease(ctx, "n2", d2); err != nil || !ok {
		t.Fatalf("n2 can get the shared release: %v %v", ok, err)
	}
	if ok, err := st.NodeCanGetRelease(ctx, "n2", d1); err != nil || ok {
		t.Fatalf("n2 can get n1's unshared release: %v %v", ok, err)
	}
	// A node that pulled a release holds it: placement prefers it.
	if err := st.AddNodeRelease(ctx, "n2", d1); err != nil {
		t.Fatal(err)
	}
	held, err := st.NodeReleases(ctx)
	if err != nil || !held["n2"][d1] || !held["n1"][d1] {
		t.Fatalf("node releases: %v %v", held, err)
	}
	// Registering an existing release again does not forget that it is shared.
	if err := st.MarkReleaseShared(ctx, d1, "sha256:m1"); err != nil {
		t.Fatal(err)
	}
	if err := st.PutRelease(ctx, &store.Release{Digest: d1, Name: "base", KeepTag: true}, "latest", "n1"); err != nil {
		t.Fatal(err)
	}
	if r, _ := st.GetRelease(ctx, d1); r.Registry != "sha256:m1" {
		t.Fatalf("registering again cleared the registry digest: %+v", r)
	}
}

func hex64(c byte) string {
	b := make([]byte, 64)
	for i := range b {
		b[i] = c
	}
	return string(b)
}

// TestWithLock: the fleet-wide lock admits one holder; a waiter that gives up leaves
// no lock behind, and the next waiter gets it once the holder is done.
func TestWithLock(t *testing.T) {
	st, ctx := open(t)
	held, release := make(chan struct{}), make(chan struct{})
	done := make(chan error, 1)
	go func() {
		done <- st.WithLock(ctx, "k", func(context.Context) error {
			close(held)
			<-release
			return nil
		})
	}()
	<-held
	short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	err := st.WithLock(short, "k", func(context.Context) error { t.Error("ran while another held the lock"); return nil })
	cancel()
	if err == nil {
		t.Fatal("a second holder got the lock")
	}
	// Another key is independent.
	if err := st.WithLock(ctx, "other", func(context.Context) error { return nil }); err != nil {
		t.Fatal(err)
	}
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	ran := false
	if err := st.WithLock(ctx, "k", func(context.Context) error { ran = true; return nil }); err != nil || !ran {
		t.Fatalf("lock after its holder finished: %v %v", ran, err)
	}
}

// TestReleaseGCSweep: the registry collection deletes only release artifacts nothing
// references (no release row, no sandbox — a pending one included —, no build, no
// snapshot artifact) for the grace period.
func TestReleaseGCSweep(t *testing.T) {
	st, ctx := open(t)
	registerNode(t, ctx, st, "n1")
	tagged, pending, orphan, ofSnapshot, later := "sha256:"+hex64('a'), "sha256:"+hex64('b'), "sha256:"+hex64('c'), "sha256:"+hex64('d'), "sha256:"+hex64('e')
	if err := st.PutRelease(ctx, &store.Release{Digest: tagged, Name: "base"}, "latest", "n1"); err != nil {
		t.Fatal(err)
	}
	// A sandbox waiting to start from a release whose row is gone still needs it.
	newSandbox(t, ctx, st, &store.Sandbox{TemplateRef: "py@" + pending, TemplateDigest: pending})
	inRegistry := []string{tagged, pending, orphan, ofSnapshot, later}
	kept := []string{ofSnapshot}
	sweep := func(grace time.Duration) []string {
		t.Helper()
		got, err := st.ReleaseGCSweep(ctx, inRegistry, kept, grace)
		if err != nil {
			t.Fatal(err)
		}
		return got
	}
	if got := sweep(0); len(got) != 0 {
		t.Fatalf("first sweep: %v (only marks)", got)
	}
	if got := sweep(time.Hour); len(got) != 0 {
		t.Fatalf("within the grace period: %v", got)
	}
	// later becomes referenced by a sandbox before the grace period ends: unmarked.
	newSandbox(t, ctx, st, &store.Sandbox{TemplateRef: "py@" + later, TemplateDigest: later})
	if got := sweep(0); !slices.Equal(got, []string{orphan}) {
		t.Fatalf("deletable after the grace period: %v, want only %s", got, orphan)
	}
	if err := st.ReleaseGCDeleted(ctx, orphan); err != nil {
		t.Fatal(err)
	}
	inRegistry = []string{tagged, pending, ofSnapshot, later}
	if got := sweep(0); len(got) != 0 {
		t.Fatalf("after the delete: %v", got)
	}
}

// TestEvictableReleases: a node may drop from its store only a release it can pull
// again that nothing uses and nothing used for the grace period.
func TestEvictableReleases(t *testing.T) {
	st, ctx := open(t)
	registerNode(t, ctx, st, "n1")
	d := func(c byte) string { return "sha256:" + hex64(c) }
	unused, tagged, unshared, pending, recentlyDeleted, fresh := d('1'), d('2'), d('3'), d('4'), d('5'), d('6')
	for _, r := range []struct {
		digest, tag, registry string
	}{{unused, "", "m"}, {tagged, "latest", "m"}, {unshared, "", ""}, {pending, "", "m"}, {recentlyDeleted, "", "m"}, {fresh, "", "m"}} {
		reg := ""
		if r.registry != "" {
			reg = "sha256:" + hex64('f')
		}
		if err := st.PutRelease(ctx, &store.Release{Digest: r.digest, Name: "py", Registry: reg}, r.tag, "n1"); err != nil {
			t.Fatal(err)
		}
	}
	exec(t, st, `UPDATE template_releases SET created_at = now() - interval '2 hours' WHERE digest <> $1`, fresh)
	newSandbox(t, ctx, st, &store.Sandbox{TemplateRef: "py@" + pending})
	gone, _ := newSandbox(t, ctx, st, &store.Sandbox{TemplateRef: "py@" + recentlyDeleted, TemplateDigest: recentlyDeleted})
	exec(t, st, `UPDATE sandboxes SET deleted_at = now() - interval '10 minutes', state='deleted' WHERE id=$1`, gone.ID)
	got, err := st.EvictableReleases(ctx, "n1", time.Hour)
	if err != nil || !slices.Equal(got, []string{unused}) {
		t.Fatalf("evictable: %v %v, want only %s", got, err, unused)
	}
	if ok, err := st.ForgetNodeRelease(ctx, "n1", pending, time.Hour); err != nil || ok {
		t.Fatalf("forgot a release a pending sandbox needs: %v %v", ok, err)
	}
	if ok, err := st.ForgetNodeRelease(ctx, "n1", unused, time.Hour); err != nil || !ok {
		t.Fatalf("forget the unused release: %v %v", ok, err)
	}
	if held, _ := st.NodeReleases(ctx); held["n1"][unused] || !held["n1"][pending] {
		t.Fatalf("node releases after the eviction: %v", held["n1"])
	}
	// Longer ago than the grace period, the deleted sandbox no longer keeps its release.
	if got, _ := st.EvictableReleases(ctx, "n1", time.Minute); !slices.Equal(got, []string{recentlyDeleted}) {
		t.Fatalf("evictable with a 1 min grace: %v", got)
	}
}
