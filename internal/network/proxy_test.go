package network_test

import (
	"bufio"
	"context"
	"crypto/tls"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/network"
	"github.com/spacedev/space/internal/network/fakenet"
)

const secret = "Bearer sk-live-0123456789"

func headerSpec() *api.Network {
	return &api.Network{
		Egress:   true,
		AllowOut: []string{"api.example.test", "www.allowed.test"},
		DenyOut:  denyAll,
		Rules: map[string][]api.NetworkRule{
			"api.example.test": {{Transform: &api.NetworkTransform{Headers: map[string]string{"Authorization": secret, "X-Space-Rule": "1"}}}},
		},
	}
}

// lastRequest returns the newest request the fake internet saw for path.
func lastRequest(t *testing.T, e *env, path string) fakenet.Request {
	t.Helper()
	reqs := e.fn.Requests()
	for i := len(reqs) - 1; i >= 0; i-- {
		if reqs[i].Path == path {
			return reqs[i]
		}
	}
	t.Fatalf("no request for %s reached the fake internet", path)
	return fakenet.Request{}
}

func TestHeaderRuleInjectsHeader(t *testing.T) {
	e := newEnv(t)
	s := e.sandbox("hdr1", headerSpec())
	if len(s.att.CACertPEM) == 0 {
		t.Fatal("Setup with header rules returned no CA certificate")
	}
	_, code, err := s.get("https://api.example.test/v1/models", map[string]string{"Authorization": "Bearer from-the-sandbox"})
	mustOK(t, "HTTPS to the header-rule domain", err)
	if code != 200 {
		t.Fatalf("status %d", code)
	}
	r := lastRequest(t, e, "/v1/models")
	if got := r.Header.Get("Authorization"); got != secret || r.Header.Get("X-Space-Rule") != "1" {
		t.Fatalf("upstream saw Authorization %q, X-Space-Rule %q", got, r.Header.Get("X-Space-Rule"))
	}
	if r.Server != web+":443" || r.Host != "api.example.test" {
		t.Fatalf("request went to %s Host %s", r.Server, r.Host)
	}

	// Another allowed domain on the same address: passed through untouched (the
	// sandbox sees the real server's certificate, no header is added).
	_, err = s.lookup("www.allowed.test")
	mustOK(t, "lookup", err)
	resp, err := s.httpClient(e.fn.Roots).Get("https://www.allowed.test/plain")
	mustOK(t, "pass-through HTTPS with the real roots only", err)
	resp.Body.Close()
	if h := lastRequest(t, e, "/plain").Header.Get("Authorization"); h != "" {
		t.Fatalf("a header rule leaked to another domain: %q", h)
	}

	// Plain HTTP to the rule domain is not intercepted: the secret never travels in
	// clear text.
	_, code, err = s.get("http://api.example.test/cleartext", nil)
	mustOK(t, "plain HTTP", err)
	if h := lastRequest(t, e, "/cleartext").Header.Get("Authorization"); h != "" || code != 200 {
		t.Fatalf("plain HTTP got Authorization %q (status %d)", h, code)
	}

	// A plain process in the sandbox's namespace, with the CA installed, gets the same.
	out, err := s.runProbe(probe{Op: "http", URL: "https://api.example.test/probe", Resolver: s.resolver(), CAPEM: s.att.CACertPEM})
	mustOK(t, "probe process: "+out, err)
	if !strings.HasPrefix(out, "status 200") {
		t.Fatalf("probe: %s", out)
	}
	if h := lastRequest(t, e, "/probe").Header.Get("Authorization"); h != secret {
		t.Fatalf("probe request carried %q", h)
	}

	// The sandbox's own trust store without the node CA: verification fails (the
	// proxy cannot be silently in the middle).
	_, err = s.httpClient(e.fn.Roots).Get("https://api.example.test/untrusted")
	mustFail(t, "terminated TLS without the node CA", err)

	ev := s.waitEvent("https close", func(ev api.NetworkEvent) bool {
		return ev.Kind == api.NetEventClose && ev.Protocol == "https" && ev.Domain == "api.example.test"
	})
	if ev.BytesIn == 0 || ev.BytesOut == 0 {
		t.Fatalf("close event without bytes: %+v", ev)
	}
}

