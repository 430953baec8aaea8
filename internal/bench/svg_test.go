package bench

import (
	"encoding/xml"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestWriteSVGDir checks the per-scenario SVGs: one well-formed file per scenario, a
// dot per sample of that scenario only (the baseline's too), the ratio shown, names
// escaped, no script or external asset.
func TestWriteSVGDir(t *testing.T) {
	rep := Report{FinishedAt: time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC), Template: "base", Runs: 3, Results: []Result{
		result("pool", "pool: create → <exit>", "ms", []float64{250, 260, 400}, "boot & co", []float64{450, 470, 600}),
		result("pool", "pool timeline: → node", "ms", []float64{20, 21, 130}, "", nil),
		result("density", "sentry PSS", "MiB", []float64{30, 31}, "", nil),
	}}
	dir := t.TempDir()
	files, err := WriteSVGDir(dir, rep)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]int{"bench-pool.svg": 9, "bench-density.svg": 2}
	if len(files) != len(want) {
		t.Fatalf("files %v", files)
	}
	for name, dots := range want {
		b, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		s := string(b)
		if err := xml.Unmarshal(b, new(struct{})); err != nil {
			t.Errorf("%s is not well-formed: %v", name, err)
		}
		if n := strings.Count(s, "<circle"); n != dots {
			t.Errorf("%s: %d dots, want %d", name, n, dots)
		}
		if strings.Contains(s, "<script") || strings.Contains(s, "href=") || strings.Contains(s, "<exit>") {
			t.Errorf("%s: a script, a link or unescaped text", name)
		}
	}
	b, _ := os.ReadFile(filepath.Join(dir, "bench-pool.svg"))
	if !strings.Contains(string(b), "0.55× boot &amp; co") {
		t.Errorf("the pool plot lacks its ratio")
	}
	var sb strings.Builder
	if err := WriteSVG(&sb, rep, "nope"); err == nil {
		t.Errorf("an unknown scenario gave no error")
	}
}
