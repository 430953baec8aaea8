package e2e

import (
	"encoding/json"
	"os"
	"strings"
	"testing"

	"github.com/spacedev/space/internal/bench"
)

// TestBenchRuns runs a quick subset of `space bench` end to end (two repetitions), so
// the benchmark command keeps working; the figures themselves are not asserted.
func TestBenchRuns(t *testing.T) {
	s := start(t, options{})
	out, stderr, code := s.cli(t, "bench", "--runs", "2", "--only", "cold-create,exec,files,pool", "-o", "json")
	if code != 0 {
		t.Fatalf("space bench: exit %d\n%s", code, stderr)
	}
	var rs []bench.Result
	if err := json.Unmarshal([]byte(out), &rs); err != nil {
		t.Fatalf("bench output: %v\n%s", err, out)
	}
	seen := map[string]bool{}
	for _, r := range rs {
		seen[r.Scenario] = true
		if r.Runs != 2 || r.Median <= 0 || r.P95 < r.Median {
			t.Errorf("result %+v", r)
		}
		if r.Baseline != "" && r.Ratio <= 0 {
			t.Errorf("result %+v has a baseline but no ratio", r)
		}
	}
	if !seen["cold-create"] || !seen["exec"] || !seen["files"] || !seen["pool"] {
		t.Fatalf("scenarios: %v", seen)
	}
	table, _, _ := s.cli(t, "bench", "--runs", "1", "--only", "exec")
	if !strings.Contains(table, "MEDIAN") || !strings.Contains(table, "runsc exec true") {
		t.Fatalf("table:\n%s", table)
	}
}

// TestBenchPoolFigures prints `space bench --only pool,exec` for docs/benchmarks.md
// (the warm-pool create's breakdown); it runs only when SPACE_BENCH_RUNS is set, and
// writes the HTML report to SPACE_BENCH_HTML (and the saved JSON next to it) when that
// is set:
// SPACE_BENCH_RUNS=20 go test -run TestBenchPoolFigures -v ./internal/e2e/
func TestBenchPoolFigures(t *testing.T) {
	runs := os.Getenv("SPACE_BENCH_RUNS")
	if runs == "" {
		t.Skip("set SPACE_BENCH_RUNS to measure")
	}
	s := start(t, options{})
	args := []string{"bench", "--runs", runs, "--only", "exec,pool"}
	if f := os.Getenv("SPACE_BENCH_HTML"); f != "" {
		args = append(args, "--html", f) // an absolute path: the page with the plots
	}
	out, stderr, code := s.cli(t, args...)
	if code != 0 {
		t.Fatalf("space bench: exit %d\n%s", code, stderr)
	}
	t.Log("\n" + out)
	if f := os.Getenv("SPACE_BENCH_HTML"); f != "" {
		// Keep the run's samples too (space bench --from FILE.json --html re-renders).
		if b, err := os.ReadFile(bench.LastPath(s.DataDir)); err == nil {
			_ = os.WriteFile(f+".json", b, 0o644)
		}
	}
}
