package agent

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"github.com/spacedev/space/internal/guest/wire"
)

const (
	maxListDepth = 64
	copyBuf      = 256 << 10
)

// resolvePath makes p absolute: "~" and "~/x" are the user's home, relative paths are
// relative to it. The agent runs inside the sandbox, so every path is the sandbox's own;
// cleaning only normalizes.
func resolvePath(acct account, p string) (string, error) {
	if p == "" {
		return "", badRequest("path is required")
	}
	if strings.ContainsRune(p, 0) {
		return "", badRequest("path contains NUL")
	}
	switch {
	case p == "~":
		p = acct.Home
	case strings.HasPrefix(p, "~/"):
		p = filepath.Join(acct.Home, p[2:])
	case !filepath.IsAbs(p):
		p = filepath.Join(acct.Home, p)
	}
	return filepath.Clean(p), nil
}

// resolve looks up the user and resolves p for it.
func (a *Agent) resolve(user, p string) (account, string, error) {
	acct, err := a.users.lookup(user)
	if err != nil {
		return account{}, "", err
	}
	abs, err := resolvePath(acct, p)
	return acct, abs, err
}

// chownTo gives path to acct when the agent can (it is root).
func chownTo(path string, acct account) error {
	if os.Geteuid() != 0 {
		return nil
	}
	if err := os.Lchown(path, int(acct.UID), int(acct.GID)); err != nil {
		return fmt.Errorf("chown %s: %w", path, err)
	}
	return nil
}

// ensureDirs creates dir and its missing parents, owned by acct. Only what it created
// is chowned; on failure what it created is removed again.
func ensureDirs(dir string, acct account) error {
	_, err := makeDirs(dir, acct)
	return err
}

// makeDirs is ensureDirs that returns the directories it created, outermost first
// (removeDirs undoes it).
func makeDirs(dir string, acct account) ([]string, error) {
	var missing []string
	for d := dir; ; d = filepath.Dir(d) {
		fi, err := os.Stat(d)
		if err == nil {
			if !fi.IsDir() {
				return nil, fmt.Errorf("mkdir %s: %w", d, syscall.ENOTDIR)
			}
			break
		}
		if !errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("mkdir %s: %w", d, err)
		}
		missing = append(missing, d)
		if d == filepath.Dir(d) {
			break
		}
	}
	var created []string
	for i := len(missing) - 1; i >= 0; i-- {
		d := missing[i]
		err := os.Mkdir(d, 0o755)
		if errors.Is(err, fs.ErrExist) {
			continue // created concurrently
		}
		if err == nil {
			created = append(created, d)
			err = chownTo(d, acct)
		}
		if err != nil {
			removeDirs(created)
			return nil, fmt.Errorf("mkdir %s: %w", d, err)
		}
	}
	return created, nil
}

// removeDirs removes directories makeDirs created, innermost first, as long as they
// are empty.
func removeDirs(created []string) {
	for i := len(created) - 1; i >= 0; i-- {
		_ = os.Remove(created[i])
	}
}

func parseMode(s string, def os.FileMode) (os.FileMode, error) {
	if s == "" {
		return def, nil
	}
	m, err := strconv.ParseUint(s, 8, 32)
	if err != nil || m > 0o7777 {
		return 0, badRequest("bad mode %q (octal, e.g. 0644)", s)
	}
	return unixMode(uint32(m)), nil
}

// unixMode converts permission, setuid, setgid and sticky bits to an os.FileMode.
func unixMode(m uint32) os.FileMode {
	mode := os.FileMode(m & 0o777)
	if m&syscall.S_ISUID != 0 {
		mode |= os.ModeSetuid
	}
	if m&syscall.S_ISGID != 0 {
		mode |= os.ModeSetgid
	}
	if m&syscall.S_ISVTX != 0 {
		mode |= os.ModeSticky
	}
	return mode
}

