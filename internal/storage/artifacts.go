package storage

// What the registry transfer (internal/artifact) needs of the store: raw send streams,
// receiving them under the filter of sendstream.go, subvolume identities, and two caches
// of pulled artifacts:
//
//	pulled/<name>/   a snapshot pulled from a registry (<name>: the hex of its artifact
//	                 digest): a received read-only subvolume, a checkpoint directory and
//	                 metadata, as the artifact package lays them out
//	bases/<name>/    a disk base of VM-runtime snapshots (see internal/artifact): a
//	                 read-only subvolume holding a disk image
//
// An entry is assembled in tmp/ (ArtifactBuild) and published with one rename, so both
// directories only ever hold complete entries, and what a crash leaves in tmp/ is
// removed by the next Open. Entries are read-only once published: a sandbox made from
// one gets O(1) copies (CopyDisk, CopyTree) and never writes to the entry itself.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/fault"
)

// ArtifactKind names a cache of pulled artifacts in the store.
type ArtifactKind string

// The caches.
const (
	// PulledSnapshots holds snapshots pulled from a registry.
	PulledSnapshots ArtifactKind = "pulled"
	// DiskBases holds the bases that VM-runtime snapshot disks are sent against.
	DiskBases ArtifactKind = "bases"
)

func (k ArtifactKind) valid() error {
	if k != PulledSnapshots && k != DiskBases {
		return fmt.Errorf("storage: unknown artifact kind %q", k)
	}
	return nil
}

// ArtifactDir returns the directory of cache entry name of kind (it may not exist).
func (s *Store) ArtifactDir(kind ArtifactKind, name string) (string, error) {
	if err := kind.valid(); err != nil {
		return "", err
	}
	if err := validateName(name); err != nil {
		return "", err
	}
	return filepath.Join(s.root, string(kind), name), nil
}

// HasArtifact reports whether cache entry name of kind exists.
func (s *Store) HasArtifact(kind ArtifactKind, name string) bool {
	dir, err := s.ArtifactDir(kind, name)
	if err != nil {
		return false
	}
	_, err = os.Lstat(dir)
	return err == nil
}

// ArtifactEntry is one entry of an artifact cache.
type ArtifactEntry struct {
	Name string
	Path string
	// PublishedAt is when the entry was published (its directory's modification time).
	PublishedAt time.Time
}

