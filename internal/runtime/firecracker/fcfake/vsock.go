package fcfake

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/guest/vmboot"
)

// Hybrid vsock as Firecracker implements it (docs/vsock.md): the host connects to the
// device's unix socket and writes "CONNECT <port>\n"; when something in the guest listens
// on that port the VMM answers "OK <host port>\n" and the connection becomes a byte
// stream to it, else the VMM closes the connection.
const (
	maxConnectLine = 32              // longest request line Firecracker reads
	connectTimeout = 2 * time.Second // Firecracker's connection-request timeout
)

// bindVsockLocked binds the vsock device's socket (a request path) and starts accepting.
// Like Firecracker it refuses an existing file and never removes it.
func (s *Server) bindVsockLocked(uds string) error {
	hp := s.hostPath(uds)
	if err := s.checkCreate(hp); err != nil {
		return err
	}
	ln, err := listenUnix(hp)
	if err != nil {
		return err
	}
	s.own(hp)
	s.vsockLn = ln
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s.wg.Add(1)
			go func() {
				defer s.wg.Done()
				s.serveVsock(c)
			}()
		}
	}()
	return nil
}

// serveVsock handles one host connection to the vsock socket.
func (s *Server) serveVsock(c net.Conn) {
	port, err := readConnect(c)
	if err != nil {
		s.log.Debug("vsock: bad request", "err", err)
		c.Close()
		return
	}
	guest, hostPort, err := s.connectGuest(port)
	if err != nil {
		s.log.Debug("vsock: no guest listener", "port", port, "err", err)
		c.Close()
		return
	}
	if _, err := fmt.Fprintf(c, "OK %d\n", hostPort); err != nil {
		c.Close()
		guest.Close()
		return
	}
	if !s.track(c, guest) {
		return
	}
	done := make(chan struct{}, 2)
	pipe := func(dst, src net.Conn) {
		_, _ = io.Copy(dst, src)
		if cw, ok := dst.(interface{ CloseWrite() error }); ok {
			_ = cw.CloseWrite()
		}
		done <- struct{}{}
	}
	go pipe(guest, c)
	go pipe(c, guest)
	<-done
	<-done
	s.untrack(c, guest)
}

// readConnect reads the request line byte by byte (nothing of the stream after it may be
// consumed) and returns the port.
func readConnect(c net.Conn) (uint32, error) {
	_ = c.SetReadDeadline(time.Now().Add(connectTimeout))
	defer c.SetReadDeadline(time.Time{})
	var line []byte
	b := make([]byte, 1)
	for {
		if _, err := c.Read(b); err != nil {
			return 0, err
		}
		if b[0] == '\n' {
			break
		}
		line = append(line, b[0])
		if len(line) > maxConnectLine {
			return 0, errors.New("request line too long")
		}
	}
	f := strings.Fields(string(line))
	if len(f) != 2 || !strings.EqualFold(f[0], "CONNECT") {
		return 0, fmt.Errorf("bad request line %q", line)
	}
	port, err := strconv.ParseUint(f[1], 10, 32)
	if err != nil {
		return 0, fmt.Errorf("bad port in %q", line)
	}
	return uint32(port), nil
}

// connectGuest opens a connection to the guest's listener on port, waiting (up to the
// connection-request timeout) while the VM is paused.
func (s *Server) connectGuest(port uint32) (net.Conn, uint32, error) {
	deadline := time.Now().Add(connectTimeout)
	for {
		s.mu.Lock()
		running, state := s.running, s.state
		listening := s.guestPort != 0 && s.guestPort == port && !time.Now().Before(s.guestAt)
		closed := s.closed
		s.mu.Unlock()
		if closed {
			return nil, 0, errors.New("vmm closed")
		}
		if state == StatePaused {
			// A paused guest cannot accept: the request waits for a resume or times out.
			select {
			case <-running:
				continue
			case <-time.After(time.Until(deadline)):
				return nil, 0, errors.New("guest paused")
			}
		}
		if state != StateRunning || !listening {
			return nil, 0, fmt.Errorf("nothing listens on port %d", port)
		}
		break
	}
	if s.opts.Guest == nil {
		return nil, 0, errors.New("no guest")
	}
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	g, err := s.opts.Guest(ctx, port)
	if err != nil {
		return nil, 0, err
	}
	s.mu.Lock()
	s.hostPort++
	hp := s.hostPort
	s.mu.Unlock()
	return g, hp, nil
}

func (s *Server) track(conns ...net.Conn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		for _, c := range conns {
			c.Close()
		}
		return false
	}
	for _, c := range conns {
		s.conns[c] = struct{}{}
	}
	return true
}

func (s *Server) untrack(conns ...net.Conn) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, c := range conns {
		c.Close()
		delete(s.conns, c)
	}
}

// resetConnsLocked closes every bridged connection (VIRTIO_VSOCK_EVENT_TRANSPORT_RESET).
func (s *Server) resetConnsLocked() {
	for c := range s.conns {
		c.Close()
		delete(s.conns, c)
	}
}

// agentPort returns the vsock port the space agent listens on according to the kernel
// command line (SPACE_AGENT_LISTEN=vsock:PORT in space.env), or 0.
func agentPort(bootArgs *string) uint32 {
	if bootArgs == nil {
		return 0
	}
	for _, arg := range strings.Fields(*bootArgs) {
		v, ok := strings.CutPrefix(arg, vmboot.EnvParam+"=")
		if !ok {
			continue
		}
		data, err := base64.RawURLEncoding.DecodeString(v)
		if err != nil {
			return 0
		}
		var env map[string]string
		if json.Unmarshal(data, &env) != nil {
			return 0
		}
		p, ok := strings.CutPrefix(env["SPACE_AGENT_LISTEN"], "vsock:")
		if !ok {
			return 0
		}
		n, err := strconv.ParseUint(p, 10, 32)
		if err != nil {
			return 0
		}
		return uint32(n)
	}
	return 0
}

// DialUnixGuest returns a GuestDialer that connects every vsock connection to the unix
// socket at path (for example an agent listening on unix:PATH).
func DialUnixGuest(path string) GuestDialer {
	return func(ctx context.Context, _ uint32) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", path)
	}
}

// listenUnix binds a unix socket at hp, which firecracker never removes. A jailed
// firecracker binds short in-chroot paths; their host paths can exceed what a
// sockaddr_un holds, so long ones are bound through a descriptor of their directory.
func listenUnix(hp string) (net.Listener, error) {
	name := hp
	if len(hp) > 107 {
		fd, err := unix.Open(filepath.Dir(hp), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			return nil, err
		}
		defer unix.Close(fd)
		name = "/proc/self/fd/" + strconv.Itoa(fd) + "/" + filepath.Base(hp)
	}
	ln, err := net.Listen("unix", name)
	if err != nil {
		return nil, err
	}
	ln.(*net.UnixListener).SetUnlinkOnClose(false)
	return ln, nil
}
