// DOM helpers. Text always goes in as text nodes (never innerHTML), so nothing the API
// returns can become markup.

export function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === 'class') el.className = v;
    else if (k.startsWith('on') && typeof v === 'function') el.addEventListener(k.slice(2), v);
    else if (k === 'value') el.value = v;
    else if (k === 'checked') el.checked = !!v;
    else if (v === true) el.setAttribute(k, '');
    else el.setAttribute(k, String(v));
  }
  append(el, children);
  return el;
}

export function append(el, children) {
  for (const c of children.flat(Infinity)) {
    if (c === undefined || c === null || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

export function clear(el) {
  while (el.firstChild) el.removeChild(el.firstChild);
  return el;
}

export function replace(el, ...children) {
  clear(el);
  return append(el, children);
}

// announce reads a short message to screen readers.
export function announce(msg) {
  const el = document.getElementById('announce');
  el.textContent = '';
  setTimeout(() => { el.textContent = msg; }, 30);
}

// errorBox shows an API error in the API's own words.
export function errorBox(err, prefix) {
  const msg = err && err.message ? err.message : String(err);
  return h('div', { class: 'alert', role: 'alert' }, prefix ? prefix + ': ' : '', msg);
}

// status is a message area: set(node|string), error(err), clear().
export function statusArea() {
  const el = h('div', { class: 'status-area', 'aria-live': 'polite' });
  return {
    el,
    ok(msg) { replace(el, h('div', { class: 'notice', role: 'status' }, msg)); },
    error(err, prefix) { replace(el, errorBox(err, prefix)); },
    clear() { clear(el); },
  };
}

export function badge(state) {
  return h('span', { class: 'badge ' + (state || '') }, state || 'unknown');
}

export function fmtBytes(n) {
  if (n === undefined || n === null) return '';
  const u = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  let x = Number(n);
  while (x >= 1024 && i < u.length - 1) { x /= 1024; i++; }
  return (i === 0 ? x : x.toFixed(x < 10 ? 1 : 0)) + ' ' + u[i];
}

export function fmtTime(t) {
  if (!t) return '';
  const d = new Date(t);
  if (isNaN(d) || d.getFullYear() < 2000) return '';
  return d.toLocaleString();
}

export function fmtAgo(t) {
  if (!t) return '';
  const d = new Date(t);
  if (isNaN(d) || d.getFullYear() < 2000) return '';
  const s = Math.round((Date.now() - d.getTime()) / 1000);
  const abs = Math.abs(s);
  let v;
  if (abs < 60) v = abs + 's';
  else if (abs < 3600) v = Math.round(abs / 60) + 'm';
  else if (abs < 86400) v = Math.round(abs / 3600) + 'h';
  else v = Math.round(abs / 86400) + 'd';
  return s >= 0 ? v + ' ago' : 'in ' + v;
}

export function timeEl(t) {
  if (!t) return h('span', { class: 'muted' }, '—');
  return h('time', { datetime: t, title: fmtTime(t) }, fmtAgo(t));
}

export function fmtDuration(ms) {
  if (ms < 1000) return Math.round(ms) + ' ms';
  if (ms < 60000) return (ms / 1000).toFixed(ms < 10000 ? 2 : 1) + ' s';
  return Math.floor(ms / 60000) + 'm ' + Math.round((ms % 60000) / 1000) + 's';
}

// field builds a labelled input; returns {wrap, input}.
let fieldSeq = 0;
export function field(label, input, opts = {}) {
  const id = input.id || ('f' + (++fieldSeq));
  input.id = id;
  const hint = opts.hint ? h('span', { class: 'muted', id: id + '-hint' }, opts.hint) : null;
  if (hint) input.setAttribute('aria-describedby', id + '-hint');
  return h('div', { class: 'field' + (opts.wide ? ' wide' : '') }, h('label', { for: id }, label), input, hint);
}

export function checkbox(label, attrs = {}) {
  const input = h('input', { type: 'checkbox', ...attrs });
  return { input, el: h('label', { class: 'check' }, input, label) };
}

// table builds a table with a header; rows is an array of arrays of cells.
export function table(caption, headers, rows, opts = {}) {
  const thead = h('thead', {}, h('tr', {}, headers.map((t) => h('th', { scope: 'col', class: t.num ? 'num' : null }, t.label ?? t))));
  const tbody = h('tbody', {}, rows);
  const t = h('table', {}, caption ? h('caption', { class: 'visually-hidden' }, caption) : null, thead, tbody);
  return h('div', { class: 'table-wrap', tabindex: opts.scrollable === false ? null : 0, role: 'region', 'aria-label': caption || 'table' }, t);
}

export function emptyRow(cols, text) {
  return h('tr', {}, h('td', { colspan: cols, class: 'empty' }, text));
}

// confirmDialog asks a yes/no question in the page's modal dialog.
export function confirmDialog(title, text, okLabel = 'Confirm') {
  const dlg = document.getElementById('confirm');
  document.getElementById('confirm-title').textContent = title;
  document.getElementById('confirm-text').textContent = text;
  const ok = document.getElementById('confirm-ok');
  const cancel = document.getElementById('confirm-cancel');
  ok.textContent = okLabel;
  return new Promise((resolve) => {
    const done = (v) => {
      ok.removeEventListener('click', onOK);
      cancel.removeEventListener('click', onCancel);
      dlg.removeEventListener('cancel', onCancel);
      if (dlg.open) dlg.close();
      resolve(v);
    };
    const onOK = () => done(true);
    const onCancel = () => done(false);
    ok.addEventListener('click', onOK);
    cancel.addEventListener('click', onCancel);
    dlg.addEventListener('cancel', onCancel);
    dlg.showModal();
    cancel.focus();
  });
}

// tabs builds an accessible tab list (arrow keys move between tabs). onSelect(name)
// is called on activation.
export function tabs(label, items, selected, onSelect) {
  const list = h('div', { role: 'tablist', 'aria-label': label });
  const buttons = items.map(([name, text]) => h('button', {
    type: 'button', role: 'tab', id: 'tab-' + name, 'aria-controls': 'panel-' + name,
    'aria-selected': name === selected ? 'true' : 'false', tabindex: name === selected ? '0' : '-1',
    onclick: () => onSelect(name),
  }, text));
  list.addEventListener('keydown', (e) => {
    const i = buttons.indexOf(document.activeElement);
    if (i < 0) return;
    let j = -1;
    if (e.key === 'ArrowRight') j = (i + 1) % buttons.length;
    else if (e.key === 'ArrowLeft') j = (i - 1 + buttons.length) % buttons.length;
    else if (e.key === 'Home') j = 0;
    else if (e.key === 'End') j = buttons.length - 1;
    if (j >= 0) {
      e.preventDefault();
      buttons[j].focus();
      onSelect(items[j][0]);
    }
  });
  append(list, buttons);
  return list;
}

// parsePairs reads "key=value" lines (or comma-separated pairs) into an object.
export function parsePairs(text, what) {
  const out = {};
  for (const raw of text.split(/[\n,]/)) {
    const line = raw.trim();
    if (!line) continue;
    const eq = line.indexOf('=');
    if (eq <= 0) throw new Error(`${what}: "${line}" must look like key=value`);
    out[line.slice(0, eq).trim()] = line.slice(eq + 1).trim();
  }
  return out;
}

export function pairs(obj) {
  const keys = Object.keys(obj || {}).sort();
  if (!keys.length) return h('span', { class: 'muted' }, '—');
  return keys.map((k) => h('span', { class: 'chip' }, k + '=' + obj[k]));
}

// download saves a Blob under name.
export function download(blob, name) {
  const url = URL.createObjectURL(blob);
  const a = h('a', { href: url, download: name, hidden: true });
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 60000);
}
