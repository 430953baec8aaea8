package agent

import (
	"context"
	"net"
	"os"
	"syscall"

	"github.com/creack/pty"
	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/guest/wire"
)

// connKey is the request context key of the request's connection (http.Server
// ConnContext).
type connKey struct{}

func withConn(ctx context.Context, c net.Conn) context.Context {
	return context.WithValue(ctx, connKey{}, c)
}

// peerGone reports whether the client of the request behind ctx has gone away. Go's
// HTTP/1 server notices a closed connection only after the request body was read to
// the end, so a handler blocked writing that body somewhere (a stdin nobody reads)
// would never learn it; this asks the kernel directly (POLLRDHUP), for connections
// that have a file descriptor. For others it relies on ctx alone.
func peerGone(ctx context.Context) bool {
	if ctx.Err() != nil {
		return true
	}
	sc, ok := ctx.Value(connKey{}).(syscall.Conn)
	if !ok {
		return false
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return false
	}
	gone := false
	_ = rc.Control(func(fd uintptr) {
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLRDHUP}}
		if n, err := unix.Poll(fds, 0); err == nil && n > 0 {
			gone = fds[0].Revents&(unix.POLLRDHUP|unix.POLLHUP|unix.POLLERR|unix.POLLNVAL) != 0
		}
	})
	return gone
}

// openPTY opens a terminal pair with creack/pty and returns a master served by the
// runtime poller. pty.Open ends up calling File.Fd(), which switches the master to
// blocking mode: reads would pin a thread and write deadlines (stdin requests for a
// program that does not read) would not work. A non-blocking duplicate fixes both.
func openPTY(size wire.Size) (ptm, pts *os.File, err error) {
	m, s, err := pty.Open()
	if err != nil {
		return nil, nil, err
	}
	fd, err := unix.FcntlInt(m.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	m.Close()
	if err == nil {
		err = unix.SetNonblock(fd, true)
		if err != nil {
			unix.Close(fd)
		}
	}
	if err != nil {
		s.Close()
		return nil, nil, err
	}
	ptm = os.NewFile(uintptr(fd), m.Name())
	if err := setWinsize(ptm, size); err != nil {
		ptm.Close()
		s.Close()
		return nil, nil, err
	}
	return ptm, s, nil
}

// setWinsize sets a terminal's size without File.Fd (see openPTY).
func setWinsize(f *os.File, size wire.Size) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var ierr error
	if err := rc.Control(func(fd uintptr) {
		ierr = unix.IoctlSetWinsize(int(fd), unix.TIOCSWINSZ, &unix.Winsize{Row: size.Rows, Col: size.Cols})
	}); err != nil {
		return err
	}
	return ierr
}
