package network

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	nflog "github.com/florianl/go-nflog/v2"
	mdnetlink "github.com/mdlayher/netlink"
	"github.com/ti-mo/conntrack"
	"github.com/ti-mo/netfilter"
	"go4.org/netipx"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
)

// The audit journal of a sandbox is fed from four places:
//
//   - its resolver: every DNS query, answered or refused;
//   - its proxy: every connection it carries or refuses, and their ends with bytes;
//   - nflog: the rules log the first packet of every denied attempt (rate-limited in
//     the kernel) to one nflog group, prefixed "<sandbox id> <reason>";
//   - conntrack events: a new connection the rules admitted, and its end with the byte
//     counts (conntrack accounting is switched on in the host namespace).
//
// Connections to the resolver and to the proxy are left to those (the conntrack
// entries of a redirected connection are skipped).

// Events returns the sandbox's audit journal.
func (m *Manager) Events(id string) (*Journal, error) {
	sb, err := m.get(id)
	if err != nil {
		return nil, err
	}
	return sb.jr, nil
}

type auditor struct {
	m      *Manager
	cancel context.CancelFunc
	nf     *nflog.Nflog
	ct     *conntrack.Conn // events
	q      *conntrack.Conn // queries (counters of closing flows)
	wg     sync.WaitGroup
	closed map[uint32]bool // flows whose close was recorded (TCP, at TIME_WAIT)

	forbidden   atomic.Pointer[netipx.IPSet]
	forbiddenAt atomic.Int64
	fmu         sync.Mutex
}

func startAuditor(ctx context.Context, m *Manager) (*auditor, error) {
	ctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	a := &auditor{m: m, cancel: cancel, closed: map[uint32]bool{}}
	var err error
	a.nf, err = nflog.Open(&nflog.Config{
		NetNS:    m.host.FD(),
		Group:    m.cfg.NflogGroup,
		Copymode: nflog.CopyPacket,
		Bufsize:  256,
		QThresh:  1, // deliver each logged packet at once
		Timeout:  1,
	})
	if err != nil {
		cancel()
		return nil, fmt.Errorf("network: nflog: %w", err)
	}
	_ = a.nf.SetOption(mdnetlink.NoENOBUFS, true)
	if err := a.nf.RegisterWithErrorFunc(ctx, a.onLog, func(err error) int {
		if ctx.Err() == nil {
			m.log.Debug("nflog error", "err", err)
		}
		return 0
	}); err != nil {
		a.nf.Close()
		cancel()
		return nil, fmt.Errorf("network: nflog register: %w", err)
	}
	a.q, err = conntrack.Dial(&mdnetlink.Config{NetNS: m.host.FD()})
	if err != nil {
		a.nf.Close()
		cancel()
		return nil, fmt.Errorf("network: conntrack: %w", err)
	}
	a.ct, err = conntrack.Dial(&mdnetlink.Config{NetNS: m.host.FD()})
	if err != nil {
		a.q.Close()
		a.nf.Close()
		cancel()
		return nil, fmt.Errorf("network: conntrack: %w", err)
	}
	evs := make(chan conntrack.Event, 1024)
	errs, err := a.ct.Listen(evs, 1, []netfilter.NetlinkGroup{netfilter.GroupCTNew, netfilter.GroupCTUpdate, netfilter.GroupCTDestroy})
	if err != nil {
		a.nf.Close()
		a.ct.Close()
		cancel()
		return nil, fmt.Errorf("network: conntrack events: %w", err)
	}
	a.wg.Add(1)
	go func() {
		defer a.wg.Done()
		for {
			select {
			case <-ctx.Done():
				return
			case ev := <-evs:
				a.onConntrack(ev)
			case err := <-errs:
				if err != nil && ctx.Err() == nil {
					m.log.Debug("conntrack events", "err", err)
				}
			}
		}
	}()
	return a, nil
}

func (a *auditor) close() {
	a.cancel()
	a.nf.Close()
	a.ct.Close()
	a.wg.Wait()
	a.q.Close()
}

func (a *auditor) forget(sb *sandbox) { sb.jr.close() }

// onLog turns an nflog message into a denied "connect" event.
func (a *auditor) onLog(attrs nflog.Attribute) int {
	if attrs.Prefix == nil || attrs.Payload == nil {
		return 0
	}
	id, reason, ok := strings.Cut(*attrs.Prefix, " ")
	if !ok {
		return 0
	}
	a.m.mu.Lock()
	sb := a.m.sandboxes[id]
	a.m.mu.Unlock()
	if sb == nil {
		return 0
	}
	ev := api.NetworkEvent{Kind: api.NetEventConnect, Verdict: api.NetDenied, Reason: reason}
	if attrs.Timestamp != nil {
		ev.Time = *attrs.Timestamp
	}
	ev.Protocol, ev.Destination = parsePacket(*attrs.Payload)
	if dst, err := netip.ParseAddr(strings.Split(ev.Destination, ":")[0]); err == nil {
		sb.mu.Lock()
		if names := sb.pins.lookup(dst, time.Now()); len(names) > 0 {
			ev.Domain = names[0]
		}
		sb.mu.Unlock()
	}
	sb.jr.Append(ev)
	return 0
}

