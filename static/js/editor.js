/* The take editor ("waveform and regions"): the selected take's waveform with its playhead, zoom and scroll; the
 * region (long-press and drag, by mouse or touch; Shift+drag; [ ]) with handles to drag its ends, loop, region
 * retake and keep-the-old-tail; markers; the take's name, star, note and delete (with undo: deletes.js); replay
 * and retake from the playhead, with the retake direction panel. Owns the view, the region and the pointer
 * gestures; the selection and the playhead are selection.js's. */
import { $, el, SR, FRAME, clamp, fmtSec } from './util.js';
import { frameNote, frameSuffix, showFrames, unitEvents } from './units.js';
import { conn } from './connection.js';
import { limits } from './service.js';
import { setStatus, announce } from './status.js';
import * as playback from './playback.js';
import { drawWaveform, fitCanvas } from './waveform.js';
import { notesChanged, partTitle, serverHolds, takeByKey, takeEvents, takeTitle } from './takes.js';
import { cursorSample, playTake, selectedTake, selectionEvents, setCursor } from './selection.js';
import { XFADE, hasPending, liveTake, seek } from './director.js';
import { deleteTake, deleteWording } from './deletes.js';
import * as render from './render.js';

const wave = $('wave');
let view = { zoom: 1, start: 0 };   // the editor's window on the selected take (zoom 1 = all of it)
let region = null;                  // {from, to} samples of the selected take, whole frames
let dragging = false, hoverX = null, regionDrag = null;
// A press on the waveform: {id, x, y, timer, moved} until it is a playhead drag (it moved), a region drag (held
// still for LONG_PRESS_MS, or Shift), or a handle drag (it started on a region end).
let press = null;
const LONG_PRESS_MS = 450;          // held this long without moving: the press selects a region
const MOVE_SLOP_PX = 8;             // moving less than this is still holding still
// How far from a region end a press grabs it: 22 px each side under a finger (a 44 px target), 7 with a mouse.
const handleReach = (pointerType) => (pointerType === 'mouse' ? 7 : 22);

export const stats = { longPresses: 0, handleDrags: 0 };

export function currentRegion() { return region; }

/* The part of the selected take the editor shows: all of it at zoom 1, 1/zoom of it from view.start. */
export function viewRange(t) {
  const total = viewLength(t);
  const span = Math.min(total, Math.max(FRAME * 2, total / view.zoom));
  const start = clamp(view.start, 0, Math.max(0, total - span));
  return { start, span, total };
}
function viewLength(t) {
  if (!t || !t.pcm) return SR * 4;
  const n = t.pcm.length;
  return t.status === 'streaming' ? Math.max(SR * 4, Math.ceil(n * 1.2 / SR) * SR) : Math.max(n, FRAME);
}
function setZoom(z, around) {
  const t = selectedTake(); if (!t || !t.pcm) return;
  const before = viewRange(t), anchor = around ?? cursorSample();
  view.zoom = clamp(z, 1, 256);
  const span = viewRange(t).span;
  view.start = Math.max(0, anchor - (anchor - before.start) / before.span * span);
  syncScrollbar(); render.scheduleDraw();
}
function syncScrollbar() {
  const t = selectedTake(), v = t && t.pcm ? viewRange(t) : null;
  const bar = $('waveScroll');
  bar.hidden = !v || view.zoom <= 1;
  if (v) { bar.max = String(Math.max(0, Math.round((v.total - v.span) / FRAME))); bar.value = String(Math.round(v.start / FRAME)); }
  $('zoomLevel').textContent = view.zoom <= 1 ? 'fit' : view.zoom.toFixed(view.zoom < 10 ? 1 : 0) + '×';
}

