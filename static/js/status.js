/* Feedback the page gives: the connection pill, the status line, the alert, the screen-reader live region,
 * and the marks on fields the service refused. */
import { $ } from './util.js';
import * as render from './render.js';

let lastError = null;       // the alert shown: {code, message}
let titlePrefix = () => '';

/* The tab title shows what is going on ('● ' while a take streams, '▶ ' while playing): main.js says how to tell. */
export function setTitlePrefix(fn) { titlePrefix = fn; }

export function setConn(state, text) { const c = $('conn'); c.dataset.state = state; $('connText').textContent = text; render.refresh(); }
export function setRtt(ms) { $('conn').title = ms != null ? 'Round trip ' + ms.toFixed(0) + ' ms' : ''; }

export function setStatus(main, sub) {
  $('statusMain').textContent = main; $('statusSub').textContent = sub || '';
  const title = titlePrefix() + 'moss_rt studio';
  if (document.title !== title) document.title = title;
}

/* Screen readers hear discrete events (a take started, ended, failed), never the meters' ticks. */
export function announce(text) { $('announce').textContent = text; }

export function showAlert(code, message, opts = {}) {
  lastError = { code, message };
  $('alertCode').textContent = code;
  $('alertMsg').textContent = message;
  $('alert').classList.toggle('info', !!opts.info);
  $('alertRetry').hidden = !opts.retry;
  $('alert').hidden = false;
}
/* Hide the alert; with codes, only when the alert shown has one of them. */
export function hideAlert(codes) {
  if (codes && lastError && !codes.includes(lastError.code)) return;
  $('alert').hidden = true; lastError = null;
}

/* A field the service (or the page) refused: red outline and the reason under it. */
export function markField(field, message) {
  const map = { reference: 'voice', frame: 'wave', take: 'wave' };
  const input = $(map[field] || field);
  if (input) { input.classList.add('invalid'); if (input.closest('#params')) $('advanced').open = true; }
  const box = document.querySelector(`.field-error[data-for="${field}"]`);
  if (box) { box.textContent = message; box.hidden = false; }
}
export function clearFieldErrors(target) {
  for (const n of document.querySelectorAll('.invalid')) if (!target || n === target) n.classList.remove('invalid');
  for (const n of document.querySelectorAll('.field-error')) if (!target || n.dataset.for === target.id || (target.id === 'voice' && n.dataset.for === 'reference')) n.hidden = true;
}