func (a *Agent) handleReadFile(w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	_, path, err := a.resolve(q.Get("user"), q.Get("path"))
	if err != nil {
		return err
	}
	offset, err := queryInt(r, "offset", 0)
	if err != nil {
		return err
	}
	length, err := queryInt(r, "length", -1)
	if err != nil {
		return err
	}
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	if fi.IsDir() {
		return &apiError{status: http.StatusBadRequest, code: wire.ErrCodeIsDir, msg: path + " is a directory"}
	}
	if !fi.Mode().IsRegular() {
		return badRequest("%s is not a regular file", path)
	}
	size := fi.Size()
	if offset > size {
		return badRequest("offset %d beyond the end of %s (%d bytes)", offset, path, size)
	}
	n := size - offset
	if length >= 0 && length < n {
		n = length
	}
	if _, err := f.Seek(offset, io.SeekStart); err != nil {
		return err
	}
	h := w.Header()
	h.Set("Content-Type", "application/octet-stream")
	h.Set("Content-Length", strconv.FormatInt(n, 10))
	h.Set(wire.FileSizeHeader, strconv.FormatInt(size, 10))
	w.WriteHeader(http.StatusOK)
	// io.CopyN hands the response writer a LimitedReader of the file, which it can
	// sendfile: the file never passes through user space buffers of ours.
	if _, err := io.CopyN(w, f, n); err != nil {
		a.log.Debug("read file: copy", "path", path, "err", err)
	}
	return nil
}

func (a *Agent) handleWriteFile(w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	acct, path, err := a.resolve(q.Get("user"), q.Get("path"))
	if err != nil {
		return err
	}
	modeGiven := q.Get("mode") != ""
	mode, err := parseMode(q.Get("mode"), 0o644)
	if err != nil {
		return err
	}
	if fi, err := os.Lstat(path); err == nil && fi.Mode().Type() == fs.ModeSymlink {
		// Write through the link, like writing to the path would.
		if target, err := filepath.EvalSymlinks(path); err == nil {
			path = target
		}
	}
	existing, statErr := os.Stat(path)
	if statErr == nil && existing.IsDir() {
		return &apiError{status: http.StatusBadRequest, code: wire.ErrCodeIsDir, msg: path + " is a directory"}
	}
	if statErr == nil && !modeGiven {
		mode = existing.Mode() & (fs.ModePerm | os.ModeSetuid | os.ModeSetgid | os.ModeSticky)
	}
	if err := ensureDirs(filepath.Dir(path), acct); err != nil {
		return err
	}
	if queryBool(r, "append") {
		err = appendFile(path, r.Body, mode, acct, statErr != nil)
	} else {
		err = replaceFile(path, r.Body, mode, acct)
	}
	if err != nil {
		return err
	}
	info, err := a.entryInfo(path, nil)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, info)
	return nil
}

// replaceFile streams body into a temporary file next to path and renames it over
// path, so readers see the old or the new content, never a mix. The temporary file is
// removed on any failure. No fsync: atomicity is for concurrent readers; durability
// against a crash of the sandbox is not promised.
func replaceFile(path string, body io.Reader, mode os.FileMode, acct account) (err error) {
	dir, base := filepath.Split(path)
	tmp, err := os.CreateTemp(dir, "."+base+".space-*")
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	defer func() {
		if err != nil {
			tmp.Close()
			_ = os.Remove(tmp.Name())
		}
	}()
	if _, err := io.CopyBuffer(writerOnly{tmp}, body, make([]byte, copyBuf)); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := tmp.Chmod(mode); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := chownTo(tmp.Name(), acct); err != nil {
		return err
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}

// appendFile appends body to path (created if missing). Appending is not atomic: a
// failed request may leave part of its body appended.
func appendFile(path string, body io.Reader, mode os.FileMode, acct account, create bool) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, mode)
	if err != nil {
		return fmt.Errorf("append %s: %w", path, err)
	}
	if create {
		if err := chownTo(path, acct); err != nil {
			f.Close()
			return err
		}
	}
	_, err = io.CopyBuffer(writerOnly{f}, body, make([]byte, copyBuf))
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("append %s: %w", path, err)
	}
	return nil
}

func (a *Agent) handleStat(w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	_, path, err := a.resolve(q.Get("user"), q.Get("path"))
	if err != nil {
		return err
	}
	info, err := a.entryInfo(path, nil)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, info)
	return nil
}