export function drawEditor() {
  const t = selectedTake(), cursor = cursorSample();
  const { w, h, dpr } = fitCanvas(wave);
  const g = wave.getContext('2d');
  g.clearRect(0, 0, w, h);
  $('waveEmpty').hidden = !!(t && t.pcm && t.pcm.length) || (t && t.status === 'streaming');
  const rulerH = 16 * dpr, H = h - rulerH;
  const v = viewRange(t), total = v.span;
  const xOf = (s) => Math.round((s - v.start) / v.span * w);
  // Ruler.
  g.fillStyle = '#12171c'; g.fillRect(0, H, w, rulerH);
  g.font = `${10 * dpr}px ui-monospace, Menlo, monospace`; g.textBaseline = 'middle';
  const secs = v.span / SR, stepSec = [0.08, 0.16, 0.24, 0.5, 1, 2, 5, 10, 15, 30, 60].find((x) => secs / x <= 12) || 120;
  for (let k = Math.ceil(v.start / SR / stepSec); k * stepSec <= (v.start + v.span) / SR; k++) {
    const sec = +(k * stepSec).toFixed(2), x = xOf(sec * SR);
    g.fillStyle = '#2a323c'; g.fillRect(x, 0, 1, H);
    g.fillStyle = '#8a95a2'; g.fillText(Number.isInteger(sec) ? sec + 's' : String(sec), x + 3 * dpr, H + rulerH / 2);
  }
  if (!t || !t.pcm) return;
  // The selected region, then markers and splices (under the waveform's colours, over the background).
  const R = region;
  if (R) {
    g.fillStyle = 'rgba(154,165,232,.16)'; g.fillRect(xOf(R.from), 0, Math.max(1, xOf(R.to) - xOf(R.from)), H);
    g.fillStyle = '#9aa5e8'; g.fillRect(xOf(R.from), 0, Math.max(1, dpr), H); g.fillRect(xOf(R.to), 0, Math.max(1, dpr), H);
  }
  // Inherited prefix of a retake.
  const S0 = t.spliceSample || 0;
  if (S0) { g.fillStyle = 'rgba(216,166,87,.06)'; g.fillRect(0, 0, xOf(S0), H); }
  const p = playback.current(), ph = p && p.take === t ? playback.playheadSample() : null;
  const phX = ph != null ? xOf(ph) : -1;
  drawWaveform(g, t, 0, w, H, total, (x, s) => {
    const played = phX >= 0 && x <= phX;
    if (S0 && s < S0) return played ? '#b8975d' : '#6e6450';
    return played ? '#7fd0c2' : '#4b8f86';
  }, v.start);
  const flag = (x, label, color, y) => {
    g.fillStyle = color; g.fillRect(x, 0, Math.max(1, dpr), H);
    g.font = `600 ${10 * dpr}px system-ui, sans-serif`; g.textBaseline = 'middle';
    const tw = g.measureText(label).width + 10 * dpr, lx = x + 4 * dpr + tw > w ? x - 4 * dpr - tw : x + 4 * dpr;
    g.beginPath(); if (g.roundRect) g.roundRect(lx, y, tw, 16 * dpr, 4 * dpr); else g.rect(lx, y, tw, 16 * dpr);
    g.fill(); g.fillStyle = '#0e1114'; g.fillText(label, lx + 5 * dpr, y + 8 * dpr);
  };
  if (R) {                 // the region's ends as handles (over the waveform): grips to drag them
    const gw = 8 * dpr, gh = Math.min(34 * dpr, H / 2), gy = (H - gh) / 2;
    for (const x of [xOf(R.from), xOf(R.to)]) {
      g.fillStyle = '#9aa5e8'; g.fillRect(x, 0, Math.max(1, dpr), H);
      g.beginPath(); if (g.roundRect) g.roundRect(x - gw / 2, gy, gw, gh, 3 * dpr); else g.rect(x - gw / 2, gy, gw, gh); g.fill();
      g.fillStyle = '#0e1114';
      for (let k = -1; k <= 1; k++) g.fillRect(x - dpr, gy + gh / 2 + k * 5 * dpr, 2 * dpr, dpr);
    }
  }
  for (const sp of t.splices || []) flag(xOf(sp.sample), 'splice · ' + sp.kind, '#9aa5e8', H - 22 * dpr);
  for (const m of t.markers || []) flag(xOf(m.sample), m.label, '#7cc593', 24 * dpr);
  if (S0) {
    const x = xOf(S0);
    g.fillStyle = '#d8a657'; g.fillRect(x, 0, Math.max(1, dpr), H);
    g.font = `600 ${10 * dpr}px system-ui, sans-serif`; g.textBaseline = 'middle';
    const label = 'retake @ ' + fmtSec(S0), tw = g.measureText(label).width + 10 * dpr;
    const lx = x + 4 * dpr + tw > w ? x - 4 * dpr - tw : x + 4 * dpr;
    g.fillStyle = '#d8a657'; g.beginPath();
    if (g.roundRect) g.roundRect(lx, 4 * dpr, tw, 16 * dpr, 4 * dpr); else g.rect(lx, 4 * dpr, tw, 16 * dpr);
    g.fill(); g.fillStyle = '#1b1406'; g.fillText(label, lx + 5 * dpr, 12 * dpr);
  }
  // Cursor (frame-aligned) and playhead.
  const cx = xOf(cursor);
  g.fillStyle = '#e9c27c'; g.fillRect(cx - Math.floor(dpr / 2), 0, Math.max(1, Math.round(1.5 * dpr)), H);
  g.beginPath(); g.moveTo(cx - 5 * dpr, 0); g.lineTo(cx + 5 * dpr, 0); g.lineTo(cx, 7 * dpr); g.closePath(); g.fill();
  if (phX >= 0) { g.fillStyle = '#e4e8ec'; g.fillRect(phX, 0, Math.max(1, dpr), H); }
  if (hoverX != null && !dragging) {          // where a click would put the playhead (frame-aligned)
    const maxF = Math.floor(t.pcm.length / FRAME);
    const hs = clamp(Math.round((v.start + hoverX * v.span) / FRAME), 0, maxF) * FRAME, hx = xOf(hs);
    g.fillStyle = 'rgba(233,194,124,.35)'; g.fillRect(hx, 0, Math.max(1, dpr), H);
    g.font = `${10 * dpr}px ui-monospace, Menlo, monospace`; g.textBaseline = 'bottom';
    const label = fmtSec(hs), tw = g.measureText(label).width;
    g.fillStyle = '#e9c27c'; g.fillText(label, hx + 4 * dpr + tw > w ? hx - 4 * dpr - tw : hx + 4 * dpr, H - 3 * dpr);
  }
  // Not yet received region while streaming.
  if (t.status === 'streaming') {
    const x = xOf(t.pcm.length);
    g.fillStyle = 'rgba(95,179,166,.10)'; g.fillRect(x, 0, Math.max(2, 3 * dpr), H);
  }
  const maxS = t.pcm.length;
  wave.setAttribute('aria-valuemax', String(Math.floor(maxS / FRAME)));
  wave.setAttribute('aria-valuenow', String(Math.floor(cursor / FRAME)));
  wave.setAttribute('aria-valuetext', takeTitle(t) + ': playhead at ' + fmtSec(cursor) + ' of ' + fmtSec(maxS) + frameSuffix(cursor));
  $('edPos').innerHTML = '';
  const atEnd = cursor && cursor >= t.pcm.length && t.status !== 'streaming';
  const small = [frameNote(cursor), atEnd ? 'the end' : '', ph != null ? 'playing ' + fmtSec(ph) : ''].filter(Boolean).join(' · ');
  $('edPos').append(fmtSec(cursor) + ' ', el('small', { text: small }));
}

