// One sandbox: its state (live), lifecycle verbs with their operations as a timeline,
// processes with live, replayable output, a terminal, and a file browser.

import { api, b64bytes, errorFrom, openSSE, request } from '../api.js';
import { TermView } from '../terminal.js';
import {
  announce, badge, checkbox, confirmDialog, download, emptyRow, errorBox, field, fmtBytes, fmtDuration, fmtTime, h,
  pairs, replace, statusArea, table, tabs, timeEl,
} from '../ui.js';

// The verbs and the states they may start from (as the API checks them; the API's
// answer is shown when it disagrees).
const VERBS = [
  ['pause', 'Pause', ['running']],
  ['resume', 'Resume', ['paused']],
  ['suspend', 'Suspend', ['running', 'paused']],
  ['wake', 'Wake', ['paused', 'suspended', 'stopped']],
  ['stop', 'Stop', ['running', 'paused', 'suspended']],
  ['start', 'Start', ['stopped']],
];

const TABS = [['overview', 'Overview'], ['processes', 'Processes'], ['terminal', 'Terminal'], ['files', 'Files']];

export function render(main, ctx, id, tab) {
  const enc = encodeURIComponent(id);
  let sb = null;
  const ops = new Map();
  const disposers = [];
  const status = statusArea();
  const stateEl = h('span', { id: 'sandbox-state' });
  const reasonEl = h('p', { class: 'muted', id: 'sandbox-reason' });
  const verbButtons = new Map();
  const toolbar = h('div', { class: 'toolbar', role: 'group', 'aria-label': 'Lifecycle' });
  for (const [verb, label] of VERBS) {
    const b = h('button', { type: 'button', id: 'verb-' + verb, onclick: () => doVerb(verb, label) }, label);
    verbButtons.set(verb, b);
    toolbar.append(b);
  }
  const cloneBtn = h('button', { type: 'button', id: 'verb-clone', onclick: () => doClone() }, 'Clone');
  const delBtn = h('button', { type: 'button', class: 'danger', id: 'verb-delete', onclick: () => doDelete() }, 'Delete');
  toolbar.append(cloneBtn, delBtn);

  const panels = {};
  for (const [name] of TABS) {
    panels[name] = h('div', { role: 'tabpanel', id: 'panel-' + name, 'aria-labelledby': 'tab-' + name, hidden: true });
  }
  let tabList = null;
  const tabHost = h('div');
  const started = {};

  main.append(
    h('p', {}, h('a', { href: '#/sandboxes' }, '← Sandboxes')),
    h('h1', {}, 'Sandbox ', h('span', { class: 'mono' }, id)),
    h('p', {}, 'State: ', stateEl), reasonEl, toolbar, status.el, tabHost,
    ...Object.values(panels));

  function selectTab(name) {
    if (!panels[name]) name = 'overview';
    tab = name;
    const nt = tabs('Sandbox sections', TABS, name, (n) => {
      if (n !== tab) history.replaceState(null, '', `#/sandboxes/${enc}/${n}`);
      selectTab(n);
    });
    const hadFocus = tabList && tabList.contains(document.activeElement);
    if (tabList) tabList.replaceWith(nt); else tabHost.append(nt);
    tabList = nt;
    if (hadFocus) nt.querySelector('[aria-selected=true]').focus();
    for (const [n, p] of Object.entries(panels)) p.hidden = n !== name;
    if (!started[name]) {
      started[name] = true;
      ({ overview: startOverview, processes: startProcesses, terminal: startTerminal, files: startFiles })[name]();
    }
  }

  // --- state ---
  const overviewProps = h('dl', { class: 'props' });
  const metaEl = h('div');
  const timeline = h('ol', { class: 'timeline', id: 'timeline', 'aria-live': 'polite' });

  function showSandbox(next) {
    sb = next;
    const st = [badge(sb.state)];
    if (sb.desired_state && sb.desired_state !== sb.state && sb.state !== 'failed') st.push(' → ', sb.desired_state);
    replace(stateEl, st);
    replace(reasonEl, [sb.status_reason ? `Why: ${sb.status_reason}${sb.status_at ? ` (${fmtTime(sb.status_at)})` : ''}` : '',
      sb.error ? h('span', { class: 'alert', role: 'alert' }, sb.error) : '']);
    const resting = sb.desired_state === sb.state || sb.state === 'failed';
    for (const [verb, , from] of VERBS) verbButtons.get(verb).disabled = !resting || !from.includes(sb.state);
    cloneBtn.disabled = !resting || !['running', 'paused', 'suspended'].includes(sb.state);
    delBtn.disabled = sb.state === 'deleted' || sb.desired_state === 'deleted';
    const prop = (k, v) => [h('dt', {}, k), h('dd', {}, v === '' || v === undefined || v === null ? h('span', { class: 'muted' }, '—') : v)];
    replace(overviewProps,
      prop('Template', sb.template), prop('Digest', sb.template_digest ? h('code', {}, sb.template_digest) : ''),
      prop('Runtime', sb.runtime), prop('Node', sb.node ? h('a', { href: '#/nodes' }, sb.node) : ''),
      prop('Start path', sb.start_path), prop('Resources', `${sb.cpu} vCPU · ${sb.memory_mb} MiB`),
      prop('Disk (own)', fmtBytes(sb.disk_bytes)), prop('Created', timeEl(sb.created_at)),
      prop('Expires', sb.expires_at ? timeEl(sb.expires_at) : 'never'), prop('Idle timeout', sb.idle_timeout),
      prop('Last activity', timeEl(sb.last_activity_at)),
      prop('Clone of', sb.clone_of ? h('a', { href: '#/sandboxes/' + sb.clone_of }, sb.clone_of) : ''),
      prop('Environment', sb.env ? Object.keys(sb.env).sort().join(', ') : ''));
    replace(metaEl, pairs(sb.metadata));
  }

  function showOps() {
    const list = [...ops.values()].sort((a, b) => Date.parse(b.created_at) - Date.parse(a.created_at));
    replace(timeline, list.length ? list.map((op) => {
      const dur = op.done_at ? ' in ' + fmtDuration(Date.parse(op.done_at) - Date.parse(op.created_at)) : '';
      return h('li', { class: op.state, 'data-op': op.id, 'data-kind': op.kind },
        h('strong', {}, op.kind), ' ', badge(op.state), h('span', { class: 'muted' }, dur), h('br'),
        op.message ? h('span', {}, op.message) : null, op.error ? h('span', { class: 'alert' }, op.error) : null,
        h('br'), h('span', { class: 'muted mono' }, op.id + ' · '), timeEl(op.created_at));
    }) : h('li', {}, 'No operations.'));
  }

  async function load() {
    try {
      showSandbox(await api.get('/v1/sandboxes/' + enc));
      const res = await api.get(`/v1/sandboxes/${enc}/operations`);
      ops.clear();
      for (const op of res.operations) ops.set(op.id, op);
      showOps();
    } catch (err) {
      status.error(err);
    }
  }

  async function doVerb(verb, label) {
    try {
      const op = await api.post(`/v1/sandboxes/${enc}/${verb}`, null);
      ops.set(op.id, op);
      showOps();
      status.ok(`${label} requested (operation ${op.id}); its progress is in the operations below.`);
      announce(`${label} requested`);
    } catch (err) {
      status.error(err, label + ' failed');
    }
  }

  async function doClone() {
    try {
      const res = await api.post(`/v1/sandboxes/${enc}/clone`, {});
      const ids = res.sandboxes.map((s) => s.id);
      status.ok(h('span', {}, 'Clone requested: ', ids.map((c) => h('a', { href: '#/sandboxes/' + c, class: 'mono' }, c + ' '))));
    } catch (err) {
      status.error(err, 'Clone failed');
    }
  }

  async function doDelete() {
    if (!(await confirmDialog('Delete sandbox?', `Sandbox ${id} and its disk will be deleted. This cannot be undone.`, 'Delete'))) {
      delBtn.focus();
      return;
    }
    try {
      const op = await api.del('/v1/sandboxes/' + enc);
      ops.set(op.id, op);
      showOps();
      status.ok(`Delete requested (operation ${op.id}).`);
    } catch (err) {
      status.error(err, 'Delete failed');
    }
  }

  function startOverview() {
    panels.overview.append(
      h('h2', {}, 'Details'), h('div', { class: 'card' }, overviewProps),
      h('h2', {}, 'Metadata'), h('div', { class: 'card' }, metaEl),
      h('h2', {}, 'Operations'), h('div', { class: 'card' }, timeline));
  }

  // --- processes ---
  function startProcesses() {
    const p = panels.processes;
    const cmd = h('input', { type: 'text', id: 'run-command', placeholder: 'e.g. python3 -c "print(42)"', autocomplete: 'off' });
    const user = h('select', { id: 'run-user' }, h('option', { value: 'root' }, 'root'), h('option', { value: 'user' }, 'user'));
    const runMsg = statusArea();
    const form = h('form', { class: 'card', 'aria-labelledby': 'run-title' },
      h('h2', { id: 'run-title' }, 'Run a command'),
      h('div', { class: 'grid' }, field('Command', cmd, { wide: true, hint: 'runs with /bin/bash -c; output streams below' }), field('User', user)),
      h('div', { class: 'row' }, h('button', { type: 'submit', class: 'primary', id: 'run-submit' }, 'Run')), runMsg.el);
    const procBody = h('tbody');
    const procTable = table('Processes', ['PID', 'Command', 'State', 'Exit', 'Started', 'Output'], []);
    procTable.querySelector('table').replaceChild(procBody, procTable.querySelector('tbody'));
    const outHost = h('div', { id: 'output-host' });
    const refresh = h('button', { type: 'button', id: 'proc-refresh' }, 'Refresh');
    p.append(form, h('h2', {}, 'Processes'), h('div', { class: 'toolbar' }, refresh), procTable, outHost);

    let viewer = null;
    const openViewer = (sess, title) => {
      if (viewer) viewer.close();
      viewer = new OutputView(sess, title, () => listProcs());
      replace(outHost, viewer.el);
      viewer.attach(0);
    };
    form.addEventListener('submit', async (e) => {
      e.preventDefault();
      if (!cmd.value.trim()) { runMsg.error('Enter a command.'); return; }
      try {
        const sess = await api.post(`/v1/sandboxes/${enc}/sessions`, { command: cmd.value, user: user.value, token_ttl: '1h' });
        runMsg.ok(`Started pid ${sess.pid}.`);
        openViewer(sess, `pid ${sess.pid}: ${cmd.value}`);
        listProcs();
      } catch (err) {
        runMsg.error(err, 'Run failed');
      }
    });
    async function listProcs() {
      try {
        const res = await api.get(`/v1/sandboxes/${enc}/processes`, { query: { wake: 'false' } });
        const list = res.processes.sort((a, b) => b.pid - a.pid);
        replace(procBody, list.length ? list.map((pr) => h('tr', { 'data-pid': pr.pid },
          h('td', { class: 'num' }, pr.pid), h('td', { class: 'mono' }, (pr.argv || []).join(' ')),
          h('td', {}, badge(pr.state === 'exited' ? (pr.exit_code === 0 ? 'succeeded' : 'failed') : pr.state), pr.pty ? ' pty' : ''),
          h('td', {}, (pr.exit_code !== undefined && pr.exit_code !== null ? String(pr.exit_code) : (pr.signal || '')) + (pr.timed_out ? ' (timed out)' : '')),
          h('td', {}, timeEl(pr.started_at)),
          h('td', {}, h('button', {
            type: 'button', class: 'small', 'aria-label': 'View output of pid ' + pr.pid,
            onclick: async () => {
              try {
                const sess = await api.post(`/v1/sandboxes/${enc}/sessions`, { pid: pr.pid, rights: ['read'], token_ttl: '1h' });
                openViewer(sess, `pid ${pr.pid}: ${(pr.argv || []).join(' ')}`);
              } catch (err) { runMsg.error(err, 'Attach failed'); }
            },
          }, 'View')))) : emptyRow(6, 'No processes.'));
      } catch (err) {
        replace(procBody, emptyRow(6, ''));
        runMsg.error(err, 'Listing processes failed');
      }
    }
    refresh.addEventListener('click', listProcs);
    listProcs();
    disposers.push(() => viewer && viewer.close());
  }

  // --- terminal ---
  function startTerminal() {
    const p = panels.terminal;
    const user = h('select', { id: 'term-user' }, h('option', { value: 'root' }, 'root'), h('option', { value: 'user' }, 'user'));
    const startBtn = h('button', { type: 'button', class: 'primary', id: 'term-start' }, 'Start shell');
    const stopBtn = h('button', { type: 'button', id: 'term-interrupt', disabled: true }, 'Send Ctrl+C');
    const termStatus = h('p', { id: 'term-status', role: 'status' }, 'No shell running.');
    const host = h('div', { id: 'term-host' });
    p.append(h('div', { class: 'row' }, field('User', user), startBtn, stopBtn), termStatus, host,
      h('p', { class: 'muted', id: 'term-help' },
        'Click the terminal or tab into it to type. Tab goes to the shell; Shift+Tab moves focus out. ' +
        'Shift+PageUp/PageDown scroll. Ctrl+Shift+C / Ctrl+V copy and paste.'));
    let session = null;
    startBtn.addEventListener('click', async () => {
      if (session) session.close();
      replace(host);
      const view = new TermView({ label: 'Terminal input', onInput: (d) => session && session.send(d), onResize: (s) => session && session.resize(s) });
      host.append(view.el);
      view.fit();
      startBtn.disabled = true;
      try {
        const sess = await api.post(`/v1/sandboxes/${enc}/sessions`, {
          argv: ['/bin/bash', '-l'], user: user.value, stdin: true, pty: view.size, token_ttl: '12h',
          env: { TERM: 'xterm-256color' },
        });
        session = new PTYSession(sess, view, (s) => { termStatus.textContent = s; }, () => { stopBtn.disabled = true; startBtn.disabled = false; });
        stopBtn.disabled = false;
        termStatus.textContent = `Shell running (pid ${sess.pid}).`;
        session.attach();
        view.focus();
      } catch (err) {
        replace(termStatus, errorBox(err, 'Starting the shell failed'));
        startBtn.disabled = false;
      }
    });
    stopBtn.addEventListener('click', () => session && session.send('\x03'));
    disposers.push(() => session && session.close());
  }

  // --- files ---
  function startFiles() {
    const p = panels.files;
    const pathIn = h('input', { type: 'text', id: 'files-path', value: '/root', autocomplete: 'off' });
    const goBtn = h('button', { type: 'submit' }, 'Open');
    const upBtn = h('button', { type: 'button', id: 'files-up' }, 'Parent folder');
    const fileIn = h('input', { type: 'file', id: 'files-upload', multiple: true });
    const upload = h('button', { type: 'button', id: 'files-upload-btn' }, 'Upload');
    const mk = h('input', { type: 'text', id: 'files-mkdir', placeholder: 'new-folder' });
    const mkBtn = h('button', { type: 'button', id: 'files-mkdir-btn' }, 'Create folder');
    const msg = statusArea();
    const body = h('tbody');
    const tbl = table('Files', ['Name', 'Type', { label: 'Size', num: true }, 'Mode', 'Owner', 'Modified', 'Actions'], []);
    tbl.querySelector('table').replaceChild(body, tbl.querySelector('tbody'));
    const nav = h('form', { class: 'card', 'aria-label': 'Folder' },
      h('div', { class: 'row' }, h('div', { class: 'field wide' }, h('label', { for: 'files-path' }, 'Folder'), pathIn), goBtn, upBtn));
    const tools = h('div', { class: 'card grid' },
      h('div', { class: 'field' }, h('label', { for: 'files-upload' }, 'Upload files to this folder'), fileIn, h('div', { class: 'row' }, upload)),
      h('div', { class: 'field' }, h('label', { for: 'files-mkdir' }, 'New folder'), mk, h('div', { class: 'row' }, mkBtn)));
    p.append(nav, msg.el, tbl, tools);
    let cwd = '/root';
    const join = (dir, name) => (dir.endsWith('/') ? dir : dir + '/') + name;

    async function list(dir) {
      try {
        const res = await api.get(`/v1/sandboxes/${enc}/files/list`, { query: { path: dir } });
        cwd = dir;
        pathIn.value = dir;
        const entries = (Array.isArray(res) ? res : res.entries || res.files || []).sort((a, b) =>
          (a.type === 'dir') === (b.type === 'dir') ? a.name.localeCompare(b.name) : (a.type === 'dir' ? -1 : 1));
        replace(body, entries.length ? entries.map((f) => {
          const name = f.type === 'dir'
            ? h('button', { type: 'button', class: 'link', onclick: () => list(f.path) }, f.name + '/')
            : h('span', { class: 'mono' }, f.name);
          const acts = [];
          if (f.type === 'file') {
            acts.push(h('button', { type: 'button', class: 'small', 'aria-label': 'Download ' + f.name, onclick: () => get(f) }, 'Download'), ' ');
          }
          acts.push(h('button', { type: 'button', class: 'small danger', 'aria-label': 'Delete ' + f.name, onclick: () => del(f) }, 'Delete'));
          return h('tr', { 'data-name': f.name },
            h('td', {}, name), h('td', {}, f.type + (f.symlink_target ? ' → ' + f.symlink_target : '')),
            h('td', { class: 'num' }, f.type === 'file' ? fmtBytes(f.size) : ''), h('td', { class: 'mono' }, f.permissions),
            h('td', {}, `${f.owner}:${f.group}`), h('td', {}, timeEl(f.modified_time)), h('td', {}, acts));
        }) : emptyRow(7, 'This folder is empty.'));
        msg.clear();
      } catch (err) {
        msg.error(err, 'Listing ' + dir + ' failed');
      }
    }
    async function get(f) {
      try {
        const resp = await request('GET', `/v1/sandboxes/${enc}/files`, { query: { path: f.path }, raw: true });
        download(await resp.blob(), f.name);
        msg.ok(`Downloaded ${f.path}.`);
      } catch (err) {
        msg.error(err, 'Download failed');
      }
    }
    async function del(f) {
      if (!(await confirmDialog('Delete?', `Delete ${f.path}${f.type === 'dir' ? ' and everything in it' : ''}?`, 'Delete'))) return;
      try {
        await api.del(`/v1/sandboxes/${enc}/files`, { query: { path: f.path, recursive: f.type === 'dir' ? 'true' : undefined } });
        msg.ok(`Deleted ${f.path}.`);
        list(cwd);
      } catch (err) {
        msg.error(err, 'Delete failed');
      }
    }
    nav.addEventListener('submit', (e) => { e.preventDefault(); list(pathIn.value.trim() || '/'); });
    upBtn.addEventListener('click', () => {
      const parts = cwd.split('/').filter(Boolean);
      parts.pop();
      list('/' + parts.join('/'));
    });
    upload.addEventListener('click', async () => {
      if (!fileIn.files.length) { msg.error('Choose one or more files first.'); fileIn.focus(); return; }
      upload.disabled = true;
      try {
        for (const f of fileIn.files) {
          await request('PUT', `/v1/sandboxes/${enc}/files`, { query: { path: join(cwd, f.name) }, body: f, headers: { 'Content-Type': 'application/octet-stream' } });
        }
        msg.ok(`Uploaded ${[...fileIn.files].map((f) => f.name).join(', ')} to ${cwd}.`);
        fileIn.value = '';
        list(cwd);
      } catch (err) {
        msg.error(err, 'Upload failed');
      } finally {
        upload.disabled = false;
      }
    });
    mkBtn.addEventListener('click', async () => {
      const name = mk.value.trim();
      if (!name) { msg.error('Enter a folder name.'); mk.focus(); return; }
      try {
        await api.post(`/v1/sandboxes/${enc}/files/mkdir`, { path: name.startsWith('/') ? name : join(cwd, name), parents: true });
        mk.value = '';
        list(cwd);
      } catch (err) {
        msg.error(err, 'Create folder failed');
      }
    });
    list(cwd);
  }

  // --- live updates ---
  disposers.push(ctx.live.on('sandbox', (s) => { if (s.id === id) showSandbox(s); }));
  disposers.push(ctx.live.on('operation', (op) => {
    if (op.sandbox_id !== id) return;
    ops.set(op.id, op);
    showOps();
  }));
  disposers.push(ctx.live.on('sync', load));

  selectTab(tab);
  load();
  const cleanup = () => disposers.forEach((f) => f());
  cleanup.onTab = (name) => selectTab(name);
  return cleanup;
}

