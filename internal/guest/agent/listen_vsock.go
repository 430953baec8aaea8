package agent

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"sync/atomic"
	"syscall"

	"golang.org/x/sys/unix"
)

// The vsock transport ("vsock:PORT"): an AF_VSOCK stream socket listening on PORT for any
// CID, the guest end of a VM's virtio-vsock device. Firecracker's hybrid vsock forwards
// each host connection to its unix socket ("CONNECT PORT") to this listener, one
// connection per host connection, so the agent's HTTP server serves them directly.
//
// A snapshot resets the device's transport: every established connection dies with it,
// but the listening socket survives (it adopts the device's CID after the reset), so
// after a restore the host just connects again.

// listenVsock listens on AF_VSOCK port (VMADDR_CID_ANY).
func listenVsock(_ context.Context, port string) (net.Listener, error) {
	p, err := strconv.ParseUint(port, 10, 32)
	if err != nil {
		return nil, fmt.Errorf("listen vsock:%s: bad port", port)
	}
	fd, err := unix.Socket(unix.AF_VSOCK, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("listen vsock:%s: socket: %w (is the vsock transport module loaded?)", port, err)
	}
	if err := unix.Bind(fd, &unix.SockaddrVM{CID: unix.VMADDR_CID_ANY, Port: uint32(p)}); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("listen vsock:%s: bind: %w", port, err)
	}
	if err := unix.Listen(fd, unix.SOMAXCONN); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("listen vsock:%s: %w", port, err)
	}
	// A non-blocking descriptor becomes a File on the runtime poller: Accept waits
	// without a thread, and Close interrupts it.
	f := os.NewFile(uintptr(fd), "vsock:"+port)
	rc, err := f.SyscallConn()
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("listen vsock:%s: %w", port, err)
	}
	addr := vsockAddr{cid: unix.VMADDR_CID_ANY, port: uint32(p)}
	if sa, err := unix.Getsockname(fd); err == nil {
		addr = vsockAddrOf(sa, addr)
	}
	return &vsockListener{f: f, rc: rc, addr: addr}, nil
}

// vsockAddr is an AF_VSOCK address.
type vsockAddr struct{ cid, port uint32 }

func (a vsockAddr) Network() string { return "vsock" }
func (a vsockAddr) String() string  { return fmt.Sprintf("vm(%d):%d", a.cid, a.port) }

func vsockAddrOf(sa unix.Sockaddr, def vsockAddr) vsockAddr {
	if vm, ok := sa.(*unix.SockaddrVM); ok {
		return vsockAddr{cid: vm.CID, port: vm.Port}
	}
	return def
}

type vsockListener struct {
	f      *os.File
	rc     syscall.RawConn
	addr   vsockAddr
	closed atomic.Bool
}

func (l *vsockListener) Accept() (net.Conn, error) {
	for {
		var nfd int
		var sa unix.Sockaddr
		var aerr error
		err := l.rc.Read(func(fd uintptr) bool {
			nfd, sa, aerr = unix.Accept4(int(fd), unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC)
			return !errors.Is(aerr, unix.EAGAIN) // false: wait until readable, try again
		})
		if err != nil {
			if l.closed.Load() {
				return nil, net.ErrClosed
			}
			return nil, &net.OpError{Op: "accept", Net: "vsock", Addr: l.addr, Err: err}
		}
		switch {
		case errors.Is(aerr, unix.ECONNABORTED) || errors.Is(aerr, unix.EINTR):
			continue // the peer gave up before we got to it
		case aerr != nil:
			return nil, &net.OpError{Op: "accept", Net: "vsock", Addr: l.addr, Err: os.NewSyscallError("accept4", aerr)}
		}
		local := l.addr
		if lsa, err := unix.Getsockname(nfd); err == nil {
			local = vsockAddrOf(lsa, local)
		}
		return newVsockConn(nfd, local, vsockAddrOf(sa, vsockAddr{}))
	}
}

func (l *vsockListener) Close() error {
	l.closed.Store(true)
	return l.f.Close()
}

func (l *vsockListener) Addr() net.Addr { return l.addr }

// vsockConn is an accepted connection: a pollable File (reads, writes and deadlines) with
// addresses and a half-close.
type vsockConn struct {
	*os.File
	rc            syscall.RawConn
	local, remote net.Addr
}

// newVsockConn wraps a connected, non-blocking stream socket.
func newVsockConn(fd int, local, remote net.Addr) (*vsockConn, error) {
	f := os.NewFile(uintptr(fd), "vsock-conn")
	rc, err := f.SyscallConn()
	if err != nil {
		f.Close()
		return nil, err
	}
	return &vsockConn{File: f, rc: rc, local: local, remote: remote}, nil
}

func (c *vsockConn) LocalAddr() net.Addr  { return c.local }
func (c *vsockConn) RemoteAddr() net.Addr { return c.remote }

// CloseWrite shuts the sending side down (net/http uses it to end a response cleanly).
func (c *vsockConn) CloseWrite() error {
	var serr error
	if err := c.rc.Control(func(fd uintptr) { serr = unix.Shutdown(int(fd), unix.SHUT_WR) }); err != nil {
		return err
	}
	return serr
}
