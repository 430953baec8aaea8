package bench

import (
	"fmt"
	"html"
	"io"
	"math"
	"strings"
)

// Geometry of one result's plot (SVG user units).
const (
	plotW     = 720
	plotLeft  = 150 // room for the row labels
	plotRight = 48  // room for the off-axis samples and the unit
	rowH      = 26
	axisH     = 22
	padTop    = 8 // room for the labels above the first row
)

// WriteHTML writes rep as one self-contained HTML page: per scenario a table and, for
// each result, its distribution drawn as inline SVG (every sample a dot, the median and
// p95 marked; samples far beyond the p95 as open circles at the axis's end), with the
// baseline's distribution under it on the same axis and the ratio between their
// medians. No scripts, fonts or other external assets.
func WriteHTML(w io.Writer, rep Report) error {
	var b strings.Builder
	b.WriteString(`<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>space bench</title>
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:2em auto;max-width:960px;color:#222}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:2em;border-bottom:1px solid #ddd}
h3{font-size:1em;margin:1.2em 0 .2em}
table{border-collapse:collapse;margin:.5em 0}td,th{padding:2px 10px;text-align:right}
td:first-child,th:first-child{text-align:left}th{border-bottom:1px solid #ccc}
.meta{color:#666}.err{color:#b00}
svg text{font:11px system-ui,sans-serif;fill:#444}
</style></head><body>
<h1>space bench</h1>
`)
	fmt.Fprintf(&b, "<p class=meta>%s · template %s · %d runs per measurement",
		html.EscapeString(rep.FinishedAt.Format("2006-01-02 15:04 MST")), html.EscapeString(rep.Template), rep.Runs)
	if len(rep.Only) > 0 {
		fmt.Fprintf(&b, " · scenarios %s", html.EscapeString(strings.Join(rep.Only, ", ")))
	}
	if rep.Host != nil {
		fmt.Fprintf(&b, " · %s", html.EscapeString(rep.Host.String()))
	}
	b.WriteString("</p>\n")
	if rep.Error != "" {
		fmt.Fprintf(&b, "<p class=err>The run stopped early: %s</p>\n", html.EscapeString(rep.Error))
	}
	b.WriteString(`<p class=meta>Each dot is one measurement; the bar marks the median, the thin tick the p95.
Blue: space; grey: the baseline measured in the same run. Open circles at the end of an axis are samples beyond it
(hover for their value).</p>
`)
	var scenario string
	for i, r := range rep.Results {
		if r.Scenario != scenario {
			scenario = r.Scenario
			fmt.Fprintf(&b, "<h2>%s</h2>\n", html.EscapeString(scenario))
			b.WriteString("<table><tr><th>Metric</th><th>Runs</th><th>Median</th><th>p95</th><th>Baseline</th><th>Base median</th><th>Ratio</th></tr>\n")
			for _, t := range rep.Results[i:] {
				if t.Scenario != scenario {
					break
				}
				base, bm, ratio := "—", "—", "—"
				if t.Baseline != "" {
					base, bm, ratio = html.EscapeString(t.Baseline), num(t.BaselineMedian, t.Unit), fmt.Sprintf("%.2f×", t.Ratio)
				}
				fmt.Fprintf(&b, "<tr><td>%s</td><td>%d</td><td>%s</td><td>%s</td><td>%s</td><td>%s</td><td>%s</td></tr>\n",
					html.EscapeString(t.Metric), t.Runs, num(t.Median, t.Unit), num(t.P95, t.Unit), base, bm, ratio)
			}
			b.WriteString("</table>\n")
		}
		fmt.Fprintf(&b, "<h3>%s</h3>\n", html.EscapeString(r.Metric))
		b.WriteString(plot(r))
	}
	b.WriteString("</body></html>\n")
	_, err := io.WriteString(w, b.String())
	return err
}