// parsePacket returns the protocol and destination of an IPv4 packet.
func parsePacket(b []byte) (proto, dst string) {
	if len(b) < 20 || b[0]>>4 != 4 {
		if len(b) > 0 && b[0]>>4 == 6 {
			return "ipv6", ""
		}
		return "unknown", ""
	}
	ihl := int(b[0]&0x0f) * 4
	p := b[9]
	d := netip.AddrFrom4([4]byte{b[16], b[17], b[18], b[19]})
	proto = protoName(p)
	frag := binary.BigEndian.Uint16(b[6:8])&0x1fff != 0
	if (p == protoTCP || p == protoUDP) && !frag && len(b) >= ihl+4 {
		port := binary.BigEndian.Uint16(b[ihl+2 : ihl+4])
		return proto, netip.AddrPortFrom(d, port).String()
	}
	return proto, d.String()
}

func protoName(p uint8) string {
	switch p {
	case protoTCP:
		return "tcp"
	case protoUDP:
		return "udp"
	case protoICMP:
		return "icmp"
	}
	return strconv.Itoa(int(p))
}

// onConntrack turns admitted flows into "connect" and "close" events.
func (a *auditor) onConntrack(ev conntrack.Event) {
	if ev.Flow == nil {
		return
	}
	f := ev.Flow
	src := f.TupleOrig.IP.SourceAddress.Unmap()
	if !src.Is4() || !a.m.cfg.Pool.Contains(src) {
		return
	}
	a.m.mu.Lock()
	id := a.m.addrs[src]
	sb := a.m.sandboxes[id]
	a.m.mu.Unlock()
	if sb == nil {
		return
	}
	// The resolver's and the proxy's connections are theirs to record.
	if f.TupleOrig.IP.DestinationAddress.Unmap() == sb.gw || f.TupleReply.IP.SourceAddress.Unmap() == sb.gw {
		return
	}
	dst := f.TupleOrig.IP.DestinationAddress.Unmap()
	p := f.TupleOrig.Proto.Protocol
	e := api.NetworkEvent{Verdict: api.NetAllowed, Protocol: protoName(p), Destination: dst.String()}
	if p == protoTCP || p == protoUDP {
		e.Destination = netip.AddrPortFrom(dst, f.TupleOrig.Proto.DestinationPort).String()
	}
	sb.mu.Lock()
	if names := sb.pins.lookup(dst, time.Now()); len(names) > 0 {
		e.Domain = names[0]
	}
	pol := sb.policy
	sb.mu.Unlock()
	switch ev.Type {
	case conntrack.EventNew:
		e.Kind = api.NetEventConnect
		if pol != nil {
			e.Reason = pol.Decide(dst, p, f.TupleOrig.Proto.DestinationPort, e.Domain != "", a.m.cachedForbidden()).Reason
		}
	case conntrack.EventUpdate:
		// A TCP connection that reached TIME_WAIT or CLOSE has ended; its conntrack
		// entry lingers (TIME_WAIT lasts two minutes), so its close is recorded now,
		// with the counters asked for (update events do not carry them).
		const tcpTimeWait, tcpClose = 7, 8
		st := f.ProtoInfo.TCP
		if p != protoTCP || st == nil || (st.State != tcpTimeWait && st.State != tcpClose) || a.closed[f.ID] {
			return
		}
		if len(a.closed) > 65536 {
			a.closed = map[uint32]bool{}
		}
		a.closed[f.ID] = true
		if full, err := a.q.Get(*f); err == nil {
			f = &full
		}
		e.Kind = api.NetEventClose
		e.BytesOut = int64(f.CountersOrig.Bytes)
		e.BytesIn = int64(f.CountersReply.Bytes)
	case conntrack.EventDestroy:
		if a.closed[f.ID] {
			delete(a.closed, f.ID)
			return
		}
		e.Kind = api.NetEventClose
		e.BytesOut = int64(f.CountersOrig.Bytes)
		e.BytesIn = int64(f.CountersReply.Bytes)
	default:
		return
	}
	sb.jr.Append(e)
}

