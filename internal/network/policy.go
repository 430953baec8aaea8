package network

import (
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"sort"
	"strconv"
	"strings"

	"go4.org/netipx"
	"golang.org/x/net/http/httpguts"
	"golang.org/x/net/idna"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
)

// Limits on a network spec: what a sandbox may ask for. They bound the size of the
// nftables sets, the resolver's matching work and the memory a spec holds.
const (
	MaxListEntries   = 256
	MaxRuleDomains   = 64
	MaxRuleHeaders   = 16
	MaxHeaderValue   = 8 << 10
	maxDomainLength  = 253
	maxLabelLength   = 63
	maxProxyUserPass = 255 // RFC 1929
)

// Policy is a validated, normalised network spec: what the nftables rules, the DNS
// resolver and the egress proxy of one sandbox enforce. It is immutable.
type Policy struct {
	// Egress is false for "no network at all".
	Egress bool
	// Allow and Deny are the CIDR entries (IPv4 only: IPv6 egress is not offered).
	Allow, Deny *netipx.IPSet
	// AllowDomains and DenyDomains are the domain entries, normalised (lower case,
	// ASCII, no trailing dot); a wildcard keeps its "*." prefix.
	AllowDomains, DenyDomains []string
	// Open is true when DenyOut does not cover all of IPv4: destinations that match
	// neither list are allowed, and the resolver answers any name not denied.
	Open bool
	// Rules maps a domain pattern to the headers set on HTTPS requests to it.
	Rules map[string]http.Header
	// Proxy is the SOCKS5 upstream, or nil.
	Proxy *ProxySpec
}

// ProxySpec is a validated SOCKS5 upstream.
type ProxySpec struct {
	Address  string // host:port
	Username string
	Password string
}

// String describes the policy without secrets (header values and proxy password).
func (p *Policy) String() string {
	if p == nil || !p.Egress {
		return "egress=none"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "egress=on open=%v allow=%v deny=%v allow_domains=%v deny_domains=%v",
		p.Open, p.Allow.Prefixes(), p.Deny.Prefixes(), p.AllowDomains, p.DenyDomains)
	if len(p.Rules) > 0 {
		names := make([]string, 0, len(p.Rules))
		for d := range p.Rules {
			names = append(names, d)
		}
		sort.Strings(names)
		fmt.Fprintf(&b, " rules=%v", names)
	}
	if p.Proxy != nil {
		fmt.Fprintf(&b, " socks5=%s", p.Proxy.Address)
	}
	return b.String()
}

// Compile validates spec (nil: no network) against the always-denied ranges less the
// operator's exceptions and returns its policy. Every error is fault.Invalid and names
// the field ("network.allow_out[2]: …").
func Compile(spec *api.Network, forbidden *netipx.IPSet) (*Policy, error) {
	if spec == nil {
		return &Policy{Allow: &netipx.IPSet{}, Deny: &netipx.IPSet{}}, nil
	}
	if !spec.Egress {
		switch {
		case len(spec.AllowOut) > 0:
			return nil, invalid("network.allow_out", "needs egress on")
		case len(spec.DenyOut) > 0:
			return nil, invalid("network.deny_out", "needs egress on")
		case len(spec.Rules) > 0:
			return nil, invalid("network.rules", "needs egress on")
		case spec.EgressProxy != nil:
			return nil, invalid("network.egress_proxy", "needs egress on")
		}
		return &Policy{Allow: &netipx.IPSet{}, Deny: &netipx.IPSet{}}, nil
	}
	p := &Policy{Egress: true}
	var allow, deny netipx.IPSetBuilder
	var err error
	if p.AllowDomains, err = parseList("network.allow_out", spec.AllowOut, &allow, forbidden, true); err != nil {
		return nil, err
	}
	if p.DenyDomains, err = parseList("network.deny_out", spec.DenyOut, &deny, nil, false); err != nil {
		return nil, err
	}
	if p.Allow, err = allow.IPSet(); err != nil {
		return nil, fault.Wrap(fault.Invalid, fmt.Errorf("network.allow_out: %w", err))
	}
	if p.Deny, err = deny.IPSet(); err != nil {
		return nil, fault.Wrap(fault.Invalid, fmt.Errorf("network.deny_out: %w", err))
	}
	p.Open = !p.Deny.ContainsPrefix(netip.MustParsePrefix("0.0.0.0/0"))
	if p.Rules, err = compileRules(spec.Rules, p); err != nil {
		return nil, err
	}
	if spec.EgressProxy != nil {
		if p.Proxy, err = compileProxy(spec.EgressProxy, forbidden); err != nil {
			return nil, err
		}
	}
	return p, nil
}

