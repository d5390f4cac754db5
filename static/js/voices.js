/* Reference voices: the list the service offers (/api/voices), the voice picker (restored after a reload once the
 * list is here), listening to a voice before using it, uploading a reference file (recorder.js records one from
 * the microphone), and renaming one of the director's uploads (PATCH /api/voices/{id}). */
import { $, el } from './util.js';
import { createEmitter } from './events.js';
import { auth, apiFetch } from './auth.js';
import { limits } from './service.js';

let voiceById = new Map();
let listed = false;     // the service's list came at least once
let wanted = null;      // the voice to choose once the list is here (the scene saved before a reload)

/* 'uploaded': a new voice was uploaded and chosen (the scene saves); 'listed': the list came (again), or a name
 * changed. */
export const voiceEvents = createEmitter();

/* The voices the service offers, as it listed them ({id, name, kind, duration, owned}); read only. */
export function listedVoices() { return [...voiceById.values()]; }
/* The voice the picker holds ('none' for the model's own voice); before the list came, the one it will hold. */
export function chosenVoice() { return !listed && wanted ? wanted : $('voice').value; }
/* A voice's display name (its id when the service does not list it; null for none). */
export function voiceName(id) { if (!id || id === 'none') return null; const v = voiceById.get(id); return v ? v.name : id; }
/* A voice the service lists ({id, name, kind, owned, ...}), or undefined. */
export function listedVoice(id) { return voiceById.get(id); }
/* Choose `id` in the picker as soon as the service's list is here (now, when it already is). */
export function wantVoice(id) { if (listed) setVoice(voiceById.has(id) ? id : 'none'); else wanted = id; }

export async function loadVoices(selectId) {
  let voices;
  try {
    const r = await apiFetch('/api/voices', { cache: 'no-store' });
    if (!r.ok) throw new Error('HTTP ' + r.status);
    const body = await r.json();
    voices = body.voices || [];
  } catch (e) { note('err', 'Could not list voices: ' + e.message); return; }
  voiceById = new Map(voices.map((v) => [v.id, v]));
  const sel = $('voice'), keep = selectId || (!listed && wanted) || sel.value;
  listed = true; wanted = null;
  const opt = (v) => el('option', { value: v.id, text: v.name + (v.duration ? ' · ' + (+v.duration).toFixed(1) + ' s' : '') });
  const builtin = voices.filter((v) => v.kind === 'builtin'), uploaded = voices.filter((v) => v.kind !== 'builtin');
  sel.replaceChildren(el('option', { value: 'none', text: 'No reference (model voice)' }));
  if (builtin.length) sel.append(el('optgroup', { label: 'Built-in' }, ...builtin.map(opt)));
  if (uploaded.length) sel.append(el('optgroup', { label: 'Uploaded' }, ...uploaded.map(opt)));
  setVoice(keep && (keep === 'none' || voiceById.has(keep)) ? keep : 'none');
  voiceEvents.emit('listed');
}

export function setVoice(id) {
  const sel = $('voice');
  if (id !== 'none' && !voiceById.has(id)) sel.append(el('option', { value: id, text: id + ' (not listed)' }));
  sel.value = id;
  refreshVoicePlay(); refreshRename();
}

/* ------------------------------------------------------------------ renaming an upload */

function refreshRename() {
  const v = voiceById.get($('voice').value);
  const can = !!(v && v.kind === 'uploaded' && v.owned);
  $('voiceRenameBtn').hidden = !can;
  if (!can) $('voiceRenameRow').hidden = true;
}
function openRename() {
  const v = voiceById.get($('voice').value); if (!v) return;
  $('voiceRenameRow').hidden = false; $('voiceRenameBtn').setAttribute('aria-expanded', 'true');
  $('voiceRenameInput').value = v.name; $('voiceRenameInput').focus(); $('voiceRenameInput').select();
}
function closeRename() { $('voiceRenameRow').hidden = true; $('voiceRenameBtn').setAttribute('aria-expanded', 'false'); }
/* PATCH the voice's name (the service keeps it with the voice); the picker and every label follow. */
async function saveRename() {
  const id = $('voice').value, name = $('voiceRenameInput').value.trim();
  if (!name) { note('err', 'A voice needs a name.'); $('voiceRenameInput').focus(); return; }
  try {
    const r = await apiFetch('/api/voices/' + encodeURIComponent(id), { method: 'PATCH', headers: { 'Content-Type': 'application/json' }, body: JSON.stringify({ name }) });
    const body = await r.json().catch(() => null);
    if (!r.ok) throw new Error((body && body.error && body.error.message) || 'HTTP ' + r.status);
    closeRename();
    await loadVoices(id);
    note('ok', 'Voice renamed: ' + body.name + '.');
  } catch (e) { note('err', 'Could not rename the voice: ' + e.message); }
}

