package e2e

import (
	"bytes"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

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
	// Not s.cli: a run takes longer than its three minutes.
	cmd := exec.CommandContext(ctx(t, 2*time.Hour), s.Bin, args...)
	cmd.Env = append(os.Environ(), "SPACE_URL="+s.URL, "SPACE_DATA_DIR="+s.DataDir, "SPACE_API_KEY=")
	var outb, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &outb, &errb
	err := cmd.Run()
	out, stderr := outb.String(), errb.String()
	if f := os.Getenv("SPACE_BENCH_JSON"); f != "" {
		if b, err := os.ReadFile(bench.LastPath(s.DataDir)); err == nil {
			_ = os.WriteFile(f, b, 0o644)
		}
	}
	if err != nil {
		t.Fatalf("space bench: %v\n%s\n%s", err, stderr, out)
	}
	t.Log("\n" + out)
}