func invalid(field, format string, args ...any) error {
	return fault.New(fault.Invalid, "%s: %s", field, fmt.Sprintf(format, args...))
}

// parseList sorts entries into CIDRs (added to b) and domains (returned). An allow
// list may not name only always-denied space: such an entry is a mistake or a probe.
func parseList(field string, entries []string, b *netipx.IPSetBuilder, forbidden *netipx.IPSet, isAllow bool) ([]string, error) {
	if len(entries) > MaxListEntries {
		return nil, invalid(field, "%d entries (at most %d)", len(entries), MaxListEntries)
	}
	var domains []string
	seen := map[string]bool{}
	for i, raw := range entries {
		f := fmt.Sprintf("%s[%d]", field, i)
		e := strings.TrimSpace(raw)
		if e == "" {
			return nil, invalid(f, "empty entry")
		}
		if pfx, ok, err := parsePrefix(e); err != nil {
			return nil, invalid(f, "%v", err)
		} else if ok {
			if pfx.Addr().Is6() {
				if isAllow {
					return nil, invalid(f, "%s: IPv6 egress is not supported (all IPv6 is denied)", e)
				}
				continue // denied anyway
			}
			if isAllow && forbidden != nil && forbidden.ContainsPrefix(pfx) {
				return nil, invalid(f, "%s is in an always-denied range (loopback, link-local, metadata, private or shared address space)", e)
			}
			b.AddPrefix(pfx)
			continue
		}
		d, err := normalizePattern(e)
		if err != nil {
			return nil, invalid(f, "%v", err)
		}
		if !seen[d] {
			seen[d] = true
			domains = append(domains, d)
		}
	}
	return domains, nil
}

// parsePrefix recognises an IP address or a CIDR. ok is false for anything that does
// not look like one (a domain); err is set for something that does but is malformed.
func parsePrefix(s string) (netip.Prefix, bool, error) {
	if strings.Contains(s, "/") {
		pfx, err := netip.ParsePrefix(s)
		if err != nil {
			return netip.Prefix{}, false, fmt.Errorf("invalid CIDR %q", s)
		}
		if pfx.Addr().Zone() != "" {
			return netip.Prefix{}, false, fmt.Errorf("invalid CIDR %q: zones are not allowed", s)
		}
		if pfx.Masked() != pfx {
			return netip.Prefix{}, false, fmt.Errorf("invalid CIDR %q: host bits set (did you mean %s?)", s, pfx.Masked())
		}
		if pfx.Addr().Is4In6() {
			return netip.Prefix{}, false, fmt.Errorf("invalid CIDR %q: write IPv4 as a.b.c.d", s)
		}
		return pfx, true, nil
	}
	if a, err := netip.ParseAddr(s); err == nil {
		if a.Zone() != "" || a.Is4In6() {
			return netip.Prefix{}, false, fmt.Errorf("invalid address %q", s)
		}
		return netip.PrefixFrom(a, a.BitLen()), true, nil
	}
	if strings.Contains(s, ":") || looksNumeric(s) {
		return netip.Prefix{}, false, fmt.Errorf("invalid address %q", s)
	}
	return netip.Prefix{}, false, nil
}