// dpURL turns a session's attach URL into the URL of another data-plane action.
function dpURL(sess, action) {
  return sess.attach_url.replace(/\/attach$/, '/' + action);
}

// OutputView shows a process's output from an attach stream, replayable from any
// offset, and resumes after a dropped connection where it stopped (Last-Event-ID).
class OutputView {
  constructor(sess, title, onExit) {
    this.sess = sess;
    this.onExit = onExit;
    this.ctrl = null;
    this.offset = h('input', { type: 'number', min: 0, value: 0, id: 'replay-offset' });
    this.pre = h('pre', { class: 'output', id: 'process-output', role: 'log', 'aria-label': 'Output of ' + title });
    this.state = h('p', { id: 'process-state', role: 'status' }, 'Connecting…');
    const replay = h('button', { type: 'button', id: 'replay' }, 'Replay from offset');
    replay.addEventListener('click', () => this.attach(Number(this.offset.value) || 0));
    this.el = h('section', { class: 'card', 'aria-labelledby': 'output-title' },
      h('h2', { id: 'output-title' }, 'Output of ', h('span', { class: 'mono' }, title)),
      h('div', { class: 'row' }, field('Byte offset', this.offset, { hint: 'output is kept with byte offsets; replay from any of them' }), replay),
      this.state, this.pre);
  }

