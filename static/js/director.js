/* Directing runs: what the page asked the service for and what it is receiving. Sends start (Speak), seek (replay
 * or retake from a frame) and cancel; matches the service's answers (start, seek, end, error) to the requests;
 * routes incoming PCM into the take being generated (or into a replay's store); mirrors which takes the service
 * still holds. Owns the requests in flight and the live take. */
import { SR, FRAME, now, fmtSec, plural } from './util.js';
import { frameSuffix } from './units.js';
import { PcmStore } from './pcm.js';
import { audio } from './audio-out.js';
import { conn, onClose, onMessage, onPcm } from './connection.js';
import { limits } from './service.js';
import { setStatus, setConn, showAlert, hideAlert, announce, markField } from './status.js';
import { paramValue, SAMPLING_KEYS } from './params.js';
import { collectRequest, validateScene, saveScene, seedIsFixed, wordsChoice } from './scene.js';
import { voiceName } from './voices.js';
import * as playback from './playback.js';
import { addTake, allTakes, holds, newTake, pinTakes, removeTake, setTakeId, takeById, takeTitle, takeUpdated } from './takes.js';
import { selectTake, lastTakeSummary, openLocalTake } from './selection.js';
import { createEdit, sessionId, sessionLost, sessionEvents } from './sessions.js';
import * as render from './render.js';

export const XFADE = 480;   // 10 ms: the crossfade where a region retake gives way to the old tail (or none: at the frame)

let starts = [];     // start requests sent, in order, each waiting for its server start (or error): [{take, cancelled}]
let seekReq = null;  // the seek sent and not yet acknowledged: {mode, frame, source, take, tail, preroll, cancelled}
let rx = null;       // where incoming PCM goes: {kind:'take', take} | {kind:'replay', take, store, base}
let live = null;     // the take the server is generating for us (its PCM arrives now)
// Every take that started and has not ended yet. Usually just `live`; but the service may send a replaced take's
// `end` after the next take's `start` (it stores the ended take before sending its end, and answers new
// requests meanwhile), so a take can still be open when another one is live.
const open = new Set();
let held = [];       // ids of this connection's takes the service keeps (it drops the oldest beyond limits.max_takes_kept)

export const stats = {
  samplesReceived: 0, pcmMessages: 0, strayPcm: 0, replayMismatches: 0,
  takesStarted: 0, takesEnded: 0, lastTtfaMs: null, lastEnd: null, lastSeek: null, lastSplice: null, errors: [],
};

/* The take being generated for this page, or null. */
export function liveTake() { return live; }
/* A start or seek sent and not answered yet. */
export function hasPending() { return starts.length > 0 || !!seekReq; }
/* A start sent for `take` that the service has not answered yet. */
export function pendingStart(take) { return starts.some((r) => r.take === take); }
/* The service is still working for this page: a request not answered, or a take started and not ended. */
export function busy() { return hasPending() || open.size > 0 || !!live; }
/* The service is re-sending a take (a replay). */
export function replaying() { return !!(rx && rx.kind === 'replay'); }

/* Speak: the scene as a new take. With streamText, a take whose text is fed afterwards ("speak as I type": the
 * scene's text so far is its first piece, typing.js sends the rest with `append`); the take record, or null. */
export function speak({ streamText = false } = {}) {
  if (!conn.ready) { showAlert('offline', 'Not connected yet.'); return null; }
  const req = collectRequest();
  if (!validateScene(req, { emptyText: streamText })) { setStatus('Check the scene', 'Some fields need attention.'); return null; }
  hideAlert();
  audio.init().catch(() => {});
  playback.stopPlayback();
  discardUnheard();
  const take = newTake({ req: { ...req, referenceName: voiceName(req.reference), ...(streamText ? { stream_text: true } : {}) } });
  take.sentAt = now();
  const r = { take };
  starts.push(r);
  const msg = { type: 'start', ...req, take: take.key, channels: req.channels || 1 };
  if (!seedIsFixed()) delete msg.seed;
  if (streamText) { msg.stream_text = true; take.streamText = true; }
  if (!conn.send(msg)) { starts.pop(); return null; }
  setStatus('Requesting a take…', streamText ? 'Its text follows as you type.' : 'Waiting for the first audio.');
  render.refresh();
  saveScene();
  return take;
}

