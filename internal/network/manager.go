// Package network gives each sandbox its own network namespace and enforces its egress
// policy from the host: a veth pair to the host, NAT out of an uplink, nftables rules
// that always deny the host, private ranges, metadata services and other sandboxes, a
// DNS resolver that answers only allowed names and pins their addresses, an HTTPS proxy
// that injects per-domain headers (and sends egress through a SOCKS5 upstream when the
// policy asks), and an audit journal of every DNS query and connection attempt.
//
// Everything lives outside the sandbox: a process with root inside the sandbox's
// namespace cannot change the rules, which are in the host's namespace. See
// docs/networking.md for the design and docs/security.md for the threat model.
package network

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"encoding/base32"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/nftables"
	"github.com/vishvananda/netlink"
	"go4.org/netipx"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
)

// Config configures a Manager. The zero value of every field has a usable default.
type Config struct {
	Logger *slog.Logger
	// HostNetns is the namespace that plays the host: it holds the uplink, the host ends
	// of the veths, the rules and the resolver and proxy sockets. Empty: the namespace
	// space runs in (production). Tests give a namespace of their own.
	HostNetns string
	// NetnsDir is where sandbox namespaces are pinned (default /run/netns, so that
	// "ip netns exec" finds them).
	NetnsDir string
	// Prefix names what belongs to this manager: namespace pins "<Prefix><id>" and
	// nftables tables "<Prefix with - as _><id>". Default "space-".
	Prefix string
	// Pool is where sandbox addresses come from; each sandbox takes a /30 (the host end
	// the first address, the sandbox the second). Default 10.201.0.0/16.
	Pool netip.Prefix
	// Uplink is the interface egress leaves by (default: the default route's).
	Uplink string
	// Upstreams are the DNS servers ("ip:port") the resolver and the proxy ask
	// (default: the nameservers of /etc/resolv.conf, port 53).
	Upstreams []string
	// AllowPrivate lists operator exceptions to the always-denied ranges, e.g. an
	// internal package mirror at 10.20.0.5/32. Sandboxes may then allow them.
	AllowPrivate []netip.Prefix
	// UpstreamRoots verifies the TLS servers the proxy connects to for header rules
	// (default: the system roots).
	UpstreamRoots *x509.CertPool
	// CADir holds the node's egress CA (ca.pem, ca-key.pem), generated on first use.
	// Default: a "ca" directory next to the namespace pins is NOT used: the CA needs
	// persistent storage, so an empty CADir keeps it in memory only (tests).
	CADir string
	// NflogGroup is the nflog group denied attempts are logged to (default 2718).
	NflogGroup uint16
	// JournalEvents bounds each sandbox's audit journal (default 4096 events).
	JournalEvents int
	// DNSRate and DNSBurst bound each sandbox's DNS queries per second (default 50, 100).
	DNSRate  float64
	DNSBurst int
	// PinMin and PinMax clamp how long an answered address stays pinned (defaults 60 s
	// and 1 h). The TTL the sandbox sees is never longer than the pin.
	PinMin, PinMax time.Duration
	// ProxyConnsPerSandbox bounds the proxy's concurrent connections per sandbox
	// (default 256).
	ProxyConnsPerSandbox int
}

func (c *Config) defaults() error {
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.NetnsDir == "" {
		c.NetnsDir = "/run/netns"
	}
	if c.Prefix == "" {
		c.Prefix = "space-"
	}
	if !regexp.MustCompile(`^[a-z][a-z0-9-]{0,15}$`).MatchString(c.Prefix) {
		return fmt.Errorf("network: invalid prefix %q", c.Prefix)
	}
	if !c.Pool.IsValid() {
		c.Pool = DefaultPool
	}
	if !c.Pool.Addr().Is4() || c.Pool.Bits() > 29 || c.Pool.Masked() != c.Pool {
		return fmt.Errorf("network: pool %s: want an IPv4 network of /29 or larger", c.Pool)
	}
	if c.NflogGroup == 0 {
		c.NflogGroup = 2718
	}
	if c.JournalEvents <= 0 {
		c.JournalEvents = 4096
	}
	if c.DNSRate <= 0 {
		c.DNSRate = 50
	}
	if c.DNSBurst <= 0 {
		c.DNSBurst = 100
	}
	if c.PinMin <= 0 {
		c.PinMin = 60 * time.Second
	}
	if c.PinMax < c.PinMin {
		c.PinMax = max(time.Hour, c.PinMin)
	}
	if c.ProxyConnsPerSandbox <= 0 {
		c.ProxyConnsPerSandbox = 256
	}
	return nil
}

