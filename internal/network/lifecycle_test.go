package network_test

import (
	"context"
	"errors"
	"net/netip"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/network"
)

func TestSetupAdoptAfterRestartAndReconcile(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	open := &api.Network{Egress: true}
	att, err := e.m.Setup(ctx, "keep1", open)
	mustOK(t, "setup keep1", err)
	again, err := e.m.Setup(ctx, "keep1", open)
	mustOK(t, "setup keep1 again", err)
	if again.Address != att.Address || again.Netns != att.Netns {
		t.Fatalf("second Setup changed the attachment: %+v → %+v", att, again)
	}
	gone, err := e.m.Setup(ctx, "gone1", open)
	mustOK(t, "setup gone1", err)

	// space restarts: the namespaces and rules stay, a new manager finds them.
	e.m.Close()
	m2, err := network.New(ctx, e.cfg)
	mustOK(t, "new manager", err)
	defer m2.Close()
	ids, err := m2.List(ctx)
	mustOK(t, "list", err)
	if !slices.Contains(ids, "keep1") || !slices.Contains(ids, "gone1") {
		t.Fatalf("List after restart = %v", ids)
	}
	adopted, err := m2.Setup(ctx, "keep1", open)
	mustOK(t, "adopt keep1", err)
	if adopted.Address != att.Address || adopted.Netns != att.Netns {
		t.Fatalf("adopted attachment differs: %+v vs %+v", adopted, att)
	}
	ns, err := network.OpenNS(adopted.Netns)
	mustOK(t, "open netns", err)
	defer ns.Close()
	s := &sbx{e: e, id: "keep1", att: adopted, ns: ns}
	mustOK(t, "adopted sandbox has egress", s.tcpEcho(web+echoPort))
	// A new sandbox does not get the address of the leftover.
	fresh, err := m2.Setup(ctx, "new1", open)
	mustOK(t, "setup new1", err)
	if fresh.Address == gone.Address || fresh.Address == att.Address {
		t.Fatalf("new sandbox got a taken address %v", fresh.Address)
	}

	removed, err := m2.Reconcile(ctx, func(id string) bool { return id == "keep1" || id == "new1" })
	mustOK(t, "reconcile", err)
	if !slices.Equal(removed, []string{"gone1"}) {
		t.Fatalf("Reconcile removed %v", removed)
	}
	if _, err := os.Stat(gone.Netns); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("gone1's namespace pin is still there: %v", err)
	}
	out, err := execIn(e, "nft", "list", "tables")
	if err == nil && strings.Contains(out, "gone1") {
		t.Fatalf("gone1's tables are still there:\n%s", out)
	}
	if out, _ := execIn(e, "ip", "-o", "link"); strings.Contains(out, "space:gone1") {
		t.Fatalf("gone1's veth is still there:\n%s", out)
	}

	for _, id := range []string{"keep1", "new1"} {
		mustOK(t, "teardown "+id, m2.Teardown(ctx, id))
		mustOK(t, "teardown twice "+id, m2.Teardown(ctx, id))
	}
	ids, err = m2.List(ctx)
	mustOK(t, "list", err)
	if len(ids) != 0 {
		t.Fatalf("List after teardown = %v", ids)
	}
	if out, _ := execIn(e, "ip", "-o", "link"); strings.Contains(out, "space:") {
		t.Fatalf("veths left:\n%s", out)
	}
}

