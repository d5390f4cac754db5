/* The Scene panel: direction (instruction), text, language, voice choice, seed, word timing, and the sampling
 * panel (params.js); the cue chips; character counts against the service's limits; the scene saved in this browser
 * (not the takes: the service keeps those). Turns the panel into a start request (collectRequest). */
import { $, el, takeTitle } from './util.js';
import { hello, limits } from './service.js';
import { markField, clearFieldErrors, setStatus } from './status.js';
import { chosenModel } from './topbar.js';
import { chosenVoice, setVoice, voiceEvents, wantVoice } from './voices.js';
import * as params from './params.js';
import { framesToSeconds } from './units.js';

const STORAGE_KEY = 'moss_rt.studio.v1';
const CUES = ['(a soft laugh)', '(sighs)', '(whispering)', '(breathes in)', '(clears throat)', '(voice breaking)', '[pause]', '[long pause]'];
const DEFAULT_TEXT = 'The lighthouse keeper counted the ships until the fog rolled in, and then he counted the silence.';

let savedScene = {};
try { savedScene = JSON.parse(localStorage.getItem(STORAGE_KEY) || '{}') || {}; } catch (e) { savedScene = {}; }
// Scenes saved before durations were asked in seconds hold those parameters in frames.
const FRAME_PARAMS = ['max_new_tokens', 'tokens', 'chunk_frames'];
if (savedScene.params && savedScene.durations !== 'seconds') {
  for (const k of FRAME_PARAMS) if (savedScene.params[k] != null && savedScene.params[k] !== '') savedScene.params[k] = framesToSeconds(+savedScene.params[k]);
}
let saveTimer = null;
let seedMode = 'random';
// Cue chips insert where the caret was last: in the direction, the text, or the retake panel's fields.
let lastTextField = $('instruction');
const caretPos = { instruction: null, text: null };

export function seedIsFixed() { return seedMode === 'fixed'; }

/* Word timing (docs/words.md) for a new take or a retake: the Scene's box while the service has an aligner
 * (hello.words), else null: not asked at all (the service would refuse "words"). */
export function wordsChoice() { const h = hello(); return h && h.words ? $('wantWords').checked : null; }

/* The start request the scene describes (without type and take key). */
export function collectRequest() {
  const req = {
    text: $('text').value, instruction: $('instruction').value, language: $('language').value.trim(),
    reference: chosenVoice() || 'none', model: chosenModel(),
  };
  Object.assign(req, params.requestParams());
  if (seedMode === 'fixed') req.seed = $('seed').value.trim();
  if (wordsChoice()) req.words = true;
  return req;
}

/* Marks what the service would refuse; true when the request may be sent. emptyText: the text may be empty (a
 * take fed with text as it is typed starts before its first word). */
export function validateScene(req, { emptyText = false } = {}) {
  clearFieldErrors();
  const L = limits();
  let ok = true;
  if (!emptyText && !req.text.trim()) { markField('text', 'Write something for the voice to say.'); ok = false; }
  if (L.max_text_chars && req.text.length > L.max_text_chars) { markField('text', `${req.text.length} characters: at most ${L.max_text_chars} are accepted. Shorten it before speaking.`); ok = false; }
  if (L.max_instruction_chars && req.instruction.length > L.max_instruction_chars) { markField('instruction', `${req.instruction.length} characters: at most ${L.max_instruction_chars} are accepted.`); ok = false; }
  if (seedMode === 'fixed' && !/^\d{1,19}$/.test(req.seed || '')) { markField('seed', 'A fixed seed is a whole number ≥ 0.'); ok = false; }
  for (const key of params.invalidParams()) { markField(key, 'Out of range'); ok = false; }
  return ok;
}

/* "Use direction": a take's direction, voice, parameters and seed back into the scene. */
export function loadIntoScene(t) {
  const r = t.req || {};
  if (r.instruction != null) $('instruction').value = r.instruction;
  if (r.text != null) $('text').value = r.text;
  $('language').value = r.language || '';
  if (r.reference) setVoice(r.reference);
  params.loadParams(r);
  if (t.seed != null) { setSeedMode('fixed'); $('seed').value = t.seed; }
  updateCounts(); saveScene();
  setStatus('Scene loaded from ' + takeTitle(t), 'Direction, voice, parameters and seed ' + (t.seed ?? '') + '.');
}

export function saveScene() {
  clearTimeout(saveTimer);
  saveTimer = setTimeout(() => {
    savedScene = { instruction: $('instruction').value, text: $('text').value, language: $('language').value, reference: chosenVoice(), seedMode, seed: $('seed').value, params: params.changedValues(), words: $('wantWords').checked, durations: 'seconds' };
    try { localStorage.setItem(STORAGE_KEY, JSON.stringify(savedScene)); } catch (e) { /* private mode */ }
  }, 300);
}

/* The service's hello: its limits on the counters and inputs, its defaults in the sampling panel. */
export function applyHelloToScene(msg) {
  params.setServiceDefaults(msg);
  // No maxLength: a paste over the limit would be cut silently. The counter and the field say it instead.
  params.applyParamLimits(limits(), msg);
  updateCounts();
  params.applyParamDefaults(savedScene.params || {});
  $('wordsField').hidden = !msg.words;       // no aligner (--aligner none): no word timing to ask for
  $('wantWords').title = msg.words ? 'Aligner: ' + (msg.aligner || 'the service\'s') : '';
}

