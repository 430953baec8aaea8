package storage

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/durable"
	"github.com/spacedev/space/internal/fault"
)

// Release is the metadata of an immutable template release (templates/<hex>/release.json).
type Release struct {
	// Name is the template name the release was built for, e.g. "base".
	Name string `json:"name"`
	// Digest is the content digest of the root filesystem (TreeDigest).
	Digest string `json:"digest"`
	// CreatedAt is when the release was built.
	CreatedAt time.Time `json:"created_at"`
	// SizeBytes is the total size of the regular files in the root filesystem.
	SizeBytes int64 `json:"size_bytes"`
	// Config is the release's runtime configuration (user, workdir, environment, start
	// command, default resources), kept with the release as its builder wrote it; its
	// one type is template.Config. Storage does not interpret it.
	Config json.RawMessage `json:"config"`
}

// ReleaseBuild is a release being built in tmp/: a writable subvolume for its root
// filesystem. Finish it with Commit or Discard; Discard after Commit does nothing, so
// `defer b.Discard(ctx)` is the undo for every failure path.
type ReleaseBuild struct {
	s       *Store
	dir     string // tmp/<build-...>, becomes templates/<hex>
	done    bool
	limited bool // SetLimit set a limit, which Commit lifts
}

// BeginRelease starts a release build with an empty writable root filesystem.
func (s *Store) BeginRelease(ctx context.Context) (*ReleaseBuild, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	dir, err := s.tmpDirFor("build")
	if err != nil {
		return nil, err
	}
	if err := createSubvolume(filepath.Join(dir, rootfsName)); err != nil {
		os.Remove(dir)
		return nil, fmt.Errorf("storage: %w", err)
	}
	s.log.DebugContext(ctx, "storage: release build started", "dir", dir)
	return &ReleaseBuild{s: s, dir: dir}, nil
}

// beginImport starts a release build without a root filesystem; the caller creates
// Rootfs() itself (btrfs receive does).
func (s *Store) beginImport(ctx context.Context) (*ReleaseBuild, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	dir, err := s.tmpDirFor("import")
	if err != nil {
		return nil, err
	}
	return &ReleaseBuild{s: s, dir: dir}, nil
}

// Rootfs returns the path of the root filesystem being built.
func (b *ReleaseBuild) Rootfs() string { return filepath.Join(b.dir, rootfsName) }

