// API access: the key lives in sessionStorage (gone when the tab closes) and goes out
// as a bearer header on every request. There are no cookies, so nothing a foreign site
// could make the browser send on its own.

const KEY = 'space.key';
const WHO = 'space.who';

export const session = {
  get key() { return sessionStorage.getItem(KEY) || ''; },
  get who() {
    try { return JSON.parse(sessionStorage.getItem(WHO) || 'null'); } catch { return null; }
  },
  set(key, who) {
    sessionStorage.setItem(KEY, key);
    sessionStorage.setItem(WHO, JSON.stringify(who));
  },
  clear() {
    sessionStorage.removeItem(KEY);
    sessionStorage.removeItem(WHO);
  },
};

// APIError carries the API's own words: {"error": {"code", "message"}}.
export class APIError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

// errorFrom turns a failed response into an APIError with the API's message.
export async function errorFrom(resp) {
  let code = 'http_' + resp.status;
  let message = `${resp.status} ${resp.statusText}`.trim();
  try {
    const text = await resp.text();
    try {
      const body = JSON.parse(text);
      if (body && body.error && body.error.message) {
        code = body.error.code || code;
        message = body.error.message;
      }
    } catch {
      if (text.trim()) message = text.trim().slice(0, 500);
    }
  } catch { /* no body */ }
  return new APIError(resp.status, code, message);
}

// request calls the control-plane API. body: an object (sent as JSON), or a
// Blob/ArrayBuffer/string sent as is. raw returns the Response instead of JSON.
export async function request(method, path, opts = {}) {
  const key = opts.key ?? session.key;
  const headers = new Headers(opts.headers || {});
  if (key) headers.set('Authorization', 'Bearer ' + key);
  let body = opts.body;
  if (body !== undefined && body !== null && !(body instanceof Blob) && !(body instanceof ArrayBuffer)
      && !(body instanceof Uint8Array) && typeof body !== 'string') {
    body = JSON.stringify(body);
    headers.set('Content-Type', 'application/json');
  }
  let url = path;
  if (opts.query) {
    const q = new URLSearchParams();
    for (const [k, v] of Object.entries(opts.query)) {
      if (v !== undefined && v !== null && v !== '') q.set(k, String(v));
    }
    const s = q.toString();
    if (s) url += (url.includes('?') ? '&' : '?') + s;
  }
  let resp;
  try {
    resp = await fetch(url, { method, headers, body, signal: opts.signal, cache: 'no-store', credentials: 'omit' });
  } catch (e) {
    if (e.name === 'AbortError') throw e;
    throw new APIError(0, 'network', 'cannot reach the server: ' + e.message);
  }
  if (!resp.ok) {
    const err = await errorFrom(resp);
    if (resp.status === 401 && !opts.key) {
      window.dispatchEvent(new CustomEvent('space:unauthorized', { detail: err }));
    }
    throw err;
  }
  if (opts.raw) return resp;
  if (resp.status === 204) return null;
  const text = await resp.text();
  return text ? JSON.parse(text) : null;
}

export const api = {
  get: (p, o) => request('GET', p, o),
  post: (p, body, o = {}) => request('POST', p, { ...o, body }),
  put: (p, body, o = {}) => request('PUT', p, { ...o, body }),
  del: (p, o) => request('DELETE', p, o),
};

// readSSE reads a Server-Sent Events response body, calling onEvent({event, data, id})
// for each event (comments are skipped). It resolves when the stream ends.
export async function readSSE(resp, onEvent) {
  const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = '';
  let ev = { event: 'message', data: [], id: null };
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += value;
    let nl;
    while ((nl = buf.indexOf('\n')) >= 0) {
      let line = buf.slice(0, nl);
      buf = buf.slice(nl + 1);
      if (line.endsWith('\r')) line = line.slice(0, -1);
      if (line === '') {
        if (ev.data.length) onEvent({ event: ev.event, data: ev.data.join('\n'), id: ev.id });
        ev = { event: 'message', data: [], id: null };
        continue;
      }
      if (line.startsWith(':')) continue;
      const colon = line.indexOf(':');
      const field = colon < 0 ? line : line.slice(0, colon);
      let val = colon < 0 ? '' : line.slice(colon + 1);
      if (val.startsWith(' ')) val = val.slice(1);
      if (field === 'event') ev.event = val;
      else if (field === 'data') ev.data.push(val);
      else if (field === 'id') ev.id = val;
    }
  }
}

// openSSE opens an SSE stream with fetch (EventSource cannot send an Authorization
// header) and reads it. bearer defaults to the API key.
export async function openSSE(url, { bearer, lastEventId, signal, onEvent }) {
  const headers = new Headers({ Accept: 'text/event-stream' });
  const tok = bearer ?? session.key;
  if (tok) headers.set('Authorization', 'Bearer ' + tok);
  if (lastEventId) headers.set('Last-Event-ID', lastEventId);
  let resp;
  try {
    resp = await fetch(url, { headers, signal, cache: 'no-store', credentials: 'omit' });
  } catch (e) {
    if (e.name === 'AbortError') throw e;
    throw new APIError(0, 'network', 'cannot reach ' + new URL(url, location.href).origin + ': ' + e.message);
  }
  if (!resp.ok) {
    const err = await errorFrom(resp);
    if (resp.status === 401 && bearer === undefined) {
      window.dispatchEvent(new CustomEvent('space:unauthorized', { detail: err }));
    }
    throw err;
  }
  await readSSE(resp, onEvent);
}

// b64bytes decodes standard base64 into bytes.
export function b64bytes(s) {
  const bin = atob(s);
  const out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}