/* "retake of Take 1 @ 2.40 s (frame 30) · t_…": where a take comes from, under its title. */
function takeLineage(t) {
  const parent = t.parent && takeByKey(t.parent);
  const bits = [];
  const named = (x) => (x ? takeTitle(x) : 'a take no longer here');
  if (t.parts && t.parts.length) {
    const regions = t.parts.map((p) => partTitle(p) + ' ' + fmtSec(p.from) + ' – ' + fmtSec(p.to));
    bits.push(t.kind === 'splice' ? 'splice: ' + regions.join(', then ') : 'comp of ' + regions.join(' + '));
    if (t.crossfade) bits.push(Math.round(t.crossfade / SR * 1000) + ' ms crossfade at each join');
    if (t.hasCodes === false) bits.push('audio only');
  } else if (t.spliceOf) bits.push('region ' + fmtSec(t.spliceSample) + ' – ' + fmtSec(t.spliceOf.to) + ' re-done from ' + named(takeByKey(t.spliceOf.retake)) + ', then ' + named(parent) + '\'s tail · made here');
  else if (parent) bits.push('retake of ' + takeTitle(parent) + ' @ ' + fmtSec(t.spliceSample) + frameSuffix(t.spliceSample));
  if (t.comp) bits.push('comp of ' + t.comp.length + ' regions · made here');
  if (t.id && showFrames()) bits.push(t.id);    // the service's id: for the advanced view
  return bits.join(' · ');
}

