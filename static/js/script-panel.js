/* The Script panel: a whole script rendered into the director's session (docs/scripts.md), every line still a
 * take the studio directs.
 *   Compose: paste or open a script (plain text or JSON); the cast table (voice, direction, language per
 *   character, with a voice preview) is filled from it and sent with it; Render posts it into the page's session.
 *   Errors the service finds are shown with the script's line (or the cast's row) they name, selected.
 *   Follow: progress per line from the script's event stream (script-job.js).
 *   Direct: a line opens its take in the studio (selected in the editor; ▶ plays it). The studio's own replay and
 *   retake tools work on it; the take selected in the editor can then be accepted as the line's take. A line can
 *   also be retaken from here (new words, direction or seed, from the playhead).
 *   Export the zip (format choice). After a reload the session's scripts are listed, and the last one opened.
 * A line's take joins the page when the service has stored it: the panel asks the session again (syncSession). */
import { $, el, FRAME, fmtSec, plural } from './util.js';
import { auth } from './auth.js';
import { limits } from './service.js';
import { announce } from './status.js';
import { onMessage } from './connection.js';
import { listedVoices, voiceEvents } from './voices.js';
import { playsLocally, stopPlayback } from './playback.js';
import { takeById, takeByKey, takeEvents, takeTitle } from './takes.js';
import { cursorSample, playTake, selectTake, selectedTake, selectionEvents } from './selection.js';
import { sessionId, syncSession } from './sessions.js';
import { faultOf, jsonRange, jsonSyntaxError, lineOf, lineRange, parseJsonExact, readCast, scriptForm } from './script-text.js';
import {
  acceptTake, currentScript, deleteScript, exportZip, followScript, listScripts, postScript, retakeLine,
  scriptEvents, scriptLine, stopFollowing,
} from './script-job.js';

const OPEN_KEY = 'moss_rt.studio.scriptPanel';         // the panel open or closed
const LAST_KEY = 'moss_rt.studio.script.';             // + session id: the script last opened in it
const TEXT_KEY = 'moss_rt.studio.scriptText';          // the script in the compose form
const CAST_KEY = 'moss_rt.studio.scriptCast';          // what the director set in its cast table

let available = true;          // the service keeps sessions (else it renders no scripts)
let composing = false;         // the compose form shown while a script is open
let castRows = [];             // [{name, voice, instruction, language, declared}] as the table shows them
const castEdits = new Map();   // lower-case name -> {voice?, instruction?, language?}: what the director set
let castSignature = '';
let scripts = [];              // the session's scripts (GET /api/scripts?session=)
let listedFor = null;          // the session they were listed for
let posting = false, exporting = false, deleteArmed = null;
let openN = null;              // the line open in the detail
let wanted = null;             // {n, play, asked}: a line to open once its take joins the page (asked: a sync went since)
let pendingPlay = null;        // a take to play once its audio is loaded
let syncTimer = null, syncing = false, syncAgain = false;
const rows = new Map();        // line number -> {li, open, badge, dur, play}
const removedTakes = new Set();// ids of line takes the director deleted from the session

export const stats = { syncs: 0 };

/* ------------------------------------------------------------------ the panel open or closed */

function setOpen(open, remember = true) {
  $('scriptBody').hidden = !open;
  $('scriptToggle').setAttribute('aria-expanded', String(open));
  $('scriptToggle').textContent = open ? 'Hide' : 'Open';
  if (remember) try { localStorage.setItem(OPEN_KEY, open ? '1' : '0'); } catch (e) { /* private mode */ }
  refreshInfo();
}
const isOpen = () => !$('scriptBody').hidden;

function refreshInfo() {
  const s = currentScript();
  let text = 'Render a whole script: a cast, many lines';
  if (!available) text = 'Needs a service that keeps sessions';
  else if (s && s.lines_total) text = (s.title || 'Script') + ' · ' + (s.lines_done + s.lines_failed) + ' / ' + s.lines_total + ' lines' + (s.state === 'done' ? '' : ' · ' + s.state);
  else if (scripts.length) text = plural(scripts.length, 'script') + ' in this session';
  $('scriptInfo').textContent = text;
}

/* ------------------------------------------------------------------ compose: the text and the cast table */

const nameKey = (name) => name.toLocaleLowerCase();

function voiceOptions(chosen) {
  const voices = listedVoices();
  const opt = (v) => el('option', { value: v.id, text: v.name + (v.duration ? ' · ' + (+v.duration).toFixed(1) + ' s' : '') });
  const builtin = voices.filter((v) => v.kind === 'builtin'), uploaded = voices.filter((v) => v.kind !== 'builtin');
  const out = [el('option', { value: 'none', text: 'No reference (model voice)' })];
  if (builtin.length) out.push(el('optgroup', { label: 'Built-in' }, ...builtin.map(opt)));
  if (uploaded.length) out.push(el('optgroup', { label: 'Uploaded' }, ...uploaded.map(opt)));
  if (chosen && chosen !== 'none' && !voices.some((v) => v.id === chosen)) out.push(el('option', { value: chosen, text: chosen + ' (not listed)' }));
  return out;
}

