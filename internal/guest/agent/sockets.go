package agent

import (
	"bufio"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/spacedev/space/internal/guest/wire"
)

// Unix sockets a gVisor checkpoint cannot save. The sandbox's disk is a gofer mount
// that creates the unix sockets bound on it on the host (runsc --host-uds=create, which
// the agent's own listener needs), and gVisor refuses to checkpoint a socket bound so
// ("Cannot save endpoint with bound host socket"). A suspend's `runsc checkpoint` then
// failed and took the sandbox down with it: its memory was lost. So before a checkpoint
// that closes the transport (gVisor's), the agent looks for stream and seqpacket
// sockets bound on such a mount and refuses the quiesce, naming them; sockets in /tmp
// or /dev/shm (tmpfs inside the Sentry) and abstract ones are saved as any other.
//
// Only an agent that listens on a unix socket (Config.Listen "unix:…") runs so. Since
// 2026-12-06 the gVisor runtime starts the agent with "connect:…" and runsc with
// --host-uds=open, under which a socket bound on a gofer mount is the Sentry's and is
// saved too; the check stays for the unix transport (tests, and a runtime that still
// starts agents that way).

// goferFS is the file system type gVisor's gofer mounts show in /proc/self/mounts.
const goferFS = "9p"

// unsavableSocket is a unix socket bound on a gofer mount, and who holds it.
type unsavableSocket struct {
	path string
	pid  int    // 0: not found
	comm string // the holder's name
}

func (s unsavableSocket) String() string {
	if s.pid == 0 {
		return s.path
	}
	return fmt.Sprintf("%s (process %d, %s)", s.path, s.pid, s.comm)
}

// errUnsavable refuses a quiesce for socks.
func errUnsavable(socks []unsavableSocket) error {
	names := make([]string, len(socks))
	for i, s := range socks {
		names[i] = s.String()
	}
	return &apiError{status: http.StatusConflict, code: wire.ErrCodeCannotCheckpoint,
		msg: "cannot checkpoint the sandbox: a unix socket is bound on its disk, which gVisor cannot save: " +
			strings.Join(names, ", ") + "; close it, or bind it in /run, /tmp or /dev/shm, or as an abstract socket"}
}

// unsavableSockets lists the stream and seqpacket unix sockets bound on a gofer mount,
// but the agent's own listener (own): it closes that one before the checkpoint.
func unsavableSockets(own string) []unsavableSocket {
	mounts := readMounts()
	var out []unsavableSocket
	var holders map[uint64]int // read at the first socket that needs it
	holder := func(inode uint64) int {
		if holders == nil {
			holders = socketHolders()
		}
		return holders[inode]
	}
	for _, s := range boundUnixSockets() {
		path := s.path
		if !filepath.IsAbs(path) {
			// Bound by a relative name: where it is depends on its holder's directory.
			cwd, err := os.Readlink(fmt.Sprintf("/proc/%d/cwd", holder(s.inode)))
			if err != nil {
				continue
			}
			path = filepath.Join(cwd, path)
		}
		path = resolveDir(path)
		if filepath.Clean(path) == filepath.Clean(own) || fsTypeOf(mounts, path) != goferFS {
			continue
		}
		u := unsavableSocket{path: path, pid: holder(s.inode)}
		if u.pid != 0 {
			if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", u.pid)); err == nil {
				u.comm = strings.TrimSpace(string(b))
			}
		}
		out = append(out, u)
	}
	return out
}

type boundSocket struct {
	path  string
	inode uint64
}

// boundUnixSockets reads /proc/net/unix: "Num RefCount Protocol Flags Type St Inode
// Path"; stream (1) and seqpacket (5) sockets with a path in the file system.
func boundUnixSockets() []boundSocket {
	f, err := os.Open("/proc/net/unix")
	if err != nil {
		return nil
	}
	defer f.Close()
	var out []boundSocket
	sc := bufio.NewScanner(f)
	sc.Scan() // header
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 8 || strings.HasPrefix(fields[7], "@") {
			continue
		}
		if typ := fields[4]; typ != "0001" && typ != "0005" {
			continue
		}
		ino, err := strconv.ParseUint(fields[6], 10, 64)
		if err != nil {
			continue
		}
		out = append(out, boundSocket{path: strings.Join(fields[7:], " "), inode: ino})
	}
	return out
}

// socketHolders maps socket inodes to a process holding them (/proc/<pid>/fd).
func socketHolders() map[uint64]int {
	out := map[uint64]int{}
	for _, pid := range pids() {
		fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
		if err != nil {
			continue
		}
		for _, fd := range fds {
			link, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", pid, fd.Name()))
			if err != nil {
				continue
			}
			if s, ok := strings.CutPrefix(link, "socket:["); ok {
				if ino, err := strconv.ParseUint(strings.TrimSuffix(s, "]"), 10, 64); err == nil {
					if _, seen := out[ino]; !seen {
						out[ino] = pid
					}
				}
			}
		}
	}
	return out
}

type mountEntry struct{ dir, fstype string }

// readMounts reads the mount points and types of /proc/self/mounts.
func readMounts() []mountEntry {
	b, err := os.ReadFile("/proc/self/mounts")
	if err != nil {
		return nil
	}
	var out []mountEntry
	for line := range strings.Lines(string(b)) {
		f := strings.Fields(line)
		if len(f) >= 3 {
			out = append(out, mountEntry{dir: unescapeMount(f[1]), fstype: f[2]})
		}
	}
	return out
}

// unescapeMount undoes the octal escapes of a mounts field (\040 for a space).
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// resolveDir is path with the links in its directory resolved (a socket bound through
// Debian's /var/run link is listed there, and is in /run), or path as it is when that
// fails.
func resolveDir(path string) string {
	dir, err := filepath.EvalSymlinks(filepath.Dir(path))
	if err != nil {
		return path
	}
	return filepath.Join(dir, filepath.Base(path))
}

// fsTypeOf is the type of the file system path is on: that of the last-mounted entry
// whose directory holds it.
func fsTypeOf(mounts []mountEntry, path string) string {
	path = filepath.Clean(path)
	fstype, best := "", -1
	for _, m := range mounts {
		if underDir(path, m.dir) && len(m.dir) >= best {
			fstype, best = m.fstype, len(m.dir)
		}
	}
	return fstype
}

// underDir reports whether path p is dir or below it.
func underDir(p, dir string) bool {
	dir = filepath.Clean(dir)
	return p == dir || dir == "/" || strings.HasPrefix(p, dir+"/")
}