// Manager owns the networking of the sandboxes of one node.
type Manager struct {
	cfg    Config
	log    *slog.Logger
	host   *NS
	uplink string
	ups    []string
	ca     *CA
	audit  *auditor

	// breakNextApply makes the next policy batch carry a rule the kernel refuses
	// (tests: a refused batch must leave the previous policy in force).
	breakNextApply atomic.Bool

	mu        sync.Mutex
	sandboxes map[string]*sandbox
	addrs     map[netip.Addr]string // sandbox address → id (allocated or found)
	closed    bool
}

// Attachment is what a runtime needs to put a sandbox on its network.
type Attachment struct {
	ID string
	// Netns is the path of the sandbox's pinned network namespace: the runtime starts
	// the sandbox in it (OCI linux.namespaces {"type":"network","path":Netns}).
	Netns string
	// Interface is the sandbox's interface in Netns ("eth0"), Address its address and
	// prefix, Gateway the default gateway, which is also the DNS resolver.
	Interface string
	Address   netip.Prefix
	Gateway   netip.Addr
	// MAC is Interface's hardware address.
	MAC string
	// CACertPEM is the node's egress CA, set when the policy has header rules: install
	// it in the sandbox's trust store, or HTTPS to those domains fails verification.
	CACertPEM []byte
}

// ResolvConf is the resolv.conf the sandbox should use.
func (a *Attachment) ResolvConf() string {
	return "nameserver " + a.Gateway.String() + "\noptions edns0 trust-ad\n"
}

// sandbox is the state of one sandbox's networking.
type sandbox struct {
	id     string
	nsPath string
	hostIf string
	table  string
	addr   netip.Addr
	gw     netip.Addr
	mac    string

	mu     sync.Mutex // serialises policy changes and pin updates
	dead   bool       // torn down (or its setup failed): a waiter must not use it
	policy *Policy
	gen    uint32
	pins   *pinTable

	dns   *dnsServer
	proxy *sandboxProxy
	jr    *Journal
}

var idRE = regexp.MustCompile(`^[a-z0-9]{1,40}$`)

// New starts a manager: it checks the host namespace, enables forwarding and conntrack
// accounting in it, finds the uplink and the resolvers, starts the audit listeners and
// takes note of the namespaces earlier runs left (their addresses stay reserved until
// Setup adopts them or Teardown/Reconcile removes them).
func New(ctx context.Context, cfg Config) (*Manager, error) {
	if err := cfg.defaults(); err != nil {
		return nil, fault.Wrap(fault.Invalid, err)
	}
	host, err := OpenNS(cfg.HostNetns)
	if err != nil {
		return nil, err
	}
	m := &Manager{cfg: cfg, log: cfg.Logger, host: host,
		sandboxes: map[string]*sandbox{}, addrs: map[netip.Addr]string{}}
	ok := false
	defer func() {
		if !ok {
			m.Close()
		}
	}()
	if err := os.MkdirAll(cfg.NetnsDir, 0o755); err != nil {
		return nil, fmt.Errorf("network: %w", err)
	}
	if m.uplink, err = m.findUplink(); err != nil {
		return nil, err
	}
	if m.ups, err = upstreams(cfg.Upstreams); err != nil {
		return nil, err
	}
	for _, s := range [][2]string{{"net/ipv4/ip_forward", "1"}, {"net/netfilter/nf_conntrack_acct", "1"}} {
		if err := host.WriteSysctl(s[0], s[1]); err != nil {
			return nil, fmt.Errorf("network: %w", err)
		}
	}
	if m.ca, err = LoadOrCreateCA(cfg.CADir); err != nil {
		return nil, err
	}
	if m.audit, err = startAuditor(ctx, m); err != nil {
		return nil, err
	}
	if err := m.scan(); err != nil {
		return nil, err
	}
	ok = true
	return m, nil
}

// Close stops the resolvers, proxies and audit listeners. Namespaces and rules stay:
// sandboxes keep their (already admitted) connections while space restarts, and the
// next manager adopts them with Setup.
func (m *Manager) Close() error {
	m.mu.Lock()
	m.closed = true
	sbs := make([]*sandbox, 0, len(m.sandboxes))
	for _, sb := range m.sandboxes {
		sbs = append(sbs, sb)
	}
	m.mu.Unlock()
	for _, sb := range sbs {
		sb.mu.Lock()
		sb.stopServices()
		sb.mu.Unlock()
	}
	if m.audit != nil {
		m.audit.close()
	}
	return m.host.Close()
}