// SetLimit bounds what may be written into the build's root filesystem (build steps run
// in a sandbox on it): past bytes, writes fail with EDQUOT; 0 removes the limit. What the
// rootfs shares with the release it started from does not count. Fails with an error of
// kind fault.Unavailable when the store has no quotas (Store.QuotasEnabled says why).
func (b *ReleaseBuild) SetLimit(ctx context.Context, bytes int64) error {
	if bytes < 0 {
		return fault.New(fault.Invalid, "disk limit %d is negative", bytes)
	}
	if !b.s.quota.on {
		return fault.New(fault.Unavailable, "disk limits are off in this store: %s", b.s.quota.reason)
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	id, err := subvolumeIDOf(b.Rootfs())
	if err != nil {
		return fmt.Errorf("storage: build limit: %w", err)
	}
	if err := b.s.limit(qgroupID(0, id), bytes); err != nil {
		return fmt.Errorf("storage: build limit: %w", err)
	}
	b.limited = bytes != 0
	return nil
}

// Discard deletes the build. It does nothing after Commit or a previous Discard.
func (b *ReleaseBuild) Discard(ctx context.Context) error {
	if b.done {
		return nil
	}
	b.done = true
	// Removal must happen even when ctx is already cancelled (the usual reason to
	// discard); a crash still leaves only tmp/ leftovers that Open removes.
	if err := removeTree(context.WithoutCancel(ctx), b.dir); err != nil {
		return fmt.Errorf("storage: discard build: %w", err)
	}
	return nil
}

// Commit freezes the root filesystem (read-only), computes its digest and publishes it as
// a release with the given metadata. Digest, SizeBytes and (if zero) CreatedAt are filled
// in; if meta.Digest is set, the content must match it. If a release with the same digest
// exists already, the build is discarded and the existing release returned.
func (b *ReleaseBuild) Commit(ctx context.Context, meta Release) (rel Release, err error) {
	if b.done {
		return Release{}, errors.New("storage: release build already finished")
	}
	defer func() {
		if err != nil {
			b.Discard(ctx)
		}
	}()
	rootfs := b.Rootfs()
	sub, err := isSubvolume(rootfs)
	if err != nil {
		return Release{}, fmt.Errorf("storage: %w", err)
	}
	if !sub {
		return Release{}, fmt.Errorf("storage: %s is not a subvolume", rootfs)
	}
	if err := setReadOnly(rootfs, true); err != nil {
		return Release{}, fmt.Errorf("storage: %w", err)
	}
	if b.limited {
		// A release is read-only: the build's limit has no more use.
		if err := b.SetLimit(ctx, 0); err != nil {
			return Release{}, err
		}
	}
	digest, size, err := TreeDigest(ctx, rootfs)
	if err != nil {
		return Release{}, fmt.Errorf("storage: %w", err)
	}
	if meta.Digest != "" && meta.Digest != digest {
		return Release{}, fmt.Errorf("storage: content digest %s does not match expected %s", digest, meta.Digest)
	}
	hex, _ := digestHex(digest)
	if b.s.HasRelease(digest) {
		b.s.log.InfoContext(ctx, "storage: release exists, dropping new build", "digest", digest)
		b.Discard(ctx)
		return b.s.Release(digest)
	}

	rel = meta
	rel.Digest = digest
	rel.SizeBytes = size
	if rel.CreatedAt.IsZero() {
		rel.CreatedAt = time.Now().UTC()
	}
	if len(rel.Config) == 0 {
		rel.Config = json.RawMessage(`{}`)
	}
	data, err := json.MarshalIndent(rel, "", "  ")
	if err != nil {
		return Release{}, fmt.Errorf("storage: %w", err)
	}
	if err := durable.WriteFile(filepath.Join(b.dir, releaseFile), append(data, '\n'), 0o644); err != nil {
		return Release{}, fmt.Errorf("storage: %w", err)
	}
	// Make the contents durable before the rename publishes them.
	if err := syncFS(b.dir); err != nil {
		return Release{}, fmt.Errorf("storage: %w", err)
	}
	final := filepath.Join(b.s.root, templatesDir, hex)
	err = unix.Renameat2(unix.AT_FDCWD, b.dir, unix.AT_FDCWD, final, unix.RENAME_NOREPLACE)
	if errors.Is(err, unix.EEXIST) || errors.Is(err, unix.ENOTEMPTY) {
		// Lost a race with an identical build.
		b.Discard(ctx)
		return b.s.Release(digest)
	}
	if err != nil {
		return Release{}, fmt.Errorf("storage: publish release: %w", err)
	}
	b.done = true
	b.s.log.InfoContext(ctx, "storage: release published", "name", rel.Name, "digest", digest, "size", size)
	return rel, nil
}

func syncFS(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := unix.Syncfs(int(f.Fd())); err != nil {
		return fmt.Errorf("syncfs %s: %w", path, err)
	}
	return nil
}

func (s *Store) releaseDir(digest string) (string, error) {
	hex, err := digestHex(digest)
	if err != nil {
		return "", err
	}
	return filepath.Join(s.root, templatesDir, hex), nil
}

// HasRelease reports whether the release with this digest is in the store. An invalid
// digest is never present.
func (s *Store) HasRelease(digest string) bool {
	dir, err := s.releaseDir(digest)
	if err != nil {
		return false
	}
	_, err = os.Stat(filepath.Join(dir, releaseFile))
	return err == nil
}

// ReleaseRoot returns the path of the release's read-only root filesystem.
func (s *Store) ReleaseRoot(digest string) (string, error) {
	dir, err := s.releaseDir(digest)
	if err != nil {
		return "", err
	}
	if !s.HasRelease(digest) {
		return "", fmt.Errorf("storage: release %s: %w", digest, fs.ErrNotExist)
	}
	return filepath.Join(dir, rootfsName), nil
}

// Release returns the metadata of the release with this digest.
func (s *Store) Release(digest string) (Release, error) {
	dir, err := s.releaseDir(digest)
	if err != nil {
		return Release{}, err
	}
	return readRelease(filepath.Join(dir, releaseFile))
}

func readRelease(path string) (Release, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return Release{}, fmt.Errorf("storage: read release: %w", err)
	}
	var rel Release
	if err := json.Unmarshal(data, &rel); err != nil {
		return Release{}, fmt.Errorf("storage: parse %s: %w", path, err)
	}
	return rel, nil
}

// ListReleases returns all releases in the store, oldest first.
func (s *Store) ListReleases() ([]Release, error) {
	entries, err := os.ReadDir(filepath.Join(s.root, templatesDir))
	if err != nil {
		return nil, fmt.Errorf("storage: %w", err)
	}
	var rels []Release
	for _, e := range entries {
		if ValidateDigest(DigestPrefix+e.Name()) != nil {
			continue
		}
		rel, err := s.Release(DigestPrefix + e.Name())
		if err != nil {
			return nil, err
		}
		rels = append(rels, rel)
	}
	sort.Slice(rels, func(i, j int) bool {
		if !rels[i].CreatedAt.Equal(rels[j].CreatedAt) {
			return rels[i].CreatedAt.Before(rels[j].CreatedAt)
		}
		return rels[i].Digest < rels[j].Digest
	})
	return rels, nil
}

// DeleteRelease removes a release. Sandboxes created from it are independent snapshots
// and are not affected; whether a release is still wanted is the caller's decision.
// Deleting a missing release is not an error.
func (s *Store) DeleteRelease(ctx context.Context, digest string) error {
	dir, err := s.releaseDir(digest)
	if err != nil {
		return err
	}
	if err := s.retire(ctx, dir, "delete-release"); err != nil {
		return err
	}
	s.log.InfoContext(ctx, "storage: release deleted", "digest", digest)
	return nil
}
