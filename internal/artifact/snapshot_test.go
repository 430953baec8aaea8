package artifact_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/spacedev/space/internal/artifact"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/storage"
	"github.com/spacedev/space/internal/template/templatetest"
	"github.com/spacedev/space/internal/testenv"
)

// partSizes returns the compressed bytes of each part of a pushed artifact, read from
// the registry's storage.
func partSizes(t *testing.T, reg *registry, digest string) map[string]int64 {
	t.Helper()
	data, err := os.ReadFile(reg.blobPath(digest))
	if err != nil {
		t.Fatal(err)
	}
	m, err := v1.ParseManifest(bytes.NewReader(data))
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]int64{"config": m.Config.Size}
	for _, l := range m.Layers {
		out[l.Annotations["dev.space.part"]] += l.Size
	}
	return out
}

// fakeCheckpoint writes a checkpoint into dir as a runtime would: a memory image with
// a few pages of data among empty ones, and device state; then marks it complete.
func fakeCheckpoint(t *testing.T, st *storage.Store, dir string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Join(dir, "state"), 0o700); err != nil {
		t.Fatal(err)
	}
	mem := make([]byte, 32<<20)
	copy(mem[1<<20:], random(256<<10))
	copy(mem[20<<20:], bytes.Repeat([]byte("page"), 64<<10))
	if err := os.WriteFile(filepath.Join(dir, "checkpoint.img"), mem, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "state", "devices.json"), []byte(`{"net":"eth0"}`), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := st.MarkComplete(dir); err != nil {
		t.Fatal(err)
	}
}

// sameCheckpoint compares two checkpoint directories file by file (marker included).
func sameCheckpoint(t *testing.T, a, b string) {
	t.Helper()
	for _, f := range []string{"checkpoint.img", "state/devices.json", "complete"} {
		if sha(t, filepath.Join(a, f)) != sha(t, filepath.Join(b, f)) {
			t.Errorf("checkpoint file %s differs", f)
		}
	}
}

// writeSandbox changes a sandbox root filesystem a little, as a short session would.
func writeSandbox(t *testing.T, root string) {
	t.Helper()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.MkdirAll(filepath.Join(root, "home/user/project"), 0o755))
	must(os.WriteFile(filepath.Join(root, "home/user/project/main.py"), []byte("print('hi')\n"), 0o644))
	must(os.WriteFile(filepath.Join(root, "home/user/data.bin"), random(64<<10), 0o600))
	must(os.WriteFile(filepath.Join(root, "etc/motd"), []byte("changed\n"), 0o644))
	must(os.Remove(filepath.Join(root, "etc/hostname")))
	must(os.Symlink("../etc/motd", filepath.Join(root, "home/user/motd")))
	must(os.Chmod(filepath.Join(root, "usr/share/a.txt"), 0o600))
}

