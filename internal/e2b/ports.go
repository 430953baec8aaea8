package e2b

import (
	"bufio"
	"bytes"
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"os"
	"strconv"
	"syscall"
	"time"

	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/guest/agentclient"
	"github.com/spacedev/space/internal/guest/envdpb"
	"github.com/spacedev/space/internal/guest/wire"
	"github.com/spacedev/space/internal/ids"
	"github.com/spacedev/space/internal/rest"
	"github.com/spacedev/space/internal/service"
	"github.com/spacedev/space/internal/store"
)

// Traffic for a sandbox port other than envd's (<port>-<id>.<domain> hosts, or
// E2b-Sandbox-Port headers): E2B's "getHost(port)" URLs, the code interpreter's
// server on 49999, anything a program in the sandbox serves. Sandboxes have no
// network, so it travels through the agent's port tunnel (GET /v1/ports/{port}/connect,
// an HTTP Upgrade to a TCP connection the agent opens inside the sandbox), relayed
// api → node → agent. Here an HTTP reverse proxy speaks to the sandbox's server over
// such tunnels, one per connection, kept alive between requests like any HTTP
// connection; WebSocket and other upgrades pass through them as they are. Like E2B's
// public traffic (its default), these requests need no access token, except the code
// interpreter's /execute (codeInterpreterPort).

// codeInterpreterPort is where E2B's code interpreter server listens. Its /execute
// runs code, so, as with E2B's own server, it takes the envd access token (the code
// interpreter SDKs send it there; they send none on /contexts).
const codeInterpreterPort = 49999

// sandboxCtxKey carries the sandbox of a port request to the tunnel dialer.
type sandboxCtxKey struct{}

// errPortClosed is a tunnel refused because nothing listens on the port.
type errPortClosed struct {
	port int
	msg  string
}

func (e *errPortClosed) Error() string { return e.msg }

// newPortTransport returns the HTTP transport of port traffic: its "host" is
// <sandbox id>:<port>, and a connection is a tunnel to that port.
func (g *Gateway) newPortTransport() *http.Transport {
	return &http.Transport{
		DialContext:         g.dialPort,
		MaxIdleConnsPerHost: 8,
		IdleConnTimeout:     30 * time.Second,
		DisableCompression:  true,
		// Proxy stays nil: these connections never leave through a host proxy.
	}
}

// servePort relays one request (HTTP, or an upgrade such as WebSocket) to port of
// the sandbox.
func (g *Gateway) servePort(w http.ResponseWriter, r *http.Request, id string, port int) {
	ctx := r.Context()
	if !ids.ValidSandbox(id) {
		notFound502(w, id)
		return
	}
	target, p, err := g.portTarget(ctx, id)
	if err == nil && port == codeInterpreterPort && r.URL.Path == "/execute" &&
		subtle.ConstantTimeCompare([]byte(r.Header.Get("X-Access-Token")), []byte(g.accessToken(target))) != 1 {
		writeError(w, http.StatusUnauthorized, msgUnauthorized)
		return
	}
	if err == nil && port == codeInterpreterPort && r.URL.Path == "/execute" {
		err = g.api.Allow(ctx, p)
	}
	var sb *store.Sandbox
	if err == nil {
		sb, err = g.runningSandbox(ctx, p, id)
	}
	if fault.Is(err, fault.QuotaExceeded) || fault.Is(err, fault.TooManyRequests) || later(err) || rest.ShuttingDown(r) {
		g.fail(w, r, err)
		return
	}
	if err != nil {
		if ctx.Err() == nil {
			g.log.Debug("port request for a sandbox that is not running", "sandbox", id, "port", port, "err", err)
		}
		notFound502(w, id)
		return
	}
	// allowPublicTraffic false: the traffic access token is required (network.go).
	if !g.trafficAllowed(r, sb) {
		writeError(w, http.StatusForbidden, "the sandbox's traffic is private: send the traffic access token in the "+trafficTokenHeader+" header")
		return
	}
	host := r.Host
	if m := maskedHost(sb, port); m != "" {
		host = m // maskRequestHost
	}
	var proxyErr error
	proxy := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.Out.URL.Scheme = "http"
			pr.Out.URL.Host = net.JoinHostPort(sb.ID, strconv.Itoa(port))
			pr.Out.Host = host // the name the client used, or the sandbox's mask
			pr.Out.Header.Del(trafficTokenHeader)
			pr.SetXForwarded()
			// Credentials of the sandbox plane are not the program's business.
			pr.Out.Header.Del("X-Access-Token")
		},
		Transport:     g.ports,
		FlushInterval: -1, // streamed answers (NDJSON, SSE) go out as they come
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			proxyErr = err
		},
		ErrorLog: slog.NewLogLogger(g.log.Handler(), slog.LevelDebug), // a stream cut under it
	}
	_ = http.NewResponseController(w).EnableFullDuplex()
	proxy.ServeHTTP(w, r.WithContext(context.WithValue(ctx, sandboxCtxKey{}, portRequest{sb, p})))
	if proxyErr == nil {
		return
	}
	if ctx.Err() != nil {
		if rest.ShuttingDown(r) { // nothing written yet: the proxy reports only such errors
			g.fail(w, r, proxyErr) // says to retry
		}
		return
	}
	var closed *errPortClosed
	if errors.As(proxyErr, &closed) {
		writeJSON(w, http.StatusBadGateway, map[string]any{"message": "The sandbox is running but port is not open",
			"sandboxId": id, "port": port, "code": http.StatusBadGateway, "detail": closed.msg})
		return
	}
	if later(proxyErr) {
		g.fail(w, r, proxyErr)
		return
	}
	g.log.Warn("port relay failed", "sandbox", id, "port", port, "err", proxyErr)
	writeJSON(w, http.StatusBadGateway, map[string]any{"sandboxId": id, "port": port, "code": http.StatusBadGateway,
		"message": fmt.Sprintf("The sandbox is not reachable on port %d: %s", port, fault.Message(proxyErr))})
}

