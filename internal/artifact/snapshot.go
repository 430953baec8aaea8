package artifact

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	"github.com/spacedev/space/internal/durable"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/storage"
)

// DiskFormat is how a runtime keeps a sandbox's disk.
type DiskFormat string

// Disk formats.
const (
	// DiskRootfs is a root filesystem directory: a btrfs subvolume (gVisor).
	DiskRootfs DiskFormat = "rootfs"
	// DiskExt4 is an ext4 image file (VM runtimes).
	DiskExt4 DiskFormat = "ext4"
)

// subvolume returns the name of the subvolume a disk of this format travels in.
func (f DiskFormat) subvolume() string {
	if f == DiskExt4 {
		return "disk"
	}
	return "rootfs"
}

const (
	partBase       = "base"
	partDisk       = "disk"
	partCheckpoint = "checkpoint"
	partAgent      = "agent"

	parentRelease = "release" // the parent is the release artifact
	parentBase    = "base"    // the parent travels in the snapshot's base part

	imageName     = "disk.ext4"
	checkpointDir = "checkpoint"
	snapshotFile  = "snapshot.json"
	baseFile      = "base.json"

	// maxAgentBytes bounds the agent binary a snapshot carries (space-agent is about
	// 14 MB).
	maxAgentBytes = 256 << 20
)

// snapshotConfig is the config blob of a snapshot artifact.
type snapshotConfig struct {
	Format  string `json:"format"`
	ID      string `json:"id"`
	Release string `json:"release"`
	Disk    struct {
		Format DiskFormat `json:"format"`
		// Bytes is the length of the disk's (incremental) send stream.
		Bytes int64 `json:"bytes"`
	} `json:"disk"`
	Parent struct {
		// Source says where the parent of the disk's increment comes from: "release" (the
		// release artifact) or "base" (this artifact's base part).
		Source string `json:"source"`
		// Identity is the parent's send identity (storage.SendIdentity).
		Identity string `json:"identity"`
		// Bytes is the length of the base part's stream (source "base").
		Bytes int64 `json:"bytes,omitempty"`
	} `json:"parent"`
	CheckpointBytes int64 `json:"checkpoint_bytes"`
	// Agent is the agent binary the checkpoint restores with, when it needs a host
	// file (runtime.AgentMapper): its part "agent".
	Agent *agentRecord    `json:"agent,omitempty"`
	Meta  json.RawMessage `json:"meta,omitempty"`
}

// agentRecord describes the agent binary a snapshot carries.
type agentRecord struct {
	SHA256 string `json:"sha256"` // hex, of the binary
	Bytes  int64  `json:"bytes"`
}

// SnapshotSource is what PushSnapshot sends: a suspended sandbox (or a clone batch, or
// a base snapshot) as one artifact.
type SnapshotSource struct {
	// ID names the snapshot: its tag in <prefix>/snapshots. Pushing again under an id
	// moves the tag to the new artifact.
	ID string
	// Release is the digest of the release the disk was made from; it must be in the
	// store.
	Release string
	// Disk is the disk, in the store: a root filesystem subvolume (gVisor) or an ext4
	// image file (VM runtimes). It must not change during the push.
	Disk string
	// Checkpoint is a complete checkpoint directory (storage.MarkComplete).
	Checkpoint string
	// Agent, when set, is the host file of the agent binary a restore of the checkpoint
	// needs (runtime.AgentMapper): it travels with the snapshot, in blobs that every
	// snapshot naming the same binary shares, so that a node running another space
	// build can restore it.
	Agent string
	// Meta is the caller's (the sandbox's spec, the runtime and its version...); a pull
	// returns it as it is. It must be JSON.
	Meta json.RawMessage
}

// Snapshot is a snapshot pulled into the store (storage.PulledSnapshots). It is
// read-only: a sandbox is made from it with O(1) copies, storage.CopyDisk of Disk and
// storage.CopyTree of Checkpoint, which then needs storage.MarkComplete.
type Snapshot struct {
	// Digest is the artifact's digest, which also names it in the store.
	Digest   string
	ID       string
	Release  string
	Format   DiskFormat
	PushedAt time.Time
	// Disk is the disk: a read-only subvolume (DiskRootfs) or image file (DiskExt4).
	Disk string
	// Checkpoint is the complete checkpoint directory.
	Checkpoint string
	// AgentSHA256 is the sha256 (hex) of the agent binary the checkpoint restores with,
	// which the snapshot carries ("" when it carries none). A pull does not download it:
	// PullAgent does, for a caller that lacks that binary.
	AgentSHA256 string
	agent       agentRecord
	agentLayers []v1.Descriptor
	Meta        json.RawMessage
	// Downloaded is the bytes this pull downloaded (0: the store had it).
	Downloaded int64
}

// pulledFile is the metadata file of a pulled snapshot.
type pulledFile struct {
	Digest   string         `json:"digest"`
	PushedAt time.Time      `json:"pushed_at"`
	Config   snapshotConfig `json:"config"`
	// AgentLayers are the blobs of its part "agent", which PullAgent downloads when the
	// caller lacks the binary.
	AgentLayers []v1.Descriptor `json:"agent_layers,omitempty"`
}

