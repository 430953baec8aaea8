package artifact_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/json"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/static"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/spacedev/space/internal/artifact"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/storage"
	"github.com/spacedev/space/internal/template/templatetest"
)

// The tests need root, btrfs and Debian's docker-registry: each starts a registry on
// 127.0.0.1 and works with stores on loop-mounted btrfs images.

func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

func logger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelInfo}))
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// client returns a client of st for the registry at addr (host:port), prefix "space".
func client(t *testing.T, st *storage.Store, addr string, mod ...func(*artifact.Config)) *artifact.Client {
	t.Helper()
	cfg := artifact.Config{Registry: addr + "/space", ChunkSize: 1 << 20, Logger: logger(t)}
	for _, m := range mod {
		m(&cfg)
	}
	c, err := artifact.New(cfg, st)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// smallStore returns a store on an image of size bytes.
func smallStore(t *testing.T, size int64) *storage.Store {
	t.Helper()
	templatetest.RequireStore(t)
	ctx := context.Background()
	s, err := storage.Open(ctx, storage.Config{DataDir: t.TempDir(), ImageSizeBytes: size})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		var err error
		for deadline := time.Now().Add(10 * time.Second); ; {
			if err = s.Unmount(ctx); err == nil || time.Now().After(deadline) {
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
		if err != nil {
			t.Errorf("unmount store: %v", err)
		}
	})
	return s
}

// makeRelease builds a release in st from files (path → content) and returns it.
func makeRelease(t *testing.T, st *storage.Store, name string, files map[string][]byte) storage.Release {
	t.Helper()
	ctx := testCtx(t)
	b, err := st.BeginRelease(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Discard(ctx)
	for p, data := range files {
		full := filepath.Join(b.Rootfs(), p)
		if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(full, data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	rel, err := b.Commit(ctx, storage.Release{Name: name, Config: []byte(`{"cmd":"sleep"}`)})
	if err != nil {
		t.Fatal(err)
	}
	return rel
}

func random(n int) []byte {
	b := make([]byte, n)
	rand.Read(b)
	return b
}

// releaseFiles is a release with some incompressible data across chunks.
func releaseFiles(mb int) map[string][]byte {
	return map[string][]byte{
		"bin/tool":        random(mb << 20),
		"etc/hostname":    []byte("space\n"),
		"etc/motd":        []byte("hello\n"),
		"usr/share/a.txt": bytes.Repeat([]byte("compressible "), 10000),
	}
}

// tmpEmpty fails the test unless the store's tmp/ is empty: nothing half-made is left.
func tmpEmpty(t *testing.T, st *storage.Store) {
	t.Helper()
	entries, err := os.ReadDir(filepath.Join(st.Root(), "tmp"))
	if err != nil {
		t.Fatal(err)
	}
	if len(entries) != 0 {
		var names []string
		for _, e := range entries {
			names = append(names, e.Name())
		}
		t.Errorf("the store's tmp/ holds %v", names)
	}
}

func wantKind(t *testing.T, err error, k fault.Kind) {
	t.Helper()
	if err == nil {
		t.Fatalf("no error, want %s", k)
	}
	if fault.KindOf(err) != k {
		t.Fatalf("error kind %s, want %s: %v", fault.KindOf(err), k, err)
	}
}

func treeDigest(t *testing.T, dir string) string {
	t.Helper()
	d, _, err := storage.TreeDigest(context.Background(), dir)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func TestReleaseRoundTrip(t *testing.T) {
	reg := startRegistry(t)
	px := newProxy(t, reg.addr)
	a, b := templatetest.Store(t), templatetest.Store(t)
	ctx := testCtx(t)
	rel := makeRelease(t, a, "base", releaseFiles(6))
	ca, cb := client(t, a, px.addr()), client(t, b, px.addr())
	if err := ca.Check(ctx); err != nil {
		t.Fatal(err)
	}

	art, err := ca.PushRelease(ctx, rel.Digest)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("pushed %s: %d bytes in the registry, %d uploaded", art.Reference, art.Size, art.Uploaded)
	if art.Digest == "" || art.Release != rel.Digest || art.PushedAt.IsZero() || art.Uploaded < 6<<20 {
		t.Fatalf("artifact %+v", art)
	}
	if !strings.HasSuffix(art.Reference, "/space/releases:sha256-"+strings.TrimPrefix(rel.Digest, "sha256:")) {
		t.Errorf("reference %s", art.Reference)
	}
	// Pushing again uploads nothing.
	again, err := ca.PushRelease(ctx, rel.Digest)
	if err != nil {
		t.Fatal(err)
	}
	if again.Uploaded != 0 || again.Digest != art.Digest {
		t.Errorf("second push: %+v", again)
	}

	got, err := cb.PullRelease(ctx, rel.Digest)
	if err != nil {
		t.Fatal(err)
	}
	if got.Digest != rel.Digest || got.Name != "base" || string(got.Config) != string(rel.Config) || !got.CreatedAt.Equal(rel.CreatedAt) {
		t.Errorf("pulled release %+v, pushed %+v", got, rel)
	}
	root, err := b.ReleaseRoot(rel.Digest)
	if err != nil {
		t.Fatal(err)
	}
	if d := treeDigest(t, root); d != rel.Digest {
		t.Errorf("pulled tree digest %s, want %s", d, rel.Digest)
	}
	if ro, err := b.IsReadOnly(root); err != nil || !ro {
		t.Errorf("pulled release root read-only %v (%v)", ro, err)
	}
	tmpEmpty(t, b)

	// Present: nothing is asked of the registry.
	px.reset()
	if _, err := cb.PullRelease(ctx, rel.Digest); err != nil {
		t.Fatal(err)
	}
	if n := px.total(); n != 0 {
		t.Errorf("pulling a present release made %d requests", n)
	}
}

func TestPullRefusesTamperedBlob(t *testing.T) {
	reg := startRegistry(t)
	a, b := templatetest.Store(t), templatetest.Store(t)
	ctx := testCtx(t)
	rel := makeRelease(t, a, "base", releaseFiles(3))
	ca, cb := client(t, a, reg.addr), client(t, b, reg.addr)
	if _, err := ca.PushRelease(ctx, rel.Digest); err != nil {
		t.Fatal(err)
	}
	arts, err := ca.List(ctx, artifact.KindRelease)
	if err != nil || len(arts) != 1 {
		t.Fatalf("list: %v %v", arts, err)
	}
	// Flip one byte in the middle of the third blob of the stream (the registry serves
	// what its storage holds).
	blobs := layerDigests(t, reg, arts[0].Digest)
	if len(blobs) < 3 {
		t.Fatalf("want at least 3 blobs, got %d", len(blobs))
	}
	path := reg.blobPath(blobs[2])
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	data[len(data)/2] ^= 0xff
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
	_, err = cb.PullRelease(ctx, rel.Digest)
	wantKind(t, err, fault.BadGateway)
	if !strings.Contains(err.Error(), blobs[2]) {
		t.Errorf("error does not name the blob: %v", err)
	}
	t.Logf("tampered pull: %v", err)
	if b.HasRelease(rel.Digest) {
		t.Error("a release was published from a tampered blob")
	}
	tmpEmpty(t, b)
}

// layerDigests reads a manifest from the registry's storage and returns its layers.
func layerDigests(t *testing.T, reg *registry, manifest string) []string {
	t.Helper()
	data, err := os.ReadFile(reg.blobPath(manifest))
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, part := range strings.Split(string(data), `"digest":"`)[2:] { // [0] before config, [1] config
		out = append(out, part[:strings.IndexByte(part, '"')])
	}
	return out
}

func sha(t *testing.T, path string) [32]byte {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		t.Fatal(err)
	}
	var s [32]byte
	copy(s[:], h.Sum(nil))
	return s
}

func TestPushResumesAfterInterruption(t *testing.T) {
	reg := startRegistry(t)
	px := newProxy(t, reg.addr)
	a, b := templatetest.Store(t), templatetest.Store(t)
	rel := makeRelease(t, a, "base", releaseFiles(24))
	ca := client(t, a, px.addr(), func(c *artifact.Config) { c.Jobs = 2 })
	cb := client(t, b, px.addr())

	// Interrupt the push once 8 blobs are in.
	ctx, cancel := context.WithCancel(testCtx(t))
	defer cancel()
	px.setOnDone(func(method, kind string, status int) {
		if method == "PUT" && kind == "upload" && px.blobUploads.Load() >= 8 {
			cancel()
		}
	})
	if _, err := ca.PushRelease(ctx, rel.Digest); err == nil {
		t.Fatal("the interrupted push succeeded")
	} else {
		t.Logf("interrupted push: %v", err)
	}
	px.setOnDone(nil)
	px.quiesce(t)
	first := px.blobUploads.Load()
	// No tag names a half-pushed artifact: it cannot be pulled.
	_, err := cb.PullRelease(testCtx(t), rel.Digest)
	wantKind(t, err, fault.NotFound)
	tmpEmpty(t, b)

	px.reset()
	art, err := ca.PushRelease(testCtx(t), rel.Digest)
	if err != nil {
		t.Fatal(err)
	}
	second := px.blobUploads.Load()
	blobs := int64(len(layerDigests(t, reg, art.Digest))) + 1 // and the config
	t.Logf("blobs: %d; uploaded before the interruption %d, on resumption %d (%d bytes of %d)", blobs, first, second, art.Uploaded, art.Size)
	// An upload the interruption cut may still have been committed by the registry
	// (the proxy then saw no 201 for it, and the resumed push found the blob there):
	// such a blob is counted in neither phase. None may be uploaded twice, and every
	// one is there (the pull below checks the release's digest).
	if first < 8 || first+second > blobs || first+second < blobs-2 {
		t.Errorf("uploads: %d before, %d after, %d blobs: no blob may be uploaded twice, and the rest must be", first, second, blobs)
	}
	if art.Uploaded >= art.Size*3/4 {
		t.Errorf("resumed push uploaded %d of %d bytes", art.Uploaded, art.Size)
	}

	// An interrupted pull leaves nothing behind either.
	pctx, pcancel := context.WithCancel(testCtx(t))
	defer pcancel()
	px.setOnDone(func(method, kind string, status int) {
		if method == "GET" && kind == "blob" && px.count("GET", "blob") >= 4 {
			pcancel()
		}
	})
	if _, err := cb.PullRelease(pctx, rel.Digest); err == nil {
		t.Fatal("the interrupted pull succeeded")
	}
	px.setOnDone(nil)
	if b.HasRelease(rel.Digest) {
		t.Fatal("an interrupted pull published the release")
	}
	tmpEmpty(t, b)
	if _, err := cb.PullRelease(testCtx(t), rel.Digest); err != nil {
		t.Fatal(err)
	}
	root, _ := b.ReleaseRoot(rel.Digest)
	if d := treeDigest(t, root); d != rel.Digest {
		t.Errorf("digest %s after resumed push and pull, want %s", d, rel.Digest)
	}
}

func TestPullIntoFullStore(t *testing.T) {
	reg := startRegistry(t)
	px := newProxy(t, reg.addr)
	a := templatetest.Store(t)
	small := smallStore(t, 128<<20)
	ctx := testCtx(t)
	rel := makeRelease(t, a, "big", map[string][]byte{"data/big": random(112 << 20), "etc/hostname": []byte("x\n")})
	ca, cs := client(t, a, px.addr(), func(c *artifact.Config) { c.ChunkSize = 8 << 20 }), client(t, small, px.addr())
	art, err := ca.PushRelease(ctx, rel.Digest)
	if err != nil {
		t.Fatal(err)
	}

	// The declared size does not fit: refused before anything is downloaded.
	px.reset()
	_, err = cs.PullRelease(ctx, rel.Digest)
	wantKind(t, err, fault.InsufficientStorage)
	t.Logf("refused up front: %v", err)
	if n := px.count("GET", "blob"); n != 1 { // the config
		t.Errorf("%d blobs downloaded before refusing", n)
	}

	// An artifact that understates its size runs the store out of space while it is
	// received: that fails as cleanly.
	understate(t, art)
	_, err = cs.PullRelease(ctx, rel.Digest)
	wantKind(t, err, fault.InsufficientStorage)
	t.Logf("ran out while receiving: %v", err)
	if small.HasRelease(rel.Digest) {
		t.Fatal("release published")
	}
	tmpEmpty(t, small)
}

func TestUnreachableRegistry(t *testing.T) {
	a := templatetest.Store(t)
	ctx := testCtx(t)
	rel := makeRelease(t, a, "base", releaseFiles(1))
	addr := freeAddr(t) // nothing listens there
	c := client(t, a, addr)
	err := c.Check(ctx)
	wantKind(t, err, fault.Unavailable)
	_, err = c.PushRelease(ctx, rel.Digest)
	wantKind(t, err, fault.Unavailable)
	if !strings.Contains(err.Error(), addr+"/space") || !strings.Contains(err.Error(), "unreachable") {
		t.Errorf("error does not name the registry: %v", err)
	}
	t.Logf("push: %v", err)
	_, err = c.PullRelease(ctx, "sha256:"+strings.Repeat("ab", 32))
	wantKind(t, err, fault.Unavailable)
	_, err = c.PullSnapshot(ctx, "snap1", "")
	wantKind(t, err, fault.Unavailable)
	_, err = c.List(ctx, artifact.KindSnapshot)
	wantKind(t, err, fault.Unavailable)
	tmpEmpty(t, a)
}

// understate rewrites a pushed release artifact so that its config declares a tiny
// stream, as a broken or hostile pusher could.
func understate(t *testing.T, art artifact.Artifact) {
	t.Helper()
	ref, err := name.ParseReference(art.Reference)
	if err != nil {
		t.Fatal(err)
	}
	desc, err := remote.Get(ref)
	if err != nil {
		t.Fatal(err)
	}
	m, err := v1.ParseManifest(bytes.NewReader(desc.Manifest))
	if err != nil {
		t.Fatal(err)
	}
	l, err := remote.Layer(ref.Context().Digest(m.Config.Digest.String()))
	if err != nil {
		t.Fatal(err)
	}
	rc, err := l.Compressed()
	if err != nil {
		t.Fatal(err)
	}
	data, err := io.ReadAll(rc)
	rc.Close()
	if err != nil {
		t.Fatal(err)
	}
	var cfg map[string]any
	if err := json.Unmarshal(data, &cfg); err != nil {
		t.Fatal(err)
	}
	cfg["rootfs_bytes"] = 1024
	data, _ = json.Marshal(cfg)
	nl := static.NewLayer(data, m.Config.MediaType)
	if err := remote.WriteLayer(ref.Context(), nl); err != nil {
		t.Fatal(err)
	}
	m.Config.Digest, _ = nl.Digest()
	m.Config.Size = int64(len(data))
	mb, _ := json.Marshal(m)
	if err := remote.Put(ref, rawManifest(mb)); err != nil {
		t.Fatal(err)
	}
}

type rawManifest []byte

func (m rawManifest) RawManifest() ([]byte, error) { return m, nil }
func (m rawManifest) MediaType() (types.MediaType, error) {
	return types.OCIManifestSchema1, nil
}