function readText() {
  const text = $('scriptText').value;
  const { cast, cues, title } = readCast(text);
  castRows = cast.map((c) => ({ ...c, ...(castEdits.get(nameKey(c.name)) || {}) }));
  const bytes = new Blob([text]).size;
  const size = bytes < 1024 ? bytes + ' bytes' : (bytes / 1024).toFixed(1) + ' KiB';
  $('scriptCount').textContent = text.trim() ? plural(cues, 'line') + (title ? ' · ' + title : '') + ' · ' + size : '';
  const signature = JSON.stringify(castRows) + '|' + listedVoices().length;
  if (signature !== castSignature) { castSignature = signature; drawCast(); }
  refreshRender();
}

function drawCast() {
  const table = $('castTable');
  if (!castRows.length) { table.replaceChildren(el('div', { class: 'empty', text: 'The characters appear here as you write their lines.' })); return; }
  table.replaceChildren(...castRows.map(castRow));
  refreshPreview();
}

function castRow(c) {
  const key = nameKey(c.name);
  const edit = (field, value) => {
    castEdits.set(key, { ...(castEdits.get(key) || {}), [field]: value }); c[field] = value;
    row.classList.remove('invalid');
    saveDraft();
  };
  const voice = el('select', { 'aria-label': 'Voice of ' + c.name, onchange: () => { edit('voice', voice.value); refreshPreview(); } }, ...voiceOptions(c.voice));
  voice.value = c.voice || 'none';
  const listen = el('button', { type: 'button', class: 'btn small icon', 'data-listen': key, 'data-who': c.name, 'aria-label': 'Listen to the voice of ' + c.name, title: 'Listen to the voice', onclick: () => preview(voice.value, key) }, '▶');
  const dir = el('input', { type: 'text', value: c.instruction, placeholder: 'direction', 'aria-label': 'Direction of ' + c.name, oninput: () => edit('instruction', dir.value) });
  const lang = el('input', { type: 'text', value: c.language, list: 'languages', placeholder: 'language: auto', autocomplete: 'off', 'aria-label': 'Language of ' + c.name, oninput: () => edit('language', lang.value) });
  const row = el('div', { class: 'cast-row', 'data-name': key },
    el('span', { class: 'cast-name' }, c.name, c.declared ? el('small', { text: 'in the script\'s cast' }) : null), voice, listen, dir, lang);
  return row;
}

/* The script being written and its cast table stay in this browser (as the scene does). */
let saveTimer = null;
function saveDraft() {
  clearTimeout(saveTimer);
  saveTimer = setTimeout(() => {
    try {
      localStorage.setItem(TEXT_KEY, $('scriptText').value.slice(0, 1_000_000));
      localStorage.setItem(CAST_KEY, JSON.stringify([...castEdits]));
    } catch (e) { /* private mode, or full */ }
  }, 300);
}
function restoreDraft() {
  try {
    $('scriptText').value = localStorage.getItem(TEXT_KEY) || '';
    for (const [k, v] of JSON.parse(localStorage.getItem(CAST_KEY) || '[]')) if (typeof k === 'string' && v && typeof v === 'object') castEdits.set(k, v);
  } catch (e) { /* private mode, or a damaged entry: start empty */ }
}

/* The voice preview: one player for the whole table, as the scene's voice picker has. */
let previewing = null;
function preview(id, key) {
  const a = $('castPreview');
  if (!a.paused && previewing === key) { a.pause(); return; }
  if (!id || id === 'none') { showError({ code: 'voice', message: 'That character speaks with the model\'s own voice: there is no reference to listen to.' }); return; }
  previewing = key;
  a.src = auth.query('/api/voices/' + encodeURIComponent(id) + '/audio');
  a.play().catch((e) => showError({ code: 'voice', message: 'Could not play the voice: ' + e.message }));
}
function refreshPreview() {
  const a = $('castPreview');
  for (const b of $('castTable').querySelectorAll('[data-listen]')) {
    const playing = !a.paused && previewing === b.dataset.listen;
    const select = b.previousElementSibling;
    b.textContent = playing ? '■' : '▶';
    b.setAttribute('aria-label', (playing ? 'Stop the voice of ' : 'Listen to the voice of ') + b.dataset.who);
    b.disabled = !playing && (!select || select.value === 'none');
  }
}

/* ------------------------------------------------------------------ errors, with the line they name */

function clearError() {
  $('scriptError').hidden = true; $('scriptError').replaceChildren();
  $('scriptText').classList.remove('invalid');
  for (const r of $('castTable').querySelectorAll('.invalid')) r.classList.remove('invalid');
}