// CACertPEM returns the node's egress CA certificate.
func (m *Manager) CACertPEM() []byte { return m.ca.CertPEM() }

// Uplink returns the interface egress leaves by.
func (m *Manager) Uplink() string { return m.uplink }

func (m *Manager) findUplink() (string, error) {
	h, err := m.host.netlink()
	if err != nil {
		return "", fmt.Errorf("network: netlink: %w", err)
	}
	defer h.Close()
	if m.cfg.Uplink != "" {
		if _, err := h.LinkByName(m.cfg.Uplink); err != nil {
			return "", fault.New(fault.Invalid, "network: egress interface %q: %v", m.cfg.Uplink, err)
		}
		return m.cfg.Uplink, nil
	}
	routes, err := dump(func() ([]netlink.Route, error) { return h.RouteList(nil, netlink.FAMILY_V4) })
	if err != nil {
		return "", fmt.Errorf("network: list routes: %w", err)
	}
	for _, r := range routes {
		if (r.Dst == nil || r.Dst.String() == "0.0.0.0/0") && r.LinkIndex > 0 {
			l, err := h.LinkByIndex(r.LinkIndex)
			if err != nil {
				return "", fmt.Errorf("network: default route's link: %w", err)
			}
			return l.Attrs().Name, nil
		}
	}
	return "", fault.New(fault.Unavailable, "network: no default route: set the egress interface")
}

func (m *Manager) forbidden() (*netipx.IPSet, error) {
	hostAddrs, err := m.hostAddrs()
	if err != nil {
		return nil, err
	}
	return forbiddenSet(m.cfg.AllowPrivate, append(hostAddrs, m.cfg.Pool)...), nil
}

// dumpTries bounds the tries of a netlink dump that the kernel interrupts.
const dumpTries = 5

// dump runs a netlink dump (a list of addresses, routes) again when the kernel says it
// was interrupted (netlink.ErrDumpInterrupted: the table changed while it was read,
// and the list may miss entries), up to dumpTries times. Several sandboxes set up at
// once change the host's links and addresses all the time: an interrupted list of the
// host's addresses failed a sandbox's network set-up (seen under an E2B SDK burst:
// "list host addresses: results may be incomplete or inconsistent"; the node booted
// the sandbox instead of restoring it).
func dump[T any](list func() ([]T, error)) ([]T, error) {
	for try := 1; ; try++ {
		out, err := list()
		if !errors.Is(err, netlink.ErrDumpInterrupted) || try == dumpTries {
			return out, err
		}
	}
}

// hostAddrs lists the host namespace's own addresses as host prefixes.
func (m *Manager) hostAddrs() ([]netip.Prefix, error) {
	h, err := m.host.netlink()
	if err != nil {
		return nil, fmt.Errorf("network: netlink: %w", err)
	}
	defer h.Close()
	list, err := dump(func() ([]netlink.Addr, error) { return h.AddrList(nil, netlink.FAMILY_ALL) })
	if err != nil {
		return nil, fmt.Errorf("network: list host addresses: %w", err)
	}
	var out []netip.Prefix
	for _, a := range list {
		if ip, ok := netip.AddrFromSlice(a.IP); ok {
			ip = ip.Unmap()
			out = append(out, netip.PrefixFrom(ip, ip.BitLen()))
		}
	}
	return out, nil
}

// Compile validates a spec against this node's always-denied ranges (see Compile).
func (m *Manager) Compile(spec *api.Network) (*Policy, error) {
	return Compile(spec, forbiddenSet(m.cfg.AllowPrivate, m.cfg.Pool))
}

// Setup creates (or finds again) the sandbox's namespace, veth and address, starts its
// resolver and proxy, and applies the policy of spec (nil: no network). It is
// idempotent: calling it again with the same id adopts what exists. Call it before a
// runtime starts or restores the sandbox: it also gives the sandbox end back its
// address and default route, which a runtime with its own network stack (gVisor's
// netstack) takes off the interface when it starts. A failure undoes what this call
// made.
func (m *Manager) Setup(ctx context.Context, id string, spec *api.Network) (*Attachment, error) {
	return m.setup(ctx, id, spec, true)
}

// Adopt is Setup for a sandbox that may be running: it finds the namespace and veth
// again (repairing what is missing), restarts the resolver and proxy and applies the
// policy, but leaves the addresses of the sandbox end as they are (a running gVisor
// sandbox owns its interface; an address given back to the kernel there would make
// the host answer for the sandbox). A restarted node calls it for every sandbox it
// keeps.
func (m *Manager) Adopt(ctx context.Context, id string, spec *api.Network) (*Attachment, error) {
	return m.setup(ctx, id, spec, false)
}

