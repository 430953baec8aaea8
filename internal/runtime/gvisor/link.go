package gvisor

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/guest/agentlink"
	"github.com/spacedev/space/internal/guest/wire"
)

// The agent's transport under gVisor (since 2026-12-06): the node listens on a unix
// socket in the instance's run directory (wire.NodeSocketName; /run/space/node.sock
// inside the sandbox) and the agent connects to it, a control connection and one
// plain connection per HTTP connection the node asks for (package agentlink, which
// also says who holds the agent's place). So the agent binds no socket on a host file
// system and runsc runs with --host-uds=open instead of create: a socket a program
// binds on the sandbox's disk is the Sentry's, which a checkpoint saves. Before, it was
// a host socket, and the sandbox could not be suspended, cloned or snapshotted while
// it existed.

// errLinkClosed is what waiting for the agent returns once the link is closed (the
// instance is being destroyed).
var errLinkClosed = agentlink.ErrClosed

// agentLink is the node's end of one instance's agent transport.
type agentLink struct {
	path string
	host *agentlink.Host
	log  *slog.Logger
}

// linkKeyFile, in the instance's state directory (outside its run directory, so out of
// the sandbox's sight), holds the key the agent confirmed (agentlink.Keys): after a
// restart of the node only a control connection that presents it takes the agent's
// place.
const linkKeyFile = "agent-link.key"

// listenLink listens on the node's socket in the run directory of stateDir (a socket
// left there by an earlier node process is replaced) and accepts the agent's
// connections in the background. fresh: the instance is being started or restored,
// its agent has no key yet (one saved for an earlier instance is removed); otherwise
// the key saved by an earlier node process is the one the agent must present.
func listenLink(id, stateDir string, fresh bool, log *slog.Logger) (*agentLink, error) {
	log = log.With("id", id)
	keys, err := linkKeys(stateDir, fresh, log)
	if err != nil {
		return nil, err
	}
	path := filepath.Join(stateDir, runDir, wire.NodeSocketName)
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode().Type() != fs.ModeSocket {
			return nil, fmt.Errorf("agent link %s: exists and is not a socket", path)
		}
		if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("agent link: remove stale socket: %w", err)
		}
	}
	ln, err := listenUnix(path)
	if err != nil {
		return nil, fmt.Errorf("agent link: %w", err)
	}
	// Root's only (the run directory is 0700 as well); the sandbox's gofer reaches it
	// through the id-mapped view, where root's files are its own.
	if err := os.Chmod(path, 0o600); err != nil {
		ln.Close()
		return nil, fmt.Errorf("agent link: %w", err)
	}
	return &agentLink{path: path, host: agentlink.NewHost(ln, log, keys), log: log}, nil
}

// removeLinkKey removes the key saved in stateDir, if any.
func removeLinkKey(stateDir string) error {
	if err := os.Remove(filepath.Join(stateDir, linkKeyFile)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("agent link: %w", err)
	}
	return nil
}

// linkKeys is what the node knows of the agent's key in stateDir (see listenLink).
func linkKeys(stateDir string, fresh bool, log *slog.Logger) (agentlink.Keys, error) {
	path := filepath.Join(stateDir, linkKeyFile)
	keys := agentlink.Keys{Save: func(key string) error {
		tmp := path + ".tmp"
		if err := os.WriteFile(tmp, []byte(key+"\n"), 0o600); err != nil {
			return err
		}
		return os.Rename(tmp, path)
	}}
	if fresh {
		return keys, removeLinkKey(stateDir)
	}
	b, err := os.ReadFile(path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		// An agent from before 2026-12-07, or a node stopped between the agent's first
		// connection and its saving the key: the first control connection takes the place.
		log.Info("agent link: no key saved for the agent; the first control connection takes its place")
	case err != nil:
		return keys, fmt.Errorf("agent link: %w", err)
	default:
		keys.Known = strings.TrimSpace(string(b))
	}
	return keys, nil
}

// listenUnix listens on a unix socket, also when its path is too long for
// sockaddr_un (see dialUnix).
func listenUnix(path string) (net.Listener, error) {
	if len(path) < len(unix.RawSockaddrUnix{}.Path) {
		ln, err := net.Listen("unix", path)
		if err == nil {
			// The link removes the socket itself (close), also for the long path.
			ln.(*net.UnixListener).SetUnlinkOnClose(false)
		}
		return ln, err
	}
	fd, err := unix.Open(filepath.Dir(path), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: filepath.Dir(path), Err: err}
	}
	defer unix.Close(fd)
	ln, err := net.Listen("unix", fmt.Sprintf("/proc/self/fd/%d/%s", fd, filepath.Base(path)))
	if err != nil {
		return nil, err
	}
	// The listener would unlink its /proc/self/fd name on Close, which no longer
	// resolves then; the link removes the socket by its real path.
	ln.(*net.UnixListener).SetUnlinkOnClose(false)
	return ln, nil
}

// dial opens a connection to the agent: one HTTP connection.
func (l *agentLink) dial(ctx context.Context) (net.Conn, error) {
	return l.host.Dial(ctx)
}

// close stops listening, ends the agent's control connection and removes the socket.
func (l *agentLink) close() {
	l.host.Close()
	if err := os.Remove(l.path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		l.log.Warn("agent link: remove socket", "err", err)
	}
}

// links holds the runtime's agent links by instance id.
type links struct {
	mu sync.Mutex
	m  map[string]*agentLink
	// dying are the instances being destroyed: Dial opens no link for them (its
	// listener would keep the run directory's tmpfs busy, and nothing would close it).
	dying map[string]bool
}

// How a link is opened.
type opening int

const (
	starting  opening = iota // a start or a restore: the agent has no key yet
	adopting                 // Adopt: an instance a node process before this one ran
	reopening                // the first Dial of this node process to an instance it found running (a warm-pool member resumed after a restart, say)
)

// open returns the instance's link, listening in stateDir's run directory first if it
// has none. A reopening is refused while the instance is being destroyed.
func (ls *links) open(id, stateDir string, log *slog.Logger, how opening) (*agentLink, error) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if l := ls.m[id]; l != nil {
		if how == starting {
			l.host.Forget()
			if err := removeLinkKey(stateDir); err != nil {
				return nil, err
			}
		}
		return l, nil
	}
	if how == reopening && ls.dying[id] {
		return nil, errLinkClosed
	}
	delete(ls.dying, id)
	l, err := listenLink(id, stateDir, how == starting, log)
	if err != nil {
		return nil, err
	}
	if ls.m == nil {
		ls.m = map[string]*agentLink{}
	}
	ls.m[id] = l
	return l, nil
}

// get returns the instance's link, or nil when it has none open.
func (ls *links) get(id string) *agentLink {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	return ls.m[id]
}

// close closes the instance's link, if it has one, as its destroy begins: until
// forget, Dial opens none.
func (ls *links) close(id string) {
	ls.mu.Lock()
	l := ls.m[id]
	delete(ls.m, id)
	if ls.dying == nil {
		ls.dying = map[string]bool{}
	}
	ls.dying[id] = true
	ls.mu.Unlock()
	if l != nil {
		l.close()
	}
}

// forget ends what close began, once the instance is gone (its record too, so no Dial
// finds it).
func (ls *links) forget(id string) {
	ls.mu.Lock()
	delete(ls.dying, id)
	ls.mu.Unlock()
}

// closeAll closes every link (the runtime is closing; sandboxes run on and their
// agents connect to the next node process).
func (ls *links) closeAll() {
	ls.mu.Lock()
	all := ls.m
	ls.m = nil
	ls.mu.Unlock()
	for _, l := range all {
		l.close()
	}
}