function setSeedMode(m) {
  seedMode = m;
  $('seedRandom').setAttribute('aria-pressed', String(m === 'random'));
  $('seedFixed').setAttribute('aria-pressed', String(m === 'fixed'));
  $('seed').disabled = m !== 'fixed';
  $('seed').placeholder = m === 'fixed' ? 'seed' : 'server picks';
  if (m === 'fixed' && !$('seed').value) $('seed').value = String(Math.floor(Math.random() * 2 ** 31));
  saveScene();
}

function updateCounts() {
  const L = limits();
  const c = (id, lim) => { const n = $(id).value.length; $(id + 'Count').textContent = lim ? n + ' / ' + lim : String(n); $(id + 'Count').style.color = lim && n > lim ? 'var(--danger)' : ''; };
  c('instruction', L.max_instruction_chars); c('text', L.max_text_chars);
  for (const [id, lim] of [['instruction', L.max_instruction_chars], ['text', L.max_text_chars]]) {
    const n = $(id).value.length, box = document.querySelector(`.field-error[data-for="${id}"]`);
    if (lim && n > lim) markField(id, `${n - lim} characters over the limit of ${lim}: shorten it before speaking.`);
    else if (box && !box.hidden && /over the limit/.test(box.textContent)) { box.hidden = true; $(id).classList.remove('invalid'); }
  }
}

function insertAtCaret(n, str) {
  const [a, b] = caretPos[n.id] || [n.value.length, n.value.length];
  const before = n.value.slice(0, a), after = n.value.slice(b);
  const pad = before && !/\s$/.test(before) ? ' ' : '';
  const pad2 = after && !/^\s/.test(after) ? ' ' : '';
  n.value = before + pad + str + pad2 + after;
  const pos = (before + pad + str + pad2).length;
  n.focus(); n.setSelectionRange(pos, pos); caretPos[n.id] = [pos, pos];
  n.dispatchEvent(new Event('input'));
}

/* GENERAL: / SCRIPT: laid out in the direction, keeping what was written. */
function layOutDirection() {
  const n = $('instruction');
  const v = n.value.trim();
  if (/^\s*GENERAL:/m.test(v) && /^\s*SCRIPT:/m.test(v)) { n.focus(); return; }
  let general = v, script = '';
  if (/^\s*SCRIPT:/m.test(v)) { const i = v.search(/^\s*SCRIPT:/m); general = v.slice(0, i).trim(); script = v.slice(i).replace(/^\s*SCRIPT:\s*/, ''); }
  else if (/^\s*GENERAL:/m.test(v)) general = v.replace(/^\s*GENERAL:\s*/, '');
  const head = 'GENERAL: ' + (general || '');
  n.value = head + '\nSCRIPT: ' + script;
  const pos = general ? n.value.length : head.length;
  n.focus(); n.setSelectionRange(pos, pos); caretPos.instruction = [pos, pos]; lastTextField = n;
  n.dispatchEvent(new Event('input'));
}

export function initScene() {
  for (const id of ['instruction', 'text', 'rtInstruction', 'rtText']) {
    const n = $(id);
    const keep = () => { lastTextField = n; caretPos[id] = [n.selectionStart, n.selectionEnd]; };
    n.addEventListener('focus', keep); n.addEventListener('keyup', keep); n.addEventListener('mouseup', keep); n.addEventListener('input', keep);
  }
  for (const cue of CUES) $('cueBar').append(el('button', { type: 'button', class: 'chip cue', text: cue, title: 'Insert ' + cue, onmousedown: (e) => e.preventDefault(), onclick: () => insertAtCaret(lastTextField, cue) }));
  $('layoutBtn').addEventListener('mousedown', (e) => e.preventDefault());
  $('layoutBtn').addEventListener('click', layOutDirection);
  $('resetScene').addEventListener('click', () => { $('instruction').value = ''; $('text').value = ''; updateCounts(); saveScene(); $('instruction').focus(); });
  params.buildParams();
  params.paramEvents.on('change', saveScene);
  voiceEvents.on('uploaded', saveScene);
  $('seedRandom').addEventListener('click', () => setSeedMode('random'));
  $('seedFixed').addEventListener('click', () => setSeedMode('fixed'));
  $('seedRoll').addEventListener('click', () => { $('seed').value = String(Math.floor(Math.random() * 2 ** 31)); setSeedMode('fixed'); });
  for (const id of ['instruction', 'text', 'language', 'voice', 'seed']) $(id).addEventListener('input', (e) => { clearFieldErrors(e.target); updateCounts(); saveScene(); });
  $('voice').addEventListener('change', saveScene);
  $('wantWords').addEventListener('change', saveScene);
}

/* The scene as this browser saved it (the defaults in the sampling panel until the service's hello). */
export function restoreScene() {
  params.applyParamDefaults(savedScene.params || {});
  if (savedScene.instruction != null) $('instruction').value = savedScene.instruction;
  $('text').value = savedScene.text != null ? savedScene.text : DEFAULT_TEXT;
  if (savedScene.language) $('language').value = savedScene.language;
  if (savedScene.seedMode === 'fixed') { $('seed').value = savedScene.seed || ''; setSeedMode('fixed'); }
  if (savedScene.reference && savedScene.reference !== 'none') wantVoice(savedScene.reference);   // once the list is here
  if (savedScene.words === false) $('wantWords').checked = false;   // on unless the director turned it off
  updateCounts();
}
