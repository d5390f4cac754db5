/* A/B compare: two takes side by side; play either from the same position, switch at the playhead (X), and, for
 * takes that share a lineage, jump to 1 s before they diverge. The panel shows which side is playing. Playing a
 * side never changes the selected take (the editor, the take's name and note stay where the director is). Owns
 * the two slots. */
import { $, SR, FRAME, fmtSec, takeTitle } from './util.js';
import * as playback from './playback.js';
import { allTakes, pinTakes, takeByKey, takeEvents, takeUpdated } from './takes.js';
import { cursorSample, selectedTake } from './selection.js';

let ab = { a: null, b: null };

/* The take in slot 'a' or 'b' (or null). */
export function compared(slot) { return ab[slot]; }

/* Put a take in a slot (again: take it out); one take is never both. */
export function setAB(slot, t) {
  ab[slot] = ab[slot] === t ? null : t;
  if (ab.a && ab.a === ab.b) ab[slot === 'a' ? 'b' : 'a'] = null;
  for (const x of allTakes()) takeUpdated(x);
  refreshCompare();
}

/* The sample where two takes that share lineage start to differ. */
function divergence(a, b) {
  const root = (t) => { const chain = []; for (let x = t; x; x = x.parent && takeByKey(x.parent)) chain.push(x); return chain; };
  const ca = root(a), cb = root(b);
  for (const x of ca) { const j = cb.indexOf(x); if (j >= 0) {
    const sa = ca.indexOf(x) === 0 ? a.pcm.length : ca[ca.indexOf(x) - 1].spliceSample;
    const sb = j === 0 ? b.pcm.length : cb[j - 1].spliceSample;
    return Math.min(sa, sb);
  } }
  return null;
}

export function refreshCompare() {
  const { a, b } = ab;
  $('compare').hidden = !(a || b);
  const parentName = (t) => { const p = takeByKey(t.parent); return p ? takeTitle(p) : 'a take no longer here'; };
  const desc = (t) => takeTitle(t) + ' · ' + (t.pcm ? fmtSec(t.pcm.length) : '') + ' · seed ' + (t.seed ?? '—') + (t.parent ? ' · from ' + parentName(t) + ' @ ' + fmtSec(t.spliceSample) : '');
  $('abA').textContent = a ? desc(a) : 'choose a take with its A button';
  $('abB').textContent = b ? desc(b) : 'choose a take with its B button';
  $('abPlayA').disabled = !a; $('abPlayB').disabled = !b;
  $('abSwitch').disabled = !(a && b);
  const d = a && b ? divergence(a, b) : null;
  $('abSplice').hidden = d == null || d <= 0;
  $('abSplice').disabled = d == null;
  $('abNote').textContent = d != null ? 'They share the first ' + fmtSec(d) + '.' : a && b ? 'Independent takes: switching keeps the time position.' : '';
  refreshComparePlaying();
}

/* The side that is playing ('a', 'b' or null). */
export function playingSide() {
  const p = playback.current();
  if (!p || (!ab.a && !ab.b)) return null;
  return p.take === ab.a ? 'a' : p.take === ab.b ? 'b' : null;
}
let shown = null;
/* Which side plays, on the panel (every frame drawn: playback starts and stops without a refresh). */
export function refreshComparePlaying() {
  const side = playingSide(), now = side ? side + takeTitle(ab[side]) : '';
  if (now === shown) return;
  shown = now;
  for (const k of ['a', 'b']) $('abRow' + k.toUpperCase()).classList.toggle('playing', side === k);
  $('abNow').textContent = side ? '▶ Playing ' + side.toUpperCase() + ': ' + takeTitle(ab[side]) : '';
}

/* Play slot 'a' or 'b' from where the other one plays (or from the playhead); the selection stays. */
export function playAB(slot) {
  const t = ab[slot]; if (!t || !t.pcm || !t.pcm.length) return;
  const p = playback.current(), ph = playback.playheadSample();
  const from = p && (p.take === ab.a || p.take === ab.b) && ph != null ? ph : cursorSample();
  playback.playLocal(t, Math.min(from, Math.max(0, t.pcm.length - FRAME)));
  refreshComparePlaying();
}
export function switchAB() {
  const { a, b } = ab; if (!a || !b) return;
  const p = playback.current(), cur = p ? p.take : selectedTake();
  playAB(cur === a ? 'b' : 'a');
}

export function initCompare() {
  pinTakes((t) => t === ab.a || t === ab.b);
  takeEvents.on('notes', () => { if (ab.a || ab.b) refreshCompare(); });
  takeEvents.on('removed', (take) => { if (ab.a === take || ab.b === take) { for (const k of ['a', 'b']) if (ab[k] === take) ab[k] = null; refreshCompare(); } });
  $('abPlayA').addEventListener('click', () => playAB('a'));
  $('abPlayB').addEventListener('click', () => playAB('b'));
  $('abSwitch').addEventListener('click', switchAB);
  $('abClear').addEventListener('click', () => { ab = { a: null, b: null }; for (const t of allTakes()) takeUpdated(t); refreshCompare(); });
  $('abSplice').addEventListener('click', () => {
    const { a, b } = ab; const d = divergence(a, b); if (d == null) return;
    const p = playback.current(), cur = p ? p.take : null;
    playback.playLocal(cur === a ? b : a, Math.max(0, d - SR));
    refreshComparePlaying();
  });
}
