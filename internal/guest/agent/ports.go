package agent

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/spacedev/space/internal/guest/wire"
)

// Port tunnels: GET /v1/ports/{port}/connect upgrades the agent connection to a raw
// byte stream joined to a TCP connection the agent opens to a port inside the
// sandbox. Sandboxes have no network of their own, so this is how traffic reaches a
// server in a sandbox: E2B's <port>-<id>.<domain> routing (internal/e2b) and, later,
// port forwarding relay through it. It is an HTTP Upgrade (like WebSocket's) rather
// than CONNECT so that every proxy on the way (api → node → agent, all Go reverse
// proxies) passes it through unchanged: they relay upgraded connections both ways.

// portDialTimeout bounds the connection attempt to the port.
const portDialTimeout = 5 * time.Second

// tunnel is one open port tunnel; the agent closes them all on quiesce and shutdown
// (a hijacked connection is not closed by http.Server.Close).
type tunnel struct {
	client, upstream net.Conn
	once             sync.Once
}

func (t *tunnel) close() {
	t.once.Do(func() {
		_ = t.client.Close()
		_ = t.upstream.Close()
	})
}

type tunnels struct {
	mu   sync.Mutex
	open map[*tunnel]struct{}
}

func (ts *tunnels) add(t *tunnel) {
	ts.mu.Lock()
	defer ts.mu.Unlock()
	if ts.open == nil {
		ts.open = map[*tunnel]struct{}{}
	}
	ts.open[t] = struct{}{}
}

func (ts *tunnels) remove(t *tunnel) {
	ts.mu.Lock()
	defer ts.mu.Unlock()
	delete(ts.open, t)
}

// closeAll closes every open tunnel.
func (ts *tunnels) closeAll() {
	ts.mu.Lock()
	open := ts.open
	ts.open = nil
	ts.mu.Unlock()
	for t := range open {
		t.close()
	}
}

// dialPort connects to port on the sandbox's loopback: 127.0.0.1, then ::1 when
// nothing listens there (servers bound to "localhost" may listen on ::1 only).
func dialPort(r *http.Request, port int) (net.Conn, error) {
	d := net.Dialer{Timeout: portDialTimeout}
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	c, err := d.DialContext(r.Context(), "tcp", addr)
	if err == nil || !errors.Is(err, syscall.ECONNREFUSED) {
		return c, err
	}
	if c6, err6 := d.DialContext(r.Context(), "tcp", net.JoinHostPort("::1", strconv.Itoa(port))); err6 == nil {
		return c6, nil
	}
	return nil, err
}

func (a *Agent) handlePortConnect(w http.ResponseWriter, r *http.Request) error {
	s := r.PathValue("port")
	port, err := strconv.Atoi(s)
	if err != nil || port < 1 || port > 65535 {
		return badRequest("bad port %q", s)
	}
	if !headerHasToken(r.Header, "Connection", "upgrade") || !strings.EqualFold(r.Header.Get("Upgrade"), wire.PortUpgrade) {
		return &apiError{status: http.StatusUpgradeRequired, code: wire.ErrCodeBadRequest,
			msg: "this endpoint needs Connection: Upgrade and Upgrade: " + wire.PortUpgrade}
	}
	up, err := dialPort(r, port)
	if err != nil {
		msg := fmt.Sprintf("cannot connect to port %d in the sandbox: %v", port, err)
		if errors.Is(err, syscall.ECONNREFUSED) {
			msg = fmt.Sprintf("nothing listens on port %d in the sandbox", port)
		}
		return &apiError{status: http.StatusBadGateway, code: wire.ErrCodePortClosed, msg: msg}
	}
	conn, brw, err := http.NewResponseController(w).Hijack()
	if err != nil {
		up.Close()
		return fmt.Errorf("port %d: hijack: %w", port, err)
	}
	t := &tunnel{client: conn, upstream: up}
	a.tunnels.add(t)
	defer a.tunnels.remove(t)
	defer t.close()
	_ = conn.SetDeadline(time.Time{}) // the server's read deadlines are for requests
	if _, err := brw.WriteString("HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: " + wire.PortUpgrade + "\r\n\r\n"); err != nil {
		return nil
	}
	if err := brw.Flush(); err != nil {
		return nil
	}
	a.log.Debug("port tunnel open", "port", port)
	done := make(chan struct{}, 2)
	relay := func(dst io.Writer, src io.Reader) {
		_, _ = io.Copy(activityWriter{a: a, w: dst}, src)
		done <- struct{}{}
	}
	// Bytes the client sent right behind the request are in brw's reader already.
	go relay(up, brw.Reader)
	go relay(conn, up)
	// The first direction to end ends the tunnel: the proxies in front relay an
	// upgraded connection until either side stops, so half-closes do not survive
	// the way there anyway.
	<-done
	t.close()
	<-done
	a.log.Debug("port tunnel closed", "port", port)
	return nil
}

// activityWriter counts bytes moving through a tunnel as activity of the sandbox.
type activityWriter struct {
	a *Agent
	w io.Writer
}

func (aw activityWriter) Write(p []byte) (int, error) {
	aw.a.touch()
	return aw.w.Write(p)
}

// headerHasToken reports whether the comma-separated header name holds token.
func headerHasToken(h http.Header, name, token string) bool {
	for _, v := range h.Values(name) {
		for _, t := range strings.Split(v, ",") {
			if strings.EqualFold(strings.TrimSpace(t), token) {
				return true
			}
		}
	}
	return false
}