func (m *Manager) setup(ctx context.Context, id string, spec *api.Network, prepare bool) (*Attachment, error) {
	if !idRE.MatchString(id) {
		return nil, fault.New(fault.Invalid, "network: invalid sandbox id %q", id)
	}
	pol, err := m.Compile(spec)
	if err != nil {
		return nil, err
	}
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return nil, fault.New(fault.Unavailable, "network: manager closed")
	}
	sb := m.sandboxes[id]
	fresh := sb == nil
	if fresh {
		sb = m.newSandbox(id)
		m.sandboxes[id] = sb
	}
	m.mu.Unlock()

	sb.mu.Lock()
	defer sb.mu.Unlock()
	if sb.dead {
		return nil, fault.New(fault.Conflict, "network: sandbox %s was torn down while this setup waited", id)
	}
	// build again for a known sandbox too: it repairs what went missing (a deleted
	// veth, stopped services) and is cheap when everything is there.
	if err := m.build(ctx, sb, prepare); err != nil {
		if !fresh {
			return nil, err
		}
		m.log.Warn("network setup failed; undoing", "sandbox", id, "err", err)
		m.forget(sb)
		return nil, errors.Join(err, m.teardownNames(sb))
	}
	if err := m.applyLocked(ctx, sb, pol); err != nil {
		if fresh {
			m.forget(sb)
			return nil, errors.Join(err, m.teardownNames(sb))
		}
		return nil, err
	}
	return m.attachment(sb), nil
}

// Update replaces the policy of a running sandbox. It takes effect at once (one
// nftables transaction) and cuts the connections the new policy no longer allows. When
// it fails the previous policy stays in force.
func (m *Manager) Update(ctx context.Context, id string, spec *api.Network) error {
	pol, err := m.Compile(spec)
	if err != nil {
		return err
	}
	sb, err := m.get(id)
	if err != nil {
		return err
	}
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if sb.dead {
		return fault.New(fault.NotFound, "network: sandbox %s has no network set up", id)
	}
	return m.applyLocked(ctx, sb, pol)
}

// Policy returns the policy in force for the sandbox.
func (m *Manager) Policy(id string) (*Policy, error) {
	sb, err := m.get(id)
	if err != nil {
		return nil, err
	}
	sb.mu.Lock()
	defer sb.mu.Unlock()
	return sb.policy, nil
}

// Attachment returns the sandbox's attachment (as Setup did).
func (m *Manager) Attachment(id string) (*Attachment, error) {
	sb, err := m.get(id)
	if err != nil {
		return nil, err
	}
	sb.mu.Lock()
	defer sb.mu.Unlock()
	return m.attachment(sb), nil
}

func (m *Manager) get(id string) (*sandbox, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	sb := m.sandboxes[id]
	if sb == nil {
		return nil, fault.New(fault.NotFound, "network: sandbox %s has no network set up", id)
	}
	return sb, nil
}

// DialSandbox connects from the host to a port of the sandbox (TCP). This is how
// inbound traffic reaches a sandbox: through space (the data plane or the E2B port
// routing dials here), never by giving the sandbox a routable address.
func (m *Manager) DialSandbox(ctx context.Context, id string, port uint16) (net.Conn, error) {
	sb, err := m.get(id)
	if err != nil {
		return nil, err
	}
	sb.mu.Lock()
	addr, gw := sb.addr, sb.gw
	sb.mu.Unlock()
	d := &net.Dialer{Timeout: 10 * time.Second, LocalAddr: &net.TCPAddr{IP: gw.AsSlice()}}
	c, err := m.host.Dial(ctx, d, "tcp4", netip.AddrPortFrom(addr, port).String())
	if err != nil {
		return nil, fault.Wrap(fault.Unavailable, fmt.Errorf("network: dial sandbox %s port %d: %w", id, port, err))
	}
	return c, nil
}

// Teardown removes everything of the sandbox's networking: services, rules, the veth,
// the namespace pin, its conntrack entries and its address. It works from the id alone,
// so it also removes what a crashed earlier run left; a missing piece is not an error.
func (m *Manager) Teardown(ctx context.Context, id string) error {
	if !idRE.MatchString(id) {
		return fault.New(fault.Invalid, "network: invalid sandbox id %q", id)
	}
	m.mu.Lock()
	sb := m.sandboxes[id]
	m.mu.Unlock()
	if sb == nil {
		sb = m.newSandbox(id)
	}
	sb.mu.Lock()
	defer sb.mu.Unlock()
	sb.stopServices()
	err := m.teardownNames(sb)
	m.forget(sb)
	if m.audit != nil {
		m.audit.forget(sb)
	}
	return err
}

