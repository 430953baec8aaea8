package network_test

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"time"

	"golang.org/x/net/icmp"
	"golang.org/x/net/ipv4"

	"github.com/spacedev/space/internal/network/fakenet"
)

// ping sends an ICMP echo from inside the sandbox (raw socket, as root there) and waits
// for the reply.
func (s *sbx) ping(dst netip.Addr) error {
	var c *icmp.PacketConn
	if err := s.ns.Do(func() error {
		var err error
		c, err = icmp.ListenPacket("ip4:icmp", "0.0.0.0")
		return err
	}); err != nil {
		return err
	}
	defer c.Close()
	id := rand.IntN(0xffff)
	msg := icmp.Message{Type: ipv4.ICMPTypeEcho, Body: &icmp.Echo{ID: id, Seq: 1, Data: []byte("space-ping")}}
	b, _ := msg.Marshal(nil)
	if _, err := c.WriteTo(b, &net.IPAddr{IP: dst.AsSlice()}); err != nil {
		return err
	}
	_ = c.SetReadDeadline(time.Now().Add(1500 * time.Millisecond))
	buf := make([]byte, 1500)
	for {
		n, from, err := c.ReadFrom(buf)
		if err != nil {
			return err
		}
		m, err := icmp.ParseMessage(1, buf[:n])
		if err != nil {
			continue
		}
		if e, ok := m.Body.(*icmp.Echo); ok && m.Type == ipv4.ICMPTypeEchoReply && e.ID == id && from.String() == dst.String() {
			return nil
		}
		if m.Type == ipv4.ICMPTypeDestinationUnreachable {
			return fmt.Errorf("destination unreachable (code %d)", m.Code)
		}
	}
}

// waitHits waits up to 2 s for the fake internet's counter key to exceed before.
func (s *sbx) waitHits(key string, before int) error {
	deadline := time.Now().Add(2 * time.Second)
	for time.Now().Before(deadline) {
		if s.e.fn.Hits(key) > before {
			return nil
		}
		time.Sleep(20 * time.Millisecond)
	}
	return fmt.Errorf("%s: %w", key, fakenet.ErrNotReached)
}

// raw sends a packet of an unusual IP protocol from a raw socket inside the sandbox and
// reports whether it arrived.
func (s *sbx) raw(dst netip.Addr) error {
	var pc net.PacketConn
	if err := s.ns.Do(func() error {
		var err error
		pc, err = net.ListenPacket(fmt.Sprintf("ip4:%d", fakenet.RawProto), "0.0.0.0")
		return err
	}); err != nil {
		return err
	}
	defer pc.Close()
	key := "raw " + dst.String()
	before := s.e.fn.Hits(key)
	if _, err := pc.WriteTo([]byte("raw payload"), &net.IPAddr{IP: dst.AsSlice()}); err != nil {
		return err
	}
	return s.waitHits(key, before)
}

// fragUDP sends a 64-byte UDP datagram to dst:port as hand-made IP fragments: the
// 8-byte UDP header alone first, then the payload. With overlap, a fragment of 16 bytes
// at offset 0 (a header for port 53 and 8 bytes of payload) comes between them.
func (s *sbx) fragUDP(dst netip.Addr, port uint16, overlap bool) error {
	var rc *ipv4.RawConn
	var pc net.PacketConn
	if err := s.ns.Do(func() error {
		var err error
		pc, err = net.ListenPacket("ip4:udp", "0.0.0.0")
		if err != nil {
			return err
		}
		rc, err = ipv4.NewRawConn(pc)
		return err
	}); err != nil {
		return err
	}
	defer pc.Close()
	payload := make([]byte, 64)
	copy(payload, "fragmented datagram")
	udp := make([]byte, 8)
	binary.BigEndian.PutUint16(udp[0:], 40000+uint16(rand.IntN(1000)))
	binary.BigEndian.PutUint16(udp[2:], port)
	binary.BigEndian.PutUint16(udp[4:], uint16(8+len(payload)))
	id := rand.IntN(0xffff)
	send := func(off int, mf bool, data []byte) error {
		h := &ipv4.Header{Version: 4, Len: 20, TotalLen: 20 + len(data), ID: id, TTL: 64,
			Protocol: 17, Src: s.att.Address.Addr().AsSlice(), Dst: dst.AsSlice(), FragOff: off / 8}
		if mf {
			h.Flags = ipv4.MoreFragments
		}
		return rc.WriteTo(h, data, nil)
	}
	key := fmt.Sprintf("udp %s:%d len=%d", dst, port, len(payload))
	before := s.e.fn.Hits(key)
	if err := send(0, true, udp); err != nil {
		return err
	}
	if overlap {
		evil := append(append([]byte(nil), udp...), payload[:8]...)
		binary.BigEndian.PutUint16(evil[2:], 53)
		if err := send(0, true, evil); err != nil {
			return err
		}
	}
	if err := send(8, false, payload); err != nil {
		return err
	}
	return s.waitHits(key, before)
}

func execCommand(name string, args ...string) (string, error) {
	out, err := exec.Command(name, args...).CombinedOutput()
	return string(out), err
}

// execIn runs a command in the fake host namespace.
func execIn(e *env, name string, args ...string) (string, error) {
	var out string
	err := e.fn.Host().Do(func() error {
		var err error
		out, err = execCommand(name, args...)
		return err
	})
	return out, err
}

type cmdError struct {
	cmd, out string
	err      error
}

func (e *cmdError) Error() string { return fmt.Sprintf("%s: %v: %s", e.cmd, e.err, e.out) }

var _ = errors.New
var _ = os.Getpid
