package storage

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/fault"
)

// Per-sandbox disk limits (see the package comment, "Disk limits"):
//
//	sandboxes/<id>            subvolume V, the sandbox volume, in qgroup 1/V
//	sandboxes/<id>/rootfs     snapshot of a release: a nested subvolume, also in 1/V
//	sandboxes/<id>/clones/*/disk, checkpoint/, disk.ext4: inside V, so in 1/V
//
// With simple quotas a nested subvolume joins the qgroups of the subvolume it is created
// in, so everything made inside V lands in 1/V without further calls, and the limit on
// 1/V bounds it all.

// quotaState records whether per-sandbox limits work in this store.
type quotaState struct {
	on     bool
	reason string // why limits are off
	sysfs  string // /sys/fs/btrfs/<uuid>/qgroups
}

// initQuotas enables btrfs simple quotas on the store's file system if no quota mode is
// on, and works out whether limits are available. It never fails Open: without quotas
// the store works, only SetSandboxLimit refuses (and says why).
func (s *Store) initQuotas(ctx context.Context, disable bool) {
	off := func(reason string) {
		s.quota = quotaState{reason: reason}
		s.log.WarnContext(ctx, "storage: per-sandbox disk limits are off", "reason", reason)
	}
	switch {
	case disable:
		s.quota = quotaState{reason: "disabled by configuration"}
		return
	case os.Geteuid() != 0:
		off("btrfs quotas need root")
		return
	}
	root, err := openDir(s.root)
	if err != nil {
		off(err.Error())
		return
	}
	defer root.Close()
	uuid, err := fsUUID(root)
	if err != nil {
		off(err.Error())
		return
	}
	sysfs := filepath.Join("/sys/fs/btrfs", uuid, "qgroups")
	mode, err := os.ReadFile(filepath.Join(sysfs, "mode"))
	if errors.Is(err, fs.ErrNotExist) {
		if err := enableSimpleQuotas(root); err != nil {
			if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.EOPNOTSUPP) {
				off("the kernel has no btrfs simple quotas (Linux 6.7 or later needed)")
			} else {
				off(err.Error())
			}
			return
		}
		msg := "storage: enabled btrfs simple quotas"
		if s.image == "" {
			// The operator's own file system gets an incompat feature flag.
			s.log.WarnContext(ctx, msg+": the file system now has the simple_quota feature; kernels before 6.7 cannot mount it", "root", s.root)
		} else {
			s.log.InfoContext(ctx, msg, "image", s.image)
		}
		mode, err = os.ReadFile(filepath.Join(sysfs, "mode"))
	}
	if err != nil {
		off(fmt.Sprintf("read quota mode: %v", err))
		return
	}
	if m := strings.TrimSpace(string(mode)); m != "squota" {
		off(fmt.Sprintf("the file system has btrfs quotas in mode %q; space uses simple quotas only (run `btrfs quota disable %s` to let it enable them)", m, s.root))
		return
	}
	s.quota = quotaState{on: true, sysfs: sysfs}
}

// QuotasEnabled reports whether per-sandbox disk limits work in this store, and if not,
// why.
func (s *Store) QuotasEnabled() (bool, string) { return s.quota.on, s.quota.reason }

// makeSandboxDir creates sandboxes/<id> if it does not exist: a subvolume (mode 0700)
// and, when quotas are on, its quota group 1/<subvolume id>. It reports whether it made
// it; a failure leaves nothing behind.
func (s *Store) makeSandboxDir(ctx context.Context, id string) (dir string, made bool, err error) {
	dir, err = s.SandboxDir(id)
	if err != nil {
		return "", false, err
	}
	if err := ctx.Err(); err != nil {
		return "", false, err
	}
	s.dirMu.Lock()
	defer s.dirMu.Unlock()
	if _, err := os.Lstat(dir); err == nil {
		// Made earlier; a crash may have come between the subvolume and its group.
		if err := s.ensureGroup(dir); err != nil {
			return "", false, fmt.Errorf("storage: sandbox %s: %w", id, err)
		}
		return dir, false, nil
	} else if !errors.Is(err, fs.ErrNotExist) {
		return "", false, fmt.Errorf("storage: %w", err)
	}
	if err := createSubvolume(dir); err != nil {
		return "", false, fmt.Errorf("storage: sandbox %s: %w", id, err)
	}
	undo := func() {
		ctx := context.WithoutCancel(ctx)
		s.removeSandboxDir(ctx, dir)
	}
	// A new subvolume's root directory is 0755; sandboxes/ is 0700, so nobody could
	// reach it meanwhile.
	if err := os.Chmod(dir, 0o700); err != nil {
		undo()
		return "", false, fmt.Errorf("storage: %w", err)
	}
	if err := s.ensureGroup(dir); err != nil {
		undo()
		return "", false, fmt.Errorf("storage: sandbox %s: %w", id, err)
	}
	return dir, true, nil
}

