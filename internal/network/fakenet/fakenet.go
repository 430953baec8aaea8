// Package fakenet builds a small fake internet for network tests: two network
// namespaces, "host" (what a node's own namespace would be: it holds the uplink) and
// "internet" (the far side of the uplink), with servers on test-only addresses:
//
//	198.18.1.53:53        DNS (UDP and TCP) answering the zone the test sets
//	198.18.1.54:53, :853  another resolver (plain and DNS-over-TLS): sandboxes must not reach it
//	198.18.2.10           web: HTTP :80, HTTPS :443, TCP and UDP echo :7, raw IP protocol 253
//	198.18.2.20           a second web server (same services)
//	198.18.3.80:1080      SOCKS5 (username/password)
//	169.254.169.254:80    a cloud metadata service
//	10.77.0.5:80          a private-range server
//
// Nothing in it reaches any other address: the internet namespace has no route out.
// Every server records what reached it, so tests can assert that a denied packet never
// arrived (not just that the sender saw an error).
package fakenet

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"log"
	"math/big"
	"net"
	"net/http"
	"net/netip"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/miekg/dns"
	socks5 "github.com/things-go/go-socks5"
	"github.com/vishvananda/netlink"

	"github.com/spacedev/space/internal/network"
)

// Addresses of the fake internet.
var (
	HostUplinkAddr = netip.MustParseAddr("198.18.0.2")
	InternetAddr   = netip.MustParseAddr("198.18.0.1")
	DNSAddr        = netip.MustParseAddr("198.18.1.53")
	OtherDNSAddr   = netip.MustParseAddr("198.18.1.54")
	WebAddr        = netip.MustParseAddr("198.18.2.10")
	Web2Addr       = netip.MustParseAddr("198.18.2.20")
	SOCKSAddr      = netip.MustParseAddr("198.18.3.80")
	MetadataAddr   = netip.MustParseAddr("169.254.169.254")
	PrivateAddr    = netip.MustParseAddr("10.77.0.5")
)

// SOCKS5 credentials of the fake proxy.
const (
	SOCKSUser     = "egress"
	SOCKSPassword = "s3cret-proxy-pass"
	SOCKSPort     = 1080
	Uplink        = "up0"
	RawProto      = 253
)

// Net is a running fake internet.
type Net struct {
	HostNS     string // path of the host namespace pin
	InternetNS string // path of the internet namespace pin
	// Roots trusts the fake internet's HTTPS servers.
	Roots *x509.CertPool
	// CAPEM is Roots' certificate.
	CAPEM []byte

	host, inet *network.NS
	leaf       *tls.Certificate
	closers    []func()

	mu      sync.Mutex
	zone    map[string][]zoneAnswer // name → answers in turn (the last repeats)
	asked   map[string]int
	queries []string // names asked (normalised, no trailing dot), both resolvers
	reqs    []Request
	hits    map[string]int // "udp 198.18.2.10:7", "raw 198.18.2.10", "tcp 198.18.2.10:7", "socks …"
	socks   []string       // destinations the SOCKS5 server connected to
}

type zoneAnswer struct {
	addrs []netip.Addr
	ttl   uint32
}

// Request is what a web server received.
type Request struct {
	Server string // "198.18.2.10:443"
	Host   string
	Path   string
	Header http.Header
}

// New builds the fake internet with its namespaces pinned in dir. Close tears it
// down.
func New(dir string) (n *Net, err error) {
	n = &Net{
		HostNS: filepath.Join(dir, "fakenet-host"), InternetNS: filepath.Join(dir, "fakenet-internet"),
		zone: map[string][]zoneAnswer{}, asked: map[string]int{}, hits: map[string]int{},
	}
	defer func() {
		if err != nil {
			n.Close()
		}
	}()
	for _, p := range []string{n.HostNS, n.InternetNS} {
		if err := network.CreateNamedNS(p); err != nil {
			return nil, err
		}
		p := p
		n.closers = append(n.closers, func() { _ = network.RemoveNamedNS(p) })
	}
	if n.host, err = network.OpenNS(n.HostNS); err != nil {
		return nil, err
	}
	if n.inet, err = network.OpenNS(n.InternetNS); err != nil {
		return nil, err
	}
	n.closers = append(n.closers, func() { n.host.Close(); n.inet.Close() })
	if err := n.wire(); err != nil {
		return nil, fmt.Errorf("fakenet: wire: %w", err)
	}
	if err := n.makeCA(); err != nil {
		return nil, err
	}
	if err := n.serve(); err != nil {
		return nil, fmt.Errorf("fakenet: serve: %w", err)
	}
	return n, nil
}

