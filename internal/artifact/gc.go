package artifact

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"sort"
	"strings"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
	"golang.org/x/sync/errgroup"

	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/storage"
)

func (c *Client) repo(kind Kind) (name.Repository, string, error) {
	switch kind {
	case KindRelease:
		return c.releases, typeRelease, nil
	case KindSnapshot:
		return c.snapshots, typeSnapshot, nil
	}
	return name.Repository{}, "", fault.New(fault.Invalid, "unknown artifact kind %q", kind)
}

// List returns the artifacts of a kind in the registry, oldest push first, with their
// digests and push times (one request per artifact besides the tag list). Tags that do
// not name a space artifact of that kind are left out.
func (c *Client) List(ctx context.Context, kind Kind) ([]Artifact, error) {
	repo, artifactType, err := c.repo(kind)
	if err != nil {
		return nil, err
	}
	o := c.newOp(ctx)
	p, err := o.puller()
	if err != nil {
		return nil, err
	}
	tags, err := p.List(ctx, repo)
	if err != nil {
		var terr *transport.Error
		if errors.As(err, &terr) && (terr.StatusCode == http.StatusNotFound || hasCode(terr, transport.NameUnknownErrorCode)) {
			return nil, nil // nothing pushed yet
		}
		return nil, c.fail(ctx, "list "+repo.String(), err)
	}
	found := make([]*Artifact, len(tags))
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(c.jobs)
	for i, tag := range tags {
		g.Go(func() error {
			desc, err := p.Get(gctx, repo.Tag(tag))
			if err != nil {
				err = c.fail(gctx, "get "+repo.Tag(tag).String(), err)
				if fault.Is(err, fault.NotFound) {
					return nil // deleted meanwhile
				}
				return err
			}
			m, err := v1.ParseManifest(bytes.NewReader(desc.Manifest))
			if err != nil || m.ArtifactType != artifactType {
				return nil
			}
			a := artifactOf(kind, repo, tag, desc.Digest, m)
			found[i] = &a
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return nil, fmt.Errorf("list %s artifacts: %w", kind, err)
	}
	var out []Artifact
	for _, a := range found {
		if a != nil {
			out = append(out, *a)
		}
	}
	sort.SliceStable(out, func(i, j int) bool {
		if !out[i].PushedAt.Equal(out[j].PushedAt) {
			return out[i].PushedAt.Before(out[j].PushedAt)
		}
		return out[i].Tag < out[j].Tag
	})
	return out, nil
}

// Delete removes an artifact from the registry: the manifest with this digest, or the
// one tag names now. With both, tag must still name digest, else the error has kind
// fault.Conflict (it was pushed again since it was listed) and nothing is deleted.
// Deleting a manifest removes every tag that names it; its blobs stay until the
// registry's own garbage collection removes blobs no manifest names. Deleting what is
// not there is not an error. See doc.go for the contract that keeps this safe against
// pushes and pulls in flight.
func (c *Client) Delete(ctx context.Context, kind Kind, tag, digest string) error {
	repo, _, err := c.repo(kind)
	if err != nil {
		return err
	}
	if tag == "" && digest == "" {
		return fault.New(fault.Invalid, "delete: give a tag or a digest")
	}
	if tag != "" {
		if err := validateTag(tag); err != nil {
			return err
		}
	}
	if digest != "" {
		if _, ok := strings.CutPrefix(digest, storage.DigestPrefix); !ok || storage.ValidateDigest(digest) != nil {
			return fault.New(fault.Invalid, "delete: invalid digest %q", digest)
		}
	}
	o := c.newOp(ctx)
	p, err := o.pusher()
	if err != nil {
		return err
	}
	if tag != "" {
		pl, err := o.puller()
		if err != nil {
			return err
		}
		desc, err := pl.Head(ctx, repo.Tag(tag))
		if err != nil {
			err = c.fail(ctx, "resolve "+repo.Tag(tag).String(), err)
			if fault.Is(err, fault.NotFound) {
				return nil
			}
			return err
		}
		if digest != "" && desc.Digest.String() != digest {
			return fault.New(fault.Conflict, "delete %s: it names %s now, not %s", repo.Tag(tag), desc.Digest, digest)
		}
		digest = desc.Digest.String()
	}
	ref := repo.Digest(digest)
	if err := p.Delete(ctx, ref); err != nil {
		err = c.fail(ctx, "delete "+ref.String(), err)
		if fault.Is(err, fault.NotFound) {
			return nil
		}
		return err
	}
	c.log.InfoContext(ctx, "artifact: deleted", "kind", kind, "ref", ref.String(), "tag", tag)
	return nil
}
