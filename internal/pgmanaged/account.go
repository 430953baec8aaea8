package pgmanaged

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"syscall"
)

const (
	// defaultUser is the account Debian's postgresql packages create.
	defaultUser = "postgres"
	// fallbackUser is created when defaultUser does not exist (PostgreSQL built or
	// unpacked without the Debian packages). A dedicated system account without a login
	// shell, rather than e.g. "nobody", so that the cluster's files belong to no one else.
	fallbackUser = "space-postgres"
)

// account is the OS user that initdb and postgres run as.
type account struct {
	name     string
	uid, gid int
	// drop is true when space runs as root and the children must switch to uid/gid.
	drop bool
}

func (a account) sysProcAttr() *syscall.SysProcAttr {
	// Own process group: a Ctrl-C in space's terminal goes to the foreground group only,
	// so postgres is stopped by Stop (fast shutdown), not by the terminal.
	attr := &syscall.SysProcAttr{Setpgid: true}
	if a.drop {
		// Empty Groups drops root's supplementary groups.
		attr.Credential = &syscall.Credential{Uid: uint32(a.uid), Gid: uint32(a.gid), Groups: []uint32{}}
	}
	return attr
}

// resolveAccount picks who runs postgres. initdb and postgres refuse to run as root, so
// as root: the configured user; or, when none is configured, "postgres", falling back to
// a system account space-postgres that is created if missing. Not root: ourselves.
func resolveAccount(ctx context.Context, want string, log *slog.Logger) (account, error) {
	if os.Geteuid() != 0 {
		u, err := user.Current()
		if err != nil {
			return account{}, fmt.Errorf("current user: %w", err)
		}
		return toAccount(u, false)
	}
	if want != "" {
		u, err := user.Lookup(want)
		if err != nil {
			return account{}, fmt.Errorf("postgres user: %w", err)
		}
		return toAccount(u, true)
	}
	u, err := user.Lookup(defaultUser)
	if err == nil {
		return toAccount(u, true)
	}
	if !errors.As(err, new(user.UnknownUserError)) {
		return account{}, fmt.Errorf("look up user %s: %w", defaultUser, err)
	}
	u, err = user.Lookup(fallbackUser)
	if errors.As(err, new(user.UnknownUserError)) {
		log.Info("creating system user for postgres", "user", fallbackUser)
		out, cerr := exec.CommandContext(ctx, "useradd", "--system", "--user-group",
			"--no-create-home", "--home-dir", "/nonexistent", "--shell", "/usr/sbin/nologin",
			"--comment", "space private PostgreSQL", fallbackUser).CombinedOutput()
		if cerr != nil {
			return account{}, fmt.Errorf("useradd %s: %w: %s", fallbackUser, cerr, out)
		}
		u, err = user.Lookup(fallbackUser)
	}
	if err != nil {
		return account{}, fmt.Errorf("look up user %s: %w", fallbackUser, err)
	}
	return toAccount(u, true)
}

func toAccount(u *user.User, drop bool) (account, error) {
	uid, err := strconv.Atoi(u.Uid)
	if err != nil {
		return account{}, fmt.Errorf("user %s: uid %q: %w", u.Username, u.Uid, err)
	}
	gid, err := strconv.Atoi(u.Gid)
	if err != nil {
		return account{}, fmt.Errorf("user %s: gid %q: %w", u.Username, u.Gid, err)
	}
	return account{name: u.Username, uid: uid, gid: gid, drop: drop}, nil
}

// makeTraversable adds o+x (search, not read) to every ancestor of dir that lacks it, so
// the postgres account can reach dir. It returns a function that restores the old modes.
func makeTraversable(dir string, log *slog.Logger) (undo func(), err error) {
	var restore []func()
	undo = func() {
		for i := len(restore) - 1; i >= 0; i-- {
			restore[i]()
		}
	}
	for p := filepath.Dir(dir); ; p = filepath.Dir(p) {
		fi, err := os.Stat(p)
		if err != nil {
			undo()
			return nil, err
		}
		if mode := fi.Mode().Perm(); mode&0o001 == 0 {
			log.Info("making directory traversable for postgres (o+x)", "dir", p)
			if err := os.Chmod(p, fi.Mode()|0o001); err != nil {
				undo()
				return nil, err
			}
			restore = append(restore, func() { _ = os.Chmod(p, fi.Mode()) })
		}
		if p == filepath.Dir(p) {
			return undo, nil
		}
	}
}

// chownTree gives every file under root to uid/gid (used when the data directory
// belongs to another account, e.g. after the postgres account changed).
func chownTree(root string, uid, gid int) error {
	return filepath.WalkDir(root, func(p string, _ fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		return os.Lchown(p, uid, gid)
	})
}