// Close stops the servers and removes the namespaces.
func (n *Net) Close() {
	for i := len(n.closers) - 1; i >= 0; i-- {
		n.closers[i]()
	}
	n.closers = nil
}

// Host returns the host namespace.
func (n *Net) Host() *network.NS { return n.host }

// Internet returns the internet namespace.
func (n *Net) Internet() *network.NS { return n.inet }

func handleIn(ns *network.NS) (*netlink.Handle, error) {
	var h *netlink.Handle
	err := ns.Do(func() error {
		var err error
		h, err = netlink.NewHandle()
		return err
	})
	return h, err
}

func (n *Net) wire() error {
	hh, err := handleIn(n.host)
	if err != nil {
		return err
	}
	defer hh.Close()
	ih, err := handleIn(n.inet)
	if err != nil {
		return err
	}
	defer ih.Close()
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: Uplink, MTU: 1500}, PeerName: "inet0",
		PeerNamespace: netlink.NsFd(n.inet.FD())}
	if err := hh.LinkAdd(veth); err != nil {
		return fmt.Errorf("veth: %w", err)
	}
	addr := func(h *netlink.Handle, link, cidr string) error {
		l, err := h.LinkByName(link)
		if err != nil {
			return err
		}
		a, err := netlink.ParseAddr(cidr)
		if err != nil {
			return err
		}
		if err := h.AddrAdd(l, a); err != nil {
			return fmt.Errorf("addr %s on %s: %w", cidr, link, err)
		}
		return h.LinkSetUp(l)
	}
	for _, s := range []struct {
		h          *netlink.Handle
		link, cidr string
	}{
		{hh, Uplink, HostUplinkAddr.String() + "/30"},
		{ih, "inet0", InternetAddr.String() + "/30"},
		{ih, "lo", DNSAddr.String() + "/32"},
		{ih, "lo", OtherDNSAddr.String() + "/32"},
		{ih, "lo", WebAddr.String() + "/32"},
		{ih, "lo", Web2Addr.String() + "/32"},
		{ih, "lo", SOCKSAddr.String() + "/32"},
		{ih, "lo", MetadataAddr.String() + "/32"},
		{ih, "lo", PrivateAddr.String() + "/32"},
	} {
		if err := addr(s.h, s.link, s.cidr); err != nil {
			return err
		}
	}
	if lo, err := hh.LinkByName("lo"); err == nil {
		_ = hh.LinkSetUp(lo)
	}
	up, err := hh.LinkByName(Uplink)
	if err != nil {
		return err
	}
	// Default route over the uplink; metadata too, as on a cloud VM.
	if err := hh.RouteAdd(&netlink.Route{LinkIndex: up.Attrs().Index, Gw: InternetAddr.AsSlice()}); err != nil {
		return fmt.Errorf("default route: %w", err)
	}
	_, md, _ := net.ParseCIDR(MetadataAddr.String() + "/32")
	if err := hh.RouteAdd(&netlink.Route{LinkIndex: up.Attrs().Index, Dst: md, Gw: InternetAddr.AsSlice()}); err != nil {
		return fmt.Errorf("metadata route: %w", err)
	}
	// The internet answers the host's uplink only (sandboxes are masqueraded).
	return nil
}

// makeCA makes the CA of the fake internet's HTTPS servers.
func (n *Net) makeCA() error {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "fakenet root"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return err
	}
	ca, _ := x509.ParseCertificate(der)
	n.Roots = x509.NewCertPool()
	n.Roots.AddCert(ca)
	n.CAPEM = pemCert(der)
	lkey, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	leafT := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "fakenet"},
		// Any name under .test, and the servers' addresses.
		DNSNames:    []string{"*.example.test", "example.test", "*.allowed.test", "allowed.test", "*.other.test", "other.test", "dns.test"},
		IPAddresses: []net.IP{WebAddr.AsSlice(), Web2Addr.AsSlice(), OtherDNSAddr.AsSlice()},
		NotBefore:   time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	lder, err := x509.CreateCertificate(rand.Reader, leafT, ca, &lkey.PublicKey, key)
	if err != nil {
		return err
	}
	n.leaf = &tls.Certificate{Certificate: [][]byte{lder, der}, PrivateKey: lkey}
	return nil
}

// SetA makes the DNS server answer name with addrs (TTL ttl). Several calls for one
// name queue answers: the first query gets the first, …, the last repeats (DNS
// rebinding). No addrs: NXDOMAIN.
func (n *Net) SetA(name string, ttl uint32, addrs ...netip.Addr) {
	n.mu.Lock()
	defer n.mu.Unlock()
	k := strings.ToLower(strings.TrimSuffix(name, "."))
	n.zone[k] = append(n.zone[k], zoneAnswer{addrs: addrs, ttl: ttl})
}

