package network

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"time"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"go4.org/netipx"
	"golang.org/x/sys/unix"
)

// The rules of one sandbox live in two tables of the host namespace named after it:
// "ip <prefix><id>" (the policy) and "ip6 <prefix><id>" (drops every IPv6 packet the
// sandbox sends). A table is replaced whole in one nftables transaction, so a policy
// change is atomic: packets see the old rules or the new ones, never a mix, and a batch
// the kernel refuses leaves the old ones in force.
//
// Packet path for traffic from the sandbox's veth (iif = host end):
//
//	prerouting -300 "guard": drop IPv4 fragments the defragmenter left, spoofed sources
//	prerouting -100 "dnat":  redirect HTTPS to header-rule domains (and, with a SOCKS5
//	                         upstream, every TCP connection) to the node's egress proxy
//	input 0 "in":            only the resolver (gateway:53) and the proxy (redirected
//	                         connections, checked by "policy") reach the host
//	forward 0 "fwd":         only out of the uplink; "policy" decides; nothing new enters
//	postrouting 100 "snat":  masquerade out of the uplink
//
// "policy" works on the connection's original destination (ct original daddr), so a
// redirected connection is judged like a routed one. Every packet of a connection that
// was admitted by an older policy is judged again (its conntrack mark holds the policy
// generation that admitted it), so tightening a policy cuts established flows: TCP gets
// a reset, the rest an ICMP "administratively prohibited".

// Set names.
const (
	setForbidden = "forbidden" // always denied (interval)
	setAllow     = "allow"     // allow_out CIDRs (interval)
	setDeny      = "deny"      // deny_out CIDRs (interval)
	setPin       = "pin"       // addresses the resolver answered for allowed domains (timeout)
	setIntercept = "intercept" // addresses of header-rule domains: HTTPS goes to the proxy (timeout)
)

// maxPins bounds the pinned addresses of one sandbox (kernel set size and resolver).
const maxPins = 4096

// ruleset is everything the tables of one sandbox are made from.
type ruleset struct {
	table     string     // table name
	hostIf    string     // host end of the veth
	uplink    string     // egress interface
	addr      netip.Addr // the sandbox's address
	gw        netip.Addr // the host end's address: resolver and proxy
	gen       uint32     // policy generation (conntrack mark of admitted flows)
	policy    *Policy
	forbidden *netipx.IPSet
	tlsPort   uint16 // proxy port for intercepted HTTPS
	tcpPort   uint16 // proxy port for SOCKS5 mode (every TCP connection)
	nflog     uint16 // nflog group of denied attempts
	logPrefix string // "<id>" : the audit reader maps log lines back to the sandbox
	pins      []pinElem
}

type pinElem struct {
	addr      netip.Addr
	ttl       time.Duration
	intercept bool
}

// apply queues the atomic replacement of the sandbox's tables on c.
func (r *ruleset) apply(c *nftables.Conn) error {
	t4 := &nftables.Table{Family: nftables.TableFamilyIPv4, Name: r.table}
	t6 := &nftables.Table{Family: nftables.TableFamilyIPv6, Name: r.table}
	// "add; delete; add" replaces a table whether or not it existed, in one batch.
	for _, t := range []*nftables.Table{t4, t6} {
		c.AddTable(t)
		c.DelTable(t)
		c.AddTable(t)
	}
	r.buildV6(c, t6)
	return r.buildV4(c, t4)
}

func (r *ruleset) buildV6(c *nftables.Conn, t *nftables.Table) {
	for _, h := range []struct {
		name string
		hook *nftables.ChainHook
	}{{"pre", nftables.ChainHookPrerouting}, {"fwd", nftables.ChainHookForward}} {
		ch := c.AddChain(&nftables.Chain{Name: h.name, Table: t, Type: nftables.ChainTypeFilter,
			Hooknum: h.hook, Priority: nftables.ChainPriorityRef(-300)})
		c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: cat(iifname(r.hostIf), verdict(expr.VerdictDrop))})
		c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: cat(oifname(r.hostIf), verdict(expr.VerdictDrop))})
	}
}

