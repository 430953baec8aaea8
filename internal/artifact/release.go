package artifact

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/storage"
)

// releaseConfig is the config blob of a release artifact.
type releaseConfig struct {
	Format  string          `json:"format"`
	Release storage.Release `json:"release"`
	// Identity is the UUID the root filesystem's send stream gives it: what increments
	// against this release name as their parent (storage.SendIdentity).
	Identity string `json:"identity"`
	// RootfsBytes is the length of the uncompressed send stream.
	RootfsBytes int64 `json:"rootfs_bytes"`
}

const partRootfs = "rootfs"

// PushRelease pushes the release with this digest from the store to the registry, as
// <prefix>/releases:sha256-<hex>. If the registry has it already, nothing is uploaded.
// An interrupted push leaves only blobs, no tag; pushing again uploads only the blobs
// still missing.
func (c *Client) PushRelease(ctx context.Context, digest string) (Artifact, error) {
	if c.st == nil {
		return Artifact{}, errors.New("artifact: this client has no store to push from or pull into")
	}
	if err := storage.ValidateDigest(digest); err != nil {
		return Artifact{}, fault.Wrap(fault.Invalid, err)
	}
	rel, err := c.st.Release(digest)
	if errors.Is(err, fs.ErrNotExist) {
		return Artifact{}, fault.New(fault.NotFound, "release %s is not in this store", digest)
	} else if err != nil {
		return Artifact{}, err
	}
	root, err := c.st.ReleaseRoot(digest)
	if err != nil {
		return Artifact{}, err
	}
	o := c.newOp(ctx)
	pl, err := o.puller()
	if err != nil {
		return Artifact{}, err
	}
	tag := releaseTag(digest)
	if a, ok, err := o.existing(ctx, pl, KindRelease, c.releases, tag); err != nil {
		return Artifact{}, fmt.Errorf("push release %s: %w", digest, err)
	} else if ok {
		c.log.DebugContext(ctx, "artifact: release already in the registry", "digest", digest, "ref", a.Reference)
		return a, nil
	}
	p, err := o.pusher()
	if err != nil {
		return Artifact{}, err
	}
	a, _, err := o.pushRelease(ctx, p, rel, root)
	if err != nil {
		return Artifact{}, fmt.Errorf("push release %s: %w", digest, err)
	}
	return a, nil
}

// pushRelease uploads a release's stream and config, then its manifest, and returns the
// artifact and its config.
func (o *op) pushRelease(ctx context.Context, p *remote.Pusher, rel storage.Release, root string) (Artifact, releaseConfig, error) {
	c := o.c
	start := time.Now()
	ident, err := c.st.SendIdentity(root)
	if err != nil {
		return Artifact{}, releaseConfig{}, err
	}
	rec, err := o.pushStream(ctx, p, c.releases, partRootfs, mediaSend, func(ctx context.Context, w io.Writer) error {
		return c.st.Send(ctx, root, "", w)
	})
	if err != nil {
		return Artifact{}, releaseConfig{}, err
	}
	cfg := releaseConfig{Format: formatRelease, Release: rel, Identity: ident, RootfsBytes: rec.Bytes}
	cfgData, err := jsonBytes(cfg)
	if err != nil {
		return Artifact{}, releaseConfig{}, err
	}
	cfgDesc, err := o.uploadBlob(ctx, p, c.releases, mediaReleaseConfig, cfgData)
	if err != nil {
		return Artifact{}, releaseConfig{}, err
	}
	tag := releaseTag(rel.Digest)
	ann := map[string]string{annCreated: time.Now().UTC().Format(time.RFC3339Nano), annRelease: rel.Digest}
	mb, err := buildManifest(typeRelease, cfgDesc, rec.Layers, ann)
	if err != nil {
		return Artifact{}, releaseConfig{}, err
	}
	ref := c.releases.Tag(tag)
	// The manifest goes last: until it is there, no tag names the blobs.
	if err := p.Put(ctx, ref, rawManifest{mb, mediaManifest}); err != nil {
		return Artifact{}, releaseConfig{}, c.fail(ctx, "put "+ref.String(), err)
	}
	a := artifactOfRaw(KindRelease, c.releases, tag, mb)
	a.Uploaded = o.uploaded.Load()
	c.stats.pushes.Add(1)
	c.log.InfoContext(ctx, "artifact: release pushed", "digest", rel.Digest, "ref", a.Reference,
		"stream_bytes", rec.Bytes, "blob_bytes", a.Size, "uploaded", a.Uploaded, "took", time.Since(start).Round(time.Millisecond))
	return a, cfg, nil
}

