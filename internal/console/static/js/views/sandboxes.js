// Sandboxes: a live list (GET /v1/sandboxes, then /v1/events), filters by state,
// template and metadata, create and delete.

import { api } from '../api.js';
import {
  announce, badge, checkbox, confirmDialog, emptyRow, field, h, pairs, parsePairs, replace,
  statusArea, table, timeEl,
} from '../ui.js';

export const STATES = ['pending', 'creating', 'running', 'pausing', 'paused', 'resuming', 'suspending', 'suspended',
  'restoring', 'stopping', 'stopped', 'deleting', 'failed'];

export function render(main, ctx) {
  const q = ctx.query;
  const list = new Map(); // id -> sandbox
  const rows = new Map(); // id -> tr
  const status = statusArea();
  const count = h('p', { class: 'muted', 'aria-live': 'polite', id: 'sandbox-count' });

  // Filters (kept in the URL so that a view can be bookmarked).
  const fState = h('select', { id: 'filter-state' }, h('option', { value: '' }, 'any state'), STATES.map((s) => h('option', { value: s }, s)));
  const fTemplate = h('select', { id: 'filter-template' }, h('option', { value: '' }, 'any template'));
  const fMeta = h('input', { type: 'search', id: 'filter-metadata', placeholder: 'key=value, …' });
  fState.value = q.get('state') || '';
  fMeta.value = q.get('metadata') || '';
  const wantTemplate = q.get('template') || '';
  const filters = h('form', { class: 'card', role: 'search', 'aria-label': 'Filter sandboxes' },
    h('div', { class: 'grid' },
      field('State', fState),
      field('Template', fTemplate),
      field('Metadata', fMeta, { hint: 'all of these pairs must match' })));
  filters.addEventListener('submit', (e) => e.preventDefault());
  const onFilter = () => {
    const p = new URLSearchParams();
    if (fState.value) p.set('state', fState.value);
    if (fTemplate.value) p.set('template', fTemplate.value);
    if (fMeta.value.trim()) p.set('metadata', fMeta.value.trim());
    const s = p.toString();
    history.replaceState(null, '', '#/sandboxes' + (s ? '?' + s : ''));
    apply();
  };
  fState.addEventListener('change', onFilter);
  fTemplate.addEventListener('change', onFilter);
  fMeta.addEventListener('input', onFilter);

  // Create form.
  const cTemplate = h('input', { type: 'text', id: 'create-template', list: 'template-names', placeholder: 'base', autocomplete: 'off' });
  const dl = h('datalist', { id: 'template-names' });
  const cCPU = h('input', { type: 'number', id: 'create-cpu', min: 1, placeholder: 'default' });
  const cMem = h('input', { type: 'number', id: 'create-memory', min: 64, step: 64, placeholder: 'default' });
  const cTTL = h('input', { type: 'text', id: 'create-ttl', placeholder: 'e.g. 2h' });
  const cIdle = h('input', { type: 'text', id: 'create-idle', placeholder: 'server default (6h); 0 never' });
  const cMeta = h('textarea', { id: 'create-metadata', rows: 2, placeholder: 'owner=alice' });
  const cEnv = h('textarea', { id: 'create-env', rows: 2, placeholder: 'DEBUG=1' });
  const cFresh = checkbox('Boot fresh (skip the warm pool and base snapshot)', { id: 'create-fresh' });
  const cBtn = h('button', { type: 'submit', class: 'primary', id: 'create-submit' }, 'Create sandbox');
  const createMsg = statusArea();
  const createForm = h('form', { class: 'card', 'aria-labelledby': 'create-title' },
    h('h2', { id: 'create-title' }, 'New sandbox'),
    h('div', { class: 'grid' },
      field('Template', cTemplate, { hint: 'name, name:tag or name@sha256:…' }), dl,
      field('vCPUs', cCPU), field('Memory (MiB)', cMem), field('TTL', cTTL), field('Idle timeout', cIdle),
      field('Metadata', cMeta, { hint: 'key=value, one per line' }),
      field('Environment', cEnv, { hint: 'NAME=value, one per line' }),
      h('div', { class: 'field wide' }, cFresh.el)),
    h('div', { class: 'row' }, cBtn), createMsg.el);
  createForm.addEventListener('submit', async (e) => {
    e.preventDefault();
    let req;
    try {
      req = {
        template: cTemplate.value.trim() || undefined,
        cpu: cCPU.value ? Number(cCPU.value) : undefined,
        memory_mb: cMem.value ? Number(cMem.value) : undefined,
        ttl: cTTL.value.trim() || undefined,
        idle_timeout: cIdle.value.trim() || undefined,
        metadata: parsePairs(cMeta.value, 'metadata'),
        env: parsePairs(cEnv.value, 'environment'),
        fresh_boot: cFresh.input.checked || undefined,
      };
    } catch (err) {
      createMsg.error(err);
      return;
    }
    cBtn.disabled = true;
    try {
      const sb = await api.post('/v1/sandboxes', req, { headers: { 'Idempotency-Key': crypto.randomUUID() } });
      upsert(sb);
      createMsg.ok(h('span', {}, 'Sandbox ', h('a', { href: '#/sandboxes/' + sb.id, id: 'created-link' }, sb.id), ' requested: ',
        sb.operation ? sb.operation.message || sb.operation.state : sb.state));
      announce('Sandbox ' + sb.id + ' requested');
    } catch (err) {
      createMsg.error(err, 'Create failed');
    } finally {
      cBtn.disabled = false;
    }
  });

  const tbody = h('tbody');
  const tbl = table('Sandboxes', ['ID', 'State', 'Template', { label: 'Resources' }, 'Metadata', 'Created', { label: 'Actions' }], []);
  tbl.querySelector('table').replaceChild(tbody, tbl.querySelector('tbody'));

  main.append(h('h1', {}, 'Sandboxes'), status.el, filters, count, tbl, createForm);

  function matches(sb) {
    if (fState.value && sb.state !== fState.value) return false;
    if (fTemplate.value && sb.template !== fTemplate.value) return false;
    if (fMeta.value.trim()) {
      let want;
      try { want = parsePairs(fMeta.value, 'metadata'); } catch { return true; }
      for (const [k, v] of Object.entries(want)) {
        if (!sb.metadata || sb.metadata[k] !== v) return false;
      }
    }
    return true;
  }

  function rowFor(sb) {
    let tr = rows.get(sb.id);
    if (!tr) {
      tr = h('tr', { 'data-id': sb.id });
      rows.set(sb.id, tr);
    }
    const state = [badge(sb.state)];
    if (sb.desired_state && sb.desired_state !== sb.state && sb.state !== 'failed') {
      state.push(h('span', { class: 'muted' }, ' → ' + sb.desired_state));
    }
    const del = h('button', { type: 'button', class: 'small danger', 'aria-label': 'Delete sandbox ' + sb.id },
      'Delete');
    del.addEventListener('click', () => remove(sb.id, del));
    replace(tr,
      h('td', {}, h('a', { href: '#/sandboxes/' + sb.id, class: 'mono' }, sb.id)),
      h('td', { class: 'state' }, state),
      h('td', {}, sb.template),
      h('td', {}, `${sb.cpu} vCPU · ${sb.memory_mb} MiB`),
      h('td', {}, pairs(sb.metadata)),
      h('td', {}, timeEl(sb.created_at)),
      h('td', {}, del));
    return tr;
  }

  async function remove(id, btn) {
    if (!(await confirmDialog('Delete sandbox?', `Sandbox ${id} and its disk will be deleted. This cannot be undone.`, 'Delete'))) {
      btn.focus();
      return;
    }
    try {
      const op = await api.del('/v1/sandboxes/' + encodeURIComponent(id));
      status.ok(`Deleting ${id} (operation ${op.id}).`);
    } catch (err) {
      status.error(err, 'Delete failed');
    }
  }

  function upsert(sb) {
    const cur = list.get(sb.id);
    if (cur && cur.updated_at && sb.updated_at && Date.parse(sb.updated_at) < Date.parse(cur.updated_at)) return;
    if (sb.state === 'deleted') {
      list.delete(sb.id);
      const tr = rows.get(sb.id);
      if (tr) { tr.remove(); rows.delete(sb.id); }
    } else {
      list.set(sb.id, { ...cur, ...sb });
    }
    apply();
  }

  let applied = '';
  function apply() {
    // Template filter options: the templates seen in the list.
    const names = [...new Set([...list.values()].map((s) => s.template))].sort();
    const sig = names.join('\n');
    if (sig !== applied) {
      applied = sig;
      const keep = fTemplate.value || wantTemplate;
      replace(fTemplate, h('option', { value: '' }, 'any template'), names.map((n) => h('option', { value: n }, n)));
      if (keep && !names.includes(keep)) fTemplate.append(h('option', { value: keep }, keep));
      fTemplate.value = keep;
    }
    const shown = [...list.values()].filter(matches).sort((a, b) => (a.created_at < b.created_at ? 1 : a.created_at > b.created_at ? -1 : a.id.localeCompare(b.id)));
    // Insert or update rows in order without moving existing rows needlessly (moving
    // a row would take keyboard focus from its buttons).
    const wanted = new Set(shown.map((s) => s.id));
    for (const [id, tr] of rows) {
      if (!wanted.has(id) && tr.parentNode) tr.remove();
    }
    const emptyEl = tbody.querySelector('tr.empty-row');
    if (emptyEl) emptyEl.remove();
    let prev = null;
    for (const sb of shown) {
      const tr = rowFor(sb);
      const want = prev ? prev.nextSibling : tbody.firstChild;
      if (tr !== want) tbody.insertBefore(tr, want);
      prev = tr;
    }
    if (!shown.length) {
      const r = emptyRow(7, list.size ? 'No sandbox matches these filters.' : 'No sandboxes yet. Create one below.');
      r.classList.add('empty-row');
      tbody.append(r);
    }
    count.textContent = `${shown.length} of ${list.size} sandboxes shown`;
  }

  async function load() {
    try {
      const res = await api.get('/v1/sandboxes');
      const seen = new Set();
      for (const sb of res.sandboxes) {
        seen.add(sb.id);
        list.set(sb.id, sb);
      }
      for (const id of [...list.keys()]) {
        if (!seen.has(id)) {
          list.delete(id);
          const tr = rows.get(id);
          if (tr) { tr.remove(); rows.delete(id); }
        }
      }
      status.clear();
      apply();
    } catch (err) {
      status.error(err, 'Loading sandboxes failed');
    }
  }

  async function loadTemplates() {
    try {
      const res = await api.get('/v1/templates');
      const names = new Set();
      for (const t of res.templates) {
        names.add(t.name);
        for (const tag of t.tags || []) names.add(t.name + ':' + tag);
      }
      replace(dl, [...names].sort().map((n) => h('option', { value: n })));
    } catch { /* the create form still takes free text */ }
  }

  const offs = [
    ctx.live.on('sandbox', upsert),
    ctx.live.on('sync', load),
  ];
  load();
  loadTemplates();
  return () => offs.forEach((f) => f());
}
