package network_test

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/network"
	"github.com/spacedev/space/internal/network/fakenet"
)

var (
	web      = fakenet.WebAddr.String()
	web2     = fakenet.Web2Addr.String()
	denyAll  = []string{"0.0.0.0/0"}
	echoPort = ":7"
)

func TestSmokeOpenEgress(t *testing.T) {
	e := newEnv(t)
	start := time.Now()
	s := e.sandbox("smoke1", &api.Network{Egress: true})
	t.Logf("Setup took %v", time.Since(start))
	start = time.Now()
	s.update(&api.Network{Egress: true, DenyOut: []string{"203.0.113.0/24"}})
	t.Logf("Update took %v", time.Since(start))
	mustOK(t, "tcp echo to a public address", s.tcpEcho(web+echoPort))
	mustOK(t, "udp echo to a public address", s.udpEcho(web+echoPort, 100))
	as, err := s.lookup("other.test")
	mustOK(t, "lookup in open mode", err)
	if len(as) != 1 || as[0] != fakenet.Web2Addr {
		t.Fatalf("other.test = %v", as)
	}
}

func TestNoEgressByDefault(t *testing.T) {
	e := newEnv(t)
	s := e.sandbox("none1", nil)
	mustFail(t, "tcp with no network", s.tcpEcho(web+echoPort))
	mustFail(t, "udp with no network", s.udpEcho(web+echoPort, 10))
	_, err := s.lookup("api.example.test")
	mustFail(t, "dns with no network", err)
	if n := e.fn.Hits("tcp " + web + echoPort); n != 0 {
		t.Fatalf("echo server reached %d times", n)
	}
	if q := e.fn.Queries(); len(q) != 0 {
		t.Fatalf("upstream DNS asked %v", q)
	}
	s.waitEvent("tcp denied no_egress", func(ev api.NetworkEvent) bool {
		return ev.Verdict == api.NetDenied && ev.Reason == "no_egress" && ev.Protocol == "tcp"
	})
}

func TestNonAllowedIPDenied(t *testing.T) {
	e := newEnv(t)
	s := e.sandbox("ip1", &api.Network{Egress: true, AllowOut: []string{web + "/32"}, DenyOut: denyAll})
	mustOK(t, "allowed IP", s.tcpEcho(web+echoPort))
	mustFail(t, "non-allowed IP (tcp)", s.tcpEcho(web2+echoPort))
	mustFail(t, "non-allowed IP (udp)", s.udpEcho(web2+echoPort, 10))
	if n := e.fn.Hits("tcp " + web2 + echoPort); n != 0 {
		t.Fatalf("denied server reached %d times", n)
	}
	if n := e.fn.Hits("udp " + web2 + echoPort); n != 0 {
		t.Fatalf("denied server reached by udp %d times", n)
	}
	s.waitEvent("deny event", func(ev api.NetworkEvent) bool {
		return ev.Verdict == api.NetDenied && ev.Reason == "deny_out" && ev.Destination == web2+echoPort
	})

	// deny_out in open mode; allow beats deny.
	s2 := e.sandbox("ip2", &api.Network{Egress: true, DenyOut: []string{"198.18.2.0/24"}, AllowOut: []string{web}})
	mustOK(t, "allow beats deny", s2.tcpEcho(web+echoPort))
	mustFail(t, "deny_out", s2.tcpEcho(web2+echoPort))
	c, err := s2.dial("tcp4", fakenet.SOCKSAddr.String()+":1080", 2*time.Second)
	mustOK(t, "open mode elsewhere", err)
	c.Close()
}

