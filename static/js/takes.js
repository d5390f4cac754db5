/* The takes this page holds, in order, numbered as the service accepts them ("Take 3"). A take is a plain record,
 * shared; each part of it has one writer:
 *   takes.js     key, n, name (and the id index: setTakeId)
 *   director.js  id, req, seed, model, status, pcm while it streams, conn, end, parent, spliceSample/Frame,
 *                isRetake, tailSplice, muted, cancelling, dropped, stored, mismatch, streamText, firstChunks
 *                (frames per message), and its timings (sentAt, startAt, firstPcmAt, ttfaClient, lastPcmAt,
 *                endAt, gpuFirstMs)
 *   sessions.js  the same for takes that come back from the session (and their audio when it loads)
 *   playback.js  what the director heard of it: heardMs, heardAtMs, prerollMs, heardSamples, underruns
 *   editor.js    the director's notes: title, starred, note, markers (then notesChanged)
 *   deletes.js   deleting (deleted, still undoable: views hide it)
 *   typing.js    req.text of a take fed with text as it is typed (what was sent so far)
 *   director.js (region splices) and comp.js (comps) make local takes whole, through addLocalTake
 * Writers tell the others through takeEvents:
 *   'added' (take), 'trimmed' (take dropped to bound memory), 'removed' (take, {renumbered}), 'listed' (the list
 *   changed), 'updated' (take: status, audio or service state changed), 'notes' (take: its notes changed). */
import { createEmitter } from './events.js';
import { conn } from './connection.js';
import { current as currentPlay, stopPlayback } from './playback.js';

const list = [];
const byKey = new Map();
const byId = new Map();
let nextN = 1;
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

export { takeTitle } from './util.js';
/* Whether the service still holds the take on this connection (so replay, retake and its download work). */
export function serverHolds(take) { return !!(take && take.id && take.conn === conn.serial && conn.ready && !take.dropped); }

export function newTake({ req }) {
  const take = { key: 'k' + (++keySeq), n: null, id: null, req, seed: req && req.seed != null ? String(req.seed) : null,
    status: 'pending', pcm: null, conn: conn.serial, created: new Date(), name: 'the new take' };
  byKey.set(take.key, take);
  return take;
}

export function addTake(take) {
  take.n = nextN++; take.name = 'Take ' + take.n;   // numbered when the service accepts it
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
 * numbering; a take the director deletes keeps the others' numbers (they may be written down). */
export function removeTake(take, renumber = true) {
  const p = currentPlay();
  if (p && p.take === take) stopPlayback();
  const i = list.indexOf(take);
  if (i >= 0) list.splice(i, 1);
  byKey.delete(take.key); if (take.id) byId.delete(take.id);
  const renumbered = take.n != null && renumber;
  if (renumbered) {
    for (const t of list) if (t.n > take.n) { t.n--; t.name = 'Take ' + t.n; takeEvents.emit('updated', t); }
    nextN--;
  }
  takeEvents.emit('removed', take, { renumbered });
  takeEvents.emit('listed');
}

/* A take's status, audio or service state changed: its views redraw. */
export function takeUpdated(t) { takeEvents.emit('updated', t); }
/* The director changed a take's own notes (name, star, note, markers): its views redraw, the session keeps them. */
export function notesChanged(t) { takeEvents.emit('notes', t); }