/* Show an error; `range` [start, end) of the script's text selects the fault (its first line is quoted). */
function showError({ code, message }, range = null) {
  const box = $('scriptError');
  const parts = [el('div', null, el('span', { class: 'code', text: code || 'error' }), message)];
  if (range) {
    const text = $('scriptText').value;
    const n = lineOf(text, range[0]);
    const [s, e] = lineRange(text, n) || [range[0], range[1]];
    parts.push(el('pre', { 'aria-label': 'line ' + n + ' of the script' }, el('span', { class: 'ln', text: String(n) }), text.slice(s, e) || ' '));
    parts.push(el('div', null, el('button', { type: 'button', class: 'btn small', onclick: () => selectInText(range) }, 'Show line ' + n + ' in the script')));
    $('scriptText').classList.add('invalid');
    selectInText(range, false);
  }
  box.replaceChildren(...parts);
  box.hidden = false;
}

/* Select [start, end) of the script's text and scroll it into view. */
function selectInText([start, end], focus = true) {
  const ta = $('scriptText');
  if (focus) ta.focus({ preventScroll: true });
  ta.setSelectionRange(start, end);
  const lh = parseFloat(getComputedStyle(ta).lineHeight) || 18;
  ta.scrollTop = Math.max(0, (lineOf(ta.value, start) - 3) * lh);
}

/* An error the service gave the post: point at what it names. */
function showServiceError(e, text, form) {
  const fault = faultOf(e.message || '');
  if (fault && fault.kind === 'line' && form === 'text') {
    const r = lineRange(text, fault.line);
    if (r) { showError(e, r); return; }
  }
  if (fault && (fault.kind === 'cast' || (fault.kind === 'path' && fault.path[0] === 'cast' && fault.path.length > 1))) {
    const name = fault.kind === 'cast' ? fault.name : String(fault.path[1]);
    const row = $('castTable').querySelector(`.cast-row[data-name="${CSS.escape(nameKey(name))}"]`);
    showError(e);
    if (row) { row.classList.add('invalid'); (row.querySelector(e.field === 'voice' ? 'select' : 'input') || row).focus(); }
    return;
  }
  if (fault && fault.kind === 'path' && form === 'json') {
    const r = jsonRange(text, fault.path);
    if (r) { showError(e, r); return; }
  }
  showError(e);
}

/* ------------------------------------------------------------------ render */

function refreshRender() {
  const text = $('scriptText').value.trim();
  const bound = !!sessionId();
  $('scriptRender').disabled = !available || posting || !text || !bound;
  $('scriptRender').textContent = posting ? 'Posting…' : 'Render';
  $('scriptRenderHint').textContent = !available ? '' : !bound ? 'Waiting for the session…'
    : castRows.length ? 'Renders every line into this session: each becomes a take.' : '';
}

async function render() {
  clearError();
  const text = $('scriptText').value, form = scriptForm(text), session = sessionId();
  if (!text.trim() || !session) return;
  const cast = {};
  for (const row of castRows) {    // what the director set last wins (a row may have been redrawn since)
    const c = { ...row, ...(castEdits.get(nameKey(row.name)) || {}) };
    cast[c.name] = { voice: c.voice || 'none', instruction: c.instruction || '', language: c.language || '' };
  }
  let body;
  if (form === 'json') {
    const bad = jsonSyntaxError(text);
    if (bad) { showError({ code: 'bad_json', message: `line ${bad.line}, column ${bad.column}: ${bad.message}` }, [bad.offset, Math.min(text.length, bad.offset + 1)]); return; }
    const obj = parseJsonExact(text);   // a line's 64-bit seed stays exact
    if (!obj || typeof obj !== 'object' || Array.isArray(obj)) { showError({ code: 'invalid_field', message: 'a JSON script is an object: {"cast": {…}, "lines": […]}' }); return; }
    delete obj.session;
    body = { ...obj, cast, session };
  } else body = { script: text, cast, session };
  const max = limits().max_script_bytes;
  const size = new Blob([JSON.stringify(body)]).size;
  if (max && size > max) { showError({ code: 'too_large', message: `the script is ${(size / 1024).toFixed(0)} KiB; the service takes at most ${(max / 1024).toFixed(0)} KiB (max_script_bytes)` }); return; }
  posting = true; refreshRender();
  try {
    const posted = await postScript(body);
    composing = false;
    rememberLast(posted.session, posted.script);
    followScript(posted.script);
    announce('Rendering ' + plural(posted.lines, 'line') + '.');
    loadList(false);
  } catch (e) {
    showServiceError(e, text, form);
  } finally {
    posting = false; refreshRender(); refreshViews();
  }
}

/* ------------------------------------------------------------------ the session's scripts */

function rememberLast(session, id) { try { localStorage.setItem(LAST_KEY + session, id); } catch (e) { /* private mode */ } }
function lastOpened(session) { try { return localStorage.getItem(LAST_KEY + session); } catch (e) { return null; } }

