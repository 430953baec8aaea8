package artifact_test

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/spacedev/space/internal/artifact"
	"github.com/spacedev/space/internal/template/templatetest"
	"github.com/spacedev/space/internal/testenv"
)

// TestBaseTemplateArtifacts pushes and pulls the real base template and snapshots of a
// sandbox on it that wrote a little: the figures in docs/operations.md, "Registry".
func TestBaseTemplateArtifacts(t *testing.T) {
	if testing.Short() {
		t.Skip("pushes the base template (hundreds of MB)")
	}
	testenv.RequireBinary(t, "mkfs.ext4", "e2fsprogs")
	reg := startRegistry(t)
	a, b := templatetest.Store(t), templatetest.Store(t)
	ctx := testCtx(t)
	rel := templatetest.Base(t, a)
	ca, cb := client(t, a, reg.addr, func(c *artifact.Config) { c.ChunkSize = 0 }), client(t, b, reg.addr, func(c *artifact.Config) { c.ChunkSize = 0 })

	start := time.Now()
	art, err := ca.PushRelease(ctx, rel.Digest)
	if err != nil {
		t.Fatal(err)
	}
	push := time.Since(start)
	start = time.Now()
	if _, err := cb.PullRelease(ctx, rel.Digest); err != nil {
		t.Fatal(err)
	}
	pull := time.Since(start)
	t.Logf("base release: %d MB of files; %d MB in the registry (%d blobs); push %v, pull %v",
		rel.SizeBytes>>20, art.Size>>20, len(layerDigests(t, reg, art.Digest)), push.Round(time.Millisecond), pull.Round(time.Millisecond))

	// A gVisor sandbox that wrote a few files.
	root, err := a.CreateSandboxRoot(ctx, "sb1", rel.Digest)
	if err != nil {
		t.Fatal(err)
	}
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.MkdirAll(filepath.Join(root, "home/user/project"), 0o755))
	must(os.WriteFile(filepath.Join(root, "home/user/project/main.py"), []byte("print('hello')\n"), 0o644))
	must(os.WriteFile(filepath.Join(root, "home/user/data.bin"), random(100<<10), 0o644))
	must(os.WriteFile(filepath.Join(root, "etc/motd"), []byte("hi\n"), 0o644))
	cp, _ := a.CheckpointDir("sb1")
	fakeCheckpoint(t, a, cp)
	start = time.Now()
	snap, err := ca.PushSnapshot(ctx, artifact.SnapshotSource{ID: "sb1", Release: rel.Digest, Disk: root, Checkpoint: cp})
	if err != nil {
		t.Fatal(err)
	}
	spush := time.Since(start)
	sizes := partSizes(t, reg, snap.Digest)
	start = time.Now()
	if _, err := cb.PullSnapshot(ctx, "sb1", ""); err != nil {
		t.Fatal(err)
	}
	t.Logf("gVisor snapshot (100 KB written, 32 MB fake memory image): disk increment %d KB, checkpoint %d KB; push %v, pull %v",
		sizes["disk"]>>10, sizes["checkpoint"]>>10, spush.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))

	// A VM sandbox of the same release that wrote 1 MB.
	start = time.Now()
	if _, err := a.ReleaseImage(ctx, rel.Digest, 0); err != nil {
		t.Fatal(err)
	}
	t.Logf("release image built in %v", time.Since(start).Round(time.Millisecond))
	disk, err := a.CreateSandboxDisk(ctx, "vm1", rel.Digest, 0)
	if err != nil {
		t.Fatal(err)
	}
	var offs []int64
	for i := int64(0); i < 256; i++ {
		offs = append(offs, 1<<30+i*4096*7)
	}
	writeAt(t, disk, offs...)
	cpv, _ := a.CheckpointDir("vm1")
	fakeCheckpoint(t, a, cpv)
	start = time.Now()
	vsnap, err := ca.PushSnapshot(ctx, artifact.SnapshotSource{ID: "vm1", Release: rel.Digest, Disk: disk, Checkpoint: cpv})
	if err != nil {
		t.Fatal(err)
	}
	vpush := time.Since(start)
	vs := partSizes(t, reg, vsnap.Digest)
	start = time.Now()
	if _, err := cb.PullSnapshot(ctx, "vm1", ""); err != nil {
		t.Fatal(err)
	}
	vpull := time.Since(start)
	disk2, err := a.CreateSandboxDisk(ctx, "vm2", rel.Digest, 0)
	if err != nil {
		t.Fatal(err)
	}
	writeAt(t, disk2, offs...)
	cpv2, _ := a.CheckpointDir("vm2")
	fakeCheckpoint(t, a, cpv2)
	start = time.Now()
	vsnap2, err := ca.PushSnapshot(ctx, artifact.SnapshotSource{ID: "vm2", Release: rel.Digest, Disk: disk2, Checkpoint: cpv2})
	if err != nil {
		t.Fatal(err)
	}
	vpush2 := time.Since(start)
	start = time.Now()
	if _, err := cb.PullSnapshot(ctx, "vm2", ""); err != nil {
		t.Fatal(err)
	}
	t.Logf("ext4 snapshot (1 MB written): base %d MB, disk increment %d KB; first push %v, pull %v; second snapshot uploads %d KB, push %v, pull %v",
		vs["base"]>>20, vs["disk"]>>10, vpush.Round(time.Millisecond), vpull.Round(time.Millisecond),
		vsnap2.Uploaded>>10, vpush2.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
}
