/* Which take the editor shows, and its playhead ("cursor", a whole frame). Changing them tells the panels through
 * selectionEvents: 'select' ({prev, take}) and 'cursor' (the sample). Also the two actions that end in a
 * selection: playing a take from the page's audio, and opening a take made here (a splice, a comp). */
import { FRAME, clamp, fmtSec, takeTitle } from './util.js';
import { createEmitter } from './events.js';
import { addLocalTake, allTakes, takeEvents, pinTakes, takeUpdated } from './takes.js';
import { playLocal } from './playback.js';
import * as render from './render.js';

let selected = null;
let cursor = 0;

export const selectionEvents = createEmitter();

export function selectedTake() { return selected; }
export function cursorSample() { return cursor; }

export function selectTake(take, at) {
  const prev = selected;
  selected = take;
  if (at != null) cursor = at;
  const maxC = take && take.pcm ? Math.floor(take.pcm.length / FRAME) * FRAME : 0;   // the end itself: continue the take
  if (take && take.status !== 'streaming') cursor = clamp(cursor, 0, maxC);
  selectionEvents.emit('select', { prev, take });
  render.refresh(); render.scheduleDraw();
}

/* Move the playhead (to a whole frame within the selected take). */
export function setCursor(sample) {
  const t = selected; if (!t || !t.pcm) return;
  const maxF = Math.floor(t.pcm.length / FRAME);
  cursor = clamp(Math.round(sample / FRAME), 0, maxF) * FRAME;
  selectionEvents.emit('cursor', cursor);
  render.refresh(); render.scheduleDraw();
}

/* "Take 2 · 3.20 s · seed 7": the selected take, for the status line. */
export function lastTakeSummary() {
  const t = selected; if (!t || !t.pcm) return '';
  return takeTitle(t) + ' · ' + fmtSec(t.pcm.length) + ' · seed ' + (t.seed ?? '—');
}

/* Play a take from the audio this page holds, and show it in the editor. */
export function playTake(take, from) {
  if (!take || !take.pcm || !take.pcm.length) return;
  from = playLocal(take, from);
  if (selected !== take) selectTake(take, from);
}

/* A take made here from held audio, added and shown. */
export function openLocalTake(pcm, props) {
  const t = addLocalTake(pcm, props);
  selectTake(t, 0);
  takeUpdated(t); render.refresh(); render.drawAll();
  return t;
}

export function initSelection() {
  pinTakes((t) => t === selected);
  // The selected take removed: show the newest one.
  takeEvents.on('removed', (take) => {
    if (selected !== take) return;
    const rest = allTakes().filter((t) => !t.deleting);   // not one that is being deleted (deletes.js)
    selectTake(rest[rest.length - 1] || null, 0);
  });
}