func (r *ruleset) buildV4(c *nftables.Conn, t *nftables.Table) error {
	// Sets.
	forbidden, err := r.addIntervalSet(c, t, setForbidden, r.forbidden)
	if err != nil {
		return err
	}
	allow, err := r.addIntervalSet(c, t, setAllow, r.policy.Allow)
	if err != nil {
		return err
	}
	deny, err := r.addIntervalSet(c, t, setDeny, r.policy.Deny)
	if err != nil {
		return err
	}
	pin := &nftables.Set{Table: t, Name: setPin, KeyType: nftables.TypeIPAddr, HasTimeout: true, Size: maxPins}
	icpt := &nftables.Set{Table: t, Name: setIntercept, KeyType: nftables.TypeIPAddr, HasTimeout: true, Size: maxPins}
	var pinEls, icptEls []nftables.SetElement
	for _, p := range r.pins {
		el := nftables.SetElement{Key: p.addr.AsSlice(), Timeout: p.ttl}
		pinEls = append(pinEls, el)
		if p.intercept {
			icptEls = append(icptEls, el)
		}
	}
	if err := c.AddSet(pin, pinEls); err != nil {
		return fmt.Errorf("pin set: %w", err)
	}
	if err := c.AddSet(icpt, icptEls); err != nil {
		return fmt.Errorf("intercept set: %w", err)
	}

	add := func(ch *nftables.Chain, e ...[]expr.Any) {
		c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: cat(e...)})
	}
	chain := func(name string) *nftables.Chain {
		return c.AddChain(&nftables.Chain{Name: name, Table: t})
	}
	base := func(name string, typ nftables.ChainType, hook *nftables.ChainHook, prio int32) *nftables.Chain {
		return c.AddChain(&nftables.Chain{Name: name, Table: t, Type: typ, Hooknum: hook,
			Priority: nftables.ChainPriorityRef(nftables.ChainPriority(prio))})
	}

	// Regular chains first: base chains jump to them.
	reject := chain("reject")
	add(reject, l4proto(protoTCP), []expr.Any{&expr.Reject{Type: unix.NFT_REJECT_TCP_RST}})
	add(reject, []expr.Any{&expr.Reject{Type: unix.NFT_REJECT_ICMP_UNREACH, Code: 13}}) // communication administratively prohibited
	add(reject, verdict(expr.VerdictDrop))

	deny1 := func(ch *nftables.Chain, reason string, match ...[]expr.Any) {
		// Log the first packet of an attempt (rate-limited), then reject.
		add(ch, cat(match...), ctState(expr.CtStateBitNEW|expr.CtStateBitUNTRACKED), r.logExpr(reason), goTo("reject"))
		add(ch, cat(match...), goTo("reject"))
	}
	admit := chain("admit")
	add(admit, setCtMark(r.gen), verdict(expr.VerdictAccept))

	policy := chain("policy")
	deny1(policy, ReasonForbidden, ctOrigDaddrIn(forbidden))
	add(policy, ctState(expr.CtStateBitESTABLISHED|expr.CtStateBitRELATED), ctMarkIs(r.gen), verdict(expr.VerdictAccept))
	if !r.policy.Egress {
		deny1(policy, ReasonNoEgress)
	} else {
		for _, port := range []uint16{53, 853} {
			deny1(policy, ReasonDNSOther, l4proto(protoTCP), ctOrigDport(port))
			deny1(policy, ReasonDNSOther, l4proto(protoUDP), ctOrigDport(port))
		}
		add(policy, ctOrigDaddrIn(allow), goTo("admit"))
		add(policy, l4proto(protoTCP), ctOrigDaddrIn(pin), goTo("admit"))
		add(policy, l4proto(protoUDP), ctOrigDaddrIn(pin), goTo("admit"))
		deny1(policy, ReasonDenyOut, ctOrigDaddrIn(deny))
		if r.policy.Open {
			add(policy, goTo("admit"))
		} else {
			deny1(policy, ReasonNotAllowed)
		}
	}

	// prerouting guard: fragments and spoofed sources never get further.
	guard := base("guard", nftables.ChainTypeFilter, nftables.ChainHookPrerouting, -300)
	sb := chain("guard_sb")
	add(guard, iifname(r.hostIf), jump("guard_sb"))
	add(sb, fragment(), r.logExpr(ReasonFragment), verdict(expr.VerdictDrop))
	add(sb, saddrIsNot(r.addr), r.logExpr(ReasonSpoofed), verdict(expr.VerdictDrop))

	// dnat: redirect to the proxy.
	dnat := base("dnat", nftables.ChainTypeNAT, nftables.ChainHookPrerouting, -100)
	if r.tlsPort != 0 {
		add(dnat, iifname(r.hostIf), l4proto(protoTCP), dport(443), daddrIn(icpt), redirect(r.tlsPort))
	}
	if r.tcpPort != 0 {
		add(dnat, iifname(r.hostIf), l4proto(protoTCP), daddrNotIn(forbidden), redirect(r.tcpPort))
	}

	// input: what the sandbox may reach on the host.
	in := base("in", nftables.ChainTypeFilter, nftables.ChainHookInput, 0)
	insb := chain("in_sb")
	add(in, iifname(r.hostIf), jump("in_sb"))
	add(insb, ctState(expr.CtStateBitINVALID), verdict(expr.VerdictDrop))
	// Replies on connections the host opened into the sandbox (DialSandbox: inbound
	// ports go through space, never by routing to the sandbox).
	add(insb, ctDirectionReply(), ctState(expr.CtStateBitESTABLISHED|expr.CtStateBitRELATED), verdict(expr.VerdictAccept))
	add(insb, daddrIs(r.gw), l4proto(protoUDP), dport(53), verdict(expr.VerdictAccept))
	add(insb, daddrIs(r.gw), l4proto(protoTCP), dport(53), verdict(expr.VerdictAccept))
	for _, p := range []uint16{r.tlsPort, r.tcpPort} {
		if p != 0 {
			add(insb, ctStatusDNAT(), daddrIs(r.gw), l4proto(protoTCP), dport(p), jump("policy"))
		}
	}
	deny1(insb, ReasonHost)

	// forward: out of the uplink only, through the policy; replies only inward.
	fwd := base("fwd", nftables.ChainTypeFilter, nftables.ChainHookForward, 0)
	out := chain("out_sb")
	add(fwd, iifname(r.hostIf), jump("out_sb"))
	add(fwd, oifname(r.hostIf), ctState(expr.CtStateBitESTABLISHED|expr.CtStateBitRELATED), verdict(expr.VerdictAccept))
	add(fwd, oifname(r.hostIf), verdict(expr.VerdictDrop))
	add(out, ctState(expr.CtStateBitINVALID), verdict(expr.VerdictDrop))
	deny1(out, ReasonRoute, oifnameNot(r.uplink))
	if r.policy.Proxy != nil {
		// With a SOCKS5 upstream every connection goes through the proxy (TCP was
		// redirected in dnat); what is routed here cannot be, so it fails closed.
		deny1(out, ReasonProxyOnly)
	}
	add(out, jump("policy"))

	// postrouting: masquerade.
	snat := base("snat", nftables.ChainTypeNAT, nftables.ChainHookPostrouting, 100)
	add(snat, saddrIs(r.addr), oifname(r.uplink), []expr.Any{&expr.Masq{}})
	return nil
}

