/* The sampling panel ("Advanced sampling"): one input per parameter, the service's defaults and ranges (from its
 * hello), what the director changed. Owns the parameter table and the defaults; scene.js saves the values. */
import { $, el } from './util.js';
import { createEmitter } from './events.js';
import { clearFieldErrors } from './status.js';
import { framesToSeconds, secondsToFrames, showFrames, unitEvents } from './units.js';

// Shown before the first hello only: the service's hello.defaults replace them.
const BUILTIN_DEFAULTS = {
  audio_temperature: 1.7, audio_top_p: 0.8, audio_top_k: 25, audio_repetition_penalty: 1.0,
  text_temperature: 1.0, text_top_p: 1.0, text_top_k: 50, max_new_tokens: 4096, chunk_frames: 8,
};
/* The keys a retake may override ("use the sampling panel's values"). */
export const SAMPLING_KEYS = ['audio_temperature', 'audio_top_p', 'audio_top_k', 'audio_repetition_penalty',
  'text_temperature', 'text_top_p', 'text_top_k'];
const PARAMS = [
  { head: 'Audio' },
  { key: 'audio_temperature', label: 'Temperature', type: 'float', min: 0, max: 10, step: 0.05 },
  { key: 'audio_top_p', label: 'Top-p', type: 'float', min: 0.01, max: 1, step: 0.01 },
  { key: 'audio_top_k', label: 'Top-k', type: 'int', min: 0, max: 1024, step: 1 },
  { key: 'audio_repetition_penalty', label: 'Repetition penalty', type: 'float', min: 0.05, max: 10, step: 0.05 },
  { head: 'Text' },
  { key: 'text_temperature', label: 'Temperature', type: 'float', min: 0, max: 10, step: 0.05 },
  { key: 'text_top_p', label: 'Top-p', type: 'float', min: 0.01, max: 1, step: 0.01 },
  { key: 'text_top_k', label: 'Top-k', type: 'int', min: 0, max: 1024, step: 1 },
  { head: 'Length and streaming' },
  // Durations the service counts in 80 ms frames are asked in seconds (type 'frames': typed as seconds, sent as
  // whole frames); the advanced view ("Show codec frames") shows the frame count beside each.
  { key: 'max_new_tokens', label: 'Longest take (s)', type: 'frames', min: 1, max: 4096 },
  { key: 'tokens', label: 'Duration hint (s)', type: 'frames', min: 1, max: 4096, optional: true },
  { key: 'chunk_frames', label: 'Audio chunk (s)', type: 'frames', min: 1, max: 100 },
  { key: 'channels', label: 'Output', type: 'select', options: [['1', 'Mono'], ['2', 'Stereo']], def: '1' },
  { head: 'Player (this browser)' },
  { key: 'cushion_ms', label: 'Jitter cushion (ms)', type: 'int', min: 20, max: 3000, step: 10, def: 200, client: true },
];
const FIELDS = PARAMS.filter((p) => p.key);
const byKey = new Map(FIELDS.map((p) => [p.key, p]));

let defaults = { ...BUILTIN_DEFAULTS };

/* 'change': the director edited a value or reset them (scene.js saves). */
export const paramEvents = createEmitter();

/* The sampling defaults in force (the service's once its hello came). */
export function serviceDefaults() { return defaults; }
export function isParam(key) { return byKey.has(key); }

/* The request's parameters as the panel holds them (client-only ones left out; undefined values omitted). */
export function requestParams() {
  const out = {};
  for (const p of FIELDS) {
    if (p.client) continue;
    const v = readParam(p);
    if (v === undefined) continue;
    out[p.key] = p.key === 'channels' ? parseInt(v, 10) : v;
  }
  return out;
}
/* One parameter's value: a number (int or float), the select's string, or undefined (an empty optional one). */
export function paramValue(key) { return readParam(byKey.get(key)); }
/* Keys whose value is out of range or not a number. */
export function invalidParams() { return FIELDS.filter((p) => !p.client && paramInvalid(p)).map((p) => p.key); }
/* Set the request parameters a take was made with (Use direction). */
export function loadParams(req) { for (const p of FIELDS) if (!p.client && req[p.key] != null) writeParam(p, req[p.key]); paramChanged(); }
/* The values that differ from the defaults, as typed (what the scene saves). */
export function changedValues() {
  const params = {};
  for (const p of FIELDS) {
    if (!p.defEl) continue;
    const typed = $(p.key).value;
    const value = p.type === 'frames' ? (typed.trim() === '' ? '' : readParam(p)) : typed;
    if (String(value ?? '') !== String(paramDefault(p) ?? '')) params[p.key] = typed;
  }
  return params;
}

