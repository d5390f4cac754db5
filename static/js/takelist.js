/* The Takes panel: one card per take (status, seed, voice, parameters in plain words, direction, a mini waveform
 * and its actions), newest first, with the filter and search. One WAV download per take, named by the session and
 * the take's name; "as heard" and "as rendered" are offered apart only where the page's audio and the service's
 * differ. A view of takes.js: it follows takeEvents, and keeps each card in its own map (nothing of the view is
 * stored on the take). */
import { $, el, SR, FRAME, now, fmtSec, plural, fileSlug } from './util.js';
import { wavBlob } from './pcm.js';
import { apiFetch } from './auth.js';
import { serviceDefaults } from './params.js';
import { framesToSeconds, showFrames, unitEvents } from './units.js';
import { listedVoice, voiceEvents } from './voices.js';
import { sessionFileStem, sessionId } from './sessions.js';
import { showAlert } from './status.js';
import * as playback from './playback.js';
import { drawWaveform, fitCanvas } from './waveform.js';
import { allTakes, partTitle, serverHolds, takeByKey, takeEvents, takeTitle } from './takes.js';
import { cursorSample, playTake, selectTake, selectedTake, selectionEvents } from './selection.js';
import { liveTake } from './director.js';
import { compared, setAB } from './compare.js';
import { loadIntoScene } from './scene.js';
import { captionLinks, updateCaptionLinks } from './words.js';
import * as render from './render.js';

const cards = new Map();   // take -> {card, ui: {...the card's parts}, lastDraw}

/* The parameters that differ from the service's defaults, in plain words ("text temperature 0 · at most 20 s"). */
const PARAM_WORDS = {
  audio_temperature: 'audio temperature', audio_top_p: 'audio top-p', audio_top_k: 'audio top-k',
  audio_repetition_penalty: 'repetition penalty', text_temperature: 'text temperature', text_top_p: 'text top-p',
  text_top_k: 'text top-k',
};
function seconds(frames) { return framesToSeconds(frames) + ' s' + (showFrames() ? ' (' + plural(frames, 'frame') + ')' : ''); }
function paramSummary(req) {
  if (!req) return '';
  const d = serviceDefaults(), out = [];
  for (const [k, words] of Object.entries(PARAM_WORDS)) if (req[k] != null && req[k] !== d[k]) out.push(words + ' ' + req[k]);
  if (req.max_new_tokens != null && req.max_new_tokens !== d.max_new_tokens) out.push('at most ' + seconds(req.max_new_tokens));
  if (req.tokens) out.push('about ' + seconds(req.tokens) + ' long');
  if (req.chunk_frames != null && req.chunk_frames !== d.chunk_frames) out.push('sent in ' + seconds(req.chunk_frames) + ' chunks');
  if (req.channels === 2) out.push('stereo');
  if (req.stream_text) out.push('text fed as typed');
  return out.length ? out.join(' · ') : 'default sampling';
}

/* The seed as the director gave it: "seed 42 (fixed)", or "random seed 7731" (the service picked it). */
function seedLabel(t) {
  const r = t.req || {};
  if (t.seed == null) return 'seed —';
  return r.seed != null && r.seed !== '' ? 'seed ' + t.seed + ' (fixed)' : 'random seed ' + t.seed;
}
/* The voice by the name the director knows it by (never a raw ref_ id). */
function voiceLabel(r) {
  if (!r.reference || r.reference === 'none') return null;
  const v = listedVoice(r.reference);
  if (v) return 'voice ' + v.name;
  if (r.referenceName && r.referenceName !== r.reference) return 'voice ' + r.referenceName;
  return 'a voice not in your list';
}