// ListArtifacts returns the entries of a cache, sorted by name.
func (s *Store) ListArtifacts(kind ArtifactKind) ([]ArtifactEntry, error) {
	if err := kind.valid(); err != nil {
		return nil, err
	}
	dir := filepath.Join(s.root, string(kind))
	entries, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("storage: %w", err)
	}
	var out []ArtifactEntry
	for _, e := range entries {
		if !e.IsDir() || validateName(e.Name()) != nil {
			continue
		}
		info, err := e.Info()
		if err != nil {
			continue // deleted meanwhile
		}
		out = append(out, ArtifactEntry{Name: e.Name(), Path: filepath.Join(dir, e.Name()), PublishedAt: info.ModTime()})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// DeleteArtifact removes a cache entry (one rename, then the removal in tmp/). Sandboxes
// made from it are independent copies and are not affected. A missing entry is not an
// error.
func (s *Store) DeleteArtifact(ctx context.Context, kind ArtifactKind, name string) error {
	dir, err := s.ArtifactDir(kind, name)
	if err != nil {
		return err
	}
	if err := s.retire(ctx, dir, "delete-artifact"); err != nil {
		return err
	}
	s.log.InfoContext(ctx, "storage: artifact deleted", "kind", kind, "name", name)
	return nil
}

// ArtifactBuild is a cache entry being assembled in tmp/. Finish it with Publish or
// Discard; Discard after Publish does nothing, so `defer b.Discard(ctx)` undoes every
// failure path.
type ArtifactBuild struct {
	s    *Store
	kind ArtifactKind
	dir  string
	done bool
}

// BeginArtifact starts a cache entry of kind in a fresh directory in tmp/.
func (s *Store) BeginArtifact(ctx context.Context, kind ArtifactKind) (*ArtifactBuild, error) {
	if err := kind.valid(); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	dir, err := s.tmpDirFor("artifact")
	if err != nil {
		return nil, err
	}
	return &ArtifactBuild{s: s, kind: kind, dir: dir}, nil
}

// Dir returns the directory being assembled; the caller puts its files there.
func (b *ArtifactBuild) Dir() string { return b.dir }

// Receive reads a btrfs send stream of one subvolume named name into Dir()/name. With
// parent "" the stream must be a full one; else parent is a read-only subvolume in the
// store and the stream must be an increment on it (its UUID or received UUID). The
// stream may name no other subvolume (see sendFilter). Running out of disk space fails
// with an error of kind fault.InsufficientStorage.
func (b *ArtifactBuild) Receive(ctx context.Context, r io.Reader, parent, name string) error {
	if b.done {
		return errors.New("storage: artifact build already finished")
	}
	if err := validateName(name); err != nil {
		return err
	}
	var parents []uuid
	if parent != "" {
		p, err := b.s.inStore(parent)
		if err != nil {
			return err
		}
		id, recv, err := subvolumeUUIDs(p)
		if err != nil {
			return fmt.Errorf("storage: parent %s: %w", parent, err)
		}
		parents = []uuid{id, recv}
	}
	before, err := os.ReadDir(b.dir)
	if err != nil {
		return fmt.Errorf("storage: %w", err)
	}
	for _, e := range before {
		if e.Name() == name {
			return fmt.Errorf("storage: %s exists in the artifact being built", name)
		}
	}
	// Into the build directory itself: a received subvolume is read-only, and btrfs
	// does not move a read-only subvolume to another directory.
	if err := b.s.receiveInto(ctx, b.dir, r, parents); err != nil {
		return err
	}
	after, err := os.ReadDir(b.dir)
	if err != nil {
		return fmt.Errorf("storage: %w", err)
	}
	if len(after) != len(before)+1 {
		return fmt.Errorf("storage: %w: it does not hold exactly one subvolume named %s", ErrBadStream, name)
	}
	if sub, err := isSubvolume(filepath.Join(b.dir, name)); err != nil || !sub {
		return fmt.Errorf("storage: %w: it does not hold exactly one subvolume named %s", ErrBadStream, name)
	}
	return nil
}

// Publish moves the entry to <kind>/<name> and returns its path. If that entry exists
// already (an identical pull won a race), the build is discarded and existed is true.
func (b *ArtifactBuild) Publish(ctx context.Context, name string) (path string, existed bool, err error) {
	if b.done {
		return "", false, errors.New("storage: artifact build already finished")
	}
	final, err := b.s.ArtifactDir(b.kind, name)
	if err != nil {
		return "", false, err
	}
	if err := os.MkdirAll(filepath.Dir(final), 0o700); err != nil {
		return "", false, noSpace(fmt.Errorf("storage: %w", err))
	}
	// The contents must be durable before the rename publishes them.
	if err := syncFS(b.dir); err != nil {
		return "", false, fmt.Errorf("storage: %w", err)
	}
	err = unix.Renameat2(unix.AT_FDCWD, b.dir, unix.AT_FDCWD, final, unix.RENAME_NOREPLACE)
	if errors.Is(err, unix.EEXIST) || errors.Is(err, unix.ENOTEMPTY) {
		b.Discard(ctx)
		return final, true, nil
	}
	if err != nil {
		return "", false, noSpace(fmt.Errorf("storage: publish %s: %w", name, err))
	}
	b.done = true
	b.s.log.InfoContext(ctx, "storage: artifact published", "kind", b.kind, "name", name)
	return final, false, nil
}

// Discard deletes the build. It does nothing after Publish or a previous Discard.
func (b *ArtifactBuild) Discard(ctx context.Context) error {
	if b.done {
		return nil
	}
	b.done = true
	if err := removeTree(context.WithoutCancel(ctx), b.dir); err != nil {
		return fmt.Errorf("storage: discard artifact: %w", err)
	}
	return nil
}

// ReceiveRelease reads the `btrfs send` stream of a release's root filesystem (a full
// stream, see Send) and publishes it as a release with metadata meta. As in
// ImportRelease the received tree's digest must equal meta.Digest, a release that is
// present already is returned as it is, and a failure leaves nothing behind; running out
// of disk space fails with an error of kind fault.InsufficientStorage.
func (s *Store) ReceiveRelease(ctx context.Context, meta Release, r io.Reader) (Release, error) {
	if err := ValidateDigest(meta.Digest); err != nil {
		return Release{}, err
	}
	b, err := s.beginImport(ctx)
	if err != nil {
		return Release{}, noSpace(err)
	}
	defer b.Discard(ctx)
	if err := s.receiveInto(ctx, b.dir, r, nil); err != nil {
		return Release{}, err
	}
	if err := onlySubvolume(b.dir, rootfsName); err != nil {
		return Release{}, err
	}
	rel, err := b.Commit(ctx, meta)
	if err != nil {
		return Release{}, noSpace(fmt.Errorf("storage: receive release: %w", err))
	}
	s.log.InfoContext(ctx, "storage: release received", "digest", rel.Digest)
	return rel, nil
}

// receiveInto runs `btrfs receive` into dir on r, through a sendFilter.
func (s *Store) receiveInto(ctx context.Context, dir string, r io.Reader, parents []uuid) error {
	btrfs, err := lookTool("btrfs")
	if err != nil {
		return err
	}
	f := newSendFilter(r, parents)
	var out bytes.Buffer
	// --chroot confines the receiver to dir; -e stops at the stream's end command.
	cmd := exec.CommandContext(ctx, btrfs, "receive", "--chroot", "-e", dir)
	cmd.Stdin = f
	cmd.Stdout = &out
	cmd.Stderr = &out
	runErr := cmd.Run()
	if runErr == nil {
		// Nothing may follow the end command, and the source must be read to its end
		// (a source that verifies digests reports a mismatch there).
		if _, err := io.Copy(io.Discard, f); err != nil && f.err == nil {
			f.err = err
		}
	}
	if f.err != nil && !errors.Is(f.err, io.EOF) {
		if ctxErr := ctx.Err(); ctxErr != nil {
			return ctxErr
		}
		return fmt.Errorf("storage: receive: %w", f.err)
	}
	if runErr != nil {
		if ctxErr := ctx.Err(); ctxErr != nil {
			return ctxErr
		}
		msg := bytes.TrimSpace(out.Bytes())
		if isNoSpace(msg) {
			return fault.New(fault.InsufficientStorage, "the store ran out of disk space while receiving (%s)", lastLine(msg))
		}
		return fmt.Errorf("storage: btrfs receive: %w: %s", runErr, msg)
	}
	return nil
}

// onlySubvolume checks that dir holds exactly one entry, a subvolume named name.
func onlySubvolume(dir, name string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("storage: %w", err)
	}
	if len(entries) != 1 || entries[0].Name() != name {
		return fmt.Errorf("storage: %w: it does not hold exactly one subvolume named %s", ErrBadStream, name)
	}
	if sub, err := isSubvolume(filepath.Join(dir, name)); err != nil || !sub {
		return fmt.Errorf("storage: %w: received %s is not a subvolume", ErrBadStream, name)
	}
	return nil
}