/* Why the model cannot continue or re-send a take the service keeps (a splice with a crossfade), or ''. */
export function noCodesReason(t) {
  if (!t || t.hasCodes !== false) return '';
  return takeTitle(t) + ' joins its parts with a ' + Math.round((t.crossfade || 0) / SR * 1000) + ' ms crossfade inside a frame, so it has no codes '
    + 'for the model to continue from or re-send: retake one of the takes it is made of, or keep the old tail joined at the frame. '
    + 'Play, compare and download work.';
}

/* ------------------------------------------------------------------ replay and retake from the playhead */

/* The retake panel belongs to one take: another take starts from its own direction, never the last one typed. */
function clearRetakeDirection() {
  $('rtInstruction').value = ''; $('rtText').value = ''; $('rtSeedMode').value = 'new'; $('rtSeed').hidden = true; $('rtSeed').value = '';
  const t = selectedTake(), r = t && t.req;
  $('rtInstruction').placeholder = r ? 'unchanged: ' + (r.instruction || '(none)').slice(0, 80) : 'unchanged';
  $('rtText').placeholder = r ? 'unchanged: ' + (r.text || '').slice(0, 80) : 'unchanged';
}
/* The retake panel as director.seek() takes it; null (and the field marked) when its fixed seed is not a number. */
function readRetakeDirection() {
  const seedMode = $('rtSeedMode').value;
  let seed = null;
  if (seedMode === 'fixed') {
    const v = $('rtSeed').value.trim();
    if (!/^\d{1,19}$/.test(v)) { $('rtSeed').classList.add('invalid'); return null; }
    seed = v;
  }
  return { seedMode, seed, instruction: $('rtInstruction').value, text: $('rtText').value, useSampling: $('rtParams').checked,
    prerollSec: parseFloat($('preroll').value || '0') };
}
/* Replay (the service re-sends the audio) or retake the selected take from the playhead. */
export function seekFromPlayhead(mode, tail = null) {
  const src = selectedTake();
  if (!src || !serverHolds(src)) return;
  if (!src.pcm || !src.pcm.length) return;
  seek(mode, src, cursorSample(), { direction: readRetakeDirection, tail });
}
function retakeRegion() {
  const R = region, t = selectedTake();
  if (!R || !t) return;
  const crossfade = $('tailJoin').value === 'frame' ? 0 : XFADE;
  const tail = $('keepTail').checked && R.to + XFADE <= t.pcm.length ? { to: R.to, source: t, crossfade } : null;
  setCursor(R.from);
  seekFromPlayhead('retake', tail);
}

