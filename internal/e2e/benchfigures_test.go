package e2e

import (
	"os"
	"strings"
	"testing"

	"github.com/spacedev/space/internal/bench"
)

// TestBenchFigures runs `space bench` against a fresh server for docs/benchmarks.md; it
// runs only when SPACE_BENCH_ONLY names the scenarios. SPACE_BENCH_RUNS sets --runs
// (default 10), SPACE_BENCH_ARGS adds flags (space-separated, e.g. "--scale-max 100
// --svg /tmp/svg"), SPACE_BENCH_JSON keeps the saved report at that path:
//
//	SPACE_BENCH_ONLY=density,scale go test -run TestBenchFigures -v -timeout 2h ./internal/e2e/
func TestBenchFigures(t *testing.T) {
	only := os.Getenv("SPACE_BENCH_ONLY")
	if only == "" {
		t.Skip("set SPACE_BENCH_ONLY to measure")
	}
	runs := os.Getenv("SPACE_BENCH_RUNS")
	if runs == "" {
		runs = "10"
	}
	s := start(t, options{})
	args := []string{"bench", "--runs", runs, "--only", only}
	args = append(args, strings.Fields(os.Getenv("SPACE_BENCH_ARGS"))...)
	out, stderr, code := s.cli(t, args...)
	if f := os.Getenv("SPACE_BENCH_JSON"); f != "" {
		if b, err := os.ReadFile(bench.LastPath(s.DataDir)); err == nil {
			_ = os.WriteFile(f, b, 0o644)
		}
	}
	if code != 0 {
		t.Fatalf("space bench: exit %d\n%s\n%s", code, stderr, out)
	}
	t.Log("\n" + out)
}