// Send writes the `btrfs send` stream of the read-only subvolume path to w: a full
// stream, or with parent (a read-only subvolume too) an increment that holds only what
// differs from parent. Both must be in the store.
func (s *Store) Send(ctx context.Context, path, parent string, w io.Writer) error {
	p, err := s.inStore(path)
	if err != nil {
		return err
	}
	args := []string{"send", "-q"}
	if parent != "" {
		pp, err := s.inStore(parent)
		if err != nil {
			return err
		}
		args = append(args, "-p", pp)
	}
	btrfs, err := lookTool("btrfs")
	if err != nil {
		return err
	}
	var stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, btrfs, append(args, p)...)
	cmd.Stdout = w
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		if ctxErr := ctx.Err(); ctxErr != nil {
			return ctxErr
		}
		return fmt.Errorf("storage: btrfs send %s: %w: %s", filepath.Base(p), err, bytes.TrimSpace(stderr.Bytes()))
	}
	return nil
}

// SendIdentity returns the UUID by which an incremental stream sent against the
// subvolume at path names it as its parent: its received UUID if it was itself
// received (every copy of one sent subvolume shares it), else its own UUID.
func (s *Store) SendIdentity(path string) (string, error) {
	p, err := s.inStore(path)
	if err != nil {
		return "", err
	}
	id, recv, err := subvolumeUUIDs(p)
	if err != nil {
		return "", fmt.Errorf("storage: %w", err)
	}
	if !recv.isZero() {
		return recv.String(), nil
	}
	return id.String(), nil
}