func TestNonAllowedDomainDenied(t *testing.T) {
	e := newEnv(t)
	s := e.sandbox("dom1", &api.Network{Egress: true, AllowOut: []string{"api.example.test", "*.allowed.test"}, DenyOut: denyAll})
	// Before resolving, the address is not reachable: only the resolver pins it.
	mustFail(t, "allowed domain's address before resolving", s.tcpEcho(web+echoPort))
	as, err := s.lookup("api.example.test")
	mustOK(t, "lookup allowed domain", err)
	if len(as) != 1 || as[0] != fakenet.WebAddr {
		t.Fatalf("api.example.test = %v", as)
	}
	mustOK(t, "allowed domain after resolving", s.tcpEcho(web+echoPort))
	if _, err := s.lookup("www.allowed.test"); err != nil {
		t.Fatalf("wildcard: %v", err)
	}
	for _, name := range []string{"other.test", "allowed.test", "evilallowed.test", "api.example.test.other.test"} {
		_, err := s.lookup(name)
		mustFail(t, "lookup "+name, err)
	}
	mustFail(t, "non-allowed domain's address", s.tcpEcho(web2+echoPort))
	for _, q := range e.fn.Queries() {
		if !strings.HasSuffix(q, "allowed.test") && q != "api.example.test" {
			t.Fatalf("a non-allowed name reached the upstream resolver: %q", q)
		}
	}
	s.waitEvent("refused dns", func(ev api.NetworkEvent) bool {
		return ev.Kind == api.NetEventDNS && ev.Verdict == api.NetDenied && ev.Domain == "other.test"
	})
	s.waitEvent("allowed connect with domain", func(ev api.NetworkEvent) bool {
		return ev.Kind == api.NetEventConnect && ev.Verdict == api.NetAllowed && ev.Domain == "api.example.test"
	})
}

func TestDNSToOtherResolversBlocked(t *testing.T) {
	e := newEnv(t)
	s := e.sandbox("dns1", &api.Network{Egress: true}) // open: everything else is allowed
	other := fakenet.OtherDNSAddr.String()
	_, err := s.query(other+":53", "udp", "x.other.test", dns.TypeA)
	mustFail(t, "DNS over UDP 53 to another resolver", err)
	_, err = s.query(other+":53", "tcp", "x.other.test", dns.TypeA)
	mustFail(t, "DNS over TCP 53 to another resolver", err)
	_, err = s.query(fakenet.DNSAddr.String()+":53", "udp", "x.other.test", dns.TypeA)
	mustFail(t, "DNS to the node's own upstream", err)
	c, err := s.dial("tcp4", other+":853", 2*time.Second)
	if err == nil {
		tc := tls.Client(c, &tls.Config{InsecureSkipVerify: true})
		_ = tc.SetDeadline(time.Now().Add(2 * time.Second))
		err = tc.Handshake()
		c.Close()
	}
	mustFail(t, "DNS over TLS (853)", err)
	for _, k := range []string{"dns " + other, "dns dot"} {
		if n := e.fn.Hits(k); n != 0 {
			t.Fatalf("%s reached %d times", k, n)
		}
	}
	// Positive control: the sandbox's own resolver answers.
	_, err = s.lookup("other.test")
	mustOK(t, "own resolver", err)
	s.waitEvent("dns_other_resolver", func(ev api.NetworkEvent) bool {
		return ev.Reason == "dns_other_resolver" && ev.Destination == other+":853"
	})
}

func TestDNSTunnellingBounded(t *testing.T) {
	e := newEnv(t, func(c *network.Config) { c.DNSRate, c.DNSBurst = 20, 20 })
	s := e.sandbox("tun1", &api.Network{Egress: true, AllowOut: []string{"api.example.test"}, DenyOut: denyAll})
	// Data encoded in names of a domain that is not allowed never leaves the node.
	for i := 0; i < 5; i++ {
		r, err := s.query(s.resolver(), "udp", "c2VjcmV0"+string(rune('a'+i))+".exfil.other.test", dns.TypeA)
		if err != nil || r.Rcode != dns.RcodeRefused {
			t.Fatalf("exfil query: %v %v", r, err)
		}
	}
	// Other types for an allowed name are answered empty, never forwarded.
	for _, qt := range []uint16{dns.TypeTXT, dns.TypeNULL, dns.TypeMX, dns.TypeAAAA, dns.TypeCNAME} {
		r, err := s.query(s.resolver(), "tcp", "api.example.test", qt)
		if err != nil || r.Rcode != dns.RcodeSuccess || len(r.Answer) != 0 {
			t.Fatalf("%s query: %v %v", dns.TypeToString[qt], r, err)
		}
	}
	for _, q := range e.fn.Queries() {
		if q != "api.example.test" {
			t.Fatalf("upstream was asked %q", q)
		}
	}
	if len(e.fn.Queries()) != 0 {
		t.Fatalf("upstream asked %v before any A query", e.fn.Queries())
	}
	// Rate limit: a burst of queries for the allowed name is cut off.
	refused := 0
	for i := 0; i < 100; i++ {
		r, err := s.query(s.resolver(), "udp", "api.example.test", dns.TypeA)
		if err == nil && r.Rcode == dns.RcodeRefused {
			refused++
		}
	}
	if refused == 0 {
		t.Fatal("100 queries at once were all answered: no rate limit")
	}
	if up := len(e.fn.Queries()); up > 60 {
		t.Fatalf("upstream asked %d times for 100 queries", up)
	}
	t.Logf("100 queries: %d refused by the rate limit, %d reached upstream", refused, len(e.fn.Queries()))
	s.waitEvent("rate limited", func(ev api.NetworkEvent) bool { return ev.Reason == "rate_limited" })
}

