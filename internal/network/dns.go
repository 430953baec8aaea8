package network

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"
	"sync/atomic"
	"time"

	"github.com/google/nftables"
	"github.com/miekg/dns"
	"golang.org/x/time/rate"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
)

// The resolver of a sandbox listens on its gateway address, port 53 (UDP and TCP), in
// the host namespace. It answers only what the policy allows:
//
//   - a name not allowed is refused and never leaves the node (no exfiltration through
//     queries for <data>.attacker.example);
//   - for an allowed name only A is asked upstream: AAAA and every other type get an
//     empty answer (no TXT/NULL tunnels, no IPv6);
//   - an answer holding an always-denied address (private, loopback, metadata, the
//     host's own) is refused whole: DNS rebinding gets nothing;
//   - the addresses of a name allowed by allow_out are pinned into the sandbox's
//     nftables set before the answer is sent, for the answer's TTL clamped to
//     [PinMin, PinMax]; the TTL the sandbox sees is never longer than the pin;
//   - queries are rate-limited per sandbox.

// upstreams returns the configured resolvers, or those of /etc/resolv.conf.
func upstreams(cfg []string) ([]string, error) {
	var out []string
	for _, u := range cfg {
		if _, _, err := net.SplitHostPort(u); err != nil {
			u = net.JoinHostPort(u, "53")
		}
		ap, err := netip.ParseAddrPort(u)
		if err != nil {
			return nil, fault.New(fault.Invalid, "network: DNS upstream %q: want ip:port", u)
		}
		out = append(out, ap.String())
	}
	if len(out) > 0 {
		return out, nil
	}
	f, err := os.Open("/etc/resolv.conf")
	if err != nil {
		return nil, fmt.Errorf("network: no DNS upstream configured and %w", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fs := strings.Fields(sc.Text())
		if len(fs) >= 2 && fs[0] == "nameserver" {
			if a, err := netip.ParseAddr(fs[1]); err == nil {
				out = append(out, netip.AddrPortFrom(a, 53).String())
			}
		}
	}
	if len(out) == 0 {
		return nil, fault.New(fault.Invalid, "network: no DNS upstream configured and none in /etc/resolv.conf")
	}
	return out, nil
}

// lookupA asks the upstreams for name's A records. It returns the addresses (of the
// whole CNAME chain's end), the smallest TTL, and the response code.
func (m *Manager) lookupA(ctx context.Context, name string) ([]netip.Addr, uint32, int, error) {
	q := new(dns.Msg)
	q.SetQuestion(dns.Fqdn(name), dns.TypeA)
	q.RecursionDesired = true
	var lastErr error
	for _, up := range m.ups {
		r, err := m.exchange(ctx, q, up, "udp")
		if err == nil && r.Truncated {
			r, err = m.exchange(ctx, q, up, "tcp")
		}
		if err != nil {
			lastErr = err
			continue
		}
		if r.Rcode != dns.RcodeSuccess {
			return nil, 0, r.Rcode, nil
		}
		var addrs []netip.Addr
		ttl := uint32(1<<31 - 1)
		for _, rr := range r.Answer {
			if a, ok := rr.(*dns.A); ok {
				if ip, ok := netip.AddrFromSlice(a.A); ok {
					addrs = append(addrs, ip.Unmap())
					ttl = min(ttl, a.Hdr.Ttl)
				}
			}
		}
		if len(addrs) == 0 {
			ttl = 0
		}
		return addrs, ttl, dns.RcodeSuccess, nil
	}
	if lastErr == nil {
		lastErr = errors.New("no upstream")
	}
	return nil, 0, dns.RcodeServerFailure, fmt.Errorf("network: DNS upstream: %w", lastErr)
}

func (m *Manager) exchange(ctx context.Context, q *dns.Msg, up, network string) (*dns.Msg, error) {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	c, err := m.host.Dial(ctx, &net.Dialer{}, network, up)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	cl := &dns.Client{Net: network, Timeout: 3 * time.Second}
	r, _, err := cl.ExchangeWithConnContext(ctx, q, &dns.Conn{Conn: c})
	return r, err
}

// dnsServer is one sandbox's resolver.
type dnsServer struct {
	m       *Manager
	sb      *sandbox
	policy  atomic.Pointer[Policy]
	limiter *rate.Limiter
	udp     *dns.Server
	tcp     *dns.Server
}

func (m *Manager) startDNS(sb *sandbox) (*dnsServer, error) {
	addr := netip.AddrPortFrom(sb.gw, 53).String()
	pc, err := m.host.ListenPacket("udp4", addr)
	if err != nil {
		return nil, fmt.Errorf("network: resolver for %s: %w", sb.id, err)
	}
	l, err := m.host.Listen("tcp4", addr)
	if err != nil {
		pc.Close()
		return nil, fmt.Errorf("network: resolver for %s: %w", sb.id, err)
	}
	s := &dnsServer{m: m, sb: sb, limiter: rate.NewLimiter(rate.Limit(m.cfg.DNSRate), m.cfg.DNSBurst)}
	s.udp = &dns.Server{PacketConn: pc, Handler: s, UDPSize: 1232}
	s.tcp = &dns.Server{Listener: l, Handler: s, MaxTCPQueries: 128,
		ReadTimeout: 5 * time.Second, WriteTimeout: 5 * time.Second,
		IdleTimeout: func() time.Duration { return 5 * time.Second }}
	for _, srv := range []*dns.Server{s.udp, s.tcp} {
		go func() {
			if err := srv.ActivateAndServe(); err != nil {
				m.log.Debug("resolver stopped", "sandbox", sb.id, "err", err)
			}
		}()
	}
	return s, nil
}

func (s *dnsServer) close() {
	_ = s.udp.Shutdown()
	_ = s.tcp.Shutdown()
}

// ServeDNS answers one query from the sandbox.
func (s *dnsServer) ServeDNS(w dns.ResponseWriter, req *dns.Msg) {
	resp := new(dns.Msg)
	resp.SetReply(req)
	resp.RecursionAvailable = true
	resp.Authoritative = false
	defer func() { _ = w.WriteMsg(resp) }()
	if len(req.Question) != 1 || req.Opcode != dns.OpcodeQuery {
		resp.Rcode = dns.RcodeFormatError
		return
	}
	q := req.Question[0]
	ev := api.NetworkEvent{Kind: api.NetEventDNS, Protocol: "dns", Domain: strings.TrimSuffix(q.Name, ".")}
	deny := func(reason string, rcode int) {
		resp.Rcode = rcode
		ev.Verdict, ev.Reason = api.NetDenied, reason
		s.sb.jr.Append(ev)
	}
	if !s.limiter.Allow() {
		deny(ReasonRateLimited, dns.RcodeRefused)
		return
	}
	name, err := NormalizeDomain(q.Name)
	if err != nil || q.Qclass != dns.ClassINET {
		deny(ReasonNotAllowed, dns.RcodeRefused)
		return
	}
	ev.Domain = name
	pol := s.policy.Load()
	if pol == nil {
		deny(ReasonNoEgress, dns.RcodeRefused)
		return
	}
	verdict := pol.Name(name)
	if verdict == NameRefused {
		reason := ReasonNotAllowed
		if !pol.Egress {
			reason = ReasonNoEgress
		} else if matchAny(pol.DenyDomains, name) {
			reason = ReasonDenyOut
		}
		deny(reason, dns.RcodeRefused)
		return
	}
	reason := ReasonOpen
	if verdict == NamePinned {
		reason = ReasonAllowOut
	}
	if q.Qtype != dns.TypeA {
		// Allowed name, other type: an empty answer, nothing asked upstream.
		ev.Verdict, ev.Reason = api.NetAllowed, reason
		ev.Destination = dns.TypeToString[q.Qtype] + ": empty"
		s.sb.jr.Append(ev)
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	addrs, ttl, rcode, err := s.m.lookupA(ctx, name)
	if err != nil {
		s.m.log.Debug("resolver upstream failed", "sandbox", s.sb.id, "name", name, "err", err)
		deny(ReasonUpstream, dns.RcodeServerFailure)
		return
	}
	if rcode != dns.RcodeSuccess {
		resp.Rcode = rcode
		ev.Verdict, ev.Reason = api.NetAllowed, reason
		ev.Destination = dns.RcodeToString[rcode]
		s.sb.jr.Append(ev)
		return
	}
	forbidden := s.m.cachedForbidden()
	for _, a := range addrs {
		if forbidden.Contains(a) {
			ev.Destination = a.String()
			deny(ReasonRebinding, dns.RcodeRefused)
			return
		}
	}
	pinTTL := min(max(time.Duration(ttl)*time.Second, s.m.cfg.PinMin), s.m.cfg.PinMax)
	answerTTL := min(ttl, uint32(pinTTL/time.Second))
	if len(addrs) > 0 && (verdict == NamePinned || pol.HeaderRules(name) != nil) {
		if err := s.m.pin(s.sb, pol, name, addrs, pinTTL); err != nil {
			s.m.log.Warn("pin failed", "sandbox", s.sb.id, "name", name, "err", err)
			deny(ReasonUpstream, dns.RcodeServerFailure)
			return
		}
	}
	for _, a := range addrs {
		resp.Answer = append(resp.Answer, &dns.A{
			Hdr: dns.RR_Header{Name: q.Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: answerTTL},
			A:   a.AsSlice(),
		})
	}
	ev.Verdict, ev.Reason = api.NetAllowed, reason
	ev.Destination = joinAddrs(addrs)
	s.sb.jr.Append(ev)
}

func joinAddrs(as []netip.Addr) string {
	s := make([]string, len(as))
	for i, a := range as {
		s[i] = a.String()
	}
	return strings.Join(s, ",")
}

// pin adds addrs, answered for name, to the sandbox's pinned sets for ttl. It holds
// the sandbox's lock, so it never races with a policy change, and it re-checks that the
// policy in force still allows name. The answer is sent only after the kernel holds the
// pin, so the sandbox's first connection is never refused.
func (m *Manager) pin(sb *sandbox, pol *Policy, name string, addrs []netip.Addr, ttl time.Duration) error {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if sb.dead {
		return errors.New("sandbox torn down")
	}
	if sb.policy != pol {
		pol = sb.policy
		if pol == nil || (pol.Name(name) != NamePinned && pol.HeaderRules(name) == nil) {
			return errors.New("policy changed")
		}
	}
	now := time.Now()
	intercept := pol.HeaderRules(name) != nil
	add, present, ok := sb.pins.plan(name, addrs, now.Add(ttl), intercept, now)
	if !ok {
		return fmt.Errorf("more than %d pinned addresses", maxPins)
	}
	try := func(refresh bool) error {
		c, err := m.nft()
		if err != nil {
			return err
		}
		if refresh {
			if err := deletePins(c, sb.table, present); err != nil {
				return err
			}
		}
		if err := addPins(c, sb.table, add); err != nil {
			return err
		}
		return c.Flush()
	}
	if err := try(len(present) > 0); err != nil {
		// A refreshed element may have expired between plan and flush: add only.
		if len(present) == 0 {
			return err
		}
		if err := try(false); err != nil {
			return err
		}
	}
	sb.pins.commit(name, add, now)
	return nil
}

// deletePins queues the removal of present pins from the kernel sets.
func deletePins(c *nftables.Conn, table string, present []pinElem) error {
	t := &nftables.Table{Family: nftables.TableFamilyIPv4, Name: table}
	pin := &nftables.Set{Table: t, Name: setPin, KeyType: nftables.TypeIPAddr, HasTimeout: true}
	icpt := &nftables.Set{Table: t, Name: setIntercept, KeyType: nftables.TypeIPAddr, HasTimeout: true}
	var pe, ie []nftables.SetElement
	for _, p := range present {
		pe = append(pe, nftables.SetElement{Key: p.addr.AsSlice()})
		if p.intercept {
			ie = append(ie, nftables.SetElement{Key: p.addr.AsSlice()})
		}
	}
	if err := c.SetDeleteElements(pin, pe); err != nil {
		return err
	}
	if len(ie) > 0 {
		return c.SetDeleteElements(icpt, ie)
	}
	return nil
}
