package network

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"net/netip"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"go4.org/netipx"
	"golang.org/x/net/proxy"
	"golang.org/x/sys/unix"

	"github.com/spacedev/space/api"
)

// The egress proxy of a sandbox has two listeners on its gateway address (host
// namespace), reached only through the nftables redirects:
//
//   - tls: HTTPS to an address pinned for a header-rule domain. The proxy reads the
//     ClientHello's SNI. No SNI, or a name the policy does not allow: refused. An allowed
//     name without rules: the bytes are passed through to that name, which the proxy
//     resolves and dials itself (never the address the sandbox chose). A name with rules:
//     TLS is terminated with a leaf of the node CA, every request's Host must equal the
//     SNI (else 421), the rule's headers are set, and the request goes to the name over
//     verified TLS.
//   - tcp (SOCKS5 upstream only): every TCP connection, judged like the kernel judges
//     them, then carried through the SOCKS5 upstream. When the upstream cannot be
//     reached the connection is reset: egress never falls back to direct.
//
// Upstream dials (direct or to the SOCKS5 server) refuse always-denied addresses in the
// dialer's Control hook, after resolution and before connect, so a name that resolves
// to a private or metadata address (rebinding) reaches nothing.
type sandboxProxy struct {
	m      *Manager
	sb     *sandbox
	tlsL   net.Listener
	tcpL   net.Listener
	policy atomic.Pointer[Policy]
	sem    chan struct{}
	srv    *http.Server
	httpL  *chanListener
	tr     atomic.Pointer[http.Transport]

	mu    sync.Mutex
	conns map[*pconn]struct{}
	tlsOf map[net.Conn]*pconn
}

// pconn is one connection from the sandbox the proxy carries.
type pconn struct {
	net.Conn // the sandbox side (counting)
	dst      netip.AddrPort
	domain   string // SNI (tls) or the names pinned for dst (tcp)
	kind     string // "https" (terminated), "tls" (passed through) or "tcp"
	via      *ProxySpec
	up       net.Conn
	in, out  atomic.Int64 // bytes from / to the sandbox
	closed   atomic.Bool
	hijacked atomic.Bool
}

func (c *pconn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	c.out.Add(int64(n)) // the sandbox sends: outbound
	return n, err
}

func (c *pconn) Write(b []byte) (int, error) {
	n, err := c.Conn.Write(b)
	c.in.Add(int64(n))
	return n, err
}

func (c *pconn) cut() {
	if c.closed.Swap(true) {
		return
	}
	if tc, ok := c.Conn.(*net.TCPConn); ok {
		_ = tc.SetLinger(0) // reset, not a clean close
	}
	_ = c.Conn.Close()
	if c.up != nil {
		_ = c.up.Close()
	}
}

func (m *Manager) startProxy(sb *sandbox) (*sandboxProxy, error) {
	p := &sandboxProxy{m: m, sb: sb, sem: make(chan struct{}, m.cfg.ProxyConnsPerSandbox),
		conns: map[*pconn]struct{}{}, tlsOf: map[net.Conn]*pconn{}}
	var err error
	if p.tlsL, err = m.host.Listen("tcp4", netip.AddrPortFrom(sb.gw, 0).String()); err != nil {
		return nil, fmt.Errorf("network: proxy for %s: %w", sb.id, err)
	}
	if p.tcpL, err = m.host.Listen("tcp4", netip.AddrPortFrom(sb.gw, 0).String()); err != nil {
		p.tlsL.Close()
		return nil, fmt.Errorf("network: proxy for %s: %w", sb.id, err)
	}
	p.httpL = newChanListener(p.tlsL.Addr())
	p.srv = &http.Server{
		Handler:           p,
		ReadHeaderTimeout: 30 * time.Second,
		IdleTimeout:       2 * time.Minute,
		MaxHeaderBytes:    64 << 10,
		ConnContext: func(ctx context.Context, c net.Conn) context.Context {
			p.mu.Lock()
			pc := p.tlsOf[c]
			p.mu.Unlock()
			return context.WithValue(ctx, pconnKey{}, pc)
		},
		ConnState: func(c net.Conn, st http.ConnState) {
			if st == http.StateClosed || st == http.StateHijacked {
				p.mu.Lock()
				pc := p.tlsOf[c]
				delete(p.tlsOf, c)
				p.mu.Unlock()
				if pc == nil {
					return
				}
				if st == http.StateHijacked {
					// An upgrade (WebSocket): ServeHTTP carries it and ends it.
					pc.hijacked.Store(true)
					return
				}
				p.done(pc)
			}
		},
		ErrorLog: nil,
	}
	p.newTransport()
	go func() { _ = p.srv.Serve(p.httpL) }()
	go p.accept(p.tlsL, p.serveTLS)
	go p.accept(p.tcpL, p.serveTCP)
	return p, nil
}