async function loadList(autoOpen) {
  const session = sessionId();
  if (!session || !available) return;
  try { scripts = await listScripts(session); } catch (e) { scripts = []; if (e.status !== 404) showJobError('The session\'s scripts could not be listed: ' + e.message); }
  if (session !== sessionId()) return;
  const s = currentScript();
  if (autoOpen && !s && scripts.length) {
    const last = lastOpened(session);
    const pick = scripts.find((x) => x.script === last) || scripts[scripts.length - 1];
    followScript(pick.script);
  }
  drawList();
  refreshViews();
}

function drawList() {
  const sel = $('scriptList'), s = currentScript();
  const label = (x) => (x.title || 'Untitled') + ' · ' + plural(x.lines_total, 'line') + ' · ' + x.state
    + (x.created ? ' · ' + new Date(x.created * 1000).toLocaleString([], { dateStyle: 'short', timeStyle: 'short' }) : '');
  const opts = scripts.map((x) => el('option', { value: x.script, text: label(x) }));
  if (!s) opts.unshift(el('option', { value: '', text: 'Choose a script…' }));
  sel.replaceChildren(...opts);
  sel.value = s ? s.script : '';
  $('scriptPick').hidden = !scripts.length;
}

/* ------------------------------------------------------------------ following: progress, lines */

function refreshViews() {
  const s = currentScript();
  $('scriptJob').hidden = !s;
  $('scriptCompose').hidden = !available || (!!s && !composing);
  $('scriptNew').setAttribute('aria-expanded', String(!$('scriptCompose').hidden));
  $('scriptNew').textContent = s && composing ? 'Hide the new script' : 'New script…';
  $('scriptOff').hidden = available;
  refreshInfo();
}

function drawScript(s) {
  $('scriptTitle').textContent = s.title || 'Untitled script';
  rows.clear();
  $('scriptLines').replaceChildren(...s.lines.filter(Boolean).map(lineRow));
  if (openN != null && !s.lines[openN - 1]) openN = null;
  drawProgress(s);
  drawDetail();
  markOpenRow();
}

function lineStatus(line) {
  if (line.status === 'done' && line.take && removedTakes.has(line.take)) return 'gone';
  return line.status;
}
const STATUS_TEXT = { pending: 'waiting', rendering: 'rendering', done: 'done', failed: 'failed', gone: 'take deleted' };

function lineRow(line) {
  const n = line.line;
  const badge = el('span', { class: 'badge' });
  const dur = el('span', { class: 'dur num' });
  // Its name is what it shows ("Line 3 KEEPER The words… done 2.56 s"): the spaces between the grid's items are
  // for screen readers (whitespace between grid items takes no room).
  const open = el('button', { type: 'button', class: 'sline-open', onclick: () => openLine(n) },
    el('span', { class: 'n num' }, el('span', { class: 'sr-only', text: 'Line ' }), String(n)), ' ',
    el('span', { class: 'who', text: line.who }), ' ', el('span', { class: 'txt', text: line.text }), ' ', badge, ' ', dur);
  const play = el('button', { type: 'button', class: 'btn small icon', onclick: () => togglePlay(n) }, '▶');
  const li = el('li', { class: 'sline', 'data-line': String(n) }, open, play);
  const r = { li, open, badge, dur, play, take: null, playing: null, disabled: null };
  rows.set(n, r);
  fillRow(r, line);
  return li;
}

function fillRow(r, line) {
  const status = lineStatus(line);
  r.take = line.take;
  r.badge.className = 'badge ' + status; r.badge.textContent = STATUS_TEXT[status] || status;
  r.dur.textContent = line.duration_sec != null && status === 'done' ? line.duration_sec.toFixed(2) + ' s' : '';
  r.li.querySelector('.txt').textContent = line.text;
  r.open.title = line.error ? 'Failed: ' + line.error : line.instruction ? 'Direction: ' + line.instruction : '';
  refreshPlayButton(r, line);
}

function refreshPlayButton(r, line) {
  const t = line.take ? takeById(line.take) : null;
  const playing = !!(t && playsLocally(t));
  const disabled = !playing && !(line.take && !removedTakes.has(line.take));
  if (r.playing === playing && r.disabled === disabled) return;   // called on every refresh: touch the DOM only on a change
  r.playing = playing; r.disabled = disabled;
  r.play.textContent = playing ? '■' : '▶';
  r.play.setAttribute('aria-label', (playing ? 'Stop line ' : 'Play line ') + line.line);
  r.play.disabled = disabled;
}