/* The cursor bar's buttons (on every render.refresh()). */
export function refreshEditorButtons() {
  const t = selectedTake(), cursor = cursorSample();
  const noCodes = noCodesReason(t);
  const canServer = serverHolds(t) && t.pcm && t.pcm.length > 0 && t.status !== 'streaming' && !noCodes;
  const atEnd = !!(t && t.pcm && t.pcm.length && cursor >= t.pcm.length);
  $('replayBtn').disabled = !canServer || atEnd;
  $('retakeBtn').disabled = !(serverHolds(t) && t.pcm && t.pcm.length > 0 && !noCodes);
  $('retakeBtn').textContent = atEnd && t.status !== 'streaming' ? 'Continue from the end' : 'Retake from here';
  const why = !t ? '' : !t.id ? '' : t.conn !== conn.serial ? 'This take belongs to an earlier connection: the service no longer has it in this session. Play and download still work.'
    : t.dropped ? 'The service no longer holds this take (it keeps the last ' + (limits().max_takes_kept || 32) + ' of a connection). Play and download still work.' : noCodes;
  if ($('seekWhy').textContent !== noCodes) $('seekWhy').textContent = noCodes;
  $('seekWhy').hidden = !noCodes;
  $('retakeBtn').title = why || 'Keep everything before the playhead, generate a new continuation (Ctrl+Shift+Enter)';
  $('replayBtn').title = why || (t && t.status === 'streaming' ? 'Available when the take has finished' : 'Have the service re-send this take\'s audio from the playhead');
  $('edPlay').disabled = !(t && t.pcm && t.pcm.length);
  $('edPlay').textContent = playback.playsLocally(t) ? 'Stop' : 'Play';
}

/* ------------------------------------------------------------------ regions, loop, markers */

export function setRegion(a, b) {
  const t = selectedTake();
  if (a == null || !t || !t.pcm) region = null;
  else {
    const max = Math.floor(t.pcm.length / FRAME) * FRAME;
    const from = clamp(Math.min(a, b), 0, max), to = clamp(Math.max(a, b), 0, max);
    region = { from: Math.round(from / FRAME) * FRAME, to: Math.round(to / FRAME) * FRAME };
  }
  const p = playback.current();
  if (p && p.loop && (!region || p.take !== t)) { playback.stopPlayback(); setStatus('Stopped', ''); }
  else if (p && p.loop) playLoop(t, region.from, region.to);   // a changed region loops anew
  refreshRegion(); render.scheduleDraw();
}
/* [ at the playhead: the region starts here (and runs to its end, or the take's). */
export function markRegionStart() { const t = selectedTake(), c = cursorSample(); if (t) setRegion(c, region ? Math.max(region.to, c) : t.pcm.length); }
/* ] at the playhead: the region ends here. */
export function markRegionEnd() { const t = selectedTake(), c = cursorSample(); if (t) setRegion(region ? Math.min(region.from, c) : 0, c); }

export function refreshRegion() {
  const R = region, t = selectedTake();
  const pos = $('regionPos'); pos.replaceChildren();
  if (R && R.to > R.from) pos.append('Region ' + fmtSec(R.from) + ' – ' + fmtSec(R.to) + ' ', el('small', { text: fmtSec(R.to - R.from) + (showFrames() ? ' · frames ' + R.from / FRAME + '–' + R.to / FRAME : '') + ' · drag its ends to change it' }));
  else if (matchMedia('(pointer: coarse)').matches) pos.append('No region ', el('small', { text: 'Long-press and drag on the waveform' }));
  else pos.append('No region ', el('small', {}, 'Long-press and drag on the waveform (or Shift+drag, ', el('kbd', { text: '[' }), ' ', el('kbd', { text: ']' }), ')'));
  const has = !!(R && R.to > R.from && t && t.pcm);
  const looping = !!playback.loopRegion();
  $('loopBtn').disabled = !has; $('loopBtn').setAttribute('aria-pressed', String(looping));
  $('loopBtn').textContent = looping ? 'Stop loop' : 'Loop region';
  $('retakeRegionBtn').disabled = !(has && serverHolds(t) && t.status !== 'streaming' && !hasPending() && !noCodesReason(t));
  $('retakeRegionBtn').title = noCodesReason(t) || 'Retake from the region\'s start (with the retake direction below)';
  $('compAdd').disabled = !has; $('regionClear').disabled = !R;
  $('markerAdd').disabled = !(t && t.pcm && t.pcm.length);
}
function playLoop(take, from, to) {
  if (!take || !take.pcm || to <= from) return;
  playback.stopPlayback();
  playback.startStream(take, take.pcm, from, 0, 'local', { from, to });
  setStatus('Looping ' + takeTitle(take), fmtSec(from) + ' – ' + fmtSec(to) + ', over and over (Esc stops).');
  refreshRegion();
}
export function toggleLoop() {
  if (playback.loopRegion()) { playback.stopPlayback(); setStatus('Stopped', ''); render.refresh(); refreshRegion(); return; }
  if (region) playLoop(selectedTake(), region.from, region.to);
}
export function addMarker() {
  const t = selectedTake(); if (!t || !t.pcm) return;
  const cursor = cursorSample();
  const label = $('markerLabel').value.trim() || 'marker ' + ((t.markers || []).length + 1);
  t.markers = [...(t.markers || []), { sample: cursor, label }].sort((a, b) => a.sample - b.sample);
  $('markerLabel').value = '';
  announce('Marker ' + label + ' at ' + fmtSec(cursor) + '.');
  notesChanged(t); refreshMarkers(); render.scheduleDraw();
}
function refreshMarkers() {
  const t = selectedTake(), box = $('markerList');
  box.replaceChildren(...((t && t.markers) || []).map((m) => el('span', { class: 'row', style: 'gap:2px' },
    el('button', { type: 'button', class: 'chip', text: m.label + ' @ ' + fmtSec(m.sample), title: 'Move the playhead to this marker', onclick: () => setCursor(m.sample) }),
    el('button', { type: 'button', class: 'x', text: '×', 'aria-label': 'Remove marker ' + m.label, onclick: () => { t.markers = t.markers.filter((x) => x !== m); notesChanged(t); refreshMarkers(); render.scheduleDraw(); } }))));
}

