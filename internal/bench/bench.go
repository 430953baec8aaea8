// Package bench owns space's benchmarks: scenarios that drive a running space server
// through its API and, side by side in the same run, the bare runtime they are built
// on, and report medians, p95s and ratios. `space bench` prints them as a table.
package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spacedev/space/client"
)

// Config configures a benchmark run.
type Config struct {
	Client *client.Client
	// DataDir is the server's data directory (for the runtime baselines, which run the
	// template's root filesystem directly). Baselines need root and a local server.
	DataDir string
	// Runs is how many times each measurement is repeated.
	Runs int
	// Only restricts the run to these scenarios (empty: all).
	Only []string
	// Template is the template used for sandboxes.
	Template string
	// Progress receives one line per finished scenario.
	Progress io.Writer
	// EgressURL is a server sandboxes may reach that serves /bytes/{n} (the network
	// scenario's egress rows; empty skips them).
	EgressURL string
	// EgressNetns is the network namespace the host-side egress baseline downloads
	// from (the server's --network-host-netns, when it has one).
	EgressNetns string
	// Registry is the server's registry (space serve --registry), for the
	// template-pull scenario (empty skips it); RegistryInsecure as its
	// --registry-insecure. Credentials come from the same environment as the server's.
	Registry         string
	RegistryInsecure bool
	// ScaleMax caps the scale scenario's largest step (of 10, 50, 100, 200 idle
	// sandboxes); 0 means 200.
	ScaleMax int
	// ScaleCPUWindow is how long the scale scenario reads idle CPU at each step (and
	// once with no idle sandboxes); 0 means 20 s, four of a node's sample rounds.
	ScaleCPUWindow time.Duration
}

// Result is one row of the report.
type Result struct {
	Scenario string  `json:"scenario"`
	Metric   string  `json:"metric"`
	Unit     string  `json:"unit"`
	Runs     int     `json:"runs"`
	Median   float64 `json:"median"`
	P95      float64 `json:"p95"`
	// Baseline is what the same work costs on the bare runtime, measured in the same run.
	Baseline       string  `json:"baseline,omitempty"`
	BaselineMedian float64 `json:"baseline_median,omitempty"`
	BaselineP95    float64 `json:"baseline_p95,omitempty"`
	// Ratio is Median / BaselineMedian.
	Ratio float64 `json:"ratio,omitempty"`
	Note  string  `json:"note,omitempty"`
	// Samples and BaselineSamples are the measurements themselves, in the order taken
	// (what `space bench --html` draws).
	Samples         []float64 `json:"samples,omitempty"`
	BaselineSamples []float64 `json:"baseline_samples,omitempty"`
}

// scenario is one benchmark.
type scenario struct {
	name string
	run  func(ctx context.Context, cfg *Config) ([]Result, error)
}

var scenarios = []scenario{
	{"cold-create", coldCreate},
	{"exec", execRoundTrip},
	{"exec-path", execPath},
	{"throughput", throughput},
	{"files", files},
	{"memory", memory},
	{"start-paths", startPaths},
	{"pool", pool},
	{"suspend", suspendWake},
	{"clone", clones},
	{"density", density},
	{"scale", scale},
	{"network", networkBench},
	{"template-pull", templatePull},
	{"move", move},
}

// Names lists the scenarios.
func Names() []string {
	var out []string
	for _, s := range scenarios {
		out = append(out, s.name)
	}
	return out
}

// Run runs the selected scenarios.
func Run(ctx context.Context, cfg Config) ([]Result, error) {
	if cfg.Runs <= 0 {
		cfg.Runs = 10
	}
	if cfg.Template == "" {
		cfg.Template = "base"
	}
	for _, o := range cfg.Only {
		if !slices.Contains(Names(), o) {
			return nil, fmt.Errorf("unknown scenario %q (scenarios: %s)", o, strings.Join(Names(), ", "))
		}
	}
	var out []Result
	for _, s := range scenarios {
		if len(cfg.Only) > 0 && !slices.Contains(cfg.Only, s.name) {
			continue
		}
		res, err := s.run(ctx, &cfg)
		if err != nil {
			// Keep what the scenario finished (the scale steps before the failing one).
			return append(out, res...), fmt.Errorf("%s: %w", s.name, err)
		}
		if cfg.Progress != nil {
			fmt.Fprintf(cfg.Progress, "bench: %s done\n", s.name)
		}
		out = append(out, res...)
	}
	return out, nil
}

// stats returns the median and the 95th percentile (nearest rank) of xs.
func stats(xs []float64) (median, p95 float64) {
	if len(xs) == 0 {
		return 0, 0
	}
	s := slices.Clone(xs)
	sort.Float64s(s)
	mid := len(s) / 2
	if len(s)%2 == 0 {
		median = (s[mid-1] + s[mid]) / 2
	} else {
		median = s[mid]
	}
	rank := int(0.95*float64(len(s))+0.999999) - 1
	rank = max(0, min(rank, len(s)-1))
	return median, s[rank]
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// result builds a row from samples and optional baseline samples.
func result(scenario, metric, unit string, xs []float64, baseline string, bs []float64) Result {
	r := Result{Scenario: scenario, Metric: metric, Unit: unit, Runs: len(xs), Samples: xs}
	r.Median, r.P95 = stats(xs)
	if len(bs) > 0 {
		r.Baseline = baseline
		r.BaselineSamples = bs
		r.BaselineMedian, r.BaselineP95 = stats(bs)
		if r.BaselineMedian > 0 {
			r.Ratio = r.Median / r.BaselineMedian
		}
	}
	return r
}

// WriteTable prints results as an aligned table.
func WriteTable(w io.Writer, rs []Result) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "SCENARIO\tMETRIC\tRUNS\tMEDIAN\tP95\tBASELINE\tBASE MEDIAN\tBASE P95\tRATIO")
	for _, r := range rs {
		base, bm, bp, ratio := "-", "-", "-", "-"
		if r.Baseline != "" {
			base = r.Baseline
			bm = fmt.Sprintf("%.2f %s", r.BaselineMedian, r.Unit)
			bp = fmt.Sprintf("%.2f %s", r.BaselineP95, r.Unit)
			ratio = fmt.Sprintf("%.2fx", r.Ratio)
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%.2f %s\t%.2f %s\t%s\t%s\t%s\t%s\n", r.Scenario, r.Metric, r.Runs,
			r.Median, r.Unit, r.P95, r.Unit, base, bm, bp, ratio)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, r := range rs {
		if r.Note != "" {
			fmt.Fprintf(w, "note: %s / %s: %s\n", r.Scenario, r.Metric, r.Note)
		}
	}
	return nil
}

// WriteJSON prints results as JSON.
func WriteJSON(w io.Writer, rs []Result) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(rs)
}