// baseInfo is the metadata file of a disk base.
type baseInfo struct {
	Release  string     `json:"release"`
	Format   DiskFormat `json:"format"`
	Identity string     `json:"identity"`
	// Origin is "local" (made here from the release image) or "pulled".
	Origin string `json:"origin"`
	// Layers are the blobs of a pulled base in the snapshots repository: a snapshot
	// pushed from a disk made from this base names them instead of uploading the base
	// again.
	Layers []v1.Descriptor `json:"layers,omitempty"`
	Bytes  int64           `json:"bytes,omitempty"`
}

// identName names a base in the store after its identity.
func identName(ident string) string { return strings.ReplaceAll(ident, "-", "") }

// PushSnapshot pushes a snapshot (a disk and a checkpoint) as <prefix>/snapshots:<ID>.
// The disk goes as an increment on a parent that receivers have or can get: for a
// root filesystem, the release (which is pushed first if the registry lacks it); for an
// ext4 image, a base image of the release, pushed with the first snapshot that needs it
// and shared by later ones (see doc.go). A snapshot of a sandbox that wrote little is
// therefore small. The manifest goes last; an interrupted push re-sends only the blobs
// still missing.
func (c *Client) PushSnapshot(ctx context.Context, src SnapshotSource) (Artifact, error) {
	if err := validateTag(src.ID); err != nil {
		return Artifact{}, err
	}
	if err := storage.ValidateDigest(src.Release); err != nil {
		return Artifact{}, fault.Wrap(fault.Invalid, err)
	}
	if !c.st.IsComplete(src.Checkpoint) {
		return Artifact{}, fault.New(fault.Conflict, "push snapshot %s: checkpoint %s is not complete", src.ID, src.Checkpoint)
	}
	if len(src.Meta) > 0 && !json.Valid(src.Meta) {
		return Artifact{}, fault.New(fault.Invalid, "push snapshot %s: meta is not JSON", src.ID)
	}
	if src.Agent != "" {
		if fi, err := os.Stat(src.Agent); err != nil || !fi.Mode().IsRegular() || fi.Size() > maxAgentBytes {
			return Artifact{}, fault.New(fault.Invalid, "push snapshot %s: agent %s is not a regular file of at most %d bytes (%v)", src.ID, src.Agent, maxAgentBytes, err)
		}
	}
	fi, err := os.Lstat(src.Disk)
	if err != nil {
		return Artifact{}, fault.New(fault.NotFound, "push snapshot %s: disk: %v", src.ID, err)
	}
	var format DiskFormat
	switch {
	case fi.IsDir():
		format = DiskRootfs
	case fi.Mode().IsRegular():
		format = DiskExt4
	default:
		return Artifact{}, fault.New(fault.Invalid, "push snapshot %s: disk %s is neither a directory nor a file", src.ID, src.Disk)
	}
	// A root filesystem is sent against its release; an image against a base that
	// may have come with a pulled snapshot, without the release.
	if format == DiskRootfs && !c.st.HasRelease(src.Release) {
		return Artifact{}, fault.New(fault.NotFound, "push snapshot %s: release %s is not in this store", src.ID, src.Release)
	}
	a, err := c.pushSnapshot(ctx, src, format)
	if err != nil {
		return Artifact{}, fmt.Errorf("push snapshot %s: %w", src.ID, err)
	}
	return a, nil
}

