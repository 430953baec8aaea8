package network

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
)

func forbiddenForTest() []netip.Prefix { return []netip.Prefix{netip.MustParsePrefix("10.201.0.0/16")} }

func TestCompileRejects(t *testing.T) {
	fb := forbiddenSet(nil, forbiddenForTest()...)
	rule := func(h map[string]string) []api.NetworkRule {
		return []api.NetworkRule{{Transform: &api.NetworkTransform{Headers: h}}}
	}
	for _, c := range []struct {
		name  string
		spec  api.Network
		field string
	}{
		{"allow without egress", api.Network{AllowOut: []string{"1.2.3.4"}}, "network.allow_out"},
		{"proxy without egress", api.Network{EgressProxy: &api.EgressProxy{Address: "1.2.3.4:1080"}}, "network.egress_proxy"},
		{"bad CIDR", api.Network{Egress: true, AllowOut: []string{"1.2.3.0/33"}}, "network.allow_out[0]"},
		{"host bits", api.Network{Egress: true, AllowOut: []string{"ok.example.com", "1.2.3.4/24"}}, "network.allow_out[1]"},
		{"bad IPv4", api.Network{Egress: true, DenyOut: []string{"10.0.0.256"}}, "network.deny_out[0]"},
		{"empty entry", api.Network{Egress: true, DenyOut: []string{" "}}, "network.deny_out[0]"},
		{"private allow", api.Network{Egress: true, AllowOut: []string{"192.168.1.0/24"}}, "network.allow_out[0]"},
		{"metadata allow", api.Network{Egress: true, AllowOut: []string{"169.254.169.254"}}, "network.allow_out[0]"},
		{"CGNAT allow", api.Network{Egress: true, AllowOut: []string{"100.100.100.200"}}, "network.allow_out[0]"},
		{"pool allow", api.Network{Egress: true, AllowOut: []string{"10.201.0.6"}}, "network.allow_out[0]"},
		{"IPv6 allow", api.Network{Egress: true, AllowOut: []string{"2001:4860::/32"}}, "network.allow_out[0]"},
		{"underscore domain", api.Network{Egress: true, AllowOut: []string{"a_b.example.com"}}, "network.allow_out[0]"},
		{"single label", api.Network{Egress: true, AllowOut: []string{"localhost"}}, "network.allow_out[0]"},
		{"mid wildcard", api.Network{Egress: true, AllowOut: []string{"a.*.example.com"}}, "network.allow_out[0]"},
		{"bare wildcard", api.Network{Egress: true, AllowOut: []string{"*"}}, "network.allow_out[0]"},
		{"long label", api.Network{Egress: true, AllowOut: []string{strings.Repeat("a", 64) + ".com"}}, "network.allow_out[0]"},
		{"too many", api.Network{Egress: true, AllowOut: make([]string, 257)}, "network.allow_out"},
		{"rule for non-allowed domain", api.Network{Egress: true, DenyOut: []string{"0.0.0.0/0"}, AllowOut: []string{"a.example.com"},
			Rules: map[string][]api.NetworkRule{"b.example.com": rule(map[string]string{"X": "y"})}}, "network.rules[b.example.com]"},
		{"rule wildcard wider than allow", api.Network{Egress: true, DenyOut: []string{"0.0.0.0/0"}, AllowOut: []string{"*.api.example.com"},
			Rules: map[string][]api.NetworkRule{"*.example.com": rule(map[string]string{"X": "y"})}}, "network.rules[*.example.com]"},
		{"bad header name", api.Network{Egress: true, Rules: map[string][]api.NetworkRule{"a.example.com": rule(map[string]string{"Bad Header": "y"})}}, "transform.headers[Bad Header]"},
		{"header CRLF", api.Network{Egress: true, Rules: map[string][]api.NetworkRule{"a.example.com": rule(map[string]string{"X": "a\r\nHost: evil"})}}, "transform.headers[X]"},
		{"Host header", api.Network{Egress: true, Rules: map[string][]api.NetworkRule{"a.example.com": rule(map[string]string{"host": "evil"})}}, "transform.headers[host]"},
		{"proxy no port", api.Network{Egress: true, EgressProxy: &api.EgressProxy{Address: "proxy.example.com"}}, "network.egress_proxy.address"},
		{"proxy bad port", api.Network{Egress: true, EgressProxy: &api.EgressProxy{Address: "proxy.example.com:0"}}, "network.egress_proxy.address"},
		{"proxy bad host", api.Network{Egress: true, EgressProxy: &api.EgressProxy{Address: "bad_host:1080"}}, "network.egress_proxy.address"},
		{"proxy password without user", api.Network{Egress: true, EgressProxy: &api.EgressProxy{Address: "1.2.3.4:1080", Password: "p"}}, "network.egress_proxy.username"},
		{"proxy user without password", api.Network{Egress: true, EgressProxy: &api.EgressProxy{Address: "1.2.3.4:1080", Username: "u"}}, "network.egress_proxy.password"},
		{"proxy on loopback", api.Network{Egress: true, EgressProxy: &api.EgressProxy{Address: "127.0.0.1:1080"}}, "network.egress_proxy.address"},
		{"proxy on a private address", api.Network{Egress: true, EgressProxy: &api.EgressProxy{Address: "10.0.0.5:1080"}}, "network.egress_proxy.address"},
		{"proxy on metadata", api.Network{Egress: true, EgressProxy: &api.EgressProxy{Address: "169.254.169.254:80"}}, "network.egress_proxy.address"},
		{"proxy on IPv6", api.Network{Egress: true, EgressProxy: &api.EgressProxy{Address: "[2001:4860::1]:1080"}}, "network.egress_proxy.address"},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := Compile(&c.spec, fb)
			if !fault.Is(err, fault.Invalid) || !strings.Contains(err.Error(), c.field) {
				t.Fatalf("Compile = %v, want invalid naming %q", err, c.field)
			}
		})
	}
}

