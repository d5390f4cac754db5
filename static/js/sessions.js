/* The directing session the service keeps on disk: its takes (codes, parameters, seeds), the director's notes and
 * the audio as heard. The page binds each connection to it with `resume` (its id is kept in this browser, or given
 * as ?session= in the address), so a reload, a reconnect or a server restart brings every take back, playable and
 * retakeable. Notes and deletions go over plain HTTP (/api/sessions/...). The session numbers its takes (once, for
 * good: `stored` says a new take's number). Comps and region splices are made by the service from the stored
 * takes (createEdit) and kept like any take; without a session they are made here from held audio and not kept
 * (main.js asks before the page is closed with one).
 * A delete the director made (deletes.js: Undo for a few seconds first) is kept in this browser until the service
 * confirms it: sent as the page goes when it is closed within the Undo time, and completed on the next visit of
 * the session if that request was lost, so a delete is never lost silently. */
import { $, SR, FRAME, plural, takeTitle } from './util.js';
import { createEmitter } from './events.js';
import { PcmStore, parseWav } from './pcm.js';
import { auth, apiFetch } from './auth.js';
import { conn, onMessage } from './connection.js';
import { showAlert, announce } from './status.js';
import { voiceName } from './voices.js';
import { addTake, holds, holdAtLeast, newTake, numberFromSession, setTakeId, setTakeNumber, takeById, takeEvents, takeUpdated } from './takes.js';
import { cursorSample, selectTake, selectedTake } from './selection.js';
import * as render from './render.js';

const SESSION_KEY = 'moss_rt.studio.session';
const PENDING_DELETES = 'moss_rt.studio.pending_deletes';   // [{session, take, name}]: deletes not yet confirmed

/* 'resumed' (n): n takes came back from the session; 'synced' (n): n takes stored since (syncSession) joined. */
export const sessionEvents = createEmitter();
export const stats = { notesSaved: 0 };

let id = null;       // the session this page is bound to
let max = null;      // its quota of takes
const dirty = new Set();
let timer = null;
let syncs = 0;       // resumes sent by syncSession not answered yet: their answers are no resume to announce

export function sessionId() { return id; }
/* The session in a file name ("moss_rt-Vb2x0Zq1"): downloads of its takes and its archive start with it. */
export function sessionFileStem() { return id ? 'moss_rt-' + id.replace(/^s_/, '').slice(0, 8) : 'moss_rt'; }

/* Bind the connection to the session (the kept one, or a new one). */
export function resumeSession() { const sid = id || initialId(); conn.send(sid ? { type: 'resume', session: sid } : { type: 'resume' }); }

/* Ask the service again for the session's takes, so those stored since by something else than this connection (a
 * script render's lines, docs/scripts.md) join the page like any other: playable, retakeable. Quietly: the answer
 * is 'synced', not 'resumed'. False when there is no session or connection to ask on. */
export function syncSession() {
  if (!id || !conn.ready || !conn.send({ type: 'resume', session: id })) return false;
  syncs++;
  return true;
}

/* The service's answer to resume was an error about the session. */
export function sessionLost(msg) {
  if (msg.code !== 'not_found') { showAlert(msg.code || 'session', msg.message || 'The session could not be resumed.'); return; }
  try { localStorage.removeItem(SESSION_KEY); } catch (e) { /* private mode */ }
  id = null;
  if (conn.ready) conn.send({ type: 'resume' });       // a new session
  showAlert('session', 'That session is not kept by this service (deleted, or another data dir); a new one was started.', { info: true });
}

function initialId() { return new URLSearchParams(location.search).get('session') || localStorage.getItem(SESSION_KEY); }
function path(p) { return '/api/sessions/' + encodeURIComponent(id) + p; }