func TestSnapshotIncrementRootfs(t *testing.T) {
	reg := startRegistry(t)
	px := newProxy(t, reg.addr)
	a, b := templatetest.Store(t), templatetest.Store(t)
	ctx := testCtx(t)
	rel := makeRelease(t, a, "base", releaseFiles(8))
	ca, cb := client(t, a, px.addr()), client(t, b, px.addr())

	root, err := a.CreateSandboxRoot(ctx, "sb1", rel.Digest)
	if err != nil {
		t.Fatal(err)
	}
	writeSandbox(t, root)
	cp, _ := a.CheckpointDir("sb1")
	fakeCheckpoint(t, a, cp)
	meta := json.RawMessage(`{"runtime":"gvisor","memory_mb":512}`)
	art, err := ca.PushSnapshot(ctx, artifact.SnapshotSource{ID: "sb1-1", Release: rel.Digest, Disk: root, Checkpoint: cp, Meta: meta})
	if err != nil {
		t.Fatal(err)
	}
	sizes := partSizes(t, reg, art.Digest)
	relArts, err := ca.List(ctx, artifact.KindRelease)
	if err != nil || len(relArts) != 1 {
		t.Fatalf("the release was not pushed along: %v %v", relArts, err)
	}
	t.Logf("release: %d bytes; snapshot: disk increment %d bytes, checkpoint %d, config %d; uploaded for the snapshot and its release %d",
		relArts[0].Size, sizes["disk"], sizes["checkpoint"], sizes["config"], art.Uploaded)
	if sizes["base"] != 0 {
		t.Errorf("a snapshot on a pushed release carries a base of %d bytes", sizes["base"])
	}
	// What the sandbox wrote: 64 KiB of random data and a few small files.
	if sizes["disk"] > 96<<10 || sizes["disk"] < 64<<10 {
		t.Errorf("disk increment is %d bytes; want about 64 KiB", sizes["disk"])
	}
	if art.OwnSize != art.Size || art.Snapshot != "sb1-1" || art.Release != rel.Digest {
		t.Errorf("artifact %+v", art)
	}

	// Another store: the release comes along, the files and checkpoint are reproduced.
	s, err := cb.PullSnapshot(ctx, "sb1-1", "")
	if err != nil {
		t.Fatal(err)
	}
	if !b.HasRelease(rel.Digest) {
		t.Error("the snapshot's release was not pulled")
	}
	if s.Digest != art.Digest || s.ID != "sb1-1" || s.Release != rel.Digest || s.Format != artifact.DiskRootfs || string(s.Meta) != string(meta) || s.PushedAt.IsZero() {
		t.Errorf("snapshot %+v", s)
	}
	if got, want := treeDigest(t, s.Disk), treeDigest(t, root); got != want {
		t.Errorf("pulled root filesystem digest %s, want %s", got, want)
	}
	if !b.IsComplete(s.Checkpoint) {
		t.Error("pulled checkpoint is not complete")
	}
	sameCheckpoint(t, cp, s.Checkpoint)
	var st struct{ blocks int64 }
	if fi, err := os.Stat(filepath.Join(s.Checkpoint, "checkpoint.img")); err == nil {
		st.blocks = statBlocks(fi)
	}
	if st.blocks*512 > 4<<20 {
		t.Errorf("the pulled memory image takes %d bytes: its empty pages were written", st.blocks*512)
	}
	t.Logf("pulled: %d bytes downloaded (release included)", s.Downloaded)

	// A sandbox is made from it with an O(1) copy and is writable.
	dst, _ := b.SandboxRoot("sb2")
	if err := b.CopyDisk(ctx, s.Disk, dst, false); err != nil {
		t.Fatal(err)
	}
	if got, want := treeDigest(t, dst), treeDigest(t, root); got != want {
		t.Errorf("sandbox made from the snapshot: digest %s, want %s", got, want)
	}
	if err := os.WriteFile(filepath.Join(dst, "new"), []byte("x"), 0o644); err != nil {
		t.Errorf("sandbox made from the snapshot is not writable: %v", err)
	}
	tmpEmpty(t, b)

	// Present: by id one HEAD request, by digest none, and nothing downloaded.
	px.reset()
	again, err := cb.PullSnapshot(ctx, "sb1-1", "")
	if err != nil {
		t.Fatal(err)
	}
	if again.Downloaded != 0 || px.count("GET", "blob") != 0 || px.count("GET", "manifest") != 0 || px.count("HEAD", "manifest") != 1 {
		t.Errorf("second pull by id: %d bytes downloaded, %d requests (%d blob GETs)", again.Downloaded, px.total(), px.count("GET", "blob"))
	}
	px.reset()
	if _, err := cb.PullSnapshot(ctx, "", art.Digest); err != nil {
		t.Fatal(err)
	}
	if n := px.total(); n != 0 {
		t.Errorf("pull by digest of a present snapshot made %d requests", n)
	}
	cached, err := cb.CachedSnapshots()
	if err != nil || len(cached) != 1 || cached[0].Digest != art.Digest {
		t.Errorf("cached snapshots %+v (%v)", cached, err)
	}
	if err := cb.DeleteCachedSnapshot(ctx, art.Digest); err != nil {
		t.Fatal(err)
	}
	if cached, _ := cb.CachedSnapshots(); len(cached) != 0 {
		t.Errorf("after delete: %+v", cached)
	}
}