/* The service offers its own rendering of the take (this connection holds it, or the session keeps it). */
function serviceHas(t) { return !!(t.id && !t.local && (serverHolds(t) || (t.stored && t.stored === sessionId()))); }
/* The page's audio ("as heard") is not the service's ("as rendered"): only then are both offered. */
function audioDiffers(t) {
  if (!serviceHas(t) || !t.pcm || t.status === 'streaming') return false;
  return !!t.mismatch || !!(t.end && t.end.n_frames != null && t.pcm.length !== t.end.n_frames * FRAME);
}
/* A take's WAV file name: the session, then the take's name ("moss_rt-Vb2x0Zq1-keeper-take-2.wav"). */
export function wavName(t, suffix = '') { return sessionFileStem() + '-' + fileSlug(takeTitle(t)) + suffix + '.wav'; }
function serviceWavPath(t) {
  const sid = sessionId();
  return t.stored && t.stored === sid ? '/api/sessions/' + encodeURIComponent(sid) + '/takes/' + encodeURIComponent(t.id) + '.wav'
    : '/api/takes/' + encodeURIComponent(t.id) + '.wav';
}
/* Save a blob under `name` (a download the browser names as the page says, whatever the server would call it). */
function saveAs(blob, name) {
  const a = el('a', { href: URL.createObjectURL(blob), download: name });
  document.body.append(a); a.click(); a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 30000);
}
/* The service's rendering of the take, saved under the take's name. */
async function downloadRendered(t) {
  try {
    const r = await apiFetch(serviceWavPath(t), { cache: 'no-store' });
    if (!r.ok) throw new Error('HTTP ' + r.status);
    saveAs(await r.blob(), wavName(t, '-rendered'));
  } catch (e) { showAlert('download', 'The service\'s rendering of ' + takeTitle(t) + ' could not be downloaded: ' + e.message); }
}

function buildCard(t) {
  const mini = el('canvas', { 'aria-hidden': 'true' });
  const card = el('article', { class: 'take', 'data-key': t.key, tabindex: '0', 'aria-label': takeTitle(t) });
  const nameEl = el('span', { class: 'name', text: takeTitle(t) });
  const badge = el('span', { class: 'badge' });
  const when = el('span', { class: 'faint num', style: 'font-size:11.5px' });
  const lineage = el('span', { class: 'lineage' });
  const meta = el('div', { class: 'meta' });
  const dir = el('div', { class: 'dir' });
  const noteLine = el('div', { class: 'note-line' });
  const btn = (label, title, fn, cls) => el('button', { class: 'btn small' + (cls ? ' ' + cls : ''), title, text: label, onclick: (e) => { e.stopPropagation(); fn(e); } });
  const playB = btn('Play', 'Play this take (from the playhead when it is selected)', () => {
    if (playback.playsLocally(t)) { playback.stopPlayback(); render.refresh(); return; }
    playTake(t, selectedTake() === t ? cursorSample() : 0);
  });
  const aB = btn('A', 'Compare: set as A', () => setAB('a', t));
  const bB = btn('B', 'Compare: set as B', () => setAB('b', t));
  const wavB = btn('WAV', 'Download this take as a 16-bit WAV', () => downloadTake(t));
  const srvB = btn('WAV as rendered', 'Download the service\'s rendering of this take (it differs from what this page played)', () => downloadRendered(t));
  const capLinks = captionLinks();   // SRT, VTT (words.js)
  const branchB = btn('Retake from…', 'Open in the editor: place the playhead, then Retake from here', () => {
    const wave = $('wave');
    selectTake(t, selectedTake() === t ? cursorSample() : Math.floor((t.pcm ? t.pcm.length : 0) / 2 / FRAME) * FRAME);
    wave.focus(); wave.scrollIntoView({ block: 'nearest', behavior: 'smooth' });
  });
  const loadB = btn('Use direction', 'Copy this take\'s direction, voice, parameters and seed into the scene', () => loadIntoScene(t));
  card.append(
    el('div', { class: 't1' }, nameEl, badge, when, lineage), mini,
    meta, dir, noteLine,
    el('div', { class: 'actions' }, playB, aB, bB, wavB, srvB, ...capLinks, branchB, loadB),
  );
  card.addEventListener('click', () => { if (selectedTake() !== t) selectTake(t, 0); });
  card.addEventListener('keydown', (e) => { if (e.key === 'Enter' && e.target === card) selectTake(t, 0); });
  cards.set(t, { card, ui: { noteLine, nameEl, badge, when, lineage, meta, dir, mini, playB, aB, bB, wavB, srvB, capLinks, branchB, loadB }, lastDraw: 0 });
  updateCard(t);
  return card;
}

