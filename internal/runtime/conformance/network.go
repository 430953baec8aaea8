package conformance

import (
	"context"
	"errors"
	"log/slog"
	"path/filepath"
	"strings"
	"testing"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/guest/agentclient"
	"github.com/spacedev/space/internal/guest/wire"
	"github.com/spacedev/space/internal/network"
	"github.com/spacedev/space/internal/network/fakenet"
	"github.com/spacedev/space/internal/runtime"
)

// Network cases. A runtime that networks sandboxes (Info().Caps.Network) runs one in a
// namespace the suite prepares as the node does (internal/network, with a fake internet
// as the "host": nothing reaches a real network): the sandbox reaches an allowed host
// and not a denied one, and a checkpoint restored into another namespace (a clone)
// comes up with that namespace's address. A runtime without networking refuses a
// network cleanly.

// probeProgram fetches each URL of its arguments over HTTP and prints "ok" or "fail"
// for each, then the sandbox's source address toward the first URL's host.
const probeProgram = `import sys, socket, urllib.request, urllib.parse
for u in sys.argv[1:]:
    try:
        urllib.request.urlopen(u, timeout=4)
        print("ok", flush=True)
    except Exception:
        print("fail", flush=True)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect((urllib.parse.urlparse(sys.argv[1]).hostname, 9))
print("addr", s.getsockname()[0], flush=True)
`

// testNetworkUnsupported: a runtime without networking refuses it (ErrUnsupported) and
// leaves nothing behind; one with networking refuses Network without a namespace.
func (s *suite) testNetworkUnsupported(t *testing.T) {
	spec := s.spec(t, "net")
	spec.Network = true
	err := s.rt.Create(s.ctx(t, opTimeout), spec)
	if err == nil {
		s.track(spec)
		t.Fatal("Create with Network and no namespace succeeded")
	}
	if !errors.Is(err, runtime.ErrUnsupported) {
		t.Errorf("Create with Network and no namespace: %v, want ErrUnsupported", err)
	}
	s.assertNothingLeft(t, spec)
}

// netEnv is a fake internet and a network manager on it.
type netEnv struct {
	fn *fakenet.Net
	m  *network.Manager
}

func (s *suite) netEnv(t *testing.T) *netEnv {
	t.Helper()
	dir := t.TempDir()
	fn, err := fakenet.New(dir)
	if err != nil {
		t.Fatalf("fakenet: %v", err)
	}
	t.Cleanup(fn.Close)
	fn.SetA("allowed.test", 300, fakenet.WebAddr)
	m, err := network.New(context.Background(), network.Config{
		Logger: slog.New(slog.DiscardHandler), HostNetns: fn.HostNS, NetnsDir: filepath.Join(dir, "ns"),
		Uplink: fakenet.Uplink, Upstreams: []string{fakenet.DNSAddr.String() + ":53"}, UpstreamRoots: fn.Roots,
	})
	if err != nil {
		t.Fatalf("network.New: %v", err)
	}
	t.Cleanup(func() { m.Close() })
	return &netEnv{fn: fn, m: m}
}

// attach sets up a sandbox network as the node does before a start or restore.
func (e *netEnv) attach(t *testing.T, spec *runtime.Spec) *network.Attachment {
	t.Helper()
	att, err := e.m.Setup(context.Background(), spec.ID, &api.Network{
		Egress: true, AllowOut: []string{"allowed.test"}, DenyOut: []string{"0.0.0.0/0"},
	})
	if err != nil {
		t.Fatalf("network setup: %v", err)
	}
	t.Cleanup(func() { _ = e.m.Teardown(context.Background(), spec.ID) })
	spec.Network, spec.NetNS = true, att.Netns
	return att
}

// configureGuest gives a VM its address on the tap and points the sandbox's resolver at
// the node's, as the node does.
func (s *suite) configureGuest(t *testing.T, ctx context.Context, c *agentclient.Client, att *network.Attachment) {
	t.Helper()
	if s.info.Caps.Network == runtime.NetworkTap {
		stdout, stderr, exit := run(t, ctx, c, wire.ProcessSpec{Argv: network.TapGuestConfig()})
		if exit.ExitCode == nil || *exit.ExitCode != 0 {
			t.Fatalf("guest network config: %+v %q %q", exit, stdout, stderr)
		}
	}
	if _, err := c.WriteFile(ctx, "/etc/resolv.conf", strings.NewReader(att.ResolvConf()), agentclient.WriteOptions{Mode: 0o644}); err != nil {
		t.Fatalf("write resolv.conf: %v", err)
	}
}

