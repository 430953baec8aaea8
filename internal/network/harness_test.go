package network_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/network"
	"github.com/spacedev/space/internal/network/fakenet"
	"github.com/spacedev/space/internal/testenv"
)

// probeEnv makes the test binary a probe: a plain process started inside a sandbox's
// namespace (see runProbe).
const probeEnv = "SPACE_NETPROBE"

func TestMain(m *testing.M) {
	if spec := os.Getenv(probeEnv); spec != "" {
		os.Exit(probeMain(spec))
	}
	os.Exit(m.Run())
}

// env is one fake internet with a Manager whose host is the fake host namespace.
type env struct {
	t   *testing.T
	fn  *fakenet.Net
	m   *network.Manager
	dir string
	cfg network.Config
}

func newEnv(t *testing.T, mod ...func(*network.Config)) *env {
	t.Helper()
	testenv.RequireRoot(t)
	dir := t.TempDir()
	fn, err := fakenet.New(dir)
	if err != nil {
		t.Fatalf("fakenet: %v", err)
	}
	t.Cleanup(fn.Close)
	// The zone every test can use.
	fn.SetA("api.example.test", 300, fakenet.WebAddr)
	fn.SetA("www.allowed.test", 300, fakenet.WebAddr)
	fn.SetA("other.test", 300, fakenet.Web2Addr)
	fn.SetA("evil.other.test", 300, fakenet.Web2Addr)
	fn.SetA("metadata.other.test", 300, fakenet.MetadataAddr)
	fn.SetA("private.allowed.test", 300, fakenet.PrivateAddr)
	cfg := network.Config{
		Logger:        slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelInfo})),
		HostNetns:     fn.HostNS,
		NetnsDir:      filepath.Join(dir, "ns"),
		Upstreams:     []string{fakenet.DNSAddr.String() + ":53"},
		UpstreamRoots: fn.Roots,
		Uplink:        fakenet.Uplink,
	}
	for _, f := range mod {
		f(&cfg)
	}
	m, err := network.New(context.Background(), cfg)
	if err != nil {
		t.Fatalf("network.New: %v", err)
	}
	t.Cleanup(func() { m.Close() })
	return &env{t: t, fn: fn, m: m, dir: dir, cfg: cfg}
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// sbx is a sandbox's network as seen from inside it.
type sbx struct {
	e   *env
	id  string
	att *network.Attachment
	ns  *network.NS
}

func (e *env) sandbox(id string, spec *api.Network) *sbx {
	e.t.Helper()
	att, err := e.m.Setup(context.Background(), id, spec)
	if err != nil {
		e.t.Fatalf("Setup(%s): %v", id, err)
	}
	ns, err := network.OpenNS(att.Netns)
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() {
		ns.Close()
		if err := e.m.Teardown(context.Background(), id); err != nil {
			e.t.Errorf("Teardown(%s): %v", id, err)
		}
	})
	return &sbx{e: e, id: id, att: att, ns: ns}
}

func (s *sbx) update(spec *api.Network) {
	s.e.t.Helper()
	if err := s.e.m.Update(context.Background(), s.id, spec); err != nil {
		s.e.t.Fatalf("Update: %v", err)
	}
}

// dial connects from inside the sandbox.
func (s *sbx) dial(network, addr string, timeout time.Duration) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	return s.ns.Dial(ctx, &net.Dialer{}, network, addr)
}

// tcpEcho connects to addr (an echo service) and checks one round trip.
func (s *sbx) tcpEcho(addr string) error {
	c, err := s.dial("tcp4", addr, 2*time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(2 * time.Second))
	if _, err := c.Write([]byte("ping\n")); err != nil {
		return err
	}
	buf := make([]byte, 5)
	if _, err := io.ReadFull(c, buf); err != nil {
		return err
	}
	return nil
}

// udpEcho sends one datagram of size n to addr and waits for the echo.
func (s *sbx) udpEcho(addr string, n int) error {
	c, err := s.dial("udp4", addr, 2*time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(1500 * time.Millisecond))
	if _, err := c.Write(bytes.Repeat([]byte("u"), n)); err != nil {
		return err
	}
	buf := make([]byte, n+1)
	k, err := c.Read(buf)
	if err != nil {
		return err
	}
	if k != n {
		return fmt.Errorf("echo of %d bytes, want %d", k, n)
	}
	return nil
}

// query asks server (ip:port) about name over network ("udp" or "tcp").
func (s *sbx) query(server, network, name string, qtype uint16) (*dns.Msg, error) {
	c, err := s.dial(network+"4", server, 2*time.Second)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	q := new(dns.Msg)
	q.SetQuestion(dns.Fqdn(name), qtype)
	cl := &dns.Client{Net: network, Timeout: 2 * time.Second}
	r, _, err := cl.ExchangeWithConn(q, &dns.Conn{Conn: c})
	return r, err
}

func (s *sbx) resolver() string { return s.att.Gateway.String() + ":53" }

// lookup resolves name through the sandbox's resolver; it fails unless NOERROR.
func (s *sbx) lookup(name string) ([]netip.Addr, error) {
	r, err := s.query(s.resolver(), "udp", name, dns.TypeA)
	if err != nil {
		return nil, err
	}
	if r.Rcode != dns.RcodeSuccess {
		return nil, fmt.Errorf("rcode %s", dns.RcodeToString[r.Rcode])
	}
	var out []netip.Addr
	for _, rr := range r.Answer {
		if a, ok := rr.(*dns.A); ok {
			ip, _ := netip.AddrFromSlice(a.A)
			out = append(out, ip.Unmap())
		}
	}
	return out, nil
}