// Queries returns the names the resolvers of the fake internet were asked.
func (n *Net) Queries() []string {
	n.mu.Lock()
	defer n.mu.Unlock()
	return append([]string(nil), n.queries...)
}

// Requests returns what the web servers received.
func (n *Net) Requests() []Request {
	n.mu.Lock()
	defer n.mu.Unlock()
	return append([]Request(nil), n.reqs...)
}

// Hits returns how often something reached key ("udp 198.18.2.10:7", "raw 198.18.2.10",
// "tcp 198.18.2.10:7", "http 169.254.169.254:80", …).
func (n *Net) Hits(key string) int {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.hits[key]
}

// SOCKSConnects returns the destinations the SOCKS5 server connected to.
func (n *Net) SOCKSConnects() []string {
	n.mu.Lock()
	defer n.mu.Unlock()
	return append([]string(nil), n.socks...)
}

func (n *Net) hit(key string) {
	n.mu.Lock()
	n.hits[key]++
	n.mu.Unlock()
}

func (n *Net) serve() error {
	// DNS.
	for _, a := range []netip.Addr{DNSAddr, OtherDNSAddr} {
		ap := netip.AddrPortFrom(a, 53).String()
		pc, err := n.inet.ListenPacket("udp4", ap)
		if err != nil {
			return err
		}
		l, err := n.inet.Listen("tcp4", ap)
		if err != nil {
			return err
		}
		server := a.String()
		h := dns.HandlerFunc(func(w dns.ResponseWriter, r *dns.Msg) { n.answer(server, w, r) })
		for _, s := range []*dns.Server{{PacketConn: pc, Handler: h}, {Listener: l, Handler: h}} {
			go func() { _ = s.ActivateAndServe() }()
			n.closers = append(n.closers, func() { _ = s.Shutdown() })
		}
	}
	// DNS over TLS on the other resolver.
	dot, err := n.inet.Listen("tcp4", netip.AddrPortFrom(OtherDNSAddr, 853).String())
	if err != nil {
		return err
	}
	dotS := &dns.Server{Listener: tls.NewListener(dot, &tls.Config{Certificates: []tls.Certificate{*n.leaf}}), Net: "tcp-tls",
		Handler: dns.HandlerFunc(func(w dns.ResponseWriter, r *dns.Msg) { n.answer("dot", w, r) })}
	go func() { _ = dotS.ActivateAndServe() }()
	n.closers = append(n.closers, func() { _ = dotS.Shutdown() })

	// Web servers, echo services, raw protocol receivers.
	for _, a := range []netip.Addr{WebAddr, Web2Addr} {
		if err := n.serveHTTP(netip.AddrPortFrom(a, 80), false); err != nil {
			return err
		}
		if err := n.serveHTTP(netip.AddrPortFrom(a, 443), true); err != nil {
			return err
		}
		if err := n.serveEcho(netip.AddrPortFrom(a, 7)); err != nil {
			return err
		}
		if err := n.serveRaw(a); err != nil {
			return err
		}
	}
	for _, ap := range []netip.AddrPort{netip.AddrPortFrom(MetadataAddr, 80), netip.AddrPortFrom(PrivateAddr, 80)} {
		if err := n.serveHTTP(ap, false); err != nil {
			return err
		}
	}
	return n.serveSOCKS()
}

func (n *Net) answer(server string, w dns.ResponseWriter, r *dns.Msg) {
	m := new(dns.Msg)
	m.SetReply(r)
	defer func() { _ = w.WriteMsg(m) }()
	if len(r.Question) != 1 {
		m.Rcode = dns.RcodeFormatError
		return
	}
	q := r.Question[0]
	name := strings.ToLower(strings.TrimSuffix(q.Name, "."))
	n.mu.Lock()
	n.queries = append(n.queries, name)
	n.hits["dns "+server]++
	answers := n.zone[name]
	var ans zoneAnswer
	found := len(answers) > 0
	if found {
		i := min(n.asked[name], len(answers)-1)
		n.asked[name]++
		ans = answers[i]
	}
	n.mu.Unlock()
	if server != DNSAddr.String() {
		// The other resolvers answer anything (what an attacker's resolver would do).
		m.Answer = append(m.Answer, &dns.A{Hdr: dns.RR_Header{Name: q.Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 60}, A: WebAddr.AsSlice()})
		return
	}
	if !found || len(ans.addrs) == 0 {
		m.Rcode = dns.RcodeNameError
		return
	}
	if q.Qtype != dns.TypeA {
		return
	}
	for _, a := range ans.addrs {
		m.Answer = append(m.Answer, &dns.A{Hdr: dns.RR_Header{Name: q.Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: ans.ttl}, A: a.AsSlice()})
	}
}

