package cli

import (
	"fmt"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
)

func (a *app) sandboxCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "sandbox", Aliases: []string{"sandboxes", "sb"}, Short: "Create, list, inspect and delete sandboxes",
		Long: `Create, list, inspect and delete sandboxes, and move them between their states
(pause, resume, suspend, restore, stop, start, wake) or clone them.

A verb sent while the sandbox is in another transition (an idle suspend, a pause in
flight) waits for it to finish, for up to a minute, and then applies; a verb that does
not apply to the state the sandbox ends in fails with the reason ("cannot pause a
sandbox that is suspended"). Creates, verbs, clones and deletes are sent with an
idempotency key and repeated if the server was briefly unreachable, so nothing happens
twice.`}
	cmd.AddCommand(a.sandboxCreate(), a.sandboxList(), a.sandboxGet(), a.sandboxRm(), a.cloneCmd(),
		a.networkCmd(), a.netlogCmd(), a.sandboxMetrics())
	cmd.AddCommand(a.lifecycleCmds()...)
	return cmd
}

func (a *app) sandboxCreate() *cobra.Command {
	var req api.CreateSandboxRequest
	var env, meta []string
	var wait bool
	var idem string
	var nf netFlags
	cmd := &cobra.Command{
		Use:   "create",
		Short: "Create a sandbox and print its id",
		Long: `Create a sandbox. The new sandbox's id is printed alone on stdout (the full
sandbox as JSON with -o json). Without --wait the command returns as soon as the
request is recorded; with --wait it waits until the sandbox runs (or failed).

The first sandbox from the builtin "base" template builds that template (Debian
bookworm via debootstrap, about a minute); later ones start in well under a second.`,
		Example: `  space sandbox create --wait
  id=$(space sandbox create --template base --memory 1024 --env FOO=bar --metadata owner=alice --ttl 2h --wait)
  space sandbox create --egress --allow-out pypi.org --allow-out '*.pythonhosted.org' --deny-out 0.0.0.0/0 --wait
  space sandbox create --network-closed --wait     # no egress now; open it later with "space sandbox network"`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := a.checkOutput(); err != nil {
				return err
			}
			if req.Snapshot != "" && !cmd.Flags().Changed("template") {
				req.Template = "" // the snapshot's
			}
			var err error
			if req.Env, err = parseKV("env", env); err != nil {
				return err
			}
			if req.Metadata, err = parseKV("metadata", meta); err != nil {
				return err
			}
			if req.Network, err = a.createNetwork(&nf); err != nil {
				return err
			}
			c, err := a.client()
			if err != nil {
				return err
			}
			ctx := cmdContext(cmd)
			sb, err := c.CreateSandbox(ctx, req, idem)
			if err != nil {
				return err
			}
			if wait {
				op, err := c.WaitOperation(ctx, sb.Operation.ID)
				if err != nil {
					return err
				}
				if op.State == api.OpFailed {
					return fmt.Errorf("sandbox %s failed to start: %s", sb.ID, op.Error)
				}
				opv := sb.Operation
				if sb, err = c.GetSandbox(ctx, sb.ID); err != nil {
					return err
				}
				sb.Operation = op
				_ = opv
			}
			if a.json() {
				return a.printJSON(sb)
			}
			fmt.Fprintln(a.env.Stdout, sb.ID)
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVarP(&req.Template, "template", "t", "base", "template reference: name, name:tag or name@sha256:…")
	f.IntVar(&req.CPU, "cpu", 0, "vCPUs (default: the server's default)")
	f.IntVar(&req.MemoryMB, "memory", 0, "memory in MiB (default: the server's default)")
	f.StringArrayVarP(&env, "env", "e", nil, "environment variable KEY=VALUE for every process (repeatable)")
	f.StringArrayVarP(&meta, "metadata", "m", nil, "metadata KEY=VALUE (repeatable)")
	f.StringVar(&req.TTL, "ttl", "", "delete the sandbox after this long (e.g. 30m, 2h)")
	f.StringVar(&req.Runtime, "runtime", "", "ask for a runtime: gvisor, qemu or firecracker")
	f.StringVar(&req.IdleTimeout, "idle-timeout", "", "suspend the sandbox after this long without activity (default: the server's, 6h; 0 = never)")
	f.StringVar(&req.CheckpointInterval, "checkpoint-interval", "", "checkpoint the running sandbox this often (at least 10s) to the fleet's registry, so it is restored on another node from the last checkpoint if its node dies (each checkpoint pauses it about a second)")
	f.StringVar(&req.Snapshot, "snapshot", "", "restore from a named snapshot (id or name) instead of a template: its memory, disk and resources")
	f.BoolVarP(&wait, "wait", "w", false, "wait until the sandbox is running")
	f.StringVar(&idem, "idempotency-key", "", "retry-safe key: a retried create with the same key returns the same sandbox")
	nf.register(f, true)
	return cmd
}

func (a *app) sandboxList() *cobra.Command {
	var states, meta []string
	var tenant string
	cmd := &cobra.Command{
		Use:     "list",
		Aliases: []string{"ls"},
		Short:   "List sandboxes",
		Example: "  space sandbox list --state running --metadata owner=alice",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := a.checkOutput(); err != nil {
				return err
			}
			md, err := parseKV("metadata", meta)
			if err != nil {
				return err
			}
			c, err := a.client()
			if err != nil {
				return err
			}
			list, err := c.ListSandboxes(cmdContext(cmd), client.ListOptions{States: states, Metadata: md, Tenant: tenant})
			if err != nil {
				return err
			}
			return printList(a, list, []string{"ID", "STATE", "TEMPLATE", "CPU", "MEMORY", "NODE", "CREATED"}, func(s api.Sandbox) []any {
				return []any{s.ID, s.State, s.Template, s.CPU, fmt.Sprintf("%dMiB", s.MemoryMB), s.Node, ago(s.CreatedAt)}
			})
		},
	}
	cmd.Flags().StringArrayVar(&states, "state", nil, "only sandboxes in this state (repeatable)")
	cmd.Flags().StringArrayVarP(&meta, "metadata", "m", nil, "only sandboxes whose metadata has KEY=VALUE (repeatable)")
	cmd.Flags().StringVar(&tenant, "tenant", "", "only this tenant's sandboxes (operator keys see every tenant's)")
	return cmd
}

