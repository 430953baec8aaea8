package server_test

import (
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/network"
	"github.com/spacedev/space/internal/network/fakenet"
	"github.com/spacedev/space/internal/node"
	"github.com/spacedev/space/internal/spacetest"
	"github.com/spacedev/space/internal/testenv"
)

// realNet is a real network manager whose host is a fake internet's host namespace.
func realNet(t *testing.T, fn *fakenet.Net, dir string) *network.Manager {
	t.Helper()
	m, err := network.New(context.Background(), network.Config{
		Logger:    slog.New(slog.DiscardHandler),
		HostNetns: fn.HostNS, NetnsDir: filepath.Join(dir, "ns"), Uplink: fakenet.Uplink,
		Upstreams: []string{fakenet.DNSAddr.String() + ":53"}, UpstreamRoots: fn.Roots,
	})
	if err != nil {
		t.Fatalf("network.New: %v", err)
	}
	return m
}

// echo connects from inside the sandbox's namespace to the fake internet's TCP echo
// service at addr and reports whether it answered.
func echo(t *testing.T, m *network.Manager, id, addr string) error {
	t.Helper()
	att, err := m.Attachment(id)
	if err != nil {
		t.Fatal(err)
	}
	ns, err := network.OpenNS(att.Netns)
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	c, err := ns.Dial(ctx, &net.Dialer{}, "tcp4", addr)
	if err != nil {
		return err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(2 * time.Second))
	if _, err := c.Write([]byte("ping")); err != nil {
		return err
	}
	_, err = io.ReadFull(c, make([]byte, 4))
	return err
}

// TestNetworkRefusedApplyThroughAPI: with real nftables, a policy change the kernel
// refuses in the middle of its batch (network.Manager.BreakNextApply) is a 422 saying
// so, and the previous policy is still in force (the packets prove it) and recorded.
// A restarted node adopts the sandbox's network and removes leftovers; deleting the
// sandbox removes its namespace.
func TestNetworkRefusedApplyThroughAPI(t *testing.T) {
	testenv.RequireRoot(t)
	dir := t.TempDir()
	fn, err := fakenet.New(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(fn.Close)
	m := realNet(t, fn, dir)
	t.Cleanup(func() { m.Close() })
	var cur = m
	s := spacetest.Start(t, spacetest.Options{Node: func(c *node.Config) { c.Network = cur }})
	web, web2 := fakenet.WebAddr.String(), fakenet.Web2Addr.String()
	sb := s.Create(api.CreateSandboxRequest{Network: &api.Network{Egress: true, AllowOut: []string{web}, DenyOut: []string{"0.0.0.0/0"}}})
	if err := echo(t, m, sb.ID, web+":7"); err != nil {
		t.Fatalf("allowed host: %v", err)
	}
	if err := echo(t, m, sb.ID, web2+":7"); err == nil {
		t.Fatal("a denied host answered")
	}

	m.BreakNextApply()
	code, body := do(t, s, "PATCH", "/v1/sandboxes/"+sb.ID+"/network", `{"allow_out":["`+web2+`"]}`)
	if code != http.StatusUnprocessableEntity || !strings.Contains(body, "previous policy is still in force") {
		t.Fatalf("refused batch: %d %s", code, body)
	}
	if err := echo(t, m, sb.ID, web+":7"); err != nil {
		t.Fatalf("after a refused change the allowed host is unreachable: %v", err)
	}
	if err := echo(t, m, sb.ID, web2+":7"); err == nil {
		t.Fatal("after a refused change the host it would have allowed answers")
	}
	st, err := s.C.GetNetwork(ctx(t), sb.ID)
	if err != nil || len(st.Network.AllowOut) != 1 || st.Network.AllowOut[0] != web || !st.Applied {
		t.Fatalf("after a refused change: %+v %v", st, err)
	}

	// The same change, not broken, applies at once.
	if _, err := s.C.PatchNetwork(ctx(t), sb.ID, map[string]any{"allow_out": []string{web2}}); err != nil {
		t.Fatal(err)
	}
	if err := echo(t, m, sb.ID, web2+":7"); err != nil {
		t.Fatalf("newly allowed host: %v", err)
	}
	if err := echo(t, m, sb.ID, web+":7"); err == nil {
		t.Fatal("no longer allowed host answers")
	}

	// A node restart with a new manager: the sandbox's network is adopted (still in
	// force), a leftover of a sandbox that does not exist is removed.
	if _, err := m.Setup(context.Background(), "leftover1", nil); err != nil {
		t.Fatal(err)
	}
	s.StopNode()
	m.Close()
	cur = realNet(t, fn, dir)
	t.Cleanup(func() { cur.Close() })
	s.StartNode()
	s.Eventually(30*time.Second, "the restarted node to adopt the network", func() bool {
		_, err := cur.Attachment(sb.ID)
		return err == nil
	})
	if err := echo(t, cur, sb.ID, web2+":7"); err != nil {
		t.Fatalf("after a node restart: %v", err)
	}
	s.Eventually(30*time.Second, "the restarted node to remove the leftover's namespace", func() bool {
		_, err := os.Stat(filepath.Join(dir, "ns", "space-leftover1"))
		return os.IsNotExist(err)
	})

	// Delete: the namespace goes.
	att, _ := cur.Attachment(sb.ID)
	op, err := s.C.DeleteSandbox(ctx(t), sb.ID)
	if err != nil {
		t.Fatal(err)
	}
	s.WaitOp(op.ID, api.OpSucceeded)
	if _, err := os.Stat(att.Netns); !os.IsNotExist(err) {
		t.Fatalf("the deleted sandbox's namespace is still there: %v", err)
	}
}