func TestSetupFailuresLeaveNothing(t *testing.T) {
	e := newEnv(t, func(c *network.Config) { c.Pool = netip.MustParsePrefix("10.202.0.0/29") })
	ctx := context.Background()
	for _, bad := range []struct {
		id   string
		spec *api.Network
		kind fault.Kind
		msg  string
	}{
		{"Bad-Id", nil, fault.Invalid, "invalid sandbox id"},
		{"bad1", &api.Network{Egress: true, AllowOut: []string{"10.1.0.0/16"}}, fault.Invalid, "network.allow_out[0]"},
		{"bad2", &api.Network{Egress: true, DenyOut: []string{"not a domain"}}, fault.Invalid, "network.deny_out[0]"},
	} {
		_, err := e.m.Setup(ctx, bad.id, bad.spec)
		if !fault.Is(err, bad.kind) || !strings.Contains(err.Error(), bad.msg) {
			t.Fatalf("Setup(%s): %v, want %v containing %q", bad.id, err, bad.kind, bad.msg)
		}
	}
	// A /29 holds two sandboxes; the third fails and leaves nothing behind.
	e.sandbox("pa", nil)
	e.sandbox("pb", nil)
	_, err := e.m.Setup(ctx, "pc", nil)
	if !fault.Is(err, fault.Unavailable) {
		t.Fatalf("third sandbox in a /29: %v", err)
	}
	ids, _ := e.m.List(ctx)
	if slices.Contains(ids, "pc") || slices.Contains(ids, "bad1") {
		t.Fatalf("failed setups left %v", ids)
	}
	if _, err := os.Stat(e.cfg.NetnsDir + "/space-pc"); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("failed setup left its namespace pin: %v", err)
	}
}

func TestAuditJournal(t *testing.T) {
	e := newEnv(t, func(c *network.Config) { c.JournalEvents = 16 })
	s := e.sandbox("aud1", &api.Network{Egress: true, AllowOut: []string{"api.example.test"}, DenyOut: denyAll})
	_, err := s.lookup("api.example.test")
	mustOK(t, "lookup", err)
	_, err = s.lookup("other.test")
	mustFail(t, "lookup other.test", err)
	mustOK(t, "echo", s.tcpEcho(web+echoPort))
	mustFail(t, "denied", s.tcpEcho(web2+echoPort))

	s.waitEvent("dns allowed", func(ev api.NetworkEvent) bool {
		return ev.Kind == "dns" && ev.Verdict == "allowed" && ev.Domain == "api.example.test" && ev.Destination == web
	})
	s.waitEvent("dns denied", func(ev api.NetworkEvent) bool {
		return ev.Kind == "dns" && ev.Verdict == "denied" && ev.Domain == "other.test"
	})
	s.waitEvent("connect allowed", func(ev api.NetworkEvent) bool {
		return ev.Kind == "connect" && ev.Verdict == "allowed" && ev.Destination == web+echoPort && ev.Domain == "api.example.test" && ev.Reason == "allowed_domain"
	})
	closeEv := s.waitEvent("close with bytes", func(ev api.NetworkEvent) bool {
		return ev.Kind == "close" && ev.Destination == web+echoPort
	})
	if closeEv.BytesOut == 0 || closeEv.BytesIn == 0 {
		t.Fatalf("close without bytes: %+v", closeEv)
	}
	s.waitEvent("connect denied", func(ev api.NetworkEvent) bool {
		return ev.Kind == "connect" && ev.Verdict == "denied" && ev.Destination == web2+echoPort
	})

	// Replay from an offset, then follow.
	j, err := e.m.Events(s.id)
	mustOK(t, "events", err)
	first, end := j.Bounds()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	got := make(chan api.NetworkEvent, 100)
	go func() {
		_ = j.Follow(ctx, end-1, func(ev api.NetworkEvent, gap int64) error {
			got <- ev
			return nil
		})
	}()
	select {
	case ev := <-got:
		if ev.Offset != end-1 {
			t.Fatalf("replay started at %d, want %d", ev.Offset, end-1)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no replayed event")
	}
	_, _ = s.lookup("www.example.test")
	select {
	case ev := <-got:
		if ev.Offset != end || ev.Domain != "www.example.test" {
			t.Fatalf("followed event %+v", ev)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no followed event")
	}
	// The journal is bounded: push it past its size and a reader from 0 learns the gap.
	for i := 0; i < 20; i++ {
		_, _ = s.lookup("x" + string(rune('a'+i)) + ".other.test")
	}
	evs, gap := j.Read(0, 100)
	if gap == 0 || len(evs) > 16 {
		t.Fatalf("read from 0 after overflow: %d events, gap %d (first was %d)", len(evs), gap, first)
	}
}

func TestDialSandboxInbound(t *testing.T) {
	e := newEnv(t)
	s := e.sandbox("in1", nil) // no egress: inbound through space still works
	other := e.sandbox("in2", &api.Network{Egress: true})
	l, err := s.ns.Listen("tcp4", "0.0.0.0:8080")
	mustOK(t, "listen in the sandbox", err)
	defer l.Close()
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			_, _ = c.Write([]byte("hello from the sandbox\n"))
			c.Close()
		}
	}()
	c, err := e.m.DialSandbox(context.Background(), s.id, 8080)
	mustOK(t, "DialSandbox", err)
	b := make([]byte, 64)
	_ = c.SetDeadline(time.Now().Add(2 * time.Second))
	n, err := c.Read(b)
	c.Close()
	if err != nil || !strings.HasPrefix(string(b[:n]), "hello from the sandbox") {
		t.Fatalf("read %q: %v", b[:n], err)
	}
	// The sandbox still cannot open anything toward the host, and others cannot reach it.
	mustFail(t, "sandbox to host", s.tcpEcho(s.att.Gateway.String()+":22"))
	mustFail(t, "other sandbox to its port", other.tcpEcho(s.att.Address.Addr().String()+":8080"))
	if _, err := e.m.DialSandbox(context.Background(), "nosuch", 80); !fault.Is(err, fault.NotFound) {
		t.Fatalf("DialSandbox(unknown) = %v", err)
	}
}