/* ------------------------------------------------------------------ the take's details */

/* The editor's heading: the take's name, and where it comes from (naming the takes it comes from). */
function refreshHeading(take) {
  $('edTitle').textContent = take ? takeTitle(take) : 'No take yet';
  $('edSub').textContent = take ? takeLineage(take) : '';
}

function refreshDetails() {
  const t = selectedTake();
  $('takeDetails').hidden = !t;
  if (!t) return;
  if (document.activeElement !== $('takeName')) $('takeName').value = t.title || '';
  if (document.activeElement !== $('takeNote')) $('takeNote').value = t.note || '';
  $('takeStar').setAttribute('aria-pressed', String(!!t.starred)); $('takeStar').textContent = t.starred ? '★' : '☆';
  $('takeDelete').disabled = t === liveTake();
  $('takeDelete').title = t.stored ? 'Delete ' + takeTitle(t) + ' from the session (Undo for a few seconds)'
    : 'Remove ' + takeTitle(t) + ' ' + deleteWording(t) + ' (the service does not keep it; Undo for a few seconds)';
  $('takeDelete').setAttribute('aria-label', 'Delete ' + takeTitle(t) + ' ' + deleteWording(t));
}
function deleteSelected() { deleteTake(selectedTake()); }

/* ------------------------------------------------------------------ pointer and keys on the waveform */

