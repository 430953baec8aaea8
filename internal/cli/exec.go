package cli

import (
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
)

func (a *app) execCmd() *cobra.Command {
	var req api.CreateSessionRequest
	var env []string
	var interactive, tty bool
	cmd := &cobra.Command{
		Use:   "exec SANDBOX [flags] -- COMMAND [ARG...]",
		Short: "Run a command in a sandbox and stream its output",
		Long: `Run a command in a sandbox. Its stdout and stderr stream to this terminal's stdout
and stderr, and space exits with the command's exit code (128+N when it died of
signal N). When the command did not choose its end, a line on stderr says why: it
could not be run (exit code 127: not found, 126: not executable), its --timeout
passed, or a signal killed it (as a shell does, not for SIGINT and SIGPIPE). Without -i and -t the command is started and streamed in one request
(POST /v1/sandboxes/{id}/exec), which the server serves with one call to the
sandbox's agent; output arrives as raw bytes in binary frames (no base64: see
docs/dataplane.md), written to this terminal exactly as the command wrote them. A
dropped connection is resumed from the last byte received; output that fell out of
the sandbox's journal before it was read (a command writing faster than this reader
takes it) is reported on stderr.

With -i, this terminal's stdin is sent to the command; with -t it runs on a
pseudo-terminal (raw mode, resized with the terminal).`,
		Example: `  space exec $id -- python3 -c 'print(6*7)'
  space exec $id --cwd /tmp --env DEBUG=1 -- bash -c 'echo $DEBUG; pwd'
  space exec -it $id -- bash`,
		Args: cobra.MinimumNArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			if cmd.ArgsLenAtDash() != 1 {
				return fmt.Errorf("put the command after --, like: space exec SANDBOX -- COMMAND")
			}
			var err error
			if req.Env, err = parseKV("env", env); err != nil {
				return err
			}
			req.Argv = args[1:]
			c, err := a.client()
			if err != nil {
				return err
			}
			if interactive || tty {
				return a.interactive(cmd, c, args[0], req, tty)
			}
			exit, err := c.ExecExit(cmdContext(cmd), args[0], req, client.Output{Stdout: a.env.Stdout, Stderr: a.env.Stderr,
				OnGap: func(g api.GapEvent) {
					fmt.Fprintf(a.env.Stderr, "space: %d bytes of output were dropped (journal overflow)\n", g.Dropped)
				}})
			if err != nil {
				return err
			}
			return a.processExit(exit)
		},
	}
	f := cmd.Flags()
	f.StringArrayVarP(&env, "env", "e", nil, "environment variable KEY=VALUE (repeatable)")
	f.StringVarP(&req.Cwd, "cwd", "w", "", "working directory (default: the user's home)")
	f.StringVarP(&req.User, "user", "u", "", "run as this user: root (default) or user")
	f.StringVar(&req.Timeout, "timeout", "", "kill the command after this long (e.g. 30s)")
	f.BoolVarP(&interactive, "interactive", "i", false, "send stdin to the command")
	f.BoolVarP(&tty, "tty", "t", false, "run on a pseudo-terminal")
	return cmd
}

func (a *app) opCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "op", Aliases: []string{"operation", "operations"}, Short: "Inspect and wait for operations"}
	show := func(op *api.Operation) error {
		if a.json() {
			return a.printJSON(op)
		}
		tw := a.table("ID", "KIND", "SANDBOX", "STATE", "MESSAGE", "ERROR")
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", op.ID, op.Kind, op.SandboxID, op.State, op.Message, op.Error)
		if err := tw.Flush(); err != nil {
			return err
		}
		if len(op.Timeline) == 0 {
			return nil
		}
		fmt.Fprintln(a.env.Stdout)
		tw = a.table("PHASE", "AT", "STEP")
		for i, e := range op.Timeline {
			step := 0.0
			if i > 0 {
				step = e.Ms - op.Timeline[i-1].Ms
			}
			fmt.Fprintf(tw, "%s\t+%.1f ms\t%.1f ms\n", e.Phase, e.Ms, step)
		}
		return tw.Flush()
	}
	get := &cobra.Command{
		Use:   "get OPERATION",
		Short: "Show an operation",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			op, err := c.GetOperation(cmdContext(cmd), args[0])
			if err != nil {
				return err
			}
			return show(op)
		},
	}
	wait := &cobra.Command{
		Use:   "wait OPERATION",
		Short: "Wait until an operation is done; exit 1 if it failed",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			op, err := c.WaitOperation(cmdContext(cmd), args[0])
			if err != nil {
				return err
			}
			if err := show(op); err != nil {
				return err
			}
			if op.State == api.OpFailed {
				return &ExitError{Code: 1}
			}
			return nil
		},
	}
	cmd.AddCommand(get, wait)
	return cmd
}

