/* Word timing under the waveform (docs/words.md): the selected take's words, the word being heard highlighted
 * during playback and replay, the word at the playhead marked, the words (mostly) inside the region shaded. A click on a
 * word puts the playhead on the frame where it starts, ready for "Retake from here" (and, while the take plays
 * from the page's audio, jumps there); Shift+click, or "Select span" then a click (touch), makes the words from
 * the last one clicked to this one the region (Loop, Retake region). Also the take's caption links (SRT, WebVTT),
 * in the strip and on the take cards.
 *
 * Owns each take's words: from the service's `words` messages while a take streams (asked for with the Scene's
 * "Word timing" box: scene.js), else fetched (GET …/words) when a take without them is shown: one restored from
 * the session, one made without words, one whose stream of words was cut. */
import { $, el, SR, FRAME, clamp, fmtSec, plural } from './util.js';
import { auth, apiFetch } from './auth.js';
import { onMessage } from './connection.js';
import { hello } from './service.js';
import { announce } from './status.js';
import * as playback from './playback.js';
import { serverHolds, takeById, takeEvents, takeTitle } from './takes.js';
import { cursorSample, playTake, selectedTake, selectionEvents, setCursor } from './selection.js';
import { sessionId } from './sessions.js';
import { wordsChoice } from './scene.js';
import { currentRegion, setRegion } from './editor.js';
import * as render from './render.js';

/* take -> {words: [{word, start, end, flags?}], complete, gap, loading, error}; gone with the take. */
const held = new WeakMap();
export const stats = { wordMessages: 0, wordFetches: 0 };

let shown = null;        // the take whose words the strip shows
let buttons = [];        // its word buttons, by index
let focusIdx = 0;        // the one word button in the tab order (roving tabindex; arrows move it)
let anchor = null;       // the word last clicked: a Shift+click selects from it
let spanMode = false;    // "Select span" pressed: the next click selects a span
const marks = { heard: -1, at: -1, from: null, to: null };   // what the strip shows marked, to change only that

/* ------------------------------------------------------------------ words and frames */

/* The 80 ms frame a word starts in (the service's rule: the instant snapped to a sample, then its frame). */
export function wordFrame(w) { return Math.floor(Math.round(w.start * SR) / FRAME); }
/* The first frame boundary at or after a word's end (a region that holds the whole word ends there). */
function wordEndSample(w) { return Math.ceil(Math.round(w.end * SR) / FRAME) * FRAME; }

/* A take's words as this page holds them: {words, complete, loading, error}, or null (none yet). */
export function wordsOf(take) { return (take && held.get(take)) || null; }
function stateOf(take) {
  let s = held.get(take);
  if (!s) { s = { words: [], complete: false, gap: false, loading: false, error: null }; held.set(take, s); }
  return s;
}

/* The word heard at `sec` (start ≤ sec < end), or -1. Words are in time order. */
function indexAt(words, sec) {
  let lo = 0, hi = words.length - 1, i = -1;
  while (lo <= hi) { const mid = (lo + hi) >> 1; if (words[mid].start <= sec) { i = mid; lo = mid + 1; } else hi = mid - 1; }
  return i >= 0 && sec < words[i].end ? i : -1;
}
/* The word at the playhead (frame f): the last word that starts in or before f and still sounds in it. */
function indexAtFrame(words, f) {
  let lo = 0, hi = words.length - 1, i = -1;
  while (lo <= hi) { const mid = (lo + hi) >> 1; if (wordFrame(words[mid]) <= f) { i = mid; lo = mid + 1; } else hi = mid - 1; }
  return i >= 0 && (wordFrame(words[i]) === f || f * FRAME < wordEndSample(words[i])) ? i : -1;
}

/* ------------------------------------------------------------------ where the service serves them */

/* A take stored in this page's session is read through the session (it outlives connections); any other take
 * through the service's take history while it holds it. */
