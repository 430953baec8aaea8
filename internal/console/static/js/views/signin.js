// Sign-in: the key is checked with GET /v1/whoami before it is kept.

import { api, session } from '../api.js';
import { errorBox, h, replace } from '../ui.js';

export function render(main, { notice, onSignedIn }) {
  const input = h('input', { type: 'password', id: 'apikey', name: 'apikey', autocomplete: 'off', spellcheck: 'false', required: true, 'aria-describedby': 'apikey-hint' });
  const msg = h('div', { id: 'signin-msg', 'aria-live': 'assertive' });
  const btn = h('button', { type: 'submit', class: 'primary' }, 'Sign in');
  if (notice) msg.append(h('div', { class: 'notice' }, notice));
  const form = h('form', { class: 'card', novalidate: true },
    h('div', { class: 'field' },
      h('label', { for: 'apikey' }, 'API key'),
      input,
      h('span', { class: 'muted', id: 'apikey-hint' },
        'A space API key. `space serve` saved the operator key in <data-dir>/admin.key. ' +
        'The key stays in this tab only (sessionStorage) and is sent as a bearer header.')),
    h('div', { class: 'row' }, btn));
  form.addEventListener('submit', async (e) => {
    e.preventDefault();
    const key = input.value.trim();
    if (!key) {
      replace(msg, errorBox('Enter an API key.'));
      input.focus();
      return;
    }
    btn.disabled = true;
    try {
      const who = await api.get('/v1/whoami', { key });
      session.set(key, who);
      onSignedIn();
    } catch (err) {
      replace(msg, errorBox(err, 'Sign-in failed'));
      input.select();
      input.focus();
    } finally {
      btn.disabled = false;
    }
  });
  main.append(h('div', { class: 'signin' }, h('h1', {}, 'Sign in to space'), msg, form));
  setTimeout(() => input.focus(), 0);
  return null;
}
