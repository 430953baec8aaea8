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
	"sync"
	"time"

	"github.com/hashicorp/yamux"
	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/guest/vmboot"
	"github.com/spacedev/space/internal/guest/wire"
)

// The agent's transport under gVisor (since 2026-12-06). The node listens on a unix
// socket in the instance's run directory (wire.NodeSocketName; /run/space/node.sock
// inside the sandbox) and the agent connects to it; over that connection both ends run
// the serial transport's handshake and a yamux session (package vmboot), the node
// opening one stream per HTTP connection. So the agent binds no socket on a host file
// system and runsc runs with --host-uds=open instead of create: a socket a program
// binds on the sandbox's disk is the Sentry's, which a checkpoint saves. Before, it was
// a host socket, and the sandbox could not be suspended, cloned or snapshotted while
// it existed.
//
// One connection holds the agent's place at a time. After a start or a restore the
// agent connects before any user process runs (it thaws them once connected), so the
// first connection is the agent's; a later one is closed unanswered while the session
// that holds the place answers a ping. When it does not (the agent's connection broke,
// or this is a new node process), the newcomer takes the place: as before, sandbox
// root can stand in for the agent at run time (docs/security.md), never across a
// checkpoint.

const (
	// linkHandshakeTimeout bounds the handshake of a new connection.
	linkHandshakeTimeout = 5 * time.Second
	// linkPingTimeout is how long the session that holds the place has to answer when
	// another connection arrives; an answer counts for linkAnswerFresh, and a refusal
	// costs the next connection linkRefusePause (a process of the sandbox that connects
	// in a loop gets at most a hundred refusals a second, one log line a minute, and
	// makes the agent answer a ping at most once a second).
	linkPingTimeout = time.Second
	linkAnswerFresh = time.Second
	linkRefusePause = 10 * time.Millisecond
	linkRefuseLog   = time.Minute
)

// errLinkClosed is what waiting for the agent returns once the link is closed (the
// instance is being destroyed).
var errLinkClosed = errors.New("the agent's link is closed")

// agentLink is the node's end of one instance's agent transport.
type agentLink struct {
	id   string
	path string
	ln   net.Listener
	log  *slog.Logger
	done chan struct{} // closed when accept returns

	mu      sync.Mutex
	sess    *yamux.Session
	changed chan struct{} // closed and replaced whenever sess is set

	// Only accept's goroutine touches these.
	answered time.Time // sess last answered a ping
	refused  int       // connections refused since the last log line
	logged   time.Time // of the last refusal logged
}

// listenLink listens on the node's socket in runDir (a socket left there by an earlier
// node process is replaced) and accepts the agent's connections in the background.
func listenLink(id, runDir string, log *slog.Logger) (*agentLink, error) {
	path := filepath.Join(runDir, wire.NodeSocketName)
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
	l := &agentLink{id: id, path: path, ln: ln, log: log, done: make(chan struct{}), changed: make(chan struct{})}
	go l.accept()
	return l, nil
}

// listenUnix listens on a unix socket, also when its path is too long for
// sockaddr_un (see dialUnix).
func listenUnix(path string) (net.Listener, error) {
	if len(path) < len(unix.RawSockaddrUnix{}.Path) {
		return net.Listen("unix", path)
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

// accept takes the agent's connections until the listener is closed.
func (l *agentLink) accept() {
	defer close(l.done)
	for {
		conn, err := l.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			l.log.Warn("agent link: accept", "id", l.id, "err", err)
			time.Sleep(10 * time.Millisecond)
			continue
		}
		if l.held() {
			conn.Close()
			l.refused++
			if time.Since(l.logged) >= linkRefuseLog {
				l.log.Warn("agent link: refused connections while the agent's own answers", "id", l.id, "refused", l.refused)
				l.refused, l.logged = 0, time.Now()
			}
			time.Sleep(linkRefusePause)
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), linkHandshakeTimeout)
		sess, err := vmboot.Connect(ctx, conn, l.log) // closes conn on failure
		cancel()
		if err != nil {
			l.log.Warn("agent link: handshake", "id", l.id, "err", err)
			continue
		}
		l.mu.Lock()
		l.sess = sess
		close(l.changed)
		l.changed = make(chan struct{})
		l.mu.Unlock()
		l.answered = time.Time{}
		l.log.Debug("agent link: agent connected", "id", l.id)
		go func() {
			<-sess.CloseChan()
			l.log.Debug("agent link: agent's session ended", "id", l.id)
		}()
	}
}

// held reports whether a session holds the agent's place: it exists and answers a
// ping in time. One that does not is closed.
func (l *agentLink) held() bool {
	l.mu.Lock()
	s := l.sess
	l.mu.Unlock()
	if s == nil || s.IsClosed() {
		return false
	}
	if time.Since(l.answered) < linkAnswerFresh {
		return true
	}
	answered := make(chan error, 1)
	go func() {
		_, err := s.Ping()
		answered <- err
	}()
	t := time.NewTimer(linkPingTimeout)
	defer t.Stop()
	select {
	case err := <-answered:
		if err == nil {
			l.answered = time.Now()
			return true
		}
	case <-t.C:
	}
	s.Close()
	return false
}

// session returns the session that holds the agent's place, waiting for one until
// ctx ends.
func (l *agentLink) session(ctx context.Context) (*yamux.Session, error) {
	for {
		l.mu.Lock()
		s, changed := l.sess, l.changed
		l.mu.Unlock()
		if s != nil && !s.IsClosed() {
			return s, nil
		}
		select {
		case <-changed:
		case <-l.done:
			return nil, errLinkClosed
		case <-ctx.Done():
			return nil, fmt.Errorf("wait for the agent to connect: %w", ctx.Err())
		}
	}
}

// dial opens a stream to the agent: one HTTP connection.
func (l *agentLink) dial(ctx context.Context) (net.Conn, error) {
	s, err := l.session(ctx)
	if err != nil {
		return nil, err
	}
	return s.Open()
}

// close stops listening, ends the session and removes the socket.
func (l *agentLink) close() {
	l.ln.Close()
	<-l.done
	l.mu.Lock()
	if l.sess != nil {
		l.sess.Close()
	}
	l.mu.Unlock()
	if err := os.Remove(l.path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		l.log.Warn("agent link: remove socket", "id", l.id, "err", err)
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

// open returns the instance's link, listening in runDir first if it has none: a start
// or a restore, Adopt, or the first Dial of this node process to an instance it found
// running (a warm-pool member resumed after a restart, say). A lazy open (Dial's) is
// refused while the instance is being destroyed.
func (ls *links) open(id, runDir string, log *slog.Logger, lazy bool) (*agentLink, error) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if l := ls.m[id]; l != nil {
		return l, nil
	}
	if lazy && ls.dying[id] {
		return nil, errLinkClosed
	}
	delete(ls.dying, id)
	l, err := listenLink(id, runDir, log)
	if err != nil {
		return nil, err
	}
	if ls.m == nil {
		ls.m = map[string]*agentLink{}
	}
	ls.m[id] = l
	return l, nil
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
