package bench

import (
	"encoding/xml"
	"regexp"
	"strings"
	"testing"
	"time"
)

// TestWriteHTML checks the HTML report: a plot per result with a dot per sample (the
// baseline's too), names escaped, the ratio shown, every SVG well-formed XML, and no
// external asset.
func TestWriteHTML(t *testing.T) {
	rep := Report{FinishedAt: time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC), Template: "base", Runs: 3, Results: []Result{
		result("pool", "pool: create → <exit>", "ms", []float64{250, 260, 400}, "boot & co", []float64{450, 470, 600}),
		result("pool", "pool timeline: → node", "ms", []float64{20, 21, 130}, "", nil),
		result("throughput", "1 GiB", "MiB/s", []float64{30, 31}, "", nil),
	}}
	var b strings.Builder
	if err := WriteHTML(&b, rep); err != nil {
		t.Fatal(err)
	}
	page := b.String()
	svgs := regexp.MustCompile(`(?s)<svg .*?</svg>`).FindAllString(page, -1)
	if len(svgs) != 3 {
		t.Fatalf("%d plots, want 3", len(svgs))
	}
	for i, want := range []int{6, 3, 2} {
		if n := strings.Count(svgs[i], "<circle"); n != want {
			t.Errorf("plot %d: %d dots, want %d", i, n, want)
		}
		if err := xml.Unmarshal([]byte(svgs[i]), new(struct{})); err != nil {
			t.Errorf("plot %d is not well-formed: %v", i, err)
		}
	}
	for _, want := range []string{"&lt;exit&gt;", "boot &amp; co", "0.55×", "<h2>pool</h2>", "<h2>throughput</h2>"} {
		if !strings.Contains(page, want) {
			t.Errorf("page lacks %q", want)
		}
	}
	if strings.Contains(page, "<exit>") || strings.Contains(page, "<script") ||
		regexp.MustCompile(`(src|href)=`).MatchString(page) {
		t.Errorf("unescaped text, a script or an external asset in the page")
	}
}
