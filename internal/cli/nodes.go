package cli

import (
	"fmt"
	"slices"

	"github.com/spf13/cobra"

	"github.com/spacedev/space/api"
)

// nodesCmd is `space node`: list, show, cordon, uncordon, rm (operator key).
func (a *app) nodesCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "node", Aliases: []string{"nodes"}, Short: "Inspect and manage nodes (operator key)",
		Long: `Inspect and manage the fleet's nodes (an operator key is needed).

A node publishes what it offers sandboxes (space serve --capacity); the scheduler
places each new sandbox on a node with room for it (space serve --placement).
A cordoned node gets no new placements. A node that misses its heartbeats is marked
dead: its running sandboxes are lost, suspended and stopped ones wait for it to
return. rm removes a dead node, or a cordoned one that holds no sandbox, so that a
replacement can register under the same --node-name (docs/operations.md).`}
	cmd.AddCommand(&cobra.Command{
		Use:     "list",
		Aliases: []string{"ls"},
		Short:   "List nodes with their state, capacity and usage",
		Long: `List nodes. CPU, MEMORY (MiB) and DISK (MiB) show used/capacity: what the
sandboxes placed on the node take of what it offers ("-": unbounded). vCPUs and
memory count sandboxes that hold the node's memory (not suspended, stopped or
failed); disk counts each sandbox's measured use, at least 64 MiB, plus the memory
snapshot of a suspended one. RELEASES and SNAPSHOTS are the node's cache: the
template releases and the ready named snapshots it holds (count and size).
space node show NODE shows one node with its runtime details.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			nodes, err := c.ListNodes(cmdContext(cmd))
			if err != nil {
				return err
			}
			return printList(a, nodes, []string{"NAME", "STATE", "RUNTIME", "CPU", "MEMORY", "DISK", "SANDBOXES", "RELEASES", "SNAPSHOTS", "HEARTBEAT", "DATA PLANE"},
				func(n api.Node) []any {
					return []any{n.Name, nodeState(n), n.Runtime, usedOf(int64(n.Used.CPU), int64(n.Capacity.CPU)),
						usedOf(n.Used.MemoryMB, n.Capacity.MemoryMB), usedOf(n.Used.DiskMB, n.Capacity.DiskMB),
						n.Sandboxes, cacheOf(n.Cache.Releases, n.Cache.ReleaseBytes), cacheOf(n.Cache.Snapshots, n.Cache.SnapshotBytes),
						ago(n.HeartbeatAt), n.DataPlaneURL}
				})
		},
	})
	cmd.AddCommand(&cobra.Command{
		Use:   "show NODE",
		Short: "Show one node: state, capacity, usage, cache and runtime details",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			nodes, err := c.ListNodes(cmdContext(cmd))
			if err != nil {
				return err
			}
			i := slices.IndexFunc(nodes, func(n api.Node) bool { return n.Name == args[0] })
			if i < 0 {
				i = slices.IndexFunc(nodes, func(n api.Node) bool { return n.ID == args[0] })
			}
			if i < 0 {
				return fmt.Errorf("node %q not found (space node list shows the nodes)", args[0])
			}
			n := nodes[i]
			if a.json() {
				return a.printJSON(n)
			}
			w := a.env.Stdout
			fmt.Fprintf(w, "name:        %s\nid:          %s\nstate:       %s\n", n.Name, n.ID, nodeState(n))
			if n.DeadReason != "" {
				fmt.Fprintf(w, "dead:        %s\n", n.DeadReason)
			}
			fmt.Fprintf(w, "heartbeat:   %s\ndata plane:  %s\nruntime:     %s\n", ago(n.HeartbeatAt), n.DataPlaneURL, n.Runtime)
			fmt.Fprintf(w, "sandboxes:   %d\ncpu:         %s\nmemory:      %s MiB\ndisk:        %s MiB\n", n.Sandboxes,
				usedOf(int64(n.Used.CPU), int64(n.Capacity.CPU)), usedOf(n.Used.MemoryMB, n.Capacity.MemoryMB), usedOf(n.Used.DiskMB, n.Capacity.DiskMB))
			fmt.Fprintf(w, "releases:    %s\nsnapshots:   %s\ndetails:     %s\n", cacheOf(n.Cache.Releases, n.Cache.ReleaseBytes),
				cacheOf(n.Cache.Snapshots, n.Cache.SnapshotBytes), details(n.RuntimeInfo))
			return nil
		},
	})
	cordon := func(on bool) *cobra.Command {
		use, short := "cordon NODE", "Stop placing new sandboxes and template builds on a node (what runs there keeps running)"
		if !on {
			use, short = "uncordon NODE", "Place new sandboxes on a cordoned node again"
		}
		return &cobra.Command{
			Use: use, Short: short, Args: cobra.ExactArgs(1),
			RunE: func(cmd *cobra.Command, args []string) error {
				c, err := a.connect()
				if err != nil {
					return err
				}
				n, err := c.CordonNode(cmdContext(cmd), args[0], on)
				if err != nil {
					return err
				}
				if a.json() {
					return a.printJSON(n)
				}
				fmt.Fprintf(a.env.Stdout, "%s %s\n", n.Name, nodeState(*n))
				return nil
			},
		}
	}
	cmd.AddCommand(cordon(true), cordon(false))
	cmd.AddCommand(&cobra.Command{
		Use:   "rm NODE",
		Short: "Remove a dead node, or a cordoned one that holds no sandbox",
		Long: `Remove a node's record, freeing its name: a replacement host can then register
under the same --node-name.

Only a dead node, or a cordoned one that holds no sandbox, can be removed. The
sandboxes still recorded on a dead node (lost ones, and suspended or stopped ones,
whose disks are on that host only) and the named snapshots kept on it are deleted
with it. Stop a live node's process
before removing it: once removed, its heartbeats are refused and it stops; started
again, it registers as a new node and reclaims everything it holds.`,
		Aliases: []string{"remove"},
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			rm, err := c.RemoveNode(cmdContext(cmd), args[0])
			if err != nil {
				return err
			}
			if a.json() {
				return a.printJSON(rm)
			}
			fmt.Fprintf(a.env.Stdout, "removed node %s (%s); %d sandbox(es) and %d snapshot(s) deleted with it\n",
				rm.Node.Name, rm.Node.ID, rm.SandboxesDeleted, rm.SnapshotsDeleted)
			return nil
		},
	})
	return cmd
}

// cacheOf renders a count of cached artifacts and their size.
func cacheOf(n int, bytes int64) string {
	if n == 0 {
		return "0"
	}
	return fmt.Sprintf("%d (%s)", n, humanBytes(bytes))
}

func nodeState(n api.Node) string {
	if n.Cordoned {
		return n.State + ",cordoned"
	}
	return n.State
}

// usedOf renders used/capacity ("-" for an unbounded capacity).
func usedOf(used, capacity int64) string {
	if capacity <= 0 {
		return fmt.Sprintf("%d/-", used)
	}
	return fmt.Sprintf("%d/%d", used, capacity)
}