func (c *Client) pushSnapshot(ctx context.Context, src SnapshotSource, format DiskFormat) (Artifact, error) {
	start := time.Now()
	o := c.newOp(ctx)
	p, err := o.pusher()
	if err != nil {
		return Artifact{}, err
	}
	pl, err := o.puller()
	if err != nil {
		return Artifact{}, err
	}
	tmp, err := c.st.TempDir("push")
	if err != nil {
		return Artifact{}, err
	}
	defer c.st.RemoveAll(context.WithoutCancel(ctx), tmp)

	cfg := snapshotConfig{Format: formatSnapshot, ID: src.ID, Release: src.Release, Meta: src.Meta}
	cfg.Disk.Format = format
	// The disk is sent as a read-only snapshot (send needs one, and it pins what is
	// sent), as an increment on parent.
	send := filepath.Join(tmp, format.subvolume())
	var parent string
	switch format {
	case DiskRootfs:
		if parent, err = c.st.ReleaseRoot(src.Release); err != nil {
			return Artifact{}, err
		}
		ident, err := c.st.SendIdentity(parent)
		if err != nil {
			return Artifact{}, err
		}
		regIdent, err := o.releaseIdentity(ctx, p, pl, src.Release, parent)
		if err != nil {
			return Artifact{}, err
		}
		cfg.Parent.Source, cfg.Parent.Identity = parentRelease, ident
		if regIdent != ident {
			// This node built the release itself; the registry holds another build of
			// it (same files, another subvolume), which this increment cannot apply to.
			c.log.InfoContext(ctx, "artifact: the registry holds another copy of the release; its snapshots carry this node's as their base",
				"release", src.Release, "local", ident, "registry", regIdent)
			cfg.Parent.Source = parentBase
		}
		if err := c.st.Snapshot(ctx, src.Disk, send, true); err != nil {
			return Artifact{}, err
		}
	case DiskExt4:
		var ident string
		if parent, ident, err = c.diskBase(ctx, src.Release, src.Disk); err != nil {
			return Artifact{}, err
		}
		cfg.Parent.Source, cfg.Parent.Identity = parentBase, ident
		// A snapshot of the base whose image is then replaced by a reflink of the disk:
		// the same inode, so send compares the two images extent by extent and sends only
		// the extents the sandbox wrote.
		if err := c.st.Snapshot(ctx, parent, send, false); err != nil {
			return Artifact{}, err
		}
		if err := c.st.ReflinkInto(src.Disk, filepath.Join(send, imageName)); err != nil {
			return Artifact{}, err
		}
		if err := c.st.SetReadOnly(ctx, send, true); err != nil {
			return Artifact{}, err
		}
	}

	var layers []v1.Descriptor
	if cfg.Parent.Source == parentBase {
		rec, err := o.pushBase(ctx, p, pl, parent, cfg.Parent.Identity)
		if err != nil {
			return Artifact{}, err
		}
		layers = append(layers, rec.Layers...)
		cfg.Parent.Bytes = rec.Bytes
	}
	disk, err := o.pushStream(ctx, p, c.snapshots, partDisk, mediaSend, func(ctx context.Context, w io.Writer) error {
		return c.st.Send(ctx, send, parent, w)
	})
	if err != nil {
		return Artifact{}, err
	}
	cfg.Disk.Bytes = disk.Bytes
	layers = append(layers, disk.Layers...)
	cp, err := o.pushStream(ctx, p, c.snapshots, partCheckpoint, mediaTar, func(ctx context.Context, w io.Writer) error {
		return writeCheckpoint(ctx, src.Checkpoint, w)
	})
	if err != nil {
		return Artifact{}, err
	}
	cfg.CheckpointBytes = cp.Bytes
	layers = append(layers, cp.Layers...)
	if src.Agent != "" {
		rec, sum, err := o.pushAgent(ctx, p, pl, src.Agent)
		if err != nil {
			return Artifact{}, err
		}
		cfg.Agent = &agentRecord{SHA256: sum, Bytes: rec.Bytes}
		layers = append(layers, rec.Layers...)
	}

	cfgData, err := jsonBytes(cfg)
	if err != nil {
		return Artifact{}, err
	}
	cfgDesc, err := o.uploadBlob(ctx, p, c.snapshots, mediaSnapshotConfig, cfgData)
	if err != nil {
		return Artifact{}, err
	}
	ann := map[string]string{
		annCreated:  time.Now().UTC().Format(time.RFC3339Nano),
		annRelease:  src.Release,
		annSnapshot: src.ID,
	}
	mb, err := buildManifest(typeSnapshot, cfgDesc, layers, ann)
	if err != nil {
		return Artifact{}, err
	}
	ref := c.snapshots.Tag(src.ID)
	if err := p.Put(ctx, ref, rawManifest{mb, mediaManifest}); err != nil {
		return Artifact{}, c.fail(ctx, "put "+ref.String(), err)
	}
	a := artifactOfRaw(KindSnapshot, c.snapshots, src.ID, mb)
	a.Uploaded = o.uploaded.Load()
	c.stats.pushes.Add(1)
	c.log.InfoContext(ctx, "artifact: snapshot pushed", "id", src.ID, "ref", a.Reference, "digest", a.Digest, "format", format,
		"parent", cfg.Parent.Source, "disk_stream", disk.Bytes, "checkpoint_stream", cp.Bytes,
		"own_bytes", a.OwnSize, "uploaded", a.Uploaded, "took", time.Since(start).Round(time.Millisecond))
	return a, nil
}

// releaseIdentity returns the send identity of the registry's copy of a release,
// pushing this store's copy first if the registry has none.
func (o *op) releaseIdentity(ctx context.Context, p *remote.Pusher, pl *remote.Puller, digest, root string) (string, error) {
	c := o.c
	ref := c.releases.Tag(releaseTag(digest))
	f, err := o.fetchManifest(ctx, pl, ref, typeRelease, mediaReleaseConfig)
	if fault.Is(err, fault.NotFound) {
		rel, err := c.st.Release(digest)
		if err != nil {
			return "", err
		}
		_, cfg, err := o.pushRelease(ctx, p, rel, root)
		if err != nil {
			return "", fmt.Errorf("push its release: %w", err)
		}
		return cfg.Identity, nil
	}
	if err != nil {
		return "", err
	}
	cfg, _, err := c.releaseOf(ref.String(), f)
	if err != nil {
		return "", err
	}
	return cfg.Identity, nil
}