// List returns the ids of the sandboxes that have networking on this host: set up by
// this manager or left by an earlier run (namespace pins and nftables tables).
func (m *Manager) List(ctx context.Context) ([]string, error) {
	ids := map[string]bool{}
	m.mu.Lock()
	for id := range m.sandboxes {
		ids[id] = true
	}
	m.mu.Unlock()
	ents, err := os.ReadDir(m.cfg.NetnsDir)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("network: list %s: %w", m.cfg.NetnsDir, err)
	}
	for _, e := range ents {
		if id, ok := strings.CutPrefix(e.Name(), m.cfg.Prefix); ok && idRE.MatchString(id) {
			ids[id] = true
		}
	}
	c, err := m.nft()
	if err != nil {
		return nil, err
	}
	tables, err := listTables(c, m.tablePrefix())
	if err != nil {
		return nil, err
	}
	for _, t := range tables {
		if id := strings.TrimPrefix(t, m.tablePrefix()); idRE.MatchString(id) {
			ids[id] = true
		}
	}
	out := make([]string, 0, len(ids))
	for id := range ids {
		out = append(out, id)
	}
	sort.Strings(out)
	return out, nil
}

// Reconcile tears down the networking of every sandbox on this host that keep does
// not want (leftovers of deleted sandboxes or of crashed runs) and returns their ids.
func (m *Manager) Reconcile(ctx context.Context, keep func(id string) bool) ([]string, error) {
	ids, err := m.List(ctx)
	if err != nil {
		return nil, err
	}
	var removed []string
	var errs []error
	for _, id := range ids {
		if keep(id) {
			continue
		}
		if err := m.Teardown(ctx, id); err != nil {
			errs = append(errs, fmt.Errorf("sandbox %s: %w", id, err))
			continue
		}
		removed = append(removed, id)
	}
	return removed, errors.Join(errs...)
}

func (m *Manager) tablePrefix() string { return strings.ReplaceAll(m.cfg.Prefix, "-", "_") }

func (m *Manager) newSandbox(id string) *sandbox {
	sum := sha256.Sum256([]byte(id))
	h := strings.ToLower(base32.StdEncoding.WithPadding(base32.NoPadding).EncodeToString(sum[:]))
	return &sandbox{
		id:     id,
		nsPath: filepath.Join(m.cfg.NetnsDir, m.cfg.Prefix+id),
		hostIf: "sp" + h[:13],
		table:  m.tablePrefix() + id,
		pins:   newPinTable(maxPins),
		jr:     NewJournal(m.cfg.JournalEvents),
	}
}

func (m *Manager) forget(sb *sandbox) {
	sb.dead = true
	sb.stopServices()
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.sandboxes[sb.id] == sb {
		delete(m.sandboxes, sb.id)
	}
	if sb.addr.IsValid() && m.addrs[sb.addr] == sb.id {
		delete(m.addrs, sb.addr)
	}
}

func (m *Manager) nft() (*nftables.Conn, error) {
	var opts []nftables.ConnOption
	if fd := m.host.FD(); fd != 0 {
		opts = append(opts, nftables.WithNetNSFd(fd))
	}
	c, err := nftables.New(opts...)
	if err != nil {
		return nil, fmt.Errorf("network: nftables: %w", err)
	}
	return c, nil
}

const sandboxIf = "eth0"

