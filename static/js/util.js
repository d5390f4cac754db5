/* Small shared helpers: audio constants, DOM building, number formatting. No state. */

export const SR = 48000;                 // the service's sample rate (hello.sr)
export const FRAME = 3840;               // samples per channel per 80 ms codec frame
export const LITTLE_ENDIAN = new Uint8Array(new Uint16Array([1]).buffer)[0] === 1;

export const $ = (id) => document.getElementById(id);
export const now = () => performance.now();
export const clamp = (v, lo, hi) => Math.max(lo, Math.min(hi, v));
export const fmtSec = (samples) => (samples / SR).toFixed(2) + ' s';
export const plural = (n, word) => n + ' ' + word + (n === 1 ? '' : 's');
export const fmtClock = (sec) => { const m = Math.floor(sec / 60); return m + ':' + (sec - m * 60).toFixed(1).padStart(4, '0'); };

/* A take as every label names it: its name ("Keeper (Take 2)") when the director gave one, else "Take 2". */
export function takeTitle(t) { return t.title ? t.title + ' (' + t.name + ')' : t.name; }

/* A take's name as a file name part: "keeper-take-2" (letters and digits of any script, dashes between). */
export function fileSlug(text) {
  return String(text || '').normalize('NFC').toLowerCase().replace(/[^\p{L}\p{N}]+/gu, '-').replace(/^-+|-+$/g, '').slice(0, 60) || 'take';
}

/* A real-time factor as shown: the words follow the rounded number (0.996 is "1.00×, real time"). */
export function describeRtf(rtf) {
  const shown = rtf.toFixed(2);
  return shown + '× · ' + (shown === '1.00' ? 'real time' : rtf > 1 ? 'faster than real time' : 'slower than real time');
}

/* el('button', { class, text, onclick, 'aria-label': … }, ...children): attributes, listeners and children in one call. */
export function el(tag, props, ...kids) {
  const n = document.createElement(tag);
  if (props) for (const [k, v] of Object.entries(props)) {
    if (v == null || v === false) continue;
    if (k === 'class') n.className = v;
    else if (k === 'text') n.textContent = v;
    else if (k.startsWith('on')) n.addEventListener(k.slice(2), v);
    else n.setAttribute(k, v === true ? '' : v);
  }
  for (const c of kids) if (c != null) n.append(c);
  return n;
}