  close() { if (this.ctrl) this.ctrl.abort(); }

  async attach(from) {
    this.close();
    const ctrl = new AbortController();
    this.ctrl = ctrl;
    this.pre.replaceChildren();
    this.state.textContent = `Connecting (from byte ${from})…`;
    const decoders = { stdout: new TextDecoder(), stderr: new TextDecoder() };
    let last = String(from);
    let exited = false;
    for (let attempt = 0; attempt < 20 && !exited && !ctrl.signal.aborted; attempt++) {
      try {
        await openSSE(this.sess.attach_url, {
          bearer: this.sess.token, lastEventId: last, signal: ctrl.signal,
          onEvent: (ev) => {
            if (ev.id) last = ev.id;
            const d = JSON.parse(ev.data);
            if (ev.event === 'start') {
              this.state.textContent = `Running (pid ${d.pid}), from byte ${d.offset}.`;
            } else if (ev.event === 'stdout' || ev.event === 'stderr') {
              const text = decoders[ev.event].decode(b64bytes(d.data || ''), { stream: true });
              this.pre.append(ev.event === 'stderr' ? h('span', { class: 'stderr' }, text) : document.createTextNode(text));
              this.pre.scrollTop = this.pre.scrollHeight;
            } else if (ev.event === 'gap') {
              this.pre.append(h('span', { class: 'note' }, `[${d.dropped} bytes fell out of the journal before this reader got them]\n`));
            } else if (ev.event === 'exit') {
              exited = true;
              const how = d.error ? `could not be run: ${d.error}`
                : d.timed_out ? `timed out and was killed by ${d.signal}`
                : d.signal ? `killed by ${d.signal}` : `exited with code ${d.exit_code}`;
              this.state.textContent = `Process ${how} (${d.offset} bytes of output).`;
              announce('Process ' + how);
              if (this.onExit) this.onExit();
            } else if (ev.event === 'error') {
              this.state.textContent = 'Stream error: ' + d.message;
            }
          },
        });
        attempt = 0;
      } catch (err) {
        if (ctrl.signal.aborted) return;
        if (err.status && err.status >= 400 && err.status < 500) {
          replace(this.state, errorBox(err, 'Attach failed'));
          return;
        }
        this.state.textContent = 'Connection lost; resuming from byte ' + last + '…';
        await new Promise((r) => setTimeout(r, 1000));
      }
    }
  }
}