/* Text was sent to a take fed with text: until its first audio, "heard after" counts from the last text sent
 * (before it, the take was waiting for words, not for the service). */
export function noteTextSent(take) { if (take.firstPcmAt == null) take.sentAt = now(); }

/* Cancel: stop the audio, and whatever the service is generating or about to. */
export function cancelAll() {
  const hadPlayback = !!playback.current();
  playback.stopPlayback();
  if (busy() || replaying()) {
    conn.send({ type: 'cancel' });
    if (live) live.cancelling = true;
    setStatus('Cancelling…', 'Audio stopped.');
    const pend = [...starts, seekReq].filter(Boolean);
    for (const r of pend) r.cancelled = true;      // whatever the service still sends for them is kept silent
    if (pend.length) setTimeout(() => {            // a request cancelled while being admitted may never be answered
      const before = starts.length + (seekReq ? 1 : 0);
      starts = starts.filter((r) => !pend.includes(r));
      if (pend.includes(seekReq)) seekReq = null;
      if (starts.length + (seekReq ? 1 : 0) !== before) { if (!busy()) setStatus('Cancelled', ''); render.refresh(); }
    }, 5000);
  } else if (hadPlayback) setStatus('Stopped', '');
  if (replaying()) { rx.store.complete = true; rx = null; }
  render.refresh();
}

/* Replay (mode 'replay') or retake (mode 'retake') `src` from the frame at sample `at`.
 * direction(): the retake's direction {seedMode, seed, instruction, text, useSampling, prerollSec}, or null when
 * it is not valid (it marks the field); tail: keep the old tail after a region ({to, source}). */
export function seek(mode, src, at, { direction = null, tail = null } = {}) {
  const frame = Math.floor(at / FRAME);
  audio.init().catch(() => {});
  playback.stopPlayback();
  const msg = { type: 'seek', take: src.id, frame, mode };
  let take = null, preroll = 0;
  if (mode === 'retake') {
    const d = direction ? direction() : { seedMode: 'new', instruction: '', text: '', useSampling: false, prerollSec: 0 };
    if (!d) return;
    if (d.seedMode === 'same') msg.seed = src.seed;
    else if (d.seedMode === 'fixed') msg.seed = d.seed;
    // 'new': the service picks a fresh seed and reports it in its start
    if (d.instruction.trim()) msg.instruction = d.instruction;
    if (d.text.trim()) msg.text = d.text;
    const req = { ...(src.req || {}), seed: msg.seed ?? null };
    if (msg.instruction) req.instruction = msg.instruction;
    if (msg.text) req.text = msg.text;
    if (d.useSampling) for (const k of SAMPLING_KEYS) { const v = paramValue(k); if (v !== undefined) { msg[k] = v; req[k] = v; } }
    const words = wordsChoice();                 // the Scene's "Word timing" now, not the source take's
    if (words != null) { msg.words = words; req.words = words; }
    take = newTake({ req });
    take.seed = msg.seed ?? null;
    take.sentAt = now();
    preroll = d.prerollSec;
  }
  discardUnheard();
  seekReq = { mode, frame, source: src, take, tail, preroll };
  if (!conn.send(msg)) { seekReq = null; return; }
  setStatus(mode === 'retake' ? 'Retaking ' + takeTitle(src) + ' from ' + fmtSec(frame * FRAME) + frameSuffix(frame * FRAME) + '…' : 'Replaying ' + takeTitle(src) + '…',
    mode === 'retake' ? 'Everything before ' + fmtSec(frame * FRAME) + ' is kept exactly.' : 'The service re-sends the stored audio.');
  render.refresh();
}

/* ------------------------------------------------------------------ the service's answers */

function onHello() { held = []; }