// ensureGroup gives the sandbox volume dir its quota group 1/V (V its subvolume id) if
// quotas are on and it has none. A sandbox directory that is not a subvolume (made
// before sandbox volumes existed) has no group.
func (s *Store) ensureGroup(dir string) error {
	if !s.quota.on {
		return nil
	}
	vol, err := s.volumeID(dir)
	if err != nil || vol == 0 {
		return err
	}
	root, err := openDir(s.root)
	if err != nil {
		return err
	}
	defer root.Close()
	g := qgroupID(1, vol)
	if _, err := os.Stat(s.qgroupDir(g)); err == nil {
		members, _, err := qgroupRelations(root, g)
		if err != nil {
			return err
		}
		if slices.Contains(members, qgroupID(0, vol)) {
			return nil
		}
	}
	// The marker, written first, is what lets the sweep at Open find a group whose
	// volume is gone (a crash during DeleteSandbox).
	if err := s.markGroup(vol, true); err != nil {
		return err
	}
	created := false
	if err := createQgroup(root, g); err == nil {
		created = true
	} else if !errors.Is(err, unix.EEXIST) {
		return err
	}
	if err := assignQgroup(root, true, qgroupID(0, vol), g); err != nil && !errors.Is(err, unix.EEXIST) {
		if created {
			destroyQgroup(root, g)
		}
		return err
	}
	return nil
}

// markGroup records (or forgets) that qgroup 1/vol belongs to a sandbox volume of this
// store: an empty file groupsDir/<vol>.
func (s *Store) markGroup(vol uint64, set bool) error {
	p := filepath.Join(s.root, groupsDir, strconv.FormatUint(vol, 10))
	if !set {
		if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return err
		}
		return nil
	}
	f, err := os.OpenFile(p, os.O_CREATE|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	return f.Close()
}

// sandboxGroup returns the qgroup that bounds sandbox dir: 1/V of its volume, or, for a
// sandbox directory made before sandbox volumes existed, 0/R of its rootfs subvolume
// (then only the root filesystem is bounded, not its checkpoints or a disk image).
func (s *Store) sandboxGroup(dir string) (uint64, error) {
	vol, err := s.volumeID(dir)
	if err != nil {
		return 0, err
	}
	if vol != 0 {
		return qgroupID(1, vol), nil
	}
	root := filepath.Join(dir, rootfsName)
	if sub, err := isSubvolume(root); err != nil || !sub {
		return 0, fault.New(fault.Conflict, "sandbox %s predates per-sandbox volumes and has no root filesystem subvolume: its disk cannot be limited", filepath.Base(dir))
	}
	r, err := subvolumeIDOf(root)
	if err != nil {
		return 0, err
	}
	return qgroupID(0, r), nil
}

