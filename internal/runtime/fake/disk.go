package fake

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/storage"
)

// Disk is a store of plain directories with the node's store interface (node.Disk):
// releases, sandbox disks, checkpoints. Copies are real copies (cp -a), not btrfs
// snapshots, so it needs no root; tests keep their releases small.
type Disk struct {
	root         string
	mu           sync.Mutex
	rels         map[string]storage.Release
	rootfsLimits map[string]int64
	limits       map[string]int64
	full         string
	free         int64 // SetFree; negative: no bound
}

// NewDisk returns a directory store under root, with the releases recorded there.
func NewDisk(root string) (*Disk, error) {
	for _, d := range []string{"templates", "sandboxes", "tmp"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			return nil, err
		}
	}
	d := &Disk{root: root, rels: map[string]storage.Release{}, free: -1}
	recs, _ := filepath.Glob(filepath.Join(root, "templates", "*", releaseFile))
	for _, p := range recs {
		var rel storage.Release
		if b, err := os.ReadFile(p); err == nil && json.Unmarshal(b, &rel) == nil {
			d.rels[rel.Digest] = rel
		}
	}
	return d, nil
}

const releaseFile = "release.json"

// AddRelease records a release whose root filesystem holds files (path → content).
func (d *Disk) AddRelease(name, digest string, config json.RawMessage, files map[string]string) (storage.Release, error) {
	dir, err := d.releaseDir(digest)
	if err != nil {
		return storage.Release{}, err
	}
	for p, content := range files {
		full := filepath.Join(dir, "rootfs", p)
		if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
			return storage.Release{}, err
		}
		if err := os.WriteFile(full, []byte(content), 0o644); err != nil {
			return storage.Release{}, err
		}
	}
	if err := os.MkdirAll(filepath.Join(dir, "rootfs"), 0o755); err != nil {
		return storage.Release{}, err
	}
	if len(config) == 0 {
		config = json.RawMessage(`{}`)
	}
	rel := storage.Release{Name: name, Digest: digest, CreatedAt: time.Now().UTC(), Config: config}
	rec, _ := json.Marshal(rel)
	if err := os.WriteFile(filepath.Join(dir, releaseFile), rec, 0o644); err != nil {
		return storage.Release{}, err
	}
	d.mu.Lock()
	d.rels[digest] = rel
	d.mu.Unlock()
	return rel, nil
}

func (d *Disk) releaseDir(digest string) (string, error) {
	hex, ok := strings.CutPrefix(digest, "sha256:")
	if !ok || hex == "" || strings.ContainsAny(hex, "/.") {
		return "", fmt.Errorf("fake disk: invalid digest %q", digest)
	}
	return filepath.Join(d.root, "templates", hex), nil
}

// HasRelease reports whether the release is here.
func (d *Disk) HasRelease(digest string) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	_, ok := d.rels[digest]
	return ok
}

// Release returns a release's record.
func (d *Disk) Release(digest string) (storage.Release, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	rel, ok := d.rels[digest]
	if !ok {
		return storage.Release{}, fmt.Errorf("fake disk: release %s: %w", digest, fs.ErrNotExist)
	}
	return rel, nil
}

// ListReleases lists the releases.
func (d *Disk) ListReleases() ([]storage.Release, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	var out []storage.Release
	for _, r := range d.rels {
		out = append(out, r)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Digest < out[j].Digest })
	return out, nil
}

// DeleteRelease removes a release.
func (d *Disk) DeleteRelease(_ context.Context, digest string) error {
	dir, err := d.releaseDir(digest)
	if err != nil {
		return err
	}
	d.mu.Lock()
	delete(d.rels, digest)
	d.mu.Unlock()
	return os.RemoveAll(dir)
}

// SandboxDir returns sandboxes/<id>.
func (d *Disk) SandboxDir(id string) (string, error) {
	if err := storage.ValidateID(id); err != nil {
		return "", err
	}
	return filepath.Join(d.root, "sandboxes", id), nil
}