// dialPort opens a tunnel to addr, "<sandbox id>:<port>".
func (g *Gateway) dialPort(ctx context.Context, _, addr string) (net.Conn, error) {
	id, p, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, err
	}
	port, err := strconv.Atoi(p)
	if err != nil {
		return nil, fmt.Errorf("bad port in %q", addr)
	}
	pr, _ := ctx.Value(sandboxCtxKey{}).(portRequest)
	if pr.sb == nil || pr.sb.ID != id {
		if _, pr.p, err = g.portTarget(ctx, id); err != nil {
			return nil, err
		}
		if pr.sb, err = g.runningSandbox(ctx, pr.p, id); err != nil {
			return nil, err
		}
	}
	return g.openTunnel(ctx, pr.sb, pr.p, port)
}

// portRequest is the sandbox of a port request and the principal it acts as.
type portRequest struct {
	sb *store.Sandbox
	p  *service.Principal
}

// portTarget loads the sandbox a port request names, without waking it, and the
// principal port traffic acts as: a member of the sandbox's tenant (the traffic is
// public, as E2B's is by default; the sandbox id is its capability). An unknown id
// and a warm-pool member are not found alike.
func (g *Gateway) portTarget(ctx context.Context, id string) (*store.Sandbox, *service.Principal, error) {
	sb, err := g.st.GetSandbox(ctx, id)
	if err != nil {
		return nil, nil, err
	}
	if sb.PoolKey != "" || sb.DeletedAt != nil {
		return nil, nil, fault.New(fault.NotFound, "sandbox %s not found", id)
	}
	return sb, &service.Principal{Tenant: sb.Tenant, Role: store.RoleMember}, nil
}