function takePath(t) {
  const sid = sessionId();
  return t.stored && t.stored === sid ? '/api/sessions/' + encodeURIComponent(sid) + '/takes/' + encodeURIComponent(t.id) : '/api/takes/' + encodeURIComponent(t.id);
}
function servedByService(t) { return !!(t && t.id && !t.local && t.status !== 'streaming' && t.status !== 'pending'); }

/* The caption download of a take ('srt' or 'vtt'), or null when the service cannot serve it now. */
export function captionUrl(t, fmt) {
  const h = hello();
  if (!(h && h.words) || !servedByService(t)) return null;
  if (!(t.stored && t.stored === sessionId()) && !serverHolds(t)) return null;
  return auth.query(takePath(t) + '.' + fmt);
}

/* The caption links of a take card, beside its WAV (made once; updateCaptionLinks keeps them current). */
export function captionLinks() {
  return ['srt', 'vtt'].map((fmt) => el('a', { class: 'btn small', text: fmt.toUpperCase(), download: '', 'data-fmt': fmt, hidden: true, onclick: (e) => e.stopPropagation() }));
}
export function updateCaptionLinks(t, links) {
  for (const a of links) {
    const fmt = a.dataset.fmt, url = captionUrl(t, fmt), what = fmt === 'srt' ? 'SRT captions (SubRip)' : 'VTT captions (WebVTT)';
    a.hidden = !url;
    if (url) a.href = url; else a.removeAttribute('href');
    a.title = 'Download ' + what + ': the take\'s words grouped into readable cues';
    a.setAttribute('aria-label', fmt.toUpperCase() + ' captions of ' + takeTitle(t));   // starts with the visible text
  }
}

/* ------------------------------------------------------------------ words arriving, words fetched */

function onWords(msg) {
  stats.wordMessages++;
  const t = takeById(msg.take); if (!t) return;
  const s = stateOf(t);
  const i = Number.isInteger(msg.index) ? msg.index : s.words.length;
  if (i > s.words.length) s.gap = true;               // a batch missed: the whole list is fetched after the take
  if (!s.gap) {
    s.words.splice(i, s.words.length - i, ...(Array.isArray(msg.words) ? msg.words : []).filter(validWord));
    if (t === shown) { appendButtons(i); refreshWords(); }
  }
  if (msg.final) { s.complete = !s.gap; if (s.gap) ensureWords(t); }
}
function validWord(w) { return w && typeof w.word === 'string' && Number.isFinite(w.start) && Number.isFinite(w.end); }

/* Fetch the words of a take the page shows without them (once at a time; again after an error only when asked). */
function ensureWords(t) {
  if (!t || wordsChoice() !== true || !servedByService(t)) return;
  const s = stateOf(t);
  if ((s.complete && !s.gap) || s.loading || s.error) return;
  fetchWords(t);
}
async function fetchWords(t) {
  const s = stateOf(t);
  s.loading = true; s.error = null; stats.wordFetches++;
  if (t === shown) refreshWords();
  try {
    const r = await apiFetch(takePath(t) + '/words', { cache: 'no-store' });
    const body = await r.json().catch(() => null);
    if (!r.ok) throw new Error(r.status === 404 ? 'the service no longer holds this take' : (body && body.error && body.error.message) || 'HTTP ' + r.status);
    if (!body || !Array.isArray(body.words)) throw new Error('the service answered without words');
    s.words = body.words.filter(validWord); s.complete = body.complete !== false; s.gap = false;
  } catch (e) { s.error = e.message; }
  s.loading = false;
  if (t === shown) showTake(t);
}

/* ------------------------------------------------------------------ the strip */

function wordButton(w, i) {
  const est = Array.isArray(w.flags) && w.flags.includes('interpolated');
  return el('button', { type: 'button', class: 'word' + (est ? ' est' : ''), 'data-i': String(i), tabindex: i === focusIdx ? '0' : '-1',
    title: fmtSec(w.start * SR) + ' – ' + fmtSec(w.end * SR) + ', frame ' + wordFrame(w) + (est ? ' (time estimated)' : '') }, w.word);
}
function appendButtons(from) {
  const s = wordsOf(shown), box = $('words');
  for (const b of buttons.splice(from)) b.remove();
  if (!s) { box.hidden = true; return; }
  const frag = document.createDocumentFragment();
  for (let i = from; i < s.words.length; i++) { const b = wordButton(s.words[i], i); buttons.push(b); frag.append(b); }
  box.append(frag);
  box.hidden = buttons.length === 0;
  marks.from = marks.to = null;                       // new buttons: their marks are drawn again
  if (marks.heard >= from) marks.heard = -1;
  if (marks.at >= from) marks.at = -1;
}