func TestIPv6Denied(t *testing.T) {
	e := newEnv(t)
	s := e.sandbox("six1", &api.Network{Egress: true})
	for _, a := range []string{"[fd00:ec2::254]:80", "[2001:db8::1]:80", "[64:ff9b::a9fe:a9fe]:80"} {
		_, err := s.dial("tcp6", a, time.Second)
		mustFail(t, "IPv6 "+a, err)
	}
	// v4-mapped IPv6 is IPv4 on the wire: the metadata rule catches it.
	mustFail(t, "v4-mapped metadata", s.tcpEcho("[::ffff:169.254.169.254]:80"))
	// Root in the sandbox turning IPv6 on and routing it out: the host drops it.
	if err := s.ns.WriteSysctl("net/ipv6/conf/eth0/disable_ipv6", "0"); err != nil {
		t.Fatal(err)
	}
	if err := s.ns.Do(func() error {
		return runCmd("ip", "-6", "addr", "add", "2001:db8:1::2/64", "dev", "eth0")
	}); err != nil {
		t.Fatal(err)
	}
	_ = s.ns.Do(func() error { return runCmd("ip", "-6", "route", "add", "default", "dev", "eth0") })
	_, err := s.dial("tcp6", "[2001:db8:1::1]:80", time.Second)
	mustFail(t, "IPv6 after the sandbox turned it on", err)
	if err := e.fn.Host().Do(func() error {
		return runCmd("sh", "-c", "ip -6 addr show dev "+hostIf(t, e, s)+" | grep -q inet6 && exit 1 || exit 0")
	}); err != nil {
		t.Fatalf("the host end of the veth has an IPv6 address: %v", err)
	}
}

func TestMetadataDenied(t *testing.T) {
	e := newEnv(t)
	s := e.sandbox("meta1", &api.Network{Egress: true})
	md := fakenet.MetadataAddr.String()
	mustFail(t, "metadata over TCP", s.tcpEcho(md+":80"))
	mustFail(t, "metadata over UDP", s.udpEcho(md+":7", 10))
	mustFail(t, "metadata ping", s.ping(fakenet.MetadataAddr))
	_, err := s.lookup("metadata.other.test")
	mustFail(t, "a name resolving to metadata", err)
	if n := e.fn.Hits("http " + md + ":80"); n != 0 {
		t.Fatalf("metadata reached %d times", n)
	}
	// Positive control: the host itself reaches the metadata service (so it is the
	// sandbox's policy that stops it, not the fake internet's routing).
	c, err := e.fn.Host().Dial(context.Background(), &net.Dialer{Timeout: 2 * time.Second}, "tcp4", md+":80")
	mustOK(t, "host to metadata", err)
	c.Close()
	// A policy cannot allow it.
	_, err = e.m.Setup(context.Background(), "meta2", &api.Network{Egress: true, AllowOut: []string{"169.254.169.254"}})
	if !fault.Is(err, fault.Invalid) || !strings.Contains(err.Error(), "network.allow_out[0]") {
		t.Fatalf("allow_out metadata: %v", err)
	}
}