// TestSnapshotAcrossReleaseBuilds: two stores built the same release themselves (same
// digest, different subvolumes). A snapshot still travels between them.
func TestSnapshotAcrossReleaseBuilds(t *testing.T) {
	reg := startRegistry(t)
	a, b, c := templatetest.Store(t), templatetest.Store(t), templatetest.Store(t)
	ctx := testCtx(t)
	files := releaseFiles(4)
	rel := makeRelease(t, a, "base", files)
	if relB := makeRelease(t, b, "base", files); relB.Digest != rel.Digest {
		t.Fatalf("builds differ: %s %s", relB.Digest, rel.Digest)
	}
	ca, cb, cc := client(t, a, reg.addr), client(t, b, reg.addr), client(t, c, reg.addr)
	if _, err := ca.PushRelease(ctx, rel.Digest); err != nil {
		t.Fatal(err)
	}

	// b's snapshot: the registry's release is a's build, so b sends its own as a base.
	root, err := b.CreateSandboxRoot(ctx, "sb1", rel.Digest)
	if err != nil {
		t.Fatal(err)
	}
	writeSandbox(t, root)
	cp, _ := b.CheckpointDir("sb1")
	fakeCheckpoint(t, b, cp)
	art, err := cb.PushSnapshot(ctx, artifact.SnapshotSource{ID: "from-b", Release: rel.Digest, Disk: root, Checkpoint: cp})
	if err != nil {
		t.Fatal(err)
	}
	sizes := partSizes(t, reg, art.Digest)
	t.Logf("snapshot from a store with its own build: base %d, disk %d, checkpoint %d", sizes["base"], sizes["disk"], sizes["checkpoint"])
	if sizes["base"] < 4<<20 || sizes["disk"] > 96<<10 {
		t.Errorf("parts %v", sizes)
	}
	// a pulls it (a's release is not its parent: the base comes along).
	s, err := ca.PullSnapshot(ctx, "from-b", "")
	if err != nil {
		t.Fatal(err)
	}
	if treeDigest(t, s.Disk) != treeDigest(t, root) {
		t.Error("pulled into a: files differ")
	}

	// a's snapshot pulled into b: the parent is the registry's release, b's own build is
	// another subvolume, so b gets the registry's copy as a base.
	rootA, err := a.CreateSandboxRoot(ctx, "sb2", rel.Digest)
	if err != nil {
		t.Fatal(err)
	}
	writeSandbox(t, rootA)
	cpA, _ := a.CheckpointDir("sb2")
	fakeCheckpoint(t, a, cpA)
	if _, err := ca.PushSnapshot(ctx, artifact.SnapshotSource{ID: "from-a", Release: rel.Digest, Disk: rootA, Checkpoint: cpA}); err != nil {
		t.Fatal(err)
	}
	sb, err := cb.PullSnapshot(ctx, "from-a", "")
	if err != nil {
		t.Fatal(err)
	}
	if treeDigest(t, sb.Disk) != treeDigest(t, rootA) {
		t.Error("pulled into b: files differ")
	}
	// And c, which has nothing, pulls both.
	for id, want := range map[string]string{"from-a": rootA, "from-b": root} {
		sc, err := cc.PullSnapshot(ctx, id, "")
		if err != nil {
			t.Fatal(err)
		}
		if treeDigest(t, sc.Disk) != treeDigest(t, want) {
			t.Errorf("pulled %s into c: files differ", id)
		}
	}
	for _, st := range []*storage.Store{a, b, c} {
		tmpEmpty(t, st)
	}
}