func TestHostSNIMismatchRefused(t *testing.T) {
	e := newEnv(t)
	s := e.sandbox("sni1", headerSpec())
	// Host header naming another domain on a connection whose SNI is the rule domain.
	_, code, err := s.get("https://api.example.test/fronted", map[string]string{"Host": "other.test"})
	mustOK(t, "request", err)
	if code != http.StatusMisdirectedRequest {
		t.Fatalf("Host other.test on SNI api.example.test: status %d, want 421", code)
	}
	// Absolute-form request target naming another host.
	tc := s.tlsDial(t, web+":443", "api.example.test")
	_, _ = io.WriteString(tc, "GET https://other.test/abs HTTP/1.1\r\nHost: api.example.test\r\n\r\n")
	resp, err := http.ReadResponse(bufio.NewReader(tc), nil)
	mustOK(t, "absolute-form", err)
	if resp.StatusCode != http.StatusMisdirectedRequest {
		t.Fatalf("absolute-form to other.test: status %d", resp.StatusCode)
	}
	tc.Close()
	// CONNECT through the terminated connection.
	tc = s.tlsDial(t, web+":443", "api.example.test")
	_, _ = io.WriteString(tc, "CONNECT other.test:443 HTTP/1.1\r\nHost: api.example.test\r\n\r\n")
	resp, err = http.ReadResponse(bufio.NewReader(tc), nil)
	mustOK(t, "CONNECT", err)
	if resp.StatusCode < 400 {
		t.Fatalf("CONNECT: status %d", resp.StatusCode)
	}
	tc.Close()
	for _, r := range e.fn.Requests() {
		if r.Host != "api.example.test" {
			t.Fatalf("a request for %q reached %s", r.Host, r.Server)
		}
	}
	// SNI of a name that is not allowed, to the intercepted address.
	_, err = s.tlsHandshake(web+":443", "evil.other.test")
	mustFail(t, "SNI of a non-allowed name", err)
	// No SNI at all.
	_, err = s.tlsHandshake(web+":443", "")
	mustFail(t, "no SNI", err)
	s.waitEvent("sni_mismatch", func(ev api.NetworkEvent) bool { return ev.Reason == "sni_mismatch" })
	s.waitEvent("sni not allowed", func(ev api.NetworkEvent) bool {
		return ev.Reason == "not_allowed" && ev.Domain == "evil.other.test"
	})
	s.waitEvent("no sni", func(ev api.NetworkEvent) bool { return ev.Reason == "no_sni" })
}

// tlsDial resolves api.example.test (pinning it) and opens TLS to addr with sni,
// trusting the node CA.
func (s *sbx) tlsDial(t *testing.T, addr, sni string) *tls.Conn {
	t.Helper()
	c, err := s.tlsHandshake(addr, sni)
	if err != nil {
		t.Fatalf("TLS to %s (SNI %q): %v", addr, sni, err)
	}
	return c
}

func (s *sbx) tlsHandshake(addr, sni string) (*tls.Conn, error) {
	if _, err := s.lookup("api.example.test"); err != nil {
		return nil, err
	}
	c, err := s.dial("tcp4", addr, 2*time.Second)
	if err != nil {
		return nil, err
	}
	roots := s.e.fn.Roots.Clone()
	roots.AppendCertsFromPEM(s.e.m.CACertPEM())
	tc := tls.Client(c, &tls.Config{ServerName: sni, RootCAs: roots, InsecureSkipVerify: sni == ""})
	_ = tc.SetDeadline(time.Now().Add(3 * time.Second))
	if err := tc.Handshake(); err != nil {
		c.Close()
		return nil, err
	}
	_ = tc.SetDeadline(time.Time{})
	return tc, nil
}

