// API keys (operator and tenant admin keys): list, create (the secret is shown once),
// revoke. Operators name the new key's tenant; a tenant's admin creates keys in its own.

import { api } from '../api.js';
import { checkbox, confirmDialog, emptyRow, field, h, replace, statusArea, table, timeEl } from '../ui.js';

export function render(main) {
  const status = statusArea();
  const body = h('tbody');
  const tbl = table('API keys', ['Name', 'Tenant', 'Role', 'Prefix', 'Kind', 'Created', 'Revoked', 'Actions'], []);
  tbl.querySelector('table').replaceChild(body, tbl.querySelector('tbody'));
  const name = h('input', { type: 'text', id: 'key-name', maxlength: 128, required: true });
  const kind = h('select', { id: 'key-kind' }, h('option', { value: 'space' }, 'space (this API)'), h('option', { value: 'e2b' }, 'e2b (E2B-compatible API)'));
  const tenant = h('input', { type: 'text', id: 'key-tenant', maxlength: 63, placeholder: 'required from operators' });
  const admin = checkbox("Admin of its tenant (may manage the tenant's keys, pools and templates)", { id: 'key-admin' });
  const msg = statusArea();
  const secretHost = h('div', { 'aria-live': 'polite' });
  const form = h('form', { class: 'card', 'aria-labelledby': 'key-title' },
    h('h2', { id: 'key-title' }, 'Create a key'),
    h('div', { class: 'grid' }, field('Name', name), field('Tenant', tenant), field('Kind', kind), h('div', { class: 'field' }, admin.el)),
    h('div', { class: 'row' }, h('button', { type: 'submit', class: 'primary' }, 'Create key')), msg.el, secretHost);
  form.addEventListener('submit', async (e) => {
    e.preventDefault();
    try {
      const req = { name: name.value.trim(), kind: kind.value, admin: admin.input.checked };
      if (tenant.value.trim()) req.tenant = tenant.value.trim();
      const k = await api.post('/v1/apikeys', req);
      const copy = h('button', { type: 'button' }, 'Copy');
      copy.addEventListener('click', async () => {
        try { await navigator.clipboard.writeText(k.secret); copy.textContent = 'Copied'; } catch { copy.textContent = 'Select and copy by hand'; }
      });
      replace(secretHost, h('div', { class: 'notice' },
        h('p', {}, `Key "${k.name}" created. Its secret is shown only now:`),
        h('p', { class: 'secret', id: 'key-secret' }, k.secret), copy));
      msg.clear();
      name.value = '';
      load();
    } catch (err) {
      msg.error(err, 'Creating the key failed');
    }
  });
  main.append(h('h1', {}, 'API keys'), status.el, tbl, form);
  async function load() {
    try {
      const res = await api.get('/v1/apikeys');
      replace(body, res.api_keys.length ? res.api_keys.map((k) => {
        const revoke = h('button', { type: 'button', class: 'small danger', 'aria-label': 'Revoke key ' + k.name, disabled: !!k.revoked_at }, 'Revoke');
        revoke.addEventListener('click', async () => {
          if (!(await confirmDialog('Revoke key?', `Key "${k.name}" (${k.prefix}…) stops working at once.`, 'Revoke'))) return;
          try { await api.del('/v1/apikeys/' + encodeURIComponent(k.id)); status.ok(`Revoked ${k.name}.`); load(); } catch (err) { status.error(err, 'Revoke failed'); }
        });
        return h('tr', {}, h('td', {}, k.name), h('td', {}, k.tenant), h('td', {}, k.role), h('td', { class: 'mono' }, k.prefix), h('td', {}, k.kind),
          h('td', {}, timeEl(k.created_at)), h('td', {}, k.revoked_at ? timeEl(k.revoked_at) : '—'), h('td', {}, revoke));
      }) : emptyRow(8, 'No keys.'));
    } catch (err) {
      status.error(err, 'Loading keys failed');
    }
  }
  load();
  return null;
}
