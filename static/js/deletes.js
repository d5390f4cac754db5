/* Delete with undo. Delete hides the take at once and offers Undo for a few seconds (GRACE_MS); only then is the
 * take removed from the page and, when the session keeps it, deleted from the session (sessions.js, on 'removed').
 * Several deletes in a row share one Undo. Closing the page within the Undo time does not lose a delete silently:
 * it is sent as the page goes, and kept in this browser until the service confirms it, so the next visit of the
 * session completes it and says so (sessions.js). Writes the take's `deleting` flag (views hide such takes). */
import { $, plural, takeTitle } from './util.js';
import { announce } from './status.js';
import * as playback from './playback.js';
import { allTakes, holds, removeTake, takeUpdated } from './takes.js';
import { selectTake, selectedTake } from './selection.js';
import { deleteOnUnload, forgetDelete, rememberDelete } from './sessions.js';
import { liveTake } from './director.js';
import * as render from './render.js';

export const GRACE_MS = 6000;
let graceMs = GRACE_MS;  // the Undo time in use: tests shorten it (window.studio.undoGraceMs) to wait less

/* The Undo time of the next deletes, in ms (at least 100). */
export function setUndoGrace(ms) { graceMs = Math.max(100, Number(ms) || GRACE_MS); }
export function undoGrace() { return graceMs; }

let pending = [];     // takes deleted, still in their Undo time
let timer = null;

export const stats = { deletesCommitted: 0, deletesUndone: 0 };

/* The takes deleted and still undoable (read only). */
export function pendingDeletes() { return pending; }

/* What Delete says it does: the session keeps the take (deleted from it), or only this page holds it. */
export function deleteWording(t) { return t && t.stored ? 'from the session' : 'from this page'; }

/* Delete `t` (the live take cannot be): hidden now, gone after the Undo time. */
export function deleteTake(t) {
  if (!t || t === liveTake() || t.deleting || !holds(t)) return;
  t.deleting = true;
  pending.push(t);
  const p = playback.current();
  if (p && p.take === t) playback.stopPlayback();
  if (selectedTake() === t) {
    const rest = allTakes().filter((x) => !x.deleting);
    selectTake(rest[rest.length - 1] || null, 0);
  }
  takeUpdated(t);
  showBar();                           // a live region: screen readers hear it, with its Undo
  clearTimeout(timer);
  timer = setTimeout(commit, graceMs);
  render.refresh();
}

/* Undo: every take of the current Undo comes back as it was. */
export function undoDelete() {
  if (!pending.length) return;
  clearTimeout(timer);
  const back = pending; pending = [];
  for (const t of back) { t.deleting = false; forgetDelete(t); takeUpdated(t); }
  hideBar();
  stats.deletesUndone += back.length;
  selectTake(back[back.length - 1], 0);
  announce('Undone: ' + back.map(takeTitle).join(', ') + ' kept.');
  render.refresh();
}

/* The Undo time has passed: the takes leave the page (and the session). */
function commit() {
  const gone = pending; pending = [];
  hideBar();
  for (const t of gone) if (holds(t)) removeTake(t, false);
  stats.deletesCommitted += gone.length;
  render.refresh();
}

function showBar() {
  const stored = pending.filter((t) => t.stored), local = pending.filter((t) => !t.stored);
  const parts = [];
  if (stored.length) parts.push(stored.map(takeTitle).join(', ') + ' deleted from the session');
  if (local.length) parts.push(local.map(takeTitle).join(', ') + ' removed from this page');
  $('undoText').textContent = parts.join('; ') + '.';
  $('undoDelete').setAttribute('aria-label', 'Undo: keep ' + plural(pending.length, 'take'));
  $('undoBar').hidden = false;
}
function hideBar() { $('undoBar').hidden = true; }

export function initDeletes() {
  $('undoDelete').addEventListener('click', undoDelete);
  // Leaving the page within the Undo time: the delete still happens. Kept in this browser while the page is hidden
  // (a phone may close it without another word), sent as the page goes, and completed on the next visit if that
  // request was lost (sessions.js); back on the page, the Undo is still there and nothing is kept.
  document.addEventListener('visibilitychange', () => {
    for (const t of pending) if (document.visibilityState === 'hidden') rememberDelete(t); else forgetDelete(t);
  });
  window.addEventListener('pagehide', () => {
    if (!pending.length) return;
    for (const t of pending) rememberDelete(t);
    deleteOnUnload(pending);
  });
}
