/* The takes this page holds, in order, numbered as the service accepts them ("Take 3"). Bound to a session, the
 * session numbers its takes (once, never reused, even after deletes): a take gets a number here when the service
 * starts it, and the session's number (setTakeNumber, `numbered`) once it is stored. A take is a plain record,
 * shared; each part of it has one writer:
 *   takes.js     key, n, name, numbered (and the id index: setTakeId)
 *   director.js  id, req, seed, model, status, pcm while it streams, conn, end, parent, spliceSample/Frame,
 *                isRetake, tailSplice, muted, cancelling, dropped, stored, discarded, mismatch, streamText,
 *                firstChunks (frames per message), and its timings (sentAt, startAt, firstPcmAt, ttfaClient,
 *                lastPcmAt, endAt, gpuFirstMs; lagMs: the longest its audio fell behind real time over any
 *                stretch after the first chunk, with rxBase and leadMs that measure it)
 *   sessions.js  the same for takes that come back from the session (and their audio when it loads)
 *   playback.js  what the director heard of it: heardMs, heardAtMs, prerollMs, heardSamples, underruns
 *   editor.js    the director's notes: title, starred, note, markers (then notesChanged)
 *   sessions.js  kind, parts, crossfade, hasCodes of a splice or comp the session keeps (createEdit)
 *   deletes.js   deleting (deleted, still undoable: views hide it)
 *   typing.js    req.text of a take fed with text as it is typed (what was sent so far)
 *   director.js (region splices) and comp.js (comps) make local takes whole, through addLocalTake, when the
 *                service keeps no session
 * Writers tell the others through takeEvents:
 *   'added' (take), 'trimmed' (take dropped to bound memory), 'removed' (take, {renumbered}), 'listed' (the list
 *   changed), 'updated' (take: status, audio or service state changed), 'notes' (take: its notes changed),
 *   'numbered' (take: the session gave it another number than the one shown while it streamed). */
import { createEmitter } from './events.js';
import { conn } from './connection.js';
import { current as currentPlay, stopPlayback } from './playback.js';
import { takeTitle } from './util.js';

const list = [];
const byKey = new Map();
const byId = new Map();
let nextN = 1;
let sessionNumbers = false;    // bound to a session: it numbers the takes, nothing is renumbered here
let keySeq = 0;
let keepAtLeast = 0;           // the session's quota: the page holds at least that many takes
const pins = [];               // predicates: takes that must not be dropped to bound memory

export const takeEvents = createEmitter();

/* Every take, oldest first (read only). */
export function allTakes() { return list; }
export function holds(take) { return list.includes(take); }
export function takeByKey(key) { return byKey.get(key); }
export function takeById(id) { return byId.get(id); }
/* A take by the service's id or the page's key. */
export function findTake(idOrKey) { return byId.get(idOrKey) || byKey.get(idOrKey); }
/* Record the service's id of a take (once the service names it). */
export function setTakeId(take, id) { take.id = id; byId.set(id, take); }
/* Never drop a take for which pred(take) is true (playing, shown, compared). */
export function pinTakes(pred) { pins.push(pred); }
/* The service keeps a session of up to n takes: hold at least that many. */
export function holdAtLeast(n) { keepAtLeast = n || 0; }

export { takeTitle };
/* A splice's or comp's source, by name: "Keeper (Take 2)", or "Take 2 (deleted)" once it left the session. */
export function partTitle(p) { const t = p.take && byId.get(p.take); return t ? takeTitle(t) : 'Take ' + p.number + ' (deleted)'; }
/* Whether the service still holds the take on this connection (so replay, retake and its download work). */
export function serverHolds(take) { return !!(take && take.id && take.conn === conn.serial && conn.ready && !take.dropped); }

export function newTake({ req }) {
  const take = { key: 'k' + (++keySeq), n: null, id: null, req, seed: req && req.seed != null ? String(req.seed) : null,
    status: 'pending', pcm: null, conn: conn.serial, created: new Date(), name: 'the new take' };
  byKey.set(take.key, take);
  return take;
}

/* The page is bound to a session whose next take number is `next`: the session numbers takes from now on. */
export function numberFromSession(next) { sessionNumbers = true; nextN = Math.max(nextN, next || 1); }
/* The number the session gave the take (it keeps it for good); its views redraw. */
export function setTakeNumber(take, n) {
  take.numbered = true;
  nextN = Math.max(nextN, n + 1);
  if (take.n === n) return;
  take.n = n; take.name = 'Take ' + n;
  takeEvents.emit('updated', take); takeEvents.emit('numbered', take);
}

export function addTake(take) {
  if (take.numbered) nextN = Math.max(nextN, take.n + 1);   // came back from the session with its number
  else { take.n = nextN++; take.name = 'Take ' + take.n; }   // numbered when the service accepts it
  list.push(take);
  takeEvents.emit('added', take);
  // Keep memory bounded: drop the oldest takes beyond 60, or beyond the session's quota when the service keeps
  // them (they stay in the session on disk, and come back on a reload).
  while (list.length > Math.max(60, keepAtLeast)) {
    const old = list.find((t) => !pins.some((pinned) => pinned(t)));
    if (!old) break;
    list.splice(list.indexOf(old), 1); byKey.delete(old.key); if (old.id) byId.delete(old.id);
    takeEvents.emit('trimmed', old);
  }
  takeEvents.emit('listed');
}

/* A take made here from held audio (a splice or a comp): playable, comparable, exportable as WAV. */
export function addLocalTake(pcm, props) {
  const t = newTake({ req: props.req || null });
  Object.assign(t, props, { pcm, status: 'done', local: true, conn: null });
  pcm.complete = true;
  addTake(t);
  return t;
}

/* renumber: a take the director never really had (no audio, or replaced unheard) leaves no gap in the
 * numbering; a take the director deletes keeps the others' numbers (they may be written down). Bound to a
 * session, the session's numbers never change (nor come back); only numbers shown while takes stream, before the
 * session numbered them, close up behind a take that was never kept. */
export function removeTake(take, renumber = true) {
  const p = currentPlay();
  if (p && p.take === take) stopPlayback();
  const i = list.indexOf(take);
  if (i >= 0) list.splice(i, 1);
  byKey.delete(take.key); if (take.id) byId.delete(take.id);
  const renumbered = take.n != null && (sessionNumbers ? !take.numbered : renumber);
  if (renumbered) {
    for (const t of list) if (t.n > take.n && !(sessionNumbers && t.numbered)) { t.n--; t.name = 'Take ' + t.n; takeEvents.emit('updated', t); }
    if (!list.some((t) => t.n === nextN - 1)) nextN--;
  }
  takeEvents.emit('removed', take, { renumbered });
  takeEvents.emit('listed');
}

/* A take's status, audio or service state changed: its views redraw. */
export function takeUpdated(t) { takeEvents.emit('updated', t); }
/* The director changed a take's own notes (name, star, note, markers): its views redraw, the session keeps them. */
export function notesChanged(t) { takeEvents.emit('notes', t); }
