package network

import (
	"net/netip"

	"go4.org/netipx"
)

// alwaysDenied are the destinations no sandbox reaches, whatever its policy says,
// unless the operator lists an exception (Config.AllowPrivate). The host's own
// addresses and the sandbox address pool are added at run time and admit no exception.
var alwaysDenied = []string{
	"0.0.0.0/8",      // "this network"
	"10.0.0.0/8",     // RFC 1918
	"100.64.0.0/10",  // CGNAT (RFC 6598): cloud-internal services, Alibaba's metadata 100.100.100.200
	"127.0.0.0/8",    // loopback
	"169.254.0.0/16", // link-local, cloud metadata 169.254.169.254
	"172.16.0.0/12",  // RFC 1918
	"192.0.0.0/24",   // IETF protocol assignments
	"192.168.0.0/16", // RFC 1918
	"224.0.0.0/4",    // multicast
	"240.0.0.0/4",    // reserved, broadcast
	"::/128",         // unspecified
	"::1/128",        // loopback
	"::ffff:0:0/96",  // IPv4-mapped
	"64:ff9b::/96",   // NAT64 (maps onto IPv4, private ranges included)
	"64:ff9b:1::/48", // local-use NAT64
	"100::/64",       // discard
	"fc00::/7",       // ULA, AWS metadata fd00:ec2::254
	"fe80::/10",      // link-local
	"ff00::/8",       // multicast
	"2001:db8::/32",  // documentation
	"2002::/16",      // 6to4 (embeds IPv4)
	"2001::/32",      // Teredo (embeds IPv4)
	"fec0::/10",      // deprecated site-local
	"fd00:ec2::254/128",
}

// AlwaysDenied returns the built-in always-denied ranges.
func AlwaysDenied() []netip.Prefix {
	out := make([]netip.Prefix, len(alwaysDenied))
	for i, s := range alwaysDenied {
		out[i] = netip.MustParsePrefix(s)
	}
	return out
}

// forbiddenSet builds the effective always-denied set: the built-in ranges less the
// operator's exceptions, plus extra (host addresses, the pool), which no exception
// removes.
func forbiddenSet(exceptions []netip.Prefix, extra ...netip.Prefix) *netipx.IPSet {
	var b netipx.IPSetBuilder
	for _, p := range AlwaysDenied() {
		b.AddPrefix(p)
	}
	for _, p := range exceptions {
		b.RemovePrefix(p)
	}
	for _, p := range extra {
		b.AddPrefix(p)
	}
	s, _ := b.IPSet() // only fails for invalid prefixes, which the callers never pass
	return s
}