// pushBase uploads the full stream of the base subvolume at path into the snapshots
// repository, or, if this client pushed it before and the registry still has every
// blob, only checks that.
func (o *op) pushBase(ctx context.Context, p *remote.Pusher, pl *remote.Puller, path, ident string) (streamRecord, error) {
	c := o.c
	c.basesMu.Lock()
	rec, ok := c.bases[ident]
	c.basesMu.Unlock()
	if !ok {
		if info, err := readBaseInfo(filepath.Dir(path)); err == nil && info.Identity == ident && len(info.Layers) > 0 {
			rec, ok = streamRecord{Layers: info.Layers, Bytes: info.Bytes}, true
		}
	}
	if ok {
		all, err := o.haveBlobs(ctx, pl, rec.Layers, "base")
		if err != nil {
			return streamRecord{}, err
		}
		if all {
			return rec, nil
		}
	}
	rec, err := o.pushStream(ctx, p, c.snapshots, partBase, mediaSend, func(ctx context.Context, w io.Writer) error {
		return c.st.Send(ctx, path, "", w)
	})
	if err != nil {
		return streamRecord{}, err
	}
	c.basesMu.Lock()
	c.bases[ident] = rec
	c.basesMu.Unlock()
	return rec, nil
}

// haveBlobs reports whether the snapshots repository has every one of blobs.
func (o *op) haveBlobs(ctx context.Context, pl *remote.Puller, blobs []v1.Descriptor, what string) (bool, error) {
	c := o.c
	for _, d := range blobs {
		l, err := pl.Layer(ctx, c.snapshots.Digest(d.Digest.String()))
		if err != nil {
			return false, c.fail(ctx, "check "+what+" blob", err)
		}
		ex, ok := l.(interface{ Exists() (bool, error) })
		if !ok {
			return false, nil
		}
		found, err := ex.Exists()
		if err != nil {
			return false, c.fail(ctx, "check "+what+" blob", err)
		}
		if !found {
			return false, nil
		}
	}
	return true, nil
}

// agentFileKey names an agent binary on this host as pushed: node.installAgent keeps
// them content-addressed and never rewrites one, and size and modification time catch
// a file replaced all the same.
type agentFileKey struct {
	path  string
	size  int64
	mtime time.Time
}

// agentPushed is an agent binary as pushed: its stream's blobs and its sha256 (hex).
type agentPushed struct {
	rec    streamRecord
	sha256 string
}

// pushAgent uploads the agent binary at path as a snapshot's part "agent" and returns
// its blobs and sha256. The same binary makes the same blobs, so the registry has them
// after the first snapshot that carries it; a binary this client pushed before is only
// checked (one HEAD per blob), not compressed again.
func (o *op) pushAgent(ctx context.Context, p *remote.Pusher, pl *remote.Puller, path string) (streamRecord, string, error) {
	c := o.c
	fi, err := os.Stat(path)
	if err != nil {
		return streamRecord{}, "", err
	}
	key := agentFileKey{path, fi.Size(), fi.ModTime()}
	c.basesMu.Lock()
	prev, ok := c.agents[key]
	c.basesMu.Unlock()
	if ok {
		all, err := o.haveBlobs(ctx, pl, prev.rec.Layers, "agent")
		if err != nil {
			return streamRecord{}, "", err
		}
		if all {
			return prev.rec, prev.sha256, nil
		}
	}
	h := sha256.New()
	rec, err := o.pushStream(ctx, p, c.snapshots, partAgent, mediaAgent, func(ctx context.Context, w io.Writer) error {
		f, err := os.Open(path)
		if err != nil {
			return err
		}
		defer f.Close()
		_, err = io.Copy(io.MultiWriter(w, h), f)
		return err
	})
	if err != nil {
		return streamRecord{}, "", err
	}
	sum := hex.EncodeToString(h.Sum(nil))
	c.basesMu.Lock()
	c.agents[key] = agentPushed{rec, sum}
	c.basesMu.Unlock()
	return rec, sum, nil
}