export function buildParams() {
  const box = $('params');
  for (const p of PARAMS) {
    if (p.head) { box.append(el('div', { class: 'subhead', text: p.head })); continue; }
    const input = p.type === 'select'
      ? el('select', { id: p.key }, ...p.options.map(([v, l]) => el('option', { value: v, text: l })))
      : p.type === 'frames'
        ? el('input', { id: p.key, type: 'number', min: framesToSeconds(p.min), max: framesToSeconds(p.max), step: framesToSeconds(1), placeholder: p.optional ? 'none' : '', inputmode: 'decimal' })
        : el('input', { id: p.key, type: 'number', min: p.min, max: p.max, step: p.step, placeholder: p.optional ? 'none' : '', inputmode: p.type === 'int' ? 'numeric' : 'decimal' });
    const def = el('span', { class: 'def' });
    const frameCount = p.type === 'frames' ? el('span', { class: 'frame-count' }) : null;
    box.append(el('div', { class: 'param', id: 'param_' + p.key }, el('label', { for: p.key }, el('span', { text: p.label }, frameCount), def), input));
    p.defEl = def; p.framesEl = frameCount;
    input.addEventListener('input', () => { clearFieldErrors(input); paramChanged(); paramEvents.emit('change'); });
  }
  $('resetParams').addEventListener('click', () => { for (const p of FIELDS) writeParam(p, paramDefault(p)); paramChanged(); clearFieldErrors(); paramEvents.emit('change'); });
  unitEvents.on('change', paramChanged);
}

/* The service's hello: its defaults replace the built-in ones. */
export function setServiceDefaults(msg) {
  const d = msg.defaults || msg.sampling_defaults || {};
  const limits = msg.limits || {};
  defaults = { ...BUILTIN_DEFAULTS, ...d };
  if (limits.max_new_tokens && !('max_new_tokens' in d)) defaults.max_new_tokens = limits.max_new_tokens;
}

/* Ranges from the service: its limits, and hello.sampling_ranges like the defaults. */
export function applyParamLimits(limits, hello) {
  for (const p of FIELDS) {
    const n = $(p.key); if (!n || p.type === 'select') continue;
    if (p.key === 'max_new_tokens' || p.key === 'tokens') { p.max = limits.max_new_tokens || p.max; n.max = framesToSeconds(p.max); }
    if (p.key === 'chunk_frames') {
      p.min = limits.min_chunk_frames || p.min; p.max = limits.max_chunk_frames || p.max;
      n.min = framesToSeconds(p.min); n.max = framesToSeconds(p.max);
    }
    if (p.type === 'frames') continue;   // counted in frames: no sampling range
    const r = ((hello && hello.sampling_ranges) || {})[p.key];
    if (r) { p.min = r.exclusive_minimum ? r.minimum + (p.step || 0.01) : r.minimum; p.max = r.maximum; n.min = p.min; n.max = p.max; }
  }
}

/* Show the defaults and put the saved values (or the defaults) in the inputs. */
export function applyParamDefaults(saved) {
  for (const p of FIELDS) {
    const d = paramDefault(p);
    p.defEl.textContent = d === '' || d == null ? '' : p.type === 'select' ? '' : p.type === 'frames' ? framesToSeconds(d) : String(d);
    if (saved[p.key] !== undefined) $(p.key).value = String(saved[p.key]);   // as the director typed it
    else writeParam(p, d);
  }
  paramChanged();
}

function paramDefault(p) { return p.def !== undefined ? p.def : p.optional ? '' : defaults[p.key]; }
function readParam(p) {
  if (!p) return undefined;
  const raw = $(p.key).value.trim();
  if (raw === '') return p.optional ? undefined : paramDefault(p);
  if (p.type === 'select') return raw;
  const v = Number(raw);
  if (p.type === 'frames') return secondsToFrames(v);
  return p.type === 'int' ? Math.round(v) : v;
}
/* A value as the request has it (frames for 'frames' parameters) into its input (seconds). */
function writeParam(p, v) { $(p.key).value = v == null || v === '' ? '' : p.type === 'frames' ? framesToSeconds(v) : String(v); }
function paramInvalid(p) {
  const raw = $(p.key).value.trim(); if (p.type === 'select' || raw === '') return false;
  const v = Number(raw), max = +$(p.key).max, min = +$(p.key).min;
  if (p.type === 'frames') return !Number.isFinite(v) || v <= 0 || secondsToFrames(v) < p.min || secondsToFrames(v) > p.max;
  return !Number.isFinite(v) || v < min || v > max || (p.type === 'int' && !Number.isInteger(v));
}
function paramChanged() {
  let n = 0;
  for (const p of FIELDS) {
    const changed = String(readParam(p) ?? '') !== String(paramDefault(p) ?? '');
    $('param_' + p.key).classList.toggle('changed', changed); if (changed) n++;
    if (p.framesEl) {                      // the advanced view: the frames the service will count
      const f = paramInvalid(p) ? undefined : readParam(p);
      p.framesEl.textContent = showFrames() && f !== undefined ? ' = ' + f + ' frame' + (f === 1 ? '' : 's') : '';
    }
  }
  $('advChanged').textContent = n ? n + ' changed' : 'service defaults';
}