// httpClient makes requests from inside the sandbox, resolving names through the
// sandbox's resolver and trusting roots (nil: the fake internet's and the node CA).
func (s *sbx) httpClient(roots *x509.CertPool) *http.Client {
	if roots == nil {
		roots = s.e.fn.Roots.Clone()
		roots.AppendCertsFromPEM(s.e.m.CACertPEM())
	}
	return &http.Client{
		Timeout: 5 * time.Second,
		Transport: &http.Transport{
			DisableKeepAlives: true,
			TLSClientConfig:   &tls.Config{RootCAs: roots},
			DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
				host, port, err := net.SplitHostPort(addr)
				if err != nil {
					return nil, err
				}
				if _, err := netip.ParseAddr(host); err != nil {
					as, err := s.lookup(host)
					if err != nil {
						return nil, fmt.Errorf("resolve %s: %w", host, err)
					}
					if len(as) == 0 {
						return nil, fmt.Errorf("resolve %s: no address", host)
					}
					host = as[0].String()
				}
				return s.ns.Dial(ctx, &net.Dialer{}, "tcp4", net.JoinHostPort(host, port))
			},
		},
	}
}

// echoResp is the fake web servers' answer.
type echoResp struct {
	Server string      `json:"server"`
	Host   string      `json:"host"`
	Header http.Header `json:"header"`
}

func (s *sbx) get(url string, hdr map[string]string) (*echoResp, int, error) {
	req, _ := http.NewRequest("GET", url, nil)
	for k, v := range hdr {
		if k == "Host" {
			req.Host = v
		} else {
			req.Header.Set(k, v)
		}
	}
	resp, err := s.httpClient(nil).Do(req)
	if err != nil {
		return nil, 0, err
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	var r echoResp
	if resp.StatusCode == 200 {
		if err := json.Unmarshal(body, &r); err != nil {
			return nil, resp.StatusCode, fmt.Errorf("body %q: %w", body, err)
		}
	}
	return &r, resp.StatusCode, nil
}

// events returns the sandbox's audit events so far.
func (s *sbx) events() []api.NetworkEvent {
	j, err := s.e.m.Events(s.id)
	if err != nil {
		s.e.t.Fatal(err)
	}
	evs, _ := j.Read(0, 100000)
	return evs
}

// waitEvent waits (up to 5 s) for an audit event matching f.
func (s *sbx) waitEvent(what string, f func(api.NetworkEvent) bool) api.NetworkEvent {
	s.e.t.Helper()
	j, err := s.e.m.Events(s.id)
	if err != nil {
		s.e.t.Fatal(err)
	}
	deadline := time.After(5 * time.Second)
	from := int64(0)
	for {
		ch := j.Changed()
		evs, _ := j.Read(from, 1000)
		for _, ev := range evs {
			if f(ev) {
				return ev
			}
			from = ev.Offset + 1
		}
		select {
		case <-ch:
		case <-deadline:
			s.e.t.Fatalf("no audit event %s; have %s", what, dumpEvents(s.events()))
			return api.NetworkEvent{}
		}
	}
}

func dumpEvents(evs []api.NetworkEvent) string {
	var b strings.Builder
	for _, e := range evs {
		fmt.Fprintf(&b, "\n  %d %s %s %s %s %s %s out=%d in=%d", e.Offset, e.Kind, e.Verdict, e.Reason, e.Protocol, e.Destination, e.Domain, e.BytesOut, e.BytesIn)
	}
	return b.String()
}

func mustFail(t *testing.T, what string, err error) {
	t.Helper()
	if err == nil {
		t.Fatalf("%s: succeeded, want it denied", what)
	}
	t.Logf("%s: denied as expected: %v", what, err)
}

func mustOK(t *testing.T, what string, err error) {
	t.Helper()
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}

// runProbe runs the test binary as a plain process inside the sandbox's namespace
// (started from a thread in it: the child inherits the thread's namespace) with one
// probe, and returns its output.
func (s *sbx) runProbe(p probe) (string, error) {
	spec, _ := json.Marshal(p)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), probeEnv+"="+string(spec))
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := s.ns.Do(cmd.Start); err != nil {
		return "", err
	}
	err := cmd.Wait()
	return strings.TrimSpace(out.String()), err
}

// probe is what a probe process does.
type probe struct {
	Op       string `json:"op"` // "http"
	URL      string `json:"url"`
	Resolver string `json:"resolver"`
	CAPEM    []byte `json:"ca_pem"`
}

// probeMain runs a probe: a plain client in the sandbox's namespace that resolves
// through the given resolver (as the sandbox's resolv.conf would say) and prints
// "status <code> <body>" or "error <err>".
func probeMain(spec string) int {
	var p probe
	if err := json.Unmarshal([]byte(spec), &p); err != nil {
		fmt.Println("error", err)
		return 2
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(p.CAPEM)
	r := &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, network, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, network, p.Resolver)
	}}
	cl := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{
		TLSClientConfig: &tls.Config{RootCAs: roots},
		DialContext:     (&net.Dialer{Resolver: r}).DialContext,
	}}
	resp, err := cl.Get(p.URL)
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<16))
	fmt.Println("status", resp.StatusCode, string(b))
	return 0
}

var errDenied = errors.New("denied")