// diskBase returns the disk base (its subvolume and identity) to send an ext4 disk of
// release against: of the bases of the release in the store, the one that shares the
// most extents with disk (the one it was copied from), else a new one made from the
// release's image.
func (c *Client) diskBase(ctx context.Context, release, disk string) (string, string, error) {
	c.baseMake.Lock()
	defer c.baseMake.Unlock()
	entries, err := c.st.ListArtifacts(storage.DiskBases)
	if err != nil {
		return "", "", err
	}
	diskExts, err := extents(disk)
	if err != nil {
		return "", "", err
	}
	var best string
	var bestShared uint64
	for _, e := range entries {
		info, err := readBaseInfo(e.Path)
		if err != nil || info.Release != release || info.Format != DiskExt4 {
			continue
		}
		sub := filepath.Join(e.Path, DiskExt4.subvolume())
		exts, err := extents(filepath.Join(sub, imageName))
		if err != nil {
			continue
		}
		if s := sharedBytes(diskExts, exts); s > bestShared {
			best, bestShared = sub, s
		}
	}
	if best != "" {
		ident, err := c.st.SendIdentity(best)
		return best, ident, err
	}
	if !c.st.HasRelease(release) {
		return "", "", fault.New(fault.NotFound, "release %s is not in this store, and no disk base of it shares data with %s", release, disk)
	}
	img, err := c.st.ReleaseImage(ctx, release, 0)
	if err != nil {
		return "", "", err
	}
	b, err := c.st.BeginArtifact(ctx, storage.DiskBases)
	if err != nil {
		return "", "", err
	}
	defer b.Discard(ctx)
	sub := filepath.Join(b.Dir(), DiskExt4.subvolume())
	if err := c.st.CreateSubvolume(ctx, sub); err != nil {
		return "", "", err
	}
	if err := c.st.CopyDisk(ctx, img, filepath.Join(sub, imageName), false); err != nil {
		return "", "", err
	}
	if err := c.st.SetReadOnly(ctx, sub, true); err != nil {
		return "", "", err
	}
	ident, err := c.st.SendIdentity(sub)
	if err != nil {
		return "", "", err
	}
	if err := writeJSON(filepath.Join(b.Dir(), baseFile), baseInfo{Release: release, Format: DiskExt4, Identity: ident, Origin: "local"}); err != nil {
		return "", "", err
	}
	dir, _, err := b.Publish(ctx, identName(ident))
	if err != nil {
		return "", "", err
	}
	c.log.InfoContext(ctx, "artifact: disk base made", "release", release, "identity", ident)
	return filepath.Join(dir, DiskExt4.subvolume()), ident, nil
}

// PullSnapshot makes a snapshot present in the store and returns it: the one digest
// names if digest is set (then id, if set, must match it), else the one the tag id
// names now. A snapshot the store has already is returned without downloading anything
// (by digest: without asking the registry at all). What the snapshot's disk is an
// increment on — its release (root filesystems), or a base (ext4 images; the release
// itself is not needed then, PullRelease gets it if wanted) — is pulled first if the
// store lacks it.
// Every blob is verified before it is used; a failed or interrupted pull leaves
// nothing behind; a store without room fails with fault.InsufficientStorage.
func (c *Client) PullSnapshot(ctx context.Context, id, digest string) (Snapshot, error) {
	if id == "" && digest == "" {
		return Snapshot{}, fault.New(fault.Invalid, "pull snapshot: give an id or a digest")
	}
	if id != "" {
		if err := validateTag(id); err != nil {
			return Snapshot{}, err
		}
	}
	what := id
	if what == "" {
		what = digest
	}
	o := c.newOp(ctx)
	p, err := o.puller()
	if err != nil {
		return Snapshot{}, err
	}
	if digest == "" {
		desc, err := p.Head(ctx, c.snapshots.Tag(id))
		if err != nil {
			return Snapshot{}, fmt.Errorf("pull snapshot %s: %w", what, c.fail(ctx, "resolve "+c.snapshots.Tag(id).String(), err))
		}
		digest = desc.Digest.String()
	}
	hex, ok := strings.CutPrefix(digest, storage.DigestPrefix)
	if !ok || storage.ValidateDigest(digest) != nil {
		return Snapshot{}, fault.New(fault.Invalid, "pull snapshot %s: invalid digest %q", what, digest)
	}
	if s, err := c.cached(hex); err == nil {
		if id != "" && s.ID != id {
			return Snapshot{}, fault.New(fault.Conflict, "pull snapshot: %s is snapshot %s, not %s", digest, s.ID, id)
		}
		return s, nil
	}
	v, err, _ := c.flight.Do("snapshot "+digest, func() (any, error) {
		if s, err := c.cached(hex); err == nil {
			return s, nil
		}
		return c.pullSnapshot(ctx, o, p, digest, hex)
	})
	if err != nil {
		return Snapshot{}, fmt.Errorf("pull snapshot %s: %w", what, err)
	}
	s := v.(Snapshot)
	if id != "" && s.ID != id {
		return Snapshot{}, fault.New(fault.Conflict, "pull snapshot: %s is snapshot %s, not %s", digest, s.ID, id)
	}
	return s, nil
}