// SandboxRoot returns sandboxes/<id>/rootfs.
func (d *Disk) SandboxRoot(id string) (string, error) {
	dir, err := d.SandboxDir(id)
	return filepath.Join(dir, "rootfs"), err
}

// SandboxDisk returns sandboxes/<id>/disk.img.
func (d *Disk) SandboxDisk(id string) (string, error) {
	dir, err := d.SandboxDir(id)
	return filepath.Join(dir, "disk.img"), err
}

// CreateSandboxRoot copies the release's root filesystem into the sandbox's.
func (d *Disk) CreateSandboxRoot(ctx context.Context, id, digest string) (string, error) {
	dir, err := d.releaseDir(digest)
	if err != nil {
		return "", err
	}
	if !d.HasRelease(digest) {
		return "", fmt.Errorf("fake disk: release %s: %w", digest, fs.ErrNotExist)
	}
	root, err := d.SandboxRoot(id)
	if err != nil {
		return "", err
	}
	if _, err := os.Stat(root); err == nil {
		return "", fmt.Errorf("fake disk: sandbox %s: %w", id, fs.ErrExist)
	}
	if err := os.MkdirAll(filepath.Dir(root), 0o755); err != nil {
		return "", err
	}
	return root, copyTree(ctx, filepath.Join(dir, "rootfs"), root)
}

// CreateSandboxDisk is not supported: the fake runtime takes directories.
func (d *Disk) CreateSandboxDisk(context.Context, string, string, int64) (string, error) {
	return "", errors.New("fake disk: image disks are not supported")
}

// DeleteSandbox removes everything of a sandbox.
func (d *Disk) DeleteSandbox(_ context.Context, id string) error {
	dir, err := d.SandboxDir(id)
	if err != nil {
		return err
	}
	return os.RemoveAll(dir)
}

// ListSandboxes lists the sandboxes with a directory.
func (d *Disk) ListSandboxes() ([]string, error) {
	ents, err := os.ReadDir(filepath.Join(d.root, "sandboxes"))
	if err != nil {
		return nil, err
	}
	var out []string
	for _, e := range ents {
		if e.IsDir() && storage.ValidateID(e.Name()) == nil {
			out = append(out, e.Name())
		}
	}
	sort.Strings(out)
	return out, nil
}

// ExclusiveBytes sums the sizes of the sandbox's files.
func (d *Disk) ExclusiveBytes(_ context.Context, id string) (int64, error) {
	dir, err := d.SandboxDir(id)
	if err != nil {
		return 0, err
	}
	var n int64
	err = filepath.WalkDir(dir, func(_ string, e fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if fi, err := e.Info(); err == nil && fi.Mode().IsRegular() {
			n += fi.Size()
		}
		return nil
	})
	return n, err
}

// CheckpointDir returns sandboxes/<id>/checkpoint.
func (d *Disk) CheckpointDir(id string) (string, error) {
	dir, err := d.SandboxDir(id)
	return filepath.Join(dir, "checkpoint"), err
}

// CloneBatchDir returns sandboxes/<id>/clones/<batch>.
func (d *Disk) CloneBatchDir(id, batch string) (string, error) {
	dir, err := d.SandboxDir(id)
	return filepath.Join(dir, "clones", batch), err
}

// BaseSnapshotDir returns templates/<hex>/snapshots/<key>.
func (d *Disk) BaseSnapshotDir(digest, key string) (string, error) {
	dir, err := d.releaseDir(digest)
	return filepath.Join(dir, "snapshots", key), err
}

// TempDir makes a new directory under tmp/.
func (d *Disk) TempDir(prefix string) (string, error) {
	return os.MkdirTemp(filepath.Join(d.root, "tmp"), prefix+"-")
}

const (
	completeName = "complete"
	writtenName  = "written"
)

// MarkComplete marks a checkpoint directory complete.
func (d *Disk) MarkComplete(dir string) error {
	return os.WriteFile(filepath.Join(dir, completeName), []byte("ok\n"), 0o600)
}

// Sync does nothing: the fake store makes no durability promise.
func (d *Disk) Sync(context.Context, string) error { return nil }

