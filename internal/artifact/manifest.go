package artifact

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/storage"
)

// Media types, artifact types and annotations of space's artifacts (see doc.go).
const (
	typeRelease  = "application/vnd.space.release.v1"
	typeSnapshot = "application/vnd.space.snapshot.v1"

	mediaReleaseConfig  types.MediaType = "application/vnd.space.release.config.v1+json"
	mediaSnapshotConfig types.MediaType = "application/vnd.space.snapshot.config.v1+json"
	mediaSend           types.MediaType = "application/vnd.space.btrfs-send.v1+zstd"
	mediaTar            types.MediaType = "application/vnd.space.checkpoint.tar.v1+zstd"
	mediaAgent          types.MediaType = "application/vnd.space.agent.v1+zstd"

	annPart     = "dev.space.part" // which stream a blob belongs to
	annSize     = "dev.space.size" // a blob's uncompressed size
	annCreated  = "org.opencontainers.image.created"
	annRelease  = "dev.space.release"
	annSnapshot = "dev.space.snapshot"

	formatRelease  = "space-release-v1"
	formatSnapshot = "space-snapshot-v1"

	// maxConfig bounds a config blob and a manifest.
	maxConfig = 4 << 20
)

// Kind is what an artifact holds.
type Kind string

// Kinds of artifacts.
const (
	KindRelease  Kind = "release"
	KindSnapshot Kind = "snapshot"
)

// Artifact describes an artifact in the registry.
type Artifact struct {
	Kind Kind
	// Reference is repository:tag.
	Reference string
	Tag       string
	// Digest is the manifest digest ("sha256:..."): the artifact's content address.
	// PullSnapshot with it gets exactly this artifact, whatever its tag says later.
	Digest string
	// PushedAt is when the artifact was pushed (its manifest's created annotation).
	PushedAt time.Time
	// Size is the bytes of its blobs in the registry (config and layers).
	Size int64
	// OwnSize is Size without the blobs of a shared base and agent (see doc.go): what
	// this artifact alone adds to the registry.
	OwnSize int64
	// Release is the release digest: a release's own, a snapshot's release.
	Release string
	// Snapshot is a snapshot's id (its tag).
	Snapshot string
	// Uploaded is the bytes this push sent to the registry (0 when it was there already,
	// and in List).
	Uploaded int64
}

// releaseTag is the tag of a release in the releases repository.
func releaseTag(digest string) string {
	return "sha256-" + strings.TrimPrefix(digest, storage.DigestPrefix)
}

// tagRE is the OCI distribution tag grammar.
var tagRE = regexp.MustCompile(`^[a-zA-Z0-9_][a-zA-Z0-9._-]{0,127}$`)

func validateTag(id string) error {
	if !tagRE.MatchString(id) {
		return fault.New(fault.Invalid, "snapshot id %q is not a valid tag (letters, digits, '.', '_', '-'; at most 128; not starting with '.' or '-')", id)
	}
	return nil
}

// buildManifest makes the manifest of an artifact.
func buildManifest(artifactType string, config v1.Descriptor, layers []v1.Descriptor, ann map[string]string) ([]byte, error) {
	m := v1.Manifest{
		SchemaVersion: 2,
		MediaType:     mediaManifest,
		ArtifactType:  artifactType,
		Config:        config,
		Layers:        layers,
		Annotations:   ann,
	}
	if m.Layers == nil {
		m.Layers = []v1.Descriptor{}
	}
	return json.Marshal(m)
}

// fetched is a manifest read from the registry, with its config.
type fetched struct {
	digest   v1.Hash
	manifest *v1.Manifest
	config   []byte
}

// fetchManifest reads the manifest at ref and its config, which must be of the given
// artifact and config types.
func (o *op) fetchManifest(ctx context.Context, p *remote.Puller, ref name.Reference, artifactType string, configType types.MediaType) (fetched, error) {
	c := o.c
	desc, err := p.Get(ctx, ref)
	if err != nil {
		return fetched{}, c.fail(ctx, "get "+ref.String(), err)
	}
	if len(desc.Manifest) > maxConfig {
		return fetched{}, fault.New(fault.BadGateway, "registry %s: manifest of %s is too large", c.registry, ref)
	}
	m, err := v1.ParseManifest(bytes.NewReader(desc.Manifest))
	if err != nil {
		return fetched{}, fault.New(fault.BadGateway, "registry %s: manifest of %s: %v", c.registry, ref, err)
	}
	if m.Config.MediaType != configType {
		return fetched{}, fault.New(fault.Unprocessable, "registry %s: %s is not a space %s artifact (config type %q)", c.registry, ref, strings.TrimPrefix(artifactType, "application/vnd.space."), m.Config.MediaType)
	}
	if m.Config.Size > maxConfig {
		return fetched{}, fault.New(fault.BadGateway, "registry %s: config of %s is too large", c.registry, ref)
	}
	cfg, err := o.fetchBlob(ctx, p, ref.Context(), m.Config)
	if err != nil {
		return fetched{}, err
	}
	return fetched{digest: desc.Digest, manifest: m, config: cfg}, nil
}