function onStart(msg) {
  let take = null;
  if (rx && rx.kind === 'replay' && msg.take === rx.take.id) { rx.started = true; return; }
  if (msg.replay) return;                 // a replay we stopped listening to
  if (rx && rx.kind === 'take' && rx.take.id === msg.take) take = rx.take;                  // retake after its seek ack
  else if (starts.length) {
    // The server answers start requests in order (each with a start, or an error). If it echoes our
    // label, trust that instead: requests before the labelled one will never start.
    let i = msg.label != null ? starts.findIndex((r) => r.take.key === msg.label) : -1;
    if (i < 0) i = 0;
    const r = starts[i]; starts.splice(0, i + 1);
    take = r.take; take.muted = !!r.cancelled;
  }
  else take = newTake({ req: null });                                                         // not ours (should not happen)
  if (!take.id) setTakeId(take, msg.take);
  serviceKeeps(take.id);
  take.seed = msg.seed != null ? String(msg.seed) : take.seed;
  take.model = msg.model || take.model;
  take.gpuFirstMs = msg.gpu_first_ms;
  take.status = 'streaming';
  take.conn = conn.serial;
  const ch = msg.channels || 1;
  if (!take.pcm) take.pcm = new PcmStore(ch);
  else if (take.pcm.ch !== ch) take.pcm = new PcmStore(ch);
  take.startAt = now();
  rx = { kind: 'take', take };
  live = take; open.add(take);
  stats.takesStarted++;
  if (!holds(take)) addTake(take);
  if (!take.isRetake) {             // a fresh take: follow it and play it as it streams
    selectTake(take, 0);
    if (!take.muted) playback.startStream(take, take.pcm, 0, 0, 'live');
    announce('Speaking ' + takeTitle(take) + '.');
    render.showWaveOnPhone();
  }
  takeUpdated(take); render.refresh(); render.drawAll();
}

function onAudio(pcm) {
  stats.pcmMessages++;
  if (!rx) { stats.strayPcm += pcm.length; return; }
  if (rx.kind === 'take') {
    const take = rx.take, before = take.pcm.length;
    take.pcm.append(pcm);
    const n = take.pcm.length - before;
    stats.samplesReceived += n;
    if (!take.firstChunks) take.firstChunks = [];
    if (take.firstChunks.length < 8) take.firstChunks.push(n / FRAME);   // frames per message: sound starts from the first
    if (take.firstPcmAt == null) {
      take.firstPcmAt = now();
      take.ttfaClient = take.firstPcmAt - take.sentAt;
      stats.lastTtfaMs = take.ttfaClient;
      take.rxBase = before; take.lagMs = 0; take.leadMs = Infinity;
    }
    take.lastPcmAt = now();
    // The longest its audio fell behind real time over any stretch after its first chunk: the wall time of the
    // stretch past the audio that came in it (this page's own stalls included: it feeds the player). A player
    // that starts with at least that much buffered never starves; leadMs is the least (time - audio) so far.
    const at = take.lastPcmAt - take.firstPcmAt, ms = (samples) => (samples - take.rxBase) / SR * 1000;
    take.lagMs = Math.max(take.lagMs, at - ms(before) - take.leadMs);
    take.leadMs = Math.min(take.leadMs, at - ms(take.pcm.length));
    const ts = take.tailSplice;
    if (ts && !ts.cut && take.pcm.length >= ts.to + XFADE) { ts.cut = true; conn.send({ type: 'cancel' }); }   // the region is re-done
  } else {
    const before = rx.store.length;
    rx.store.append(pcm);
    stats.samplesReceived += rx.store.length - before;
    const heldPcm = rx.take.pcm, ch = heldPcm.ch;
    const from = rx.base + before, to = Math.min(rx.base + rx.store.length, heldPcm.length);
    for (let i = from; i < to; i++) if (heldPcm.data[i * ch] !== rx.store.data[(i - rx.base) * ch]) { stats.replayMismatches++; break; }
  }
  playback.feed();
  render.scheduleDraw();
}