function updateCard(t) {
  const view = cards.get(t); if (!view) return;
  const u = view.ui, card = view.card;
  u.badge.className = 'badge ' + t.status;
  u.badge.textContent = t.status === 'streaming' ? 'live' : t.kind && t.kind !== 'take' ? t.kind : t.local ? (t.comp ? 'comp' : 'splice') : t.status;
  const dur = t.pcm ? fmtSec(t.pcm.length) : '';
  u.when.textContent = t.created.toLocaleTimeString([], { hour: '2-digit', minute: '2-digit', second: '2-digit' }) + (dur ? ' · ' + dur : '');
  const parent = t.parent && takeByKey(t.parent);
  u.lineage.textContent = t.parts && t.parts.length ? '↳ ' + t.parts.map(partTitle).join(' + ')
    : parent ? '↳ from ' + takeTitle(parent) + ' @ ' + fmtSec(t.spliceSample) : '';
  const r = t.req || {};
  u.meta.textContent = [seedLabel(t), voiceLabel(r), r.language || null, paramSummary(r),
    t.end && t.end.rtf != null ? (+t.end.rtf).toFixed(1) + '× real time' : null, t.heardMs != null ? 'heard after ' + t.heardMs.toFixed(0) + ' ms' : null,
    t.underruns ? plural(t.underruns, 'underrun') : null]
    .filter(Boolean).join(' · ');
  u.meta.title = u.meta.textContent + (t.mismatch ? '\n⚠ ' + t.mismatch : '');
  u.dir.replaceChildren();
  if (r.instruction) u.dir.append(el('span', { class: 'ins', text: r.instruction.replace(/\s+/g, ' ').slice(0, 90) + ' — ' }));
  u.dir.append((r.text || '').replace(/\s+/g, ' ').slice(0, 160));
  u.dir.title = (r.instruction ? r.instruction + '\n\n' : '') + (r.text || '');
  const has = !!(t.pcm && t.pcm.length);
  u.playB.disabled = !has; u.wavB.disabled = !has; u.aB.disabled = !has; u.bB.disabled = !has;
  u.playB.textContent = playback.playsLocally(t) ? 'Stop' : 'Play';
  const nm = takeTitle(t);
  u.nameEl.replaceChildren(...(t.starred ? [el('span', { class: 'star-mark', text: '★', 'aria-label': 'starred' })] : []), nm);
  u.noteLine.textContent = t.note ? '✎ ' + t.note : ''; u.noteLine.hidden = !t.note;
  card.hidden = !takeVisible(t);
  card.setAttribute('aria-label', nm);
  u.playB.setAttribute('aria-label', u.playB.textContent + ' ' + nm);
  u.aB.setAttribute('aria-label', 'Compare ' + nm + ' as A');
  u.bB.setAttribute('aria-label', 'Compare ' + nm + ' as B');
  const differs = audioDiffers(t);
  u.wavB.textContent = differs ? 'WAV as heard' : 'WAV';
  u.wavB.title = differs ? 'Download what this page played (' + (t.mismatch || 'not what the service rendered') + ')' : 'Download this take as a 16-bit WAV';
  u.wavB.setAttribute('aria-label', 'Download ' + nm + ' as WAV' + (differs ? ', as heard' : ''));
  u.srvB.setAttribute('aria-label', 'Download ' + nm + ' as WAV, as rendered by the service');
  u.branchB.setAttribute('aria-label', 'Retake from… (' + nm + ')');   // names start with the visible text
  u.loadB.setAttribute('aria-label', 'Use direction of ' + nm);
  const a = compared('a'), b = compared('b');
  u.aB.classList.toggle('on', a === t); u.bB.classList.toggle('on', b === t); u.bB.classList.toggle('bsel', b === t);
  u.srvB.hidden = !differs;
  updateCaptionLinks(t, u.capLinks);
  u.branchB.disabled = !(has && serverHolds(t));
  drawMini(t);
}

