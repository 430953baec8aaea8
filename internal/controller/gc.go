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
		// Snapshots first: a release is kept while a snapshot artifact of it is.
		if _, err := c.CollectSnapshots(ctx); err != nil && ctx.Err() == nil {
			c.log.Warn("registry garbage collection (snapshots)", "registry", c.cfg.Registry.Registry(), "err", err)
		}
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
	return c.sweep(ctx, artifact.KindRelease, byDigest, "template release",
		func() ([]string, error) { return c.st.ReleaseGCSweep(ctx, digests, kept, c.cfg.GCGrace) },
		c.st.ReleaseGCDeleted)
}

// CollectSnapshots is one pass of the registry's snapshot collection: a snapshot
// artifact (a suspend snapshot, a periodic checkpoint, a named snapshot) is deleted
// when no sandbox that is not deleted and no named snapshot has referenced its
// manifest digest for GCGrace (store.SnapshotGCSweep, mark and sweep) and it was pushed
// more than GCGrace ago. Superseded suspend snapshots and checkpoints (each wake or
// checkpoint records a new digest) and those of deleted sandboxes go this way. It
// returns the manifest digests deleted.
func (c *Controller) CollectSnapshots(ctx context.Context) ([]string, error) {
	reg := c.cfg.Registry
	if reg == nil {
		return nil, nil
	}
	snaps, err := reg.List(ctx, artifact.KindSnapshot)
	if err != nil {
		return nil, err
	}
	byDigest := map[string]artifact.Artifact{}
	var digests []string
	for _, a := range snaps {
		if a.Digest == "" {
			continue
		}
		byDigest[a.Digest] = a
		digests = append(digests, a.Digest)
	}
	return c.sweep(ctx, artifact.KindSnapshot, byDigest, "snapshot",
		func() ([]string, error) { return c.st.SnapshotGCSweep(ctx, digests, c.cfg.GCGrace) },
		c.st.SnapshotGCDeleted)
}

// sweep runs one mark-and-sweep step (mark, which returns the keys of byDigest that
// stayed unreferenced for the grace period) and deletes those artifacts that were
// also pushed more than the grace period ago — by tag and manifest digest, so that a
// push of the same tag since the listing makes the delete refuse (fault.Conflict) and
// the next pass look again — forgetting each deleted one's mark. It returns the keys
// deleted.
func (c *Controller) sweep(ctx context.Context, kind artifact.Kind, byDigest map[string]artifact.Artifact, what string,
	mark func() ([]string, error), forget func(context.Context, string) error) ([]string, error) {
	gone, err := mark()
	if err != nil {
		return nil, err
	}
	var deleted []string
	for _, d := range gone {
		a := byDigest[d]
		if time.Since(a.PushedAt) < c.cfg.GCGrace {
			continue // pushed lately: its pusher may not have recorded it yet
		}
		err := c.cfg.Registry.Delete(ctx, kind, a.Tag, a.Digest)
		if fault.Is(err, fault.Conflict) {
			continue
		}
		if err != nil && !fault.Is(err, fault.NotFound) {
			return deleted, err
		}
		if err := forget(ctx, d); err != nil {
			return deleted, err
		}
		c.log.Info("deleted unreferenced "+what+" from the registry", "digest", d, "ref", a.Reference,
			"pushed", a.PushedAt.Format(time.RFC3339))
		deleted = append(deleted, d)
	}
	return deleted, nil
}