function onSeekAck(msg) {
  const p = seekReq;
  seekReq = null;
  const source = takeById(msg.from_take);
  stats.lastSeek = { take: msg.take, from_take: msg.from_take, frame: msg.frame, sample: msg.sample, requestedFrame: p ? p.frame : null, mode: p ? p.mode : null };
  if (!source) { showAlert('seek', 'The service acknowledged a seek on a take this page does not hold.'); return; }
  if (msg.sample !== msg.frame * FRAME) showAlert('protocol', `seek ack sample ${msg.sample} is not frame ${msg.frame} × ${FRAME}`);
  const sample = msg.sample;
  if (msg.take === msg.from_take) {                                  // replay: the same take re-sent from the sample
    if (p && p.cancelled) return;
    const store = new PcmStore(source.pcm.ch);
    rx = { kind: 'replay', take: source, store, base: sample };
    selectTake(source, sample);
    playback.startStream(source, store, 0, sample, 'replay');
    setStatus('Replaying ' + takeTitle(source), 'From ' + fmtSec(sample) + frameSuffix(sample) + ', re-sent by the service.');
    render.refresh();
    return;
  }
  // Retake: the new take keeps the source's samples before the splice exactly, then the continuation.
  const take = p && p.take ? p.take : newTake({ req: source.req });
  setTakeId(take, msg.take);
  serviceKeeps(take.id);
  take.parent = source.key; take.spliceSample = sample; take.spliceFrame = msg.frame; take.isRetake = true;
  if (p && p.tail && p.tail.source === source) take.tailSplice = p.tail;     // a region retake that keeps the old tail
  take.pcm = source.pcm.prefix(sample);
  take.status = 'streaming'; take.conn = conn.serial;
  stats.lastSplice = { take: msg.take, from_take: msg.from_take, frame: msg.frame, sample, prefixSamples: take.pcm.length,
    parentHeld: source.pcm.length, padded: source.pcm.length < sample };
  rx = { kind: 'take', take };
  live = take; open.add(take);
  addTake(take);
  selectTake(take, sample);
  const pre = Math.round((p ? p.preroll : 0) * SR);
  take.muted = !!(p && p.cancelled);
  if (!take.muted) playback.startStream(take, take.pcm, Math.max(0, sample - pre), 0, 'retake');
  announce('Retaking ' + takeTitle(source) + ' from ' + fmtSec(sample) + ' as ' + take.name + '.');
  render.showWaveOnPhone();
  takeUpdated(take); render.refresh(); render.drawAll();
}

function onEnd(msg) {
  if (rx && rx.kind === 'replay' && rx.take.id === msg.take) {
    rx.store.complete = true; rx = null; playback.feed(); render.refresh(); return;
  }
  if (msg.replay) return;                 // the end of a replay we stopped listening to: the take itself is unchanged
  if (msg.take) serviceKeeps(msg.take);
  let take = takeById(msg.take);
  if (!take && starts.length) take = starts.shift().take;    // ended before it ever started
  if (!take) return;
  take.end = msg;
  take.status = msg.reason || 'done';
  if (sessionId() && msg.n_frames > 0 && take.conn === conn.serial && !take.discarded) take.stored = sessionId();   // kept before its end was sent
  take.endAt = now();
  if (take.pcm) take.pcm.complete = true;
  if (rx && rx.take === take) rx = null;
  if (live === take) live = null;
  open.delete(take);
  stats.takesEnded++;
  stats.lastEnd = { ...msg, receivedSamples: take.pcm ? take.pcm.length : 0 };
  if (take.pcm && msg.n_frames != null && take.pcm.length !== msg.n_frames * FRAME) take.mismatch = `holds ${take.pcm.length} samples, the service reports ${msg.n_frames} frames`;
  playback.feed();
  const kept = !!(take.pcm && take.pcm.length);
  // Nothing to keep: no audio, or replaced by a new Speak before the director heard a quarter second of it. That is
  // decided when the new Speak is pressed (discardUnheard: the session is told then): a take whose start was still on
  // its way may play meanwhile, but it goes all the same, or the page would keep a take the session does not. Whatever
  // its end: a short one may end on its own before the new start replaces it (two Speaks in the same instant), and the
  // session still does not keep it (the page then showed it beside the next take, both numbered as the next one).
  if (!kept && (msg.reason === 'replaced' || msg.reason === 'cancelled')) removeTake(take);
  else if (take.discarded || (msg.reason === 'replaced' && unheard(take))) removeTake(take);
  else takeUpdated(take);
  if (take.tailSplice) {
    const ts = take.tailSplice;
    if (take.pcm && take.pcm.length >= ts.to + XFADE && holds(ts.source)) keepOldTail(take, ts);
    else showAlert('splice', 'The retake ended before the region\'s end, so the old tail was not brought back.', { info: true });
    render.refresh(); render.drawAll();
    return;
  }
  if (!busy()) {
    const what = { done: 'finished', max_frames: 'reached its frame limit', cancelled: 'cancelled', replaced: 'replaced', shutdown: 'stopped: the service is shutting down', error: 'ended with an error' }[msg.reason] || msg.reason;
    if (kept || msg.reason !== 'replaced') announce(takeTitle(take) + ' ' + what + (kept ? ', ' + fmtSec(take.pcm.length) + '.' : '.'));
    if (!playback.current() || msg.reason === 'cancelled') setStatus(msg.reason === 'cancelled' ? 'Cancelled' : 'Ready', msg.reason === 'cancelled' ? takeTitle(take) + ' cancelled at ' + fmtSec(kept ? take.pcm.length : 0) + '.' : lastTakeSummary());
  }
  render.refresh(); render.drawAll();
  if (msg.reason === 'error') showAlert('error', 'The take ended with an error.');
}