function drawProgress(s) {
  const total = s.lines_total || s.lines.length || 0, finished = (s.lines_done || 0) + (s.lines_failed || 0);
  const bar = $('scriptProgress');
  bar.setAttribute('aria-valuemax', String(total)); bar.setAttribute('aria-valuenow', String(finished));
  bar.setAttribute('aria-valuetext', `${finished} of ${total} lines rendered`);
  bar.classList.toggle('failed', !!s.lines_failed);
  $('scriptBar').style.width = (total ? (100 * finished / total) : 0).toFixed(1) + '%';
  const parts = [`${s.lines_done || 0} of ${plural(total, 'line')} done`];
  if (s.lines_rendering) parts.push(s.lines_rendering + ' rendering');
  if (s.lines_pending) parts.push(s.lines_pending + ' waiting');
  if (s.lines_failed) parts.push(s.lines_failed + ' failed');
  if (s.audio_sec) parts.push(s.audio_sec.toFixed(1) + ' s of audio');
  $('scriptCounts').textContent = parts.join(' · ');
  const state = s.error ? 'failed' : s.state;
  $('scriptState').className = 'badge ' + state; $('scriptState').textContent = state;
  const deleted = s.lines.some((l) => l && lineStatus(l) === 'gone');
  $('scriptExport').disabled = exporting || s.state !== 'done' || !!s.error || deleted;
  $('scriptExport').title = deleted ? 'A line\'s take was deleted: retake that line, or accept another take for it' : s.state !== 'done' ? 'Once every line is rendered' : 'Every line, the mix, cue sheets and captions';
  refreshInfo();
}

function showJobError(message) { $('scriptJobError').textContent = message; $('scriptJobError').hidden = !message; }

/* ------------------------------------------------------------------ a line's take in the studio */

/* Open line n: its take selected in the editor (asked from the session first when the page does not hold it). */
function openLine(n, { play = false } = {}) {
  openN = n;
  drawDetail(); markOpenRow();
  const line = scriptLine(n);
  if (!line || !line.take || removedTakes.has(line.take)) return;    // no take yet (a line retaken keeps its old one meanwhile)
  const t = takeById(line.take);
  if (!t) { wanted = { n, play, asked: false }; requestSync(0); return; }
  wanted = null;
  if (selectedTake() !== t) selectTake(t, 0);
  if (play) playWhenLoaded(t);
}

function togglePlay(n) {
  const line = scriptLine(n);
  const t = line && line.take ? takeById(line.take) : null;
  if (t && playsLocally(t)) { stopPlayback(); return; }
  openLine(n, { play: true });
}

function playWhenLoaded(t) {
  if (t.pcm && t.pcm.complete && t.pcm.length) { pendingPlay = null; playTake(t, selectedTake() === t ? cursorSample() : 0); }
  else pendingPlay = t;
}

/* Bring line n into view inside the list (never scrolling the page: the director may be in the editor). */
function scrollToRow(n) {
  const r = rows.get(n), list = $('scriptLines'); if (!r) return;
  const top = r.li.offsetTop, bottom = top + r.li.offsetHeight;
  if (top < list.scrollTop) list.scrollTop = top;
  else if (bottom > list.scrollTop + list.clientHeight) list.scrollTop = bottom - list.clientHeight;
}

function markOpenRow() {
  for (const [n, r] of rows) { if (n === openN) r.li.setAttribute('aria-current', 'true'); else r.li.removeAttribute('aria-current'); }
}

/* The line whose take `t` is, or null. */
function lineOfTake(t) {
  const s = currentScript(); if (!s || !t || !t.id) return null;
  const line = s.lines.find((l) => l && l.take === t.id);
  return line ? line.line : null;
}

/* Whether take t was made from take `id` (a retake of it, or of one of its retakes). */
function descendsFrom(t, id) {
  for (let p = t, hops = 0; p && hops < 64; hops++) {
    const parent = p.parent ? takeByKey(p.parent) : null;
    if (parent && parent.id === id) return true;
    p = parent;
  }
  return false;
}

/* Ask the session for takes stored since (the lines done): at most one ask at a time, and during a render at most
 * about one a second (each answer lists every take of the session). */
function requestSync(delay = 1000) {
  if (syncTimer) return;
  syncTimer = setTimeout(() => {
    syncTimer = null;
    if (syncing) { syncAgain = true; return; }
    if (syncSession()) { syncing = true; stats.syncs++; if (wanted) wanted.asked = true; }
  }, delay);
}

function missingTake(line) { return !!(line && line.take && !takeById(line.take) && !removedTakes.has(line.take)); }

/* ------------------------------------------------------------------ the open line: its take, accept, retake */

let detail = null;   // the detail's parts (built once)

