/* Playback: one stream at a time into the player (audio-out.js). A stream plays a PcmStore from a position: a take
 * as it arrives ('live', 'retake'), a replay the service re-sends ('replay'), or audio the page holds ('local',
 * optionally a region loop). Feeds the player ahead of its playhead, follows its reports, and records on a live
 * take what the director heard (heardMs, heardSamples, underruns). */
import { SR, FRAME, now, clamp, fmtSec, takeTitle } from './util.js';
import { createEmitter } from './events.js';
import { audio, onPlayerState } from './audio-out.js';
import { paramValue } from './params.js';
import { setStatus, showAlert } from './status.js';
import * as render from './render.js';

const HIGH_WATER = SR * 2;          // audio handed to the player ahead of the playhead

/* The stream playing: {id, take, store, pos, startPos, base, kind, loop, fed, played, level, cushion, primed, ...}. */
let play = null;
let streamSeq = 0;

/* 'drained': a stream played to its end. */
export const playbackEvents = createEmitter();

export const stats = {
  samplesPlayed: 0, underruns: 0, bufferLevel: 0, bufferMs: 0, cushion: 0, playing: false,
  streamsStarted: 0, streamsDrained: 0, loopLog: [],
};

/* The stream playing (read only: use the functions below to change it), or null. */
export function current() { return play; }
/* Whether `take` is what plays, from the page's own audio (a Play button shows Stop). */
export function playsLocally(take) { return !!(play && play.kind === 'local' && play.take === take); }
/* The region loop playing ({from, to}), or null. */
export function loopRegion() { return play && play.loop ? play.loop : null; }
export { HIGH_WATER };

/* The jitter cushion the player waits for before it starts (the panel's value, in samples). */
function cushionSamples() { return Math.round(clamp(+paramValue('cushion_ms') || 200, 20, 3000) * SR / 1000); }

/* Play `store` from sample `from`; `base` is where the store starts in the take (a replay's is the seek point). */
export function startStream(take, store, from, base, kind, loop = null) {
  const id = ++streamSeq;
  play = { id, take, store, pos: from, startPos: from, base, kind, fed: 0, played: 0, level: 0, endSent: false, primed: false };
  if (loop) play.loop = loop;
  stats.streamsStarted++;
  audio.init().then(() => {
    if (!play || play.id !== id) return;
    play.cushion = cushionSamples();
    audio.post({ t: 'stream', id, cushion: play.cushion });
    play.posted = true;
    feed();
    if (audio.ctx.state !== 'running') {
      audio.ctx.resume();
      setTimeout(() => { if (audio.ctx.state !== 'running' && play) showAlert('audio', 'The browser is holding audio back: click anywhere on the page to hear it.', { info: true }); }, 400);
    }
  }).catch(() => {});
  render.refresh();
  render.scheduleDraw();
}

/* Hand the player what it has room for (call whenever the store grew or completed). */
export function feed() {
  const p = play;
  if (!p || !p.posted || !audio.ready) return;
  // At least the player's cushion (and a bit) ahead: it starts, and restarts after an underrun with a grown
  // cushion (up to 3 s), only once that much is buffered; held below it, it would wait for the take's end.
  let room = Math.max(HIGH_WATER, (p.cushion || 0) + SR / 2) - (p.fed - p.played);
  if (p.loop) {                 // a region loop: [from, to) over and over, never an end
    const { from, to } = p.loop;
    while (room > 0) {
      if (p.pos >= to) p.pos = from;
      const n = Math.min(room, to - p.pos, SR / 4);
      const { l, r } = p.store.floatLR(p.pos, p.pos + n);
      audio.post({ t: 'data', id: p.id, l, r }, [l.buffer, r.buffer]);
      stats.loopLog.push([p.pos, p.pos + n]); if (stats.loopLog.length > 400) stats.loopLog.shift();
      p.pos += n; p.fed += n; room -= n;
    }
    return;
  }
  while (room > 0 && p.pos < p.store.length) {
    const n = Math.min(room, p.store.length - p.pos, SR / 4);
    const { l, r } = p.store.floatLR(p.pos, p.pos + n);
    audio.post({ t: 'data', id: p.id, l, r }, [l.buffer, r.buffer]);
    p.pos += n; p.fed += n; room -= n;
  }
  if (!p.endSent && p.store.complete && p.pos >= p.store.length) { audio.post({ t: 'end', id: p.id }); p.endSent = true; }
}

export function stopPlayback() {
  if (play) { audio.ready && audio.post({ t: 'stop' }); play = null; }
  stats.playing = false; stats.bufferLevel = 0; stats.bufferMs = 0;
  render.scheduleDraw();
}

/* The sample of the playing take leaving the speaker now (null when nothing plays). */
export function playheadSample() {
  const p = play;
  if (!p) return null;
  if (p.loop) return p.loop.from + (p.startPos - p.loop.from + p.played) % (p.loop.to - p.loop.from);
  return p.base + p.startPos + p.played;
}

/* Play a take from the audio this page holds (from its start when `from` is at its very end); the position used. */
export function playLocal(take, from) {
  audio.init().catch(() => {});
  if (from >= take.pcm.length - FRAME / 4) from = 0;
  stopPlayback();
  startStream(take, take.pcm, from, 0, 'local');
  setStatus('Playing ' + takeTitle(take), 'From ' + fmtSec(from) + ', from the audio this page holds.');
  return from;
}

function onReport(m) {
  stats.samplesPlayed = m.totalPlayed;
  stats.underruns = m.totalUnderruns;
  const p = play;
  if (!p || m.id !== p.id) { stats.playing = false; return; }
  p.played = m.played; p.level = m.level; p.primed = m.primed; p.cushion = m.cushion; p.underruns = m.underruns;
  if (p.kind === 'live' || p.kind === 'retake') {
    const t = p.take;
    t.underruns = m.underruns;                       // this take's own starvations while it streamed
    const pos = p.startPos + m.played, first = t.spliceSample || 0;   // a retake's own audio starts at the splice
    t.heardSamples = Math.max(t.heardSamples || 0, pos - first);
    if (t.heardMs == null && t.sentAt != null && m.primed && pos > first) {
      // What the director hears: the first NEW sample of the take (a retake's or a continuation's starts at the
      // splice) leaving the speaker. The player reports after a render quantum; what it played past that sample
      // is already heard, so subtract it, and add the output latency the browser states (the way to the speaker).
      const past = (pos - first) / SR * 1000;
      t.heardAtMs = now() - t.sentAt - past + audio.latencyMs();          // the click → the first new sample out
      // The pre-roll is kept audio the director chose to hear before the new audio: not a wait, so "heard after"
      // leaves it out; never less than the new audio's arrival (it cannot be heard before it came).
      t.prerollMs = Math.max(0, first - p.startPos) / SR * 1000;
      t.heardMs = Math.max((t.ttfaClient ?? 0) + audio.latencyMs(), t.heardAtMs - t.prerollMs);
    }
  }
  stats.bufferLevel = p.fed - p.played; stats.bufferMs = stats.bufferLevel / SR * 1000; stats.cushion = m.cushion;
  stats.playing = m.primed && m.active;
  if (m.drained) {
    stats.streamsDrained++;
    play = null; stats.playing = false;
    playbackEvents.emit('drained');
    render.refresh();
  } else feed();
  render.scheduleDraw();
}

onPlayerState(onReport);