func TestSnapshotIncrementExt4(t *testing.T) {
	testenv.RequireBinary(t, "mkfs.ext4", "e2fsprogs")
	reg := startRegistry(t)
	px := newProxy(t, reg.addr)
	a, b := templatetest.Store(t), templatetest.Store(t)
	ctx := testCtx(t)
	rel := makeRelease(t, a, "base", releaseFiles(8))
	if _, err := a.ReleaseImage(ctx, rel.Digest, 256<<20); err != nil {
		t.Fatal(err)
	}
	ca, cb := client(t, a, px.addr()), client(t, b, px.addr())

	vm := func(st *storage.Store, id string, offsets ...int64) (string, string) {
		t.Helper()
		disk, err := st.CreateSandboxDisk(ctx, id, rel.Digest, 0)
		if err != nil {
			t.Fatal(err)
		}
		writeAt(t, disk, offsets...)
		cp, _ := st.CheckpointDir(id)
		fakeCheckpoint(t, st, cp)
		return disk, cp
	}
	disk1, cp1 := vm(a, "vm1", 100<<20, 7<<20, 7<<20+4096)
	art1, err := ca.PushSnapshot(ctx, artifact.SnapshotSource{ID: "vm1-1", Release: rel.Digest, Disk: disk1, Checkpoint: cp1})
	if err != nil {
		t.Fatal(err)
	}
	s1 := partSizes(t, reg, art1.Digest)
	t.Logf("first ext4 snapshot: base %d, disk increment %d, checkpoint %d; uploaded %d", s1["base"], s1["disk"], s1["checkpoint"], art1.Uploaded)
	if s1["base"] < 8<<20 || s1["disk"] > 128<<10 {
		t.Errorf("parts %v", s1)
	}
	// A second sandbox of the release: the base is in the registry already.
	disk2, cp2 := vm(a, "vm2", 50<<20)
	art2, err := ca.PushSnapshot(ctx, artifact.SnapshotSource{ID: "vm2-1", Release: rel.Digest, Disk: disk2, Checkpoint: cp2})
	if err != nil {
		t.Fatal(err)
	}
	s2 := partSizes(t, reg, art2.Digest)
	t.Logf("second ext4 snapshot: disk increment %d, checkpoint %d; uploaded %d, own size %d", s2["disk"], s2["checkpoint"], art2.Uploaded, art2.OwnSize)
	if art2.Uploaded > 1<<20 || s2["base"] != s1["base"] {
		t.Errorf("second snapshot uploaded %d bytes (base %d vs %d)", art2.Uploaded, s2["base"], s1["base"])
	}

	// Pulled into another store: the image is reproduced bit for bit.
	p1, err := cb.PullSnapshot(ctx, "vm1-1", "")
	if err != nil {
		t.Fatal(err)
	}
	if p1.Format != artifact.DiskExt4 || sha(t, p1.Disk) != sha(t, disk1) {
		t.Fatalf("pulled image differs (format %s)", p1.Format)
	}
	sameCheckpoint(t, cp1, p1.Checkpoint)
	// The second needs no base download.
	p2, err := cb.PullSnapshot(ctx, "vm2-1", "")
	if err != nil {
		t.Fatal(err)
	}
	if sha(t, p2.Disk) != sha(t, disk2) {
		t.Fatal("second pulled image differs")
	}
	t.Logf("pulls: first %d bytes downloaded, second %d", p1.Downloaded, p2.Downloaded)
	if p2.Downloaded > 1<<20 {
		t.Errorf("second pull downloaded %d bytes", p2.Downloaded)
	}

	// A sandbox made in b from the pulled snapshot, suspended again and pushed: its disk
	// shares the pulled base, whose blobs the registry has: nothing big is uploaded.
	disk3, err := b.SandboxDisk("vm3")
	if err != nil {
		t.Fatal(err)
	}
	if err := b.CopyDisk(ctx, p1.Disk, disk3, false); err != nil {
		t.Fatal(err)
	}
	writeAt(t, disk3, 60<<20)
	cp3, _ := b.CheckpointDir("vm3")
	fakeCheckpoint(t, b, cp3)
	art3, err := cb.PushSnapshot(ctx, artifact.SnapshotSource{ID: "vm3-1", Release: rel.Digest, Disk: disk3, Checkpoint: cp3})
	if err != nil {
		t.Fatal(err)
	}
	s3 := partSizes(t, reg, art3.Digest)
	t.Logf("snapshot of a migrated VM: disk increment %d (since the base), uploaded %d", s3["disk"], art3.Uploaded)
	if art3.Uploaded > 1<<20 {
		t.Errorf("uploaded %d bytes", art3.Uploaded)
	}
	p3, err := ca.PullSnapshot(ctx, "vm3-1", "")
	if err != nil {
		t.Fatal(err)
	}
	if sha(t, p3.Disk) != sha(t, disk3) {
		t.Error("image pulled back differs")
	}
	tmpEmpty(t, a)
	tmpEmpty(t, b)
}