function saveNotes(t) {
  if (!t.stored || t.stored !== id) return;
  dirty.add(t); clearTimeout(timer); timer = setTimeout(flushNotes, 300);
}
async function flushNotes() {
  const items = [...dirty]; dirty.clear();
  for (const t of items) {
    if (!holds(t)) continue;
    const body = { title: t.title || '', starred: !!t.starred, note: t.note || '', markers: (t.markers || []).map((m) => ({ sample: m.sample, label: m.label })) };
    try {
      const r = await apiFetch(path('/takes/' + encodeURIComponent(t.id)), { method: 'PATCH', headers: { 'Content-Type': 'application/json' }, body: JSON.stringify(body) });
      if (!r.ok) { const b = await r.json().catch(() => null); throw new Error((b && b.error && b.error.message) || 'HTTP ' + r.status); }
      stats.notesSaved++;
    } catch (e) { showAlert('session', 'The notes of ' + takeTitle(t) + ' were not saved: ' + e.message); }
  }
}
/* A take removed from the page leaves the session too (deleted, or junk the director never heard). */
async function forget(t, retry = true) {
  if (!t.stored || t.stored !== id || !t.id) return;
  try {
    const r = await apiFetch(path('/takes/' + encodeURIComponent(t.id)), { method: 'DELETE' });
    if (r.status === 404 && retry) { setTimeout(() => forget(t, false), 1000); return; }   // not stored yet
    if (!r.ok && !(r.status === 404 && pendingDeletes().some((d) => d.take === t.id))) throw new Error('HTTP ' + r.status);
    forgetDelete(t);                  // confirmed (a 404 for a delete already made before: gone all the same)
  } catch (e) { showAlert('session', takeTitle(t) + ' could not be deleted from the session: ' + e.message); }
}

/* ------------------------------------------------------------------ deletes kept until confirmed */

function pendingDeletes() { try { return JSON.parse(localStorage.getItem(PENDING_DELETES) || '[]') || []; } catch (e) { return []; } }
function savePendingDeletes(list) { try { localStorage.setItem(PENDING_DELETES, JSON.stringify(list.slice(-200))); } catch (e) { /* private mode */ } }
/* A stored take the director deleted, while the page may go (hidden, or closing): kept in this browser until the
 * service confirms the delete. */
export function rememberDelete(t) {
  if (!t.stored || t.stored !== id || !t.id) return;
  savePendingDeletes([...pendingDeletes().filter((d) => d.take !== t.id), { session: id, take: t.id, name: takeTitle(t) }]);
}
/* Undone, or confirmed by the service. */
export function forgetDelete(t) { if (t.id) savePendingDeletes(pendingDeletes().filter((d) => d.take !== t.id)); }
/* The page is going with deletes still in their Undo time: send them now, as requests that outlive the page. The
 * entries stay in this browser; the next visit drops them (gone) or completes them (the request was lost). */
export function deleteOnUnload(list) {
  for (const t of list) {
    if (!t.stored || t.stored !== id || !t.id) continue;
    try { fetch(path('/takes/' + encodeURIComponent(t.id)), { method: 'DELETE', keepalive: true, headers: auth.headers() }); } catch (e) { /* the next visit completes it */ }
  }
}
/* Deletes of this session that the service never confirmed: made now, and the director told. The records of those
 * takes are left out of the page. */
function completeDeletes(records) {
  // Not those this page still offers to undo (a reconnect or a sync while it is hidden).
  const mine = pendingDeletes().filter((d) => d.session === id && !(takeById(d.take) && takeById(d.take).deleting));
  if (!mine.length) return records;
  const held = new Set(records.map((r) => r.take_id));
  const todo = mine.filter((d) => held.has(d.take));
  savePendingDeletes(pendingDeletes().filter((d) => d.session !== id || held.has(d.take)));   // the rest are gone
  for (const d of todo) {
    apiFetch(path('/takes/' + encodeURIComponent(d.take)), { method: 'DELETE' }).then((r) => {
      if (r.ok || r.status === 404) savePendingDeletes(pendingDeletes().filter((x) => x.take !== d.take));
    }).catch(() => { /* kept: tried again on the next visit */ });
  }
  if (todo.length) {
    const names = todo.map((d) => d.name).join(', ');
    showAlert('session', 'Deleted now: ' + names + ' (deleted just before the page was closed).', { info: true });
    announce(plural(todo.length, 'take') + ' deleted as you asked before the page was closed.');
  }
  const gone = new Set(todo.map((d) => d.take));
  return records.filter((r) => !gone.has(r.take_id));
}