func TestHostNotReachable(t *testing.T) {
	e := newEnv(t)
	s := e.sandbox("host1", &api.Network{Egress: true})
	// Services on the host: on the gateway address, on the uplink address, on all
	// addresses, and on loopback.
	listen := func(addr string) string {
		l, err := e.fn.Host().Listen("tcp4", addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { l.Close() })
		go func() {
			for {
				c, err := l.Accept()
				if err != nil {
					return
				}
				_, _ = io.Copy(c, c)
				c.Close()
			}
		}()
		return l.Addr().String()
	}
	gwSvc := listen(s.att.Gateway.String() + ":0")
	upSvc := listen(fakenet.HostUplinkAddr.String() + ":0")
	anySvc := listen("0.0.0.0:0")
	_, anyPort, _ := net.SplitHostPort(anySvc)
	loSvc := listen("127.0.0.1:0")
	for _, a := range []string{gwSvc, upSvc, s.att.Gateway.String() + ":" + anyPort, fakenet.HostUplinkAddr.String() + ":" + anyPort} {
		mustFail(t, "host service "+a, s.tcpEcho(a))
	}
	// 127.0.0.1 in the sandbox is the sandbox's own loopback; the host's is unreachable.
	mustFail(t, "host loopback service", s.tcpEcho(loSvc))
	mustFail(t, "ping the gateway", s.ping(s.att.Gateway))
	// Positive control: the resolver on the gateway answers.
	_, err := s.lookup("other.test")
	mustOK(t, "resolver", err)
	s.waitEvent("host denied", func(ev api.NetworkEvent) bool { return ev.Reason == "host" })
}

func TestOtherSandboxNotReachable(t *testing.T) {
	e := newEnv(t)
	a := e.sandbox("sba", &api.Network{Egress: true})
	b := e.sandbox("sbb", &api.Network{Egress: true})
	if a.att.Address == b.att.Address || a.att.Gateway == b.att.Gateway {
		t.Fatalf("two sandboxes share addresses: %v %v", a.att, b.att)
	}
	l, err := a.ns.Listen("tcp4", "0.0.0.0:8080")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			_, _ = io.Copy(c, c)
			c.Close()
		}
	}()
	mustFail(t, "sandbox b to sandbox a", b.tcpEcho(a.att.Address.Addr().String()+":8080"))
	mustFail(t, "sandbox b to sandbox a's gateway", b.tcpEcho(a.att.Gateway.String()+":53"))
	// Spoofing a's address from b goes nowhere either.
	if err := b.ns.Do(func() error {
		return runCmd("ip", "addr", "add", a.att.Address.Addr().String()+"/32", "dev", "eth0")
	}); err != nil {
		t.Fatal(err)
	}
	c, err := b.ns.Dial(context.Background(), &net.Dialer{Timeout: time.Second,
		LocalAddr: &net.TCPAddr{IP: a.att.Address.Addr().AsSlice()}}, "tcp4", web+echoPort)
	if err == nil {
		c.Close()
	}
	mustFail(t, "spoofed source", err)
	b.waitEvent("spoofed", func(ev api.NetworkEvent) bool { return ev.Reason == "spoofed" })
	mustOK(t, "a itself is fine", a.tcpEcho(web+echoPort))
}

func TestDNSRebindingRefused(t *testing.T) {
	e := newEnv(t)
	e.fn.SetA("rebind.allowed.test", 0, fakenet.WebAddr)
	e.fn.SetA("rebind.allowed.test", 0, fakenet.PrivateAddr)
	e.fn.SetA("meta.allowed.test", 0, fakenet.WebAddr, fakenet.MetadataAddr)
	s := e.sandbox("rb1", &api.Network{Egress: true, AllowOut: []string{"*.allowed.test"}, DenyOut: denyAll})
	as, err := s.lookup("rebind.allowed.test")
	mustOK(t, "first answer (public)", err)
	if len(as) != 1 || as[0] != fakenet.WebAddr {
		t.Fatalf("first answer %v", as)
	}
	_, err = s.lookup("rebind.allowed.test")
	mustFail(t, "second answer (private)", err)
	_, err = s.lookup("meta.allowed.test")
	mustFail(t, "answer mixing public and metadata", err)
	_, err = s.lookup("private.allowed.test")
	mustFail(t, "allowed name resolving to a private address", err)
	mustFail(t, "private address", s.tcpEcho(fakenet.PrivateAddr.String()+":80"))
	if n := e.fn.Hits("http " + fakenet.PrivateAddr.String() + ":80"); n != 0 {
		t.Fatalf("private server reached %d times", n)
	}
	ev := s.waitEvent("rebinding", func(ev api.NetworkEvent) bool {
		return ev.Reason == "rebinding" && ev.Domain == "rebind.allowed.test"
	})
	if ev.Destination != fakenet.PrivateAddr.String() {
		t.Fatalf("rebinding event %+v", ev)
	}
}