// writeAt writes 4 KiB of random data at each offset of the file, as a guest would.
func writeAt(t *testing.T, path string, offsets ...int64) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, off := range offsets {
		if _, err := f.WriteAt(random(4096), off); err != nil {
			t.Fatal(err)
		}
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
}

func TestSnapshotPullFailsCleanly(t *testing.T) {
	reg := startRegistry(t)
	px := newProxy(t, reg.addr)
	a, b := templatetest.Store(t), templatetest.Store(t)
	ctx := testCtx(t)
	rel := makeRelease(t, a, "base", releaseFiles(2))
	ca, cb := client(t, a, px.addr()), client(t, b, px.addr())
	root, err := a.CreateSandboxRoot(ctx, "sb1", rel.Digest)
	if err != nil {
		t.Fatal(err)
	}
	writeSandbox(t, root)
	cp, _ := a.CheckpointDir("sb1")
	fakeCheckpoint(t, a, cp)
	art, err := ca.PushSnapshot(ctx, artifact.SnapshotSource{ID: "s", Release: rel.Digest, Disk: root, Checkpoint: cp})
	if err != nil {
		t.Fatal(err)
	}
	nothingPulled := func() {
		t.Helper()
		if cached, _ := cb.CachedSnapshots(); len(cached) != 0 {
			t.Errorf("a failed pull left %+v", cached)
		}
		tmpEmpty(t, b)
	}

	// Interrupted once the release is in and the snapshot's first blob is downloaded.
	pctx, cancel := context.WithCancel(ctx)
	defer cancel()
	px.setOnDone(func(method, kind string, status int) {
		if method == "GET" && kind == "blob" && b.HasRelease(rel.Digest) {
			cancel()
		}
	})
	if _, err := cb.PullSnapshot(pctx, "s", ""); err == nil {
		t.Fatal("interrupted pull succeeded")
	}
	px.setOnDone(nil)
	nothingPulled()

	// A checkpoint blob changed in the registry is refused.
	blobs := layerDigests(t, reg, art.Digest)
	path := reg.blobPath(blobs[len(blobs)-1])
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	data[len(data)-1] ^= 1
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
	_, err = cb.PullSnapshot(ctx, "", art.Digest)
	wantKind(t, err, fault.BadGateway)
	t.Logf("tampered: %v", err)
	nothingPulled()
}