// addIntervalSet adds an interval set holding s's IPv4 ranges.
func (r *ruleset) addIntervalSet(c *nftables.Conn, t *nftables.Table, name string, s *netipx.IPSet) (*nftables.Set, error) {
	set := &nftables.Set{Table: t, Name: name, KeyType: nftables.TypeIPAddr, Interval: true}
	var els []nftables.SetElement
	if s != nil {
		for _, rg := range s.Ranges() {
			if !rg.From().Is4() {
				continue
			}
			els = append(els, nftables.SetElement{Key: rg.From().AsSlice()})
			if next := rg.To().Next(); next.IsValid() && next.Is4() {
				els = append(els, nftables.SetElement{Key: next.AsSlice(), IntervalEnd: true})
			}
		}
	}
	if err := c.AddSet(set, els); err != nil {
		return nil, fmt.Errorf("%s set: %w", name, err)
	}
	return set, nil
}

// logExpr is a rate-limited nflog of a denied attempt, prefixed "<id> <reason>".
func (r *ruleset) logExpr(reason string) []expr.Any {
	return []expr.Any{
		&expr.Limit{Type: expr.LimitTypePkts, Rate: 20, Unit: expr.LimitTimeSecond, Burst: 50},
		&expr.Log{Key: 1<<unix.NFTA_LOG_GROUP | 1<<unix.NFTA_LOG_PREFIX, Group: r.nflog,
			Data: []byte(r.logPrefix + " " + reason)},
	}
}