// TestAdoptKeepsRuntimeOwnedInterface: a runtime with its own network stack (gVisor's
// netstack) takes the address off the sandbox end when it starts. A restarted manager
// must find the sandbox from its host end alone, and Adopt (the sandbox may be running)
// must leave the interface as the runtime left it, while Setup (before the next start
// or restore) gives it its address and route back.
func TestAdoptKeepsRuntimeOwnedInterface(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	open := &api.Network{Egress: true}
	s := e.sandbox("own1", open)
	// What runsc does: the addresses move into its netstack.
	_, err := execInNS(s, "ip", "addr", "flush", "dev", "eth0")
	mustOK(t, "flush eth0", err)
	index := func() string {
		out, err := execInNS(s, "ip", "-o", "link", "show", "eth0")
		mustOK(t, "ip link", err)
		return strings.Fields(out)[0]
	}
	before := index()

	e.m.Close()
	m2, err := network.New(ctx, e.cfg)
	mustOK(t, "new manager", err)
	defer m2.Close()
	// Another new sandbox never gets own1's address, although eth0 shows none.
	other, err := m2.Setup(ctx, "own2", open)
	mustOK(t, "setup own2", err)
	defer m2.Teardown(ctx, "own2")
	if other.Address == s.att.Address {
		t.Fatalf("own2 got own1's address %v", other.Address)
	}
	att, err := m2.Adopt(ctx, "own1", open)
	mustOK(t, "adopt own1", err)
	if att.Address != s.att.Address || att.Gateway != s.att.Gateway {
		t.Fatalf("adopted attachment %+v, want address %v", att, s.att.Address)
	}
	if index() != before {
		t.Fatal("Adopt re-created the sandbox end")
	}
	if out, _ := execInNS(s, "ip", "-4", "-o", "addr", "show", "dev", "eth0"); strings.Contains(out, "inet ") {
		t.Fatalf("Adopt gave the runtime-owned interface an address back:\n%s", out)
	}
	// Before the next start: Setup restores address and default route, same interface.
	att, err = m2.Setup(ctx, "own1", open)
	mustOK(t, "setup own1", err)
	if att.Address != s.att.Address || index() != before {
		t.Fatalf("Setup changed the sandbox's address or interface: %+v", att)
	}
	s.e = &env{t: t, fn: e.fn, m: m2, dir: e.dir, cfg: e.cfg}
	mustOK(t, "egress after Setup", s.tcpEcho(web+echoPort))
	mustOK(t, "teardown", m2.Teardown(ctx, "own1"))
}

// execInNS runs a command inside the sandbox's namespace.
func execInNS(s *sbx, name string, args ...string) (string, error) {
	var out string
	err := s.ns.Do(func() error {
		var err error
		out, err = execCommand(name, args...)
		return err
	})
	return out, err
}