// TestSnapshotCarriesAgent: a snapshot pushed with the agent binary its checkpoint
// restores with carries it; the registry holds one copy for every snapshot that names
// it (later pushes upload none of it, and it is not counted as the artifact's own); a
// pull names it without downloading it, and PullAgent gets it byte for byte; a
// snapshot without one names none. Pushing a directory as the agent is refused.
func TestSnapshotCarriesAgent(t *testing.T) {
	reg := startRegistry(t)
	px := newProxy(t, reg.addr)
	a, b := templatetest.Store(t), templatetest.Store(t)
	ctx := testCtx(t)
	rel := makeRelease(t, a, "base", releaseFiles(2))
	ca, cb := client(t, a, px.addr()), client(t, b, px.addr())
	agent := filepath.Join(t.TempDir(), "space-agent")
	if err := os.WriteFile(agent, random(3<<20), 0o755); err != nil {
		t.Fatal(err)
	}
	push := func(id string, withAgent bool) artifact.Artifact {
		t.Helper()
		root, err := a.CreateSandboxRoot(ctx, id, rel.Digest)
		if err != nil {
			t.Fatal(err)
		}
		writeSandbox(t, root)
		cp, _ := a.CheckpointDir(id)
		fakeCheckpoint(t, a, cp)
		src := artifact.SnapshotSource{ID: id, Release: rel.Digest, Disk: root, Checkpoint: cp}
		if withAgent {
			src.Agent = agent
		}
		art, err := ca.PushSnapshot(ctx, src)
		if err != nil {
			t.Fatal(err)
		}
		return art
	}
	first := push("sb1", true)
	second := push("sb2", true)
	plain := push("sb3", false)
	agentBlobs := partSizes(t, reg, first.Digest)["agent"]
	if agentBlobs < 3<<20 {
		t.Fatalf("the agent part is %d bytes; want the (incompressible) 3 MiB binary", agentBlobs)
	}
	if got := partSizes(t, reg, second.Digest)["agent"]; got != agentBlobs {
		t.Errorf("the second snapshot's agent part is %d bytes, the first's %d", got, agentBlobs)
	}
	if second.Uploaded >= agentBlobs {
		t.Errorf("the second push uploaded %d bytes: the agent (%d) again", second.Uploaded, agentBlobs)
	}
	if second.OwnSize != second.Size-agentBlobs {
		t.Errorf("own size %d of %d: the shared agent (%d) is counted as the snapshot's own", second.OwnSize, second.Size, agentBlobs)
	}
	if partSizes(t, reg, plain.Digest)["agent"] != 0 {
		t.Error("a snapshot pushed without an agent carries one")
	}
	t.Logf("agent part %d bytes; first push uploaded %d, second %d", agentBlobs, first.Uploaded, second.Uploaded)

	// A pull gets the snapshot without its agent; PullAgent then gets the binary.
	px.reset()
	s, err := cb.PullSnapshot(ctx, "", second.Digest)
	if err != nil {
		t.Fatal(err)
	}
	if want := sha(t, agent); s.AgentSHA256 != hex.EncodeToString(want[:]) {
		t.Fatalf("pulled snapshot names agent sha256 %q", s.AgentSHA256)
	}
	if s.Downloaded >= agentBlobs {
		t.Errorf("the pull downloaded %d bytes: the agent (%d) with it", s.Downloaded, agentBlobs)
	}
	var got bytes.Buffer
	if err := cb.PullAgent(ctx, s, &got); err != nil {
		t.Fatal(err)
	}
	if sum := sha256.Sum256(got.Bytes()); sum != sha(t, agent) {
		t.Fatalf("pulled agent differs from the pushed one (%d bytes)", got.Len())
	}
	cached, err := cb.CachedSnapshots()
	if err != nil || len(cached) != 1 || cached[0].AgentSHA256 != s.AgentSHA256 {
		t.Fatalf("cached snapshots %+v (%v)", cached, err)
	}
	got.Reset()
	if err := cb.PullAgent(ctx, cached[0], &got); err != nil || got.Len() != 3<<20 {
		t.Errorf("agent of the cached snapshot: %d bytes (%v)", got.Len(), err)
	}
	ps, err := cb.PullSnapshot(ctx, "", plain.Digest)
	if err != nil || ps.AgentSHA256 != "" {
		t.Errorf("snapshot without an agent pulled naming %q (%v)", ps.AgentSHA256, err)
	}
	wantKind(t, cb.PullAgent(ctx, ps, &got), fault.NotFound)
	tmpEmpty(t, b)

	cp, _ := a.CheckpointDir("sb1")
	root, _ := a.SandboxRoot("sb1")
	_, err = ca.PushSnapshot(ctx, artifact.SnapshotSource{ID: "sb4", Release: rel.Digest, Disk: root, Checkpoint: cp, Agent: t.TempDir()})
	wantKind(t, err, fault.Invalid)
}
