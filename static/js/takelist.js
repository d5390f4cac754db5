/* The Takes panel: one card per take (status, seed, voice, parameters, direction, a mini waveform and its
 * actions), newest first, with the filter and search. A view of takes.js: it follows takeEvents, and keeps each
 * card in its own map (nothing of the view is stored on the take). */
import { $, el, SR, FRAME, now, fmtSec, plural } from './util.js';
import { wavBlob } from './pcm.js';
import { auth, authEvents } from './auth.js';
import { serviceDefaults } from './params.js';
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

function paramSummary(req) {
  if (!req) return '';
  const d = serviceDefaults(), out = [];
  const short = { audio_temperature: 'aT', audio_top_p: 'aP', audio_top_k: 'aK', audio_repetition_penalty: 'rep', text_temperature: 'tT', text_top_p: 'tP', text_top_k: 'tK', chunk_frames: 'chunk', max_new_tokens: 'max' };
  for (const k of Object.keys(short)) if (req[k] != null && req[k] !== d[k]) out.push(short[k] + ' ' + req[k]);
  if (req.tokens) out.push('dur ' + req.tokens);
  if (req.channels === 2) out.push('stereo');
  return out.length ? out.join(' · ') : 'service defaults';
}

function buildCard(t) {
  const mini = el('canvas', { 'aria-hidden': 'true' });
  const card = el('article', { class: 'take', 'data-key': t.key, tabindex: '0', 'aria-label': t.name });
  const nameEl = el('span', { class: 'name', text: t.name });
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
  const wavB = btn('WAV', 'Download the audio this page holds as a 16-bit WAV', () => downloadTake(t));
  const srvB = el('a', { class: 'btn small', title: 'Download the service\'s rendering of this take', text: 'Service WAV', download: '', onclick: (e) => e.stopPropagation() });
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
  u.meta.textContent = ['seed ' + (t.seed ?? '—') + (r.seed != null && r.seed !== '' ? ' (fixed)' : ''), r.referenceName && r.reference !== 'none' ? 'voice ' + r.referenceName : null,
    r.language || null, paramSummary(r), t.end && t.end.rtf != null ? 'rtf ' + t.end.rtf : null, t.heardMs != null ? 'heard after ' + t.heardMs.toFixed(0) + ' ms' : null,
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
  u.wavB.setAttribute('aria-label', 'Download ' + nm + ' as WAV (the audio this page holds)');
  u.srvB.setAttribute('aria-label', 'Service WAV of ' + nm);
  u.branchB.setAttribute('aria-label', 'Retake from… (' + nm + ')');   // names start with the visible text
  u.loadB.setAttribute('aria-label', 'Use direction of ' + nm);
  const a = compared('a'), b = compared('b');
  u.aB.classList.toggle('on', a === t); u.bB.classList.toggle('on', b === t); u.bB.classList.toggle('bsel', b === t);
  if (t.id) u.srvB.href = auth.query('/api/takes/' + encodeURIComponent(t.id) + '.wav'); else u.srvB.removeAttribute('href');
  u.srvB.hidden = !serverHolds(t) || t.status === 'streaming' || (t.kind && t.kind !== 'take');   // a splice: its audio is the one held
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
  const blob = wavBlob(t.pcm.data.subarray(0, t.pcm.length * t.pcm.ch), t.pcm.ch, SR);
  const a = el('a', { href: URL.createObjectURL(blob), download: `moss_rt-${t.name.replace(/\s+/g, '').toLowerCase()}-${t.id || t.key}-seed${t.seed ?? 'x'}.wav` });
  document.body.append(a); a.click(); a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 30000);
}

function takeVisible(t) {
  const mode = $('takeFilter').value, q = $('takeSearch').value.trim().toLowerCase();
  if (mode === 'starred' && !t.starred) return false;
  if (mode === 'kept' && (t.status === 'replaced' || t.status === 'cancelled')) return false;
  if (!q) return true;
  const r = t.req || {};
  return [t.name, t.title, t.note, r.text, r.instruction, t.id].some((x) => x && String(x).toLowerCase().includes(q));
}
function applyFilter() {
  let shown = 0;
  const list = allTakes();
  for (const t of list) { const v = takeVisible(t), view = cards.get(t); if (view) view.card.hidden = !v; if (v) shown++; }
  const n = list.length;
  $('takesCount').textContent = !n ? '' : shown === n ? plural(n, 'take') : shown + ' of ' + plural(n, 'take');
}
function dropCard(t) { const view = cards.get(t); if (view) { view.card.remove(); cards.delete(t); } }

export function initTakeList() {
  takeEvents.on('added', (t) => { $('takeList').prepend(buildCard(t)); $('takesEmpty').hidden = true; });
  takeEvents.on('trimmed', dropCard);
  takeEvents.on('removed', (t) => { dropCard(t); $('takesEmpty').hidden = allTakes().length > 0; });
  takeEvents.on('listed', applyFilter);
  takeEvents.on('updated', updateCard);
  takeEvents.on('notes', (t) => { updateCard(t); applyFilter(); });
  selectionEvents.on('select', ({ prev, take }) => {
    const a = prev && cards.get(prev), b = take && cards.get(take);
    if (a) a.card.classList.remove('selected');
    if (b) b.card.classList.add('selected');
  });
  authEvents.on('renewed', () => { for (const t of allTakes()) updateCard(t); });
  $('takeFilter').addEventListener('change', applyFilter);
  $('takeSearch').addEventListener('input', applyFilter);
}