type pconnKey struct{}

func (p *sandboxProxy) tlsPort() uint16 { return uint16(p.tlsL.Addr().(*net.TCPAddr).Port) }
func (p *sandboxProxy) tcpPort() uint16 { return uint16(p.tcpL.Addr().(*net.TCPAddr).Port) }

func (p *sandboxProxy) close() {
	p.tlsL.Close()
	p.tcpL.Close()
	p.httpL.Close()
	_ = p.srv.Close()
	p.mu.Lock()
	conns := make([]*pconn, 0, len(p.conns))
	for c := range p.conns {
		conns = append(conns, c)
	}
	p.mu.Unlock()
	for _, c := range conns {
		c.cut()
	}
	if tr := p.tr.Load(); tr != nil {
		tr.CloseIdleConnections()
	}
}

func (p *sandboxProxy) newTransport() {
	roots := p.m.cfg.UpstreamRoots
	tr := &http.Transport{
		DialTLSContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			host, port, err := net.SplitHostPort(addr)
			if err != nil {
				return nil, err
			}
			n, _ := strconv.Atoi(port)
			c, err := p.dial(ctx, p.policy.Load(), host, uint16(n))
			if err != nil {
				return nil, err
			}
			tc := tls.Client(c, &tls.Config{ServerName: host, RootCAs: roots, NextProtos: []string{"http/1.1"}, MinVersion: tls.VersionTLS12})
			if err := tc.HandshakeContext(ctx); err != nil {
				c.Close()
				return nil, err
			}
			return tc, nil
		},
		MaxIdleConnsPerHost:   4,
		IdleConnTimeout:       30 * time.Second,
		ResponseHeaderTimeout: 2 * time.Minute,
		ForceAttemptHTTP2:     false,
	}
	if old := p.tr.Swap(tr); old != nil {
		old.CloseIdleConnections()
	}
}

// setPolicy installs a new policy and cuts the carried connections it no longer allows
// (or all of them when the SOCKS5 upstream changed). The caller holds the sandbox's lock.
func (p *sandboxProxy) setPolicy(pol *Policy, forbidden *netipx.IPSet) {
	old := p.policy.Swap(pol)
	if old == nil {
		return
	}
	p.newTransport()
	now := time.Now()
	p.mu.Lock()
	var cut []*pconn
	for c := range p.conns {
		allowed := false
		if c.kind == "tcp" {
			pinned := p.sb.pins.lookup(c.dst.Addr(), now) != nil
			allowed = pol.Decide(c.dst.Addr(), protoTCP, c.dst.Port(), pinned, forbidden).Allowed
		} else if c.kind != "" {
			allowed = pol.Name(c.domain) != NameRefused
		}
		if c.kind != "" && (!allowed || !sameProxy(c.via, pol.Proxy)) {
			cut = append(cut, c)
		}
	}
	p.mu.Unlock()
	for _, c := range cut {
		p.m.log.Info("egress connection cut by policy change", "sandbox", p.sb.id, "dst", c.dst, "domain", c.domain)
		p.sb.jr.Append(api.NetworkEvent{Kind: api.NetEventConnect, Verdict: api.NetDenied, Reason: ReasonPolicy,
			Protocol: c.kind, Destination: c.dst.String(), Domain: c.domain})
		c.cut()
	}
}

func (p *sandboxProxy) decide(pol *Policy, dst netip.AddrPort, now time.Time) Verdict {
	p.sb.mu.Lock()
	pinned := p.sb.pins.lookup(dst.Addr(), now) != nil
	p.sb.mu.Unlock()
	return pol.Decide(dst.Addr(), protoTCP, dst.Port(), pinned, p.m.cachedForbidden())
}