func (a *app) sandboxGet() *cobra.Command {
	return &cobra.Command{
		Use:   "get SANDBOX",
		Short: "Show a sandbox",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			sb, err := c.GetSandbox(cmdContext(cmd), args[0])
			if err != nil {
				return err
			}
			if a.json() {
				return a.printJSON(sb)
			}
			tw := a.table("FIELD", "VALUE")
			row := func(k, v string) { fmt.Fprintf(tw, "%s\t%s\n", k, v) }
			row("id", sb.ID)
			row("state", sb.State)
			row("desired state", sb.DesiredState)
			row("template", sb.Template)
			row("template digest", sb.TemplateDigest)
			row("cpu", fmt.Sprint(sb.CPU))
			row("memory", fmt.Sprintf("%d MiB", sb.MemoryMB))
			row("runtime", sb.Runtime)
			row("node", sb.Node)
			row("start path", sb.StartPath)
			row("idle timeout", sb.IdleTimeout)
			row("last activity", sb.LastActivityAt.Format(time.RFC3339))
			if sb.StatusReason != "" {
				row("status reason", sb.StatusReason)
			}
			if sb.StatusAt != nil {
				row("status since", sb.StatusAt.Format(time.RFC3339))
			}
			if sb.CloneOf != "" {
				row("clone of", sb.CloneOf)
			}
			if sb.Snapshot != "" {
				row("from snapshot", sb.Snapshot)
			}
			row("disk (exclusive)", humanBytes(sb.DiskBytes))
			row("created", sb.CreatedAt.Format(time.RFC3339))
			if sb.ExpiresAt != nil {
				row("expires", sb.ExpiresAt.Format(time.RFC3339))
			}
			for k, v := range sb.Metadata {
				row("metadata."+k, v)
			}
			if sb.Error != "" {
				row("error", sb.Error)
			}
			if ops, err := c.SandboxOperations(cmdContext(cmd), sb.ID); err == nil {
				for _, op := range ops { // newest first
					if op.Kind == api.OpCreate {
						if tl := timelineSummary(op.Timeline); tl != "" {
							row("create timeline", tl)
						}
						break
					}
				}
			}
			return tw.Flush()
		},
	}
}

func (a *app) sandboxRm() *cobra.Command {
	var wait bool
	cmd := &cobra.Command{
		Use:     "rm SANDBOX...",
		Aliases: []string{"delete"},
		Short:   "Delete sandboxes",
		Args:    cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			ctx := cmdContext(cmd)
			var ops []*api.Operation
			var failed []string
			for _, id := range args {
				op, err := c.DeleteSandbox(ctx, id)
				if err != nil {
					failed = append(failed, fmt.Sprintf("%s: %v", id, err))
					continue
				}
				if wait {
					if op, err = c.WaitOperation(ctx, op.ID); err != nil {
						return err
					}
				}
				ops = append(ops, op)
				if !a.json() {
					fmt.Fprintln(a.env.Stdout, id)
				}
			}
			if a.json() {
				if err := a.printJSON(ops); err != nil {
					return err
				}
			}
			if len(failed) > 0 {
				return fmt.Errorf("%s", strings.Join(failed, "; "))
			}
			return nil
		},
	}
	cmd.Flags().BoolVarP(&wait, "wait", "w", false, "wait until each sandbox is deleted")
	return cmd
}

// timelineSummary renders an operation's timeline on one line: each phase with its
// offset from acceptance in milliseconds ("" without one).
func timelineSummary(tl []api.TimelineEntry) string {
	parts := make([]string, 0, len(tl))
	for _, e := range tl {
		parts = append(parts, fmt.Sprintf("%s %.0f", e.Phase, e.Ms))
	}
	if len(parts) == 0 {
		return ""
	}
	return strings.Join(parts, " · ") + " ms"
}
