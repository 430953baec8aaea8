package storage

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

// DefaultImageSize is the apparent size of a freshly made store image. The file is
// sparse: it only takes the space its contents use.
const DefaultImageSize int64 = 64 << 30

// Config configures Open.
type Config struct {
	// DataDir is the space data directory; the store lives in DataDir/store.
	DataDir string
	// ImageSizeBytes is the size of the sparse image made when DataDir is not on btrfs
	// (default DefaultImageSize). Only used when the image is first created.
	ImageSizeBytes int64
	// Logger receives debug and info messages (default: discarded).
	Logger *slog.Logger
	// DisableQuotas leaves btrfs quotas alone: Open does not enable simple quotas, and
	// per-sandbox disk limits (SetSandboxLimit) are unavailable.
	DisableQuotas bool
	// DiskReserve is the fraction (0 to <1) of each file system under the store that
	// CheckSpace keeps free; 0 keeps nothing free. The operator flag defaults to
	// DefaultDiskReserve.
	DiskReserve float64
}

// Store is an open btrfs store. Its methods are safe for concurrent use.
type Store struct {
	root    string // DataDir/store
	image   string // DataDir/store.img, "" if the store is not image-backed
	log     *slog.Logger
	reserve float64    // Config.DiskReserve
	quota   quotaState // set by Open

	mu   sync.Mutex
	lock *os.File // shared flock on root/.lock; nil once closed

	dirMu sync.Mutex // serializes making sandbox directories

	bg sync.WaitGroup // removals running in the background (retireLater)
}

const (
	storeDirName = "store"
	imageName    = "store.img"
	lockName     = ".lock"
	templatesDir = "templates"
	sandboxesDir = "sandboxes"
	tmpDir       = "tmp"
	groupsDir    = ".qgroups"
	trashName    = ".trash" // in a sandbox volume: what is being removed from it
	rootfsName   = "rootfs"
	releaseFile  = "release.json"
)