func (n *Net) serveHTTP(ap netip.AddrPort, useTLS bool) error {
	l, err := n.inet.Listen("tcp4", ap.String())
	if err != nil {
		return err
	}
	if useTLS {
		l = tls.NewListener(l, &tls.Config{Certificates: []tls.Certificate{*n.leaf}})
	}
	server := ap.String()
	mux := http.NewServeMux()
	mux.HandleFunc("/stream", func(w http.ResponseWriter, r *http.Request) {
		// A byte every 20 ms for at most 30 s (bounded).
		n.record(server, r)
		fl, _ := w.(http.Flusher)
		for i := 0; i < 1500; i++ {
			if _, err := w.Write([]byte("x")); err != nil {
				return
			}
			if fl != nil {
				fl.Flush()
			}
			select {
			case <-r.Context().Done():
				return
			case <-time.After(20 * time.Millisecond):
			}
		}
	})
	mux.HandleFunc("/bytes/{n}", func(w http.ResponseWriter, r *http.Request) {
		// n bytes of zeros (at most 1 GiB): throughput benchmarks.
		size, err := strconv.ParseInt(r.PathValue("n"), 10, 64)
		if err != nil || size < 0 || size > 1<<30 {
			http.Error(w, "bad size", http.StatusBadRequest)
			return
		}
		n.record(server, r)
		w.Header().Set("Content-Length", strconv.FormatInt(size, 10))
		buf := make([]byte, 64<<10)
		for size > 0 {
			k := min(size, int64(len(buf)))
			if _, err := w.Write(buf[:k]); err != nil {
				return
			}
			size -= k
		}
	})
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		n.record(server, r)
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(map[string]any{"server": server, "host": r.Host, "path": r.URL.Path, "header": r.Header})
	})
	s := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = s.Serve(l) }()
	n.closers = append(n.closers, func() { _ = s.Close() })
	return nil
}

func (n *Net) record(server string, r *http.Request) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.reqs = append(n.reqs, Request{Server: server, Host: r.Host, Path: r.URL.Path, Header: r.Header.Clone()})
	n.hits["http "+server]++
}

func (n *Net) serveEcho(ap netip.AddrPort) error {
	l, err := n.inet.Listen("tcp4", ap.String())
	if err != nil {
		return err
	}
	pc, err := n.inet.ListenPacket("udp4", ap.String())
	if err != nil {
		l.Close()
		return err
	}
	n.closers = append(n.closers, func() { l.Close(); pc.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			n.hit("tcp " + ap.String())
			go func() {
				defer c.Close()
				_ = c.SetDeadline(time.Now().Add(60 * time.Second))
				_, _ = io.Copy(c, c)
			}()
		}
	}()
	go func() {
		buf := make([]byte, 65536)
		for {
			k, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			n.hit("udp " + ap.String())
			n.hit(fmt.Sprintf("udp %s len=%d", ap, k))
			_, _ = pc.WriteTo(buf[:k], from)
		}
	}()
	return nil
}

func (n *Net) serveRaw(a netip.Addr) error {
	pc, err := n.inet.ListenPacket("ip4:"+strconv.Itoa(RawProto), a.String())
	if err != nil {
		return err
	}
	n.closers = append(n.closers, func() { pc.Close() })
	go func() {
		buf := make([]byte, 65536)
		for {
			if _, _, err := pc.ReadFrom(buf); err != nil {
				return
			}
			n.hit("raw " + a.String())
		}
	}()
	return nil
}

func (n *Net) serveSOCKS() error {
	l, err := n.inet.Listen("tcp4", netip.AddrPortFrom(SOCKSAddr, SOCKSPort).String())
	if err != nil {
		return err
	}
	srv := socks5.NewServer(
		socks5.WithAuthMethods([]socks5.Authenticator{socks5.UserPassAuthenticator{
			Credentials: socks5.StaticCredentials{SOCKSUser: SOCKSPassword}}}),
		socks5.WithDial(func(ctx context.Context, network, addr string) (net.Conn, error) {
			n.mu.Lock()
			n.socks = append(n.socks, addr)
			n.mu.Unlock()
			return n.inet.Dial(ctx, &net.Dialer{Timeout: 5 * time.Second}, network, addr)
		}),
		socks5.WithLogger(socks5.NewLogger(log.New(io.Discard, "", 0))),
	)
	go func() { _ = srv.Serve(l) }()
	n.closers = append(n.closers, func() { l.Close() })
	return nil
}

// ErrNotReached is what probes report when nothing came back.
var ErrNotReached = errors.New("not reached")

func pemCert(der []byte) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
}
