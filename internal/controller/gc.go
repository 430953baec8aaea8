package controller

import (
	"context"
	"time"

	"github.com/spacedev/space/internal/artifact"
	"github.com/spacedev/space/internal/fault"
)

// Defaults of the registry collection (Config.GCGrace, Config.GCInterval).
const (
	DefaultGCGrace    = time.Hour
	DefaultGCInterval = 10 * time.Minute
)

// Registry is what the controller's garbage collection needs of the fleet's artifact
// store (*artifact.Client).
type Registry interface {
	Registry() string
	List(ctx context.Context, kind artifact.Kind) ([]artifact.Artifact, error)
	Delete(ctx context.Context, kind artifact.Kind, tag, digest string) error
}

// collectReleases runs the registry collection every GCInterval while this replica
// leads, until ctx ends.
func (c *Controller) collectReleases(ctx context.Context) {
	if c.cfg.Registry == nil {
		return
	}
	t := time.NewTicker(c.cfg.GCInterval)
	defer t.Stop()
	for {
		if _, err := c.CollectReleases(ctx); err != nil && ctx.Err() == nil {
			c.log.Warn("registry garbage collection", "registry", c.cfg.Registry.Registry(), "err", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// CollectReleases is one pass of the registry's release collection (artifact/doc.go,
// "Garbage collection"; docs/operations.md, "Registry"): a release artifact is deleted
// when no release row, sandbox that is not deleted, snapshot or unfinished build has
// referenced its digest for GCGrace (store.ReleaseGCSweep, mark and sweep), it was
// pushed more than GCGrace ago, and no snapshot artifact in the registry is of it. It
// returns the release digests deleted.
func (c *Controller) CollectReleases(ctx context.Context) ([]string, error) {
	reg := c.cfg.Registry
	if reg == nil {
		return nil, nil
	}
	releases, err := reg.List(ctx, artifact.KindRelease)
	if err != nil {
		return nil, err
	}
	snapshots, err := reg.List(ctx, artifact.KindSnapshot)
	if err != nil {
		return nil, err
	}
	var kept []string
	for _, s := range snapshots {
		kept = append(kept, s.Release)
	}
	byDigest := map[string]artifact.Artifact{}
	var digests []string
	for _, a := range releases {
		if a.Release == "" {
			continue
		}
		byDigest[a.Release] = a
		digests = append(digests, a.Release)
	}
	gone, err := c.st.ReleaseGCSweep(ctx, digests, kept, c.cfg.GCGrace)
	if err != nil {
		return nil, err
	}
	var deleted []string
	for _, d := range gone {
		a := byDigest[d]
		if time.Since(a.PushedAt) < c.cfg.GCGrace {
			continue // pushed again lately: its pusher may not have recorded it yet
		}
		// By tag and manifest digest: a push of the same release since the listing
		// makes the delete refuse (fault.Conflict) and the next pass look again.
		err := reg.Delete(ctx, artifact.KindRelease, a.Tag, a.Digest)
		if fault.Is(err, fault.Conflict) {
			continue
		}
		if err != nil {
			return deleted, err
		}
		if err := c.st.ReleaseGCDeleted(ctx, d); err != nil {
			return deleted, err
		}
		c.log.Info("deleted unreferenced template release from the registry", "digest", d, "ref", a.Reference,
			"pushed", a.PushedAt.Format(time.RFC3339))
		deleted = append(deleted, d)
	}
	return deleted, nil
}
