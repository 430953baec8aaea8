package cli

import (
	"fmt"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
)

func (a *app) snapshotCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "snapshot", Aliases: []string{"snapshots", "snap"},
		Short: "Take, list and delete named snapshots (a sandbox's memory and disk, kept on its own)",
		Long: `A named snapshot captures a running, paused or suspended sandbox's memory and disk
and keeps them as a resource of its own: the sandbox keeps running (it pauses for
well under a second) and may be deleted later; the snapshot stays until it is
removed. New sandboxes restore from it with "space sandbox create --snapshot NAME",
each with its own id and identity, on the node that holds the snapshot.`}
	cmd.AddCommand(a.snapshotCreate(), a.snapshotList(), a.snapshotGet(), a.snapshotRm())
	return cmd
}

func (a *app) snapshotCreate() *cobra.Command {
	var req api.CreateSnapshotRequest
	var noWait bool
	cmd := &cobra.Command{
		Use:   "create SANDBOX",
		Short: "Take a named snapshot of a sandbox and print its id",
		Long: `Take a named snapshot of a sandbox. The command waits until the snapshot is ready
(unless --no-wait) and prints its id (the snapshot as JSON with -o json). Names are
unique among your snapshots; without --name the snapshot is named by its id.`,
		Example: `  space snapshot create $id --name warmed-up
  space sandbox create --snapshot warmed-up --wait`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			ctx := cmdContext(cmd)
			sn, err := c.CreateSnapshot(ctx, args[0], req)
			if err != nil {
				return err
			}
			if !noWait {
				op, err := c.WaitOperation(ctx, sn.Operation.ID)
				if err != nil {
					return err
				}
				if op.State == api.OpFailed {
					return fmt.Errorf("snapshot of %s failed: %s", args[0], op.Error)
				}
				if sn, err = c.GetSnapshot(ctx, sn.ID); err != nil {
					return err
				}
				sn.Operation = op
			}
			if a.json() {
				return a.printJSON(sn)
			}
			fmt.Fprintln(a.env.Stdout, sn.ID)
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVarP(&req.Name, "name", "n", "", "name of the snapshot (unique among yours; default: its id)")
	f.BoolVar(&req.Replace, "replace", false, "if the name is taken, move it to the new snapshot (the old one keeps its id)")
	f.BoolVar(&noWait, "no-wait", false, "return once the snapshot is requested, without waiting until it is ready")
	return cmd
}

func (a *app) snapshotList() *cobra.Command {
	var o client.SnapshotListOptions
	cmd := &cobra.Command{
		Use:     "list",
		Aliases: []string{"ls"},
		Short:   "List named snapshots",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			list, err := c.ListSnapshots(cmdContext(cmd), o)
			if err != nil {
				return err
			}
			return printList(a, list, []string{"ID", "NAME", "STATE", "SOURCE", "TEMPLATE", "CPU", "MEMORY", "SIZE", "CREATED"}, func(s api.Snapshot) []any {
				return []any{s.ID, s.Name, s.State, s.SourceSandbox, s.Template, s.CPU, fmt.Sprintf("%dMiB", s.MemoryMB),
					humanBytes(s.SizeBytes), ago(s.CreatedAt)}
			})
		},
	}
	cmd.Flags().StringVar(&o.Sandbox, "sandbox", "", "only snapshots of this sandbox")
	return cmd
}

func (a *app) snapshotGet() *cobra.Command {
	return &cobra.Command{
		Use:   "get SNAPSHOT",
		Short: "Show a named snapshot (by id or name)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			sn, err := c.GetSnapshot(cmdContext(cmd), args[0])
			if err != nil {
				return err
			}
			if a.json() {
				return a.printJSON(sn)
			}
			tw := a.table("FIELD", "VALUE")
			row := func(k, v string) { fmt.Fprintf(tw, "%s\t%s\n", k, v) }
			row("id", sn.ID)
			row("name", sn.Name)
			row("state", sn.State)
			row("source sandbox", sn.SourceSandbox)
			row("template", sn.Template)
			row("template digest", sn.TemplateDigest)
			row("cpu", fmt.Sprint(sn.CPU))
			row("memory", fmt.Sprintf("%d MiB", sn.MemoryMB))
			row("disk limit", fmt.Sprintf("%d MiB", sn.DiskMB))
			row("runtime", sn.Runtime)
			row("node", sn.Node)
			row("size", humanBytes(sn.SizeBytes))
			row("created", sn.CreatedAt.Format(time.RFC3339))
			if sn.ReadyAt != nil {
				row("ready", sn.ReadyAt.Format(time.RFC3339))
			}
			return tw.Flush()
		},
	}
}

func (a *app) snapshotRm() *cobra.Command {
	return &cobra.Command{
		Use:     "rm SNAPSHOT...",
		Aliases: []string{"delete"},
		Short:   "Delete named snapshots (by id or name)",
		Args:    cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			var out []*api.Snapshot
			var failed []string
			for _, ref := range args {
				sn, err := c.DeleteSnapshot(cmdContext(cmd), ref)
				if err != nil {
					failed = append(failed, fmt.Sprintf("%s: %v", ref, err))
					continue
				}
				out = append(out, sn)
				if !a.json() {
					fmt.Fprintln(a.env.Stdout, sn.ID)
				}
			}
			if a.json() {
				if err := a.printJSON(out); err != nil {
					return err
				}
			}
			if len(failed) > 0 {
				return fmt.Errorf("%s", strings.Join(failed, "; "))
			}
			return nil
		},
	}
}

func (a *app) sandboxMetrics() *cobra.Command {
	var since time.Duration
	cmd := &cobra.Command{
		Use:   "metrics SANDBOX",
		Short: "Show a sandbox's resource use over time (CPU, memory, disk against its limits)",
		Long: `Show a sandbox's resource samples, oldest first. Its node samples it every 5 s
while it runs; samples older than 15 minutes are kept as minute averages, older
than a day as hour averages, for 30 days. Totals are the sandbox's own limits.`,
		Example: "  space sandbox metrics $id --since 10m",
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			var start time.Time
			if since > 0 {
				start = time.Now().Add(-since)
			}
			m, err := c.SandboxMetrics(cmdContext(cmd), args[0], start, time.Time{})
			if err != nil {
				return err
			}
			if a.json() {
				return a.printJSON(m)
			}
			return printList(a, m.Samples, []string{"TIME", "SPAN", "CPU", "MEMORY", "DISK"}, func(s api.MetricSample) []any {
				return []any{s.Time.Local().Format(time.TimeOnly), s.Resolution,
					fmt.Sprintf("%.1f%% of %d", s.CPUUsedPct, s.CPUCount),
					fmt.Sprintf("%s / %s", humanBytes(s.MemUsed), humanBytes(s.MemTotal)),
					fmt.Sprintf("%s / %s", humanBytes(s.DiskUsed), humanBytes(s.DiskTotal))}
			})
		},
	}
	cmd.Flags().DurationVar(&since, "since", 0, "only samples of the last DURATION (e.g. 10m; default: all)")
	return cmd
}
