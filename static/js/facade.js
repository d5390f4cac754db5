/* window.studio: the page's test and automation facade. Counters (stats, a live view over each module's own
 * counters) and read-only views of what the page holds, plus a few commands (select, place the playhead, set a
 * region, drop the connection). The browser tests (tests/browser/) drive and check the page through it. */
import { FRAME, describeRtf } from './util.js';
import { hello } from './service.js';
import { audio, stats as audioStats } from './audio-out.js';
import { conn, stats as connectionStats } from './connection.js';
import * as playback from './playback.js';
import { allTakes, findTake, holds, takeByKey } from './takes.js';
import { cursorSample, selectTake, selectedTake, setCursor } from './selection.js';
import { busy, stats as directorStats } from './director.js';
import { sessionId, stats as sessionStats } from './sessions.js';
import { currentRegion, setRegion, viewRange, stats as editorStats } from './editor.js';
import { compSegments } from './comp.js';
import { compared, playingSide } from './compare.js';
import { pendingDeletes, setUndoGrace, stats as deleteStats, undoGrace } from './deletes.js';
import { typedSoFar, typingOpen, stats as typingStats } from './typing.js';
import { currentScript, stats as scriptJobStats } from './script-job.js';
import { stats as scriptPanelStats } from './script-panel.js';
import { stats as wordStats, wordsOf } from './words.js';

/* One object whose properties read through to the modules' counters (each counter has one owner). */
function liveStats(...sources) {
  const view = {};
  for (const src of sources) for (const key of Object.keys(src)) {
    if (key in view) throw new Error('two modules count ' + key);
    Object.defineProperty(view, key, { get: () => src[key], enumerable: true });
  }
  return view;
}

function describeTake(t) {
  return { key: t.key, name: t.name, id: t.id, status: t.status, seed: t.seed, samples: t.pcm ? t.pcm.length : 0,
    channels: t.pcm ? t.pcm.ch : null, parent: t.parent ? (takeByKey(t.parent) || {}).id || null : null, spliceSample: t.spliceSample || 0,
    spliceFrame: t.spliceFrame || 0, end: t.end || null, ttfaMs: t.ttfaClient ?? null, heardMs: t.heardMs ?? null,
    heardAtMs: t.heardAtMs ?? null, prerollMs: t.prerollMs ?? null, lagMs: t.lagMs ?? null, firstChunks: t.firstChunks || [], mismatch: t.mismatch || null, request: t.req, deleting: !!t.deleting,
    underruns: t.underruns || 0, dropped: !!t.dropped, title: t.title || null, starred: !!t.starred, note: t.note || '',
    local: !!t.local, stored: !!t.stored, loaded: !!(t.pcm && t.pcm.complete), splices: (t.splices || []).map((x) => ({ ...x })), markers: (t.markers || []).map((m) => ({ ...m })),
    number: t.n ?? null, numbered: !!t.numbered, kind: t.kind || (t.local ? (t.comp ? 'comp' : 'splice') : 'take'), hasCodes: t.hasCodes !== false,
    crossfade: t.crossfade || 0, parts: (t.parts || []).map((p) => ({ ...p })) };
}

export function installFacade() {
  window.studio = {
    stats: liveStats(connectionStats, directorStats, playback.stats, audioStats, sessionStats, editorStats, deleteStats, typingStats,
      wordStats, scriptJobStats, scriptPanelStats),
    get connected() { return conn.ready; },
    get hello() { return hello(); },
    get audioMode() { return audio.mode; },
    get audioState() { return audio.ctx ? audio.ctx.state : null; },
    get busy() { return busy(); },
    get playing() { return !!playback.current(); },
    get cursor() { return cursorSample(); },
    get selected() { const t = selectedTake(); return t ? t.key : null; },
    get playingTake() { const p = playback.current(); return p ? p.take.key : null; },
    get playhead() { return playback.playheadSample(); },
    get audioLatencyMs() { return audio.latencyMs(); },
    get connectionSerial() { return conn.serial; },
    get session() { return sessionId(); },
    takes() { return allTakes().map(describeTake); },
    take(idOrKey) { const t = findTake(idOrKey); return t ? (holds(t) ? describeTake(t) : undefined) : null; },
    /* Samples [from, to) of channel c of a take, as a plain array (tests check splices with it). */
    samples(idOrKey, from, to, c = 0) {
      const t = findTake(idOrKey); if (!t || !t.pcm) return null;
      const out = []; for (let i = Math.max(0, from); i < Math.min(to, t.pcm.length); i++) out.push(t.pcm.sample(i, c)); return out;
    },
    /* Samples [from, to) of every channel of a take, interleaved, as base64 of little-endian int16 with the channel
     * count: {channels, data}. Tests read whole takes with it: a plain array of a take's 100k+ samples took ~2 s
     * through the DevTools protocol. */
    pcm(idOrKey, from = 0, to = null) {
      const t = findTake(idOrKey); if (!t || !t.pcm) return null;
      const p = t.pcm, a = Math.max(0, from), b = Math.min(to == null ? p.length : to, p.length);
      const values = p.data.subarray(a * p.ch, Math.max(a, b) * p.ch), view = new DataView(new ArrayBuffer(values.length * 2));
      values.forEach((v, i) => view.setInt16(2 * i, v, true));
      const bytes = new Uint8Array(view.buffer); let text = '';
      for (let i = 0; i < bytes.length; i += 0x8000) text += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
      return { channels: p.ch, data: btoa(text) };
    },
    setCursorFrame(frame) { setCursor(frame * FRAME); return cursorSample(); },
    select(idOrKey) { const t = findTake(idOrKey); if (t) selectTake(t, cursorSample()); return !!t; },
    disconnect() { conn.drop(4001, 'test'); },
    describeRtf,
    setRegion(fromFrame, toFrame) { setRegion(fromFrame == null ? null : fromFrame * FRAME, toFrame * FRAME); return currentRegion(); },
    get region() { return currentRegion(); },
    get view() { const t = selectedTake(); return t && t.pcm ? viewRange(t) : null; },
    get loop() { const l = playback.loopRegion(); return l ? { ...l } : null; },
    get comp() { return compSegments().map((g) => ({ key: g.take.key, from: g.from, to: g.to })); },
    /* A/B: the keys in the slots and the side playing ('a', 'b' or null). */
    get ab() { const a = compared('a'), b = compared('b'); return { a: a ? a.key : null, b: b ? b.key : null, playing: playingSide() }; },
    get pendingDeletes() { return pendingDeletes().map((t) => t.key); },
    /* The Undo time after a delete, in ms (6,000; tests shorten it). */
    get undoGraceMs() { return undoGrace(); },
    set undoGraceMs(ms) { setUndoGrace(ms); },
    get typing() { return { open: typingOpen(), sent: typedSoFar() }; },
    /* The script the Script panel follows, as the service last said it ({script, state, lines: [...]}), or null. */
    get script() { const s = currentScript(); return s ? JSON.parse(JSON.stringify(s)) : null; },
    markers(idOrKey) { const t = findTake(idOrKey); return t ? (t.markers || []).map((m) => ({ ...m })) : null; },
    /* A take's word timing as the page holds it: {words: [{word, start, end, flags?}], complete, loading, error}. */
    words(idOrKey) { const s = wordsOf(findTake(idOrKey)); return s ? JSON.parse(JSON.stringify({ words: s.words, complete: s.complete && !s.gap, loading: s.loading, error: s.error })) : null; },
  };
}
