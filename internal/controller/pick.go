package controller

import (
	"fmt"
	"sort"
	"strings"

	"github.com/spacedev/space/internal/store"
)

// Policy is how the scheduler chooses among the nodes a sandbox fits on.
type Policy string

// Placement policies.
const (
	// Spread places each sandbox on the node with the most room left (the least
	// loaded): a node's failure takes the fewest sandboxes with it.
	Spread Policy = "spread"
	// Pack places each sandbox on the fullest node it fits on: whole nodes stay empty,
	// to be cordoned and removed or kept for large sandboxes.
	Pack Policy = "pack"
)

// ParsePolicy parses a --placement value.
func ParsePolicy(s string) (Policy, error) {
	switch p := Policy(s); p {
	case Spread, Pack:
		return p, nil
	}
	return "", fmt.Errorf("placement policy %q: want spread or pack", s)
}

// NoNodeAlive is Pick's reason when no node is alive at all.
const NoNodeAlive = "no node is alive"

// Want is what a sandbox asks of the node it is placed on.
type Want struct {
	Runtime  string // "" = any
	CPU      int
	MemoryMB int64
	DiskMB   int64
	// Digest is the template release it starts from: nodes that hold it are preferred.
	Digest string
}

func (w Want) String() string {
	return fmt.Sprintf("%d vCPU, %d MiB memory, %d MiB disk", w.CPU, w.MemoryMB, w.DiskMB)
}

// Pick chooses the node for a sandbox: among the alive, uncordoned nodes that offer
// its runtime, have disk above their reserve and the free capacity it asks for
// (allocatable minus what the sandboxes placed there take; a dimension a node does not
// report is unbounded), those that hold its template release (releases: node id →
// digests) come first, then the policy decides, then the fewest sandboxes, then the
// name. It returns nil and the reason, naming each node's misfit, when none fits.
func Pick(nodes []*store.Node, w Want, policy Policy, releases map[string]map[string]bool) (*store.Node, string) {
	var fit []*store.Node
	var misfits []string
	alive, offer := 0, 0
	for _, n := range nodes {
		if n.State != store.NodeAlive {
			continue
		}
		alive++
		if w.Runtime != "" && n.Runtime != w.Runtime {
			continue
		}
		offer++
		if why := misfit(n, w); why != "" {
			misfits = append(misfits, n.Name+": "+why)
			continue
		}
		fit = append(fit, n)
	}
	switch {
	case alive == 0:
		return nil, NoNodeAlive
	case offer == 0:
		return nil, fmt.Sprintf("no alive node offers runtime %q", w.Runtime)
	case len(fit) == 0:
		return nil, "no node has room for " + w.String() + " (" + strings.Join(misfits, "; ") + ")"
	}
	holds := func(n *store.Node) bool { return w.Digest != "" && releases[n.ID][w.Digest] }
	sort.SliceStable(fit, func(i, j int) bool {
		a, b := fit[i], fit[j]
		if ha, hb := holds(a), holds(b); ha != hb {
			return ha
		}
		if sa, sb := room(a, w), room(b, w); sa != sb {
			if policy == Pack {
				return sa < sb
			}
			return sa > sb
		}
		if a.Sandboxes != b.Sandboxes {
			if policy == Pack {
				return a.Sandboxes > b.Sandboxes
			}
			return a.Sandboxes < b.Sandboxes
		}
		return a.Name < b.Name
	})
	return fit[0], ""
}

// misfit says why w does not fit on n ("" when it does).
func misfit(n *store.Node, w Want) string {
	if n.Cordoned {
		return "cordoned"
	}
	if n.DiskLow != "" {
		return "disk at its reserve"
	}
	if h := hostCPUs(n); h > 0 && w.CPU > h {
		return fmt.Sprintf("a sandbox cannot have more vCPUs than the host's %d CPUs", h)
	}
	a, u := n.Allocatable, n.Used
	var short []string
	if a.CPU > 0 && u.CPU+w.CPU > a.CPU {
		short = append(short, fmt.Sprintf("%d of %d vCPU free", max(a.CPU-u.CPU, 0), a.CPU))
	}
	if a.MemoryMB > 0 && u.MemoryMB+w.MemoryMB > a.MemoryMB {
		short = append(short, fmt.Sprintf("%d of %d MiB memory free", max(a.MemoryMB-u.MemoryMB, 0), a.MemoryMB))
	}
	if a.DiskMB > 0 && u.DiskMB+w.DiskMB > a.DiskMB {
		short = append(short, fmt.Sprintf("%d of %d MiB disk free", max(a.DiskMB-u.DiskMB, 0), a.DiskMB))
	}
	return strings.Join(short, ", ")
}

// room is the smallest fraction of a bounded dimension of n that stays free once w is
// placed there (1 when n bounds nothing).
func room(n *store.Node, w Want) float64 {
	r := 1.0
	frac := func(alloc, used, want int64) {
		if alloc > 0 {
			r = min(r, float64(alloc-used-want)/float64(alloc))
		}
	}
	frac(int64(n.Allocatable.CPU), int64(n.Used.CPU), int64(w.CPU))
	frac(n.Allocatable.MemoryMB, n.Used.MemoryMB, w.MemoryMB)
	frac(n.Allocatable.DiskMB, n.Used.DiskMB, w.DiskMB)
	return r
}

// hostCPUs is the CPU count the node reports of its host (0: unknown).
func hostCPUs(n *store.Node) int {
	m, _ := n.RuntimeInfo["host_cpus"].(float64)
	return int(m)
}