// looksNumeric reports whether s is made of digits and dots only (a malformed IPv4
// address such as "10.0.0.256", never a domain).
func looksNumeric(s string) bool {
	for _, c := range s {
		if c != '.' && (c < '0' || c > '9') {
			return false
		}
	}
	return true
}

// normalizePattern validates a domain or a "*.domain" wildcard and returns it in
// canonical form: ASCII (IDNA), lower case, no trailing dot.
func normalizePattern(s string) (string, error) {
	wild := false
	if strings.HasPrefix(s, "*.") {
		wild = true
		s = s[2:]
	}
	d, err := NormalizeDomain(s)
	if err != nil {
		return "", err
	}
	if !strings.Contains(d, ".") {
		return "", fmt.Errorf("invalid domain %q: needs at least two labels", s)
	}
	if wild {
		return "*." + d, nil
	}
	return d, nil
}

// NormalizeDomain returns name in the form domain patterns are matched in: ASCII
// (IDNA lookup profile), lower case, without a trailing dot. It fails for anything that
// is not a valid host name (underscores, empty labels, labels over 63 bytes, …).
func NormalizeDomain(name string) (string, error) {
	name = strings.TrimSuffix(name, ".")
	if name == "" {
		return "", fmt.Errorf("invalid domain: empty")
	}
	if strings.ContainsAny(name, "*") {
		return "", fmt.Errorf("invalid domain %q: a wildcard must be the whole first label (\"*.example.com\")", name)
	}
	a, err := idna.Lookup.ToASCII(name)
	if err != nil {
		return "", fmt.Errorf("invalid domain %q: %v", name, err)
	}
	a = strings.ToLower(a)
	if len(a) > maxDomainLength {
		return "", fmt.Errorf("invalid domain %q: longer than %d bytes", name, maxDomainLength)
	}
	for _, l := range strings.Split(a, ".") {
		if l == "" || len(l) > maxLabelLength || l[0] == '-' || l[len(l)-1] == '-' {
			return "", fmt.Errorf("invalid domain %q: bad label %q", name, l)
		}
		for _, c := range l {
			if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-') {
				return "", fmt.Errorf("invalid domain %q: bad character %q", name, c)
			}
		}
	}
	if looksNumeric(a) {
		return "", fmt.Errorf("invalid domain %q", name)
	}
	return a, nil
}

// matchPattern reports whether the normalised name matches pattern: exactly, or for
// "*.d" any name below d (not d itself).
func matchPattern(pattern, name string) bool {
	if suffix, ok := strings.CutPrefix(pattern, "*"); ok {
		return len(name) > len(suffix) && strings.HasSuffix(name, suffix)
	}
	return pattern == name
}

func matchAny(patterns []string, name string) bool {
	for _, p := range patterns {
		if matchPattern(p, name) {
			return true
		}
	}
	return false
}

// NameVerdict is what the resolver does with a query for a name.
type NameVerdict int

const (
	// NameRefused: the name is not allowed; the query never leaves the node.
	NameRefused NameVerdict = iota
	// NameAnswered: the name is resolved upstream and answered, its addresses are not
	// pinned (the policy is open and they are reachable anyway, unless denied by CIDR).
	NameAnswered
	// NamePinned: the name is allowed by AllowOut; its addresses are pinned into the
	// sandbox's allowed set for the answer's lifetime.
	NamePinned
)

// Name decides a DNS query for the normalised name. Allow wins over deny.
func (p *Policy) Name(name string) NameVerdict {
	switch {
	case !p.Egress:
		return NameRefused
	case matchAny(p.AllowDomains, name):
		return NamePinned
	case matchAny(p.DenyDomains, name):
		return NameRefused
	case p.Open:
		return NameAnswered
	}
	return NameRefused
}