// PTYSession drives a terminal: output from the attach stream into the emulator, key
// presses out as ordered stdin POSTs, size changes as resize POSTs.
class PTYSession {
  constructor(sess, view, onStatus, onEnd) {
    this.sess = sess;
    this.view = view;
    this.onStatus = onStatus;
    this.onEnd = onEnd;
    this.queue = '';
    this.sending = false;
    this.ctrl = new AbortController();
    this.ended = false;
  }

  async post(action, body, ctype) {
    const resp = await fetch(dpURL(this.sess, action), {
      method: 'POST', body, signal: this.ctrl.signal, credentials: 'omit',
      headers: { Authorization: 'Bearer ' + this.sess.token, 'Content-Type': ctype },
    });
    if (!resp.ok) throw await errorFrom(resp);
  }

  // send queues input and keeps one stdin POST in flight, so bytes arrive in order.
  send(data) {
    if (this.ended) return;
    this.queue += data;
    this.pump();
  }

  async pump() {
    if (this.sending || !this.queue) return;
    this.sending = true;
    const chunk = this.queue;
    this.queue = '';
    try {
      await this.post('stdin', new TextEncoder().encode(chunk), 'application/octet-stream');
    } catch (err) {
      // Input typed just before the shell exited (Enter's trailing newline, say) can
      // reach a process that is gone; that must not hide the exit status.
      if (!this.ctrl.signal.aborted && !this.ended) this.onStatus('Input failed: ' + err.message);
    } finally {
      this.sending = false;
      if (this.queue) this.pump();
    }
  }