func TestICMPAndRawSockets(t *testing.T) {
	e := newEnv(t)
	s := e.sandbox("icmp1", &api.Network{Egress: true, AllowOut: []string{web}, DenyOut: denyAll})
	mustOK(t, "ping allowed address", s.ping(fakenet.WebAddr))
	mustFail(t, "ping non-allowed address", s.ping(fakenet.Web2Addr))
	mustOK(t, "raw protocol to allowed address", s.raw(fakenet.WebAddr))
	mustFail(t, "raw protocol to non-allowed address", s.raw(fakenet.Web2Addr))
	if n := e.fn.Hits("raw " + web2); n != 0 {
		t.Fatalf("raw packets reached the denied address %d times", n)
	}
	// A domain allow does not open ICMP or raw protocols to its addresses.
	s2 := e.sandbox("icmp2", &api.Network{Egress: true, AllowOut: []string{"other.test"}, DenyOut: denyAll})
	_, err := s2.lookup("other.test")
	mustOK(t, "lookup", err)
	mustOK(t, "tcp to the pinned address", s2.tcpEcho(web2+echoPort))
	mustFail(t, "ping the pinned address", s2.ping(fakenet.Web2Addr))
	mustFail(t, "raw protocol to the pinned address", s2.raw(fakenet.Web2Addr))
	if n := e.fn.Hits("raw " + web2); n != 0 {
		t.Fatalf("raw packets reached the pinned address %d times", n)
	}
}

func TestFragmentedPackets(t *testing.T) {
	e := newEnv(t)
	s := e.sandbox("frag1", &api.Network{Egress: true, AllowOut: []string{web}, DenyOut: denyAll})
	// A 4000-byte datagram leaves in three fragments: reassembled and judged whole.
	mustOK(t, "fragmented UDP to allowed address", s.udpEcho(web+echoPort, 4000))
	mustFail(t, "fragmented UDP to non-allowed address", s.udpEcho(web2+echoPort, 4000))
	// Hand-made fragments: the UDP header alone in a first 8-byte fragment, to a
	// non-allowed address and to DNS on an allowed one.
	mustOK(t, "hand-made fragments to the allowed echo", s.fragUDP(fakenet.WebAddr, 7, false))
	mustFail(t, "hand-made fragments to a non-allowed address", s.fragUDP(fakenet.Web2Addr, 7, false))
	// A fragment overlapping the first (rewriting the UDP header and part of the
	// payload): the kernel drops the whole datagram.
	mustFail(t, "overlapping fragments", s.fragUDP(fakenet.WebAddr, 7, true))
	if n := e.fn.Hits("udp " + web2 + echoPort); n != 0 {
		t.Fatalf("fragments reached the denied address %d times", n)
	}
}