// plot draws one result (and its baseline) on a shared linear axis from 0.
func plot(r Result) string {
	type row struct {
		label     string
		xs        []float64
		med, p95  float64
		fill      string
		ratioNote string
	}
	rows := []row{{label: "space", xs: r.Samples, med: r.Median, p95: r.P95, fill: "#2a6fdb"}}
	if r.Baseline != "" {
		rows[0].ratioNote = fmt.Sprintf("%.2f× %s", r.Ratio, r.Baseline)
		rows = append(rows, row{label: r.Baseline, xs: r.BaselineSamples, med: r.BaselineMedian, p95: r.BaselineP95, fill: "#888"})
	}
	// The axis ends a little past the largest p95, so one outlier does not squash the
	// distribution; samples beyond it are drawn as open circles at the right edge.
	hi := 0.0
	for _, rw := range rows {
		hi = math.Max(hi, math.Max(rw.p95, rw.med)*1.25)
	}
	if hi <= 0 {
		for _, rw := range rows {
			for _, x := range rw.xs {
				hi = math.Max(hi, x)
			}
		}
	}
	if hi <= 0 {
		hi = 1
	}
	hi = niceCeil(hi)
	span := float64(plotW - plotLeft - plotRight)
	xOf := func(v float64) float64 { return plotLeft + span*math.Max(0, v)/hi }
	h := len(rows)*rowH + axisH + padTop
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" role="img">`, plotW, h, plotW, h)
	fmt.Fprintf(&b, `<title>%s</title>`, html.EscapeString(r.Metric))
	for i, rw := range rows {
		y := float64(i*rowH) + rowH/2 + padTop
		label := rw.label
		if len(label) > 24 {
			label = label[:23] + "…"
		}
		fmt.Fprintf(&b, `<text x="%d" y="%.1f" text-anchor="end" dominant-baseline="middle">%s</text>`, plotLeft-8, y, html.EscapeString(label))
		for j, x := range rw.xs {
			jitter := float64(j%5-2) * 2.2 // spread equal values a little
			if x > hi {
				fmt.Fprintf(&b, `<circle cx="%.1f" cy="%.1f" r="2.6" fill="none" stroke="%s"><title>%s (off the axis)</title></circle>`,
					xOf(hi)+6, y+jitter, rw.fill, html.EscapeString(num(x, r.Unit)))
				continue
			}
			fmt.Fprintf(&b, `<circle cx="%.1f" cy="%.1f" r="2.6" fill="%s" fill-opacity="0.45"><title>%s</title></circle>`,
				xOf(x), y+jitter, rw.fill, html.EscapeString(num(x, r.Unit)))
		}
		fmt.Fprintf(&b, `<line x1="%.1f" x2="%.1f" y1="%.1f" y2="%.1f" stroke="%s" stroke-width="3"><title>median %s</title></line>`,
			xOf(rw.med), xOf(rw.med), y-9, y+9, rw.fill, html.EscapeString(num(rw.med, r.Unit)))
		fmt.Fprintf(&b, `<line x1="%.1f" x2="%.1f" y1="%.1f" y2="%.1f" stroke="%s" stroke-width="1"><title>p95 %s</title></line>`,
			xOf(rw.p95), xOf(rw.p95), y-6, y+6, rw.fill, html.EscapeString(num(rw.p95, r.Unit)))
		note := num(rw.med, r.Unit)
		if rw.ratioNote != "" {
			note += " · " + rw.ratioNote
		}
		// The label goes right of the p95 tick when it fits, else left of the median.
		if tx := xOf(rw.p95) + 6; tx <= plotW-plotRight-150 {
			fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" dominant-baseline="middle">%s</text>`, tx, y-9, html.EscapeString(note))
		} else {
			fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="end" dominant-baseline="middle">%s</text>`, xOf(rw.med)-6, y-9, html.EscapeString(note))
		}
	}
	axisY := float64(len(rows)*rowH + padTop)
	fmt.Fprintf(&b, `<line x1="%d" x2="%d" y1="%.1f" y2="%.1f" stroke="#bbb"/>`, plotLeft, plotW-plotRight, axisY+2, axisY+2)
	for k := 0; k <= 4; k++ {
		v := hi * float64(k) / 4
		fmt.Fprintf(&b, `<line x1="%.1f" x2="%.1f" y1="%.1f" y2="%.1f" stroke="#bbb"/>`, xOf(v), xOf(v), axisY+2, axisY+6)
		fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle">%s</text>`, xOf(v), axisY+17, html.EscapeString(trim(v)))
	}
	fmt.Fprintf(&b, `<text x="%d" y="%.1f" text-anchor="end">%s</text>`, plotW-4, axisY+17, html.EscapeString(r.Unit))
	b.WriteString("</svg>\n")
	return b.String()
}

// niceCeil rounds v up to 1, 2 or 5 times a power of ten.
func niceCeil(v float64) float64 {
	p := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 2, 5, 10} {
		if v <= m*p {
			return m * p
		}
	}
	return 10 * p
}

func num(v float64, unit string) string { return trim(v) + " " + unit }

// trim prints v with three significant digits at most.
func trim(v float64) string {
	switch a := math.Abs(v); {
	case a >= 100 || a == 0:
		return fmt.Sprintf("%.0f", v)
	case a >= 10:
		return fmt.Sprintf("%.1f", v)
	default:
		return fmt.Sprintf("%.2f", v)
	}
}