// Open opens the store in cfg.DataDir, creating and mounting it as needed (see the
// package comment). It also brings a store made by an older version up to date: mount
// flags nosuid,nodev, directory modes 0700, simple quotas. Setup that fails half-way is
// undone.
func Open(ctx context.Context, cfg Config) (_ *Store, err error) {
	if cfg.DataDir == "" {
		return nil, errors.New("storage: DataDir is required")
	}
	if cfg.DiskReserve < 0 || cfg.DiskReserve >= 1 {
		return nil, fmt.Errorf("storage: disk reserve %v is not a fraction from 0 to below 1", cfg.DiskReserve)
	}
	dataDir, err := filepath.Abs(cfg.DataDir)
	if err != nil {
		return nil, fmt.Errorf("storage: %w", err)
	}
	size := cfg.ImageSizeBytes
	if size == 0 {
		size = DefaultImageSize
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s := &Store{root: filepath.Join(dataDir, storeDirName), log: log, reserve: cfg.DiskReserve}

	var undo []func()
	defer func() {
		if err != nil {
			for i := len(undo) - 1; i >= 0; i-- {
				undo[i]()
			}
		}
	}()

	if err := os.MkdirAll(dataDir, 0o755); err != nil {
		return nil, fmt.Errorf("storage: %w", err)
	}
	madeRoot, err := mkdirNew(s.root, 0o700)
	if err != nil {
		return nil, fmt.Errorf("storage: %w", err)
	}
	if madeRoot {
		undo = append(undo, func() { os.Remove(s.root) })
	}

	image := filepath.Join(dataDir, imageName)
	onBtrfs, err := isBtrfs(s.root)
	if err != nil {
		return nil, fmt.Errorf("storage: %w", err)
	}
	if onBtrfs {
		if _, statErr := os.Stat(image); statErr == nil {
			if mp, _ := isMountPoint(s.root); mp {
				s.image = image
			}
		}
		log.DebugContext(ctx, "storage: using btrfs directory", "root", s.root, "image", s.image)
		if err := s.secureMount(ctx, &undo); err != nil {
			return nil, fmt.Errorf("storage: %w", err)
		}
	} else {
		if os.Geteuid() != 0 {
			return nil, fmt.Errorf("storage: %s is not on btrfs and loop-mounting an image there needs root (running as uid %d)", dataDir, os.Geteuid())
		}
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		if _, statErr := os.Stat(image); errors.Is(statErr, fs.ErrNotExist) {
			log.InfoContext(ctx, "storage: creating btrfs image", "image", image, "size", size)
			if err := makeImage(ctx, image, size); err != nil {
				return nil, fmt.Errorf("storage: %w", err)
			}
			undo = append(undo, func() { os.Remove(image) })
		} else if statErr != nil {
			return nil, fmt.Errorf("storage: %w", statErr)
		}
		if err := mountImage(image, s.root, storeMountFlags); err != nil {
			return nil, fmt.Errorf("storage: %w", err)
		}
		undo = append(undo, func() { unix.Unmount(s.root, 0) })
		s.image = image
		log.InfoContext(ctx, "storage: mounted btrfs image", "image", image, "root", s.root)
	}

	if err := s.restrictModes(); err != nil {
		return nil, fmt.Errorf("storage: %w", err)
	}
	s.initQuotas(ctx, cfg.DisableQuotas)
	if err := s.lockAndClean(ctx); err != nil {
		return nil, fmt.Errorf("storage: %w", err)
	}
	if s.quota.on {
		s.sweepQgroups(ctx)
	}
	return s, nil
}

// restrictModes makes the store's directories mode 0700, creating the fixed ones: the
// root, templates/, sandboxes/, tmp/ and every entry of templates/ and sandboxes/. Only
// root (the runtimes run as root) may walk to a sandbox's files; an older store with
// 0755 directories is fixed here.
func (s *Store) restrictModes() error {
	if err := os.Chmod(s.root, 0o700); err != nil {
		return err
	}
	for _, d := range []string{templatesDir, sandboxesDir, tmpDir, groupsDir} {
		p := filepath.Join(s.root, d)
		if err := os.MkdirAll(p, 0o700); err != nil {
			return err
		}
		if err := os.Chmod(p, 0o700); err != nil {
			return err
		}
	}
	for _, d := range []string{templatesDir, sandboxesDir} {
		entries, err := os.ReadDir(filepath.Join(s.root, d))
		if err != nil {
			return err
		}
		for _, e := range entries {
			if !e.IsDir() {
				continue
			}
			info, err := e.Info()
			if err != nil {
				return err
			}
			if info.Mode().Perm() != 0o700 {
				if err := os.Chmod(filepath.Join(s.root, d, e.Name()), 0o700); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// mkdirNew creates dir if missing and reports whether it did.
func mkdirNew(dir string, perm os.FileMode) (bool, error) {
	err := os.Mkdir(dir, perm)
	if errors.Is(err, fs.ErrExist) {
		return false, nil
	}
	return err == nil, err
}

// lockAndClean takes the store's shared lock, emptying tmp/ first if no other process
// holds the store open.
func (s *Store) lockAndClean(ctx context.Context) error {
	f, err := os.OpenFile(filepath.Join(s.root, lockName), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return fmt.Errorf("open lock: %w", err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err == nil {
		cleanErr := s.cleanTmp(ctx)
		if cleanErr != nil {
			f.Close()
			return cleanErr
		}
	} else if !errors.Is(err, unix.EWOULDBLOCK) {
		f.Close()
		return fmt.Errorf("lock store: %w", err)
	}
	// Converts our exclusive lock, or waits for another process's short cleanup.
	if err := unix.Flock(int(f.Fd()), unix.LOCK_SH); err != nil {
		f.Close()
		return fmt.Errorf("lock store: %w", err)
	}
	s.lock = f
	return nil
}

func (s *Store) cleanTmp(ctx context.Context) error {
	dirs := []string{filepath.Join(s.root, tmpDir)}
	trashes, err := filepath.Glob(filepath.Join(s.root, sandboxesDir, "*", trashName))
	if err != nil {
		return fmt.Errorf("clean tmp: %w", err)
	}
	for _, dir := range append(dirs, trashes...) {
		entries, err := os.ReadDir(dir)
		if err != nil {
			return fmt.Errorf("clean tmp: %w", err)
		}
		for _, e := range entries {
			p := filepath.Join(dir, e.Name())
			s.log.InfoContext(ctx, "storage: removing leftover", "path", p)
			if err := s.removeAll(ctx, p); err != nil {
				return fmt.Errorf("clean tmp: %w", err)
			}
		}
	}
	return nil
}

// Root returns the store's root directory.
func (s *Store) Root() string { return s.root }

// Close releases the store. The volume stays mounted (see Unmount).
func (s *Store) Close() error {
	s.bg.Wait()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.lock == nil {
		return nil
	}
	err := s.lock.Close()
	s.lock = nil
	return err
}

// Unmount closes the store and, if it is a loop-mounted image, unmounts it (which also
// detaches the loop device). Meant for tests and tooling: space itself leaves the store
// mounted so sandboxes outlive its restarts.
func (s *Store) Unmount(ctx context.Context) error {
	if err := s.Close(); err != nil {
		return fmt.Errorf("storage: %w", err)
	}
	if s.image == "" {
		return nil
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := unix.Unmount(s.root, 0); err != nil && !errors.Is(err, unix.EINVAL) {
		return fmt.Errorf("storage: unmount %s: %w", s.root, err)
	}
	s.log.InfoContext(ctx, "storage: unmounted", "root", s.root)
	return nil
}

// inStore returns the cleaned absolute form of path after checking that it lies strictly
// inside the store root.
func (s *Store) inStore(path string) (string, error) {
	p, err := filepath.Abs(path)
	if err != nil {
		return "", fmt.Errorf("storage: %w", err)
	}
	rel, err := filepath.Rel(s.root, p)
	if err != nil || rel == "." || rel == ".." || strings.HasPrefix(rel, "../") {
		return "", fmt.Errorf("storage: %s is not inside the store %s", path, s.root)
	}
	return p, nil
}

// CreateSubvolume creates an empty subvolume at path, which must be inside the store.
func (s *Store) CreateSubvolume(ctx context.Context, path string) error {
	p, err := s.inStore(path)
	if err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := createSubvolume(p); err != nil {
		return fmt.Errorf("storage: %w", err)
	}
	return nil
}

// Snapshot makes dst a snapshot of the subvolume src (both inside the store), in O(1).
func (s *Store) Snapshot(ctx context.Context, src, dst string, readOnly bool) error {
	sp, err := s.inStore(src)
	if err != nil {
		return err
	}
	dp, err := s.inStore(dst)
	if err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := snapshotSubvolume(sp, dp, readOnly); err != nil {
		return fmt.Errorf("storage: %w", err)
	}
	return nil
}

// DeleteSubvolume deletes the subvolume at path (inside the store) and every subvolume
// nested in it, read-only ones included.
func (s *Store) DeleteSubvolume(ctx context.Context, path string) error {
	p, err := s.inStore(path)
	if err != nil {
		return err
	}
	sub, err := isSubvolume(p)
	if err != nil {
		return fmt.Errorf("storage: %w", err)
	}
	if !sub {
		return fmt.Errorf("storage: %s is not a subvolume", p)
	}
	if err := deleteSubvolume(ctx, p); err != nil {
		return fmt.Errorf("storage: %w", err)
	}
	return nil
}

// SetReadOnly sets or clears the read-only flag of the subvolume at path (inside the
// store).
func (s *Store) SetReadOnly(ctx context.Context, path string, readOnly bool) error {
	p, err := s.inStore(path)
	if err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := setReadOnly(p, readOnly); err != nil {
		return fmt.Errorf("storage: %w", err)
	}
	return nil
}

// IsReadOnly reports whether the subvolume at path (inside the store) is read-only.
func (s *Store) IsReadOnly(path string) (bool, error) {
	p, err := s.inStore(path)
	if err != nil {
		return false, err
	}
	ro, err := isReadOnly(p)
	if err != nil {
		return false, fmt.Errorf("storage: %w", err)
	}
	return ro, nil
}

// IsSubvolume reports whether path (inside the store) is a subvolume root.
func (s *Store) IsSubvolume(path string) (bool, error) {
	p, err := s.inStore(path)
	if err != nil {
		return false, err
	}
	sub, err := isSubvolume(p)
	if err != nil {
		return false, fmt.Errorf("storage: %w", err)
	}
	return sub, nil
}

// trashDirFor makes a fresh directory prefix-<random> in the trash of the sandbox volume
// that holds path.
func (s *Store) trashDirFor(path, prefix string) (string, error) {
	id := s.sandboxOf(path)
	if id == "" {
		return "", fmt.Errorf("storage: %s is in another subvolume than tmp/ and not in a sandbox volume", path)
	}
	trash := filepath.Join(s.root, sandboxesDir, id, trashName)
	if err := os.MkdirAll(trash, 0o700); err != nil {
		return "", fmt.Errorf("storage: %w", err)
	}
	d, err := os.MkdirTemp(trash, prefix+"-")
	if err != nil {
		return "", fmt.Errorf("storage: %w", err)
	}
	return d, nil
}

// tmpDirFor makes a fresh directory in tmp/ named prefix-<random>.
func (s *Store) tmpDirFor(prefix string) (string, error) {
	d, err := os.MkdirTemp(filepath.Join(s.root, tmpDir), prefix+"-")
	if err != nil {
		return "", fmt.Errorf("storage: %w", err)
	}
	return d, nil
}

// retire moves path into tmp/ with one rename and removes it there, so that readers
// never see a half-deleted entry and a crash leaves only a leftover that the next Open
// removes. A path inside a sandbox volume (a checkpoint, a clone batch) cannot be renamed
// out of its subvolume: it goes to the volume's own trash, sandboxes/<id>/.trash/, which
// Open empties likewise. A missing path is not an error.
func (s *Store) retire(ctx context.Context, path, prefix string) error {
	d, err := s.moveAside(path, prefix)
	if err != nil || d == "" {
		return err
	}
	if err := s.removeAll(ctx, d); err != nil {
		return fmt.Errorf("storage: %w", err)
	}
	return nil
}

// retireLater is retire that returns once path is moved aside and removes it in the
// background (Close waits for it). A crash meanwhile leaves a leftover that the next
// Open removes.
func (s *Store) retireLater(ctx context.Context, path, prefix string) error {
	d, err := s.moveAside(path, prefix)
	if err != nil || d == "" {
		return err
	}
	s.bg.Add(1)
	go func() {
		defer s.bg.Done()
		if err := s.removeAll(context.WithoutCancel(ctx), d); err != nil {
			s.log.Warn("storage: remove in the background; the next start removes what is left", "path", d, "err", err)
		}
	}()
	return nil
}

// moveAside renames path into a fresh directory of tmp/ (or of its sandbox volume's
// trash) and returns that directory; "" when path does not exist.
func (s *Store) moveAside(path, prefix string) (string, error) {
	d, err := s.tmpDirFor(prefix)
	if err != nil {
		return "", err
	}
	dst := filepath.Join(d, filepath.Base(path))
	err = os.Rename(path, dst)
	if errors.Is(err, unix.EXDEV) {
		os.Remove(d)
		if d, err = s.trashDirFor(path, prefix); err != nil {
			return "", err
		}
		dst = filepath.Join(d, filepath.Base(path))
		err = os.Rename(path, dst)
	}
	if err != nil {
		os.Remove(d)
		if errors.Is(err, fs.ErrNotExist) {
			return "", nil
		}
		return "", fmt.Errorf("storage: %w", err)
	}
	return d, nil
}
