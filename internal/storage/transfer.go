package storage

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
)

// exportFormat names the release export format, written as the first header field.
const exportFormat = "space-release-v1"

// maxHeader bounds the header line of an export.
const maxHeader = 1 << 20

// exportHeader is the first line of an export.
type exportHeader struct {
	Format  string  `json:"format"`
	Release Release `json:"release"`
}

// ExportRelease writes the release as one stream: a single line of JSON
// {"format":"space-release-v1","release":{...}} followed by the `btrfs send` stream of its
// root filesystem. ImportRelease reads it back.
func (s *Store) ExportRelease(ctx context.Context, digest string, w io.Writer) error {
	rel, err := s.Release(digest)
	if err != nil {
		return err
	}
	root, err := s.ReleaseRoot(digest)
	if err != nil {
		return err
	}
	btrfs, err := lookTool("btrfs")
	if err != nil {
		return err
	}
	hdr, err := json.Marshal(exportHeader{Format: exportFormat, Release: rel})
	if err != nil {
		return fmt.Errorf("storage: %w", err)
	}
	if _, err := w.Write(append(hdr, '\n')); err != nil {
		return fmt.Errorf("storage: export %s: %w", digest, err)
	}
	var stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, btrfs, "send", "-q", root)
	cmd.Stdout = w
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		if ctxErr := ctx.Err(); ctxErr != nil {
			return ctxErr
		}
		return fmt.Errorf("storage: export %s: btrfs send: %w: %s", digest, err, bytes.TrimSpace(stderr.Bytes()))
	}
	s.log.InfoContext(ctx, "storage: release exported", "digest", digest)
	return nil
}

// ImportRelease reads a stream written by ExportRelease and adds the release to the store,
// keeping its metadata. The received root filesystem's digest is recomputed and must
// match the digest in the header. If the release exists already, the existing one is
// returned (the stream is still read and checked). A failed import leaves nothing behind.
func (s *Store) ImportRelease(ctx context.Context, r io.Reader) (Release, error) {
	btrfs, err := lookTool("btrfs")
	if err != nil {
		return Release{}, err
	}
	br := bufio.NewReaderSize(r, maxHeader)
	line, err := br.ReadSlice('\n')
	if err != nil {
		return Release{}, fmt.Errorf("storage: import: read header: %w", err)
	}
	var hdr exportHeader
	if err := json.Unmarshal(line, &hdr); err != nil {
		return Release{}, fmt.Errorf("storage: import: parse header: %w", err)
	}
	if hdr.Format != exportFormat {
		return Release{}, fmt.Errorf("storage: import: unknown format %q", hdr.Format)
	}
	if err := ValidateDigest(hdr.Release.Digest); err != nil {
		return Release{}, fmt.Errorf("storage: import: %w", err)
	}

	b, err := s.beginImport(ctx)
	if err != nil {
		return Release{}, err
	}
	defer b.Discard(ctx)

	// --chroot confines the receiver to the target directory, so a crafted stream cannot
	// write outside it.
	var out bytes.Buffer
	cmd := exec.CommandContext(ctx, btrfs, "receive", "--chroot", "-e", b.dir)
	cmd.Stdin = br
	cmd.Stdout = &out
	cmd.Stderr = &out
	if err := cmd.Run(); err != nil {
		if ctxErr := ctx.Err(); ctxErr != nil {
			return Release{}, ctxErr
		}
		return Release{}, fmt.Errorf("storage: import: btrfs receive: %w: %s", err, bytes.TrimSpace(out.Bytes()))
	}
	// The stream must have held exactly one subvolume, named rootfs.
	entries, err := os.ReadDir(b.dir)
	if err != nil {
		return Release{}, fmt.Errorf("storage: import: %w", err)
	}
	if len(entries) != 1 || entries[0].Name() != rootfsName {
		return Release{}, errors.New("storage: import: stream does not hold exactly one subvolume named rootfs")
	}
	if sub, err := isSubvolume(filepath.Join(b.dir, rootfsName)); err != nil || !sub {
		return Release{}, errors.New("storage: import: received rootfs is not a subvolume")
	}
	rel, err := b.Commit(ctx, hdr.Release)
	if err != nil {
		return Release{}, fmt.Errorf("storage: import: %w", err)
	}
	s.log.InfoContext(ctx, "storage: release imported", "digest", rel.Digest)
	return rel, nil
}
