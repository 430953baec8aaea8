// Nodes: runtime (and why it was chosen), liveness, capacity and the usage of the
// sandboxes placed there.

import { api } from '../api.js';
import { badge, emptyRow, fmtBytes, h, replace, statusArea, table, timeEl } from '../ui.js';

const LIVE = new Set(['pending', 'creating', 'running', 'pausing', 'paused', 'resuming', 'restoring', 'suspending', 'stopping', 'deleting']);

export function render(main, ctx) {
  const status = statusArea();
  const host = h('div');
  main.append(h('h1', {}, 'Nodes'), status.el, host);
  async function load() {
    try {
      const [nres, sres] = await Promise.all([api.get('/v1/nodes'), api.get('/v1/sandboxes').catch(() => ({ sandboxes: [] }))]);
      const use = {};
      for (const sb of sres.sandboxes) {
        if (!sb.node) continue;
        const u = use[sb.node] || (use[sb.node] = { n: 0, cpu: 0, mem: 0, disk: 0, resident: 0 });
        u.n++;
        u.disk += sb.disk_bytes || 0;
        if (LIVE.has(sb.state)) { u.resident++; u.cpu += sb.cpu; u.mem += sb.memory_mb; }
      }
      replace(host, nres.nodes.length ? nres.nodes.map((n) => {
        const info = n.runtime_info || {};
        const u = use[n.id] || { n: 0, cpu: 0, mem: 0, disk: 0, resident: 0 };
        const used = n.used || {};
        const capacity = n.capacity || {};
        const cap = (v, total, unit) => (total ? `${v} of ${total} ${unit}` : `${v} ${unit}`);
        const why = info.selected || info.reason || '';
        const rest = Object.keys(info).filter((k) => !['selected', 'reason', 'version', 'host_cpus', 'host_memory_mb'].includes(k)).sort();
        return h('section', { class: 'card', 'data-node': n.id },
          h('h2', {}, n.name, ' ', badge(n.state), n.cordoned ? [' ', badge('cordoned')] : null),
          h('dl', { class: 'props' },
            h('dt', {}, 'ID'), h('dd', { class: 'mono' }, n.id),
            h('dt', {}, 'Runtime'), h('dd', {}, n.runtime, info.version ? ' ' + info.version : ''),
            h('dt', {}, 'Why this runtime'), h('dd', {}, why || h('span', { class: 'muted' }, 'not reported')),
            h('dt', {}, 'Heartbeat'), h('dd', {}, timeEl(n.heartbeat_at)),
            n.dead_reason ? [h('dt', {}, 'Dead'), h('dd', {}, n.dead_reason)] : null,
            h('dt', {}, 'Data plane'), h('dd', { class: 'mono' }, n.data_plane_url),
            h('dt', {}, 'Sandboxes'), h('dd', {}, `${n.sandboxes} placed, ${u.resident} using resources`),
            // Placement's view (what the node offers; 0 = unbounded) where the node
            // reports it, else the host's.
            h('dt', {}, 'vCPUs'), h('dd', {}, cap(used.cpu ?? u.cpu, capacity.cpu || info.host_cpus, 'vCPU')),
            h('dt', {}, 'Memory'), h('dd', {}, cap(used.memory_mb ?? u.mem, capacity.memory_mb || info.host_memory_mb, 'MiB')),
            h('dt', {}, 'Disk for placement'), h('dd', {}, cap(used.disk_mb ?? 0, capacity.disk_mb, 'MiB')),
            h('dt', {}, 'Own disk of sandboxes'), h('dd', {}, fmtBytes(u.disk))),
          rest.length ? h('details', {}, h('summary', {}, 'Runtime details'),
            h('dl', { class: 'props' }, rest.map((k) => [h('dt', {}, k), h('dd', { class: 'mono' }, typeof info[k] === 'object' ? JSON.stringify(info[k]) : String(info[k]))]))) : null);
      }) : h('p', { class: 'empty' }, 'No nodes registered.'));
    } catch (err) {
      status.error(err, 'Loading nodes failed');
    }
  }
  load();
  const t = setInterval(load, 10000); // heartbeats are not streamed
  const off = ctx.live.on('sync', load);
  return () => { clearInterval(t); off(); };
}