func sameProxy(a, b *ProxySpec) bool {
	if a == nil || b == nil {
		return a == b
	}
	return *a == *b
}

func (p *sandboxProxy) accept(l net.Listener, serve func(*pconn)) {
	for {
		c, err := l.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			time.Sleep(10 * time.Millisecond)
			continue
		}
		select {
		case p.sem <- struct{}{}:
		default:
			p.sb.jr.Append(api.NetworkEvent{Kind: api.NetEventConnect, Verdict: api.NetDenied,
				Reason: ReasonRateLimited, Protocol: "tcp", Destination: c.RemoteAddr().String()})
			if tc, ok := c.(*net.TCPConn); ok {
				_ = tc.SetLinger(0)
			}
			c.Close()
			continue
		}
		dst, err := originalDst(c)
		if err != nil {
			<-p.sem
			c.Close()
			continue
		}
		pc := &pconn{Conn: c, dst: dst}
		p.mu.Lock()
		p.conns[pc] = struct{}{}
		p.mu.Unlock()
		go serve(pc)
	}
}

// done forgets a connection and records its end.
func (p *sandboxProxy) done(pc *pconn) {
	pc.cut()
	p.mu.Lock()
	_, ok := p.conns[pc]
	delete(p.conns, pc)
	p.mu.Unlock()
	if !ok {
		return
	}
	<-p.sem
	if pc.kind != "" {
		p.sb.jr.Append(api.NetworkEvent{Kind: api.NetEventClose, Verdict: api.NetAllowed, Protocol: pc.kind,
			Destination: pc.dst.String(), Domain: pc.domain, BytesOut: pc.out.Load(), BytesIn: pc.in.Load()})
	}
}

func (p *sandboxProxy) deny(pc *pconn, proto, reason string) {
	p.sb.jr.Append(api.NetworkEvent{Kind: api.NetEventConnect, Verdict: api.NetDenied, Reason: reason,
		Protocol: proto, Destination: pc.dst.String(), Domain: pc.domain})
	pc.kind = ""
	p.done(pc)
}

func (p *sandboxProxy) allow(pc *pconn, proto, reason string) {
	p.sb.jr.Append(api.NetworkEvent{Kind: api.NetEventConnect, Verdict: api.NetAllowed, Reason: reason,
		Protocol: proto, Destination: pc.dst.String(), Domain: pc.domain})
}

// serveTLS handles HTTPS redirected to the proxy.
func (p *sandboxProxy) serveTLS(pc *pconn) {
	_ = pc.Conn.SetDeadline(time.Now().Add(15 * time.Second))
	sni, hello, err := peekSNI(pc)
	if err != nil || sni == "" {
		p.deny(pc, "https", ReasonNoSNI)
		return
	}
	name, err := NormalizeDomain(sni)
	pc.domain = sni
	if err != nil {
		p.deny(pc, "https", ReasonNotAllowed)
		return
	}
	pc.domain = name
	pol := p.policy.Load()
	if pol == nil || pol.Name(name) == NameRefused {
		p.deny(pc, "https", ReasonNotAllowed)
		return
	}
	pc.via = pol.Proxy
	replay := &prefixConn{Conn: pc, r: io.MultiReader(bytes.NewReader(hello), pc)}
	if pol.HeaderRules(name) == nil {
		// Allowed, no rules: pass the TLS bytes through to the name itself.
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		up, err := p.dial(ctx, pol, name, pc.dst.Port())
		cancel()
		if err != nil {
			p.deny(pc, "tls", upstreamReason(err))
			return
		}
		pc.up, pc.kind = up, "tls"
		_ = pc.Conn.SetDeadline(time.Time{})
		p.allow(pc, "tls", ReasonPinned)
		splice(replay, up)
		p.done(pc)
		return
	}
	cert, err := p.m.ca.Leaf(name)
	if err != nil {
		p.deny(pc, "https", ReasonUpstream)
		return
	}
	tc := tls.Server(replay, &tls.Config{
		Certificates: []tls.Certificate{*cert},
		NextProtos:   []string{"http/1.1"},
		MinVersion:   tls.VersionTLS12,
	})
	if err := tc.Handshake(); err != nil {
		p.deny(pc, "https", "tls_handshake")
		return
	}
	_ = pc.Conn.SetDeadline(time.Time{})
	pc.kind = "https"
	p.allow(pc, "https", "header_rule")
	p.mu.Lock()
	p.tlsOf[tc] = pc
	p.mu.Unlock()
	if !p.httpL.push(tc) {
		p.mu.Lock()
		delete(p.tlsOf, tc)
		p.mu.Unlock()
		p.done(pc)
	}
}