func (c *Client) pullSnapshot(ctx context.Context, o *op, p *remote.Puller, digest, hex string) (Snapshot, error) {
	start := time.Now()
	ref := c.snapshots.Digest(digest)
	// By digest: go-containerregistry checks the manifest against it.
	f, err := o.fetchManifest(ctx, p, ref, typeSnapshot, mediaSnapshotConfig)
	if err != nil {
		return Snapshot{}, err
	}
	var cfg snapshotConfig
	if err := decodeConfig(c, ref.String(), f.config, &cfg); err != nil {
		return Snapshot{}, err
	}
	if err := c.checkSnapshotConfig(ref.String(), &cfg); err != nil {
		return Snapshot{}, err
	}
	ps, err := parts(f.manifest, partBase, partDisk, partCheckpoint, partAgent)
	if err != nil {
		return Snapshot{}, fault.New(fault.BadGateway, "registry %s: %s: %v", c.registry, ref, err)
	}
	if len(ps[partDisk]) == 0 || (cfg.Parent.Source == parentBase) != (len(ps[partBase]) > 0) ||
		(cfg.Agent != nil) != (len(ps[partAgent]) > 0) {
		return Snapshot{}, fault.New(fault.BadGateway, "registry %s: %s: its parts do not match its config", c.registry, ref)
	}
	if err := c.st.CheckSpace(cfg.Disk.Bytes + cfg.CheckpointBytes); err != nil {
		return Snapshot{}, err
	}
	parent, err := c.parentFor(ctx, o, p, &cfg, ps[partBase])
	if err != nil {
		return Snapshot{}, err
	}

	b, err := c.st.BeginArtifact(ctx, storage.PulledSnapshots)
	if err != nil {
		return Snapshot{}, noSpace(err)
	}
	defer b.Discard(ctx)
	name := cfg.Disk.Format.subvolume()
	err = pipeInto(func(w io.Writer) error {
		return o.pullStream(ctx, p, c.snapshots, ps[partDisk], w)
	}, func(r io.Reader) error {
		return b.Receive(ctx, r, parent, name)
	})
	if err != nil {
		return Snapshot{}, err
	}
	if cfg.Disk.Format == DiskExt4 {
		if err := onlyImage(filepath.Join(b.Dir(), name)); err != nil {
			return Snapshot{}, fault.New(fault.BadGateway, "registry %s: %s: %v", c.registry, ref, err)
		}
	}
	cpDir := filepath.Join(b.Dir(), checkpointDir)
	err = pipeInto(func(w io.Writer) error {
		return o.pullStream(ctx, p, c.snapshots, ps[partCheckpoint], w)
	}, func(r io.Reader) error {
		return extractCheckpoint(ctx, r, cpDir, cfg.CheckpointBytes)
	})
	if err != nil {
		return Snapshot{}, err
	}
	if err := c.st.MarkComplete(cpDir); err != nil {
		return Snapshot{}, noSpace(err)
	}
	pushed, _ := time.Parse(time.RFC3339Nano, f.manifest.Annotations[annCreated])
	if err := writeJSON(filepath.Join(b.Dir(), snapshotFile), pulledFile{Digest: digest, PushedAt: pushed, Config: cfg, AgentLayers: ps[partAgent]}); err != nil {
		return Snapshot{}, err
	}
	if _, _, err := b.Publish(ctx, hex); err != nil {
		return Snapshot{}, err
	}
	s, err := c.cached(hex)
	if err != nil {
		return Snapshot{}, err
	}
	s.Downloaded = o.downloaded.Load()
	c.stats.pulls.Add(1)
	c.log.InfoContext(ctx, "artifact: snapshot pulled", "id", s.ID, "digest", digest, "downloaded", s.Downloaded,
		"took", time.Since(start).Round(time.Millisecond))
	return s, nil
}

// checkSnapshotConfig validates a snapshot config from the registry.
func (c *Client) checkSnapshotConfig(what string, cfg *snapshotConfig) error {
	bad := func(format string, args ...any) error {
		return fault.New(fault.Unprocessable, "registry %s: %s: %s", c.registry, what, fmt.Sprintf(format, args...))
	}
	switch {
	case cfg.Format != formatSnapshot:
		return bad("format %q, not %s", cfg.Format, formatSnapshot)
	case validateTag(cfg.ID) != nil:
		return bad("invalid id %q", cfg.ID)
	case storage.ValidateDigest(cfg.Release) != nil:
		return bad("invalid release %q", cfg.Release)
	case cfg.Disk.Format != DiskRootfs && cfg.Disk.Format != DiskExt4:
		return bad("unknown disk format %q", cfg.Disk.Format)
	case cfg.Parent.Source != parentRelease && cfg.Parent.Source != parentBase:
		return bad("unknown parent source %q", cfg.Parent.Source)
	case cfg.Disk.Format == DiskExt4 && cfg.Parent.Source != parentBase:
		return bad("an ext4 disk without a base")
	case !uuidRE.MatchString(cfg.Parent.Identity):
		return bad("invalid parent identity %q", cfg.Parent.Identity)
	case cfg.Disk.Bytes < 0 || cfg.CheckpointBytes < 0 || cfg.Parent.Bytes < 0:
		return bad("negative sizes")
	case cfg.Agent != nil && (cfg.Agent.Bytes < 1 || cfg.Agent.Bytes > maxAgentBytes || !sha256RE.MatchString(cfg.Agent.SHA256)):
		return bad("invalid agent (%d bytes, sha256 %q)", cfg.Agent.Bytes, cfg.Agent.SHA256)
	}
	return nil
}

// sha256RE is a hex sha256.
var sha256RE = regexp.MustCompile(`^[0-9a-f]{64}$`)