func TestCompileAndDecide(t *testing.T) {
	exc := []netip.Prefix{netip.MustParsePrefix("10.20.0.5/32")}
	fb := forbiddenSet(exc, forbiddenForTest()...)
	p, err := Compile(&api.Network{
		Egress:   true,
		AllowOut: []string{"203.0.113.0/24", "API.Example.COM.", "*.pkg.example.org", "10.20.0.5", "bücher.example"},
		DenyOut:  []string{"0.0.0.0/0", "*.example.com", "2001:db8::/32"},
		Rules: map[string][]api.NetworkRule{
			"api.example.com":   {{Transform: &api.NetworkTransform{Headers: map[string]string{"authorization": "Bearer x"}}}},
			"*.pkg.example.org": {{Transform: &api.NetworkTransform{Headers: map[string]string{"X-Wild": "1"}}}},
		},
		EgressProxy: &api.EgressProxy{Address: "Proxy.Example.NET:1080", Username: "u", Password: "hunter2-secret"},
	}, fb)
	if err != nil {
		t.Fatal(err)
	}
	if p.Open {
		t.Fatal("deny 0.0.0.0/0 must make the policy closed")
	}
	if p.Proxy.Address != "proxy.example.net:1080" {
		t.Fatalf("proxy address %q", p.Proxy.Address)
	}
	if !strings.Contains(p.String(), "socks5=proxy.example.net:1080") || strings.Contains(p.String(), "Bearer") || strings.Contains(p.String(), "hunter2") {
		t.Fatalf("String leaks or misses: %s", p.String())
	}
	for _, c := range []struct {
		name string
		want NameVerdict
	}{
		{"api.example.com", NamePinned},  // allow beats the deny wildcard
		{"www.example.com", NameRefused}, // denied by wildcard
		{"example.com", NameRefused},
		{"a.pkg.example.org", NamePinned},
		{"pkg.example.org", NameRefused}, // a wildcard matches subdomains only
		{"evilpkg.example.org", NameRefused},
		{"xn--bcher-kva.example", NamePinned}, // IDN normalised
		{"other.net", NameRefused},
	} {
		if got := p.Name(c.name); got != c.want {
			t.Errorf("Name(%s) = %v, want %v", c.name, got, c.want)
		}
	}
	if h := p.HeaderRules("api.example.com"); h.Get("Authorization") != "Bearer x" {
		t.Fatalf("rules for api.example.com: %v", h)
	}
	if h := p.HeaderRules("deep.a.pkg.example.org"); h.Get("X-Wild") != "1" {
		t.Fatalf("wildcard rules: %v", h)
	}
	if h := p.HeaderRules("www.example.com"); h != nil {
		t.Fatalf("rules for www.example.com: %v", h)
	}
	a := netip.MustParseAddr
	for _, c := range []struct {
		dst    string
		proto  uint8
		port   uint16
		pinned bool
		want   Verdict
	}{
		{"203.0.113.7", protoTCP, 443, false, Verdict{true, ReasonAllowOut}},
		{"203.0.113.7", protoICMP, 0, false, Verdict{true, ReasonAllowOut}},
		{"203.0.113.7", protoUDP, 53, false, Verdict{false, ReasonDNSOther}},
		{"203.0.113.7", protoTCP, 853, false, Verdict{false, ReasonDNSOther}},
		{"198.51.100.1", protoTCP, 443, false, Verdict{false, ReasonDenyOut}},
		{"198.51.100.1", protoTCP, 443, true, Verdict{true, ReasonPinned}},
		{"198.51.100.1", protoICMP, 0, true, Verdict{false, ReasonDenyOut}}, // a pin opens TCP and UDP only
		{"169.254.169.254", protoTCP, 80, true, Verdict{false, ReasonForbidden}},
		{"10.201.0.6", protoTCP, 80, false, Verdict{false, ReasonForbidden}},
		{"10.20.0.5", protoTCP, 80, false, Verdict{true, ReasonAllowOut}}, // operator exception
		{"10.20.0.6", protoTCP, 80, false, Verdict{false, ReasonForbidden}},
		{"100.100.100.200", protoTCP, 80, false, Verdict{false, ReasonForbidden}},
		{"2001:4860::1", protoTCP, 443, false, Verdict{false, ReasonIPv6}},
	} {
		if got := p.Decide(a(c.dst), c.proto, c.port, c.pinned, fb); got != c.want {
			t.Errorf("Decide(%s %d/%d pinned=%v) = %+v, want %+v", c.dst, c.proto, c.port, c.pinned, got, c.want)
		}
	}
	// allow_out 0.0.0.0/0 is accepted: the always-denied ranges stay denied.
	all, err := Compile(&api.Network{Egress: true, AllowOut: []string{"0.0.0.0/0"}, DenyOut: []string{"0.0.0.0/0"}}, fb)
	if err != nil {
		t.Fatal(err)
	}
	if v := all.Decide(a("192.168.1.1"), protoTCP, 80, false, fb); v.Allowed {
		t.Fatalf("allow 0.0.0.0/0 reached a private address: %+v", v)
	}
	none, _ := Compile(nil, fb)
	if v := none.Decide(a("203.0.113.7"), protoTCP, 443, false, fb); v.Allowed || v.Reason != ReasonNoEgress {
		t.Fatalf("nil spec: %+v", v)
	}
	open, _ := Compile(&api.Network{Egress: true, DenyOut: []string{"*.ads.example"}}, fb)
	if !open.Open || open.Name("x.ads.example") != NameRefused || open.Name("example.org") != NameAnswered {
		t.Fatalf("open policy: open=%v", open.Open)
	}
}
