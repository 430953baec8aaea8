// The console's shell: sign-in, navigation and the hash router. Views are modules
// exporting render(main, ctx) that return a cleanup function.

import { session } from './api.js';
import { Live } from './live.js';
import { clear, h } from './ui.js';
import * as signin from './views/signin.js';
import * as sandboxes from './views/sandboxes.js';
import * as sandbox from './views/sandbox.js';
import * as templates from './views/templates.js';
import * as pools from './views/pools.js';
import * as nodes from './views/nodes.js';
import * as keys from './views/keys.js';
import * as bench from './views/bench.js';

const main = document.getElementById('main');
const nav = document.getElementById('nav');
const who = document.getElementById('who');
const live = new Live(document.getElementById('live'));
let cleanup = null;
let signinNotice = '';

// route parses "#/a/b?x=y" into {parts: [a, b], query: URLSearchParams}.
function route() {
  const raw = location.hash.replace(/^#\/?/, '');
  const [path, qs] = raw.split('?');
  const parts = path.split('/').filter(Boolean).map(decodeURIComponent);
  return { parts, query: new URLSearchParams(qs || '') };
}

export function navigate(hash) {
  if (location.hash === hash) render();
  else location.hash = hash;
}

function showChrome(on) {
  nav.hidden = !on;
  who.hidden = !on;
  if (on) {
    const w = session.who || {};
    document.getElementById('who-text').textContent = `tenant ${w.tenant || '?'}${w.role && w.role !== 'member' ? ' · ' + w.role : ''}`;
    document.body.classList.toggle('is-admin', !!w.admin);
    for (const el of document.querySelectorAll('.admin-only')) el.hidden = !w.admin;
    for (const el of document.querySelectorAll('.operator-only')) el.hidden = w.role !== 'operator';
  }
}

function render() {
  if (cleanup) { try { cleanup(); } catch (e) { console.error(e); } cleanup = null; }
  clear(main);
  const ctx = { live, navigate, query: null };
  if (!session.key) {
    live.stop();
    showChrome(false);
    document.title = 'Sign in · space console';
    cleanup = signin.render(main, {
      notice: signinNotice,
      onSignedIn: () => {
        signinNotice = '';
        // Stay on the page the user asked for (a bookmark), else go to the sandboxes.
        if (!location.hash || location.hash === '#/') location.hash = '#/sandboxes';
        else render();
      },
    });
    return;
  }
  showChrome(true);
  live.start();
  const { parts, query } = route();
  ctx.query = query;
  const section = parts[0] || 'sandboxes';
  for (const a of nav.querySelectorAll('a')) {
    if (a.dataset.section === section) a.setAttribute('aria-current', 'page');
    else a.removeAttribute('aria-current');
  }
  let view;
  switch (section) {
    case 'sandboxes': view = parts[1] ? () => sandbox.render(main, ctx, parts[1], parts[2] || 'overview') : () => sandboxes.render(main, ctx); break;
    case 'templates': view = () => templates.render(main, ctx, parts[1]); break;
    case 'pools': view = () => pools.render(main, ctx); break;
    case 'nodes': view = () => nodes.render(main, ctx); break;
    case 'keys': view = () => keys.render(main, ctx); break;
    case 'bench': view = () => bench.render(main, ctx); break;
    default:
      view = () => { main.append(h('h1', { tabindex: '-1' }, 'Not found'), h('p', {}, 'No page here. ', h('a', { href: '#/sandboxes' }, 'Go to sandboxes'))); return null; };
  }
  cleanup = view();
  // Move focus to the new page's heading so keyboard and screen-reader users land there.
  const h1 = main.querySelector('h1');
  if (h1) {
    h1.setAttribute('tabindex', '-1');
    document.title = h1.textContent + ' · space console';
    if (document.activeElement === document.body || !main.contains(document.activeElement)) h1.focus({ preventScroll: true });
  }
}

function signOut(notice) {
  session.clear();
  signinNotice = notice || '';
  live.stop();
  render();
}

document.getElementById('signout').addEventListener('click', () => signOut('Signed out.'));
window.addEventListener('space:unauthorized', (e) => {
  if (session.key) signOut('Your API key was refused: ' + e.detail.message);
});
let lastPath = '';
window.addEventListener('hashchange', () => {
  // Tab changes within a sandbox page are handled by the page itself.
  const { parts } = route();
  const path = parts.slice(0, 2).join('/');
  if (path === lastPath && parts[0] === 'sandboxes' && parts[1] && cleanup && cleanup.onTab) {
    cleanup.onTab(parts[2] || 'overview');
    return;
  }
  lastPath = path;
  render();
});
lastPath = route().parts.slice(0, 2).join('/');
render();
