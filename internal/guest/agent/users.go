package agent

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"
)

// The sandbox's users are read from its own /etc/passwd and /etc/group, parsed here
// rather than with os/user: without cgo os/user only knows those two files too, but it
// offers no uid→name lookup that is cheap for listing thousands of entries, no way to
// point it at other files (tests), and no supplementary group resolution in one pass.
// The formats are fixed (passwd(5), group(5)) and the parser is small.

// account is a resolved user.
type account struct {
	Name   string
	UID    uint32
	GID    uint32
	Groups []uint32 // supplementary groups, including GID
	Home   string
	Shell  string
}

var errUnknownUser = errors.New("unknown user")

// userDB resolves users and groups, re-reading the files when they change.
type userDB struct {
	passwdPath, groupPath string

	mu          sync.Mutex
	passwdStamp fileStamp
	groupStamp  fileStamp
	users       []passwdEntry
	groups      []groupEntry
}

type fileStamp struct {
	mod  time.Time
	size int64
	ok   bool
}

type passwdEntry struct {
	name  string
	uid   uint32
	gid   uint32
	home  string
	shell string
}

type groupEntry struct {
	name    string
	gid     uint32
	members []string
}

func newUserDB(etcDir string) *userDB {
	return &userDB{
		passwdPath: etcDir + "/passwd",
		groupPath:  etcDir + "/group",
	}
}

// refresh re-reads the files whose size or mtime changed. Missing files are empty.
func (db *userDB) refresh() error {
	if st, changed := stampOf(db.passwdPath, db.passwdStamp); changed {
		users, err := readDB(db.passwdPath, parsePasswd)
		if err != nil {
			return err
		}
		db.users, db.passwdStamp = users, st
	}
	if st, changed := stampOf(db.groupPath, db.groupStamp); changed {
		groups, err := readDB(db.groupPath, parseGroup)
		if err != nil {
			return err
		}
		db.groups, db.groupStamp = groups, st
	}
	return nil
}

func stampOf(path string, old fileStamp) (fileStamp, bool) {
	fi, err := os.Stat(path)
	if err != nil {
		return fileStamp{}, old.ok
	}
	st := fileStamp{mod: fi.ModTime(), size: fi.Size(), ok: true}
	return st, st != old
}

// readDB parses a passwd(5)-style file; a missing file holds no entries.
func readDB[T any](path string, parse func(io.Reader) ([]T, error)) ([]T, error) {
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", path, err)
	}
	defer f.Close()
	entries, err := parse(f)
	if err != nil {
		return nil, fmt.Errorf("parse %s: %w", path, err)
	}
	return entries, nil
}

// parsePasswd parses passwd(5) lines name:password:uid:gid:gecos:home:shell. Malformed
// lines, comments and NIS "+"/"-" lines are skipped, like glibc does.
func parsePasswd(r io.Reader) ([]passwdEntry, error) {
	var out []passwdEntry
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 4096), 1<<20)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || line[0] == '#' || line[0] == '+' || line[0] == '-' {
			continue
		}
		f := strings.Split(line, ":")
		if len(f) < 7 || f[0] == "" {
			continue
		}
		uid, err1 := strconv.ParseUint(f[2], 10, 32)
		gid, err2 := strconv.ParseUint(f[3], 10, 32)
		if err1 != nil || err2 != nil {
			continue
		}
		out = append(out, passwdEntry{name: f[0], uid: uint32(uid), gid: uint32(gid), home: f[5], shell: f[6]})
	}
	return out, sc.Err()
}

// parseGroup parses group(5) lines name:password:gid:member,member.
func parseGroup(r io.Reader) ([]groupEntry, error) {
	var out []groupEntry
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 4096), 1<<20)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || line[0] == '#' || line[0] == '+' || line[0] == '-' {
			continue
		}
		f := strings.Split(line, ":")
		if len(f) < 4 || f[0] == "" {
			continue
		}
		gid, err := strconv.ParseUint(f[2], 10, 32)
		if err != nil {
			continue
		}
		var members []string
		for _, m := range strings.Split(f[3], ",") {
			if m = strings.TrimSpace(m); m != "" {
				members = append(members, m)
			}
		}
		out = append(out, groupEntry{name: f[0], gid: uint32(gid), members: members})
	}
	return out, sc.Err()
}

// lookup resolves a user name (or a numeric uid). Empty means root; root resolves even
// when /etc/passwd lacks it (home /root).
func (db *userDB) lookup(name string) (account, error) {
	db.mu.Lock()
	defer db.mu.Unlock()
	if err := db.refresh(); err != nil {
		return account{}, err
	}
	if name == "" {
		name = "root"
	}
	var pe *passwdEntry
	for i := range db.users {
		if db.users[i].name == name {
			pe = &db.users[i]
			break
		}
	}
	if pe == nil {
		if uid, err := strconv.ParseUint(name, 10, 32); err == nil {
			for i := range db.users {
				if db.users[i].uid == uint32(uid) {
					pe = &db.users[i]
					break
				}
			}
			if pe == nil {
				// A bare uid without an entry: run with gid = uid, home /.
				return account{Name: name, UID: uint32(uid), GID: uint32(uid), Groups: []uint32{uint32(uid)}, Home: "/"}, nil
			}
		}
	}
	if pe == nil {
		if name == "root" {
			return account{Name: "root", Home: "/root", Groups: []uint32{0}, Shell: "/bin/sh"}, nil
		}
		return account{}, fmt.Errorf("%w %q", errUnknownUser, name)
	}
	acc := account{Name: pe.name, UID: pe.uid, GID: pe.gid, Home: pe.home, Shell: pe.shell, Groups: []uint32{pe.gid}}
	for _, g := range db.groups {
		if g.gid == pe.gid {
			continue
		}
		for _, m := range g.members {
			if m == pe.name {
				acc.Groups = append(acc.Groups, g.gid)
				break
			}
		}
	}
	if acc.Home == "" {
		acc.Home = "/"
	}
	return acc, nil
}

// names returns the user and group names of uid and gid (the number as a string when
// unknown).
func (db *userDB) names(uid, gid uint32) (user, group string) {
	db.mu.Lock()
	defer db.mu.Unlock()
	_ = db.refresh() // on error keep the previous tables; names are informational
	user, group = strconv.FormatUint(uint64(uid), 10), strconv.FormatUint(uint64(gid), 10)
	for i := range db.users {
		if db.users[i].uid == uid {
			user = db.users[i].name
			break
		}
	}
	for i := range db.groups {
		if db.groups[i].gid == gid {
			group = db.groups[i].name
			break
		}
	}
	if uid == 0 && user == "0" {
		user = "root"
	}
	if gid == 0 && group == "0" {
		group = "root"
	}
	return user, group
}