function sampleAt(e) {
  const r = wave.getBoundingClientRect(), v = viewRange(selectedTake());
  return v.start + clamp((e.clientX - r.left) / r.width, 0, 1) * v.span;
}
function setCursorFromEvent(e) {
  const t = selectedTake(); if (!t || !t.pcm) return;
  const s = sampleAt(e);
  if (regionDrag) { setRegion(regionDrag.anchor, Math.round(s / FRAME) * FRAME); return; }
  setCursor(Math.round(s / FRAME) * FRAME);
}
/* The region end (a handle) a press at clientX grabs: 'from', 'to' or null. */
function handleAt(e) {
  const R = region, t = selectedTake(); if (!R || R.to <= R.from || !t || !t.pcm) return null;
  const r = wave.getBoundingClientRect(), v = viewRange(t), px = (s) => r.left + (s - v.start) / v.span * r.width;
  const dFrom = Math.abs(e.clientX - px(R.from)), dTo = Math.abs(e.clientX - px(R.to)), reach = handleReach(e.pointerType);
  if (Math.min(dFrom, dTo) > reach) return null;
  return dTo <= dFrom ? 'to' : 'from';
}
function cancelPress() { if (press) { clearTimeout(press.timer); press = null; } }
/* Held still long enough: from here the drag selects a region, anchored where the press began. */
function beginRegionFromPress() {
  if (!press || press.moved || !dragging) return;
  regionDrag = { anchor: press.anchor };
  stats.longPresses++;
  if (navigator.vibrate) try { navigator.vibrate(10); } catch (e) { /* not allowed */ }
  setRegion(press.anchor, press.anchor);
  setStatus('Selecting a region', 'Drag to where it ends; lift to keep it.');
  press.timer = null;
  render.scheduleDraw();
}
function initPointer() {
  wave.addEventListener('pointerleave', () => { hoverX = null; wave.style.cursor = ''; render.scheduleDraw(); });
  wave.addEventListener('contextmenu', (e) => e.preventDefault());   // a long press is a region, not a menu
  wave.addEventListener('pointerdown', (e) => {
    const t = selectedTake();
    if (!t || !t.pcm || (e.pointerType === 'mouse' && e.button !== 0)) return;
    cancelPress();
    dragging = true; wave.setPointerCapture(e.pointerId);
    const edge = handleAt(e);
    if (edge) {                     // a region end: drag it (the other end stays)
      regionDrag = { anchor: edge === 'to' ? region.from : region.to };
      stats.handleDrags++;
      return;
    }
    // Shift+drag selects a region at once; a plain press places the playhead, a drag scrubs it, and a press held
    // still for LONG_PRESS_MS turns into a region drag (the way in on a touch screen).
    const anchor = Math.round(sampleAt(e) / FRAME) * FRAME;
    if (e.shiftKey) regionDrag = { anchor };
    else press = { id: e.pointerId, x: e.clientX, y: e.clientY, anchor, moved: false, timer: setTimeout(beginRegionFromPress, LONG_PRESS_MS) };
    setCursorFromEvent(e);
  });
  wave.addEventListener('pointermove', (e) => {
    if (press && press.id === e.pointerId && !press.moved && Math.hypot(e.clientX - press.x, e.clientY - press.y) > MOVE_SLOP_PX) {
      press.moved = true; clearTimeout(press.timer);          // it moves: a playhead drag
    }
    if (dragging) setCursorFromEvent(e);
    hoverX = e.pointerType === 'mouse' ? (e.clientX - wave.getBoundingClientRect().left) / wave.clientWidth : null;
    if (!dragging && e.pointerType === 'mouse') wave.style.cursor = handleAt(e) ? 'ew-resize' : '';
    render.scheduleDraw();
  });
  const endDrag = () => {
    cancelPress();
    if (!dragging) return; dragging = false;
    if (regionDrag) {
      regionDrag = null;
      if (!region || region.to - region.from < FRAME) { setRegion(null); setStatus('No region', 'Hold still a moment on the waveform, then drag.'); return; }
      setCursor(region.from);
      setStatus('Region ' + fmtSec(region.from) + ' – ' + fmtSec(region.to), 'Loop it, retake it or add it to the comp; drag its ends to change it.');
      return;
    }
    const t = selectedTake();   // scrubbing during local playback jumps the audio to the playhead
    if (playback.playsLocally(t)) playTake(t, cursorSample());
  };
  wave.addEventListener('pointerup', endDrag); wave.addEventListener('pointercancel', endDrag);
  wave.addEventListener('wheel', (e) => {       // Ctrl/⌘+wheel zooms around the mouse; a sideways (or Shift+) wheel scrolls
    const t = selectedTake(); if (!t || !t.pcm) return;
    const r = wave.getBoundingClientRect(), v = viewRange(t);
    if (e.ctrlKey || e.metaKey) {
      e.preventDefault();
      setZoom(view.zoom * (e.deltaY < 0 ? 1.25 : 0.8), v.start + clamp((e.clientX - r.left) / r.width, 0, 1) * v.span);
    } else if (view.zoom > 1 && (e.shiftKey || Math.abs(e.deltaX) > Math.abs(e.deltaY))) {
      e.preventDefault();
      view.start = clamp(v.start + (e.deltaX || e.deltaY) / r.width * v.span, 0, v.total - v.span); syncScrollbar(); render.scheduleDraw();
    }
  }, { passive: false });
  wave.addEventListener('keydown', (e) => {    // ←/→ are page-wide shortcuts (main.js)
    const t = selectedTake();
    if (e.key === 'Home') { e.preventDefault(); setCursor(0); }
    else if (e.key === 'End' && t && t.pcm) { e.preventDefault(); setCursor(t.pcm.length); }
  });
}