func (a *Agent) handleList(w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	_, path, err := a.resolve(q.Get("user"), q.Get("path"))
	if err != nil {
		return err
	}
	depth, err := queryInt(r, "depth", 1)
	if err != nil {
		return err
	}
	if depth < 1 || depth > maxListDepth {
		return badRequest("depth must be between 1 and %d", maxListDepth)
	}
	fi, err := os.Stat(path)
	if err != nil {
		return err
	}
	if !fi.IsDir() {
		return &apiError{status: http.StatusBadRequest, code: wire.ErrCodeNotDir, msg: path + " is not a directory"}
	}
	names := newNameCache(a.users)
	out := []wire.EntryInfo{}
	var walk func(dir string, level int64) error
	walk = func(dir string, level int64) error {
		entries, err := os.ReadDir(dir)
		if err != nil {
			return err
		}
		for _, e := range entries {
			p := filepath.Join(dir, e.Name())
			info, err := a.entryInfo(p, names)
			if err != nil {
				continue // removed meanwhile
			}
			out = append(out, info)
			if e.IsDir() && level < depth {
				// Unreadable subdirectories are listed but not descended into.
				_ = walk(p, level+1)
			}
		}
		return nil
	}
	if err := walk(path, 1); err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}

func (a *Agent) handleMkdir(w http.ResponseWriter, r *http.Request) error {
	var req wire.MkdirRequest
	if err := decodeJSON(r, &req); err != nil {
		return err
	}
	acct, path, err := a.resolve(req.User, req.Path)
	if err != nil {
		return err
	}
	mode := os.FileMode(0o755)
	if req.Mode != 0 {
		if req.Mode > 0o7777 {
			return badRequest("bad mode %o", req.Mode)
		}
		mode = unixMode(req.Mode)
	}
	if fi, err := os.Lstat(path); err == nil {
		if fi.IsDir() {
			return &apiError{status: http.StatusConflict, code: wire.ErrCodeExists, msg: path + " already exists"}
		}
		return &apiError{status: http.StatusConflict, code: wire.ErrCodeNotDir, msg: path + " exists and is not a directory"}
	}
	if req.Parents {
		if err := ensureDirs(filepath.Dir(path), acct); err != nil {
			return err
		}
	}
	if err := os.Mkdir(path, mode); err != nil {
		return fmt.Errorf("mkdir %s: %w", path, err)
	}
	// Mkdir is subject to the umask and ignores setuid/setgid/sticky.
	if err := os.Chmod(path, mode); err == nil {
		err = chownTo(path, acct)
	}
	if err != nil {
		_ = os.Remove(path)
		return err
	}
	info, err := a.entryInfo(path, nil)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusCreated, info)
	return nil
}

func (a *Agent) handleMove(w http.ResponseWriter, r *http.Request) error {
	var req wire.MoveRequest
	if err := decodeJSON(r, &req); err != nil {
		return err
	}
	acct, from, err := a.resolve(req.User, req.From)
	if err != nil {
		return err
	}
	_, to, err := a.resolve(req.User, req.To)
	if err != nil {
		return err
	}
	if _, err := os.Lstat(from); err != nil {
		return err
	}
	if err := ensureDirs(filepath.Dir(to), acct); err != nil {
		return err
	}
	if err := a.rename(from, to); err != nil {
		return err
	}
	info, err := a.entryInfo(to, nil)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, info)
	return nil
}

func (a *Agent) handleRemove(w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	_, path, err := a.resolve(q.Get("user"), q.Get("path"))
	if err != nil {
		return err
	}
	if path == "/" {
		return badRequest("refusing to remove /")
	}
	fi, err := os.Lstat(path)
	if err != nil {
		return err
	}
	if fi.IsDir() && queryBool(r, "recursive") {
		err = os.RemoveAll(path)
	} else {
		err = os.Remove(path)
	}
	if err != nil {
		return err
	}
	a.forgetMetadata(path)
	w.WriteHeader(http.StatusNoContent)
	return nil
}