/* Show a take's words (the strip rebuilt). */
function showTake(t) {
  if (t !== shown) { anchor = null; focusIdx = 0; setSpanMode(false); $('words').scrollTop = 0; }
  shown = t;
  marks.heard = marks.at = -1;
  buttons = []; $('words').replaceChildren();
  appendButtons(0);
  refreshWords(); drawWords();
}

/* The strip's line and links (on every render.refresh()). */
export function refreshWords() {
  const t = selectedTake(), on = wordsChoice() === true;
  $('wordsBar').hidden = !(t && on);
  if (!t || !on) return;
  const s = wordsOf(t), n = s ? s.words.length : 0;
  let info;
  if (t.local) info = 'No word timing for takes made on this page (comps, splices).';
  else if (s && s.loading) info = 'Finding the words…';
  else if (s && s.error) info = 'The words could not be loaded: ' + s.error + '.';
  else if (!n) info = t.status === 'streaming' ? (t.req && t.req.words ? 'The words appear as they are said.' : 'This take streams without word timing: its words come when it ends.')
    : s && s.complete ? 'No words were placed in this take.' : '';
  else {
    const est = s.words.filter((w) => Array.isArray(w.flags) && w.flags.includes('interpolated')).length;
    info = plural(n, 'word') + (est ? ' (' + (est === n ? 'all' : est) + ' with estimated times, underlined)' : '') + (t.status === 'streaming' ? ' so far' : '') +
      ' · click one: the playhead at its start · Shift+click another: a region';
  }
  $('wordsInfo').textContent = info;
  $('wordsRetry').hidden = !(s && s.error && !s.loading);
  $('wordSpan').hidden = !n;
  for (const [id, fmt] of [['wordsSrt', 'srt'], ['wordsVtt', 'vtt']]) {
    const a = $(id), url = captionUrl(t, fmt);
    a.hidden = !url;
    if (url) a.href = url; else a.removeAttribute('href');
    a.title = 'Download the captions of ' + takeTitle(t) + (fmt === 'srt' ? ' (SubRip)' : ' (WebVTT)');
  }
}

/* The marks that follow playback, the playhead and the region (every frame drawn). */
export function drawWords() {
  const t = shown, s = wordsOf(t);
  if (!t || !s || !buttons.length || $('wordsBar').hidden) return;
  const p = playback.current();
  const heard = p && p.take === t && playback.playheadSample() != null ? indexAt(s.words, playback.playheadSample() / SR) : -1;
  const at = indexAtFrame(s.words, Math.round(cursorSample() / FRAME));
  if (heard !== marks.heard) {
    if (buttons[marks.heard]) buttons[marks.heard].classList.remove('heard');
    if (buttons[heard]) { buttons[heard].classList.add('heard'); keepInView(buttons[heard]); }
    marks.heard = heard;
  }
  if (at !== marks.at) {
    if (buttons[marks.at]) buttons[marks.at].classList.remove('at');
    if (buttons[at]) buttons[at].classList.add('at');
    marks.at = at;
  }
  const R = currentRegion(), from = R ? R.from : null, to = R ? R.to : null;
  if (from !== marks.from || to !== marks.to) {
    marks.from = from; marks.to = to;
    for (let i = 0; i < buttons.length; i++) {
      const w = s.words[i];
      const inside = R ? Math.min(w.end * SR, R.to) - Math.max(w.start * SR, R.from) : 0;
      buttons[i].classList.toggle('inreg', !!R && inside > 0 && inside >= (w.end - w.start) * SR / 2);   // most of it inside
    }
  }
}
/* Scroll the strip (never the page) so the word being heard stays in view. */
function keepInView(b) {
  const box = $('words');
  if (box.scrollHeight <= box.clientHeight) return;
  if (b.offsetTop < box.scrollTop || b.offsetTop + b.offsetHeight > box.scrollTop + box.clientHeight) box.scrollTop = Math.max(0, b.offsetTop - box.clientHeight / 3);
}