/* Play or stop the selected take from the playhead (the Play button, Space). */
export function togglePlaySelected() {
  const t = selectedTake();
  if (playback.playsLocally(t)) { playback.stopPlayback(); setStatus('Stopped', ''); render.refresh(); return; }
  playTake(t, cursorSample());
}

export function initEditor() {
  initPointer();
  selectionEvents.on('select', ({ prev, take }) => {
    if (take !== prev) {
      clearRetakeDirection();
      view = { zoom: 1, start: 0 };
      const p = playback.current();
      if (!(p && p.loop && p.take === take)) region = null;
    }
    refreshHeading(take);
    syncScrollbar(); refreshDetails(); refreshMarkers(); refreshRegion();
  });
  selectionEvents.on('cursor', (cursor) => {
    const v = viewRange(selectedTake());                     // zoomed in: keep the playhead in view
    if (view.zoom > 1 && (cursor < v.start || cursor > v.start + v.span)) { view.start = Math.max(0, cursor - v.span / 2); syncScrollbar(); }
  });
  takeEvents.on('removed', (take) => { const t = selectedTake(); if (t && t !== take) refreshHeading(t); });
  // a name or a number changed: every label that names a take follows (the lineage names takes too)
  for (const ev of ['notes', 'numbered']) takeEvents.on(ev, () => { refreshDetails(); refreshHeading(selectedTake()); });
  unitEvents.on('change', () => { refreshHeading(selectedTake()); refreshRegion(); render.scheduleDraw(); });
  $('replayBtn').addEventListener('click', () => seekFromPlayhead('replay'));
  $('retakeBtn').addEventListener('click', () => seekFromPlayhead('retake'));
  $('edPlay').addEventListener('click', togglePlaySelected);
  $('zoomIn').addEventListener('click', () => setZoom(view.zoom * 2));
  $('zoomOut').addEventListener('click', () => setZoom(view.zoom / 2));
  $('zoomFit').addEventListener('click', () => setZoom(1));
  $('waveScroll').addEventListener('input', () => { view.start = +$('waveScroll').value * FRAME; render.scheduleDraw(); });
  $('loopBtn').addEventListener('click', toggleLoop);
  $('regionClear').addEventListener('click', () => setRegion(null));
  $('retakeRegionBtn').addEventListener('click', retakeRegion);
  $('markerAdd').addEventListener('click', addMarker);
  $('markerLabel').addEventListener('keydown', (e) => { if (e.key === 'Enter') { e.preventDefault(); addMarker(); } });
  $('takeStar').addEventListener('click', () => { const t = selectedTake(); if (t) { t.starred = !t.starred; notesChanged(t); } });
  $('takeName').addEventListener('input', () => { const t = selectedTake(); if (t) { t.title = $('takeName').value.trim(); notesChanged(t); } });
  $('takeNote').addEventListener('input', () => { const t = selectedTake(); if (t) { t.note = $('takeNote').value; notesChanged(t); } });
  $('takeDelete').addEventListener('click', deleteSelected);
  $('rtSeedMode').addEventListener('change', () => { $('rtSeed').hidden = $('rtSeedMode').value !== 'fixed'; });
  $('rtSeed').addEventListener('input', () => $('rtSeed').classList.remove('invalid'));
  $('retakeOptsBtn').addEventListener('click', () => {
    const open = $('retakeOpts').hidden; $('retakeOpts').hidden = !open; $('retakeOptsBtn').setAttribute('aria-expanded', String(open));
    const t = selectedTake();
    if (open && t && t.req) { $('rtInstruction').placeholder = 'unchanged: ' + (t.req.instruction || '(none)').slice(0, 80); $('rtText').placeholder = 'unchanged: ' + (t.req.text || '').slice(0, 80); }
  });
}