function onServerError(msg) {
  stats.errors.push({ code: msg.code, message: msg.message, field: msg.field, take: msg.take });
  if (stats.errors.length > 50) stats.errors.shift();
  if (msg.field === 'session') { sessionLost(msg); return; }      // an answer to resume, not to a take
  if (!(msg.take && takeById(msg.take))) {          // not about a take we know: a request of ours was refused
    if (seekReq && (msg.field === 'take' || msg.field === 'frame' || !starts.length)) seekReq = null;
    else if (starts.length) starts.shift();
  }
  if (msg.take) {
    const t = takeById(msg.take);
    if (t && t.status === 'streaming') { t.status = 'error'; t.pcm && (t.pcm.complete = true); if (live === t) live = null; open.delete(t); if (rx && rx.take === t) rx = null; takeUpdated(t); }
  }
  if (msg.field) markField(msg.field, msg.message);
  const retry = msg.code === 'busy' || msg.code === 'loading' || msg.code === 'rate_limited';
  showAlert(msg.code || 'error', msg.message || 'The service reported an error.', { retry });
  if (!busy() && !playback.current()) setStatus(msg.code === 'busy' ? 'Service busy' : msg.code === 'loading' ? 'Model loading' : msg.code === 'rate_limited' ? 'Limit reached' : 'Not started', msg.message || '');
  render.refresh(); playback.feed();
}

function onDisconnected(ev) {
  setConn('closed', 'Disconnected');
  for (const lost of new Set([...open, live].filter(Boolean))) {
    if (lost.status === 'streaming') lost.status = 'disconnected';
    lost.pcm && (lost.pcm.complete = true); takeUpdated(lost);
  }
  if (replaying()) rx.store.complete = true;
  live = null; rx = null; starts = []; seekReq = null; open.clear();
  playback.feed();                // let the player drain what it holds
  render.refresh();
  for (const t of allTakes()) takeUpdated(t);
  if (ev && ev.code === 1008) showAlert('closed', 'The service closed the connection: ' + (ev.reason || 'policy violation'));
}

/* A take the director never really had: under a quarter second of it heard, no notes on it. */
function unheard(t) { return (t.heardSamples || 0) < SR / 4 && !t.title && !t.starred && !t.note; }
/* The live take (and any start not answered yet) is about to be replaced: unheard, the session is told not to
 * keep it (it then takes no number there), and the page drops it when it ends. */
function discardUnheard() {
  if (!sessionId()) return;
  const t = live;
  if (t && t.id && !t.discarded && unheard(t)) { t.discarded = true; conn.send({ type: 'discard', take: t.id }); }
  for (const r of starts) if (!r.take.discarded) { r.take.discarded = true; conn.send({ type: 'discard', take: r.take.key }); }
}

