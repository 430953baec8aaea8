// The live event stream (GET /v1/events): one connection shared by every view,
// reconnected with backoff. Views subscribe to "sandbox", "operation" and "sync"
// (the stream is live or changes may have been missed: reload).

import { openSSE } from './api.js';

export class Live {
  constructor(indicator) {
    this.indicator = indicator;
    this.handlers = { sandbox: new Set(), operation: new Set(), sync: new Set() };
    this.ctrl = null;
    this.connected = false;
    this.stopped = true;
  }

  on(kind, fn) {
    this.handlers[kind].add(fn);
    return () => this.handlers[kind].delete(fn);
  }

  emit(kind, data) {
    for (const fn of [...this.handlers[kind]]) {
      try { fn(data); } catch (e) { console.error(e); }
    }
  }

  setState(on, text) {
    this.connected = on;
    if (!this.indicator) return;
    this.indicator.textContent = text;
    this.indicator.classList.toggle('on', on);
  }

  start() {
    if (!this.stopped) return;
    this.stopped = false;
    this.loop();
  }

  stop() {
    this.stopped = true;
    if (this.ctrl) this.ctrl.abort();
    this.setState(false, '');
  }

  async loop() {
    let delay = 500;
    while (!this.stopped) {
      this.ctrl = new AbortController();
      this.setState(false, 'connecting…');
      try {
        await openSSE('/v1/events', {
          signal: this.ctrl.signal,
          onEvent: (ev) => {
            let data = null;
            try { data = JSON.parse(ev.data); } catch { return; }
            switch (ev.event) {
              case 'ready':
              case 'resync':
                delay = 500;
                this.setState(true, 'live');
                this.emit('sync', ev.event);
                break;
              case 'sandbox':
                this.emit('sandbox', data);
                break;
              case 'operation':
                this.emit('operation', data);
                break;
              case 'error':
                this.setState(false, 'stream ended: ' + (data.message || ''));
                break;
            }
          },
        });
      } catch (e) {
        if (this.stopped || e.name === 'AbortError') return;
        if (e.status === 401) { this.stop(); return; }
      }
      if (this.stopped) return;
      this.setState(false, 'reconnecting…');
      await new Promise((r) => setTimeout(r, delay));
      delay = Math.min(delay * 2, 10000);
    }
  }
}