// build makes (or finds) the namespace, the veth pair and the addresses, and starts the
// sandbox's resolver and proxy listeners. With prepare, the sandbox end is given its
// address and default route again if it lost them (see Setup).
func (m *Manager) build(ctx context.Context, sb *sandbox, prepare bool) error {
	if !isPinnedNS(sb.nsPath) {
		if err := removePinnedNS(sb.nsPath); err != nil { // a stale file from a crash
			return err
		}
		if err := createPinnedNS(sb.nsPath); err != nil {
			return fmt.Errorf("network: %w", err)
		}
	}
	sbns, err := OpenNS(sb.nsPath)
	if err != nil {
		return err
	}
	defer sbns.Close()
	hh, err := m.host.netlink()
	if err != nil {
		return fmt.Errorf("network: netlink: %w", err)
	}
	defer hh.Close()
	sh, err := sbns.netlink()
	if err != nil {
		return fmt.Errorf("network: netlink in sandbox netns: %w", err)
	}
	defer sh.Close()

	// Adopt: both ends exist and the host end carries the gateway address (the sandbox
	// end may have lost its address to a runtime's own network stack).
	if a, mac, ok := m.findPair(hh, sh, sb); ok && m.reserve(a, sb.id) {
		sb.addr, sb.gw, sb.mac = a, a.Prev(), mac
		if prepare {
			if err := m.restoreSandboxEnd(sh, sb); err != nil {
				return err
			}
		}
	}
	if !sb.addr.IsValid() {
		if err := m.makeVeth(hh, sh, sbns, sb); err != nil {
			return err
		}
	}
	if err := m.host.WriteSysctl("net/ipv6/conf/"+sb.hostIf+"/disable_ipv6", "1"); err != nil {
		return fmt.Errorf("network: %w", err)
	}
	for _, k := range []string{"all", "default", sandboxIf} {
		if err := sbns.WriteSysctl("net/ipv6/conf/"+k+"/disable_ipv6", "1"); err != nil {
			return fmt.Errorf("network: %w", err)
		}
	}
	return m.startServices(ctx, sb)
}

// findPair finds the sandbox's veth pair: the host end with its gateway address in the
// pool, the sandbox end (eth0) in the sandbox namespace. It returns the sandbox's
// address (the gateway's successor in its /30) and the sandbox end's MAC.
func (m *Manager) findPair(hh, sh *netlink.Handle, sb *sandbox) (netip.Addr, string, bool) {
	gw, ok := m.findHostAddr(hh, sb.hostIf)
	if !ok {
		return netip.Addr{}, "", false
	}
	l, err := sh.LinkByName(sandboxIf)
	if err != nil {
		return netip.Addr{}, "", false
	}
	return gw.Next(), l.Attrs().HardwareAddr.String(), true
}

// findHostAddr returns the pool address (a sandbox's gateway) of host interface name.
func (m *Manager) findHostAddr(hh *netlink.Handle, name string) (netip.Addr, bool) {
	l, err := hh.LinkByName(name)
	if err != nil {
		return netip.Addr{}, false
	}
	addrs, err := dump(func() ([]netlink.Addr, error) { return hh.AddrList(l, netlink.FAMILY_V4) })
	if err != nil {
		return netip.Addr{}, false
	}
	for _, a := range addrs {
		ip, ok := netip.AddrFromSlice(a.IP)
		if ip = ip.Unmap(); ok && m.cfg.Pool.Contains(ip) {
			return ip, true
		}
	}
	return netip.Addr{}, false
}

// restoreSandboxEnd gives the sandbox end its address, link state and default route
// again where they are missing.
func (m *Manager) restoreSandboxEnd(sh *netlink.Handle, sb *sandbox) error {
	peer, err := sh.LinkByName(sandboxIf)
	if err != nil {
		return fmt.Errorf("network: sandbox end: %w", err)
	}
	if a, _, ok := m.findSandboxAddr(sh); !ok || a != sb.addr {
		if err := sh.AddrReplace(peer, &netlink.Addr{IPNet: prefixNet(netip.PrefixFrom(sb.addr, 30))}); err != nil {
			return fmt.Errorf("network: sandbox address: %w", err)
		}
	}
	if lo, err := sh.LinkByName("lo"); err == nil {
		_ = sh.LinkSetUp(lo)
	}
	if err := sh.LinkSetUp(peer); err != nil {
		return fmt.Errorf("network: up sandbox end: %w", err)
	}
	if err := sh.RouteReplace(&netlink.Route{LinkIndex: peer.Attrs().Index, Gw: sb.gw.AsSlice()}); err != nil {
		return fmt.Errorf("network: default route: %w", err)
	}
	return nil
}

// findSandboxAddr returns the pool address of eth0 in the sandbox namespace, if any.
func (m *Manager) findSandboxAddr(sh *netlink.Handle) (netip.Addr, string, bool) {
	l, err := sh.LinkByName(sandboxIf)
	if err != nil {
		return netip.Addr{}, "", false
	}
	addrs, err := sh.AddrList(l, netlink.FAMILY_V4)
	if err != nil {
		return netip.Addr{}, "", false
	}
	for _, a := range addrs {
		ip, ok := netip.AddrFromSlice(a.IP)
		if ok && m.cfg.Pool.Contains(ip.Unmap()) {
			return ip.Unmap(), l.Attrs().HardwareAddr.String(), true
		}
	}
	return netip.Addr{}, "", false
}