// PullRelease makes the release with this digest present in the store, pulling it
// from the registry if it is not there yet (then nothing is downloaded). The received
// tree's digest is checked against digest. A failed or interrupted pull leaves
// nothing behind; a store without room for it fails with an error of kind
// fault.InsufficientStorage, and an unreachable registry with fault.Unavailable.
func (c *Client) PullRelease(ctx context.Context, digest string) (storage.Release, error) {
	if c.st == nil {
		return storage.Release{}, errors.New("artifact: this client has no store to push from or pull into")
	}
	if err := storage.ValidateDigest(digest); err != nil {
		return storage.Release{}, fault.Wrap(fault.Invalid, err)
	}
	if c.st.HasRelease(digest) {
		return c.st.Release(digest)
	}
	rel, _, err := c.pullReleaseOnce(ctx, digest)
	return rel, err
}

// pulledRelease is what one pull of a release did.
type pulledRelease struct {
	rel        storage.Release
	downloaded int64
}

// pullReleaseOnce pulls a release that is not in the store, sharing the pull with
// concurrent callers, and says how many bytes it downloaded.
func (c *Client) pullReleaseOnce(ctx context.Context, digest string) (storage.Release, int64, error) {
	v, err, _ := c.flight.Do("release "+digest, func() (any, error) {
		if c.st.HasRelease(digest) {
			rel, err := c.st.Release(digest)
			return pulledRelease{rel: rel}, err
		}
		o := c.newOp(ctx)
		rel, err := c.pullRelease(ctx, o, digest)
		return pulledRelease{rel, o.downloaded.Load()}, err
	})
	if err != nil {
		return storage.Release{}, 0, fmt.Errorf("pull release %s: %w", digest, err)
	}
	pr := v.(pulledRelease)
	return pr.rel, pr.downloaded, nil
}

func (c *Client) pullRelease(ctx context.Context, o *op, digest string) (storage.Release, error) {
	start := time.Now()
	p, err := o.puller()
	if err != nil {
		return storage.Release{}, err
	}
	ref := c.releases.Tag(releaseTag(digest))
	f, err := o.fetchManifest(ctx, p, ref, typeRelease, mediaReleaseConfig)
	if err != nil {
		return storage.Release{}, err
	}
	cfg, layers, err := c.releaseOf(ref.String(), f)
	if err != nil {
		return storage.Release{}, err
	}
	if cfg.Release.Digest != digest {
		return storage.Release{}, fault.New(fault.BadGateway, "registry %s: %s holds release %s, not %s", c.registry, ref, cfg.Release.Digest, digest)
	}
	if err := c.st.CheckSpace(cfg.RootfsBytes); err != nil {
		return storage.Release{}, err
	}
	var rel storage.Release
	err = pipeInto(func(w io.Writer) error {
		return o.pullStream(ctx, p, c.releases, layers, w)
	}, func(r io.Reader) error {
		var err error
		rel, err = c.st.ReceiveRelease(ctx, cfg.Release, r)
		return err
	})
	if err != nil {
		return storage.Release{}, err
	}
	c.stats.pulls.Add(1)
	c.log.InfoContext(ctx, "artifact: release pulled", "digest", digest, "ref", ref.String(),
		"downloaded", o.downloaded.Load(), "took", time.Since(start).Round(time.Millisecond))
	return rel, nil
}

// releaseOf checks a fetched release artifact and returns its config and stream.
func (c *Client) releaseOf(what string, f fetched) (releaseConfig, []v1.Descriptor, error) {
	var cfg releaseConfig
	if err := decodeConfig(c, what, f.config, &cfg); err != nil {
		return releaseConfig{}, nil, err
	}
	if cfg.Format != formatRelease {
		return releaseConfig{}, nil, fault.New(fault.Unprocessable, "registry %s: %s has format %q, not %s", c.registry, what, cfg.Format, formatRelease)
	}
	if err := storage.ValidateDigest(cfg.Release.Digest); err != nil {
		return releaseConfig{}, nil, fault.New(fault.BadGateway, "registry %s: %s: %v", c.registry, what, err)
	}
	ps, err := parts(f.manifest, partRootfs)
	if err != nil {
		return releaseConfig{}, nil, fault.New(fault.BadGateway, "registry %s: %s: %v", c.registry, what, err)
	}
	if len(ps[partRootfs]) == 0 {
		return releaseConfig{}, nil, fault.New(fault.BadGateway, "registry %s: %s has no root filesystem", c.registry, what)
	}
	return cfg, ps[partRootfs], nil
}