// MarkWritten marks a checkpoint directory written this boot (as storage does).
func (d *Disk) MarkWritten(dir string) error {
	boot, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, writtenName), boot, 0o600)
}

// Unmark removes the completion markers.
func (d *Disk) Unmark(dir string) error {
	for _, name := range []string{completeName, writtenName} {
		if err := os.Remove(filepath.Join(dir, name)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return err
		}
	}
	return nil
}

// IsComplete reports whether dir is a complete checkpoint (or one written this boot).
func (d *Disk) IsComplete(dir string) bool {
	if d.IsDurable(dir) {
		return true
	}
	return storage.IsWrittenThisBoot(dir)
}

// IsDurable reports whether dir was marked complete.
func (d *Disk) IsDurable(dir string) bool {
	_, err := os.Stat(filepath.Join(dir, completeName))
	return err == nil
}

// CopyDisk copies a disk directory.
func (d *Disk) CopyDisk(ctx context.Context, src, dst string, _ bool) error {
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return err
	}
	return copyTree(ctx, src, dst)
}

// CopyTree copies a directory tree.
func (d *Disk) CopyTree(ctx context.Context, src, dst string) error {
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return err
	}
	if err := copyTree(ctx, src, dst); err != nil {
		return err
	}
	// As storage's: a checkpoint's completion markers are not copied.
	return d.Unmark(dst)
}

// SetRootfsLimit records a sandbox's root filesystem limit (enforced by none).
func (d *Disk) SetRootfsLimit(_ context.Context, id string, bytes int64) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.rootfsLimits == nil {
		d.rootfsLimits = map[string]int64{}
	}
	d.rootfsLimits[id] = bytes
	return nil
}

// SetSandboxLimit records a sandbox's limit (the directory store enforces none).
func (d *Disk) SetSandboxLimit(_ context.Context, id string, bytes int64) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.limits == nil {
		d.limits = map[string]int64{}
	}
	d.limits[id] = bytes
	return nil
}

// Limit returns the limit recorded for a sandbox (0 if none).
func (d *Disk) Limit(id string) int64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.limits[id]
}

// SetFull makes CheckSpace fail with reason ("" lets it pass again).
func (d *Disk) SetFull(reason string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.full = reason
}

// SetFree makes CheckSpace fail for needs above free bytes (a negative free lets every
// need pass again).
func (d *Disk) SetFree(free int64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.free = free
}

// CheckSpace fails when SetFull made the store "full", or when need is above what
// SetFree set.
func (d *Disk) CheckSpace(need int64) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.full != "" {
		return fault.New(fault.InsufficientStorage, "%s", d.full)
	}
	if d.free >= 0 && need > d.free {
		return fault.New(fault.InsufficientStorage, "need %d MiB, %d MiB free above the reserve (test)", need>>20, d.free>>20)
	}
	return nil
}

// RemoveAll removes a path.
func (d *Disk) RemoveAll(_ context.Context, path string) error { return os.RemoveAll(path) }

// RemoveLater removes path at once (the fake has nothing to gain by waiting).
func (d *Disk) RemoveLater(ctx context.Context, path string) error { return d.RemoveAll(ctx, path) }

func copyTree(ctx context.Context, src, dst string) error {
	if out, err := exec.CommandContext(ctx, "cp", "-a", src, dst).CombinedOutput(); err != nil {
		return fmt.Errorf("fake disk: copy %s: %v: %s", src, err, out)
	}
	return nil
}

// SnapshotDir returns snapshots/<id>.
func (d *Disk) SnapshotDir(id string) (string, error) {
	if err := storage.ValidateID(id); err != nil {
		return "", err
	}
	return filepath.Join(d.root, "snapshots", id), nil
}

// ListSnapshotDirs lists the ids under snapshots/.
func (d *Disk) ListSnapshotDirs() ([]string, error) {
	entries, err := os.ReadDir(filepath.Join(d.root, "snapshots"))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var out []string
	for _, e := range entries {
		if e.IsDir() {
			out = append(out, e.Name())
		}
	}
	sort.Strings(out)
	return out, nil
}