func (a *app) apikeyCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "apikey", Aliases: []string{"apikeys"}, Short: "Manage API keys (an operator's key, or a tenant admin's for its tenant)"}
	var admin, e2b bool
	var tenant, role string
	create := &cobra.Command{
		Use:   "create NAME",
		Short: "Create an API key in a tenant and print its secret (shown only once)",
		Long: `Create an API key and print its secret (shown only once).

Operators name the tenant the key belongs to with --tenant (required; see
"space tenant list"); a tenant's admin key creates keys in its own tenant only.
Roles: member (the default: the tenant's sandboxes, sessions and operations), admin
(--admin: also the tenant's keys, templates and pools) and operator (--role operator,
operators only: every tenant, tenants and quotas, nodes, metrics).`,
		Example: `  space apikey create ci-bot --tenant acme
  space apikey create acme-admin --tenant acme --admin
  space apikey create sdk --tenant acme --e2b`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			req := api.CreateAPIKeyRequest{Name: args[0], Admin: admin, Role: role, Kind: "space", Tenant: tenant}
			if e2b {
				req.Kind = "e2b"
			}
			k, err := c.CreateAPIKey(cmdContext(cmd), req)
			if err != nil {
				return err
			}
			if a.json() {
				return a.printJSON(k)
			}
			fmt.Fprintln(a.env.Stdout, k.Secret)
			return nil
		},
	}
	create.Flags().StringVar(&tenant, "tenant", "", "the key's tenant (required from operators)")
	create.Flags().BoolVar(&admin, "admin", false, "make the tenant's admin key: it manages the tenant's keys, templates and pools")
	create.Flags().StringVar(&role, "role", "", "member, admin or operator (operators only)")
	create.Flags().BoolVar(&e2b, "e2b", false, "make an E2B-format key (e2b_…) for the E2B-compatible API")
	var listTenant string
	list := &cobra.Command{
		Use:     "list",
		Aliases: []string{"ls"},
		Short:   "List API keys",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			keys, err := c.ListAPIKeysOf(cmdContext(cmd), listTenant)
			if err != nil {
				return err
			}
			return printList(a, keys, []string{"ID", "NAME", "TENANT", "ROLE", "PREFIX", "KIND", "CREATED", "REVOKED"}, func(k api.APIKey) []any {
				revoked := "-"
				if k.RevokedAt != nil {
					revoked = ago(*k.RevokedAt)
				}
				return []any{k.ID, k.Name, k.Tenant, k.Role, k.Prefix + "…", k.Kind, ago(k.CreatedAt), revoked}
			})
		},
	}
	list.Flags().StringVar(&listTenant, "tenant", "", "only this tenant's keys (operators)")
	revoke := &cobra.Command{
		Use:   "revoke KEY-ID",
		Short: "Revoke an API key by its id (key_…; see space apikey list)",
		Long: `Revoke an API key by its id (key_…; see "space apikey list"). The key stops
working at once, and so do the attachment tokens it minted (their open streams are
cut within a second).`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.client()
			if err != nil {
				return err
			}
			k, err := c.RevokeAPIKey(cmdContext(cmd), args[0])
			if err != nil {
				return err
			}
			if a.json() {
				return a.printJSON(k)
			}
			fmt.Fprintln(a.env.Stdout, k.ID)
			return nil
		},
	}
	cmd.AddCommand(create, list, revoke)
	return cmd
}

func (a *app) nodeCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "node", Aliases: []string{"nodes"}, Short: "Inspect nodes"}
	cmd.AddCommand(&cobra.Command{
		Use:     "list",
		Aliases: []string{"ls"},
		Short:   "List nodes with their runtime",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			nodes, err := c.ListNodes(cmdContext(cmd))
			if err != nil {
				return err
			}
			return printList(a, nodes, []string{"NAME", "STATE", "RUNTIME", "DETAILS", "SANDBOXES", "HEARTBEAT", "DATA PLANE"}, func(n api.Node) []any {
				return []any{n.Name, n.State, n.Runtime, details(n.RuntimeInfo), n.Sandboxes, ago(n.HeartbeatAt), n.DataPlaneURL}
			})
		},
	})
	return cmd
}

func details(v any) string {
	m, ok := v.(map[string]any)
	if !ok {
		return ""
	}
	var parts []string
	for _, k := range []string{"version", "platform", "accel", "accel_reason", "kernel_boot"} {
		if s, ok := m[k]; ok {
			parts = append(parts, fmt.Sprintf("%s=%v", k, s))
		}
	}
	return strings.Join(parts, " ")
}

func humanBytes(n int64) string {
	const unit = 1024
	if n < unit {
		return strconv.FormatInt(n, 10) + " B"
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}

var _ = os.Stdin
