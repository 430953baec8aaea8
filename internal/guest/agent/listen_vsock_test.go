package agent

import (
	"errors"
	"io"
	"net"
	"strconv"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestListenVsock: the listener binds an AF_VSOCK port, reports its address and Close
// ends a blocked Accept with net.ErrClosed. (Connecting needs a vsock transport with a
// peer, i.e. a VM or vsock_loopback, which hosts often lack; the connection wrapper is
// tested over a socket pair below.)
func TestListenVsock(t *testing.T) {
	probe, err := unix.Socket(unix.AF_VSOCK, unix.SOCK_STREAM, 0)
	if err != nil {
		t.Skipf("no AF_VSOCK on this host: %v", err)
	}
	unix.Close(probe)
	port := 40000 + time.Now().Nanosecond()%20000
	ln, err := listen(t.Context(), "vsock:"+strconv.Itoa(port), nil)
	if err != nil {
		t.Fatal(err)
	}
	if a := ln.Addr(); a.Network() != "vsock" || a.(vsockAddr).port != uint32(port) {
		t.Errorf("Addr() = %v %v, want vsock port %d", a.Network(), a, port)
	}
	// The port is taken while the listener lives.
	if ln2, err := listen(t.Context(), "vsock:"+strconv.Itoa(port), nil); err == nil {
		ln2.Close()
		t.Error("second listener on the same port succeeded")
	}
	accepted := make(chan error, 1)
	go func() {
		_, err := ln.Accept()
		accepted <- err
	}()
	if err := ln.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-accepted:
		if !errors.Is(err, net.ErrClosed) {
			t.Errorf("Accept after Close: %v, want net.ErrClosed", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not end Accept")
	}
	if _, err := listen(t.Context(), "vsock:x", nil); err == nil {
		t.Error("vsock:x accepted")
	}
}

// TestVsockConn checks the connection wrapper (pollable reads and writes, deadlines,
// half-close) on a unix socket pair: it does not depend on the address family.
func TestVsockConn(t *testing.T) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	a, err := newVsockConn(fds[0], vsockAddr{cid: 3, port: 1024}, vsockAddr{cid: 2, port: 5})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, err := newVsockConn(fds[1], vsockAddr{}, vsockAddr{})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	var c net.Conn = a
	if c.LocalAddr().String() != "vm(3):1024" || c.RemoteAddr().String() != "vm(2):5" {
		t.Errorf("addresses %v %v", c.LocalAddr(), c.RemoteAddr())
	}
	// A read with nothing to read ends at its deadline.
	b.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
	if _, err := b.Read(make([]byte, 1)); !isTimeout(err) {
		t.Errorf("read past deadline: %v, want a timeout", err)
	}
	b.SetReadDeadline(time.Time{})
	if _, err := a.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	if err := a.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(b)
	if err != nil || string(got) != "hello" {
		t.Errorf("read %q, %v; want hello then EOF", got, err)
	}
}

func isTimeout(err error) bool {
	var ne interface{ Timeout() bool }
	return errors.As(err, &ne) && ne.Timeout()
}