// Expression helpers. Register 1 is the only register used.

func cat(parts ...[]expr.Any) []expr.Any {
	var out []expr.Any
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}

func ifnameBytes(name string) []byte {
	b := make([]byte, 16)
	copy(b, name)
	return b
}

func iifname(name string) []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyIIFNAME, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: ifnameBytes(name)},
	}
}

func oifname(name string) []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyOIFNAME, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: ifnameBytes(name)},
	}
}

func oifnameNot(name string) []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyOIFNAME, Register: 1},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: ifnameBytes(name)},
	}
}

func l4proto(p byte) []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{p}},
	}
}

func dport(p uint16) []expr.Any {
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.BigEndian.PutUint16(p)},
	}
}

func ipField(off uint32) *expr.Payload {
	return &expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: off, Len: 4}
}

func saddrIs(a netip.Addr) []expr.Any {
	return []expr.Any{ipField(12), &expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: a.AsSlice()}}
}

func saddrIsNot(a netip.Addr) []expr.Any {
	return []expr.Any{ipField(12), &expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: a.AsSlice()}}
}

func daddrIs(a netip.Addr) []expr.Any {
	return []expr.Any{ipField(16), &expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: a.AsSlice()}}
}

func daddrIn(s *nftables.Set) []expr.Any {
	return []expr.Any{ipField(16), &expr.Lookup{SourceRegister: 1, SetName: s.Name, SetID: s.ID}}
}

func daddrNotIn(s *nftables.Set) []expr.Any {
	return []expr.Any{ipField(16), &expr.Lookup{SourceRegister: 1, SetName: s.Name, SetID: s.ID, Invert: true}}
}

func ctOrigDaddrIn(s *nftables.Set) []expr.Any {
	return []expr.Any{
		&expr.Ct{Key: expr.CtKeyDST, Direction: 0, Register: 1},
		&expr.Lookup{SourceRegister: 1, SetName: s.Name, SetID: s.ID},
	}
}

func ctOrigDport(p uint16) []expr.Any {
	return []expr.Any{
		&expr.Ct{Key: expr.CtKeyPROTODST, Direction: 0, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.BigEndian.PutUint16(p)},
	}
}

func ctState(bits uint32) []expr.Any {
	return []expr.Any{
		&expr.Ct{Key: expr.CtKeySTATE, Register: 1},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4,
			Mask: binaryutil.NativeEndian.PutUint32(bits), Xor: binaryutil.NativeEndian.PutUint32(0)},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: binaryutil.NativeEndian.PutUint32(0)},
	}
}

func ctDirectionReply() []expr.Any {
	return []expr.Any{
		&expr.Ct{Key: expr.CtKeyDIRECTION, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{1}}, // IP_CT_DIR_REPLY
	}
}

func ctStatusDNAT() []expr.Any {
	const ipsDstNAT = 1 << 5 // IPS_DST_NAT
	return []expr.Any{
		&expr.Ct{Key: expr.CtKeySTATUS, Register: 1},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4,
			Mask: binaryutil.NativeEndian.PutUint32(ipsDstNAT), Xor: binaryutil.NativeEndian.PutUint32(0)},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: binaryutil.NativeEndian.PutUint32(0)},
	}
}

