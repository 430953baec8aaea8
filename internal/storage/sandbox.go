package storage

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
)

// SandboxDir returns the directory that holds everything stored for sandbox id
// (sandboxes/<id>). It may not exist.
func (s *Store) SandboxDir(id string) (string, error) {
	if err := ValidateID(id); err != nil {
		return "", err
	}
	return filepath.Join(s.root, sandboxesDir, id), nil
}

// SandboxRoot returns the path of sandbox id's writable root filesystem
// (sandboxes/<id>/rootfs). It may not exist.
func (s *Store) SandboxRoot(id string) (string, error) {
	dir, err := s.SandboxDir(id)
	if err != nil {
		return "", err
	}
	return filepath.Join(dir, rootfsName), nil
}

// CreateSandboxRoot makes sandbox id's root filesystem a writable snapshot of the release
// with this digest (O(1) in time and space) and returns its path. It fails with an error
// wrapping fs.ErrNotExist if the release is missing and fs.ErrExist if the root exists.
// SandboxDir may exist already (other per-sandbox files); if this call created it and
// fails, it removes it again.
func (s *Store) CreateSandboxRoot(ctx context.Context, id, digest string) (string, error) {
	if _, err := s.SandboxDir(id); err != nil {
		return "", err
	}
	src, err := s.ReleaseRoot(digest)
	if err != nil {
		return "", err
	}
	dir, made, err := s.makeSandboxDir(ctx, id)
	if err != nil {
		return "", err
	}
	root := filepath.Join(dir, rootfsName)
	if err := snapshotSubvolume(src, root, false); err != nil {
		if made {
			s.removeSandboxDir(ctx, dir)
		}
		return "", fmt.Errorf("storage: sandbox %s: %w", id, err)
	}
	s.log.DebugContext(ctx, "storage: sandbox root created", "id", id, "digest", digest)
	return root, nil
}

// DeleteSandbox removes sandbox id's directory with everything in it, including
// subvolumes nested inside its root filesystem, and its quota group. Deleting a missing
// sandbox is not an error.
func (s *Store) DeleteSandbox(ctx context.Context, id string) error {
	dir, err := s.SandboxDir(id)
	if err != nil {
		return err
	}
	if _, err := os.Lstat(dir); errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	vol, err := s.volumeID(dir)
	if err != nil {
		return fmt.Errorf("storage: sandbox %s: %w", id, err)
	}
	if vol != 0 {
		// Deleting the nested subvolumes is charged to the volume: at its limit it
		// would fail.
		if err := s.limit(qgroupID(1, vol), 0); err != nil {
			s.log.DebugContext(ctx, "storage: lift disk limit before delete", "id", id, "err", err)
		}
	}
	if err := s.retire(ctx, dir, "delete-sandbox"); err != nil {
		return err
	}
	s.dropGroup(ctx, vol)
	s.log.DebugContext(ctx, "storage: sandbox deleted", "id", id)
	return nil
}

// sandboxOf returns the id of the sandbox whose directory holds path (inside the store),
// or "" if path is not below sandboxes/<id>/.
func (s *Store) sandboxOf(path string) string {
	rel, err := filepath.Rel(filepath.Join(s.root, sandboxesDir), path)
	if err != nil || rel == "." || strings.HasPrefix(rel, "..") {
		return ""
	}
	id, rest, _ := strings.Cut(rel, string(filepath.Separator))
	if rest == "" || ValidateID(id) != nil {
		return ""
	}
	return id
}

// ListSandboxes returns the ids of all sandboxes that have a directory in the store,
// sorted.
func (s *Store) ListSandboxes() ([]string, error) {
	entries, err := os.ReadDir(filepath.Join(s.root, sandboxesDir))
	if err != nil {
		return nil, fmt.Errorf("storage: %w", err)
	}
	var ids []string
	for _, e := range entries {
		if e.IsDir() && ValidateID(e.Name()) == nil {
			ids = append(ids, e.Name())
		}
	}
	sort.Strings(ids)
	return ids, nil
}