// cachedForbidden returns the effective always-denied set, re-reading the host's
// addresses at most every few seconds.
func (m *Manager) cachedForbidden() *netipx.IPSet {
	a := m.audit
	if a == nil {
		s, err := m.forbidden()
		if err != nil {
			return forbiddenSet(m.cfg.AllowPrivate, m.cfg.Pool)
		}
		return s
	}
	if s := a.forbidden.Load(); s != nil && time.Since(time.Unix(0, a.forbiddenAt.Load())) < 5*time.Second {
		return s
	}
	a.fmu.Lock()
	defer a.fmu.Unlock()
	s, err := m.forbidden()
	if err != nil {
		if old := a.forbidden.Load(); old != nil {
			return old
		}
		return forbiddenSet(m.cfg.AllowPrivate, m.cfg.Pool)
	}
	a.forbidden.Store(s)
	a.forbiddenAt.Store(time.Now().UnixNano())
	return s
}

// sandboxFlows returns the conntrack entries whose original source is addr.
func (m *Manager) sandboxFlows(c *conntrack.Conn, addr netip.Addr) ([]conntrack.Flow, error) {
	flows, err := c.DumpFilter(conntrack.NewFilter().Family(netfilter.ProtoIPv4), nil)
	if err != nil {
		return nil, err
	}
	var out []conntrack.Flow
	for _, f := range flows {
		if f.TupleOrig.IP.SourceAddress.Unmap() == addr {
			out = append(out, f)
		}
	}
	return out, nil
}

func (m *Manager) dialConntrack() (*conntrack.Conn, error) {
	c, err := conntrack.Dial(&mdnetlink.Config{NetNS: m.host.FD()})
	if err != nil {
		return nil, fmt.Errorf("network: conntrack: %w", err)
	}
	return c, nil
}

// revalidate deletes the conntrack entries of the sandbox's flows that pol no longer
// allows, so that replies stop at once (the sandbox's next packet is rejected by the
// rules), and cuts the proxy's connections likewise. sb.mu is held.
func (m *Manager) revalidate(sb *sandbox, pol *Policy, forbidden *netipx.IPSet) {
	if sb.proxy != nil {
		sb.proxy.setPolicy(pol, forbidden)
	}
	c, err := m.dialConntrack()
	if err != nil {
		m.log.Warn("revalidate: no conntrack", "sandbox", sb.id, "err", err)
		return
	}
	defer c.Close()
	flows, err := m.sandboxFlows(c, sb.addr)
	if err != nil {
		m.log.Warn("revalidate: dump conntrack", "sandbox", sb.id, "err", err)
		return
	}
	now := time.Now()
	for _, f := range flows {
		dst := f.TupleOrig.IP.DestinationAddress.Unmap()
		if dst == sb.gw || f.TupleReply.IP.SourceAddress.Unmap() == sb.gw {
			continue // the resolver, or a proxied flow (the proxy judged it above)
		}
		p := f.TupleOrig.Proto.Protocol
		pinned := sb.pins.lookup(dst, now) != nil
		if pol.Decide(dst, p, f.TupleOrig.Proto.DestinationPort, pinned, forbidden).Allowed {
			continue
		}
		if err := c.Delete(f); err != nil && !errors.Is(err, errNoEntry) {
			m.log.Debug("revalidate: delete flow", "sandbox", sb.id, "err", err)
		}
		sb.jr.Append(api.NetworkEvent{Kind: api.NetEventConnect, Verdict: api.NetDenied, Reason: ReasonPolicy,
			Protocol: protoName(p), Destination: netip.AddrPortFrom(dst, f.TupleOrig.Proto.DestinationPort).String()})
	}
}

var errNoEntry = errors.New("no such entry")

// flushConntrack deletes every conntrack entry from addr.
func (m *Manager) flushConntrack(addr netip.Addr) error {
	c, err := m.dialConntrack()
	if err != nil {
		return err
	}
	defer c.Close()
	flows, err := m.sandboxFlows(c, addr)
	if err != nil {
		return fmt.Errorf("network: dump conntrack: %w", err)
	}
	for _, f := range flows {
		_ = c.Delete(f)
	}
	return nil
}

// startServices starts the sandbox's resolver and proxy (once).
func (m *Manager) startServices(ctx context.Context, sb *sandbox) error {
	if sb.dns == nil {
		d, err := m.startDNS(sb)
		if err != nil {
			return err
		}
		sb.dns = d
	}
	if sb.proxy == nil {
		p, err := m.startProxy(sb)
		if err != nil {
			return err
		}
		sb.proxy = p
	}
	return nil
}

func (sb *sandbox) stopServices() {
	if sb.dns != nil {
		sb.dns.close()
		sb.dns = nil
	}
	if sb.proxy != nil {
		sb.proxy.close()
		sb.proxy = nil
	}
}

var _ = fault.Invalid