func ctMarkIs(m uint32) []expr.Any {
	return []expr.Any{
		&expr.Ct{Key: expr.CtKeyMARK, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.NativeEndian.PutUint32(m)},
	}
}

func setCtMark(m uint32) []expr.Any {
	return []expr.Any{
		&expr.Immediate{Register: 1, Data: binaryutil.NativeEndian.PutUint32(m)},
		&expr.Ct{Key: expr.CtKeyMARK, Register: 1, SourceRegister: true},
	}
}

// fragment matches an IPv4 fragment (MF set or a non-zero offset). The conntrack
// defragmenter reassembles fragments before these rules, so a match is a fragment it
// refused (overlaps, timeouts): dropped.
func fragment() []expr.Any {
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 6, Len: 2},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 2,
			Mask: binaryutil.BigEndian.PutUint16(0x3fff), Xor: []byte{0, 0}},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: []byte{0, 0}},
	}
}

func redirect(port uint16) []expr.Any {
	return []expr.Any{
		&expr.Immediate{Register: 1, Data: binaryutil.BigEndian.PutUint16(port)},
		&expr.Redir{RegisterProtoMin: 1},
	}
}

func verdict(k expr.VerdictKind) []expr.Any { return []expr.Any{&expr.Verdict{Kind: k}} }

func jump(chain string) []expr.Any {
	return []expr.Any{&expr.Verdict{Kind: expr.VerdictJump, Chain: chain}}
}

func goTo(chain string) []expr.Any {
	return []expr.Any{&expr.Verdict{Kind: expr.VerdictGoto, Chain: chain}}
}

// deleteTables queues the removal of a sandbox's tables (both families).
func deleteTables(c *nftables.Conn, name string) {
	for _, f := range []nftables.TableFamily{nftables.TableFamilyIPv4, nftables.TableFamilyIPv6} {
		t := &nftables.Table{Family: f, Name: name}
		c.AddTable(t) // so that the delete cannot fail on a missing table
		c.DelTable(t)
	}
}

// listTables returns the names of the IPv4 tables whose name starts with prefix.
func listTables(c *nftables.Conn, prefix string) ([]string, error) {
	var out []string
	seen := map[string]bool{}
	for _, f := range []nftables.TableFamily{nftables.TableFamilyIPv4, nftables.TableFamilyIPv6} {
		ts, err := c.ListTablesOfFamily(f)
		if err != nil {
			return nil, fmt.Errorf("list nftables tables: %w", err)
		}
		for _, t := range ts {
			if strings.HasPrefix(t.Name, prefix) && !seen[t.Name] {
				seen[t.Name] = true
				out = append(out, t.Name)
			}
		}
	}
	return out, nil
}

// addPins queues the addition of pinned addresses (with their timeouts) to the sets.
func addPins(c *nftables.Conn, table string, els []pinElem) error {
	t := &nftables.Table{Family: nftables.TableFamilyIPv4, Name: table}
	pin := &nftables.Set{Table: t, Name: setPin, KeyType: nftables.TypeIPAddr, HasTimeout: true}
	icpt := &nftables.Set{Table: t, Name: setIntercept, KeyType: nftables.TypeIPAddr, HasTimeout: true}
	var pe, ie []nftables.SetElement
	for _, e := range els {
		el := nftables.SetElement{Key: e.addr.AsSlice(), Timeout: e.ttl}
		pe = append(pe, el)
		if e.intercept {
			ie = append(ie, el)
		}
	}
	if err := c.SetAddElements(pin, pe); err != nil {
		return err
	}
	if len(ie) > 0 {
		return c.SetAddElements(icpt, ie)
	}
	return nil
}

var errNotIPv4 = errors.New("not an IPv4 address")

func ip4u32(a netip.Addr) (uint32, error) {
	if !a.Is4() {
		return 0, errNotIPv4
	}
	b := a.As4()
	return binary.BigEndian.Uint32(b[:]), nil
}
