package controller

import (
	"strings"
	"testing"

	"github.com/spacedev/space/internal/store"
)

func TestPick(t *testing.T) {
	node := func(id string, mut func(*store.Node)) *store.Node {
		n := &store.Node{ID: id, Name: id, State: store.NodeAlive, Runtime: "gvisor",
			RuntimeInfo: map[string]any{"host_cpus": float64(4)},
			Allocatable: store.Resources{CPU: 16, MemoryMB: 8192, DiskMB: 20480}}
		if mut != nil {
			mut(n)
		}
		return n
	}
	used := func(cpu int, mem, disk int64) func(*store.Node) {
		return func(n *store.Node) { n.Used = store.Resources{CPU: cpu, MemoryMB: mem, DiskMB: disk} }
	}
	small := Want{CPU: 1, MemoryMB: 512, DiskMB: 1024}
	releases := map[string]map[string]bool{"full": {"sha256:t": true}, "half": {"sha256:t": true}}
	for _, tc := range []struct {
		name   string
		nodes  []*store.Node
		want   Want
		policy Policy
		pick   string // "" = none
		why    string // substring of the reason when none
	}{
		{name: "spread: the emptiest", policy: Spread, want: small, pick: "empty",
			nodes: []*store.Node{node("half", used(8, 4096, 0)), node("empty", nil), node("full", used(15, 7000, 0))}},
		{name: "pack: the fullest that fits", policy: Pack, want: small, pick: "full",
			nodes: []*store.Node{node("half", used(8, 4096, 0)), node("empty", nil), node("full", used(15, 7000, 0))}},
		{name: "pack skips a node it does not fit on", policy: Pack, want: Want{CPU: 2, MemoryMB: 512}, pick: "half",
			nodes: []*store.Node{node("half", used(8, 4096, 0)), node("empty", nil), node("full", used(15, 7000, 0))}},
		{name: "the template's holders first, whatever the policy", policy: Spread,
			want: Want{CPU: 1, MemoryMB: 512, Digest: "sha256:t"}, pick: "half",
			nodes: []*store.Node{node("half", used(8, 4096, 0)), node("empty", nil), node("full", used(15, 8000, 0))}},
		{name: "runtime", policy: Spread, want: Want{CPU: 1, MemoryMB: 512, Runtime: "qemu"}, pick: "vm",
			nodes: []*store.Node{node("a", nil), node("vm", func(n *store.Node) { n.Runtime = "qemu"; n.Used.CPU = 10 })}},
		{name: "no runtime", policy: Spread, want: Want{Runtime: "firecracker"}, why: `no alive node offers runtime "firecracker"`,
			nodes: []*store.Node{node("a", nil)}},
		{name: "dead and cordoned nodes get nothing", policy: Spread, want: small, pick: "ok",
			nodes: []*store.Node{node("dead", func(n *store.Node) { n.State = store.NodeDead }),
				node("cordoned", func(n *store.Node) { n.Cordoned = true }), node("ok", used(15, 7000, 0))}},
		{name: "none alive", policy: Spread, want: small, why: NoNodeAlive,
			nodes: []*store.Node{node("dead", func(n *store.Node) { n.State = store.NodeDead })}},
		{name: "fits nowhere: each node's misfit", policy: Spread, want: Want{CPU: 2, MemoryMB: 4096, DiskMB: 1024},
			why: "no node has room for 2 vCPU, 4096 MiB memory, 1024 MiB disk (a: 1 of 16 vCPU free; b: 2048 of 8192 MiB memory free; c: cordoned; d: disk at its reserve; e: 0 of 20480 MiB disk free)",
			nodes: []*store.Node{node("a", used(15, 0, 0)), node("b", used(0, 6144, 0)), node("c", func(n *store.Node) { n.Cordoned = true }),
				node("d", func(n *store.Node) { n.DiskLow = "full" }), node("e", used(0, 0, 20480))}},
		{name: "more vCPUs than the host has", policy: Spread, want: Want{CPU: 8}, why: "more vCPUs than the host's 4 CPUs",
			nodes: []*store.Node{node("a", nil)}},
		{name: "unreported capacity is unbounded; then the fewest sandboxes", policy: Spread, want: Want{CPU: 64, MemoryMB: 1 << 20}, pick: "b",
			nodes: []*store.Node{
				node("a", func(n *store.Node) { n.Allocatable = store.Resources{}; n.RuntimeInfo = nil; n.Sandboxes = 3 }),
				node("b", func(n *store.Node) { n.Allocatable = store.Resources{}; n.RuntimeInfo = nil; n.Sandboxes = 1 })}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n, why := Pick(tc.nodes, tc.want, tc.policy, releases)
			got := ""
			if n != nil {
				got = n.ID
			}
			if got != tc.pick || (tc.pick == "" && !strings.Contains(why, tc.why)) || (tc.pick != "" && why != "") {
				t.Fatalf("Pick = %q %q, want %q %q", got, why, tc.pick, tc.why)
			}
		})
	}
}

func TestParsePolicy(t *testing.T) {
	for in, want := range map[string]Policy{"spread": Spread, "pack": Pack, "": "", "binpack": ""} {
		got, err := ParsePolicy(in)
		if got != want || (want == "") != (err != nil) {
			t.Errorf("ParsePolicy(%q) = %q %v", in, got, err)
		}
	}
}
