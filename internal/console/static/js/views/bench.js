// Benchmarks: the results `space bench` saved last (GET /v1/bench), drawn as bar
// charts (median bars, p95 ticks, the bare-runtime baseline beside) and listed in a
// table that carries the same numbers for screen readers.

import { api } from '../api.js';
import { h, replace, statusArea, table, fmtTime } from '../ui.js';

const NS = 'http://www.w3.org/2000/svg';
function s(tag, attrs, ...kids) {
  const el = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, String(v));
  for (const k of kids) el.append(k instanceof Node ? k : document.createTextNode(String(k)));
  return el;
}

const num = (x) => (x >= 100 ? x.toFixed(0) : x >= 10 ? x.toFixed(1) : x.toFixed(2));

function chart(unit, rows) {
  const W = 900, L = 330, R = 90, rowH = 44, top = 10;
  const H = top + rows.length * rowH + 24;
  const max = Math.max(...rows.flatMap((r) => [r.median, r.p95, r.baseline_median || 0, r.baseline_p95 || 0])) || 1;
  const x = (v) => L + (v / max) * (W - L - R);
  const svg = s('svg', { viewBox: `0 0 ${W} ${H}`, class: 'plot', role: 'img', 'aria-label': `Medians in ${unit}; the table below lists the numbers` });
  rows.forEach((r, i) => {
    const y = top + i * rowH;
    svg.append(s('text', { x: L - 8, y: y + 16, 'text-anchor': 'end' }, `${r.scenario} · ${r.metric}`.slice(0, 52)));
    svg.append(s('rect', { class: 'bar', x: L, y: y + 4, width: Math.max(1, x(r.median) - L), height: 16 }, s('title', {}, `median ${num(r.median)} ${unit}, p95 ${num(r.p95)} ${unit}`)));
    svg.append(s('line', { class: 'p95', x1: x(r.p95), x2: x(r.p95), y1: y + 1, y2: y + 23 }));
    svg.append(s('text', { x: Math.min(x(Math.max(r.median, r.p95)) + 6, W - R + 4), y: y + 16 }, num(r.median)));
    if (r.baseline) {
      svg.append(s('rect', { class: 'base', x: L, y: y + 24, width: Math.max(1, x(r.baseline_median) - L), height: 10 },
        s('title', {}, `${r.baseline}: median ${num(r.baseline_median)} ${unit}`)));
      svg.append(s('text', { x: Math.min(x(r.baseline_median) + 6, W - R + 4), y: y + 34 }, `${num(r.baseline_median)} (${r.ratio ? r.ratio.toFixed(2) + '×' : ''})`));
    }
  });
  svg.append(s('line', { x1: L, x2: L, y1: top, y2: H - 20, stroke: 'currentColor' }));
  svg.append(s('text', { x: W - R, y: H - 4, 'text-anchor': 'end' }, `${num(max)} ${unit}`));
  return svg;
}

export function render(main) {
  const status = statusArea();
  const host = h('div', { id: 'bench-host' });
  main.append(h('h1', {}, 'Benchmarks'), status.el, host);
  api.get('/v1/bench').then((rep) => {
    const results = rep.results || [];
    const units = [...new Set(results.map((r) => r.unit))];
    replace(host,
      h('p', {}, `Last run finished ${fmtTime(rep.finished_at)}: template ${rep.template}, ${rep.runs} runs per measurement`,
        rep.only && rep.only.length ? `, scenarios ${rep.only.join(', ')}` : '', '.'),
      rep.error ? h('div', { class: 'alert' }, 'The run stopped early: ' + rep.error) : null,
      h('div', { class: 'legend', 'aria-hidden': 'true' },
        h('span', {}, h('span', { class: 'sw bar' }), 'space, median (tick: p95)'),
        h('span', {}, h('span', { class: 'sw base' }), 'bare runtime baseline, median (ratio)')),
      units.map((u) => h('section', { class: 'card' }, h('h2', {}, 'In ' + u), chart(u, results.filter((r) => r.unit === u)))),
      h('h2', {}, 'All results'),
      table('Benchmark results', ['Scenario', 'Metric', { label: 'Runs', num: true }, { label: 'Median', num: true }, { label: 'p95', num: true },
        'Baseline', { label: 'Base median', num: true }, { label: 'Ratio', num: true }],
      results.map((r) => h('tr', {}, h('td', {}, r.scenario), h('td', {}, r.metric), h('td', { class: 'num' }, r.runs),
        h('td', { class: 'num' }, `${num(r.median)} ${r.unit}`), h('td', { class: 'num' }, `${num(r.p95)} ${r.unit}`),
        h('td', {}, r.baseline || '—'), h('td', { class: 'num' }, r.baseline ? `${num(r.baseline_median)} ${r.unit}` : '—'),
        h('td', { class: 'num' }, r.ratio ? r.ratio.toFixed(2) + '×' : '—')))),
      results.filter((r) => r.note).map((r) => h('p', { class: 'muted' }, `${r.scenario} / ${r.metric}: ${r.note}`)));
  }).catch((err) => {
    status.error(err);
    host.append(h('p', {}, 'Run ', h('code', {}, 'space bench'), ' on the server\'s host (as root); it saves its results to ',
      h('code', {}, '<data-dir>/bench/last.json'), ', which this page plots.'));
  });
  return null;
}
