/* Recording a reference voice from the microphone: raw PCM through the 'moss-recorder' worklet processor (or a
 * ScriptProcessor), encoded to WAV here, listened back, then uploaded as a voice (voices.js). */
import { $, SR, now, clamp, fmtClock } from './util.js';
import { wavBlob } from './pcm.js';
import { audio } from './audio-out.js';
import { limits } from './service.js';
import { note, uploadRef } from './voices.js';

const rec = { on: false, chunks: [], rate: SR, stream: null, node: null, src: null, mute: null, t0: 0, timer: null, blob: null, url: null };

export function isRecording() { return rec.on; }

async function startRecording() {
  if (!navigator.mediaDevices || !navigator.mediaDevices.getUserMedia) { note('err', 'Recording needs a secure page (https or localhost).'); return; }
  try {
    await audio.init();
    rec.stream = await navigator.mediaDevices.getUserMedia({ audio: { channelCount: 1, echoCancellation: false, noiseSuppression: false, autoGainControl: false } });
  } catch (e) { note('err', 'Microphone unavailable: ' + e.message); return; }
  const ctx = audio.ctx;
  rec.rate = ctx.sampleRate; rec.chunks = []; rec.on = true; rec.t0 = now(); discardRecording(true);
  rec.src = ctx.createMediaStreamSource(rec.stream);
  const onChunk = (pcm, peak) => { rec.chunks.push(pcm); $('recLevel').style.width = Math.min(100, Math.sqrt(peak) * 100) + '%'; };
  if (audio.mode === 'worklet') {
    rec.node = new AudioWorkletNode(ctx, 'moss-recorder', { numberOfInputs: 1, numberOfOutputs: 1, channelCount: 1, channelCountMode: 'explicit' });
    rec.node.port.onmessage = (e) => { if (e.data.pcm) onChunk(e.data.pcm, e.data.peak); if (e.data.done) finishRecording(); };
  } else {
    rec.node = ctx.createScriptProcessor(4096, 1, 1);
    rec.node.onaudioprocess = (e) => { if (!rec.on) return; const d = new Float32Array(e.inputBuffer.getChannelData(0)); let p = 0; for (const v of d) p = Math.max(p, Math.abs(v)); onChunk(d, p); };
  }
  const mute = ctx.createGain(); mute.gain.value = 0;
  rec.src.connect(rec.node); rec.node.connect(mute); mute.connect(ctx.destination); rec.mute = mute;
  $('recBox').hidden = false; $('recPreview').hidden = true; $('recActions').hidden = true;
  document.querySelector('#recordBtn .recdot').hidden = false; $('recordLabel').textContent = 'Stop recording';
  note('', 'Recording… speak for 3 to 20 seconds.');
  const maxSec = limits().max_upload_seconds || 60;
  rec.timer = setInterval(() => {
    const sec = (now() - rec.t0) / 1000; $('recTime').textContent = fmtClock(sec);
    if (sec >= maxSec - 0.2) stopRecording();
  }, 100);
}

export function stopRecording() {
  if (!rec.on) return;
  rec.on = false; clearInterval(rec.timer);
  rec.stream.getTracks().forEach((t) => t.stop());
  if (audio.mode === 'worklet') rec.node.port.postMessage('stop'); else finishRecording();
  document.querySelector('#recordBtn .recdot').hidden = true; $('recordLabel').textContent = 'Record again';
}

function finishRecording() {
  try { rec.src.disconnect(); rec.node.disconnect(); rec.mute.disconnect(); } catch (e) {}
  const n = rec.chunks.reduce((a, c) => a + c.length, 0);
  const pcm = new Int16Array(n); let o = 0;
  for (const c of rec.chunks) for (let i = 0; i < c.length; i++) pcm[o++] = Math.round(clamp(c[i], -1, 1) * 32767);
  const sec = n / rec.rate, min = limits().min_upload_seconds || 0.5;
  rec.blob = wavBlob(pcm, 1, rec.rate);
  rec.url && URL.revokeObjectURL(rec.url); rec.url = URL.createObjectURL(rec.blob);
  $('recPreview').src = rec.url; $('recPreview').hidden = false; $('recActions').hidden = false;
  $('recTime').textContent = fmtClock(sec); $('recLevel').style.width = '0';
  if (sec < min) { note('err', `That is ${sec.toFixed(1)} s; a reference needs at least ${min} s.`); $('recUse').disabled = true; }
  else { note('', `Recorded ${sec.toFixed(1)} s. Listen back, then use it as the voice.`); $('recUse').disabled = false; }
}

function discardRecording(keepBox) {
  rec.blob = null; if (rec.url) { URL.revokeObjectURL(rec.url); rec.url = null; }
  $('recPreview').removeAttribute('src');
  if (!keepBox) { $('recBox').hidden = true; $('recordLabel').textContent = 'Record from microphone'; $('uploadNote').textContent = ''; }
}

export function initRecorder() {
  $('recordBtn').addEventListener('click', () => (rec.on ? stopRecording() : startRecording()));
  $('recUse').addEventListener('click', async () => {
    if (!rec.blob) return;
    const stamp = new Date().toTimeString().slice(0, 5).replace(':', 'h');
    if (await uploadRef(rec.blob, 'wav', 'mic ' + stamp + '.wav')) { discardRecording(true); $('recBox').hidden = true; $('recordLabel').textContent = 'Record from microphone'; }
  });
  $('recDiscard').addEventListener('click', () => discardRecording());
}
