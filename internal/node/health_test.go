package node_test

import (
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/spacedev/space/internal/node"
	"github.com/spacedev/space/internal/spacetest"
)

// TestHealth: a registered node is healthy; a store at its disk reserve makes it
// unhealthy with the reason (and space_node_up 0) until it has room again.
func TestHealth(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	reg := prometheus.NewRegistry()
	s.Node.RegisterMetrics(reg)
	gauge := func(name string) float64 {
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range mfs {
			if mf.GetName() == name {
				return mf.GetMetric()[0].GetGauge().GetValue()
			}
		}
		t.Fatalf("no %s", name)
		return 0
	}
	up := func() float64 { return gauge("space_node_up") }
	var h node.Health
	s.Eventually(10*time.Second, "the node to be healthy", func() bool {
		h = s.Node.Health(t.Context())
		return h.OK() && up() == 1
	})
	if h.ID != s.NodeID || h.Epoch < 1 || len(h.Reasons) != 0 || h.LastHeartbeat.IsZero() {
		t.Fatalf("healthy node: %+v", h)
	}
	for _, c := range []string{"registration", "database", "heartbeat", "runtime", "disk", "shutdown"} {
		if h.Checks[c] != "ok" {
			t.Errorf("check %s: %q", c, h.Checks[c])
		}
	}
	s.Disk.SetFull("store at its 10% reserve")
	s.Eventually(10*time.Second, "the node to report its disk", func() bool {
		h = s.Node.Health(t.Context())
		return !h.OK() && up() == 0
	})
	if h.Status != "unhealthy" || !strings.Contains(h.Checks["disk"], "reserve") || len(h.Reasons) != 1 ||
		!strings.HasPrefix(h.Reasons[0], "disk: ") {
		t.Fatalf("node at its disk reserve: %+v", h)
	}
	if v := gauge("space_node_disk_low"); v != 1 {
		t.Fatalf("space_node_disk_low %v, want 1", v)
	}
	s.Disk.SetFull("")
	s.Eventually(10*time.Second, "the node to be healthy again", func() bool { return s.Node.Health(t.Context()).OK() })
	s.StopNode()
	if h := s.Node.Health(t.Context()); h.OK() || h.Checks["shutdown"] != "shutting down" {
		t.Fatalf("stopped node: %+v", h)
	}
}

// TestFingerprint: the same installation always presents the same fingerprint; another
// data directory or store does not.
func TestFingerprint(t *testing.T) {
	a := node.Fingerprint("/var/lib/space", "0011223344556677")
	if a != node.Fingerprint("/var/lib/space", "0011223344556677") {
		t.Fatal("fingerprint not stable")
	}
	for _, other := range []string{node.Fingerprint("/srv/space", "0011223344556677"), node.Fingerprint("/var/lib/space", "8899aabbccddeeff")} {
		if other == a {
			t.Fatalf("another installation has the same fingerprint %q", a)
		}
	}
	if !strings.Contains(a, "host=") || !strings.Contains(a, "dir=/var/lib/space") {
		t.Fatalf("fingerprint %q", a)
	}
}