// rename renames from to to and carries the file metadata kept in the sidecar store
// along (extended attributes move with the inode by themselves).
func (a *Agent) rename(from, to string) error {
	if err := os.Rename(from, to); err != nil {
		return err
	}
	if err := a.meta.move(from, to); err != nil {
		a.log.Warn("file metadata not moved", "from", from, "to", to, "err", err)
	}
	return nil
}

// forgetMetadata drops the sidecar metadata of a removed path and what was under it.
func (a *Agent) forgetMetadata(path string) {
	if err := a.meta.forget(path, true); err != nil {
		a.log.Warn("file metadata not dropped", "path", path, "err", err)
	}
}

// entryInfo describes path without following a final symbolic link.
func (a *Agent) entryInfo(path string, names *nameCache) (wire.EntryInfo, error) {
	info, _, err := a.entryInfoFI(path, names)
	return info, err
}

// entryInfoFI is entryInfo that also returns path's lstat.
func (a *Agent) entryInfoFI(path string, names *nameCache) (wire.EntryInfo, os.FileInfo, error) {
	fi, err := os.Lstat(path)
	if err != nil {
		return wire.EntryInfo{}, nil, err
	}
	if names == nil {
		names = newNameCache(a.users)
	}
	info := wire.EntryInfo{
		Name:         filepath.Base(path),
		Path:         path,
		Size:         fi.Size(),
		ModifiedTime: fi.ModTime(),
	}
	switch fi.Mode().Type() {
	case 0:
		info.Type = wire.FileTypeFile
	case fs.ModeDir:
		info.Type = wire.FileTypeDir
	case fs.ModeSymlink:
		info.Type = wire.FileTypeSymlink
		if t, err := os.Readlink(path); err == nil {
			info.SymlinkTarget = t
		}
	default:
		info.Type = wire.FileTypeOther
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		info.UID, info.GID = st.Uid, st.Gid
		info.Mode = st.Mode & 0o7777
		info.Permissions = permissionString(st.Mode)
	}
	info.Owner, info.Group = names.names(info.UID, info.GID)
	return info, fi, nil
}

// permissionString renders st_mode like ls -l does ("drwxr-sr-x", "-rwsr-xr-x").
func permissionString(m uint32) string {
	var b [10]byte
	switch m & syscall.S_IFMT {
	case syscall.S_IFDIR:
		b[0] = 'd'
	case syscall.S_IFLNK:
		b[0] = 'l'
	case syscall.S_IFIFO:
		b[0] = 'p'
	case syscall.S_IFSOCK:
		b[0] = 's'
	case syscall.S_IFCHR:
		b[0] = 'c'
	case syscall.S_IFBLK:
		b[0] = 'b'
	default:
		b[0] = '-'
	}
	const rwx = "rwxrwxrwx"
	for i := 0; i < 9; i++ {
		if m&(1<<uint(8-i)) != 0 {
			b[1+i] = rwx[i]
		} else {
			b[1+i] = '-'
		}
	}
	special := func(pos int, bit uint32, set, setNoExec byte) {
		if m&bit == 0 {
			return
		}
		if b[pos] == 'x' {
			b[pos] = set
		} else {
			b[pos] = setNoExec
		}
	}
	special(3, syscall.S_ISUID, 's', 'S')
	special(6, syscall.S_ISGID, 's', 'S')
	special(9, syscall.S_ISVTX, 't', 'T')
	return string(b[:])
}

// nameCache memoizes uid/gid → name lookups for one request.
type nameCache struct {
	db     *userDB
	users  map[uint32]string
	groups map[uint32]string
}

func newNameCache(db *userDB) *nameCache {
	return &nameCache{db: db, users: map[uint32]string{}, groups: map[uint32]string{}}
}

func (c *nameCache) names(uid, gid uint32) (string, string) {
	u, uok := c.users[uid]
	g, gok := c.groups[gid]
	if uok && gok {
		return u, g
	}
	u, g = c.db.names(uid, gid)
	c.users[uid], c.groups[gid] = u, g
	return u, g
}

// writerOnly hides os.File's ReadFrom so that io.CopyBuffer uses the buffer it is
// given: a request body is never a file or socket, so ReadFrom would only fall back to
// a loop with its own 32 KiB buffer.
type writerOnly struct{ io.Writer }