// SetSandboxLimit bounds the bytes sandbox id's volume may own: what the sandbox writes
// to its root filesystem or disk image, its suspend snapshots and its clone batches. What
// it shares with its template release (or a clone source) does not count until it is
// overwritten. Writes past the limit fail with EDQUOT. bytes 0 removes the limit. Call it
// after CreateSandboxRoot or CreateSandboxDisk and before the sandbox runs. Fails with an
// error of kind fault.Unavailable when the store has no quotas (QuotasEnabled says why).
func (s *Store) SetSandboxLimit(ctx context.Context, id string, bytes int64) error {
	dir, err := s.SandboxDir(id)
	if err != nil {
		return fault.Wrap(fault.Invalid, err)
	}
	if err := s.checkLimit(ctx, id, dir, bytes); err != nil {
		return err
	}
	if err := s.ensureGroup(dir); err != nil {
		return fmt.Errorf("storage: sandbox %s: %w", id, err)
	}
	g, err := s.sandboxGroup(dir)
	if err != nil {
		return fmt.Errorf("storage: sandbox %s: %w", id, err)
	}
	if err := s.limit(g, bytes); err != nil {
		return fmt.Errorf("storage: sandbox %s: %w", id, err)
	}
	s.log.DebugContext(ctx, "storage: sandbox disk limit set", "id", id, "qgroup", qgroupName(g), "bytes", bytes)
	return nil
}

// SetRootfsLimit bounds what sandbox id may write to its root filesystem (a subvolume
// made by CreateSandboxRoot): its own quota group, 0/<rootfs>, counts the data the
// sandbox wrote or overwrote, not what it shares with its release. This is the
// sandbox's disk size (disk_mb); SetSandboxLimit bounds the whole sandbox volume,
// checkpoints included, above it. A sandbox on a disk image (VM runtimes) has no root
// filesystem here (the error wraps fs.ErrNotExist): the image's size bounds its disk.
// bytes 0 removes the limit. Errors as SetSandboxLimit's.
func (s *Store) SetRootfsLimit(ctx context.Context, id string, bytes int64) error {
	root, err := s.SandboxRoot(id)
	if err != nil {
		return fault.Wrap(fault.Invalid, err)
	}
	if err := s.checkLimit(ctx, id, root, bytes); err != nil {
		return err
	}
	vol, err := subvolumeIDOf(root)
	if err != nil {
		return fmt.Errorf("storage: sandbox %s: %w", id, err)
	}
	if err := s.limit(vol, bytes); err != nil {
		return fmt.Errorf("storage: sandbox %s rootfs: %w", id, err)
	}
	s.log.DebugContext(ctx, "storage: sandbox rootfs limit set", "id", id, "qgroup", qgroupName(vol), "bytes", bytes)
	return nil
}

