package artifact_test

import (
	"encoding/base64"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/spacedev/space/internal/artifact"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/template/templatetest"
)

func TestListAndDelete(t *testing.T) {
	reg := startRegistry(t)
	a := templatetest.Store(t)
	ctx := testCtx(t)
	ca := client(t, a, reg.addr)
	if arts, err := ca.List(ctx, artifact.KindRelease); err != nil || len(arts) != 0 {
		t.Fatalf("empty registry: %v %v", arts, err)
	}
	rel1 := makeRelease(t, a, "one", releaseFiles(1))
	rel2 := makeRelease(t, a, "two", releaseFiles(1))
	p1, err := ca.PushRelease(ctx, rel1.Digest)
	if err != nil {
		t.Fatal(err)
	}
	p2, err := ca.PushRelease(ctx, rel2.Digest)
	if err != nil {
		t.Fatal(err)
	}
	root, err := a.CreateSandboxRoot(ctx, "sb1", rel1.Digest)
	if err != nil {
		t.Fatal(err)
	}
	cp, _ := a.CheckpointDir("sb1")
	fakeCheckpoint(t, a, cp)
	snap, err := ca.PushSnapshot(ctx, artifact.SnapshotSource{ID: "s1", Release: rel1.Digest, Disk: root, Checkpoint: cp})
	if err != nil {
		t.Fatal(err)
	}

	rels, err := ca.List(ctx, artifact.KindRelease)
	if err != nil {
		t.Fatal(err)
	}
	if len(rels) != 2 || rels[0].Digest != p1.Digest || rels[1].Digest != p2.Digest ||
		rels[0].Release != rel1.Digest || rels[1].Release != rel2.Digest || rels[0].PushedAt.After(rels[1].PushedAt) {
		t.Fatalf("releases %+v", rels)
	}
	for _, r := range rels {
		if r.PushedAt.IsZero() || r.Size == 0 || r.Kind != artifact.KindRelease {
			t.Errorf("release %+v", r)
		}
	}
	snaps, err := ca.List(ctx, artifact.KindSnapshot)
	if err != nil {
		t.Fatal(err)
	}
	if len(snaps) != 1 || snaps[0].Snapshot != "s1" || snaps[0].Digest != snap.Digest || snaps[0].Release != rel1.Digest || snaps[0].Tag != "s1" {
		t.Fatalf("snapshots %+v", snaps)
	}

	// A tag that names another digest than the one listed is not deleted.
	err = ca.Delete(ctx, artifact.KindRelease, rels[0].Tag, rels[1].Digest)
	wantKind(t, err, fault.Conflict)
	if err := ca.Delete(ctx, artifact.KindRelease, rels[0].Tag, rels[0].Digest); err != nil {
		t.Fatal(err)
	}
	if rels, _ := ca.List(ctx, artifact.KindRelease); len(rels) != 1 || rels[0].Digest != p2.Digest {
		t.Errorf("after delete: %+v", rels)
	}
	// Deleting again, by tag or digest, is no error.
	if err := ca.Delete(ctx, artifact.KindRelease, rels[0].Tag, ""); err != nil {
		t.Errorf("delete by tag of a deleted release: %v", err)
	}
	if err := ca.Delete(ctx, artifact.KindRelease, "", rels[0].Digest); err != nil {
		t.Errorf("delete by digest of a deleted release: %v", err)
	}

	// A deleted snapshot cannot be pulled.
	if err := ca.Delete(ctx, artifact.KindSnapshot, "", snap.Digest); err != nil {
		t.Fatal(err)
	}
	b := templatetest.Store(t)
	_, err = client(t, b, reg.addr).PullSnapshot(ctx, "s1", "")
	wantKind(t, err, fault.NotFound)
	tmpEmpty(t, b)
}

