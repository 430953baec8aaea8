package cli

import (
	"bytes"
	"fmt"
	"os"
	"time"

	"github.com/spf13/cobra"

	"github.com/spacedev/space/internal/bench"
)

func (a *app) benchCmd() *cobra.Command {
	var cfg bench.Config
	var save bool
	var htmlFile, svgDir, from string
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Measure space against the bare runtime and print a table",
		Long: `Run benchmarks against a running space server and, side by side in the same run,
against the bare runtime (runsc), and print median, p95 and their ratio. Run it on the
server's host as root: the baselines use the template's files in the server's store.

With --html FILE it also writes a self-contained HTML page drawing each measurement's
distribution (inline SVG: every sample, median and p95) next to its baseline's, with
their ratio. With --svg DIR it writes one standalone SVG per scenario
(DIR/bench-<scenario>.svg, the same plots, no scripts), for embedding in Markdown;
--from renders a saved report (<data-dir>/bench/last.json, or a file of the same form)
with --html and/or --svg without running anything.

density breaks down the host memory of idle sandboxes (sentry, gofer, the agent inside,
the server's share); scale creates 10, 50, 100 and 200 idle sandboxes (--scale-max caps
the largest step) and reports create throughput, API latency, host memory and the CPU
an idle sandbox costs at each size.

Scenarios: ` + joinNames() + `.`,
		Example: "  space bench --runs 20\n  space bench --only cold-create -o json\n" +
			"  space bench --only pool,exec --html bench.html\n  space bench --from last --html bench.html\n" +
			"  space bench --only density,scale --scale-max 50 --svg docs/images",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if from != "" {
				if htmlFile == "" && svgDir == "" {
					return fmt.Errorf("--from renders a saved report: give --html FILE or --svg DIR")
				}
				if from == "last" {
					from = bench.LastPath(a.env.DataDir)
				}
				rep, err := bench.LoadReport(from)
				if err != nil {
					return err
				}
				if htmlFile != "" {
					if err := writeHTMLFile(htmlFile, rep); err != nil {
						return err
					}
				}
				if svgDir != "" {
					if _, err := bench.WriteSVGDir(svgDir, rep); err != nil {
						return err
					}
				}
				return nil
			}
			c, err := a.connect()
			if err != nil {
				return err
			}
			cfg.Client = c
			cfg.DataDir = a.env.DataDir
			cfg.Progress = a.env.Stderr
			host := bench.ReadHost()
			fmt.Fprintf(a.env.Stderr, "bench: host: %s\n", host)
			res, err := bench.Run(cmdContext(cmd), cfg)
			rep := bench.Report{FinishedAt: time.Now().UTC(), Template: cfg.Template, Runs: cfg.Runs, Only: cfg.Only, Host: &host, Results: res}
			if err != nil {
				rep.Error = err.Error()
			}
			if save && (err == nil || len(res) > 0) {
				if serr := bench.SaveLast(cfg.DataDir, rep); serr != nil {
					fmt.Fprintf(a.env.Stderr, "bench: %v\n", serr)
				}
			}
			if htmlFile != "" && (err == nil || len(res) > 0) {
				if herr := writeHTMLFile(htmlFile, rep); herr != nil {
					fmt.Fprintf(a.env.Stderr, "bench: %v\n", herr)
				}
			}
			if svgDir != "" && (err == nil || len(res) > 0) {
				if _, serr := bench.WriteSVGDir(svgDir, rep); serr != nil {
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
	cmd.Flags().StringVar(&cfg.Registry, "registry", os.Getenv("SPACE_REGISTRY"), "template-pull scenario: the server's registry (space serve --registry; env SPACE_REGISTRY, credentials from SPACE_REGISTRY_USERNAME/PASSWORD/DOCKER_CONFIG); empty skips the scenario")
	cmd.Flags().BoolVar(&cfg.RegistryInsecure, "registry-insecure", false, "template-pull scenario: allow plain HTTP to a registry that is not on a loopback address")
	cmd.Flags().BoolVar(&save, "save", true, "save the results to <data-dir>/bench/last.json, where the web console plots them")
	cmd.Flags().StringVar(&htmlFile, "html", "", "also write the results as a self-contained HTML page with a plot per measurement")
	cmd.Flags().StringVar(&svgDir, "svg", "", "also write one SVG per scenario (DIR/bench-<scenario>.svg)")
	cmd.Flags().IntVar(&cfg.ScaleMax, "scale-max", 200, "scale scenario: the largest number of idle sandboxes (steps of 10, 50, 100, 200 below it, then it)")
	cmd.Flags().DurationVar(&cfg.ScaleCPUWindow, "scale-cpu-window", 20*time.Second, "scale scenario: how long idle CPU is read at each step")
	cmd.Flags().StringVar(&from, "from", "", "render a saved report (a JSON file, or \"last\" for <data-dir>/bench/last.json) with --html or --svg, running nothing")
	return cmd
}

// writeHTMLFile writes rep's HTML report to path (atomically).
func writeHTMLFile(path string, rep bench.Report) error {
	var buf bytes.Buffer
	if err := bench.WriteHTML(&buf, rep); err != nil {
		return err
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, buf.Bytes(), 0o644); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
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