// checkLimit is what setting a sandbox's limit of bytes at path needs: a non-negative
// size, quotas on, and path present.
func (s *Store) checkLimit(ctx context.Context, id, path string, bytes int64) error {
	if bytes < 0 {
		return fault.New(fault.Invalid, "disk limit %d is negative", bytes)
	}
	if !s.quota.on {
		return fault.New(fault.Unavailable, "per-sandbox disk limits are off in this store: %s", s.quota.reason)
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if _, err := os.Lstat(path); err != nil {
		return fmt.Errorf("storage: sandbox %s: %w", id, err)
	}
	return nil
}

// limit sets qgroup g's limit to bytes (0: no limit). Quota ioctls go through the
// store root: one on a directory inside a sandbox at its limit would be charged to the
// sandbox, and fail.
func (s *Store) limit(g uint64, bytes int64) error {
	root, err := openDir(s.root)
	if err != nil {
		return err
	}
	defer root.Close()
	maxExcl := uint64(bytes)
	if bytes == 0 {
		maxExcl = qgroupLimitClear
	}
	return limitQgroup(root, g, maxExcl)
}

// DiskUsage is a sandbox's disk use as its quota group counts it.
type DiskUsage struct {
	// UsedBytes is what the sandbox's volume owns: data it wrote (not what it still
	// shares with its release or clone source), its suspend snapshots, its clone batches,
	// and data it wrote that its clones still share.
	UsedBytes int64
	// LimitBytes is the limit set by SetSandboxLimit, 0 for none.
	LimitBytes int64
}

// SandboxUsage returns sandbox id's disk usage and limit. The numbers are the kernel's
// live accounting: data freed by a delete counts until the transaction commits (at most
// the commit interval, 30 s by default; syncfs forces it). Fails with fault.Unavailable
// when the store has no quotas.
func (s *Store) SandboxUsage(ctx context.Context, id string) (DiskUsage, error) {
	dir, err := s.SandboxDir(id)
	if err != nil {
		return DiskUsage{}, fault.Wrap(fault.Invalid, err)
	}
	if !s.quota.on {
		return DiskUsage{}, fault.New(fault.Unavailable, "per-sandbox disk accounting is off in this store: %s", s.quota.reason)
	}
	if err := ctx.Err(); err != nil {
		return DiskUsage{}, err
	}
	if _, err := os.Lstat(dir); err != nil {
		return DiskUsage{}, fmt.Errorf("storage: sandbox %s: %w", id, err)
	}
	g, err := s.sandboxGroup(dir)
	if err != nil {
		return DiskUsage{}, fmt.Errorf("storage: sandbox %s: %w", id, err)
	}
	used, err := s.qgroupValue(g, "exclusive")
	if err != nil {
		return DiskUsage{}, fmt.Errorf("storage: sandbox %s: %w", id, err)
	}
	limit, err := s.qgroupValue(g, "max_exclusive")
	if err != nil {
		return DiskUsage{}, fmt.Errorf("storage: sandbox %s: %w", id, err)
	}
	return DiskUsage{UsedBytes: used, LimitBytes: limit}, nil
}

func (s *Store) qgroupDir(id uint64) string {
	return filepath.Join(s.quota.sysfs, fmt.Sprintf("%d_%d", id>>qgroupLevelShift, id&(1<<qgroupLevelShift-1)))
}

// qgroupValue reads one of qgroup id's numbers from sysfs (referenced, exclusive,
// max_exclusive, ...).
func (s *Store) qgroupValue(id uint64, name string) (int64, error) {
	data, err := os.ReadFile(filepath.Join(s.qgroupDir(id), name))
	if err != nil {
		return 0, fmt.Errorf("qgroup %s: %w", qgroupName(id), err)
	}
	n, err := strconv.ParseUint(strings.TrimSpace(string(data)), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("qgroup %s %s: %w", qgroupName(id), name, err)
	}
	if n > 1<<62 {
		n = 0 // an unset limit may read as all ones
	}
	return int64(n), nil
}

// removeSandboxDir deletes a sandbox directory that never held a sandbox (an undo) and
// its quota group.
func (s *Store) removeSandboxDir(ctx context.Context, dir string) {
	vol, _ := s.volumeID(dir)
	if err := s.removeAll(ctx, dir); err != nil {
		s.log.WarnContext(ctx, "storage: undo sandbox directory", "dir", dir, "err", err)
		return
	}
	s.dropGroup(ctx, vol)
}

// volumeID returns the subvolume id of sandbox directory dir if it is a sandbox volume
// and quotas are on, else 0.
func (s *Store) volumeID(dir string) (uint64, error) {
	if !s.quota.on {
		return 0, nil
	}
	sub, err := isSubvolume(dir)
	if err != nil || !sub {
		return 0, err
	}
	return subvolumeIDOf(dir)
}

// removeAll is removeTree for paths that may hold sandbox volumes. Deleting a subvolume
// is charged to the subvolume it sits in, so inside a sandbox at its limit it fails with
// EDQUOT: then the limits of every subvolume under path (and of their groups) are lifted
// and the removal is tried again.
func (s *Store) removeAll(ctx context.Context, path string) error {
	err := removeTree(ctx, path)
	if !s.quota.on || !errors.Is(err, unix.EDQUOT) {
		return err
	}
	if lerr := s.liftLimits(ctx, path); lerr != nil {
		return fmt.Errorf("%w (lifting its disk limits: %v)", err, lerr)
	}
	return removeTree(ctx, path)
}

// liftLimits removes the limits of the qgroups of every subvolume under path and of the
// groups they belong to.
func (s *Store) liftLimits(ctx context.Context, path string) error {
	root, err := openDir(s.root)
	if err != nil {
		return err
	}
	defer root.Close()
	return filepath.WalkDir(path, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil
			}
			return err
		}
		if ctxErr := ctx.Err(); ctxErr != nil {
			return ctxErr
		}
		if !d.IsDir() {
			return nil
		}
		sub, err := isSubvolume(p)
		if err != nil || !sub {
			return err
		}
		id, err := subvolumeIDOf(p)
		if err != nil {
			return err
		}
		_, parents, err := qgroupRelations(root, qgroupID(0, id))
		if err != nil {
			return err
		}
		for _, g := range append(parents, qgroupID(0, id)) {
			if err := limitQgroup(root, g, qgroupLimitClear); err != nil && !errors.Is(err, unix.ENOENT) {
				return err
			}
		}
		return nil
	})
}