// ReflinkInto replaces the contents of the existing file dst with an O(1) copy-on-write
// copy of src (FICLONE), keeping dst's inode: an incremental send of a snapshot that
// had dst then sees only the extents in which src differs from dst's old contents.
// Both must be in the store.
func (s *Store) ReflinkInto(src, dst string) error {
	sp, err := s.inStore(src)
	if err != nil {
		return err
	}
	dp, err := s.inStore(dst)
	if err != nil {
		return err
	}
	in, err := os.Open(sp)
	if err != nil {
		return fmt.Errorf("storage: %w", err)
	}
	defer in.Close()
	out, err := os.OpenFile(dp, os.O_WRONLY|os.O_TRUNC, 0)
	if err != nil {
		return fmt.Errorf("storage: %w", err)
	}
	if err := unix.IoctlFileClone(int(out.Fd()), int(in.Fd())); err != nil {
		out.Close()
		return fmt.Errorf("storage: reflink %s: %w", filepath.Base(sp), err)
	}
	return out.Close()
}

// noSpace gives an error caused by a full file system the kind
// fault.InsufficientStorage.
func noSpace(err error) error {
	if err != nil && (errors.Is(err, unix.ENOSPC) || errors.Is(err, unix.EDQUOT)) && !fault.Is(err, fault.InsufficientStorage) {
		return fault.Wrap(fault.InsufficientStorage, err)
	}
	return err
}

func lastLine(b []byte) string {
	if i := bytes.LastIndexByte(b, '\n'); i >= 0 {
		return string(b[i+1:])
	}
	return string(b)
}

// BTRFS_IOC_GET_SUBVOL_INFO (Linux 4.18+): _IOR(0x94, 60, struct
// btrfs_ioctl_get_subvol_info_args), usable by any user on a subvolume root.
const iocGetSubvolInfo = 0x81f8943c

// ioctlTimespec is struct btrfs_ioctl_timespec.
type ioctlTimespec struct {
	sec  uint64
	nsec uint32
	_    uint32
}

// subvolInfoArgs is struct btrfs_ioctl_get_subvol_info_args.
type subvolInfoArgs struct {
	treeID       uint64
	name         [256]byte
	parentID     uint64
	dirID        uint64
	generation   uint64
	flags        uint64
	uuid         uuid
	parentUUID   uuid
	receivedUUID uuid
	ctransid     uint64
	otransid     uint64
	stransid     uint64
	rtransid     uint64
	ctime        ioctlTimespec
	otime        ioctlTimespec
	stime        ioctlTimespec
	rtime        ioctlTimespec
	reserved     [8]uint64
}

// The struct is 504 bytes in the kernel ABI; these fail to compile otherwise.
const (
	_ uintptr = 504 - unsafe.Sizeof(subvolInfoArgs{})
	_ uintptr = unsafe.Sizeof(subvolInfoArgs{}) - 504
)

// subvolumeUUIDs returns the UUID and received UUID (zero if none) of the subvolume
// whose root is path.
func subvolumeUUIDs(path string) (id, received uuid, err error) {
	sub, err := isSubvolume(path)
	if err != nil {
		return uuid{}, uuid{}, err
	}
	if !sub {
		return uuid{}, uuid{}, fmt.Errorf("%s is not a subvolume", path)
	}
	f, err := openDir(path)
	if err != nil {
		return uuid{}, uuid{}, err
	}
	defer f.Close()
	var args subvolInfoArgs
	if err := ioctl(f.Fd(), iocGetSubvolInfo, unsafe.Pointer(&args)); err != nil {
		return uuid{}, uuid{}, &fs.PathError{Op: "get subvolume info", Path: path, Err: err}
	}
	return args.uuid, args.receivedUUID, nil
}
