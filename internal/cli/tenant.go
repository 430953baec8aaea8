package cli

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	"github.com/spacedev/space/api"
)

// tenantCmd is "space tenant": tenants and their quotas (operators).
func (a *app) tenantCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "tenant", Aliases: []string{"tenants"}, Short: "Manage tenants and their quotas (operator key required)",
		Long: `Manage tenants and their quotas (operator key required).

A tenant owns its sandboxes, processes, sessions, operations, templates, pools and API
keys; other tenants cannot see them (they answer like missing ones). Onboarding:

  space tenant create acme
  space tenant set-quota acme --running 20 --vcpus 40 --memory-mb 81920
  space apikey create acme-admin --tenant acme --admin`}
	create := &cobra.Command{
		Use:   "create NAME",
		Short: "Create a tenant",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			t, err := c.CreateTenant(cmdContext(cmd), args[0])
			if err != nil {
				return err
			}
			if a.json() {
				return a.printJSON(t)
			}
			fmt.Fprintln(a.env.Stdout, t.Name)
			return nil
		},
	}
	list := &cobra.Command{
		Use:     "list",
		Aliases: []string{"ls"},
		Short:   "List tenants with their usage",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			list, err := c.ListTenants(cmdContext(cmd))
			if err != nil {
				return err
			}
			cell := func(t api.Tenant, name string) string {
				for _, q := range t.Quota {
					if q.Name == name {
						return fmt.Sprintf("%d/%s", q.Usage, limitText(q.Limit))
					}
				}
				return "-"
			}
			return printList(a, list, []string{"NAME", "RUNNING", "VCPUS", "MEMORY MB", "DISK MB", "OPERATIONS", "CREATED"}, func(t api.Tenant) []any {
				return []any{t.Name, cell(t, "running_sandboxes"), cell(t, "vcpus"), cell(t, "memory_mb"), cell(t, "disk_mb"),
					cell(t, "operations"), ago(t.CreatedAt)}
			})
		},
	}
	get := &cobra.Command{
		Use:   "get NAME",
		Short: "Show a tenant's quotas and what it uses of them",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			t, err := c.GetTenant(cmdContext(cmd), args[0])
			if err != nil {
				return err
			}
			if a.json() {
				return a.printJSON(t)
			}
			fmt.Fprintf(a.env.Stdout, "tenant %s (created %s)\n\n", t.Name, ago(t.CreatedAt))
			tw := a.table("QUOTA", "USAGE", "LIMIT", "SET BY")
			for _, q := range t.Quota {
				usage := strconv.FormatInt(q.Usage, 10)
				if q.Name == "request_rate" || q.Name == "request_burst" {
					usage = "-"
				}
				by := "tenant"
				if q.Default {
					by = "server default"
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", q.Name, usage, limitText(q.Limit), by)
			}
			return tw.Flush()
		},
	}
	rm := &cobra.Command{
		Use:     "rm NAME",
		Aliases: []string{"delete"},
		Short:   "Remove a tenant with its API keys and pools (not while it has sandboxes or templates)",
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			t, err := c.DeleteTenant(cmdContext(cmd), args[0])
			if err != nil {
				return err
			}
			if a.json() {
				return a.printJSON(t)
			}
			fmt.Fprintln(a.env.Stdout, t.Name)
			return nil
		},
	}
	vals := map[string]*string{}
	setQuota := &cobra.Command{
		Use:   "set-quota NAME",
		Short: "Set a tenant's quotas (a number, \"unlimited\", or \"default\" for the server's default)",
		Example: `  space tenant set-quota acme --running 10 --vcpus 20 --memory-mb 40960
  space tenant set-quota acme --disk-mb unlimited --rate default`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			var req api.SetQuotaRequest
			fields := map[string]**int64{
				"running_sandboxes": &req.RunningSandboxes, "vcpus": &req.VCPUs, "memory_mb": &req.MemoryMB,
				"disk_mb": &req.DiskMB, "operations": &req.Operations, "request_rate": &req.RequestRate,
				"request_burst": &req.RequestBurst,
			}
			for name, v := range vals {
				if !cmd.Flags().Changed(quotaFlagName(name)) {
					continue
				}
				switch *v {
				case "default":
					req.Reset = append(req.Reset, name)
				case "unlimited":
					n := int64(-1)
					*fields[name] = &n
				default:
					n, err := strconv.ParseInt(*v, 10, 64)
					if err != nil {
						return fmt.Errorf("--%s %q: want a number, unlimited or default", quotaFlagName(name), *v)
					}
					*fields[name] = &n
				}
			}
			c, err := a.connect()
			if err != nil {
				return err
			}
			t, err := c.SetQuota(cmdContext(cmd), args[0], req)
			if err != nil {
				return err
			}
			if a.json() {
				return a.printJSON(t)
			}
			fmt.Fprintln(a.env.Stdout, t.Name)
			return nil
		},
	}
	for _, q := range []struct{ name, help string }{
		{"running_sandboxes", "sandboxes held in memory (running or paused)"},
		{"vcpus", "vCPUs of running and paused sandboxes"},
		{"memory_mb", "memory (MiB) of running and paused sandboxes"},
		{"disk_mb", "disk (MiB) of all sandboxes and snapshots"},
		{"operations", "unfinished operations"},
		{"request_rate", "API requests per second"},
		{"request_burst", "request burst (token bucket size)"},
	} {
		v := new(string)
		vals[q.name] = v
		setQuota.Flags().StringVar(v, quotaFlagName(q.name), "", q.help)
	}
	cmd.AddCommand(create, list, get, rm, setQuota)
	return cmd
}

// quotaFlagName is the set-quota flag of a quota: running_sandboxes is --running,
// request_rate --rate, the others their name with dashes.
func quotaFlagName(q string) string {
	switch q {
	case "running_sandboxes":
		return "running"
	case "request_rate":
		return "rate"
	case "request_burst":
		return "burst"
	}
	return strings.ReplaceAll(q, "_", "-")
}

func limitText(n int64) string {
	if n < 0 {
		return "unlimited"
	}
	return strconv.FormatInt(n, 10)
}
