// A terminal for PTY sessions. The emulation (escape sequences, screen buffer,
// scrollback) is xterm.js's headless build (vendor/xterm-headless.mjs, pinned in
// web/package-lock.json); this module renders its buffer to DOM rows and turns key
// presses into the bytes a terminal sends.
//
// Why not xterm.js's own renderer: it injects <style> elements and style attributes,
// which the console's Content-Security-Policy (no 'unsafe-inline' styles) forbids.
// Colors here are classes from app.css, or CSSOM properties (el.style.color), which
// the policy allows.

import { Terminal } from '../vendor/xterm-headless.mjs';
import { h } from './ui.js';

// The xterm 256-color palette beyond the 16 named colors (6x6x6 cube, then grays).
function color256(i) {
  if (i < 232) {
    const n = i - 16;
    const v = [0, 95, 135, 175, 215, 255];
    return `rgb(${v[Math.floor(n / 36)]},${v[Math.floor(n / 6) % 6]},${v[n % 6]})`;
  }
  const g = 8 + (i - 232) * 10;
  return `rgb(${g},${g},${g})`;
}

function rgb(c) {
  return '#' + (c & 0xffffff).toString(16).padStart(6, '0');
}

// keySequence returns the bytes a terminal sends for a key press, or null to let the
// browser handle it (printable text then arrives as an input event).
export function keySequence(e, appCursor) {
  const mod = (e.shiftKey ? 1 : 0) + (e.altKey ? 2 : 0) + (e.ctrlKey ? 4 : 0);
  const csi = (final, num) => (mod ? `\x1b[${num || 1};${mod + 1}${final}` : (num ? `\x1b[${num}${final}` : `\x1b[${final}`));
  const cursor = (final) => (mod ? csi(final) : (appCursor ? '\x1bO' + final : '\x1b[' + final));
  switch (e.key) {
    case 'Enter': return e.altKey ? '\x1b\r' : '\r';
    case 'Backspace': return e.ctrlKey ? '\x08' : (e.altKey ? '\x1b\x7f' : '\x7f');
    case 'Tab': return e.shiftKey ? null : '\t'; // Shift+Tab leaves the terminal
    case 'Escape': return '\x1b';
    case 'ArrowUp': return cursor('A');
    case 'ArrowDown': return cursor('B');
    case 'ArrowRight': return cursor('C');
    case 'ArrowLeft': return cursor('D');
    case 'Home': return cursor('H');
    case 'End': return cursor('F');
    case 'Insert': return csi('~', 2);
    case 'Delete': return csi('~', 3);
    case 'PageUp': return e.shiftKey ? null : csi('~', 5);
    case 'PageDown': return e.shiftKey ? null : csi('~', 6);
    case 'F1': return '\x1bOP';
    case 'F2': return '\x1bOQ';
    case 'F3': return '\x1bOR';
    case 'F4': return '\x1bOS';
  }
  const fn = { F5: 15, F6: 17, F7: 18, F8: 19, F9: 20, F10: 21, F11: 23, F12: 24 }[e.key];
  if (fn) return csi('~', fn);
  if (e.metaKey || e.key.length !== 1) return null;
  if (e.ctrlKey && !e.altKey) {
    if (e.shiftKey) return null; // Ctrl+Shift+C/V: the browser's copy and paste
    const k = e.key;
    if (k === 'v') return null; // paste
    const c = k.toUpperCase().charCodeAt(0);
    if (c >= 64 && c <= 95) return String.fromCharCode(c - 64); // Ctrl+@ … Ctrl+_
    if (k === ' ' || k === '2') return '\x00';
    if (k === '/') return '\x1f';
    if (k >= '3' && k <= '7') return String.fromCharCode(k.charCodeAt(0) - 24);
    if (k === '8') return '\x7f';
    return null;
  }
  if (e.altKey && !e.ctrlKey) return '\x1b' + e.key;
  return null;
}

export class TermView {
  // opts: onInput(string), onResize({rows, cols}), label.
  constructor(opts) {
    this.opts = opts;
    this.term = new Terminal({ cols: 80, rows: 24, scrollback: 5000, allowProposedApi: true });
    this.screen = h('div', { class: 'term-screen', 'aria-hidden': 'true' });
    this.measure = h('span', { class: 'term-measure' }, 'WWWWWWWWWW');
    this.input = h('textarea', {
      class: 'term-input', 'aria-label': opts.label || 'Terminal input', autocapitalize: 'off',
      autocomplete: 'off', autocorrect: 'off', spellcheck: 'false', 'aria-describedby': 'term-help',
    });
    // A text copy of the screen for assistive technology and for tests: it is the
    // same rows as the visual screen, without colors.
    this.text = h('pre', { class: 'visually-hidden', id: 'term-text', 'aria-live': 'off' });
    this.el = h('div', { class: 'term' }, this.screen, this.measure, this.input, this.text);
    this.rowEls = [];
    this.cell = this.term.buffer.active.getNullCell();
    this.pending = false;
    this.composing = false;

    this.term.onWriteParsed(() => this.schedule());
    this.term.onData((d) => opts.onInput(d)); // terminal replies (cursor reports etc.)
    this.input.addEventListener('focus', () => { this.el.classList.add('focused'); this.schedule(); });
    this.input.addEventListener('blur', () => { this.el.classList.remove('focused'); this.schedule(); });
    this.input.addEventListener('keydown', (e) => {
      if (e.isComposing || this.composing) return;
      const seq = keySequence(e, this.term.modes.applicationCursorKeysMode);
      if (seq === null) {
        if (e.shiftKey && (e.key === 'PageUp' || e.key === 'PageDown')) {
          e.preventDefault();
          this.term.scrollLines((e.key === 'PageUp' ? -1 : 1) * (this.term.rows - 1));
          this.schedule();
        }
        return;
      }
      e.preventDefault();
      this.term.scrollToBottom();
      opts.onInput(seq);
    });
    this.input.addEventListener('compositionstart', () => { this.composing = true; });
    this.input.addEventListener('compositionend', () => { this.composing = false; this.flushInput(); });
    this.input.addEventListener('input', () => { if (!this.composing) this.flushInput(); });
    this.el.addEventListener('wheel', (e) => {
      e.preventDefault();
      this.term.scrollLines(Math.sign(e.deltaY) * 3);
      this.schedule();
    }, { passive: false });
    this.el.addEventListener('mousedown', (e) => {
      if (e.target !== this.input) { e.preventDefault(); this.input.focus(); }
    });
    this.ro = new ResizeObserver(() => this.fit());
    this.ro.observe(this.el);
  }