// dropGroup removes qgroup 1/vol after its volume was deleted: first its members (the
// deleted subvolumes' own qgroups, which stay while clones still share their data), then
// the group. A group that cannot go yet stays until the sweep at the next Open.
func (s *Store) dropGroup(ctx context.Context, vol uint64) {
	if vol == 0 || !s.quota.on {
		return
	}
	root, err := openDir(s.root)
	if err != nil {
		return
	}
	defer root.Close()
	if err := s.removeGroup(root, qgroupID(1, vol)); err != nil {
		s.log.DebugContext(ctx, "storage: quota group left for the sweep at the next Open", "qgroup", qgroupName(qgroupID(1, vol)), "err", err)
		return
	}
	s.markGroup(vol, false)
}

func (s *Store) removeGroup(root *os.File, g uint64) error {
	members, _, err := qgroupRelations(root, g)
	if err != nil {
		return err
	}
	for _, m := range members {
		if err := assignQgroup(root, false, m, g); err != nil && !errors.Is(err, unix.ENOENT) {
			return err
		}
	}
	if err := destroyQgroup(root, g); err != nil && !errors.Is(err, unix.ENOENT) {
		return err
	}
	return nil
}

// sweepQgroups removes the quota groups of sandbox volumes that no longer exist (left by
// a crash during DeleteSandbox), then the empty qgroups of deleted subvolumes (what
// `btrfs qgroup clear-stale` does). Only groups this store made are touched.
func (s *Store) sweepQgroups(ctx context.Context) {
	root, err := openDir(s.root)
	if err != nil {
		return
	}
	defer root.Close()
	// Commit first, so that frees of dropped subvolumes are accounted.
	if err := unix.Syncfs(int(root.Fd())); err != nil {
		return
	}
	removed := 0
	marks, _ := os.ReadDir(filepath.Join(s.root, groupsDir))
	for _, m := range marks {
		vol, err := strconv.ParseUint(m.Name(), 10, 48)
		if err != nil {
			continue
		}
		if exists, err := subvolumeExists(root, vol); err != nil || exists {
			continue
		}
		if err := s.removeGroup(root, qgroupID(1, vol)); err != nil {
			s.log.DebugContext(ctx, "storage: stale quota group stays", "qgroup", qgroupName(qgroupID(1, vol)), "err", err)
			continue
		}
		s.markGroup(vol, false)
		removed++
	}
	entries, _ := os.ReadDir(s.quota.sysfs)
	for _, e := range entries {
		level, id, ok := parseQgroupDir(e.Name())
		if !ok || level != 0 || id == 5 { // 0/5 is the top-level subvolume
			continue
		}
		if exists, err := subvolumeExists(root, id); err != nil || exists {
			continue
		}
		g := qgroupID(0, id)
		if used, err := s.qgroupValue(g, "exclusive"); err == nil && used == 0 && destroyQgroup(root, g) == nil {
			removed++
		}
	}
	if removed > 0 {
		s.log.InfoContext(ctx, "storage: removed stale quota groups", "count", removed)
	}
}

// parseQgroupDir parses a sysfs qgroup directory name "<level>_<id>".
func parseQgroupDir(name string) (level, id uint64, ok bool) {
	l, i, found := strings.Cut(name, "_")
	if !found {
		return 0, 0, false
	}
	level, err1 := strconv.ParseUint(l, 10, 16)
	id, err2 := strconv.ParseUint(i, 10, 48)
	return level, id, err1 == nil && err2 == nil
}