/* ------------------------------------------------------------------ clicks and keys */

function setSpanMode(on) {
  spanMode = on;
  $('wordSpan').setAttribute('aria-pressed', String(on));
  $('wordSpan').classList.toggle('on', on);
}
function focusWord(i, move) {
  if (!buttons.length) return;
  i = clamp(i, 0, buttons.length - 1);
  if (buttons[focusIdx]) buttons[focusIdx].tabIndex = -1;
  focusIdx = i; buttons[i].tabIndex = 0;
  if (move) buttons[i].focus();
}

/* Word i clicked: the playhead to its start, or (span) the words from the anchor to it as the region. */
function activate(i, span) {
  const t = shown, s = wordsOf(t), w = s && s.words[i];
  if (!w || !t.pcm || !t.pcm.length || t !== selectedTake()) return;
  focusWord(i, false);
  if (span) {
    setSpanMode(false);
    let a = anchor;
    if (a == null || !s.words[a]) { a = indexAtFrame(s.words, Math.round(cursorSample() / FRAME)); if (a < 0) a = i; }
    const lo = Math.min(a, i), hi = Math.max(a, i);
    setRegion(wordFrame(s.words[lo]) * FRAME, wordEndSample(s.words[hi]));
    const R = currentRegion();
    if (!R || R.to <= R.from) return;
    setCursor(R.from);
    announce('Region “' + s.words.slice(lo, hi + 1).map((x) => x.word).join(' ') + '”, ' + fmtSec(R.from) + ' – ' + fmtSec(R.to) + '.');
    drawWords();
    return;
  }
  anchor = i;
  setCursor(wordFrame(w) * FRAME);
  if (playback.playsLocally(t)) playTake(t, cursorSample());          // playing: the audio jumps to the word
  announce('Playhead at “' + w.word + '”, ' + fmtSec(cursorSample()) + ', frame ' + Math.round(cursorSample() / FRAME) + '.');
  drawWords();
}

function initStrip() {
  const box = $('words');
  box.addEventListener('click', (e) => {
    const b = e.target.closest('button.word'); if (!b) return;
    activate(+b.dataset.i, e.shiftKey || spanMode);
  });
  box.addEventListener('keydown', (e) => {
    const b = e.target.closest('button.word'); if (!b) return;
    const i = +b.dataset.i;
    let j = null;
    if (e.key === 'ArrowRight' || e.key === 'ArrowDown') j = i + 1;
    else if (e.key === 'ArrowLeft' || e.key === 'ArrowUp') j = i - 1;
    else if (e.key === 'Home') j = 0;
    else if (e.key === 'End') j = buttons.length - 1;
    else if (e.key === 'Enter' || e.key === ' ') {   // handled here so Shift is seen; the page's Space (play) is not
      e.preventDefault(); e.stopPropagation();
      activate(i, e.shiftKey || spanMode);
      return;
    }
    if (j == null) return;
    e.preventDefault(); e.stopPropagation();       // the arrows move between words here, not the playhead
    focusWord(j, true);
  });
  $('wordSpan').addEventListener('click', () => setSpanMode(!spanMode));
  $('wordsRetry').addEventListener('click', () => { const t = shown; if (t) { stateOf(t).error = null; ensureWords(t); } });
  $('wantWords').addEventListener('change', () => { const t = selectedTake(); showTake(t); ensureWords(t); });
}

export function initWords() {
  onMessage('words', onWords);
  initStrip();
  selectionEvents.on('select', ({ take }) => { if (take !== shown) showTake(take); ensureWords(take); });
  takeEvents.on('updated', (t) => { if (t === shown) { ensureWords(t); refreshWords(); } });
}