// ServeHTTP forwards one request of a terminated connection.
func (p *sandboxProxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	pc, _ := r.Context().Value(pconnKey{}).(*pconn)
	if pc == nil {
		http.Error(w, "no connection", http.StatusInternalServerError)
		return
	}
	host := r.Host
	if h, port, err := net.SplitHostPort(r.Host); err == nil {
		host = h
		if port != strconv.Itoa(int(pc.dst.Port())) {
			host = "" // another port is another origin
		}
	}
	name, err := NormalizeDomain(host)
	if err != nil || name != pc.domain {
		p.sb.jr.Append(api.NetworkEvent{Kind: api.NetEventConnect, Verdict: api.NetDenied, Reason: ReasonSNIMismatch,
			Protocol: "https", Destination: pc.dst.String(), Domain: pc.domain + " (Host: " + truncate(r.Host, 100) + ")"})
		http.Error(w, "space egress: Host does not match the TLS server name", http.StatusMisdirectedRequest)
		return
	}
	if r.Method == http.MethodConnect {
		http.Error(w, "space egress: CONNECT is not allowed", http.StatusMethodNotAllowed)
		return
	}
	pol := p.policy.Load()
	if pol.Name(name) == NameRefused {
		http.Error(w, "space egress: domain not allowed", http.StatusForbidden)
		return
	}
	headers := pol.HeaderRules(name)
	port := pc.dst.Port()
	rp := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.Out.URL.Scheme = "https"
			pr.Out.URL.Host = net.JoinHostPort(name, strconv.Itoa(int(port)))
			if port == 443 {
				pr.Out.URL.Host = name
			}
			pr.Out.Host = pr.Out.URL.Host
			for k, v := range headers {
				pr.Out.Header[k] = append([]string(nil), v...)
			}
		},
		Transport: p.tr.Load(),
		ErrorLog:  slog.NewLogLogger(p.m.log.Handler(), slog.LevelDebug), // a stream cut under it
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			p.sb.jr.Append(api.NetworkEvent{Kind: api.NetEventConnect, Verdict: api.NetDenied, Reason: upstreamReason(err),
				Protocol: "https", Destination: pc.dst.String(), Domain: name})
			http.Error(w, "space egress: upstream failed", http.StatusBadGateway)
		},
	}
	rp.ServeHTTP(w, r)
	if pc.hijacked.Load() {
		p.done(pc) // the upgraded connection ended with ServeHTTP
	}
}

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n]
	}
	return s
}

// serveTCP handles a TCP connection redirected in SOCKS5 mode.
func (p *sandboxProxy) serveTCP(pc *pconn) {
	pol := p.policy.Load()
	if pol == nil {
		p.deny(pc, "tcp", ReasonNoEgress)
		return
	}
	now := time.Now()
	p.sb.mu.Lock()
	names := p.sb.pins.lookup(pc.dst.Addr(), now)
	p.sb.mu.Unlock()
	if len(names) > 0 {
		pc.domain = names[0]
	}
	v := p.decide(pol, pc.dst, now)
	if !v.Allowed {
		p.deny(pc, "tcp", v.Reason)
		return
	}
	if pol.Proxy == nil {
		p.deny(pc, "tcp", ReasonProxyOnly)
		return
	}
	pc.via = pol.Proxy
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	up, err := p.dial(ctx, pol, pc.dst.Addr().String(), pc.dst.Port())
	cancel()
	if err != nil {
		p.deny(pc, "tcp", upstreamReason(err))
		return
	}
	pc.up, pc.kind = up, "tcp"
	p.allow(pc, "tcp", v.Reason)
	splice(pc, up)
	p.done(pc)
}

var errForbiddenAddr = errors.New("address is always denied")