function onSession(msg) {
  id = msg.session; max = msg.max_takes || null;
  holdAtLeast(max);
  numberFromSession(msg.next_number);
  try { localStorage.setItem(SESSION_KEY, msg.session); } catch (e) { /* private mode */ }
  const records = completeDeletes(msg.takes || []);
  const fresh = records.filter((rec) => !takeById(rec.take_id)).length;
  for (const rec of records) adoptStoredTake(rec);
  refreshSessionUi(); render.refresh(); render.drawAll();
  if (syncs > 0 && msg.session === id && msg.resumed) { syncs--; sessionEvents.emit('synced', fresh); }
  else if (msg.resumed && fresh) {
    announce(plural(fresh, 'take') + ' back from the session.');
    sessionEvents.emit('resumed', fresh);
  }
}

/* The service stored a take of this connection in the session as Take `number`. */
function onStored(msg) {
  const t = takeById(msg.take);
  if (!t || (msg.session && msg.session !== id)) return;
  if (id) t.stored = id;
  setTakeNumber(t, msg.number);
}

function adoptStoredTake(rec) {
  const known = takeById(rec.take_id);
  if (known) {
    const changed = known.conn !== conn.serial || known.dropped || known.stored !== id;   // a sync re-lists them all
    known.conn = conn.serial; known.dropped = false; known.stored = id;
    if (rec.number) setTakeNumber(known, rec.number);
    if (changed) takeUpdated(known);
    return known;
  }
  const req = { ...(rec.request || {}) }; delete req.type; delete req.take;
  req.referenceName = voiceName(req.reference);
  const t = newTake({ req });
  setTakeId(t, rec.take_id);
  t.seed = String(rec.seed); t.status = rec.reason || 'done';
  t.end = { type: 'end', take: rec.take_id, reason: rec.reason, n_frames: rec.n_frames, ...(rec.stats || {}) };
  const parent = rec.parent && takeById(rec.parent);
  if (parent) t.parent = parent.key;
  t.spliceFrame = rec.branch_frame || 0; t.spliceSample = t.spliceFrame * FRAME; t.isRetake = !!rec.parent;
  t.title = rec.title || ''; t.starred = !!rec.starred; t.note = rec.note || ''; t.markers = rec.markers || [];
  t.created = new Date((rec.created || Date.now() / 1000) * 1000);
  t.conn = conn.serial; t.stored = id;
  if (rec.number) { t.n = rec.number; t.name = 'Take ' + rec.number; t.numbered = true; }
  if (rec.kind && rec.kind !== 'take') adoptEdit(t, rec);
  t.pcm = new PcmStore(rec.channels || 1, 1);
  addTake(t);
  if (!selectedTake()) selectTake(t, 0);
  loadStoredAudio(t);
  return t;
}

/* A splice or comp: where its audio came from, and its joins (drawn on the waveform). */
function adoptEdit(t, rec) {
  t.kind = rec.kind; t.hasCodes = rec.has_codes !== false; t.crossfade = rec.crossfade || 0;
  t.parts = (rec.parts || []).map((p) => ({ take: p.take, number: p.number, from: p.from, to: p.to }));
  t.isRetake = false; t.spliceFrame = 0; t.spliceSample = 0;
  const kind = t.crossfade ? 'crossfade ' + Math.round(t.crossfade / SR * 1000) + ' ms' : rec.kind === 'comp' ? 'comp join' : 'join';
  let at = 0;
  t.splices = [];
  t.parts.forEach((p, i) => { if (i) t.splices.push({ sample: at, kind }); at += p.to - p.from; });
}