/* The note under the voice tools: kind '' (progress), 'err' or 'ok'. */
export function note(kind, text) { $('uploadNote').className = kind ? 'note ' + kind : 'note'; $('uploadNote').textContent = text; }

/* Upload a reference (a file, or a recording as WAV) and choose it; the service's answer, or null on failure. */
export async function uploadRef(blob, ext, name) {
  const max = limits().max_upload_bytes;
  if (max && blob.size > max) { note('err', `That file is ${(blob.size / 1048576).toFixed(1)} MB; the limit is ${(max / 1048576).toFixed(0)} MB.`); return null; }
  note('', 'Uploading ' + name + '…');
  try {
    const q = new URLSearchParams({ ext }); if (name) q.set('name', name.replace(/\.[a-z0-9]+$/i, '').slice(0, 64));
    await auth.ensure().catch(() => {});
    const r = await apiFetch('/api/upload_ref?' + q, { method: 'POST', body: blob, headers: { 'Content-Type': 'application/octet-stream' } });
    let body = null; try { body = await r.json(); } catch (e) { /* non-JSON error page */ }
    if (!r.ok) {
      const err = (body && body.error) || {};
      throw new Error((err.code ? err.code + ': ' : '') + (err.message || 'HTTP ' + r.status));
    }
    await loadVoices(body.ref_id);
    note('ok', `Voice ready: ${body.name || name} · ${(+body.duration).toFixed(1)} s · ${body.frames} frames (${body.ref_id}).`);
    voiceEvents.emit('uploaded');
    return body;
  } catch (e) {
    note('err', 'Upload failed: ' + e.message);
    return null;
  }
}

function refreshVoicePlay() {
  const playing = !$('voicePreview').paused, id = $('voice').value;
  $('voicePlay').disabled = !playing && (!id || id === 'none');
  $('voicePlay').textContent = playing ? '■' : '▶';
  $('voicePlay').setAttribute('aria-label', playing ? 'Stop the voice' : 'Listen to the voice');
}

function extFor(file) {
  const m = /\.([a-z0-9]+)$/i.exec(file.name || '');
  const e = m ? m[1].toLowerCase() : '';
  if (['wav', 'flac', 'mp3', 'ogg'].includes(e)) return e;
  if (e === 'oga' || e === 'opus') return 'ogg';
  const t = (file.type || '').toLowerCase();
  if (t.includes('wav')) return 'wav'; if (t.includes('flac')) return 'flac'; if (t.includes('mpeg') || t.includes('mp3')) return 'mp3'; if (t.includes('ogg')) return 'ogg';
  return null;
}

export function initVoices() {
  $('uploadBtn').addEventListener('click', () => $('uploadFile').click());
  $('uploadFile').addEventListener('change', async () => {
    const f = $('uploadFile').files[0]; if (!f) return;
    const ext = extFor(f);
    if (!ext) note('err', 'Use a wav, flac, mp3 or ogg file.');
    else await uploadRef(f, ext, f.name);
    $('uploadFile').value = '';
  });
  $('refreshVoices').addEventListener('click', () => loadVoices());
  $('voice').addEventListener('change', refreshVoicePlay);
  $('voice').addEventListener('change', refreshRename);
  voiceEvents.on('listed', refreshRename);
  $('voiceRenameBtn').addEventListener('click', () => ($('voiceRenameRow').hidden ? openRename() : closeRename()));
  $('voiceRenameSave').addEventListener('click', saveRename);
  $('voiceRenameCancel').addEventListener('click', closeRename);
  $('voiceRenameInput').addEventListener('keydown', (e) => {
    if (e.key === 'Enter') { e.preventDefault(); saveRename(); } else if (e.key === 'Escape') { e.stopPropagation(); closeRename(); }
  });
  $('voicePlay').addEventListener('click', () => {
    const a = $('voicePreview'), id = $('voice').value;
    if (!a.paused) { a.pause(); return; }
    if (!id || id === 'none') return;
    a.src = auth.query('/api/voices/' + encodeURIComponent(id) + '/audio');
    a.play().catch((e) => note('err', 'Could not play the voice: ' + e.message));
  });
  $('voicePreview').addEventListener('play', refreshVoicePlay);
  $('voicePreview').addEventListener('pause', refreshVoicePlay);
  $('voicePreview').addEventListener('ended', refreshVoicePlay);
}