/* The service keeps the last limits.max_takes_kept takes of a connection (the running one never goes): mirror
 * that, so a take it has dropped is not offered for replay, retake or service download (they would fail). */
function serviceKeeps(id) {
  if (sessionId()) return;            // bound to a stored session: the service keeps takes until deleted
  if (held.includes(id)) return;
  held.push(id);
  const max = limits().max_takes_kept || 32;
  while (held.length > max) {
    const i = held.findIndex((x) => !(live && live.id === x));
    if (i < 0) break;
    const [gone] = held.splice(i, 1);
    const t = takeById(gone);
    if (t) { t.dropped = true; takeUpdated(t); }
  }
  render.refresh();
}

/* The region re-done, the rest kept: the retake up to the region's end, then the old take's tail (joined with
 * ts.crossfade samples of crossfade, or at the frame). Bound to a session the service makes it from the two stored
 * takes and keeps it (moss_rt/splices.py), a take like any other; otherwise it is made here and lives in the page. */
async function keepOldTail(retake, ts) {
  const source = ts.source, xfade = ts.crossfade ?? XFADE;
  const join = xfade ? Math.round(xfade / SR * 1000) + ' ms crossfade' : 'joined at the frame';
  let spliced;
  if (sessionId()) {
    try {
      spliced = await createEdit('splice', [{ take: retake, from: 0, to: ts.to }, { take: source, from: ts.to, to: source.pcm.length }], { crossfade: xfade });
    } catch (e) { showAlert('splice', 'The splice could not be kept: ' + e.message); return; }
    selectTake(spliced, 0);
    stats.lastSplice = { ...(stats.lastSplice || {}), kept: spliced.id };
  } else spliced = spliceOldTail(retake, source, ts.to, xfade);
  announce(takeTitle(spliced) + ': the region re-done, the old tail back after ' + fmtSec(ts.to) + '.');
  setStatus('Spliced', takeTitle(spliced) + ': new audio ' + fmtSec(retake.spliceSample) + ' – ' + fmtSec(ts.to) + ', then ' + takeTitle(source) + '\'s tail (' + join + ').');
  render.refresh(); render.drawAll();
}

/* Without a session: new[0, to) + a crossfade into old[to, to + x) + old[to + x, end), made here (the service does
 * the same to the sample: moss_rt/splices.py). */
function spliceOldTail(retake, source, to, xfade) {
  const ch = retake.pcm.ch, out = new PcmStore(ch, source.pcm.length + SR);
  out.append(retake.pcm.data.subarray(0, to * ch));
  const x = new Int16Array(xfade * ch);
  for (let i = 0; i < xfade; i++) {
    const w = (i + 0.5) / xfade;
    for (let c = 0; c < ch; c++) x[i * ch + c] = Math.round(retake.pcm.sample(to + i, c) * (1 - w) + source.pcm.sample(to + i, c) * w);
  }
  out.append(x);
  out.append(source.pcm.data.subarray((to + xfade) * ch, source.pcm.length * ch));
  return openLocalTake(out, { req: retake.req, seed: retake.seed, parent: source.key, spliceSample: retake.spliceSample, spliceFrame: retake.spliceFrame,
    splices: [{ sample: to, kind: xfade ? 'crossfade ' + Math.round(xfade / SR * 1000) + ' ms' : 'join' }], spliceOf: { retake: retake.key, source: source.key, to } });
}

export function initDirector() {
  pinTakes((t) => t === live || open.has(t));
  onMessage('hello', onHello);
  onMessage('start', onStart);
  onMessage('seek', onSeekAck);
  onMessage('end', onEnd);
  onMessage('error', onServerError);
  onPcm(onAudio);
  onClose(onDisconnected);
  sessionEvents.on('resumed', (fresh) => {
    if (!busy()) setStatus('Session resumed', plural(fresh, 'take') + ' back from the service, every one playable and retakeable.');
  });
  playback.playbackEvents.on('drained', () => { if (!busy()) setStatus('Ready', lastTakeSummary()); });
}