// HeaderRules returns the headers to set on HTTPS requests to the normalised name,
// or nil. When several patterns match, the exact name wins over wildcards and a longer
// wildcard over a shorter one.
func (p *Policy) HeaderRules(name string) http.Header {
	if h, ok := p.Rules[name]; ok {
		return h
	}
	best := ""
	for pat := range p.Rules {
		if strings.HasPrefix(pat, "*.") && matchPattern(pat, name) && len(pat) > len(best) {
			best = pat
		}
	}
	if best == "" {
		return nil
	}
	return p.Rules[best]
}

// Verdict is a decision on a connection, with the rule that made it.
type Verdict struct {
	Allowed bool
	Reason  string
}

// Reasons for a verdict (also the audit log's "reason").
const (
	ReasonAllowOut    = "allow_out"
	ReasonPinned      = "allowed_domain"
	ReasonOpen        = "open"
	ReasonDenyOut     = "deny_out"
	ReasonNotAllowed  = "not_allowed"
	ReasonForbidden   = "forbidden"
	ReasonNoEgress    = "no_egress"
	ReasonDNSOther    = "dns_other_resolver"
	ReasonProxyOnly   = "egress_proxy_only"
	ReasonRebinding   = "rebinding"
	ReasonSNIMismatch = "sni_mismatch"
	ReasonNoSNI       = "no_sni"
	ReasonRateLimited = "rate_limited"
	ReasonHost        = "host"
	ReasonProtocol    = "protocol"
	ReasonIPv6        = "ipv6"
	ReasonSpoofed     = "spoofed"
	ReasonFragment    = "fragment"
	ReasonRoute       = "route"
	ReasonUpstream    = "upstream_failed"
	ReasonPolicy      = "policy_changed"
)

// Decide evaluates a connection from the sandbox to dst:port over proto (an IP
// protocol number) the way the nftables rules do. pinned reports whether dst is pinned
// for an allowed domain; forbidden is the effective always-denied set. The proxy uses
// it for the connections it carries and Update for the flows it revalidates.
func (p *Policy) Decide(dst netip.Addr, proto uint8, port uint16, pinned bool, forbidden *netipx.IPSet) Verdict {
	dst = dst.Unmap()
	switch {
	case !p.Egress:
		return Verdict{false, ReasonNoEgress}
	case !dst.Is4():
		return Verdict{false, ReasonIPv6}
	case forbidden.Contains(dst):
		return Verdict{false, ReasonForbidden}
	case (proto == protoTCP || proto == protoUDP) && (port == 53 || port == 853):
		return Verdict{false, ReasonDNSOther}
	case p.Allow.Contains(dst):
		return Verdict{true, ReasonAllowOut}
	case pinned && (proto == protoTCP || proto == protoUDP):
		return Verdict{true, ReasonPinned}
	case p.Deny.Contains(dst):
		return Verdict{false, ReasonDenyOut}
	case p.Open:
		return Verdict{true, ReasonOpen}
	}
	return Verdict{false, ReasonNotAllowed}
}

// IP protocol numbers the rules name.
const (
	protoICMP = 1
	protoTCP  = 6
	protoUDP  = 17
)