function buildDetail() {
  const head = el('div', { class: 'row wrap' });
  const text = el('div', { class: 'ld-text' });
  const dir = el('div', { class: 'ld-dir' });
  const take = el('div', { class: 'row wrap ld-take' });
  const accept = el('div', { class: 'ld-accept', 'aria-live': 'polite' });
  const note = el('div', { class: 'note err', role: 'alert', hidden: true });
  const rtText = el('textarea', { id: 'slText', 'aria-label': 'Words of the retake' });
  const rtDir = el('textarea', { id: 'slInstruction', spellcheck: 'false', 'aria-label': 'Direction of the retake' });
  const rtSeed = el('input', { type: 'text', inputmode: 'numeric', id: 'slSeed', class: 'num', placeholder: 'new random', 'aria-label': 'Seed of the retake' });
  const rtFrom = el('input', { type: 'checkbox', id: 'slFromPlayhead' });
  const rtFromLabel = el('span', { text: 'keep the take up to the playhead' });
  const rtGo = el('button', { type: 'button', class: 'btn small cue', onclick: retakeOpen }, 'Retake line');
  const form = el('div', { class: 'ld-retake', id: 'slRetake', hidden: true },
    el('div', null, el('label', { class: 'lbl', for: 'slText', text: 'Words' }), rtText),
    el('div', null, el('label', { class: 'lbl', for: 'slInstruction', text: 'Direction (the whole instruction)' }), rtDir),
    el('div', { class: 'row wrap full' }, el('label', { class: 'lbl', for: 'slSeed', text: 'Seed' }), rtSeed,
      el('label', { class: 'inline' }, rtFrom, rtFromLabel), el('span', { class: 'spacer' }), rtGo));
  const formBtn = el('button', { type: 'button', class: 'btn small', 'aria-expanded': 'false', 'aria-controls': 'slRetake',
    onclick: () => { form.hidden = !form.hidden; formBtn.setAttribute('aria-expanded', String(!form.hidden)); refreshDetail(); } }, 'Retake this line…');
  $('lineDetail').replaceChildren(head, text, dir, take, accept, el('div', { class: 'row wrap' }, formBtn), form, note);
  detail = { head, text, dir, take, accept, note, rtText, rtDir, rtSeed, rtFrom, rtFromLabel, rtGo, form, formBtn, filledFor: null };
}

function drawDetail() {
  const line = openN != null ? scriptLine(openN) : null;
  $('lineDetail').hidden = !line;
  if (!line) return;
  if (!detail) buildDetail();
  const d = detail, status = lineStatus(line);
  d.head.replaceChildren(el('b', { text: `Line ${line.line} · ${line.who}` }), el('span', { class: 'badge ' + status, text: STATUS_TEXT[status] || status }),
    el('span', { class: 'faint', text: line.seed != null ? 'seed ' + line.seed : '' }));
  d.text.textContent = line.text;
  d.dir.textContent = line.instruction ? 'Direction: ' + line.instruction : 'No direction';
  const key = line.line + '|' + line.take + '|' + line.text + '|' + line.instruction;
  if (d.filledFor !== key) {      // a new line or a new take: the retake form starts from it
    d.filledFor = key;
    d.rtText.value = line.text; d.rtDir.value = line.instruction || ''; d.rtSeed.value = '';
    d.note.hidden = true;
  }
  if (line.error) { d.note.textContent = (line.status === 'failed' ? 'Failed: ' : 'The last retake failed: ') + line.error; d.note.hidden = false; }
  refreshDetail();
}

/* Replace a part's children only when what it says changed (refreshes are frequent; a rebuilt button loses focus). */
function setPart(node, signature, build) {
  if (node.dataset.sig === signature) return;
  node.dataset.sig = signature;
  node.replaceChildren(...build());
}

/* The parts of the detail that follow the editor (the selected take, the playhead) and playback. */
function refreshDetail() {
  const line = openN != null ? scriptLine(openN) : null;
  if (!line || !detail) return;
  const d = detail;
  const t = line.take ? takeById(line.take) : null;
  // Its take.
  const gone = line.take && removedTakes.has(line.take);
  const shown = !!t && selectedTake() === t, playing = !!t && playsLocally(t);
  setPart(d.take, [line.line, line.take, line.status, gone, !!t, shown, playing, t && takeTitle(t)].join('|'), () => {
    if (gone) return [el('span', { text: 'Its take was deleted from the session: retake the line, or accept another take for it.' })];
    if (!line.take) return [el('span', { class: 'faint', text: line.status === 'failed' ? 'No take: retake the line.' : 'Its take comes when it is rendered.' })];
    if (!t) return [el('span', { class: 'faint', text: 'Fetching its take from the session…' })];
    return [el('span', { text: 'Its take: ' + takeTitle(t) + (line.duration_sec != null ? ' · ' + line.duration_sec.toFixed(2) + ' s' : '') }),
      el('span', { class: 'spacer' }),
      el('button', { type: 'button', class: 'btn small', disabled: shown, onclick: () => openLine(line.line) }, shown ? 'In the editor' : 'Show in the editor'),
      el('button', { type: 'button', class: 'btn small', 'aria-label': (playing ? 'Stop' : 'Play') + ' the take of line ' + line.line, onclick: () => togglePlay(line.line) }, playing ? 'Stop' : 'Play')];
  });
  // Accept: the take the editor shows, when it is another one.
  const sel = selectedTake();
  if (!sel || !line.take || sel.id === line.take || line.status === 'rendering') {
    d.accept.hidden = true;
  } else {
    d.accept.hidden = false;
    const from = descendsFrom(sel, line.take) ? 'made from this line\'s take' + (sel.spliceSample ? ', from ' + fmtSec(sel.spliceSample) : '')
      : lineOfTake(sel) ? 'line ' + lineOfTake(sel) + '\'s take' : 'not made from this line';
    const why = sel.local ? 'made in this page (a comp or splice): the service does not keep it'
      : sel.status === 'streaming' || sel.status === 'pending' ? 'still being made'
      : !sel.id || sel.stored !== sessionId() ? 'not kept in this session'
      : sel.pcm && sel.pcm.ch !== 1 ? 'stereo: a line is mono' : null;
    setPart(d.accept, [line.line, sel.key, takeTitle(sel), from, why].join('|'), () => [
      el('span', { text: `In the editor: ${takeTitle(sel)} (${from}).` }),
      el('span', { class: 'spacer' }),
      why ? el('span', { class: 'hint', text: 'It cannot be the line\'s take: ' + why + '.' })
        : el('button', { type: 'button', class: 'btn small primary', onclick: () => accept(line.line, sel) }, `Accept ${sel.name} as line ${line.line}`)]);
  }
  // Retake from the playhead: only when the editor shows the line's take.
  const fromOk = !!(t && selectedTake() === t && cursorSample() > 0);
  d.rtFrom.disabled = !fromOk; if (!fromOk) d.rtFrom.checked = false;
  const label = 'keep the take up to the playhead' + (fromOk ? ' (' + fmtSec(cursorSample()) + ')' : ' (open the line, place the playhead)');
  if (d.rtFromLabel.textContent !== label) d.rtFromLabel.textContent = label;
}