// PullAgent writes the agent binary snapshot s carries to w, downloading it from the
// registry, and checks it against the sha256 and length its pusher recorded: on an
// error, what w received must be discarded. fault.NotFound when s carries none.
func (c *Client) PullAgent(ctx context.Context, s Snapshot, w io.Writer) error {
	if s.AgentSHA256 == "" || len(s.agentLayers) == 0 {
		return fault.New(fault.NotFound, "snapshot %s carries no agent binary", s.ID)
	}
	o := c.newOp(ctx)
	p, err := o.puller()
	if err != nil {
		return err
	}
	err = pipeInto(func(w io.Writer) error {
		return o.pullStream(ctx, p, c.snapshots, s.agentLayers, w)
	}, func(r io.Reader) error {
		return copyAgent(w, r, s.agent)
	})
	if err != nil {
		return fmt.Errorf("pull the agent binary of snapshot %s: %w", s.ID, err)
	}
	return nil
}

// copyAgent copies the agent binary r streams to w, checking it against want: a
// binary of other bytes, or of more or fewer, is refused.
func copyAgent(w io.Writer, r io.Reader, want agentRecord) error {
	h := sha256.New()
	n, err := io.Copy(io.MultiWriter(w, h), io.LimitReader(r, want.Bytes+1))
	if err != nil {
		return noSpace(err)
	}
	if got := hex.EncodeToString(h.Sum(nil)); n != want.Bytes || got != want.SHA256 {
		return fault.New(fault.BadGateway, "the agent binary is %d bytes with sha256 %s, not the %d bytes with sha256 %s its snapshot names", n, got, want.Bytes, want.SHA256)
	}
	return nil
}