func upstreamReason(err error) string {
	if errors.Is(err, errForbiddenAddr) {
		return ReasonRebinding
	}
	return ReasonUpstream
}

// dial connects to host:port for the sandbox: through the SOCKS5 upstream when the
// policy has one, directly otherwise. A name is resolved by the node's resolvers (A
// only) and always-denied addresses are skipped; the connect itself re-checks.
func (p *sandboxProxy) dial(ctx context.Context, pol *Policy, host string, port uint16) (net.Conn, error) {
	addrs, err := p.m.resolve(ctx, host)
	if err != nil {
		return nil, err
	}
	var lastErr error = errForbiddenAddr
	for _, a := range addrs {
		target := netip.AddrPortFrom(a, port).String()
		var c net.Conn
		if pol.Proxy != nil {
			c, err = p.m.socksDial(ctx, pol.Proxy, target)
		} else {
			c, err = p.m.dialChecked(ctx, target)
		}
		if err == nil {
			return c, nil
		}
		lastErr = err
	}
	return nil, lastErr
}

// resolve returns host's IPv4 addresses that are not always denied.
func (m *Manager) resolve(ctx context.Context, host string) ([]netip.Addr, error) {
	var addrs []netip.Addr
	if a, err := netip.ParseAddr(host); err == nil {
		addrs = []netip.Addr{a.Unmap()}
	} else {
		as, _, rcode, err := m.lookupA(ctx, host)
		if err != nil {
			return nil, err
		}
		if len(as) == 0 {
			return nil, fmt.Errorf("network: %s: no address (rcode %d)", host, rcode)
		}
		addrs = as
	}
	forbidden := m.cachedForbidden()
	var ok []netip.Addr
	for _, a := range addrs {
		if a.Is4() && !forbidden.Contains(a) {
			ok = append(ok, a)
		}
	}
	if len(ok) == 0 {
		return nil, fmt.Errorf("network: %s: %w", host, errForbiddenAddr)
	}
	return ok, nil
}

// dialChecked connects from the host namespace, refusing always-denied addresses in
// the Control hook (after resolution, before connect).
func (m *Manager) dialChecked(ctx context.Context, addr string) (net.Conn, error) {
	forbidden := m.cachedForbidden()
	d := &net.Dialer{Timeout: 10 * time.Second, Control: func(network, address string, _ syscall.RawConn) error {
		ap, err := netip.ParseAddrPort(address)
		if err != nil {
			return err
		}
		if !ap.Addr().Unmap().Is4() || forbidden.Contains(ap.Addr().Unmap()) {
			return fmt.Errorf("network: %s: %w", address, errForbiddenAddr)
		}
		return nil
	}}
	return m.host.Dial(ctx, d, "tcp4", addr)
}

// socksDial connects to target through the SOCKS5 upstream, whose own address must
// not be always denied (unless the operator allows it).
func (m *Manager) socksDial(ctx context.Context, ps *ProxySpec, target string) (net.Conn, error) {
	var auth *proxy.Auth
	if ps.Username != "" {
		auth = &proxy.Auth{User: ps.Username, Password: ps.Password}
	}
	d, err := proxy.SOCKS5("tcp", ps.Address, auth, socksForward{m})
	if err != nil {
		return nil, err
	}
	c, err := d.(proxy.ContextDialer).DialContext(ctx, "tcp", target)
	if err != nil {
		return nil, fmt.Errorf("network: egress proxy %s: %w", ps.Address, err)
	}
	return c, nil
}

type socksForward struct{ m *Manager }

func (f socksForward) Dial(network, addr string) (net.Conn, error) {
	return f.DialContext(context.Background(), network, addr)
}

func (f socksForward) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, err
	}
	addrs, err := f.m.resolve(ctx, host)
	if err != nil {
		return nil, err
	}
	return f.m.dialChecked(ctx, net.JoinHostPort(addrs[0].String(), port))
}

// splice copies both ways until both directions end, half-closing as each ends.
func splice(a, b net.Conn) {
	done := make(chan struct{}, 2)
	cp := func(dst, src net.Conn) {
		_, _ = io.Copy(dst, src)
		if cw, ok := unwrapCloseWriter(dst); ok {
			_ = cw.CloseWrite()
		} else {
			_ = dst.Close()
		}
		done <- struct{}{}
	}
	go cp(a, b)
	go cp(b, a)
	<-done
	<-done
}