async function accept(n, take) {
  detail.note.hidden = true;
  try {
    const line = await acceptTake(n, take.id);
    announce(take.name + ' is now line ' + n + '\'s take.');
    if (line) drawDetail();
  } catch (e) { detail.note.textContent = 'Not accepted: ' + e.message; detail.note.hidden = false; }
}

async function retakeOpen() {
  const line = scriptLine(openN); if (!line) return;
  const d = detail, fields = {};
  const words = d.rtText.value.trim(), dir = d.rtDir.value.trim(), seed = d.rtSeed.value.trim();
  if (!words) { d.note.textContent = 'A line needs words.'; d.note.hidden = false; return; }
  if (words !== line.text) fields.text = words;
  if (dir !== (line.instruction || '')) fields.instruction = dir;
  if (seed) {
    if (!/^\d+$/.test(seed)) { d.note.textContent = 'A seed is a whole number (or empty for a new random one).'; d.note.hidden = false; return; }
    fields.seed = seed;   // the digits: sent as the exact number (script-job.js)
  }
  if (d.rtFrom.checked && !d.rtFrom.disabled) fields.frame = Math.floor(cursorSample() / FRAME);
  d.note.hidden = true; d.rtGo.disabled = true;
  try {
    await retakeLine(line.line, fields);
    announce('Retaking line ' + line.line + '.');
  } catch (e) { d.note.textContent = 'Not retaken: ' + e.message; d.note.hidden = false; }
  finally { d.rtGo.disabled = false; }
}

/* ------------------------------------------------------------------ export and delete */

async function exportScript() {
  const s = currentScript(); if (!s || exporting) return;
  exporting = true; showJobError('');
  const btn = $('scriptExport'); btn.disabled = true; btn.textContent = 'Exporting…';
  try {
    const { blob, name } = await exportZip($('scriptFormat').value, (n) => { btn.textContent = 'Exporting… ' + (n / 1048576).toFixed(1) + ' MB'; });
    const url = URL.createObjectURL(blob);
    const a = el('a', { href: url, download: name, hidden: true });
    document.body.append(a); a.click(); a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 60_000);
    announce('Exported ' + name + '.');
  } catch (e) { showJobError('The export failed: ' + e.message); }
  finally { exporting = false; btn.textContent = 'Export zip'; if (currentScript()) drawProgress(currentScript()); }
}

async function removeScript() {
  const s = currentScript(); if (!s) return;
  const btn = $('scriptDelete');
  if (deleteArmed !== s.script) {          // a second click confirms (the takes stay in the session)
    deleteArmed = s.script; btn.textContent = 'Delete? Click again';
    setTimeout(() => { if (deleteArmed === s.script) { deleteArmed = null; btn.textContent = 'Delete'; } }, 4000);
    return;
  }
  deleteArmed = null; btn.textContent = 'Delete';
  try {
    await deleteScript(s.script);
    scripts = scripts.filter((x) => x.script !== s.script);
    openN = null; composing = false;
    announce('The script was deleted; its takes stay in the session.');
    drawList(); refreshViews();
  } catch (e) { showJobError('Not deleted: ' + e.message); }
}

/* ------------------------------------------------------------------ wiring */

/* What follows the editor and playback (registered with render.onRefresh). */
export function refreshScriptPanel() {
  const s = currentScript();
  if (!s || $('scriptBody').hidden) return;
  for (const [n, r] of rows) { const line = s.lines[n - 1]; if (line) refreshPlayButton(r, line); }
  refreshDetail();
}