// uuidRE is a subvolume UUID as storage.SendIdentity writes it.
var uuidRE = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`)

// parentFor returns the subvolume the snapshot's disk increment applies to, getting it
// if the store lacks it: the release (pulled if missing), or a base from the store's
// cache or the registry.
func (c *Client) parentFor(ctx context.Context, o *op, p *remote.Puller, cfg *snapshotConfig, baseLayers []v1.Descriptor) (string, error) {
	ident := cfg.Parent.Identity
	if cfg.Parent.Source == parentRelease {
		if !c.st.HasRelease(cfg.Release) {
			_, n, err := c.pullReleaseOnce(ctx, cfg.Release)
			if err != nil {
				return "", err
			}
			o.downloaded.Add(n)
		}
		root, err := c.st.ReleaseRoot(cfg.Release)
		if err != nil {
			return "", err
		}
		if id, err := c.st.SendIdentity(root); err == nil && id == ident {
			return root, nil
		}
		// This store's copy of the release was built here, not received: the registry's
		// copy serves as the parent, kept as a base.
	}
	name := cfg.Disk.Format.subvolume()
	if sub, ok := c.cachedBase(ident, name); ok {
		return sub, nil
	}
	v, err, _ := c.flight.Do("base "+ident, func() (any, error) {
		if sub, ok := c.cachedBase(ident, name); ok {
			return sub, nil
		}
		return c.pullBase(ctx, o, p, cfg, baseLayers)
	})
	if err != nil {
		return "", err
	}
	return v.(string), nil
}

// cachedBase returns the subvolume of the base with this identity if the store has it.
func (c *Client) cachedBase(ident, name string) (string, bool) {
	dir, err := c.st.ArtifactDir(storage.DiskBases, identName(ident))
	if err != nil {
		return "", false
	}
	sub := filepath.Join(dir, name)
	if id, err := c.st.SendIdentity(sub); err == nil && id == ident {
		return sub, true
	}
	return "", false
}

// pullBase downloads a snapshot's parent into the store's bases: its base part, or the
// release artifact's stream.
func (c *Client) pullBase(ctx context.Context, o *op, p *remote.Puller, cfg *snapshotConfig, layers []v1.Descriptor) (string, error) {
	ident, name := cfg.Parent.Identity, cfg.Disk.Format.subvolume()
	repo, bytes := c.snapshots, cfg.Parent.Bytes
	if cfg.Parent.Source == parentRelease {
		ref := c.releases.Tag(releaseTag(cfg.Release))
		f, err := o.fetchManifest(ctx, p, ref, typeRelease, mediaReleaseConfig)
		if err != nil {
			return "", err
		}
		rc, rl, err := c.releaseOf(ref.String(), f)
		if err != nil {
			return "", err
		}
		if rc.Identity != ident || rc.Release.Digest != cfg.Release {
			return "", fault.New(fault.Conflict, "registry %s: %s is no longer the release copy the snapshot was made against (identity %s, not %s)", c.registry, ref, rc.Identity, ident)
		}
		repo, layers, bytes = c.releases, rl, rc.RootfsBytes
	}
	if err := c.st.CheckSpace(bytes); err != nil {
		return "", err
	}
	b, err := c.st.BeginArtifact(ctx, storage.DiskBases)
	if err != nil {
		return "", noSpace(err)
	}
	defer b.Discard(ctx)
	err = pipeInto(func(w io.Writer) error {
		return o.pullStream(ctx, p, repo, layers, w)
	}, func(r io.Reader) error {
		return b.Receive(ctx, r, "", name)
	})
	if err != nil {
		return "", err
	}
	sub := filepath.Join(b.Dir(), name)
	if id, err := c.st.SendIdentity(sub); err != nil || id != ident {
		return "", fault.New(fault.BadGateway, "registry %s: the base of snapshot %s has identity %s, not %s", c.registry, cfg.ID, id, ident)
	}
	if cfg.Disk.Format == DiskExt4 {
		if err := onlyImage(sub); err != nil {
			return "", fault.New(fault.BadGateway, "registry %s: the base of snapshot %s: %v", c.registry, cfg.ID, err)
		}
	}
	info := baseInfo{Release: cfg.Release, Format: cfg.Disk.Format, Identity: ident, Origin: "pulled"}
	if repo == c.snapshots {
		info.Layers, info.Bytes = layers, bytes
	}
	if err := writeJSON(filepath.Join(b.Dir(), baseFile), info); err != nil {
		return "", err
	}
	dir, _, err := b.Publish(ctx, identName(ident))
	if err != nil {
		return "", err
	}
	c.log.InfoContext(ctx, "artifact: base pulled", "release", cfg.Release, "identity", ident, "format", cfg.Disk.Format)
	return filepath.Join(dir, name), nil
}

// onlyImage checks that the disk subvolume dir holds only a regular disk.ext4.
func onlyImage(dir string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	if len(entries) != 1 || entries[0].Name() != imageName || !entries[0].Type().IsRegular() {
		return fmt.Errorf("the disk does not hold exactly one image file %s", imageName)
	}
	return nil
}

// cached returns the pulled snapshot named hex.
func (c *Client) cached(hex string) (Snapshot, error) {
	dir, err := c.st.ArtifactDir(storage.PulledSnapshots, hex)
	if err != nil {
		return Snapshot{}, err
	}
	return snapshotAt(dir)
}

func snapshotAt(dir string) (Snapshot, error) {
	data, err := os.ReadFile(filepath.Join(dir, snapshotFile))
	if err != nil {
		return Snapshot{}, err
	}
	var pf pulledFile
	if err := json.Unmarshal(data, &pf); err != nil {
		return Snapshot{}, fmt.Errorf("%s: %w", dir, err)
	}
	s := Snapshot{
		Digest: pf.Digest, ID: pf.Config.ID, Release: pf.Config.Release, Format: pf.Config.Disk.Format,
		PushedAt: pf.PushedAt, Checkpoint: filepath.Join(dir, checkpointDir), Meta: pf.Config.Meta,
		Disk: filepath.Join(dir, pf.Config.Disk.Format.subvolume()),
	}
	if s.Format == DiskExt4 {
		s.Disk = filepath.Join(s.Disk, imageName)
	}
	if a := pf.Config.Agent; a != nil && len(pf.AgentLayers) > 0 {
		s.AgentSHA256, s.agent, s.agentLayers = a.SHA256, *a, pf.AgentLayers
	}
	return s, nil
}

// CachedSnapshots lists the snapshots pulled into the store.
func (c *Client) CachedSnapshots() ([]Snapshot, error) {
	if c.st == nil {
		return nil, nil // a list/delete-only client has no store to cache in
	}
	entries, err := c.st.ListArtifacts(storage.PulledSnapshots)
	if err != nil {
		return nil, err
	}
	var out []Snapshot
	for _, e := range entries {
		s, err := snapshotAt(e.Path)
		if err != nil {
			c.log.Warn("artifact: unreadable pulled snapshot", "path", e.Path, "err", err)
			continue
		}
		out = append(out, s)
	}
	return out, nil
}

// DeleteCachedSnapshot removes a pulled snapshot from the store. Sandboxes made from it
// are independent copies; one being made from it right now is not, so the caller must
// not delete a snapshot it is using.
func (c *Client) DeleteCachedSnapshot(ctx context.Context, digest string) error {
	if c.st == nil {
		return nil // nothing is cached without a store
	}
	hex, ok := strings.CutPrefix(digest, storage.DigestPrefix)
	if !ok || storage.ValidateDigest(digest) != nil {
		return fault.New(fault.Invalid, "invalid digest %q", digest)
	}
	return c.st.DeleteArtifact(ctx, storage.PulledSnapshots, hex)
}

func readBaseInfo(dir string) (baseInfo, error) {
	data, err := os.ReadFile(filepath.Join(dir, baseFile))
	if err != nil {
		return baseInfo{}, err
	}
	var b baseInfo
	return b, json.Unmarshal(data, &b)
}

func writeJSON(path string, v any) error {
	data, err := json.Marshal(v)
	if err != nil {
		return err
	}
	if err := durable.WriteFile(path, append(data, '\n'), 0o600); err != nil {
		return noSpace(err)
	}
	return nil
}