function drawMini(t) {
  const view = cards.get(t), c = view && view.ui.mini; if (!c || !c.clientWidth) return;
  const { w, h } = fitCanvas(c), g = c.getContext('2d');
  g.clearRect(0, 0, w, h);
  if (!t.pcm || !t.pcm.length) return;
  const total = Math.max(t.pcm.length, FRAME), S0 = t.spliceSample || 0;
  const p = playback.current(), ph = p && p.take === t ? playback.playheadSample() : null, phX = ph != null ? ph / total * w : -1;
  drawWaveform(g, t, 0, w, h, total, (x, s) => (S0 && s < S0 ? (x <= phX ? '#b8975d' : '#6e6450') : (x <= phX ? '#7fd0c2' : '#4b8f86')));
  for (const sp of t.splices || []) { g.fillStyle = '#9aa5e8'; g.fillRect(Math.round(sp.sample / total * w), 0, 1, h); }
  if (S0) { g.fillStyle = '#d8a657'; g.fillRect(Math.round(S0 / total * w), 0, 1, h); }
}
export function drawAllMinis() { for (const t of allTakes()) drawMini(t); }

/* Each frame: the live take's card (4 times a second) and the playing take's mini waveform. */
export function drawLiveCards() {
  const t = liveTake(), view = t && cards.get(t);
  if (view && (!view.lastDraw || now() - view.lastDraw > 250)) { view.lastDraw = now(); updateCard(t); }
  const p = playback.current();
  if (p && cards.has(p.take)) drawMini(p.take);
}

function downloadTake(t) {
  if (!t.pcm || !t.pcm.length) return;
  saveAs(wavBlob(t.pcm.data.subarray(0, t.pcm.length * t.pcm.ch), t.pcm.ch, SR), wavName(t));
}

function takeVisible(t) {
  if (t.deleting) return false;                 // deleted, in its Undo time
  const mode = $('takeFilter').value, q = $('takeSearch').value.trim().toLowerCase();
  if (mode === 'starred' && !t.starred) return false;
  if (mode === 'kept' && (t.status === 'replaced' || t.status === 'cancelled')) return false;
  if (!q) return true;
  const r = t.req || {};
  return [t.name, t.title, t.note, r.text, r.instruction, t.id].some((x) => x && String(x).toLowerCase().includes(q));
}
function applyFilter() {
  let shown = 0;
  const list = allTakes().filter((t) => !t.deleting);
  for (const t of allTakes()) { const v = takeVisible(t), view = cards.get(t); if (view) view.card.hidden = !v; if (v) shown++; }
  const n = list.length;
  $('takesCount').textContent = !n ? '' : shown === n ? plural(n, 'take') : shown + ' of ' + plural(n, 'take');
}
function dropCard(t) { const view = cards.get(t); if (view) { view.card.remove(); cards.delete(t); } }

export function initTakeList() {
  takeEvents.on('added', (t) => { $('takeList').prepend(buildCard(t)); $('takesEmpty').hidden = true; });
  takeEvents.on('trimmed', dropCard);
  takeEvents.on('removed', (t) => { dropCard(t); $('takesEmpty').hidden = allTakes().length > 0; });
  takeEvents.on('listed', applyFilter);
  takeEvents.on('updated', (t) => {            // shown or hidden now (deleted, undone): the count follows
    const view = cards.get(t), was = view && view.card.hidden;
    updateCard(t);
    if (view && view.card.hidden !== was) applyFilter();
  });
  // A name changed: its card, and every card that names it (retakes of it) follow.
  takeEvents.on('notes', () => { for (const x of allTakes()) updateCard(x); applyFilter(); });
  voiceEvents.on('listed', () => { for (const x of allTakes()) updateCard(x); });      // voice names (a rename)
  unitEvents.on('change', () => { for (const x of allTakes()) updateCard(x); });
  selectionEvents.on('select', ({ prev, take }) => {
    const a = prev && cards.get(prev), b = take && cards.get(take);
    if (a) a.card.classList.remove('selected');
    if (b) b.card.classList.add('selected');
  });
  $('takeFilter').addEventListener('change', applyFilter);
  $('takeSearch').addEventListener('input', applyFilter);
}