// reserve records a as the sandbox's address unless another sandbox holds it.
func (m *Manager) reserve(a netip.Addr, id string) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	if other, ok := m.addrs[a]; ok && other != id {
		return false
	}
	m.addrs[a] = id
	return true
}

// allocate takes a free /30 from the pool and returns its second address.
func (m *Manager) allocate(id string) (netip.Addr, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	base, _ := ip4u32(m.cfg.Pool.Addr())
	n := uint32(1) << (32 - m.cfg.Pool.Bits()) / 4
	for i := uint32(0); i < n; i++ {
		var b [4]byte
		binary.BigEndian.PutUint32(b[:], base+4*i+2)
		a := netip.AddrFrom4(b)
		if _, used := m.addrs[a]; !used {
			m.addrs[a] = id
			return a, nil
		}
	}
	return netip.Addr{}, fault.New(fault.Unavailable, "network: address pool %s exhausted", m.cfg.Pool)
}

func (m *Manager) makeVeth(hh, sh *netlink.Handle, sbns *NS, sb *sandbox) error {
	// A host end without its peer (or with a peer elsewhere) is replaced.
	if l, err := hh.LinkByName(sb.hostIf); err == nil {
		if err := hh.LinkDel(l); err != nil {
			return fmt.Errorf("network: remove stale veth %s: %w", sb.hostIf, err)
		}
	}
	if l, err := sh.LinkByName(sandboxIf); err == nil {
		_ = sh.LinkDel(l)
	}
	a, err := m.allocate(sb.id)
	if err != nil {
		return err
	}
	sb.addr, sb.gw = a, a.Prev()
	veth := &netlink.Veth{
		LinkAttrs:     netlink.LinkAttrs{Name: sb.hostIf, MTU: 1500},
		PeerName:      sandboxIf,
		PeerNamespace: netlink.NsFd(sbns.FD()),
	}
	if err := hh.LinkAdd(veth); err != nil {
		return fmt.Errorf("network: create veth %s: %w", sb.hostIf, err)
	}
	host, err := hh.LinkByName(sb.hostIf)
	if err != nil {
		return fmt.Errorf("network: veth %s: %w", sb.hostIf, err)
	}
	_ = hh.LinkSetAlias(host, "space:"+sb.id)
	gw := &netlink.Addr{IPNet: prefixNet(netip.PrefixFrom(sb.gw, 30))}
	if err := hh.AddrAdd(host, gw); err != nil {
		return fmt.Errorf("network: address %s on %s: %w", sb.gw, sb.hostIf, err)
	}
	if err := hh.LinkSetUp(host); err != nil {
		return fmt.Errorf("network: up %s: %w", sb.hostIf, err)
	}
	peer, err := sh.LinkByName(sandboxIf)
	if err != nil {
		return fmt.Errorf("network: sandbox end: %w", err)
	}
	sb.mac = peer.Attrs().HardwareAddr.String()
	if err := sh.AddrAdd(peer, &netlink.Addr{IPNet: prefixNet(netip.PrefixFrom(sb.addr, 30))}); err != nil {
		return fmt.Errorf("network: sandbox address: %w", err)
	}
	if lo, err := sh.LinkByName("lo"); err == nil {
		_ = sh.LinkSetUp(lo)
	}
	if err := sh.LinkSetUp(peer); err != nil {
		return fmt.Errorf("network: up sandbox end: %w", err)
	}
	if err := sh.RouteAdd(&netlink.Route{LinkIndex: peer.Attrs().Index, Gw: sb.gw.AsSlice()}); err != nil {
		return fmt.Errorf("network: default route: %w", err)
	}
	return nil
}

