package cli

import (
	"fmt"
	"time"

	"github.com/spf13/cobra"

	"github.com/spacedev/space/internal/bench"
)

func (a *app) benchCmd() *cobra.Command {
	var cfg bench.Config
	var save bool
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Measure space against the bare runtime and print a table",
		Long: `Run benchmarks against a running space server and, side by side in the same run,
against the bare runtime (runsc), and print median, p95 and their ratio. Run it on the
server's host as root: the baselines use the template's files in the server's store.

Scenarios: ` + joinNames() + `.`,
		Example: "  space bench --runs 20\n  space bench --only cold-create -o json",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			cfg.Client = c
			cfg.DataDir = a.env.DataDir
			cfg.Progress = a.env.Stderr
			res, err := bench.Run(cmdContext(cmd), cfg)
			if save && (err == nil || len(res) > 0) {
				rep := bench.Report{FinishedAt: time.Now().UTC(), Template: cfg.Template, Runs: cfg.Runs, Only: cfg.Only, Results: res}
				if err != nil {
					rep.Error = err.Error()
				}
				if serr := bench.SaveLast(cfg.DataDir, rep); serr != nil {
					fmt.Fprintf(a.env.Stderr, "bench: %v\n", serr)
				}
			}
			if err != nil {
				return err
			}
			if a.json() {
				return bench.WriteJSON(a.env.Stdout, res)
			}
			return bench.WriteTable(a.env.Stdout, res)
		},
	}
	cmd.Flags().IntVar(&cfg.Runs, "runs", 10, "repetitions of each measurement")
	cmd.Flags().StringSliceVar(&cfg.Only, "only", nil, "run only these scenarios (comma-separated)")
	cmd.Flags().StringVar(&cfg.Template, "template", "base", "template for the sandboxes")
	cmd.Flags().StringVar(&cfg.EgressURL, "egress-url", "", "network scenario: a server sandboxes may reach that serves /bytes/{n}, for the egress rows (the bench reaches no other host)")
	cmd.Flags().StringVar(&cfg.EgressNetns, "egress-host-netns", "", "network scenario: the namespace the host-side egress baseline downloads from (the server's --network-host-netns)")
	cmd.Flags().BoolVar(&save, "save", true, "save the results to <data-dir>/bench/last.json, where the web console plots them")
	return cmd
}

func joinNames() string {
	s := ""
	for i, n := range bench.Names() {
		if i > 0 {
			s += ", "
		}
		s += n
	}
	return s
}
