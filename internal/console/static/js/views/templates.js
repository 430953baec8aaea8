// Templates: releases and tags, one template's detail, recent builds with their live
// log, and starting a build from a spec.

import { api, openSSE } from '../api.js';
import { badge, emptyRow, errorBox, field, fmtBytes, h, replace, statusArea, table, timeEl } from '../ui.js';

const EXAMPLE = `# A build spec (YAML or JSON); see docs/templates.md.
name: tools
tag: "1"
from:
  template: base
steps:
  - run: echo built > /etc/tools-version
config:
  cpu: 1
  memory_mb: 512
`;

export function render(main, ctx, name) {
  if (name) return detail(main, ctx, name);
  const status = statusArea();
  const body = h('tbody');
  const tbl = table('Template releases', ['Name', 'Tags', 'Digest', { label: 'Size', num: true }, 'Created'], []);
  tbl.querySelector('table').replaceChild(body, tbl.querySelector('tbody'));
  const builds = h('tbody');
  const btbl = table('Template builds', ['Template', 'State', 'Message', 'Started', 'Log'], []);
  btbl.querySelector('table').replaceChild(builds, btbl.querySelector('tbody'));
  const logHost = h('div', { id: 'build-log-host' });
  let logView = null;

  const spec = h('textarea', { class: 'spec', id: 'build-spec', spellcheck: 'false' });
  spec.value = EXAMPLE;
  const buildMsg = statusArea();
  const form = h('form', { class: 'card', 'aria-labelledby': 'build-title' },
    h('h2', { id: 'build-title' }, 'Start a build'),
    field('Build spec', spec, { wide: true, hint: 'YAML or JSON. Needs an admin key; sources must be allowed by a node (--template-sources).' }),
    h('div', { class: 'row' }, h('button', { type: 'submit', class: 'primary', id: 'build-submit' }, 'Build')), buildMsg.el);
  form.addEventListener('submit', async (e) => {
    e.preventDefault();
    const text = spec.value;
    const json = text.trim().startsWith('{');
    try {
      const op = await api.post('/v1/templates', text, { headers: { 'Content-Type': json ? 'application/json' : 'application/yaml' } });
      buildMsg.ok(`Build queued (operation ${op.id}): ${op.message}`);
      showLog(op.id, op.message);
      loadBuilds();
    } catch (err) {
      buildMsg.error(err, 'Build refused');
    }
  });

  main.append(h('h1', {}, 'Templates'), status.el, tbl, h('h2', {}, 'Recent builds'), btbl, logHost, form);

  function showLog(id, title) {
    if (logView) logView.close();
    logView = new BuildLog(id, title);
    replace(logHost, logView.el);
  }

  async function load() {
    try {
      const res = await api.get('/v1/templates');
      replace(body, res.templates.length ? res.templates.map((t) => h('tr', {},
        h('td', {}, h('a', { href: '#/templates/' + encodeURIComponent(t.name) }, t.name)),
        h('td', {}, (t.tags || []).map((tag) => h('span', { class: 'chip' }, tag))),
        h('td', { class: 'mono' }, t.digest.slice(0, 19) + '…'),
        h('td', { class: 'num' }, fmtBytes(t.size_bytes)),
        h('td', {}, timeEl(t.created_at)))) : emptyRow(5, 'No releases yet. The base template is built on first use.'));
    } catch (err) {
      status.error(err, 'Loading templates failed');
    }
  }
  async function loadBuilds() {
    try {
      const res = await api.get('/v1/operations', { query: { kind: 'template_build', limit: 20 } });
      replace(builds, res.operations.length ? res.operations.map((op) => h('tr', {},
        h('td', {}, op.template || ''), h('td', {}, badge(op.state)), h('td', {}, op.error || op.message || ''),
        h('td', {}, timeEl(op.created_at)),
        h('td', {}, h('button', { type: 'button', class: 'small', 'aria-label': 'Show the log of build ' + op.id, onclick: () => showLog(op.id, op.template) }, 'Log')))) :
        emptyRow(5, 'No builds yet.'));
    } catch (err) {
      replace(builds, emptyRow(5, err.message));
    }
  }
  const off = ctx.live.on('operation', (op) => { if (op.kind === 'template_build') loadBuilds(); });
  const off2 = ctx.live.on('sync', () => { load(); loadBuilds(); });
  load();
  loadBuilds();
  return () => { off(); off2(); if (logView) logView.close(); };
}

// BuildLog follows GET /v1/operations/{id}/events: log lines and state changes.
class BuildLog {
  constructor(id, title) {
    this.ctrl = new AbortController();
    this.pre = h('pre', { class: 'output', role: 'log', id: 'build-log', 'aria-label': 'Build log' });
    this.state = h('p', { role: 'status' }, 'Connecting…');
    this.el = h('section', { class: 'card' }, h('h2', {}, 'Build log: ', title || id), this.state, this.pre);
    openSSE(`/v1/operations/${encodeURIComponent(id)}/events`, {
      signal: this.ctrl.signal,
      onEvent: (ev) => {
        const d = JSON.parse(ev.data);
        if (ev.event === 'log') {
          this.pre.append(d.line + '\n');
          this.pre.scrollTop = this.pre.scrollHeight;
        } else if (ev.event === 'operation') {
          replace(this.state, badge(d.state), ' ', d.error || d.message || '');
        }
      },
    }).catch((err) => { if (!this.ctrl.signal.aborted) replace(this.state, errorBox(err)); });
  }

  close() { this.ctrl.abort(); }
}

function detail(main, ctx, name) {
  const status = statusArea();
  const host = h('div');
  main.append(h('p', {}, h('a', { href: '#/templates' }, '← Templates')), h('h1', {}, 'Template ', name), status.el, host);
  api.get('/v1/templates/' + encodeURIComponent(name)).then((t) => {
    const tags = Object.keys(t.tags).sort();
    replace(host,
      h('h2', {}, 'Tags'),
      table('Tags', ['Tag', 'Digest'], tags.length ? tags.map((tag) => h('tr', {}, h('td', {}, tag), h('td', { class: 'mono' }, t.tags[tag]))) : [emptyRow(2, 'No tags.')]),
      h('h2', {}, 'Releases'),
      t.releases.map((r) => h('section', { class: 'card' },
        h('h3', { class: 'mono' }, r.ref),
        h('dl', { class: 'props' },
          h('dt', {}, 'Tags'), h('dd', {}, r.tags.length ? r.tags.join(', ') : '—'),
          h('dt', {}, 'Size'), h('dd', {}, fmtBytes(r.size_bytes)),
          h('dt', {}, 'Created'), h('dd', {}, timeEl(r.created_at)),
          h('dt', {}, 'On nodes'), h('dd', {}, r.nodes.length ? r.nodes.join(', ') : '—')),
        h('h4', {}, 'Configuration'), h('pre', {}, JSON.stringify(r.config, null, 2)))));
  }).catch((err) => status.error(err));
  return null;
}