// applyLocked replaces the sandbox's rules with pol's, then cuts what pol no longer
// allows. sb.mu is held.
func (m *Manager) applyLocked(ctx context.Context, sb *sandbox, pol *Policy) error {
	forbidden, err := m.forbidden()
	if err != nil {
		return err
	}
	gen := randomGen(sb.gen)
	now := time.Now()
	keep := sb.pins.retain(now, func(name string) (bool, bool) {
		return pol.Name(name) == NamePinned, pol.HeaderRules(name) != nil
	})
	r := &ruleset{
		table:     sb.table,
		hostIf:    sb.hostIf,
		uplink:    m.uplink,
		addr:      sb.addr,
		gw:        sb.gw,
		gen:       gen,
		policy:    pol,
		forbidden: forbidden,
		nflog:     m.cfg.NflogGroup,
		logPrefix: sb.id,
		pins:      keep,
	}
	if sb.proxy != nil {
		if len(pol.Rules) > 0 {
			r.tlsPort = sb.proxy.tlsPort()
		}
		if pol.Proxy != nil {
			r.tcpPort = sb.proxy.tcpPort()
		}
	}
	c, err := m.nft()
	if err != nil {
		return err
	}
	if err := r.apply(c); err != nil {
		return fmt.Errorf("network: build rules: %w", err)
	}
	if m.breakNextApply.Swap(false) {
		t := &nftables.Table{Family: nftables.TableFamilyIPv4, Name: sb.table}
		c.AddRule(&nftables.Rule{Table: t, Chain: &nftables.Chain{Name: "policy", Table: t},
			Exprs: jump("no_such_chain")})
	}
	if err := c.Flush(); err != nil {
		return fmt.Errorf("network: apply rules for %s (previous policy still in force): %w", sb.id, err)
	}
	sb.pins.commitRetain(keep)
	sb.policy, sb.gen = pol, gen
	if sb.dns != nil {
		sb.dns.policy.Store(pol)
	}
	m.log.Info("network policy applied", "sandbox", sb.id, "policy", pol.String())
	m.revalidate(sb, pol, forbidden)
	return nil
}

// BreakNextApply is a test hook: the next policy batch carries a rule the kernel
// refuses, as a kernel that rejects a batch mid-update would. Tests use it to show that
// a refused change leaves the previous policy in force and is reported.
func (m *Manager) BreakNextApply() { m.breakNextApply.Store(true) }

func randomGen(prev uint32) uint32 {
	for {
		var b [4]byte
		_, _ = rand.Read(b[:])
		g := binary.LittleEndian.Uint32(b[:])
		if g != 0 && g != prev {
			return g
		}
	}
}

func (m *Manager) attachment(sb *sandbox) *Attachment {
	a := &Attachment{
		ID: sb.id, Netns: sb.nsPath, Interface: sandboxIf,
		Address: netip.PrefixFrom(sb.addr, 30), Gateway: sb.gw, MAC: sb.mac,
	}
	if sb.policy != nil && len(sb.policy.Rules) > 0 {
		a.CACertPEM = m.ca.CertPEM()
	}
	return a
}

// teardownNames removes everything that can be found from the sandbox's names.
func (m *Manager) teardownNames(sb *sandbox) error {
	var errs []error
	if c, err := m.nft(); err != nil {
		errs = append(errs, err)
	} else {
		deleteTables(c, sb.table)
		if err := c.Flush(); err != nil {
			errs = append(errs, fmt.Errorf("network: delete rules of %s: %w", sb.id, err))
		}
	}
	if hh, err := m.host.netlink(); err != nil {
		errs = append(errs, err)
	} else {
		if l, err := hh.LinkByName(sb.hostIf); err == nil {
			if err := hh.LinkDel(l); err != nil {
				errs = append(errs, fmt.Errorf("network: delete veth %s: %w", sb.hostIf, err))
			}
		}
		hh.Close()
	}
	if sb.addr.IsValid() {
		if err := m.flushConntrack(sb.addr); err != nil {
			errs = append(errs, err)
		}
	}
	if err := removePinnedNS(sb.nsPath); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// scan reserves the addresses of the namespaces earlier runs left.
func (m *Manager) scan() error {
	ents, err := os.ReadDir(m.cfg.NetnsDir)
	if err != nil {
		return fmt.Errorf("network: scan %s: %w", m.cfg.NetnsDir, err)
	}
	hh, err := m.host.netlink()
	if err != nil {
		return fmt.Errorf("network: netlink: %w", err)
	}
	defer hh.Close()
	for _, e := range ents {
		id, ok := strings.CutPrefix(e.Name(), m.cfg.Prefix)
		if !ok || !idRE.MatchString(id) {
			continue
		}
		p := filepath.Join(m.cfg.NetnsDir, e.Name())
		if !isPinnedNS(p) {
			continue
		}
		// The host end keeps the gateway address whatever the runtime did to the
		// sandbox end; the sandbox end's address is the fallback.
		if gw, ok := m.findHostAddr(hh, m.newSandbox(id).hostIf); ok {
			m.reserve(gw.Next(), id)
			continue
		}
		ns, err := OpenNS(p)
		if err != nil {
			continue
		}
		if sh, err := ns.netlink(); err == nil {
			if a, _, ok := m.findSandboxAddr(sh); ok {
				m.reserve(a, id)
			}
			sh.Close()
		}
		ns.Close()
	}
	return nil
}

func prefixNet(p netip.Prefix) *net.IPNet {
	return &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
}
