// Warm pools: parked sandboxes per template tag and size class.

import { api } from '../api.js';
import { emptyRow, field, h, replace, statusArea, table } from '../ui.js';

export function render(main, ctx) {
  const status = statusArea();
  const body = h('tbody');
  const tbl = table('Warm pools', ['Template', { label: 'vCPUs', num: true }, { label: 'Memory', num: true }, { label: 'Size', num: true }, { label: 'Ready', num: true }], []);
  tbl.querySelector('table').replaceChild(body, tbl.querySelector('tbody'));
  const tpl = h('input', { type: 'text', id: 'pool-template', placeholder: 'base:latest', required: true });
  const cpu = h('input', { type: 'number', id: 'pool-cpu', min: 1, placeholder: 'default' });
  const mem = h('input', { type: 'number', id: 'pool-memory', min: 64, step: 64, placeholder: 'default' });
  const size = h('input', { type: 'number', id: 'pool-size', min: 0, max: 500, value: 1, required: true });
  const msg = statusArea();
  const form = h('form', { class: 'card', 'aria-labelledby': 'pool-title' },
    h('h2', { id: 'pool-title' }, 'Set a pool'),
    h('p', { class: 'muted' }, 'A create request for this template tag and size class claims a parked sandbox instead of starting one. Size 0 removes the pool. Needs an admin key.'),
    h('div', { class: 'grid' }, field('Template tag', tpl), field('vCPUs', cpu), field('Memory (MiB)', mem), field('Size', size)),
    h('div', { class: 'row' }, h('button', { type: 'submit', class: 'primary' }, 'Save pool')), msg.el);
  form.addEventListener('submit', async (e) => {
    e.preventDefault();
    try {
      const p = await api.put('/v1/pools', {
        template: tpl.value.trim(), size: Number(size.value),
        cpu: cpu.value ? Number(cpu.value) : undefined, memory_mb: mem.value ? Number(mem.value) : undefined,
      });
      msg.ok(`Pool ${p.template} (${p.cpu} vCPU, ${p.memory_mb} MiB) set to ${p.size}.`);
      load();
    } catch (err) {
      msg.error(err, 'Setting the pool failed');
    }
  });
  main.append(h('h1', {}, 'Warm pools'), status.el, tbl, form);
  async function load() {
    try {
      const res = await api.get('/v1/pools');
      replace(body, res.pools.length ? res.pools.map((p) => h('tr', {},
        h('td', {}, p.template), h('td', { class: 'num' }, p.cpu), h('td', { class: 'num' }, p.memory_mb + ' MiB'),
        h('td', { class: 'num' }, p.size), h('td', { class: 'num' }, p.ready))) : emptyRow(5, 'No warm pools.'));
    } catch (err) {
      status.error(err, 'Loading pools failed');
    }
  }
  load();
  const t = setInterval(load, 5000); // pool fill level changes without events
  return () => clearInterval(t);
}