/* A splice or comp made by the service from stored takes of this session (POST /api/sessions/{id}/takes):
 * `parts` [{take (a take record), from, to}] in samples, whole frames. Resolves to the new take (its audio loaded
 * from the service, playable, retakeable when it is whole frames of codes); throws with the service's reason. */
export async function createEdit(kind, parts, { crossfade = 0, title = '' } = {}) {
  if (!id) throw new Error('this service keeps no session');
  const unstored = parts.find((p) => !p.take.id || p.take.stored !== id);
  if (unstored) throw new Error(takeTitle(unstored.take) + ' is not kept in the session yet');
  const body = { kind, parts: parts.map((p) => ({ take: p.take.id, from: p.from, to: p.to })), crossfade };
  if (title) body.title = title;
  const r = await apiFetch(path('/takes'), { method: 'POST', headers: { 'Content-Type': 'application/json' }, body: JSON.stringify(body) });
  const rec = await r.json().catch(() => null);
  if (!r.ok) throw new Error((rec && rec.error && rec.error.message) || 'HTTP ' + r.status);
  const t = adoptStoredTake(rec);
  syncSession();                 // the connection takes it up too: replay and retake work on it
  return t;
}

async function loadStoredAudio(t) {
  try {
    const r = await apiFetch(path('/takes/' + encodeURIComponent(t.id) + '.wav'), { cache: 'no-store' });
    if (!r.ok) throw new Error('HTTP ' + r.status);
    const { ch, pcm } = parseWav(await r.arrayBuffer());
    const store = new PcmStore(ch, pcm.length / ch);
    store.append(pcm); store.complete = true;
    t.pcm = store;
    if (t.end && t.end.n_frames != null && store.length !== t.end.n_frames * FRAME) t.mismatch = `holds ${store.length} samples, the session says ${t.end.n_frames} frames`;
  } catch (e) { showAlert('session', 'The audio of ' + takeTitle(t) + ' could not be loaded: ' + e.message); }
  takeUpdated(t);
  if (selectedTake() === t) selectTake(t, cursorSample());
  render.refresh(); render.scheduleDraw();
}

function refreshSessionUi() {
  const on = !!id;
  $('sessionBar').hidden = !on;
  if (!on) return;
  $('sessionExport').href = auth.query(path('/archive'));
  $('sessionExport').setAttribute('download', sessionFileStem() + '-session.zip');
  $('sessionInfo').textContent = 'Kept by the service' + (max ? ' · up to ' + max + ' takes' : '');
  $('sessionInfo').title = 'Session ' + id + ': takes stay until you delete them, across reloads and restarts.';
}

export function initSessions() {
  onMessage('session', onSession);
  onMessage('stored', onStored);
  onMessage('hello', () => { syncs = 0; });   // a new connection: syncs sent on the old one are never answered
  takeEvents.on('removed', (take) => forget(take));
  takeEvents.on('notes', saveNotes);
  $('sessionNew').addEventListener('click', () => { try { localStorage.removeItem(SESSION_KEY); } catch (e) { /* private mode */ } location.href = location.pathname; });
  $('sessionImportBtn').addEventListener('click', () => $('sessionImport').click());
  $('sessionImport').addEventListener('change', async () => {
    const f = $('sessionImport').files[0]; if (!f) return;
    try {
      const r = await apiFetch('/api/sessions/import', { method: 'POST', body: f, headers: { 'Content-Type': 'application/zip' } });
      const body = await r.json().catch(() => null);
      if (!r.ok) throw new Error((body && body.error && body.error.message) || 'HTTP ' + r.status);
      try { localStorage.setItem(SESSION_KEY, body.session); } catch (e) { /* private mode */ }
      location.href = location.pathname + '?session=' + encodeURIComponent(body.session);
    } catch (e) { showAlert('import', 'The session could not be imported: ' + e.message); }
    $('sessionImport').value = '';
  });
}