func TestCredentials(t *testing.T) {
	reg := startRegistry(t)
	px := newProxy(t, reg.addr)
	px.auth = "space:s3cret"
	a, b := templatetest.Store(t), templatetest.Store(t)
	ctx := testCtx(t)
	rel := makeRelease(t, a, "base", releaseFiles(1))

	err := client(t, a, px.addr()).Check(ctx)
	wantKind(t, err, fault.Unauthorized)
	_, err = client(t, a, px.addr()).PushRelease(ctx, rel.Digest)
	wantKind(t, err, fault.Unauthorized)
	t.Logf("anonymous: %v", err)
	_, err = client(t, a, px.addr(), func(c *artifact.Config) { c.Username, c.Password = "space", "wrong" }).PushRelease(ctx, rel.Digest)
	wantKind(t, err, fault.Unauthorized)

	// A Docker config file with the registry's entry.
	dc := filepath.Join(t.TempDir(), "config.json")
	auth := base64.StdEncoding.EncodeToString([]byte("space:s3cret"))
	if err := os.WriteFile(dc, fmt.Appendf(nil, `{"auths":{%q:{"auth":%q}}}`, px.addr(), auth), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := client(t, a, px.addr(), func(c *artifact.Config) { c.DockerConfig = dc }).PushRelease(ctx, rel.Digest); err != nil {
		t.Fatal(err)
	}
	// Username and password.
	if _, err := client(t, b, px.addr(), func(c *artifact.Config) { c.Username, c.Password = "space", "s3cret" }).PullRelease(ctx, rel.Digest); err != nil {
		t.Fatal(err)
	}
	// A config file without an entry for the registry is refused up front.
	other := filepath.Join(t.TempDir(), "config.json")
	os.WriteFile(other, []byte(`{"auths":{"elsewhere.example":{"auth":"eDp5"}}}`), 0o600)
	_, err = artifact.New(artifact.Config{Registry: px.addr() + "/space", DockerConfig: other}, a)
	wantKind(t, err, fault.Invalid)
}

func TestNewValidatesConfig(t *testing.T) {
	for _, tc := range []struct {
		cfg artifact.Config
		ok  bool // valid
	}{
		{artifact.Config{Registry: "registry.example.com/space"}, true},
		{artifact.Config{Registry: "https://registry.example.com:5000/a/b"}, true},
		{artifact.Config{Registry: "127.0.0.1:5000/space"}, true},
		{artifact.Config{Registry: "http://127.0.0.1:5000/space"}, true},
		{artifact.Config{Registry: "http://localhost:5000/space"}, true},
		{artifact.Config{Registry: "http://[::1]:5000/space"}, true},
		{artifact.Config{Registry: "http://10.0.0.5:5000/space"}, false},
		{artifact.Config{Registry: "http://registry.example.com/space"}, false},
		{artifact.Config{Registry: "http://10.0.0.5:5000/space", Insecure: true}, true},
		{artifact.Config{Registry: "ftp://registry.example.com/space"}, false},
		{artifact.Config{Registry: ""}, false},
		{artifact.Config{Registry: "/space"}, false},
		{artifact.Config{Registry: "registry.example.com/Space"}, false},
		{artifact.Config{Registry: "registry.example.com/space", Password: "x"}, false},
		{artifact.Config{Registry: "registry.example.com/space", Username: "u", DockerConfig: "/nonexistent"}, false},
		{artifact.Config{Registry: "registry.example.com/space", DockerConfig: "/nonexistent"}, false},
		{artifact.Config{Registry: "registry.example.com/space", ChunkSize: 100}, false},
		{artifact.Config{Registry: "registry.example.com/space", Jobs: -1}, false},
	} {
		// Without a store: a client that lists, deletes and checks only.
		c, err := artifact.New(tc.cfg, nil)
		if tc.ok != (err == nil) || err != nil && !fault.Is(err, fault.Invalid) {
			t.Errorf("%+v: %v", tc.cfg, err)
		}
		if err != nil {
			continue
		}
		digest := "sha256:" + strings.Repeat("ab", 32)
		if _, err := c.PushRelease(t.Context(), digest); err == nil {
			t.Errorf("%+v: a client without a store pushed", tc.cfg)
		}
		if _, err := c.PullRelease(t.Context(), digest); err == nil {
			t.Errorf("%+v: a client without a store pulled", tc.cfg)
		}
	}
}
