/* "Speak as I type" (the Scene panel): the Text box fed to a take while it is written, the way an LLM feeds a line,
 * through the service's streaming text input (docs/protocol.md "Streaming text input"): Speak opens a take with
 * `stream_text: true` and the text so far as its first piece; every addition at the end of the box then goes out
 * as an `append` (a few a second at most); "Say it now" sends `flush` (speak what has arrived without waiting for
 * the end of its sentence); Finish (or Speak, Ctrl+Enter) sends `end_of_text`: the take ends once all is spoken.
 * Owns the typing session: the take it feeds and the text already sent. Writes the take's req.text (what was
 * sent), so its card shows the line as it grows. */
import { $, now, takeTitle } from './util.js';
import { conn } from './connection.js';
import { setStatus, announce, markField, clearFieldErrors } from './status.js';
import { takeEvents } from './takes.js';
import { noteTextSent, pendingStart, speak } from './director.js';
import * as render from './render.js';

const MIN_GAP_MS = 150;   // appends at most ~7 a second: well inside the service's message rate (20/s)
const ALREADY_SENT = 'Already sent: only what you add at the end reaches the voice now.';

let feed = null;          // {take, sent, timer, lastSendAt, finished}

export const stats = { textAppends: 0, textFlushes: 0, textFinished: 0 };

/* The mode is on (the checkbox in the Scene panel). */
export function typingOn() { return $('typeMode').checked; }
/* A take is open and takes text as it is typed. */
export function typingOpen() {
  if (!feed || feed.finished) return false;
  const t = feed.take;
  if (t.status === 'streaming' || pendingStart(t)) return true;
  closeFeed(false);                     // refused, ended or gone (asked while refreshing: no refresh from here)
  return false;
}
/* The text sent to the open take so far ('' without one). */
export function typedSoFar() { return feed ? feed.sent : ''; }

/* Speak as the Speak button (and Ctrl+Enter) mean it: finish the text of an open take fed as typed; open one when
 * the mode is on; otherwise a plain take of the scene. */
export function speakFromScene() {
  if (typingOpen()) { finishText(); return; }
  if (!typingOn()) { speak(); return; }
  const text = $('text').value;
  const take = speak({ streamText: true });
  if (!take) return;
  feed = { take, sent: text, timer: null, lastSendAt: now(), finished: false };
  announce('Speaking as you type: what you add to the text goes to the voice.');
  const box = $('text');
  box.focus(); box.setSelectionRange(box.value.length, box.value.length);
  refreshTyping();
}

/* What was added at the end of the box since the last append, sent now (false when nothing could be). */
function sendNew() {
  if (!feed) return false;
  clearTimeout(feed.timer); feed.timer = null;
  const value = $('text').value;
  if (!value.startsWith(feed.sent)) { markField('text', ALREADY_SENT); return false; }
  if ($('text').classList.contains('invalid')) clearFieldErrors($('text'));
  const piece = value.slice(feed.sent.length);
  if (!piece) return true;
  if (!conn.send({ type: 'append', text: piece, take: feed.take.key })) return false;
  feed.sent = value; feed.lastSendAt = now();
  feed.take.req = { ...(feed.take.req || {}), text: value };
  noteTextSent(feed.take);
  stats.textAppends++;
  refreshTyping();
  return true;
}

/* After each keystroke: an append soon, never more often than MIN_GAP_MS. */
function schedule() {
  if (!typingOpen() || feed.timer) return;
  feed.timer = setTimeout(sendNew, Math.max(0, MIN_GAP_MS - (now() - feed.lastSendAt)));
}

/* "Say it now": what has arrived is spoken without waiting for the end of its sentence. */
export function flushText() {
  if (!typingOpen() || !sendNew()) return;
  if (conn.send({ type: 'flush', take: feed.take.key })) { stats.textFlushes++; setStatus('Saying it now', 'What you typed is spoken without waiting for the end of the sentence.'); }
}

/* Finish: no more text; the take ends once everything is spoken. */
export function finishText() {
  if (!typingOpen()) return;
  sendNew();
  if (!conn.send({ type: 'end_of_text', take: feed.take.key })) return;
  feed.finished = true; stats.textFinished++;
  setStatus('Finishing ' + takeTitle(feed.take), 'The rest of the text is spoken, then the take ends.');
  announce('Text finished.');
  refreshTyping(); render.refresh();
}

function closeFeed(refreshPage = true) {
  if (!feed) return;
  clearTimeout(feed.timer);
  feed = null;
  refreshTyping();
  if (refreshPage) render.refresh();
}

/* The typing bar and the Speak button's label (on every render.refresh() too). */
export function refreshTyping() {
  const open = !!(feed && !feed.finished);
  $('typingBar').hidden = !open;
  if (open) $('typingInfo').textContent = 'Listening for text · ' + feed.sent.length + ' characters sent';
  if (open) $('speakLabel').textContent = 'Finish text';
  $('typeModeHint').hidden = !typingOn() || open;
}

export function initTyping() {
  $('text').addEventListener('input', schedule);
  $('typeMode').addEventListener('change', () => { if (!typingOn() && typingOpen()) finishText(); refreshTyping(); render.refresh(); });
  $('typeFlush').addEventListener('click', flushText);
  $('typeFinish').addEventListener('click', finishText);
  const ended = (t) => { if (feed && feed.take === t && t.status !== 'streaming' && t.status !== 'pending') closeFeed(); };
  takeEvents.on('updated', ended);
  takeEvents.on('removed', (t) => { if (feed && feed.take === t) closeFeed(); });
  refreshTyping();
}