func TestPolicyTightenedCutsOpenConnection(t *testing.T) {
	e := newEnv(t)
	s := e.sandbox("cut1", &api.Network{Egress: true})
	c, err := s.dial("tcp4", web+echoPort, 2*time.Second)
	mustOK(t, "connect", err)
	defer c.Close()
	roundTrip := func() error {
		_ = c.SetDeadline(time.Now().Add(1500 * time.Millisecond))
		if _, err := c.Write([]byte("hello")); err != nil {
			return err
		}
		_, err := io.ReadFull(c, make([]byte, 5))
		return err
	}
	mustOK(t, "round trip before", roundTrip())
	// A long-lived UDP flow too.
	u, err := s.dial("udp4", web+echoPort, time.Second)
	mustOK(t, "udp", err)
	defer u.Close()

	start := time.Now()
	s.update(&api.Network{Egress: true, AllowOut: []string{web2}, DenyOut: denyAll})
	applied := time.Since(start)
	err = roundTrip()
	cut := time.Since(start)
	mustFail(t, "round trip after tightening", err)
	// Cut at once (reset), not left to time out at the round trip's deadline. How fast
	// an update applies is the network bench's to measure: a loaded host can take over
	// a second, so no time bound here.
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		t.Fatalf("the open connection was not cut: it timed out %v after the update (%v)", cut, err)
	}
	t.Logf("update applied in %v; open connection cut after %v (%v)", applied, cut, err)
	_ = u.SetDeadline(time.Now().Add(time.Second))
	_, _ = u.Write([]byte("x"))
	if _, err := u.Read(make([]byte, 1)); err == nil {
		t.Fatal("udp flow still answered after tightening")
	}
	// New policy in force: the newly allowed address works.
	mustOK(t, "newly allowed", s.tcpEcho(web2+echoPort))
	s.waitEvent("policy_changed", func(ev api.NetworkEvent) bool { return ev.Reason == "policy_changed" })
}

func TestUpdateInvalidKeepsPolicy(t *testing.T) {
	e := newEnv(t)
	s := e.sandbox("upd1", &api.Network{Egress: true, AllowOut: []string{web}, DenyOut: denyAll})
	for _, bad := range []*api.Network{
		{Egress: true, AllowOut: []string{"10.0.0.0/33"}},
		{Egress: true, AllowOut: []string{"bad_domain.test"}},
		{Egress: true, EgressProxy: &api.EgressProxy{Address: "198.18.3.80:99999"}},
	} {
		err := e.m.Update(context.Background(), s.id, bad)
		if !fault.Is(err, fault.Invalid) {
			t.Fatalf("Update(%+v) = %v, want invalid", bad, err)
		}
	}
	mustOK(t, "old policy still allows", s.tcpEcho(web+echoPort))
	mustFail(t, "old policy still denies", s.tcpEcho(web2+echoPort))
}

func runCmd(name string, args ...string) error {
	out, err := execCommand(name, args...)
	if err != nil {
		return &cmdError{name + " " + strings.Join(args, " "), out, err}
	}
	return nil
}

func hostIf(t *testing.T, e *env, s *sbx) string {
	t.Helper()
	out, err := execIn(e, "ip", "-o", "addr", "show", "to", s.att.Gateway.String()+"/32")
	if err != nil {
		t.Fatal(err)
	}
	f := strings.Fields(out)
	if len(f) < 2 {
		t.Fatalf("no interface with %s: %q", s.att.Gateway, out)
	}
	return f[1]
}

var _ = netip.Addr{}

func TestRefusedBatchKeepsPolicy(t *testing.T) {
	e := newEnv(t)
	s := e.sandbox("atomic1", &api.Network{Egress: true, AllowOut: []string{web}, DenyOut: denyAll})
	before, err := e.m.Policy(s.id)
	mustOK(t, "policy", err)
	network.BreakNextApply(e.m)
	err = e.m.Update(context.Background(), s.id, &api.Network{Egress: true, AllowOut: []string{web2}, DenyOut: denyAll})
	if err == nil || !strings.Contains(err.Error(), "previous policy still in force") {
		t.Fatalf("Update with a batch the kernel refuses: %v", err)
	}
	after, _ := e.m.Policy(s.id)
	if after != before {
		t.Fatal("the manager's policy changed although the kernel refused it")
	}
	mustOK(t, "old policy still allows", s.tcpEcho(web+echoPort))
	mustFail(t, "old policy still denies", s.tcpEcho(web2+echoPort))
	// The next update goes through.
	s.update(&api.Network{Egress: true, AllowOut: []string{web2}, DenyOut: denyAll})
	mustOK(t, "new policy allows", s.tcpEcho(web2+echoPort))
	mustFail(t, "new policy denies", s.tcpEcho(web+echoPort))
}