// decodeConfig parses a config strictly.
func decodeConfig(c *Client, what string, data []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return fault.New(fault.Unprocessable, "registry %s: config of %s: %v", c.registry, what, err)
	}
	return nil
}

// parts splits a manifest's layers by their part annotation, checking that they come
// in the given order and belong to known parts.
func parts(m *v1.Manifest, order ...string) (map[string][]v1.Descriptor, error) {
	out := map[string][]v1.Descriptor{}
	pos := 0
	for _, l := range m.Layers {
		part := l.Annotations[annPart]
		for pos < len(order) && order[pos] != part {
			pos++
		}
		if pos == len(order) {
			return nil, fmt.Errorf("layer %s of part %q is unknown or out of order", l.Digest, part)
		}
		if want := partMedia(part); l.MediaType != want {
			return nil, fmt.Errorf("layer %s of part %q has media type %q, not %q", l.Digest, part, l.MediaType, want)
		}
		out[part] = append(out[part], l)
	}
	return out, nil
}

// partMedia is the media type of a part's blobs.
func partMedia(part string) types.MediaType {
	switch part {
	case partCheckpoint:
		return mediaTar
	case partAgent:
		return mediaAgent
	}
	return mediaSend
}

const mediaManifest = types.OCIManifestSchema1

// artifactOfRaw describes a manifest about to be put (or just put).
func artifactOfRaw(kind Kind, repo name.Repository, tag string, raw []byte) Artifact {
	m, err := v1.ParseManifest(bytes.NewReader(raw))
	if err != nil {
		m = &v1.Manifest{}
	}
	d, _, _ := v1.SHA256(bytes.NewReader(raw))
	return artifactOf(kind, repo, tag, d, m)
}

func jsonBytes(v any) ([]byte, error) { return json.Marshal(v) }

// artifactOf describes a manifest.
func artifactOf(kind Kind, repo name.Repository, tag string, digest v1.Hash, m *v1.Manifest) Artifact {
	a := Artifact{
		Kind:      kind,
		Reference: repo.Tag(tag).String(),
		Tag:       tag,
		Digest:    digest.String(),
		Release:   m.Annotations[annRelease],
		Snapshot:  m.Annotations[annSnapshot],
		Size:      m.Config.Size,
		OwnSize:   m.Config.Size,
	}
	if t, err := time.Parse(time.RFC3339Nano, m.Annotations[annCreated]); err == nil {
		a.PushedAt = t
	}
	for _, l := range m.Layers {
		a.Size += l.Size
		if part := l.Annotations[annPart]; part != partBase && part != partAgent {
			a.OwnSize += l.Size // a base and an agent are shared by the snapshots that name them
		}
	}
	return a
}

// existing returns the artifact at tag if the registry has it.
func (o *op) existing(ctx context.Context, p *remote.Puller, kind Kind, repo name.Repository, tag string) (Artifact, bool, error) {
	desc, err := p.Get(ctx, repo.Tag(tag))
	if err != nil {
		var terr *transport.Error
		if errors.As(err, &terr) && terr.StatusCode == http.StatusNotFound {
			return Artifact{}, false, nil
		}
		return Artifact{}, false, o.c.fail(ctx, "check "+repo.Tag(tag).String(), err)
	}
	m, err := v1.ParseManifest(bytes.NewReader(desc.Manifest))
	if err != nil {
		return Artifact{}, false, fault.New(fault.BadGateway, "registry %s: manifest of %s: %v", o.c.registry, tag, err)
	}
	return artifactOf(kind, repo, tag, desc.Digest, m), true, nil
}

// pipeInto runs pull (which writes a stream) and consume (which reads it) together and
// returns consume's result; when both fail, the stream's failure is the cause.
func pipeInto(pull func(w io.Writer) error, consume func(r io.Reader) error) error {
	pr, pw := io.Pipe()
	done := make(chan error, 1)
	go func() {
		err := pull(pw)
		pw.CloseWithError(err)
		done <- err
	}()
	cerr := consume(pr)
	pr.CloseWithError(errConsumerDone)
	perr := <-done
	switch {
	case perr != nil && !errors.Is(perr, errConsumerDone):
		return perr
	case cerr != nil:
		return cerr
	case perr != nil:
		return fault.New(fault.BadGateway, "an artifact stream holds data after its end")
	}
	return nil
}

var errConsumerDone = errors.New("consumer finished")