  resize(size) {
    if (this.ended) return;
    this.post('resize', JSON.stringify(size), 'application/json').catch((err) => {
      if (!this.ctrl.signal.aborted && !this.ended) this.onStatus('Resize failed: ' + err.message);
    });
  }

  async attach() {
    let last = '0';
    for (let attempt = 0; attempt < 20 && !this.ended; attempt++) {
      try {
        await openSSE(this.sess.attach_url, {
          bearer: this.sess.token, lastEventId: last, signal: this.ctrl.signal,
          onEvent: (ev) => {
            if (ev.id) last = ev.id;
            const d = JSON.parse(ev.data);
            if (ev.event === 'stdout' || ev.event === 'stderr') {
              this.view.write(b64bytes(d.data || ''));
            } else if (ev.event === 'exit') {
              this.end(d.signal ? `Shell killed by ${d.signal}.` : `Shell exited with code ${d.exit_code}.`);
            } else if (ev.event === 'error') {
              this.onStatus('Stream error: ' + d.message);
            }
          },
        });
        attempt = 0;
      } catch (err) {
        if (this.ctrl.signal.aborted) return;
        if (err.status && err.status >= 400 && err.status < 500) {
          this.end('Terminal session ended: ' + err.message);
          return;
        }
        this.onStatus('Connection lost; reconnecting…');
        await new Promise((r) => setTimeout(r, 1000));
      }
    }
  }

  end(msg) {
    if (this.ended) return;
    this.ended = true;
    this.onStatus(msg);
    announce(msg);
    this.onEnd();
  }

  close() {
    this.ended = true;
    this.ctrl.abort();
    this.view.dispose();
  }
}
