package server

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/guest/wire"
	"github.com/spacedev/space/internal/rest"
	"github.com/spacedev/space/internal/service"
)

// Sandbox ports through the API, authorized like every sandbox request (the caller's
// API key, its tenant): an HTTP and WebSocket proxy (/v1/sandboxes/{id}/ports/{port}/…)
// and raw TCP tunnels (GET /v1/sandboxes/{id}/ports/{port} with Upgrade: space-tcp,
// what `space port-forward` uses). Both reach the port through the sandbox's agent
// (service.DialPort): the sandbox needs no routable address and no egress.

func (a *API) registerPorts(authed func(string, rest.HandlerFunc)) {
	authed("GET /v1/sandboxes/{id}/ports/{port}", a.portTunnel)
	authed("/v1/sandboxes/{id}/ports/{port}/{path...}", a.portProxy)
}

// portTunnel upgrades the request to a raw TCP connection to the sandbox's port.
func (a *API) portTunnel(w http.ResponseWriter, r *http.Request) error {
	port, err := service.ValidPort(r.PathValue("port"))
	if err != nil {
		return err
	}
	ctx := r.Context()
	// Another tenant's sandbox is a 404 whatever the request.
	if _, err := a.svc.Sandbox(ctx, principalFrom(ctx), r.PathValue("id")); err != nil {
		return err
	}
	if !headerHas(r.Header, "Connection", "upgrade") || !strings.EqualFold(r.Header.Get("Upgrade"), wire.PortUpgrade) {
		return fault.New(fault.Invalid, "this endpoint opens a TCP tunnel: send Connection: Upgrade and Upgrade: %s (for HTTP to the port, use /v1/sandboxes/{id}/ports/%d/)", wire.PortUpgrade, port)
	}
	nw, err := noWake(r)
	if err != nil {
		return err
	}
	up, err := a.svc.DialPort(ctx, principalFrom(ctx), r.PathValue("id"), port, nw)
	if err != nil {
		return err
	}
	defer up.Close()
	conn, brw, err := http.NewResponseController(w).Hijack()
	if err != nil {
		return fmt.Errorf("port %d: hijack: %w", port, err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Time{})
	if _, err := brw.WriteString("HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: " + wire.PortUpgrade + "\r\n\r\n"); err != nil {
		return nil
	}
	if err := brw.Flush(); err != nil {
		return nil
	}
	splice(conn, brw.Reader, up)
	return nil
}

// splice relays between a client connection (whose read-ahead is in br) and a tunnel
// until either side ends; then both are closed.
func splice(conn net.Conn, br io.Reader, up net.Conn) {
	var once sync.Once
	stop := func() { once.Do(func() { conn.Close(); up.Close() }) }
	done := make(chan struct{}, 2)
	go func() { _, _ = io.Copy(up, br); stop(); done <- struct{}{} }()
	go func() { _, _ = io.Copy(conn, up); stop(); done <- struct{}{} }()
	<-done
	<-done
}

// portCtxKey carries the sandbox and port of a proxied request to the transport's
// dialer.
type portCtxKey struct{}

type portTarget struct {
	p      *service.Principal
	id     string
	port   int
	noWake bool
}

// portTransport is the proxy's transport: every connection is a tunnel to the
// request's sandbox port. Idle connections are kept per sandbox and port (the
// transport's key is the URL host, "<id>:<port>", and the tenant check happened before
// any request is sent on them).
func (a *API) portTransport() *http.Transport {
	a.portsOnce.Do(func() {
		a.ports = &http.Transport{
			DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
				t, _ := ctx.Value(portCtxKey{}).(portTarget)
				if t.id == "" {
					return nil, errors.New("port proxy: no target")
				}
				return a.svc.DialPort(ctx, t.p, t.id, t.port, t.noWake)
			},
			MaxIdleConnsPerHost: 8,
			IdleConnTimeout:     30 * time.Second,
			DisableCompression:  true,
		}
	})
	return a.ports
}

// portProxy relays an HTTP request (or a WebSocket or other upgrade) to the server on
// the sandbox's port; the path after /ports/{port} is the server's path.
func (a *API) portProxy(w http.ResponseWriter, r *http.Request) error {
	port, err := service.ValidPort(r.PathValue("port"))
	if err != nil {
		return err
	}
	ctx := r.Context()
	p := principalFrom(ctx)
	id := r.PathValue("id")
	// Authorize before anything is relayed (a connection kept idle in the transport is
	// only reused after this check passed for this caller).
	if _, err := a.svc.Sandbox(ctx, p, id); err != nil {
		return err
	}
	nw, err := noWake(r)
	if err != nil {
		return err
	}
	var proxyErr error
	proxy := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.Out.URL.Scheme = "http"
			pr.Out.URL.Host = net.JoinHostPort(id, strconv.Itoa(port))
			pr.Out.URL.Path = "/" + r.PathValue("path")
			pr.Out.URL.RawPath = ""
			pr.Out.Host = "localhost:" + strconv.Itoa(port)
			pr.SetXForwarded()
			// space's credentials are not the program's business.
			pr.Out.Header.Del("Authorization")
			pr.Out.Header.Del("X-Api-Key")
		},
		Transport:     a.portTransport(),
		FlushInterval: -1,
		ErrorHandler:  func(w http.ResponseWriter, r *http.Request, err error) { proxyErr = err },
		ErrorLog:      slog.NewLogLogger(a.log.Handler(), slog.LevelDebug), // a stream cut under it
	}
	_ = http.NewResponseController(w).EnableFullDuplex()
	proxy.ServeHTTP(w, r.WithContext(context.WithValue(ctx, portCtxKey{}, portTarget{p: p, id: id, port: port, noWake: nw})))
	if proxyErr == nil {
		return nil
	}
	if ctx.Err() != nil {
		if rest.ShuttingDown(r) { // nothing written yet: the proxy reports only such errors
			return proxyErr // written as a shutdown (rest.WriteError)
		}
		return nil
	}
	if fault.KindOf(proxyErr) != fault.Internal {
		return proxyErr
	}
	return fault.New(fault.BadGateway, "port %d of sandbox %s: %v", port, id, proxyErr)
}

// headerHas reports whether the comma-separated header name holds token.
func headerHas(h http.Header, name, token string) bool {
	for _, v := range h.Values(name) {
		for _, t := range strings.Split(v, ",") {
			if strings.EqualFold(strings.TrimSpace(t), token) {
				return true
			}
		}
	}
	return false
}
