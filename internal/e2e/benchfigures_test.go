package e2e

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/internal/bench"
)

// TestBenchFigures runs `space bench` against a fresh server for docs/benchmarks.md; it
// runs only when SPACE_BENCH_ONLY names the scenarios. SPACE_BENCH_RUNS sets --runs
// (default 10), SPACE_BENCH_RUNNING_QUOTA raises the default tenant's running-sandbox
// quota first, SPACE_BENCH_ARGS adds flags (space-separated, e.g. "--scale-max 100
// --svg /tmp/svg"), SPACE_BENCH_SERVE_ARGS adds flags to the server's (e.g. "--runtime
// qemu" for a QEMU node), SPACE_BENCH_JSON keeps the saved report at that path:
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
	s := start(t, options{Args: strings.Fields(os.Getenv("SPACE_BENCH_SERVE_ARGS"))})
	if q := os.Getenv("SPACE_BENCH_RUNNING_QUOTA"); q != "" {
		// The scale scenario's largest steps need more than the default 100 running.
		if _, stderr, code := s.cli(t, "tenant", "set-quota", "default", "--running", q); code != 0 {
			t.Fatalf("set-quota: %s", stderr)
		}
	}
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

// benchJSON runs space bench with args against s and returns its results.
func benchJSON(t *testing.T, s *srv, args ...string) []bench.Result {
	t.Helper()
	out, stderr, code := s.cli(t, append(append([]string{"bench"}, args...), "-o", "json")...)
	if code != 0 {
		t.Fatalf("space bench: exit %d\n%s", code, stderr)
	}
	var rs []bench.Result
	if err := json.Unmarshal([]byte(out), &rs); err != nil {
		t.Fatalf("bench output: %v\n%s", err, out)
	}
	return rs
}

// TestBenchDensityScale runs the density and scale scenarios small (2 sandboxes of
// each kind, 3 idle sandboxes) with --svg: the breakdown finds every sandbox's Sentry
// and gofer and its cgroup, the scale rows exist with their baselines, and one SVG per
// scenario is written. The figures themselves are not asserted.
func TestBenchDensityScale(t *testing.T) {
	s := start(t, options{})
	dir := t.TempDir()
	rs := benchJSON(t, s, "--runs", "2", "--only", "density,scale", "--scale-max", "3", "--scale-cpu-window", "5s", "--svg", dir)
	want := map[string]bool{
		"PSS per idle sandbox, booted: Sentry + gofer": false,
		"cgroup memory per idle sandbox, booted":       false,
		"gofer PSS":                                    false,
		"agent RSS inside the sandbox":                 false,
		"3 idle: create throughput":                    false,
		"3 idle: GET /v1/sandboxes/{id}":               false,
		"3 idle: exec `true`":                          false,
		"3 idle: CPU per idle sandbox (its cgroup)":    false,
	}
	for _, r := range rs {
		if _, ok := want[r.Metric]; !ok {
			continue
		}
		want[r.Metric] = true
		if r.Metric == "3 idle: CPU per idle sandbox (its cgroup)" {
			// Every sandbox's cgroup read; an idle one may use no CPU at all.
			if r.Runs != 3 || r.Median < 0 {
				t.Errorf("result %+v", r)
			}
			continue
		}
		if r.Median <= 0 || (r.Baseline != "" && r.Ratio <= 0) {
			t.Errorf("result %+v", r)
		}
		if r.Metric == "PSS per idle sandbox, booted: Sentry + gofer" && (r.Runs < 2 || r.Baseline == "") {
			t.Errorf("density: %d booted sandboxes measured, baseline %q", r.Runs, r.Baseline)
		}
	}
	for m, seen := range want {
		if !seen {
			t.Errorf("no row %q", m)
		}
	}
	for _, f := range []string{"bench-density.svg", "bench-scale.svg"} {
		if b, err := os.ReadFile(filepath.Join(dir, f)); err != nil || !strings.Contains(string(b), "<circle") {
			t.Errorf("%s: %v", f, err)
		}
	}
	if ids := s.runscIDs(); len(ids) != 0 {
		t.Errorf("sandboxes left after the bench: %v", ids)
	}
}
