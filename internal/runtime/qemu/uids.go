package qemu

import (
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"

	"github.com/prometheus/procfs"
	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/durable"
	"github.com/spacedev/space/internal/runtime/instances"
)

// Every QEMU runs as a host uid of its own, with the group of the same number, leased
// from a configured range (Config.FirstUID, Config.UIDCount) by a lease file
// <LeaseDir>/<uid> naming the holder (the runtime's root dir and the instance id). The
// lease directory is host-wide: runtimes with different root dirs (several servers,
// test runs) that share a range share it, so no two VMs on a host ever share a uid. The
// instance's record keeps its uid; after a node restart Destroy finds it there (or, for
// a lost record, in /proc) and gives the lease back.
//
// A lease whose holder is gone (a node that died between leasing and recording, or a
// wiped root dir) is taken over when no record of its holder names the uid and no
// process runs as it. All of this happens under an exclusive flock of the lease
// directory; the uid is written into the instance's record before the lock is released,
// so a fresh lease is never judged stale.

// Defaults of the uid range: 65536 uids from 0x74000000, in the range systemd leaves
// unused (between its container range, which ends at 0x6FFFFFFF, and 2^31).
const (
	DefaultFirstUID = 0x74000000
	DefaultUIDCount = 65536
	DefaultLeaseDir = "/run/space/qemu-uids"
	maxUID          = 1<<31 - 1 // uids from 2^31 on confuse too many tools
)

// uidLeases hands out uids of one range.
type uidLeases struct {
	dir          string
	first, count int
}

// leaseHolder is the content of a lease file.
type leaseHolder struct {
	RootDir string `json:"root_dir"`
	ID      string `json:"id"`
}

func newUIDLeases(dir string, first, count int) (*uidLeases, error) {
	if first <= 0 || count <= 0 || first > maxUID-count+1 {
		return nil, fmt.Errorf("uid range %d+%d: want 0 < first and first+count-1 <= %d", first, count, maxUID)
	}
	if !filepath.IsAbs(dir) {
		return nil, fmt.Errorf("uid lease dir %q is not absolute", dir)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("uid lease dir: %w", err)
	}
	return &uidLeases{dir: filepath.Clean(dir), first: first, count: count}, nil
}

// lock takes the lease directory's lock; the returned func releases it.
func (u *uidLeases) lock() (func(), error) {
	f, err := os.OpenFile(filepath.Join(u.dir, ".lock"), os.O_CREATE|os.O_RDWR|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("uid leases: %w", err)
	}
	for {
		err = unix.Flock(int(f.Fd()), unix.LOCK_EX)
		if !errors.Is(err, unix.EINTR) {
			break
		}
	}
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("uid leases: lock: %w", err)
	}
	return func() { f.Close() }, nil
}

func (u *uidLeases) path(uid int) string { return filepath.Join(u.dir, strconv.Itoa(uid)) }

// acquire leases a free uid for holder and calls commit with it while the lease lock is
// held (commit records it). The search starts at a slot derived from the holder, so an
// instance tends to get the same uid again. If commit fails the lease is given back.
func (u *uidLeases) acquire(holder leaseHolder, commit func(uid int) error) (int, error) {
	unlock, err := u.lock()
	if err != nil {
		return 0, err
	}
	defer unlock()
	h := fnv.New32a()
	h.Write([]byte(holder.RootDir + "\x00" + holder.ID))
	start := int(h.Sum32() % uint32(u.count))
	data, err := json.Marshal(holder)
	if err != nil {
		return 0, err
	}
	for i := range u.count {
		uid := u.first + (start+i)%u.count
		f, err := os.OpenFile(u.path(uid), os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
		if errors.Is(err, fs.ErrExist) {
			if !u.stale(uid) {
				continue
			}
			if err := os.Remove(u.path(uid)); err != nil && !errors.Is(err, fs.ErrNotExist) {
				return 0, fmt.Errorf("uid leases: take over stale lease %d: %w", uid, err)
			}
			f, err = os.OpenFile(u.path(uid), os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
		}
		if err != nil {
			return 0, fmt.Errorf("uid leases: %w", err)
		}
		_, werr := f.Write(data)
		if cerr := f.Close(); werr == nil {
			werr = cerr
		}
		if werr == nil {
			werr = commit(uid)
		}
		if werr != nil {
			os.Remove(u.path(uid))
			return 0, fmt.Errorf("uid leases: %w", werr)
		}
		_ = durable.Sync(u.dir)
		return uid, nil
	}
	return 0, fmt.Errorf("uid leases: all %d uids from %d are in use", u.count, u.first)
}

// release gives uid back if holder holds it.
func (u *uidLeases) release(uid int, holder leaseHolder) error {
	if uid < u.first || uid >= u.first+u.count {
		return nil
	}
	unlock, err := u.lock()
	if err != nil {
		return err
	}
	defer unlock()
	if h, err := u.holder(uid); err != nil || h != holder {
		return nil // not ours (any more)
	}
	if err := os.Remove(u.path(uid)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("uid leases: release %d: %w", uid, err)
	}
	return nil
}

func (u *uidLeases) holder(uid int) (leaseHolder, error) {
	var h leaseHolder
	data, err := os.ReadFile(u.path(uid))
	if err != nil {
		return h, err
	}
	return h, json.Unmarshal(data, &h)
}

// stale reports whether uid's lease has no holder any more: its holder's record does not
// name the uid and no process runs as it. The caller holds the lock.
func (u *uidLeases) stale(uid int) bool {
	h, err := u.holder(uid)
	if err == nil && filepath.IsAbs(h.RootDir) && validID(h.ID) {
		recs := instances.Records[record]{Dir: filepath.Join(h.RootDir, recordsDir)}
		if rec, err := recs.Read(h.ID); err == nil && rec.UID == uid {
			return false
		} else if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return false // unreadable: keep it
		}
	}
	return !uidInUse(uid)
}

// uidInUse reports whether a process runs with uid as its real, effective, saved or
// file-system uid. When /proc cannot be read it answers true.
func uidInUse(uid int) bool {
	procs, err := procfs.AllProcs()
	if err != nil {
		return true
	}
	for _, p := range procs {
		st, err := p.NewStatus()
		if err != nil {
			continue // exited meanwhile
		}
		for _, id := range st.UIDs {
			if id == uint64(uid) {
				return true
			}
		}
	}
	return false
}
