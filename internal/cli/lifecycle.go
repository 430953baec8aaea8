package cli

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/spacedev/space/api"
)

// lifecycleCmds are `space sandbox pause|resume|suspend|restore|stop|start|wake`.
func (a *app) lifecycleCmds() []*cobra.Command {
	verbs := []struct{ name, short string }{
		{"pause", "Freeze a sandbox's CPUs; it stays in memory"},
		{"resume", "Continue a paused sandbox"},
		{"suspend", "Save a sandbox's memory and disk as a snapshot and free its resources"},
		{"restore", "Bring a suspended sandbox back from its snapshot"},
		{"stop", "Power a sandbox off (its disk is kept, its memory is not)"},
		{"start", "Boot a stopped sandbox from its disk"},
		{"wake", "Get a sandbox running by whichever path works (resume, restore or start)"},
	}
	var out []*cobra.Command
	for _, v := range verbs {
		var wait bool
		cmd := &cobra.Command{
			Use:   v.name + " SANDBOX...",
			Short: v.short,
			Args:  cobra.MinimumNArgs(1),
			RunE: func(cmd *cobra.Command, args []string) error {
				c, err := a.connect()
				if err != nil {
					return err
				}
				ctx := cmdContext(cmd)
				var ops []*api.Operation
				for _, id := range args {
					op, err := c.Lifecycle(ctx, id, v.name)
					if err != nil {
						return fmt.Errorf("%s: %w", id, err)
					}
					if wait {
						if op, err = c.WaitOperation(ctx, op.ID); err != nil {
							return err
						}
						if op.State == api.OpFailed {
							return fmt.Errorf("%s %s failed: %s", v.name, id, op.Error)
						}
					}
					ops = append(ops, op)
					if !a.json() {
						fmt.Fprintln(a.env.Stdout, op.ID)
					}
				}
				if a.json() {
					return a.printJSON(ops)
				}
				return nil
			},
		}
		cmd.Flags().BoolVarP(&wait, "wait", "w", false, "wait until the operation is done")
		out = append(out, cmd)
	}
	return out
}

func (a *app) cloneCmd() *cobra.Command {
	var req api.CloneRequest
	var wait bool
	cmd := &cobra.Command{
		Use:   "clone SANDBOX",
		Short: "Make copies of a running or suspended sandbox (memory and disk, copy-on-write); prints their ids",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			ctx := cmdContext(cmd)
			list, err := c.Clone(ctx, args[0], req)
			if err != nil {
				return err
			}
			for i, sb := range list {
				if wait {
					op, err := c.WaitOperation(ctx, sb.Operation.ID)
					if err != nil {
						return err
					}
					if op.State == api.OpFailed {
						return fmt.Errorf("clone %s failed: %s", sb.ID, op.Error)
					}
					list[i].Operation = op
				}
				if !a.json() {
					fmt.Fprintln(a.env.Stdout, sb.ID)
				}
			}
			if a.json() {
				return a.printJSON(list)
			}
			return nil
		},
	}
	cmd.Flags().IntVarP(&req.Count, "count", "n", 1, "how many clones")
	cmd.Flags().StringVar(&req.TTL, "ttl", "", "delete the clones after this long")
	cmd.Flags().BoolVarP(&wait, "wait", "w", false, "wait until the clones run")
	return cmd
}

func (a *app) poolCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "pool", Aliases: []string{"pools"}, Short: "Manage warm pools (admin key required to change)"}
	var req api.SetPoolRequest
	set := &cobra.Command{
		Use:     "set TEMPLATE SIZE",
		Short:   "Keep SIZE parked sandboxes of TEMPLATE (and size class) ready; 0 removes the pool",
		Example: "  space pool set base 5\n  space pool set base:latest 2 --cpu 2 --memory 1024",
		Args:    cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := a.checkOutput(); err != nil {
				return err
			}
			req.Template = args[0]
			if _, err := fmt.Sscanf(args[1], "%d", &req.Size); err != nil {
				return fmt.Errorf("SIZE %q must be a number", args[1])
			}
			c, err := a.client()
			if err != nil {
				return err
			}
			p, err := c.SetPool(cmdContext(cmd), req)
			if err != nil {
				return err
			}
			if a.json() {
				return a.printJSON(p)
			}
			fmt.Fprintf(a.env.Stdout, "%s %dcpu %dMiB: %d\n", p.Template, p.CPU, p.MemoryMB, p.Size)
			return nil
		},
	}
	set.Flags().IntVar(&req.CPU, "cpu", 0, "vCPUs of the pool's sandboxes (default: the server's default)")
	set.Flags().IntVar(&req.MemoryMB, "memory", 0, "memory (MiB) of the pool's sandboxes (default: the server's default)")
	list := &cobra.Command{
		Use:     "list",
		Aliases: []string{"ls"},
		Short:   "List warm pools and how many sandboxes are ready in each",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			pools, err := c.ListPools(cmdContext(cmd))
			if err != nil {
				return err
			}
			return printList(a, pools, []string{"TEMPLATE", "CPU", "MEMORY", "SIZE", "READY"}, func(p api.Pool) []any {
				return []any{p.Template, p.CPU, fmt.Sprintf("%dMiB", p.MemoryMB), p.Size, p.Ready}
			})
		},
	}
	cmd.AddCommand(set, list)
	return cmd
}
