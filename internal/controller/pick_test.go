package controller

import (
	"testing"

	"github.com/spacedev/space/internal/store"
)

func TestPick(t *testing.T) {
	nodes := []*store.Node{
		{ID: "a", State: "alive", Runtime: "gvisor"},
		{ID: "b", State: "alive", Runtime: "qemu"},
		{ID: "c", State: "dead", Runtime: "gvisor"},
		{ID: "d", State: "alive", Runtime: "gvisor"},
	}
	load := map[string]int{"a": 5, "b": 0, "c": 0, "d": 2}
	for _, tc := range []struct {
		runtime, want, why string
	}{
		{"", "b", ""},
		{"gvisor", "d", ""},
		{"qemu", "b", ""},
		{"firecracker", "", `no alive node offers runtime "firecracker"`},
	} {
		n, why := Pick(nodes, load, tc.runtime)
		got := ""
		if n != nil {
			got = n.ID
		}
		if got != tc.want || why != tc.why {
			t.Errorf("Pick(%q) = %q %q, want %q %q", tc.runtime, got, why, tc.want, tc.why)
		}
	}
	if n, why := Pick(nodes[2:3], load, ""); n != nil || why != "no node is alive" {
		t.Errorf("all dead: %v %q", n, why)
	}
}