func compileRules(rules map[string][]api.NetworkRule, p *Policy) (map[string]http.Header, error) {
	if len(rules) == 0 {
		return nil, nil
	}
	if len(rules) > MaxRuleDomains {
		return nil, invalid("network.rules", "%d domains (at most %d)", len(rules), MaxRuleDomains)
	}
	out := make(map[string]http.Header, len(rules))
	for dom, list := range rules {
		field := fmt.Sprintf("network.rules[%s]", dom)
		d, err := normalizePattern(strings.TrimSpace(dom))
		if err != nil {
			return nil, invalid(field, "%v", err)
		}
		if !p.domainPatternAllowed(d) {
			return nil, invalid(field, "%s is not allowed by allow_out: a rule needs its domain allowed", dom)
		}
		h := out[d]
		if h == nil {
			h = http.Header{}
		}
		for i, r := range list {
			if r.Transform == nil {
				continue
			}
			for k, v := range r.Transform.Headers {
				f := fmt.Sprintf("%s[%d].transform.headers[%s]", field, i, k)
				if !httpguts.ValidHeaderFieldName(k) {
					return nil, invalid(f, "invalid header name")
				}
				if !httpguts.ValidHeaderFieldValue(v) || len(v) > MaxHeaderValue {
					return nil, invalid(f, "invalid header value (control characters, or longer than %d bytes)", MaxHeaderValue)
				}
				switch http.CanonicalHeaderKey(k) {
				case "Host", "Content-Length", "Transfer-Encoding", "Connection", "Upgrade", "Te", "Trailer", "Keep-Alive", "Proxy-Connection":
					return nil, invalid(f, "header %s cannot be set by a rule", k)
				}
				h.Set(k, v)
			}
		}
		if len(h) > MaxRuleHeaders {
			return nil, invalid(field, "%d headers (at most %d)", len(h), MaxRuleHeaders)
		}
		out[d] = h
	}
	return out, nil
}

// domainPatternAllowed reports whether every name the pattern matches is allowed.
func (p *Policy) domainPatternAllowed(pat string) bool {
	if !strings.HasPrefix(pat, "*.") {
		return p.Name(pat) != NameRefused
	}
	for _, a := range p.AllowDomains {
		// "*.x" is covered by "*.x" or by "*.y" when x is y or below y.
		if strings.HasPrefix(a, "*.") && (a == pat || strings.HasSuffix(pat[1:], a[1:])) {
			return true
		}
	}
	if !p.Open {
		return false
	}
	for _, d := range p.DenyDomains {
		if d == pat || matchPattern(pat, strings.TrimPrefix(d, "*.")) || matchPattern(d, pat[2:]) {
			return false
		}
	}
	return true
}

func compileProxy(ep *api.EgressProxy, forbidden *netipx.IPSet) (*ProxySpec, error) {
	host, port, err := net.SplitHostPort(strings.TrimSpace(ep.Address))
	if err != nil {
		return nil, invalid("network.egress_proxy.address", "want host:port: %v", err)
	}
	n, err := strconv.Atoi(port)
	if err != nil || n < 1 || n > 65535 {
		return nil, invalid("network.egress_proxy.address", "invalid port %q", port)
	}
	if a, err := netip.ParseAddr(host); err == nil {
		if a.Zone() != "" {
			return nil, invalid("network.egress_proxy.address", "zones are not allowed")
		}
		a = a.Unmap()
		if a.Is6() {
			return nil, invalid("network.egress_proxy.address", "%s: IPv6 egress is not supported", a)
		}
		// The proxy's address is dialed from the node: it must not be a way into what
		// sandboxes may never reach (the node's private network, metadata, loopback).
		if forbidden != nil && forbidden.Contains(a) {
			return nil, invalid("network.egress_proxy.address", "%s is in an always-denied range (loopback, link-local, metadata, private or shared address space)", a)
		}
		host = a.String()
	} else if host, err = NormalizeDomain(host); err != nil {
		return nil, invalid("network.egress_proxy.address", "%v", err)
	}
	if len(ep.Username) > maxProxyUserPass || len(ep.Password) > maxProxyUserPass {
		return nil, invalid("network.egress_proxy", "username and password are at most %d bytes", maxProxyUserPass)
	}
	if ep.Password != "" && ep.Username == "" {
		return nil, invalid("network.egress_proxy.username", "required with a password")
	}
	if ep.Username != "" && ep.Password == "" {
		// RFC 1929 allows an empty password, but a user name alone is almost always a
		// forgotten password.
		return nil, invalid("network.egress_proxy.password", "required with a username")
	}
	return &ProxySpec{Address: net.JoinHostPort(host, strconv.Itoa(n)), Username: ep.Username, Password: ep.Password}, nil
}
