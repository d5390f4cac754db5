/* moss_rt directing studio: the entry point (<script type="module" src="/static/js/main.js">). No build step.
 * Starts every module in order, connects the page-wide pieces no single module owns (the service's hello, the
 * keyboard shortcuts, what render.refresh() and the redraw do), installs the window.studio facade, and boots.
 * The module map is static/README.md. */
import { $, FRAME } from './util.js';
import * as render from './render.js';
import { setTitlePrefix, setConn, setStatus, hideAlert } from './status.js';
import { initAuth, authEvents } from './auth.js';
import { audio, resumeAudioOnGesture } from './audio-out.js';
import { conn, onMessage } from './connection.js';
import { initTopbar, applyHelloToTopbar } from './topbar.js';
import { initVoices, loadVoices } from './voices.js';
import { initRecorder, isRecording, stopRecording } from './recorder.js';
import { initScene, restoreScene, applyHelloToScene } from './scene.js';
import * as playback from './playback.js';
import { allTakes } from './takes.js';
import { initSelection, selectedTake, cursorSample, setCursor } from './selection.js';
import { initSessions, resumeSession } from './sessions.js';
import { initDirector, busy, cancelAll, liveTake } from './director.js';
import { initTyping, refreshTyping, speakFromScene } from './typing.js';
import { initDeletes, pendingDeletes, undoDelete } from './deletes.js';
import { setShowFrames, showFrames } from './units.js';
import * as editor from './editor.js';
import { initCompare, playAB, switchAB, refreshCompare, refreshComparePlaying } from './compare.js';
import { initComp } from './comp.js';
import { initTakeList, drawAllMinis, drawLiveCards } from './takelist.js';
import { initTransport, refreshTransport, updateMeters } from './transport.js';
import { initWords, refreshWords, drawWords } from './words.js';
import { initScriptPanel, refreshScriptPanel } from './script-panel.js';
import { installFacade } from './facade.js';

/* ------------------------------------------------------------------ the modules, in order */
// Listeners run in the order modules subscribe: the order below is the order panels follow a change.
initAuth();
resumeAudioOnGesture();
initTopbar();
initVoices();
initRecorder();
initScene();
initDirector();
initTyping();
initDeletes();
initSessions();
initTakeList();
editor.initEditor();
initWords();
initCompare();
initComp();
initSelection();
initTransport();
initScriptPanel();        // after sessions.js: it reads the session's takes when the service lists them

render.onRefresh(refreshTransport);
render.onRefresh(editor.refreshEditorButtons);
render.onRefresh(refreshCompare);
render.onRefresh(editor.refreshRegion);
render.onRefresh(refreshTyping);
render.onRefresh(refreshWords);
render.onRefresh(refreshScriptPanel);
render.onDraw(editor.drawEditor);
render.onDraw(drawWords);
render.onDraw(updateMeters);
render.onDraw(drawLiveCards);
render.onDraw(refreshComparePlaying);
render.keepDrawingWhile(() => !!(playback.current() || liveTake()));
setTitlePrefix(() => (liveTake() ? '● ' : playback.current() ? '▶ ' : ''));

/* ------------------------------------------------------------------ the service's hello */
onMessage('hello', (msg) => {
  applyHelloToScene(msg);
  applyHelloToTopbar(msg);
  setConn('open', 'Connected');
  conn.startPings();
  if (msg.sessions) resumeSession();
  loadVoices();
  render.refresh();
  if (!busy()) setStatus('Ready', 'Write a scene and press Speak.');
  hideAlert(['offline', 'protocol']);
});
authEvents.on('key', () => { conn.attempt = 0; conn.connect(); });

/* ------------------------------------------------------------------ page-wide */
new ResizeObserver(() => { render.scheduleDraw(); drawAllMinis(); }).observe(document.body);
new ResizeObserver(() => document.body.style.setProperty('--transport-h', $('transport').offsetHeight + 'px')).observe($('transport'));
// On a phone the transport is a bar fixed at the bottom: the meters fold away behind one button.
$('metersToggle').addEventListener('click', () => {
  const open = !$('transport').classList.contains('meters-open');
  $('transport').classList.toggle('meters-open', open);
  $('metersToggle').setAttribute('aria-expanded', String(open));
  $('metersToggle').setAttribute('aria-label', open ? 'Hide the meters' : 'Show the meters');
  $('metersToggle').textContent = open ? '▾' : '▴';
});
// The advanced view: codec frames beside the seconds.
$('showFrames').checked = showFrames();
$('showFrames').addEventListener('change', () => { setShowFrames($('showFrames').checked); render.refresh(); render.scheduleDraw(); });
window.addEventListener('beforeunload', (e) => {   // comps and splices live only in this page
  if (allTakes().some((t) => t.local)) { e.preventDefault(); e.returnValue = ''; }
});

const typingTarget = (e) => /^(INPUT|TEXTAREA|SELECT)$/.test(e.target.tagName) || e.target.isContentEditable;
document.addEventListener('keydown', (e) => {
  const typing = typingTarget(e);
  if ((e.ctrlKey || e.metaKey) && e.key === 'Enter') {
    e.preventDefault();
    if (e.shiftKey) { if (!$('retakeBtn').disabled) editor.seekFromPlayhead('retake'); } else if (!$('speak').disabled) speakFromScene();
    return;
  }
  if ((e.ctrlKey || e.metaKey) && !e.shiftKey && (e.key === 'z' || e.key === 'Z') && pendingDeletes().length && !typingTarget(e)) {
    e.preventDefault(); undoDelete(); return;
  }
  if (e.key === 'Escape') { if (isRecording()) stopRecording(); else cancelAll(); return; }
  if (typing || e.ctrlKey || e.metaKey || e.altKey) return;
  const t = selectedTake();
  if (e.key === ' ') { if (/^(BUTTON|A|SUMMARY)$/.test(e.target.tagName)) return; e.preventDefault(); $('edPlay').click(); }
  else if (e.key === 'a' || e.key === 'A') playAB('a');
  else if (e.key === 'b' || e.key === 'B') playAB('b');
  else if (e.key === 'x' || e.key === 'X') switchAB();
  else if (e.key === '[' && t) editor.markRegionStart();
  else if (e.key === ']' && t) editor.markRegionEnd();
  else if (e.key === 'l' || e.key === 'L') editor.toggleLoop();
  else if (e.key === 'm' || e.key === 'M') editor.addMarker();
  else if ((e.key === 'ArrowLeft' || e.key === 'ArrowRight') && t) {
    e.preventDefault(); setCursor(cursorSample() + (e.key === 'ArrowLeft' ? -1 : 1) * FRAME * (e.shiftKey ? 10 : 1));
  }
});

installFacade();

/* ------------------------------------------------------------------ boot */
restoreScene();
render.refresh();
render.scheduleDraw();
conn.connect();
audio.init().catch(() => {});   // starts suspended without a gesture in most browsers; resumed on the first click
