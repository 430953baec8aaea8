package node_test

import (
	"net"
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/artifact"
	"github.com/spacedev/space/internal/node"
	"github.com/spacedev/space/internal/spacetest"
	"github.com/spacedev/space/internal/store"
	"github.com/spacedev/space/internal/template/templatetest"
)

// A release the node does not hold fails the create with the registry named: when
// the registry is unreachable (nothing is left behind), and when the release never
// reached the registry.
func TestReleaseFromAnUnreachableRegistry(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close() // nothing listens there now
	pullStore := templatetest.Store(t)
	ac, err := artifact.New(artifact.Config{Registry: addr + "/space"}, pullStore)
	if err != nil {
		t.Fatal(err)
	}
	s := spacetest.Start(t, spacetest.Options{Node: func(c *node.Config) { c.Artifacts = ac }})
	c := t.Context()
	shared, unshared := "sha256:"+strings.Repeat("ab", 32), "sha256:"+strings.Repeat("cd", 32)
	if err := s.Store.PutRelease(c, &store.Release{Digest: shared, Name: "py", Config: spacetest.BaseConfig, Registry: "sha256:" + strings.Repeat("ef", 32)}, "1", ""); err != nil {
		t.Fatal(err)
	}
	if err := s.Store.PutRelease(c, &store.Release{Digest: unshared, Name: "py", Config: spacetest.BaseConfig}, "2", ""); err != nil {
		t.Fatal(err)
	}
	failed := func(tmpl string) string {
		t.Helper()
		sb, err := s.C.CreateSandbox(c, api.CreateSandboxRequest{Template: tmpl}, "")
		if err != nil {
			t.Fatal(err)
		}
		var got *api.Sandbox
		s.Eventually(30*time.Second, tmpl+" to fail", func() bool {
			got, err = s.C.GetSandbox(c, sb.ID)
			return err == nil && got.State == api.StateFailed
		})
		return got.Error
	}
	if msg := failed("py:1"); !strings.Contains(msg, "registry "+addr) || !strings.Contains(msg, "pull template release "+shared) {
		t.Fatalf("unreachable registry: %q", msg)
	}
	if rels, err := pullStore.ListReleases(); err != nil || len(rels) != 0 {
		t.Fatalf("a failed pull left releases: %v %v", rels, err)
	}
	if msg := failed("py:2"); !strings.Contains(msg, "not in registry "+addr) {
		t.Fatalf("release never pushed: %q", msg)
	}
	if held, _ := s.Store.NodeReleases(c); held[s.NodeID][shared] {
		t.Fatal("the node is recorded as holding a release it failed to pull")
	}
}

// A node removes from its store a release it can pull again that nothing uses; a
// release a pending sandbox is pinned to stays.
func TestNodeEvictsUnusedReleases(t *testing.T) {
	ac, err := artifact.New(artifact.Config{Registry: "127.0.0.1:1/space"}, nil) // never contacted
	if err != nil {
		t.Fatal(err)
	}
	s := spacetest.Start(t, spacetest.Options{NoController: true, Node: func(c *node.Config) { c.Artifacts = ac }})
	c := t.Context()
	unused, pending := "sha256:"+strings.Repeat("ab", 32), "sha256:"+strings.Repeat("cd", 32)
	for _, d := range []string{unused, pending} {
		rel, err := s.Disk.AddRelease("py", d, spacetest.BaseConfig, map[string]string{"f": "x"})
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Store.PutRelease(c, &store.Release{Digest: rel.Digest, Name: "py", Config: spacetest.BaseConfig,
			Registry: "sha256:" + strings.Repeat("ef", 32)}, "", s.NodeID); err != nil {
			t.Fatal(err)
		}
	}
	// Not placed (no controller): it waits for a node, pinned to the release. It exists
	// before the releases are old enough to evict: an eviction pass between the two would
	// rightly take the pending one too (a node pulls it again when it needs it).
	if _, err := s.C.CreateSandbox(c, api.CreateSandboxRequest{Template: "py@" + pending}, ""); err != nil {
		t.Fatal(err)
	}
	db := s.Store.DB()
	defer db.Close()
	if _, err := db.ExecContext(c, `UPDATE template_releases SET created_at = now() - interval '2 hours' WHERE digest IN ($1, $2)`, unused, pending); err != nil {
		t.Fatal(err)
	}
	s.Eventually(30*time.Second, "the unused release to be evicted", func() bool {
		held, _ := s.Store.NodeReleases(c)
		return !s.Disk.HasRelease(unused) && !held[s.NodeID][unused]
	})
	held, _ := s.Store.NodeReleases(c)
	if !s.Disk.HasRelease(pending) || !held[s.NodeID][pending] {
		t.Fatal("the release a pending sandbox needs was evicted")
	}
	if !s.Disk.HasRelease(s.Base) {
		t.Fatal("base (tagged) was evicted")
	}
}