// openTunnel asks the sandbox's agent for a port tunnel and returns it as a
// connection. The request goes through the sandbox's agent client (api → node → agent,
// reverse proxies that relay upgraded connections): it is given a response writer
// that can be hijacked, whose connection is one end of a socket pair; the other end
// is the tunnel. The tunnel lives until either end closes it.
func (g *Gateway) openTunnel(ctx context.Context, sb *store.Sandbox, p *service.Principal, port int) (net.Conn, error) {
	local, remote, err := socketPair()
	if err != nil {
		return nil, fmt.Errorf("port %d tunnel: %w", port, err)
	}
	tctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	req, err := http.NewRequestWithContext(tctx, http.MethodGet, "http://agent/", nil)
	if err != nil {
		cancel()
		local.Close()
		remote.Close()
		return nil, err
	}
	req.Header.Set("Connection", "Upgrade")
	req.Header.Set("Upgrade", wire.PortUpgrade)
	req.Header.Set(envdpb.TunnelHeader, "1") // errors come back whole (status in a header)
	hw := &hijackWriter{header: http.Header{}, conn: remote, hijacked: make(chan struct{})}
	done := make(chan error, 1)
	go func() {
		t, err := g.api.Running(tctx, p, sb.ID, true)
		var agent *agentclient.Client
		if err == nil {
			agent, err = g.api.Agent(tctx, t)
		}
		if err == nil {
			err = agent.Relay(hw, req, "/v1/ports/"+strconv.Itoa(port)+"/connect", nil, g.log)
		}
		_ = remote.Close()
		cancel()
		done <- err
	}()
	fail := func(err error) (net.Conn, error) {
		_ = local.Close()
		cancel()
		return nil, err
	}
	select {
	case <-hw.hijacked:
	case err := <-done:
		if err == nil {
			err = hw.refusal(port)
		}
		return fail(err)
	case <-ctx.Done():
		return fail(ctx.Err())
	}
	if dl, ok := ctx.Deadline(); ok {
		_ = local.SetReadDeadline(dl)
	}
	br := bufio.NewReader(local)
	resp, err := http.ReadResponse(br, req)
	if err != nil {
		return fail(fmt.Errorf("port %d tunnel: %w", port, err))
	}
	if resp.StatusCode != http.StatusSwitchingProtocols {
		return fail(fmt.Errorf("port %d tunnel: agent answered %s", port, resp.Status))
	}
	_ = local.SetReadDeadline(time.Time{})
	return &tunnelConn{Conn: local, r: br, cancel: cancel}, nil
}

// socketPair returns two connected unix stream sockets. Unlike net.Pipe they buffer,
// and they have CloseWrite: the reverse proxies half-close the connection they relay
// when the far end stops sending, and that end of file must reach the HTTP client
// reading this side (a server that ends its answer by closing the connection).
func socketPair() (net.Conn, net.Conn, error) {
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("socketpair: %w", err)
	}
	conns := make([]net.Conn, 2)
	for i, fd := range fds {
		f := os.NewFile(uintptr(fd), "tunnel")
		c, err := net.FileConn(f)
		f.Close()
		if err != nil {
			for j := i + 1; j < 2; j++ {
				syscall.Close(fds[j])
			}
			if conns[0] != nil {
				conns[0].Close()
			}
			return nil, nil, fmt.Errorf("socketpair: %w", err)
		}
		conns[i] = c
	}
	return conns[0], conns[1], nil
}

// tunnelConn is the local end of a tunnel; bytes the handshake read ahead come first.
type tunnelConn struct {
	net.Conn
	r      *bufio.Reader
	cancel context.CancelFunc
}

func (c *tunnelConn) Read(p []byte) (int, error) { return c.r.Read(p) }

func (c *tunnelConn) Close() error {
	err := c.Conn.Close()
	c.cancel()
	return err
}

// hijackWriter is the response writer of a tunnel request: hijacking it hands over
// the pipe; an answer that is not an upgrade (an error) is kept for refusal.
type hijackWriter struct {
	header   http.Header
	status   int
	body     bytes.Buffer
	conn     net.Conn
	hijacked chan struct{}
}

func (h *hijackWriter) Header() http.Header { return h.header }

func (h *hijackWriter) WriteHeader(code int) {
	if h.status == 0 {
		h.status = code
	}
}

func (h *hijackWriter) Write(b []byte) (int, error) {
	if h.status == 0 {
		h.status = http.StatusOK
	}
	if h.body.Len() < 64<<10 {
		h.body.Write(b)
	}
	return len(b), nil
}

func (h *hijackWriter) Flush() {}

func (h *hijackWriter) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	close(h.hijacked)
	return h.conn, bufio.NewReadWriter(bufio.NewReader(h.conn), bufio.NewWriter(h.conn)), nil
}

// refusal turns the agent's answer to a tunnel request that was not upgraded into an
// error (errPortClosed when nothing listens on the port).
func (h *hijackWriter) refusal(port int) error {
	status := h.status
	if s := h.header.Get(envdpb.StatusHeader); s != "" {
		status, _ = strconv.Atoi(s)
	}
	var we wire.Error
	_ = json.Unmarshal(h.body.Bytes(), &we)
	if we.Code == wire.ErrCodePortClosed {
		return &errPortClosed{port: port, msg: we.Message}
	}
	msg := we.Message
	if msg == "" {
		msg = string(bytes.TrimSpace(h.body.Bytes()))
	}
	return fmt.Errorf("port %d tunnel refused (%d): %s", port, status, msg)
}

var _ io.Writer = (*hijackWriter)(nil)
