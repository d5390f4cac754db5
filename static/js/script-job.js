/* A script render as the service runs it (docs/scripts.md, /api/scripts): posting a script, following the one
 * script the panel shows through its server-sent events, retaking a line, accepting a take as a line's, exporting
 * the zip, listing and deleting a session's scripts. Owns the followed script's state (as the service last said
 * it) and its event stream; tells the panel through scriptEvents. No DOM.
 *
 * The stream: `state` (the whole state) replaces what is held, `line` one line, `progress` and `done` the counts,
 * `error` (the script or its session was deleted) ends it. The browser reconnects by itself with Last-Event-ID and
 * gets exactly what it missed; when it gives up (the token expired, the service answered an error), the state is
 * asked again (a 404: the script is gone) and the stream reopened with a fresh token. */
import { createEmitter } from './events.js';
import { auth, apiFetch } from './auth.js';
import { encodeMessage } from './wire.js';
import { parseJsonExact } from './script-text.js';

/* 'state' (script): a new whole state; 'line' (line, script): one line changed; 'progress' (script): the counts;
 * 'done' (script): every line done or failed; 'gone' ({code, message}): the script is no more (deleted, or its
 * session); 'stream' (open): the event stream connected or lost. */
export const scriptEvents = createEmitter();
export const stats = { scriptEvents: 0, streamOpens: 0 };

let script = null;       // the followed script: the service's state, lines as an array (line n at n - 1)
let source = null;       // its EventSource
let lastEventId = null;  // the id of the last event applied (the stream resumes from it)
let reopenTimer = null;
let backoffMs = 1000;

/* The followed script ({script, session, title, state, lines_total, lines_done, …, lines: [...]}), or null. */
export function currentScript() { return script; }
/* Line n (1-based) of the followed script, or null. */
export function scriptLine(n) { return script ? script.lines[n - 1] || null : null; }
/* Whether the event stream is connected. */
export function streamOpen() { return !!(source && source.readyState === EventSource.OPEN); }

const base = (id) => '/api/scripts/' + encodeURIComponent(id);

/* An error the service answered: Error with .status, .code, .field, .retryAfter (seconds) and the message. */
async function failure(r) {
  let body = null; try { body = parseJsonExact(await r.text()); } catch (e) { /* not JSON */ }
  const err = (body && body.error) || {};
  const e = new Error(err.message || 'HTTP ' + r.status);
  e.status = r.status; e.code = err.code || 'http_' + r.status; e.field = err.field || null;
  e.retryAfter = +r.headers.get('Retry-After') || null;
  return e;
}

async function call(method, url, body) {
  await auth.ensure().catch(() => {});   // a fresh token (the answer says so if the key is refused)
  const opts = { method, cache: 'no-store' };
  // Seeds go as exact numbers (a seed held as a string of digits, past 2^53, too), and come back exact.
  if (body !== undefined) { opts.body = encodeMessage(body); opts.headers = { 'Content-Type': 'application/json' }; }
  const r = await apiFetch(url, opts);
  if (!r.ok) throw await failure(r);
  return parseJsonExact(await r.text());
}

/* POST /api/scripts: the body is the JSON form, or {script: "<plain text>", cast}; with the session. The 201's
 * answer ({script, lines, session, state, event_id}); throws the service's error (422: its message names where). */
export function postScript(body) { return call('POST', '/api/scripts', body); }

/* The scripts rendered into a session, oldest first (their progress, title, created). */
export async function listScripts(session) {
  const body = await call('GET', '/api/scripts?session=' + encodeURIComponent(session));
  return body.scripts || [];
}

/* Render line n again: any of {text, instruction, seed (a number, or a string of digits), frame}. Its result
 * comes as a `line` event. */
export function retakeLine(n, fields) { return call('POST', base(script.script) + '/lines/' + n + '/retake', fields); }

/* Make `takeId` (a take of the script's session) line n's take; the line's new state. */
export async function acceptTake(n, takeId) {
  const body = await call('POST', base(script.script) + '/lines/' + n + '/accept', { take: takeId });
  if (body.line) applyLine(body.line);
  return body.line;
}

/* Stop the script's render and forget it (its takes stay in the session). */
export async function deleteScript(id) {
  await call('DELETE', base(id));
  if (script && script.script === id) stopFollowing();
}

