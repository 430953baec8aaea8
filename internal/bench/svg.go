package bench

import (
	"fmt"
	"html"
	"io"
	"os"
	"path/filepath"
	"strings"
)

// svgStyle is the style every standalone SVG carries (the HTML page styles its inline
// plots itself).
const svgStyle = `<style>text{font:11px system-ui,sans-serif;fill:#444}.h{font-size:14px;font-weight:600;fill:#222}.m{font-size:12px;fill:#222}.meta{fill:#777}</style>`

// plotHeight is the height of plot(r) (the same geometry).
func plotHeight(r Result) int {
	rows := 1
	if r.Baseline != "" {
		rows = 2
	}
	return rows*rowH + axisH + padTop
}

// WriteSVG writes one scenario's results as a standalone SVG: a heading, then per
// result its metric and its plot (every sample, median, p95; the baseline's under it on
// the same axis with the ratio of the medians), as the HTML page draws them. Results
// of other scenarios are skipped.
func WriteSVG(w io.Writer, rep Report, scenario string) error {
	const head, metricH, gap = 44, 16, 10
	var body strings.Builder
	y := head
	n := 0
	for _, r := range rep.Results {
		if r.Scenario != scenario {
			continue
		}
		n++
		label := r.Metric
		if r.Baseline != "" {
			label += fmt.Sprintf("  (%.2f× %s)", r.Ratio, r.Baseline)
		}
		fmt.Fprintf(&body, `<text class="m" x="8" y="%d">%s</text>`, y+12, html.EscapeString(label))
		y += metricH
		p := plot(r)
		// The plot is an <svg> element of its own: nest it at the offset.
		p = strings.Replace(p, "<svg ", fmt.Sprintf(`<svg x="0" y="%d" `, y), 1)
		body.WriteString(strings.TrimSpace(p))
		y += plotHeight(r) + gap
	}
	if n == 0 {
		return fmt.Errorf("no results of scenario %q", scenario)
	}
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" role="img">`, plotW, y, plotW, y)
	fmt.Fprintf(&b, `<title>space bench: %s</title>%s<rect width="100%%" height="100%%" fill="#fff"/>`, html.EscapeString(scenario), svgStyle)
	fmt.Fprintf(&b, `<text class="h" x="8" y="18">%s</text>`, html.EscapeString(scenario))
	meta := fmt.Sprintf("space bench · %s · template %s · bar: median, tick: p95; blue: space, grey: baseline",
		rep.FinishedAt.Format("2006-01-02 15:04 MST"), rep.Template)
	fmt.Fprintf(&b, `<text class="meta" x="8" y="34">%s</text>`, html.EscapeString(meta))
	b.WriteString(body.String())
	b.WriteString("</svg>\n")
	_, err := io.WriteString(w, b.String())
	return err
}

// Scenarios lists the scenarios rep has results of, in order.
func (rep Report) Scenarios() []string {
	var out []string
	for _, r := range rep.Results {
		if len(out) == 0 || out[len(out)-1] != r.Scenario {
			out = append(out, r.Scenario)
		}
	}
	return out
}

// WriteSVGDir writes one SVG per scenario of rep into dir as bench-<scenario>.svg
// (each atomically) and returns the files written.
func WriteSVGDir(dir string, rep Report) ([]string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("svg: %w", err)
	}
	var files []string
	for _, s := range rep.Scenarios() {
		var b strings.Builder
		if err := WriteSVG(&b, rep, s); err != nil {
			return files, err
		}
		p := filepath.Join(dir, "bench-"+s+".svg")
		tmp := p + ".tmp"
		if err := os.WriteFile(tmp, []byte(b.String()), 0o644); err != nil {
			return files, fmt.Errorf("write %s: %w", p, err)
		}
		if err := os.Rename(tmp, p); err != nil {
			os.Remove(tmp)
			return files, fmt.Errorf("write %s: %w", p, err)
		}
		files = append(files, p)
	}
	return files, nil
}