func TestSOCKS5Upstream(t *testing.T) {
	e := newEnv(t)
	proxy := &api.EgressProxy{Address: fakenet.SOCKSAddr.String() + ":1080", Username: fakenet.SOCKSUser, Password: fakenet.SOCKSPassword}
	s := e.sandbox("socks1", &api.Network{Egress: true, EgressProxy: proxy})
	mustOK(t, "TCP through the SOCKS5 upstream", s.tcpEcho(web+echoPort))
	if !slices.Contains(e.fn.SOCKSConnects(), web+echoPort) {
		t.Fatalf("the SOCKS5 server did not carry the connection: %v", e.fn.SOCKSConnects())
	}
	// What SOCKS5 cannot carry fails closed.
	mustFail(t, "UDP with a SOCKS5 upstream", s.udpEcho(web+echoPort, 10))
	mustFail(t, "ICMP with a SOCKS5 upstream", s.ping(fakenet.WebAddr))
	// Always-denied destinations are not even handed to the proxy.
	mustFail(t, "metadata through the proxy", s.tcpEcho(fakenet.MetadataAddr.String()+":80"))
	for _, d := range e.fn.SOCKSConnects() {
		if strings.HasPrefix(d, "169.254.") {
			t.Fatalf("the proxy was asked for %s", d)
		}
	}
	// Header rules work through the proxy too.
	hs := headerSpec()
	hs.EgressProxy = proxy
	s.update(hs)
	_, code, err := s.get("https://api.example.test/via-socks", nil)
	mustOK(t, "header rule through SOCKS5", err)
	if code != 200 || lastRequest(t, e, "/via-socks").Header.Get("Authorization") != secret {
		t.Fatalf("status %d", code)
	}
	if !slices.Contains(e.fn.SOCKSConnects(), web+":443") {
		t.Fatalf("HTTPS did not go through the SOCKS5 server: %v", e.fn.SOCKSConnects())
	}

	// An open connection through the proxy is cut when the upstream changes.
	s.update(&api.Network{Egress: true, EgressProxy: proxy})
	c, err := s.dial("tcp4", web+echoPort, 2*time.Second)
	mustOK(t, "connect", err)
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(2 * time.Second))
	_, _ = c.Write([]byte("hello"))
	_, err = io.ReadFull(c, make([]byte, 5))
	mustOK(t, "round trip", err)

	// Wrong credentials: fails closed, nothing reaches the destination.
	bad := *proxy
	bad.Password = "wrong"
	s.update(&api.Network{Egress: true, EgressProxy: &bad})
	_ = c.SetDeadline(time.Now().Add(time.Second))
	_, _ = c.Write([]byte("again"))
	_, err = io.ReadFull(c, make([]byte, 5))
	mustFail(t, "connection opened through the previous upstream", err)
	before := e.fn.Hits("tcp " + web + echoPort)
	mustFail(t, "wrong SOCKS5 password", s.tcpEcho(web+echoPort))
	// An unreachable upstream fails closed; one on a private address is refused
	// before anything changes (the node would dial it from its own network).
	s.update(&api.Network{Egress: true, EgressProxy: &api.EgressProxy{Address: "198.18.3.81:1080", Username: "u", Password: "p"}})
	mustFail(t, "SOCKS5 upstream 198.18.3.81:1080", s.tcpEcho(web+echoPort))
	err = e.m.Update(context.Background(), s.id, &api.Network{Egress: true, EgressProxy: &api.EgressProxy{Address: fakenet.PrivateAddr.String() + ":1080", Username: "u", Password: "p"}})
	if !fault.Is(err, fault.Invalid) || !strings.Contains(err.Error(), "network.egress_proxy.address") {
		t.Fatalf("a SOCKS5 upstream on a private address: %v", err)
	}
	mustFail(t, "SOCKS5 upstream still 198.18.3.81:1080", s.tcpEcho(web+echoPort))
	if n := e.fn.Hits("tcp " + web + echoPort); n != before {
		t.Fatalf("the destination was reached directly (%d → %d)", before, n)
	}
	s.waitEvent("upstream failed", func(ev api.NetworkEvent) bool { return ev.Reason == "upstream_failed" })
}

var _ = context.Background

func TestProxyConnectionCap(t *testing.T) {
	e := newEnv(t, func(c *network.Config) { c.ProxyConnsPerSandbox = 2 })
	s := e.sandbox("cap1", headerSpec())
	_, err := s.lookup("api.example.test")
	mustOK(t, "lookup", err)
	// Two connections that never send a ClientHello hold the proxy's two slots.
	for i := 0; i < 2; i++ {
		c, err := s.dial("tcp4", web+":443", 2*time.Second)
		mustOK(t, "idle connection", err)
		defer c.Close()
	}
	c, err := s.dial("tcp4", web+":443", 2*time.Second)
	if err == nil {
		_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
		_, err = c.Read(make([]byte, 1))
		c.Close()
	}
	mustFail(t, "third connection over the cap", err)
	s.waitEvent("rate_limited", func(ev api.NetworkEvent) bool { return ev.Reason == "rate_limited" })
}
