package cli

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
)

func (a *app) dataPlaneCmds() []*cobra.Command {
	return []*cobra.Command{a.psCmd(), a.attachCmd(), a.logsCmd(), a.killCmd(), a.cpCmd()}
}

func parsePID(s string) (int, error) {
	n, err := strconv.Atoi(s)
	if err != nil || n <= 0 {
		return 0, fmt.Errorf("PID %q must be a positive integer", s)
	}
	return n, nil
}

func (a *app) psCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "ps SANDBOX",
		Short: "List a sandbox's processes (running and recently exited)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			list, err := c.ListProcesses(cmdContext(cmd), args[0])
			if err != nil {
				return err
			}
			return printList(a, list, []string{"PID", "STATE", "EXIT", "USER", "STARTED", "COMMAND"}, func(p api.Process) []any {
				exit := "-"
				switch {
				case p.ExitCode != nil:
					exit = strconv.Itoa(*p.ExitCode)
				case p.Signal != "":
					exit = p.Signal
				}
				if p.TimedOut {
					exit += " (timed out)"
				}
				started := "-"
				if p.StartedAt != nil {
					started = ago(*p.StartedAt)
				}
				return []any{p.PID, p.State, exit, p.User, started, strings.Join(p.Argv, " ")}
			})
		},
	}
}

// follow re-attaches to pid and prints its output (replay, then follow when live).
func (a *app) follow(cmd *cobra.Command, sandbox, pidArg string, from string) error {
	pid, err := parsePID(pidArg)
	if err != nil {
		return err
	}
	c, err := a.client()
	if err != nil {
		return err
	}
	ctx := cmdContext(cmd)
	sess, err := c.CreateSession(ctx, sandbox, api.CreateSessionRequest{PID: pid, Rights: []string{api.RightRead}})
	if err != nil {
		return err
	}
	if from != "" && from != "0" {
		sess.AttachURL += "?from=" + from
	}
	exit, err := c.Follow(ctx, sess, client.Output{Stdout: a.env.Stdout, Stderr: a.env.Stderr,
		OnGap: func(g api.GapEvent) {
			fmt.Fprintf(a.env.Stderr, "space: %d earlier bytes are no longer in the journal\n", g.Dropped)
		}})
	if err != nil {
		return err
	}
	return a.processExit(exit)
}

func (a *app) attachCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "attach SANDBOX PID",
		Short: "Replay a process's output from the start of its journal, then follow it until it exits",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.follow(cmd, args[0], args[1], "")
		},
	}
}

func (a *app) logsCmd() *cobra.Command {
	var followFlag bool
	cmd := &cobra.Command{
		Use:   "logs SANDBOX PID",
		Short: "Print a process's output (with -f, keep following it)",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			if followFlag {
				return a.follow(cmd, args[0], args[1], "")
			}
			pid, err := parsePID(args[1])
			if err != nil {
				return err
			}
			c, err := a.client()
			if err != nil {
				return err
			}
			ctx := cmdContext(cmd)
			p, err := c.GetProcess(ctx, args[0], pid)
			if err != nil {
				return err
			}
			if p.State == api.ProcExited {
				return a.follow(cmd, args[0], args[1], "")
			}
			return c.Snapshot(ctx, args[0], pid, client.Output{Stdout: a.env.Stdout, Stderr: a.env.Stderr})
		},
	}
	cmd.Flags().BoolVarP(&followFlag, "follow", "f", false, "follow the output until the process exits")
	return cmd
}

func (a *app) killCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "kill SANDBOX PID [SIGNAL]",
		Short: "Send a signal (default SIGTERM) to a process",
		Args:  cobra.RangeArgs(2, 3),
		RunE: func(cmd *cobra.Command, args []string) error {
			pid, err := parsePID(args[1])
			if err != nil {
				return err
			}
			sig := "SIGTERM"
			if len(args) == 3 {
				sig = args[2]
			}
			c, err := a.client()
			if err != nil {
				return err
			}
			return c.Signal(cmdContext(cmd), args[0], pid, sig)
		},
	}
}

func (a *app) interactive(cmd *cobra.Command, c *client.Client, sandbox string, req api.CreateSessionRequest, tty bool) error {
	exit, err := runInteractive(cmdContext(cmd), a.env, c, sandbox, req, tty)
	if err != nil {
		return err
	}
	return a.processExit(exit)
}