// probe runs probeProgram; it returns the verdict per URL and the source address.
func probe(t *testing.T, ctx context.Context, c *agentclient.Client, urls ...string) ([]string, string) {
	t.Helper()
	stdout, stderr, exit := run(t, ctx, c, wire.ProcessSpec{Argv: append([]string{"python3", "-c", probeProgram}, urls...)})
	if exit.ExitCode == nil || *exit.ExitCode != 0 {
		t.Fatalf("probe: %+v %q %q", exit, stdout, stderr)
	}
	var verdicts []string
	addr := ""
	for _, l := range strings.Split(strings.TrimSpace(stdout), "\n") {
		if a, ok := strings.CutPrefix(l, "addr "); ok {
			addr = a
			continue
		}
		verdicts = append(verdicts, l)
	}
	return verdicts, addr
}

// testNetwork: a sandbox in a prepared namespace reaches what its policy allows (by
// name, through the node's resolver) and not what it denies, from the namespace's
// address; the fake internet proves a denied packet never arrived.
func (s *suite) testNetwork(t *testing.T, e *netEnv) runtime.Spec {
	spec := s.spec(t, "net")
	att := e.attach(t, &spec)
	if err := s.rt.Create(s.ctx(t, readyTimeout), spec); err != nil {
		t.Fatalf("Create with a network: %v", err)
	}
	s.track(spec)
	c := s.client(spec.ID)
	ctx := s.ctx(t, readyTimeout)
	if _, err := c.WaitReady(ctx); err != nil {
		t.Fatalf("agent not ready: %v\n%s", err, s.diagnose(spec))
	}
	s.configureGuest(t, ctx, c, att)
	web2 := "http://" + fakenet.Web2Addr.String() + "/conformance-denied"
	verdicts, addr := probe(t, ctx, c, "http://allowed.test/conformance", web2)
	if strings.Join(verdicts, " ") != "ok fail" {
		t.Errorf("allowed, denied: %v", verdicts)
	}
	if want := s.guestAddr(att); addr != want {
		t.Errorf("the sandbox's source address is %q, want %s", addr, want)
	}
	if n := e.fn.Hits("http " + fakenet.Web2Addr.String() + ":80"); n != 0 {
		t.Errorf("the denied host was reached %d times", n)
	}
	return spec
}

// testNetworkClone: a checkpoint of a networked sandbox restored into another
// namespace (a clone) has that namespace's address and its egress works; the source,
// restored into its own namespace, keeps its address.
func (s *suite) testNetworkClone(t *testing.T, e *netEnv, src runtime.Spec) {
	snap, ok := s.rt.(runtime.Snapshotter)
	if !ok {
		t.Skip("no snapshots")
	}
	c := s.client(src.ID)
	s.quiesce(t, src, c)
	dir := t.TempDir()
	if err := snap.Checkpoint(s.ctx(t, readyTimeout), src.ID, dir); err != nil {
		t.Fatalf("checkpoint: %v", err)
	}
	_ = s.rt.Destroy(s.ctx(t, opTimeout), src.ID)
	s.mu.Lock()
	delete(s.live, src.ID)
	s.mu.Unlock()
	for i, name := range []string{"netclone", "netsrc"} {
		var spec runtime.Spec
		var att *network.Attachment
		if i == 0 {
			spec = s.copyRoot(t, src, name)
			att = e.attach(t, &spec)
		} else {
			spec = src
			spec.StateDir = s.stateDir(t)
			att = e.attach(t, &spec) // Setup again before the restore: the address comes back
		}
		if err := snap.Restore(s.ctx(t, readyTimeout), spec, dir); err != nil {
			t.Fatalf("restore %s: %v", name, err)
		}
		s.track(spec)
		rc := s.client(spec.ID)
		s.resume(t, spec, rc, identity(int64(10+i), name))
		ctx := s.ctx(t, readyTimeout)
		s.configureGuest(t, ctx, rc, att)
		verdicts, addr := probe(t, ctx, rc, "http://allowed.test/conformance-"+name, "http://"+fakenet.Web2Addr.String()+"/denied-"+name)
		if strings.Join(verdicts, " ") != "ok fail" {
			t.Errorf("%s: allowed, denied: %v", name, verdicts)
		}
		if want := s.guestAddr(att); addr != want {
			t.Errorf("%s: source address %q, want %s", name, addr, want)
		}
		s.destroy(t, spec)
	}
}

// guestAddr is the address the sandbox sees as its own: the namespace's (gVisor takes
// its interface), or the fixed guest address behind a VM's tap (the namespace
// masquerades it to its own).
func (s *suite) guestAddr(att *network.Attachment) string {
	if s.info.Caps.Network == runtime.NetworkTap {
		return network.TapGuest.Addr().String()
	}
	return att.Address.Addr().String()
}