function onSessionMessage(msg) {
  syncing = false;
  if (syncAgain) { syncAgain = false; requestSync(); }
  const s = currentScript();
  if (s && s.session && s.session !== msg.session) { stopFollowing(); openN = null; rows.clear(); }
  if (listedFor !== msg.session) { listedFor = msg.session; scripts = []; loadList(true); }
  if (wanted) {
    const w = wanted, line = scriptLine(w.n);
    if (line && takeById(line.take)) openLine(w.n, { play: w.play });
    else if (line && missingTake(line) && w.asked && !syncing) {   // asked, and the session does not have it
      wanted = null; removedTakes.add(line.take); drawScript(currentScript());
    }
  }
  refreshRender(); refreshViews(); refreshScriptPanel();
}

export function initScriptPanel() {
  let open = null;
  try { open = localStorage.getItem(OPEN_KEY); } catch (e) { /* private mode */ }
  setOpen(open === '1', false);
  $('scriptToggle').addEventListener('click', () => setOpen(!isOpen()));
  restoreDraft();
  let typing = null;
  $('scriptText').addEventListener('input', () => {
    $('scriptText').classList.remove('invalid');
    clearTimeout(typing);
    typing = setTimeout(() => { readText(); saveDraft(); }, 200);
  });
  $('scriptOpenFile').addEventListener('click', () => $('scriptFile').click());
  $('scriptFile').addEventListener('change', async () => {
    const f = $('scriptFile').files[0]; if (!f) return;
    $('scriptFile').value = '';
    const max = limits().max_script_bytes;
    if (max && f.size > max) { showError({ code: 'too_large', message: `${f.name} is ${(f.size / 1024).toFixed(0)} KiB; a script is at most ${(max / 1024).toFixed(0)} KiB` }); return; }
    try { $('scriptText').value = await f.text(); } catch (e) { showError({ code: 'file', message: f.name + ' could not be read: ' + e.message }); return; }
    clearError(); readText(); saveDraft();
  });
  $('scriptRender').addEventListener('click', render);
  $('scriptNew').addEventListener('click', () => { composing = !composing || !currentScript(); refreshViews(); if (!$('scriptCompose').hidden) $('scriptText').focus(); });
  $('scriptList').addEventListener('change', () => {
    const id = $('scriptList').value; if (!id) return;
    openN = null; composing = false; showJobError('');
    rememberLast(sessionId(), id);
    followScript(id);
    drawList(); refreshViews();
  });
  $('scriptExport').addEventListener('click', exportScript);
  $('scriptDelete').addEventListener('click', removeScript);
  $('castPreview').addEventListener('play', refreshPreview);
  $('castPreview').addEventListener('pause', refreshPreview);
  $('castPreview').addEventListener('ended', refreshPreview);

  scriptEvents.on('state', (s) => {
    showJobError(s.error ? 'The script could not go on: ' + s.error : '');
    drawScript(s); refreshViews();
    if (s.lines.some(missingTake)) requestSync();
  });
  scriptEvents.on('line', (line, s) => {
    const r = rows.get(line.line), before = r ? r.take : null;
    if (r) fillRow(r, line); else drawScript(s);
    if (line.line === openN) drawDetail();
    // A new take for the line while the editor shows its old one (a retake from here): show the new one.
    const sel = selectedTake();
    if (line.take && before && line.take !== before && sel && sel.id === before) openLine(line.line);
    else if (missingTake(line)) requestSync();
  });
  scriptEvents.on('progress', drawProgress);
  scriptEvents.on('done', (s) => {
    drawProgress(s);
    const x = scripts.find((y) => y.script === s.script); if (x) { Object.assign(x, { state: s.state, lines_total: s.lines_total }); drawList(); }
    if (s.lines.some(missingTake)) requestSync(0);
    announce((s.title || 'The script') + ': ' + plural(s.lines_done, 'line') + ' done' + (s.lines_failed ? ', ' + s.lines_failed + ' failed' : '') + '.');
  });
  scriptEvents.on('gone', (what) => {     // deleted (here, in another tab, or with its session)
    stopFollowing(); openN = null; rows.clear(); composing = false;
    showError({ code: what.code, message: what.message });
    loadList(false);
  });
  onMessage('session', onSessionMessage);          // after sessions.js adopted the takes it lists
  onMessage('hello', (msg) => { available = !!msg.sessions; refreshRender(); refreshViews(); });
  voiceEvents.on('listed', () => { castSignature = ''; readText(); });
  selectionEvents.on('select', ({ take }) => {
    const n = lineOfTake(take);
    if (n != null && n !== openN) { openN = n; drawDetail(); markOpenRow(); scrollToRow(n); }
    else refreshDetail();
  });
  takeEvents.on('updated', (t) => {
    if (pendingPlay === t && t.pcm && t.pcm.complete) playWhenLoaded(t);
    if (openN != null) refreshDetail();
  });
  takeEvents.on('removed', (t) => {
    const s = currentScript();
    if (t.id && s && s.lines.some((l) => l && l.take === t.id)) { removedTakes.add(t.id); drawScript(s); }
  });
  readText();
  refreshViews();
}
