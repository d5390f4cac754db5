/* The Transport panel: Speak and Cancel, the status line's alert (with Retry), and the meters (heard after,
 * real-time factor, frames, playback buffer, seed) of the take that is live, playing or selected. */
import { $, el, SR, FRAME, now, clamp, fmtSec, plural, describeRtf, takeTitle } from './util.js';
import { showFrames } from './units.js';
import { conn } from './connection.js';
import { setStatus, hideAlert } from './status.js';
import { paramValue } from './params.js';
import * as playback from './playback.js';
import { selectedTake } from './selection.js';
import { busy, cancelAll, hasPending, liveTake, replaying } from './director.js';
import { speakFromScene, typingOpen } from './typing.js';

/* Speak and Cancel (on every render.refresh()). */
export function refreshTransport() {
  const working = busy();
  $('speak').disabled = !conn.ready;
  if (!typingOpen()) $('speakLabel').textContent = working ? 'Speak again' : 'Speak';
  $('cancel').disabled = !(working || playback.current() || replaying());
  $('speak').classList.toggle('busy', working);
  if (hasPending() && !$('speak').querySelector('.spinner')) $('speak').prepend(el('span', { class: 'spinner' }));
  if (!hasPending()) { const sp = $('speak').querySelector('.spinner'); sp && sp.remove(); }
}

export function updateMeters() {
  const live = liveTake(), p = playback.current();
  const t = live || (p && p.take) || selectedTake();
  if (t && t.pcm) {
    const fresh = t.pcm.length - (t.spliceSample || 0);
    $('mTtfa').innerHTML = t.heardMs != null ? t.heardMs.toFixed(0) + '<small> ms</small>' : '—';
    // Beside it, the service's own first-audio time (its request → its first PCM sent), then what arrived here.
    $('mTtfaS').textContent = [
      t.end && t.end.ttfa_ms != null ? 'service ' + Math.round(t.end.ttfa_ms) + ' ms' : t.gpuFirstMs != null ? 'service ' + Math.round(t.gpuFirstMs) + ' ms' : null,
      t.ttfaClient != null ? 'first audio ' + Math.round(t.ttfaClient) + ' ms' : null,
      t.prerollMs ? 'pre-roll ' + (t.prerollMs / 1000).toFixed(1) + ' s not counted' : null].filter(Boolean).join(' · ') || (t.streamText ? 'last text → sound' : 'Speak → sound');
    $('mTtfaS').title = 'Heard after: the click (Speak, Retake, Continue; for text fed as it is typed, the last text sent) → the take\'s first NEW sample leaving the speaker, '
      + 'after the jitter cushion; a retake\'s pre-roll (kept audio played before the new audio) is not counted. '
      + 'Service: the service\'s own request → its first PCM sent. First audio: the click → the first new PCM arriving here.'
      + (t.heardAtMs != null ? ' This take: the first new sample was heard ' + Math.round(t.heardAtMs) + ' ms after the click.' : '');
    let rtf = null;
    if (t.end && t.end.rtf != null) rtf = t.end.rtf;
    else if (t.firstPcmAt != null && t.sentAt != null) { const wall = ((t.lastPcmAt || now()) - t.sentAt) / 1000; if (wall > 0 && fresh > 0) rtf = fresh / SR / wall; }
    $('mRtf').innerHTML = rtf != null ? rtf.toFixed(2) + '<small>×</small>' : '—';
    $('mRtfS').textContent = rtf != null ? describeRtf(rtf).split(' · ')[1] : 'audio s per wall s';
    const frames = Math.floor(t.pcm.length / FRAME);
    $('mFrames').textContent = fmtSec(t.pcm.length);
    $('mFramesS').textContent = (t.spliceSample ? fmtSec(fresh) + ' new' : 'whole take') + (showFrames() ? ' · ' + plural(frames, 'frame') + ' of 80 ms' : '');
    $('mSeed').textContent = t.seed ?? '—';
    $('mSeedS').textContent = t.req && t.req.seed != null && t.req.seed !== '' ? 'fixed' : t.seed != null ? 'random' : '';
  } else {
    for (const id of ['mTtfa', 'mRtf', 'mFrames', 'mSeed']) $(id).textContent = '—';
  }
  const lvl = p ? Math.max(0, p.fed - p.played) : 0;
  const cush = (p && p.cushion) || (+paramValue('cushion_ms') || 200) * SR / 1000;
  $('mBuf').innerHTML = p ? (lvl / SR * 1000).toFixed(0) + '<small> ms</small>' : '—';
  $('mBufBar').style.width = clamp(lvl / playback.HIGH_WATER * 100, 0, 100) + '%';
  $('mBufCushion').style.left = clamp(cush / playback.HIGH_WATER * 100, 0, 100) + '%';
  $('mBufBar').style.background = p && !p.primed && p.played > 0 ? 'var(--cue)' : 'var(--accent)';
  const ut = (live && live.status === 'streaming') ? live : p ? p.take : null;
  const under = ut && ut.underruns ? ' · ' + plural(ut.underruns, 'underrun') : '';
  if (live && live.cancelling) setStatus('Cancelling…', 'Audio stopped.');
  else if (live && live.status === 'streaming') {
    const t2 = live, fresh = t2.pcm ? t2.pcm.length - (t2.spliceSample || 0) : 0;
    setStatus((t2.isRetake ? 'Retake · ' : 'Speaking · ') + takeTitle(t2), fmtSec(fresh) + ' received' + (p && !p.primed ? ' · buffering' : p ? ' · playing' : ' · not playing') + under);
  } else if (p && p.take.pcm) {
    const ph = playback.playheadSample();
    setStatus((p.kind === 'replay' ? 'Replaying ' : 'Playing ') + takeTitle(p.take), fmtSec(ph) + ' / ' + fmtSec(p.kind === 'replay' ? p.take.pcm.length : p.store.length) + (p.primed ? '' : ' · buffering') + under);
  }
}

export function initTransport() {
  $('speak').addEventListener('click', speakFromScene);
  $('cancel').addEventListener('click', cancelAll);
  $('alertClose').addEventListener('click', () => hideAlert());
  $('alertRetry').addEventListener('click', () => { hideAlert(); speakFromScene(); });
  const isMac = /Mac|iPhone|iPad/.test(navigator.platform || navigator.userAgent);
  $('speakKbd').textContent = isMac ? '⌘ ↵' : 'Ctrl ↵';
}