type closeWriter interface{ CloseWrite() error }

func unwrapCloseWriter(c net.Conn) (closeWriter, bool) {
	for {
		if cw, ok := c.(closeWriter); ok {
			return cw, true
		}
		switch v := c.(type) {
		case *pconn:
			c = v.Conn
		case *prefixConn:
			c = v.Conn
		default:
			return nil, false
		}
	}
}

// originalDst returns the destination a redirected connection was addressed to.
func originalDst(c net.Conn) (netip.AddrPort, error) {
	tc, ok := c.(*net.TCPConn)
	if !ok {
		return netip.AddrPort{}, errors.New("not TCP")
	}
	raw, err := tc.SyscallConn()
	if err != nil {
		return netip.AddrPort{}, err
	}
	var ap netip.AddrPort
	var serr error
	err = raw.Control(func(fd uintptr) {
		// SO_ORIGINAL_DST returns a sockaddr_in; IPv6Mreq is the usual 16-byte carrier.
		mreq, err := unix.GetsockoptIPv6Mreq(int(fd), unix.SOL_IP, 80 /* SO_ORIGINAL_DST */)
		if err != nil {
			serr = err
			return
		}
		b := mreq.Multiaddr
		ap = netip.AddrPortFrom(netip.AddrFrom4([4]byte{b[4], b[5], b[6], b[7]}), uint16(b[2])<<8|uint16(b[3]))
	})
	if err == nil {
		err = serr
	}
	return ap, err
}

// peekSNI reads the TLS ClientHello from c and returns its server name and the bytes
// read (to replay). crypto/tls parses the hello (several records, any extension
// order); the handshake is aborted right after.
func peekSNI(c net.Conn) (string, []byte, error) {
	var rec bytes.Buffer
	r := io.TeeReader(io.LimitReader(c, 64<<10), &rec)
	var sni string
	got := false
	errPeeked := errors.New("peeked")
	err := tls.Server(readOnlyConn{r: r, c: c}, &tls.Config{
		GetConfigForClient: func(h *tls.ClientHelloInfo) (*tls.Config, error) {
			sni, got = h.ServerName, true
			return nil, errPeeked
		},
	}).Handshake()
	if !got {
		return "", nil, fmt.Errorf("no TLS ClientHello: %w", err)
	}
	return sni, rec.Bytes(), nil
}

type readOnlyConn struct {
	r io.Reader
	c net.Conn
}

func (c readOnlyConn) Read(b []byte) (int, error)         { return c.r.Read(b) }
func (c readOnlyConn) Write(b []byte) (int, error)        { return 0, io.ErrClosedPipe }
func (c readOnlyConn) Close() error                       { return nil }
func (c readOnlyConn) LocalAddr() net.Addr                { return c.c.LocalAddr() }
func (c readOnlyConn) RemoteAddr() net.Addr               { return c.c.RemoteAddr() }
func (c readOnlyConn) SetDeadline(t time.Time) error      { return nil }
func (c readOnlyConn) SetReadDeadline(t time.Time) error  { return nil }
func (c readOnlyConn) SetWriteDeadline(t time.Time) error { return nil }

// prefixConn reads r (replayed bytes, then the connection) and writes to Conn.
type prefixConn struct {
	net.Conn
	r io.Reader
}

func (c *prefixConn) Read(b []byte) (int, error) { return c.r.Read(b) }

// chanListener hands terminated TLS connections to the HTTP server.
type chanListener struct {
	addr net.Addr
	ch   chan net.Conn
	done chan struct{}
	once sync.Once
}

func newChanListener(a net.Addr) *chanListener {
	return &chanListener{addr: a, ch: make(chan net.Conn), done: make(chan struct{})}
}

func (l *chanListener) push(c net.Conn) bool {
	select {
	case l.ch <- c:
		return true
	case <-l.done:
		return false
	}
}

func (l *chanListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.ch:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

func (l *chanListener) Close() error {
	l.once.Do(func() { close(l.done) })
	return nil
}

func (l *chanListener) Addr() net.Addr { return l.addr }