/* The export, downloaded whole: {blob, name}. onBytes(n) follows the download. */
export async function exportZip(format, onBytes = () => {}) {
  await auth.ensure().catch(() => {});
  const q = format && format !== 'wav' ? '?format=' + encodeURIComponent(format) : '';
  const r = await apiFetch(base(script.script) + '.zip' + q, { cache: 'no-store' });
  if (!r.ok) throw await failure(r);
  const m = /filename="([^"]+)"/.exec(r.headers.get('Content-Disposition') || '');
  const parts = [];
  let n = 0;
  const reader = r.body.getReader();
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    parts.push(value); n += value.length; onBytes(n);
  }
  return { blob: new Blob(parts, { type: 'application/zip' }), name: m ? m[1] : script.script + '.zip' };
}

/* ------------------------------------------------------------------ following one script */

/* Follow script `id`: its state (from the stream's first `state`, or `known` meanwhile) and every change. */
export function followScript(id, known = null) {
  stopFollowing();
  script = known ? withLines(known) : { script: id, lines: [], state: 'queued', lines_total: 0, lines_done: 0, lines_failed: 0, lines_rendering: 0, lines_pending: 0 };
  if (known) scriptEvents.emit('state', script);
  openStream(id);
}

export function stopFollowing() {
  clearTimeout(reopenTimer); reopenTimer = null;
  if (source) { source.close(); source = null; }
  script = null; lastEventId = null; backoffMs = 1000;
}

function withLines(state) { return { ...state, lines: [...(state.lines || [])] }; }

function applyLine(line) {
  if (!script || !line || !line.line) return;
  script.lines[line.line - 1] = line;
  scriptEvents.emit('line', line, script);
}

function openStream(id) {
  let url = base(id) + '/events';
  if (lastEventId) url += '?last_event_id=' + encodeURIComponent(lastEventId);
  const es = new EventSource(auth.query(url));
  source = es; stats.streamOpens++;
  const handle = (type, fn) => es.addEventListener(type, (e) => {
    if (source !== es || !(e instanceof MessageEvent)) return;
    if (e.lastEventId) lastEventId = e.lastEventId;
    let data; try { data = parseJsonExact(e.data); } catch (err) { return; }
    stats.scriptEvents++;
    fn(data);
  });
  handle('state', (data) => { script = withLines(data); scriptEvents.emit('state', script); });
  handle('line', applyLine);
  handle('progress', (data) => { Object.assign(script, data); scriptEvents.emit('progress', script); });
  handle('done', (data) => { Object.assign(script, data); scriptEvents.emit('progress', script); scriptEvents.emit('done', script); });
  handle('error', (data) => gone(data));     // the service's own `error` event (deleted); not a lost connection
  es.addEventListener('open', () => { if (source === es) { backoffMs = 1000; scriptEvents.emit('stream', true); } });
  es.addEventListener('error', (e) => {
    if (source !== es || e instanceof MessageEvent) return;
    scriptEvents.emit('stream', false);
    if (es.readyState === EventSource.CLOSED) { es.close(); source = null; reopenLater(id); }
    // else: the browser reconnects by itself, with Last-Event-ID
  });
}

function gone(data) {
  const what = { code: (data && data.code) || 'not_found', message: (data && data.message) || 'the script is gone' };
  if (source) { source.close(); source = null; }
  clearTimeout(reopenTimer); reopenTimer = null;
  scriptEvents.emit('gone', what);
}

/* The browser gave up on the stream: is the script still there? Then open it again from the last event seen. */
function reopenLater(id) {
  clearTimeout(reopenTimer);
  reopenTimer = setTimeout(async () => {
    reopenTimer = null;
    if (!script || script.script !== id) return;
    try {
      const state = await call('GET', base(id));
      if (!script || script.script !== id) return;
      script = withLines(state); scriptEvents.emit('state', script);
      lastEventId = null;   // the stream starts with the whole state again: nothing older replays over this one
      openStream(id);
    } catch (e) {
      if (!script || script.script !== id) return;
      if (e.status === 404) gone({ code: e.code, message: e.message });
      else { backoffMs = Math.min(backoffMs * 2, 30000); reopenLater(id); }   // the service is away: try again
    }
  }, backoffMs);
}