  // flushInput sends what was typed or pasted into the hidden textarea.
  flushInput() {
    const v = this.input.value;
    if (!v) return;
    this.input.value = '';
    this.term.scrollToBottom();
    this.opts.onInput(v.replace(/\r?\n/g, '\r'));
  }

  focus() { this.input.focus(); }

  write(bytes) { this.term.write(bytes); }

  // fit sizes the terminal to its box.
  fit() {
    const w = this.measure.getBoundingClientRect();
    const cw = w.width / 10;
    const ch = w.height;
    if (!cw || !ch) return;
    const box = this.screen.getBoundingClientRect();
    const cols = Math.max(10, Math.min(500, Math.floor(box.width / cw)));
    const rows = Math.max(4, Math.min(200, Math.floor(box.height / ch)));
    if (cols === this.term.cols && rows === this.term.rows) return;
    this.term.resize(cols, rows);
    this.schedule();
    if (this.opts.onResize) this.opts.onResize({ rows, cols });
  }

  get size() { return { rows: this.term.rows, cols: this.term.cols }; }

  schedule() {
    if (this.pending) return;
    this.pending = true;
    requestAnimationFrame(() => { this.pending = false; this.render(); });
  }

  render() {
    const buf = this.term.buffer.active;
    const rows = this.term.rows;
    while (this.rowEls.length < rows) {
      const r = h('div', { class: 'term-row' });
      this.rowEls.push(r);
      this.screen.append(r);
    }
    while (this.rowEls.length > rows) this.rowEls.pop().remove();
    const cursorRow = buf.baseY + buf.cursorY - buf.viewportY;
    const lines = [];
    for (let y = 0; y < rows; y++) {
      const line = buf.getLine(buf.viewportY + y);
      const el = this.rowEls[y];
      el.replaceChildren();
      if (!line) { lines.push(''); continue; }
      lines.push(line.translateToString(true));
      this.renderLine(el, line, y === cursorRow ? buf.cursorX : -1);
    }
    this.text.textContent = lines.join('\n').replace(/\n+$/, '');
  }

  renderLine(el, line, cursorX) {
    const cell = this.cell;
    let run = null;
    let runKey = '';
    let text = '';
    const flush = () => {
      if (!text) return;
      run.textContent = text;
      el.append(run);
      text = '';
    };
    const cols = this.term.cols;
    for (let x = 0; x < cols; x++) {
      line.getCell(x, cell);
      const width = cell.getWidth();
      if (width === 0) continue; // the right half of a wide character
      const chars = cell.getChars() || ' ';
      const key = this.attrKey(cell) + (x === cursorX ? '|c' : '');
      if (key !== runKey || x === cursorX) {
        flush();
        runKey = key;
        run = this.span(cell, x === cursorX);
      }
      text += chars;
    }
    flush();
  }

  attrKey(c) {
    return [c.getFgColorMode(), c.getFgColor(), c.getBgColorMode(), c.getBgColor(), c.isBold(), c.isItalic(),
      c.isUnderline(), c.isInverse(), c.isDim(), c.isInvisible(), c.isStrikethrough()].join(',');
  }

  span(c, cursor) {
    const s = document.createElement('span');
    const cls = [];
    if (c.isBold()) cls.push('b');
    if (c.isItalic()) cls.push('i');
    if (c.isUnderline()) cls.push('u');
    if (c.isStrikethrough()) cls.push('s');
    if (c.isDim()) cls.push('d');
    if (c.isInvisible()) cls.push('h');
    if (cursor) cls.push('cursor');
    let fg = c.isFgDefault() ? null : (c.isFgRGB() ? rgb(c.getFgColor()) : c.getFgColor());
    let bg = c.isBgDefault() ? null : (c.isBgRGB() ? rgb(c.getBgColor()) : c.getBgColor());
    if (c.isInverse()) {
      [fg, bg] = [bg === null ? 'I' : bg, fg === null ? 'I' : fg];
    }
    const paint = (v, kind) => {
      if (v === null) return;
      if (v === 'I' || (typeof v === 'number' && v < 16)) cls.push(kind + v);
      else if (typeof v === 'number') s.style[kind === 'fg' ? 'color' : 'backgroundColor'] = color256(v);
      else s.style[kind === 'fg' ? 'color' : 'backgroundColor'] = v;
    };
    paint(fg, 'fg');
    paint(bg, 'bg');
    if (cls.length) s.className = cls.join(' ');
    return s;
  }

  dispose() {
    this.ro.disconnect();
    this.term.dispose();
  }
}
