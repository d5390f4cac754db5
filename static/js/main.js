/* moss_rt directing studio (ES module, no build step).
 * Wire protocol v1: every server WebSocket binary message is one frame [u8 tag][u32 BE length][payload];
 * tag 0 = JSON object, tag 1 = int16 LE PCM at 48 kHz, interleaved when channels = 2. */

import { RingCore } from './ring-core.js';

const SR = 48000;
const FRAME = 3840;                 // samples per channel per 80 ms codec frame
const HIGH_WATER = SR * 2;          // audio handed to the player ahead of the playhead
// Shown before the first hello only: the service's hello.defaults replace them.
const BUILTIN_DEFAULTS = {
  audio_temperature: 1.7, audio_top_p: 0.8, audio_top_k: 25, audio_repetition_penalty: 1.0,
  text_temperature: 1.0, text_top_p: 1.0, text_top_k: 50, max_new_tokens: 4096, chunk_frames: 8,
};
const SAMPLING_KEYS = ['audio_temperature', 'audio_top_p', 'audio_top_k', 'audio_repetition_penalty',
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
  { key: 'max_new_tokens', label: 'Max frames', type: 'int', min: 1, max: 4096, step: 1 },
  { key: 'tokens', label: 'Duration hint (frames)', type: 'int', min: 1, max: 4096, step: 1, optional: true },
  { key: 'chunk_frames', label: 'Chunk frames', type: 'int', min: 1, max: 100, step: 1 },
  { key: 'channels', label: 'Output', type: 'select', options: [['1', 'Mono'], ['2', 'Stereo']], def: '1' },
  { head: 'Player (this browser)' },
  { key: 'cushion_ms', label: 'Jitter cushion (ms)', type: 'int', min: 20, max: 3000, step: 10, def: 200, client: true },
];
const CUES = ['(a soft laugh)', '(sighs)', '(whispering)', '(breathes in)', '(clears throat)', '(voice breaking)', '[pause]', '[long pause]'];
const STORAGE_KEY = 'moss_rt.studio.v1';
const DEMO_DISMISSED = 'moss_rt.studio.demo_dismissed';

const $ = (id) => document.getElementById(id);
const now = () => performance.now();
const clamp = (v, lo, hi) => Math.max(lo, Math.min(hi, v));
const fmtSec = (samples) => (samples / SR).toFixed(2) + ' s';
const plural = (n, word) => n + ' ' + word + (n === 1 ? '' : 's');
/* A real-time factor as shown: the words follow the rounded number (0.996 is "1.00×, real time"). */
function describeRtf(rtf) {
  const shown = rtf.toFixed(2);
  return shown + '× · ' + (shown === '1.00' ? 'real time' : rtf > 1 ? 'faster than real time' : 'slower than real time');
}
const fmtClock = (sec) => { const m = Math.floor(sec / 60); return m + ':' + (sec - m * 60).toFixed(1).padStart(4, '0'); };
function el(tag, props, ...kids) {
  const n = document.createElement(tag);
  if (props) for (const [k, v] of Object.entries(props)) {
    if (v == null || v === false) continue;
    if (k === 'class') n.className = v;
    else if (k === 'text') n.textContent = v;
    else if (k.startsWith('on')) n.addEventListener(k.slice(2), v);
    else n.setAttribute(k, v === true ? '' : v);
  }
  for (const c of kids) if (c != null) n.append(c);
  return n;
}
const LITTLE_ENDIAN = new Uint8Array(new Uint16Array([1]).buffer)[0] === 1;

/* ====================================== PCM store ====================================== */
class PcmStore {
  constructor(channels, capacityFrames = SR * 4) {
    this.ch = channels;
    this.data = new Int16Array(capacityFrames * channels);
    this.length = 0;          // samples per channel
    this.complete = false;    // no more audio will be appended
    this.peaks = new PeakTrack();
  }
  ensure(frames) {
    if (frames * this.ch <= this.data.length) return;
    let cap = this.data.length || this.ch;
    while (cap < frames * this.ch) cap *= 2;
    const d = new Int16Array(cap); d.set(this.data.subarray(0, this.length * this.ch)); this.data = d;
  }
  append(int16) {
    const frames = Math.floor(int16.length / this.ch);
    this.ensure(this.length + frames);
    this.data.set(int16.subarray(0, frames * this.ch), this.length * this.ch);
    this.peaks.add(int16.subarray(0, frames * this.ch), this.ch);
    this.length += frames;
  }
  prefix(n) {           // a new store holding samples [0, n) (pads with silence if this one is shorter)
    const s = new PcmStore(this.ch, Math.max(n, SR * 4));
    s.append(this.data.subarray(0, Math.min(n, this.length) * this.ch));
    if (s.length < n) s.append(new Int16Array((n - s.length) * this.ch));
    return s;
  }
  floatLR(from, to) {
    const n = to - from, l = new Float32Array(n), r = new Float32Array(n), d = this.data;
    if (this.ch === 1) for (let i = 0, j = from; i < n; i++, j++) { l[i] = r[i] = d[j] / 32768; }
    else for (let i = 0, j = from * 2; i < n; i++, j += 2) { l[i] = d[j] / 32768; r[i] = d[j + 1] / 32768; }
    return { l, r };
  }
  sample(i, c = 0) { return this.data[i * this.ch + c]; }
}

/* Min/max per 10 ms bucket, appended incrementally as audio arrives (for waveforms). */
class PeakTrack {
  constructor() { this.B = 480; this.min = new Float32Array(1024); this.max = new Float32Array(1024); this.n = 0; this.fill = 0; this.cmin = 1; this.cmax = -1; this.abs = 0; }
  add(int16, ch) {
    const frames = int16.length / ch;
    for (let i = 0; i < frames; i++) {
      let v = int16[i * ch]; if (ch === 2) v = (v + int16[i * ch + 1]) / 2;
      v /= 32768;
      if (v < this.cmin) this.cmin = v; if (v > this.cmax) this.cmax = v;
      if (++this.fill === this.B) this.push();
    }
  }
  push() {
    if (this.n === this.min.length) { const a = new Float32Array(this.n * 2), b = new Float32Array(this.n * 2); a.set(this.min); b.set(this.max); this.min = a; this.max = b; }
    this.min[this.n] = this.cmin; this.max[this.n] = this.cmax; this.n++;
    this.abs = Math.max(this.abs, Math.abs(this.cmin), Math.abs(this.cmax));
    this.fill = 0; this.cmin = 1; this.cmax = -1;
  }
  get count() { return this.n + (this.fill ? 1 : 0); }
  at(i) { return i < this.n ? [this.min[i], this.max[i]] : [this.cmin, this.cmax]; }
}

function wavBlob(int16, channels, rate) {
  const bytes = int16.length * 2, buf = new ArrayBuffer(44 + bytes), dv = new DataView(buf);
  const str = (o, s) => { for (let i = 0; i < s.length; i++) dv.setUint8(o + i, s.charCodeAt(i)); };
  str(0, 'RIFF'); dv.setUint32(4, 36 + bytes, true); str(8, 'WAVE'); str(12, 'fmt ');
  dv.setUint32(16, 16, true); dv.setUint16(20, 1, true); dv.setUint16(22, channels, true);
  dv.setUint32(24, rate, true); dv.setUint32(28, rate * channels * 2, true); dv.setUint16(32, channels * 2, true);
  dv.setUint16(34, 16, true); str(36, 'data'); dv.setUint32(40, bytes, true);
  if (LITTLE_ENDIAN) new Int16Array(buf, 44, int16.length).set(int16);
  else for (let i = 0; i < int16.length; i++) dv.setInt16(44 + 2 * i, int16[i], true);
  return new Blob([buf], { type: 'audio/wav' });
}

/* ====================================== audio out ====================================== */
const audio = {
  ctx: null, node: null, mode: null, ready: false, initPromise: null, last: null, error: null,
  latencyMs() { const c = this.ctx; return c ? ((c.baseLatency || 0) + (c.outputLatency || 0)) * 1000 : 0; },
  init() {
    if (this.initPromise) { if (this.ctx && this.ctx.state === 'suspended') this.ctx.resume(); return this.initPromise; }
    this.initPromise = (async () => {
      const Ctx = window.AudioContext || window.webkitAudioContext;
      if (!Ctx) throw new Error('this browser has no Web Audio');
      try { this.ctx = new Ctx({ sampleRate: SR, latencyHint: 'interactive' }); } catch (e) { this.ctx = new Ctx({ latencyHint: 'interactive' }); }
      if (this.ctx.audioWorklet && window.isSecureContext !== false) {
        await this.ctx.audioWorklet.addModule(new URL('./audio-worklet.js', import.meta.url));
        this.node = new AudioWorkletNode(this.ctx, 'moss-player', { numberOfInputs: 0, numberOfOutputs: 1, outputChannelCount: [2] });
        this.node.port.onmessage = (e) => onPlayerState(e.data);
        this.post = (m, transfer) => this.node.port.postMessage(m, transfer || []);
        this.mode = 'worklet';
      } else {
        // Fallback for insecure origins where AudioWorklet does not exist: same ring, main thread.
        const core = new RingCore(this.ctx.sampleRate);
        this.node = this.ctx.createScriptProcessor(2048, 1, 2);
        this.node.onaudioprocess = (e) => {
          core.render(e.outputBuffer.getChannelData(0), e.outputBuffer.getChannelData(1));
          const r = core.report(); if (r) onPlayerState(r);
        };
        this.post = (m) => core.msg(m);
        this.mode = 'script-processor';
      }
      this.node.connect(this.ctx.destination);
      if (this.ctx.state !== 'running') await Promise.race([this.ctx.resume(), new Promise((r) => setTimeout(r, 300))]);
      this.ready = true;
      S.stats.audioMode = this.mode;
    })().catch((e) => { this.error = e; showAlert('audio', 'Audio output could not start: ' + e.message); throw e; });
    return this.initPromise;
  },
};
document.addEventListener('pointerdown', () => { if (audio.ctx && audio.ctx.state === 'suspended') audio.ctx.resume().then(() => hideAlert(['audio'])); }, true);

/* ====================================== state ====================================== */
const S = {
  hello: null, limits: {}, defaults: { ...BUILTIN_DEFAULTS },
  takes: [], byKey: new Map(), byId: new Map(), nextN: 1, keySeq: 0,
  starts: [],       // start requests sent, in order, each waiting for its server start (or error): [{take, cancelled}]
  seekReq: null,    // the seek sent and not yet acknowledged: {mode, frame, source, take, cancelled}
  rx: null,         // where incoming PCM goes: {kind:'take', take} | {kind:'replay', take, store, base}
  live: null,       // the take the server is generating for us
  selected: null, cursor: 0,
  play: null, streamSeq: 0,
  ab: { a: null, b: null },
  voices: [], voiceById: new Map(),
  lastError: null,
  held: [],         // ids of this connection's takes the service keeps (it drops the oldest beyond limits.max_takes_kept)
  stats: {
    samplesReceived: 0, pcmMessages: 0, jsonMessages: 0, samplesPlayed: 0, underruns: 0,
    bufferLevel: 0, bufferMs: 0, cushion: 0, playing: false, streamsStarted: 0, streamsDrained: 0,
    takesStarted: 0, takesEnded: 0, lastTtfaMs: null, lastEnd: null, lastSeek: null, lastSplice: null,
    replayMismatches: 0, strayPcm: 0, errors: [], reconnects: 0, connects: 0, rttMs: null, audioMode: null,
    protocolErrors: 0, loopLog: [], notesSaved: 0,
  },
  view: { zoom: 1, start: 0 },   // the editor's window on the selected take (zoom 1 = all of it)
  region: null,                  // {from, to} samples of the selected take, whole frames
  comp: [],                      // regions queued for a comp take: [{take, from, to}]
  compSeq: 0,
};

/* ====================================== auth ====================================== */
/* With an API key configured, the page trades the key for a short-lived token (POST /api/token) and
 * sends the token as a Bearer header on HTTP and as ?token= on the WebSocket URL and downloads. */
const KEY_STORAGE = 'moss_rt.api_key';
const auth = {
  key: sessionStorage.getItem(KEY_STORAGE) || localStorage.getItem(KEY_STORAGE) || null,
  token: null, expiresAt: 0, required: null, timer: null,
  fresh(margin) { return this.token && this.expiresAt - Date.now() / 1000 > margin; },
  async ensure() {
    if (this.required === false) return null;
    if (this.fresh(60)) return this.token;
    const cred = this.key;               // only the key buys a token (a token cannot renew itself)
    const r = await fetch('/api/token', { method: 'POST', headers: cred ? { Authorization: 'Bearer ' + cred } : {}, cache: 'no-store' });
    if (r.status === 404 || r.status === 405) { this.required = false; return null; }   // a service without tokens
    if (r.status === 401 || r.status === 403) { this.token = null; this.required = true; const e = new Error('unauthorized'); e.auth = true; throw e; }
    if (!r.ok) throw new Error('token request failed: HTTP ' + r.status);
    const body = await r.json();
    this.required = !!body.auth_required;
    this.token = body.token || null;
    this.expiresAt = body.expires_at || 0;
    clearTimeout(this.timer);
    if (this.token && body.expires_in) this.timer = setTimeout(() => this.ensure().then(() => { for (const t of S.takes) updateCard(t); }).catch(() => {}), Math.max(5, body.expires_in - 60) * 1000);
    return this.token;
  },
  headers() { return this.token ? { Authorization: 'Bearer ' + this.token } : {}; },
  query(url) { return this.token ? url + (url.includes('?') ? '&' : '?') + 'token=' + encodeURIComponent(this.token) : url; },
};
function apiFetch(url, opts = {}) { return fetch(url, { ...opts, headers: { ...(opts.headers || {}), ...auth.headers() } }); }
function askForKey(message) {
  const d = $('keyDialog');
  $('keyError').hidden = !message; $('keyError').textContent = message || '';
  $('apiKey').value = '';
  if (!d.open) { if (d.showModal) d.showModal(); else d.setAttribute('open', ''); }
  $('apiKey').focus();
}
$('keyForm').addEventListener('submit', (e) => {
  e.preventDefault();
  const key = $('apiKey').value.trim(); if (!key) return;
  auth.key = key; auth.token = null;
  sessionStorage.setItem(KEY_STORAGE, key);
  if ($('rememberKey').checked) localStorage.setItem(KEY_STORAGE, key); else localStorage.removeItem(KEY_STORAGE);
  $('keyDialog').close ? $('keyDialog').close() : $('keyDialog').removeAttribute('open');
  conn.attempt = 0; conn.connect();
});

/* ====================================== connection ====================================== */
const conn = {
  ws: null, serial: 0, state: 'idle', attempt: 0, timer: null, pingTimer: null, lastPong: 0, hello: null,
  get ready() { return !!(this.ws && this.ws.readyState === 1 && this.hello); },
  url() { return auth.query((location.protocol === 'https:' ? 'wss://' : 'ws://') + location.host + '/api/ws'); },
  async connect() {
    clearTimeout(this.timer);
    const serial = ++this.serial;
    this.hello = null;
    setConn('connecting', this.attempt ? 'Reconnecting…' : 'Connecting…');
    try { await auth.ensure(); } catch (e) {
      if (serial !== this.serial) return;
      if (e.auth) {
        setConn('closed', 'Key needed');
        setStatus('API key needed', 'This service asks for an API key before it opens the directing channel.');
        askForKey(auth.key ? 'That key was not accepted.' : '');
        auth.key = null; sessionStorage.removeItem(KEY_STORAGE); localStorage.removeItem(KEY_STORAGE);
        return;
      }
      this.scheduleReconnect(); return;
    }
    if (serial !== this.serial) return;
    let ws;
    try { ws = new WebSocket(this.url()); } catch (e) { this.scheduleReconnect(); return; }
    ws.binaryType = 'arraybuffer';
    this.ws = ws;
    ws.onmessage = (ev) => { if (serial === this.serial) onWireMessage(ev.data); };
    ws.onclose = (ev) => {
      if (serial !== this.serial) return;
      this.ws = null; this.hello = null; clearInterval(this.pingTimer);
      onDisconnected(ev);
      this.scheduleReconnect(ev);
    };
    ws.onerror = () => {};
  },
  scheduleReconnect() {
    const delay = Math.min(8000, 500 * 2 ** Math.min(this.attempt, 4));
    this.attempt++;
    const until = Date.now() + delay;
    const tick = () => {
      const left = Math.max(0, until - Date.now());
      setConn('reconnecting', 'Reconnecting in ' + Math.ceil(left / 1000) + ' s');
      setStatus('Connection lost', 'Reconnecting in ' + Math.ceil(left / 1000) + ' s (attempt ' + this.attempt + '). Takes you hold stay playable and downloadable.');
      if (left > 0) this.timer = setTimeout(tick, Math.min(left, 500)); else { S.stats.reconnects++; this.connect(); }
    };
    tick();
  },
  send(obj) {
    if (!this.ready) { showAlert('offline', 'Not connected to the service; waiting for the connection to come back.'); return false; }
    let text = JSON.stringify(obj, (k, v) => (k === 'seed' && typeof v === 'string' ? '\u0000seed' + v + '\u0000' : v));
    text = text.replace(/"\\u0000seed(\d+)\\u0000"/g, '$1');  // seeds may exceed 2^53: send the digits as a JSON number
    this.ws.send(text);
    return true;
  },
  /* Close the socket from this side; the pill says so at once (the close event comes a moment later). */
  drop(code, reason) {
    if (!this.ws) return;
    try { this.ws.close(code, reason); } catch (e) { /* already closing */ }
    setConn('closed', 'Disconnected');
  },
  startPings() {
    clearInterval(this.pingTimer);
    this.lastPong = now();
    this.pingTimer = setInterval(() => {
      if (!this.ready) return;
      if (now() - this.lastPong > 20000) { this.drop(4000, 'no pong'); return; }
      this.send({ type: 'ping', t: now() });
    }, 5000);
  },
};

function onWireMessage(data) {
  if (typeof data === 'string') { handleControl(data); return; }   // servers send frames; tolerate text JSON
  if (data.byteLength < 5) return protocolError('a message shorter than a frame header');
  const dv = new DataView(data);
  const tag = dv.getUint8(0), len = dv.getUint32(1, false);
  if (len !== data.byteLength - 5) return protocolError(`frame length ${len} does not match the message (${data.byteLength - 5} bytes)`);
  if (tag === 0) handleControl(new TextDecoder().decode(new Uint8Array(data, 5)));
  else if (tag === 1) {
    if (len % 2) return protocolError('odd PCM byte count');
    const pcm = new Int16Array(data.slice(5));
    if (!LITTLE_ENDIAN) for (let i = 0; i < pcm.length; i++) pcm[i] = ((pcm[i] & 0xff) << 8) | ((pcm[i] >> 8) & 0xff);
    handlePcm(pcm);
  } else protocolError('unknown frame tag ' + tag);
}
function protocolError(msg) { S.stats.protocolErrors++; showAlert('protocol', msg); }

function handleControl(text) {
  let msg;
  text = text.replace(/"seed"\s*:\s*(\d{16,})/g, '"seed":"$1"');   // seeds past 2^53 stay exact (as strings)
  try { msg = JSON.parse(text); } catch (e) { return protocolError('invalid JSON from the server'); }
  const seedMatch = /"seed"\s*:\s*(\d+)/.exec(text);       // keep 64-bit seeds exact
  if (seedMatch) msg.seed = seedMatch[1];
  S.stats.jsonMessages++;
  switch (msg.type) {
    case 'hello': return onHello(msg);
    case 'start': return onStart(msg);
    case 'seek': return onSeekAck(msg);
    case 'end': return onEnd(msg);
    case 'error': return onServerError(msg);
    case 'session': return onSession(msg);
    case 'pong': conn.lastPong = now(); if (typeof msg.t === 'number') S.stats.rttMs = now() - msg.t; updateConnTitle(); return;
    default: return;  // forward compatible: unknown types are ignored
  }
}

/* ====================================== protocol handlers ====================================== */
function onHello(msg) {
  conn.hello = msg; S.hello = msg; conn.attempt = 0; S.stats.connects++;
  S.limits = msg.limits || {};
  S.held = [];
  const d = msg.defaults || msg.sampling_defaults || {};
  S.defaults = { ...BUILTIN_DEFAULTS, ...d };
  if (S.limits.max_new_tokens && !('max_new_tokens' in d)) S.defaults.max_new_tokens = S.limits.max_new_tokens;
  applyLimits();
  applyParamDefaults();
  // Models.
  const sel = $('model'); const keep = sel.value;
  sel.replaceChildren(...(msg.models || []).map((m) => el('option', { value: m, text: m })));
  sel.value = (msg.models || []).includes(keep) ? keep : (msg.default_model || (msg.models || [])[0] || '');
  sel.disabled = (msg.models || []).length < 2;
  $('engineTag').textContent = [msg.engine && ('engine ' + msg.engine), (msg.sr || SR) / 1000 + ' kHz'].filter(Boolean).join(' · ');
  $('demoBanner').hidden = !msg.demo || localStorage.getItem(DEMO_DISMISSED) === '1';
  if (msg.demo && msg.engine === 'scripted') {
    $('demoText').textContent = 'The service is running its scripted test engine (no model): the audio is a test signal, everything else (streaming, seeking, takes) is real.';
    $('demoShort').textContent = 'Scripted test engine; the rest is real.';
  }
  $('demoBanner').title = $('demoText').textContent;
  setConn('open', 'Connected');
  conn.startPings();
  if (msg.sessions) sessionStore.resume();
  loadVoices();
  refreshTransport();
  if (!hasPending() && !S.live) setStatus('Ready', 'Write a scene and press Speak.');
  hideAlert(['offline', 'protocol']);
}

function onStart(msg) {
  let take = null;
  const rx = S.rx;
  if (rx && rx.kind === 'replay' && msg.take === rx.take.id) { rx.started = true; return; }
  if (msg.replay) return;                 // a replay we stopped listening to
  if (rx && rx.kind === 'take' && rx.take.id === msg.take) take = rx.take;                  // retake after its seek ack
  else if (S.starts.length) {
    // The server answers start requests in order (each with a start, or an error). If it echoes our
    // label, trust that instead: requests before the labelled one will never start.
    let i = msg.label != null ? S.starts.findIndex((r) => r.take.key === msg.label) : -1;
    if (i < 0) i = 0;
    const r = S.starts[i]; S.starts.splice(0, i + 1);
    take = r.take; take.muted = !!r.cancelled;
  }
  else take = newTake({ req: null });                                                         // not ours (should not happen)
  if (!take.id) { take.id = msg.take; S.byId.set(take.id, take); }
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
  S.rx = { kind: 'take', take };
  S.live = take;
  S.stats.takesStarted++;
  if (!S.takes.includes(take)) addTake(take);
  if (!take.isRetake) {             // a fresh take: follow it and play it as it streams
    selectTake(take, 0);
    if (!take.muted) startStream(take, take.pcm, 0, 0, 'live');
    announce('Speaking ' + take.name + '.');
    showWaveOnPhone();
  }
  updateCard(take); refreshTransport(); drawAll();
}

function handlePcm(pcm) {
  S.stats.pcmMessages++;
  const rx = S.rx;
  if (!rx) { S.stats.strayPcm += pcm.length; return; }
  if (rx.kind === 'take') {
    const take = rx.take, before = take.pcm.length;
    take.pcm.append(pcm);
    const n = take.pcm.length - before;
    S.stats.samplesReceived += n;
    if (take.firstPcmAt == null) {
      take.firstPcmAt = now();
      take.ttfaClient = take.firstPcmAt - take.sentAt;
      S.stats.lastTtfaMs = take.ttfaClient;
    }
    take.lastPcmAt = now();
    const ts = take.tailSplice;
    if (ts && !ts.cut && take.pcm.length >= ts.to + XFADE) { ts.cut = true; conn.send({ type: 'cancel' }); }   // the region is re-done
  } else {
    const before = rx.store.length;
    rx.store.append(pcm);
    S.stats.samplesReceived += rx.store.length - before;
    const held = rx.take.pcm, ch = held.ch;
    const from = rx.base + before, to = Math.min(rx.base + rx.store.length, held.length);
    for (let i = from; i < to; i++) if (held.data[i * ch] !== rx.store.data[(i - rx.base) * ch]) { S.stats.replayMismatches++; break; }
  }
  feed();
  scheduleDraw();
}

function onSeekAck(msg) {
  const p = S.seekReq;
  S.seekReq = null;
  const source = S.byId.get(msg.from_take);
  S.stats.lastSeek = { take: msg.take, from_take: msg.from_take, frame: msg.frame, sample: msg.sample, requestedFrame: p ? p.frame : null, mode: p ? p.mode : null };
  if (!source) { showAlert('seek', 'The service acknowledged a seek on a take this page does not hold.'); return; }
  if (msg.sample !== msg.frame * FRAME) showAlert('protocol', `seek ack sample ${msg.sample} is not frame ${msg.frame} × ${FRAME}`);
  const sample = msg.sample;
  if (msg.take === msg.from_take) {                                  // replay: the same take re-sent from the sample
    if (p && p.cancelled) return;
    const store = new PcmStore(source.pcm.ch);
    S.rx = { kind: 'replay', take: source, store, base: sample };
    selectTake(source, sample);
    startStream(source, store, 0, sample, 'replay');
    setStatus('Replaying ' + source.name, 'From ' + fmtSec(sample) + ' (frame ' + msg.frame + '), re-sent by the service.');
    refreshTransport();
    return;
  }
  // Retake: the new take keeps the source's samples before the splice exactly, then the continuation.
  const take = p && p.take ? p.take : newTake({ req: source.req });
  take.id = msg.take; S.byId.set(take.id, take);
  serviceKeeps(take.id);
  take.parent = source.key; take.spliceSample = sample; take.spliceFrame = msg.frame; take.isRetake = true;
  if (p && p.tail && p.tail.source === source) take.tailSplice = p.tail;     // a region retake that keeps the old tail
  take.pcm = source.pcm.prefix(sample);
  take.status = 'streaming'; take.conn = conn.serial;
  S.stats.lastSplice = { take: msg.take, from_take: msg.from_take, frame: msg.frame, sample, prefixSamples: take.pcm.length,
    parentHeld: source.pcm.length, padded: source.pcm.length < sample };
  S.rx = { kind: 'take', take };
  S.live = take;
  addTake(take);
  selectTake(take, sample);
  const pre = Math.round(parseFloat($('preroll').value || '0') * SR);
  take.muted = !!(p && p.cancelled);
  if (!take.muted) startStream(take, take.pcm, Math.max(0, sample - pre), 0, 'retake');
  announce('Retaking ' + source.name + ' from ' + fmtSec(sample) + ' as ' + take.name + '.');
  showWaveOnPhone();
  updateCard(take); refreshTransport(); drawAll();
}

function onEnd(msg) {
  const rx = S.rx;
  if (rx && rx.kind === 'replay' && rx.take.id === msg.take) {
    rx.store.complete = true; S.rx = null; feed(); refreshTransport(); return;
  }
  if (msg.replay) return;                 // the end of a replay we stopped listening to: the take itself is unchanged
  if (msg.take) serviceKeeps(msg.take);
  let take = S.byId.get(msg.take);
  if (!take && S.starts.length) take = S.starts.shift().take;    // ended before it ever started
  if (!take) return;
  take.end = msg;
  take.status = msg.reason || 'done';
  if (sessionStore.id && msg.n_frames > 0 && take.conn === conn.serial) take.stored = sessionStore.id;   // kept before its end was sent
  take.endAt = now();
  if (take.pcm) take.pcm.complete = true;
  if (S.rx && S.rx.take === take) S.rx = null;
  if (S.live === take) S.live = null;
  S.stats.takesEnded++;
  S.stats.lastEnd = { ...msg, receivedSamples: take.pcm ? take.pcm.length : 0 };
  if (take.pcm && msg.n_frames != null && take.pcm.length !== msg.n_frames * FRAME) take.mismatch = `holds ${take.pcm.length} samples, the service reports ${msg.n_frames} frames`;
  feed();
  const kept = !!(take.pcm && take.pcm.length);
  // Nothing to keep: no audio, or replaced by a new Speak before the director heard a quarter second of it.
  if (!kept && (msg.reason === 'replaced' || msg.reason === 'cancelled')) removeTake(take);
  else if (msg.reason === 'replaced' && (take.heardSamples || 0) < SR / 4 && !take.title && !take.starred && !take.note) removeTake(take);
  else updateCard(take);
  if (take.tailSplice) {
    const ts = take.tailSplice;
    if (take.pcm && take.pcm.length >= ts.to + XFADE && S.takes.includes(ts.source)) {
      const spliced = spliceOldTail(take, ts.source, ts.to);
      announce(takeTitle(spliced) + ': the region re-done, the old tail back after ' + fmtSec(ts.to) + '.');
      setStatus('Spliced', takeTitle(spliced) + ': new audio ' + fmtSec(take.spliceSample) + ' – ' + fmtSec(ts.to) + ', then ' + ts.source.name + '\'s tail (10 ms crossfade).');
    } else showAlert('splice', 'The retake ended before the region\'s end, so the old tail was not brought back.', { info: true });
    refreshTransport(); drawAll();
    return;
  }
  if (!S.live && !hasPending()) {
    const what = { done: 'finished', max_frames: 'reached its frame limit', cancelled: 'cancelled', replaced: 'replaced', shutdown: 'stopped: the service is shutting down', error: 'ended with an error' }[msg.reason] || msg.reason;
    if (kept || msg.reason !== 'replaced') announce(take.name + ' ' + what + (kept ? ', ' + fmtSec(take.pcm.length) + '.' : '.'));
    if (!S.play || msg.reason === 'cancelled') setStatus(msg.reason === 'cancelled' ? 'Cancelled' : 'Ready', msg.reason === 'cancelled' ? take.name + ' cancelled at ' + fmtSec(kept ? take.pcm.length : 0) + '.' : lastTakeSummary());
  }
  refreshTransport(); drawAll();
  if (msg.reason === 'error') showAlert('error', 'The take ended with an error.');
}

function onServerError(msg) {
  S.stats.errors.push({ code: msg.code, message: msg.message, field: msg.field, take: msg.take });
  if (S.stats.errors.length > 50) S.stats.errors.shift();
  if (msg.field === 'session') { sessionStore.lost(msg); return; }      // an answer to resume, not to a take
  if (!(msg.take && S.byId.has(msg.take))) {          // not about a take we know: a request of ours was refused
    if (S.seekReq && (msg.field === 'take' || msg.field === 'frame' || !S.starts.length)) S.seekReq = null;
    else if (S.starts.length) S.starts.shift();
  }
  if (msg.take) {
    const t = S.byId.get(msg.take);
    if (t && t.status === 'streaming') { t.status = 'error'; t.pcm && (t.pcm.complete = true); if (S.live === t) S.live = null; if (S.rx && S.rx.take === t) S.rx = null; updateCard(t); }
  }
  if (msg.field) markField(msg.field, msg.message);
  const retry = msg.code === 'busy' || msg.code === 'loading' || msg.code === 'rate_limited';
  showAlert(msg.code || 'error', msg.message || 'The service reported an error.', { retry });
  if (!S.live && !S.play) setStatus(msg.code === 'busy' ? 'Service busy' : msg.code === 'loading' ? 'Model loading' : msg.code === 'rate_limited' ? 'Limit reached' : 'Not started', msg.message || '');
  refreshTransport(); feed();
}

function onDisconnected(ev) {
  setConn('closed', 'Disconnected');
  const lost = S.live;
  if (lost) { lost.status = 'disconnected'; lost.pcm && (lost.pcm.complete = true); updateCard(lost); }
  if (S.rx && S.rx.kind === 'replay') S.rx.store.complete = true;
  S.live = null; S.rx = null; S.starts = []; S.seekReq = null;
  feed();                         // let the player drain what it holds
  refreshTransport();
  for (const t of S.takes) updateCard(t);
  if (ev && ev.code === 1008) showAlert('closed', 'The service closed the connection: ' + (ev.reason || 'policy violation'));
}

/* ====================================== sessions kept by the service ====================================== */
/* The service keeps a directing session on disk: its takes (codes, parameters, seeds), the director's notes and the
 * audio as heard. The page binds each connection to it with `resume` (its id is kept in this browser, or given as
 * ?session= in the address), so a reload, a reconnect or a server restart brings every take back, playable and
 * retakeable. Notes and deletions go over plain HTTP (/api/sessions/...). Comps and region splices are made here
 * from held audio and are not kept (the page asks before it is closed with one). */
const SESSION_KEY = 'moss_rt.studio.session';
const sessionStore = {
  id: null, max: null, dirty: new Set(), timer: null,
  initialId() { return new URLSearchParams(location.search).get('session') || localStorage.getItem(SESSION_KEY); },
  path(p) { return '/api/sessions/' + encodeURIComponent(this.id) + p; },
  resume() { const id = this.id || this.initialId(); conn.send(id ? { type: 'resume', session: id } : { type: 'resume' }); },
  lost(msg) {
    if (msg.code !== 'not_found') { showAlert(msg.code || 'session', msg.message || 'The session could not be resumed.'); return; }
    try { localStorage.removeItem(SESSION_KEY); } catch (e) { /* private mode */ }
    this.id = null;
    if (conn.ready) conn.send({ type: 'resume' });       // a new session
    showAlert('session', 'That session is not kept by this service (deleted, or another data dir); a new one was started.', { info: true });
  },
  saveNotes(t) {
    if (!t.stored || t.stored !== this.id) return;
    this.dirty.add(t); clearTimeout(this.timer); this.timer = setTimeout(() => this.flushNotes(), 300);
  },
  async flushNotes() {
    const items = [...this.dirty]; this.dirty.clear();
    for (const t of items) {
      if (!S.takes.includes(t)) continue;
      const body = { title: t.title || '', starred: !!t.starred, note: t.note || '', markers: (t.markers || []).map((m) => ({ sample: m.sample, label: m.label })) };
      try {
        const r = await apiFetch(this.path('/takes/' + encodeURIComponent(t.id)), { method: 'PATCH', headers: { 'Content-Type': 'application/json' }, body: JSON.stringify(body) });
        if (!r.ok) { const b = await r.json().catch(() => null); throw new Error((b && b.error && b.error.message) || 'HTTP ' + r.status); }
        S.stats.notesSaved++;
      } catch (e) { showAlert('session', 'The notes of ' + t.name + ' were not saved: ' + e.message); }
    }
  },
  /* A take removed from the page leaves the session too (deleted, or junk the director never heard). */
  async forget(t, retry = true) {
    if (!t.stored || t.stored !== this.id || !t.id) return;
    try {
      const r = await apiFetch(this.path('/takes/' + encodeURIComponent(t.id)), { method: 'DELETE' });
      if (r.status === 404 && retry) { setTimeout(() => this.forget(t, false), 1000); return; }   // not stored yet
      if (!r.ok) throw new Error('HTTP ' + r.status);
    } catch (e) { showAlert('session', t.name + ' could not be deleted from the session: ' + e.message); }
  },
};
function onSession(msg) {
  sessionStore.id = msg.session; sessionStore.max = msg.max_takes || null;
  try { localStorage.setItem(SESSION_KEY, msg.session); } catch (e) { /* private mode */ }
  const fresh = (msg.takes || []).filter((rec) => !S.byId.has(rec.take_id)).length;
  for (const rec of msg.takes || []) adoptStoredTake(rec);
  refreshSessionUi(); refreshTransport(); drawAll();
  if (msg.resumed && fresh) {
    announce(plural(fresh, 'take') + ' back from the session.');
    if (!S.live && !hasPending()) setStatus('Session resumed', plural(fresh, 'take') + ' back from the service, every one playable and retakeable.');
  }
}
function adoptStoredTake(rec) {
  const known = S.byId.get(rec.take_id);
  if (known) { known.conn = conn.serial; known.dropped = false; known.stored = sessionStore.id; updateCard(known); return; }
  const req = { ...(rec.request || {}) }; delete req.type; delete req.take;
  req.referenceName = voiceName(req.reference);
  const t = newTake({ req });
  t.id = rec.take_id; S.byId.set(t.id, t);
  t.seed = String(rec.seed); t.status = rec.reason || 'done';
  t.end = { type: 'end', take: rec.take_id, reason: rec.reason, n_frames: rec.n_frames, ...(rec.stats || {}) };
  const parent = rec.parent && S.byId.get(rec.parent);
  if (parent) t.parent = parent.key;
  t.spliceFrame = rec.branch_frame || 0; t.spliceSample = t.spliceFrame * FRAME; t.isRetake = !!rec.parent;
  t.title = rec.title || ''; t.starred = !!rec.starred; t.note = rec.note || ''; t.markers = rec.markers || [];
  t.created = new Date((rec.created || Date.now() / 1000) * 1000);
  t.conn = conn.serial; t.stored = sessionStore.id;
  t.pcm = new PcmStore(rec.channels || 1, 1);
  addTake(t);
  if (!S.selected) selectTake(t, 0);
  loadStoredAudio(t);
}
async function loadStoredAudio(t) {
  try {
    const r = await apiFetch(sessionStore.path('/takes/' + encodeURIComponent(t.id) + '.wav'), { cache: 'no-store' });
    if (!r.ok) throw new Error('HTTP ' + r.status);
    const { ch, pcm } = parseWav(await r.arrayBuffer());
    const store = new PcmStore(ch, pcm.length / ch);
    store.append(pcm); store.complete = true;
    t.pcm = store;
    if (t.end && t.end.n_frames != null && store.length !== t.end.n_frames * FRAME) t.mismatch = `holds ${store.length} samples, the session says ${t.end.n_frames} frames`;
  } catch (e) { showAlert('session', 'The audio of ' + t.name + ' could not be loaded: ' + e.message); }
  updateCard(t);
  if (S.selected === t) selectTake(t, S.cursor);
  refreshTransport(); scheduleDraw();
}
/* 16-bit PCM WAV (what the service writes) → channels and interleaved samples. */
function parseWav(buf) {
  const dv = new DataView(buf), tag = (o) => String.fromCharCode(dv.getUint8(o), dv.getUint8(o + 1), dv.getUint8(o + 2), dv.getUint8(o + 3));
  if (buf.byteLength < 12 || tag(0) !== 'RIFF' || tag(8) !== 'WAVE') throw new Error('not a WAV file');
  let ch = 1, off = 12;
  while (off + 8 <= buf.byteLength) {
    const id = tag(off), size = dv.getUint32(off + 4, true);
    if (id === 'fmt ') { ch = dv.getUint16(off + 10, true); if (dv.getUint16(off + 22, true) !== 16) throw new Error('not 16-bit PCM'); }
    if (id === 'data') {
      const n = Math.min(size, buf.byteLength - off - 8) >> 1, pcm = new Int16Array(n);
      for (let i = 0; i < n; i++) pcm[i] = dv.getInt16(off + 8 + 2 * i, true);
      return { ch, pcm };
    }
    off += 8 + size + (size & 1);
  }
  throw new Error('no audio in the WAV file');
}
function refreshSessionUi() {
  const on = !!sessionStore.id;
  $('sessionBar').hidden = !on;
  if (!on) return;
  $('sessionExport').href = auth.query(sessionStore.path('/archive'));
  $('sessionInfo').textContent = 'Kept by the service' + (sessionStore.max ? ' · up to ' + sessionStore.max + ' takes' : '');
  $('sessionInfo').title = 'Session ' + sessionStore.id + ': takes stay until you delete them, across reloads and restarts.';
}

/* ====================================== takes ====================================== */
function newTake({ req }) {
  const take = { key: 'k' + (++S.keySeq), n: null, id: null, req, seed: req && req.seed != null ? String(req.seed) : null,
    status: 'pending', pcm: null, conn: conn.serial, created: new Date(), name: 'the new take' };
  S.byKey.set(take.key, take);
  return take;
}
function addTake(take) {
  take.n = S.nextN++; take.name = 'Take ' + take.n;   // numbered when the service accepts it
  S.takes.push(take);
  const card = buildCard(take);
  $('takeList').prepend(card);
  $('takesEmpty').hidden = true;
  // Keep memory bounded: drop the oldest takes beyond 60, or beyond the session's quota when the service keeps
  // them (they stay in the session on disk, and come back on a reload).
  while (S.takes.length > Math.max(60, sessionStore.max || 0)) {
    const old = S.takes.find((t) => t !== S.live && t !== S.selected && t !== S.ab.a && t !== S.ab.b);
    if (!old) break;
    S.takes.splice(S.takes.indexOf(old), 1); S.byKey.delete(old.key); if (old.id) S.byId.delete(old.id);
    old.card && old.card.remove();
  }
  applyFilter();
}
function hasPending() { return S.starts.length > 0 || !!S.seekReq; }
/* renumber: a take the director never really had (no audio, or replaced unheard) leaves no gap in the
 * numbering; a take the director deletes keeps the others' numbers (they may be written down). */
function removeTake(take, renumber = true) {
  if (S.play && S.play.take === take) stopPlayback();
  sessionStore.forget(take);
  const i = S.takes.indexOf(take);
  if (i >= 0) S.takes.splice(i, 1);
  S.byKey.delete(take.key); if (take.id) S.byId.delete(take.id);
  take.card && take.card.remove();
  if (take.n != null && renumber) {
    for (const t of S.takes) if (t.n > take.n) { t.n--; t.name = 'Take ' + t.n; t.card && updateCard(t); }
    S.nextN--;
    if (S.selected && S.selected !== take) $('edTitle').textContent = takeTitle(S.selected);
  }
  for (const k of ['a', 'b']) if (S.ab[k] === take) S.ab[k] = null;
  if (S.selected === take) selectTake(S.takes[S.takes.length - 1] || null, 0);
  $('takesEmpty').hidden = S.takes.length > 0;
  S.comp = S.comp.filter((g) => g.take !== take); renderComp();
  applyFilter();
}
function serverHolds(take) { return !!(take && take.id && take.conn === conn.serial && conn.ready && !take.dropped); }
/* The service keeps the last limits.max_takes_kept takes of a connection (the running one never goes): mirror
 * that, so a take it has dropped is not offered for replay, retake or service download (they would fail). */
function serviceKeeps(id) {
  if (sessionStore.id) return;            // bound to a stored session: the service keeps takes until deleted
  if (S.held.includes(id)) return;
  S.held.push(id);
  const max = S.limits.max_takes_kept || 32;
  while (S.held.length > max) {
    const i = S.held.findIndex((x) => !(S.live && S.live.id === x));
    if (i < 0) break;
    const [gone] = S.held.splice(i, 1);
    const t = S.byId.get(gone);
    if (t) { t.dropped = true; updateCard(t); }
  }
  refreshTransport();
}
function takeTitle(t) { return t.title ? t.title + ' (' + t.name + ')' : t.name; }
/* Screen readers hear discrete events (a take started, ended, failed), never the meters' ticks. */
function announce(text) { $('announce').textContent = text; }
/* On a phone the waveform sits below the whole scene form: bring it up when a take starts playing. */
function showWaveOnPhone() {
  if (!matchMedia('(max-width: 860px)').matches) return;
  requestAnimationFrame(() => wave.scrollIntoView({ block: 'center', behavior: 'smooth' }));
}

function collectRequest() {
  const req = {
    text: $('text').value, instruction: $('instruction').value, language: $('language').value.trim(),
    reference: $('voice').value || 'none', model: $('model').value || (S.hello && S.hello.default_model) || undefined,
  };
  for (const p of PARAMS) {
    if (!p.key || p.client) continue;
    const v = readParam(p);
    if (v === undefined) continue;
    req[p.key] = p.key === 'channels' ? parseInt(v, 10) : v;
  }
  if (seedMode === 'fixed') req.seed = $('seed').value.trim();
  return req;
}

function validateScene(req) {
  clearFieldErrors();
  let ok = true;
  if (!req.text.trim()) { markField('text', 'Write something for the voice to say.'); ok = false; }
  if (S.limits.max_text_chars && req.text.length > S.limits.max_text_chars) { markField('text', `${req.text.length} characters: at most ${S.limits.max_text_chars} are accepted. Shorten it before speaking.`); ok = false; }
  if (S.limits.max_instruction_chars && req.instruction.length > S.limits.max_instruction_chars) { markField('instruction', `${req.instruction.length} characters: at most ${S.limits.max_instruction_chars} are accepted.`); ok = false; }
  if (seedMode === 'fixed' && !/^\d{1,19}$/.test(req.seed || '')) { markField('seed', 'A fixed seed is a whole number ≥ 0.'); ok = false; }
  for (const p of PARAMS) if (p.key && !p.client && paramInvalid(p)) { markField(p.key, 'Out of range'); ok = false; }
  return ok;
}

async function speak() {
  if (!conn.ready) { showAlert('offline', 'Not connected yet.'); return; }
  const req = collectRequest();
  if (!validateScene(req)) { setStatus('Check the scene', 'Some fields need attention.'); return; }
  hideAlert();
  audio.init().catch(() => {});
  stopPlayback();
  const take = newTake({ req: { ...req, referenceName: voiceName(req.reference) } });
  take.sentAt = now();
  const r = { take };
  S.starts.push(r);
  const msg = { type: 'start', ...req, take: take.key, channels: req.channels || 1 };
  if (seedMode !== 'fixed') delete msg.seed;
  if (!conn.send(msg)) { S.starts.pop(); return; }
  setStatus('Requesting a take…', 'Waiting for the first audio.');
  refreshTransport();
  saveScene();
}

function cancelAll() {
  const hadPlayback = !!S.play;
  stopPlayback();
  if (S.live || hasPending() || (S.rx && S.rx.kind === 'replay')) {
    conn.send({ type: 'cancel' });
    if (S.live) S.live.cancelling = true;
    setStatus('Cancelling…', 'Audio stopped.');
    const pend = [...S.starts, S.seekReq].filter(Boolean);
    for (const r of pend) r.cancelled = true;      // whatever the service still sends for them is kept silent
    if (pend.length) setTimeout(() => {            // a request cancelled while being admitted may never be answered
      const before = S.starts.length + (S.seekReq ? 1 : 0);
      S.starts = S.starts.filter((r) => !pend.includes(r));
      if (pend.includes(S.seekReq)) S.seekReq = null;
      if (S.starts.length + (S.seekReq ? 1 : 0) !== before) { if (!S.live) setStatus('Cancelled', ''); refreshTransport(); }
    }, 5000);
  } else if (hadPlayback) setStatus('Stopped', '');
  if (S.rx && S.rx.kind === 'replay') { S.rx.store.complete = true; S.rx = null; }
  refreshTransport();
}

function seek(mode, tail = null) {
  const src = S.selected;
  if (!src || !serverHolds(src)) return;
  if (!src.pcm || !src.pcm.length) return;
  const frame = Math.floor(S.cursor / FRAME);
  audio.init().catch(() => {});
  stopPlayback();
  const msg = { type: 'seek', take: src.id, frame, mode };
  let take = null;
  if (mode === 'retake') {
    const rtSeed = $('rtSeedMode').value;
    if (rtSeed === 'same') msg.seed = src.seed;
    else if (rtSeed === 'fixed') {
      const v = $('rtSeed').value.trim();
      if (!/^\d{1,19}$/.test(v)) { $('rtSeed').classList.add('invalid'); return; }
      msg.seed = v;
    }                                      // 'new': the service picks a fresh seed and reports it in its start
    const ins = $('rtInstruction').value, txt = $('rtText').value;
    if (ins.trim()) msg.instruction = ins;
    if (txt.trim()) msg.text = txt;
    const req = { ...(src.req || {}), seed: msg.seed ?? null };
    if (msg.instruction) req.instruction = msg.instruction;
    if (msg.text) req.text = msg.text;
    if ($('rtParams').checked) for (const k of SAMPLING_KEYS) { const v = readParam(PARAMS.find((p) => p.key === k)); if (v !== undefined) { msg[k] = v; req[k] = v; } }
    take = newTake({ req });
    take.seed = msg.seed ?? null;
    take.sentAt = now();
  }
  S.seekReq = { mode, frame, source: src, take, tail };
  if (!conn.send(msg)) { S.seekReq = null; return; }
  setStatus(mode === 'retake' ? 'Retaking ' + src.name + ' from ' + fmtSec(frame * FRAME) + '…' : 'Replaying ' + src.name + '…',
    mode === 'retake' ? 'Everything before frame ' + frame + ' is kept exactly.' : 'The service re-sends the stored audio.');
  refreshTransport();
}

/* ====================================== playback ====================================== */
function startStream(take, store, from, base, kind) {
  const id = ++S.streamSeq;
  S.play = { id, take, store, pos: from, startPos: from, base, kind, fed: 0, played: 0, level: 0, endSent: false, primed: false };
  S.stats.streamsStarted++;
  audio.init().then(() => {
    if (!S.play || S.play.id !== id) return;
    S.play.cushion = Math.round(clamp(+readParam(PARAMS.find((p) => p.key === 'cushion_ms')) || 200, 20, 3000) * SR / 1000);
    audio.post({ t: 'stream', id, cushion: S.play.cushion });
    S.play.posted = true;
    feed();
    if (audio.ctx.state !== 'running') {
      audio.ctx.resume();
      setTimeout(() => { if (audio.ctx.state !== 'running' && S.play) showAlert('audio', 'The browser is holding audio back: click anywhere on the page to hear it.', { info: true }); }, 400);
    }
  }).catch(() => {});
  refreshTransport();
  scheduleDraw();
}
function feed() {
  const p = S.play;
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
      S.stats.loopLog.push([p.pos, p.pos + n]); if (S.stats.loopLog.length > 400) S.stats.loopLog.shift();
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
function stopPlayback() {
  if (S.play) { audio.ready && audio.post({ t: 'stop' }); S.play = null; }
  S.stats.playing = false; S.stats.bufferLevel = 0; S.stats.bufferMs = 0;
  scheduleDraw();
}
function onPlayerState(m) {
  S.stats.samplesPlayed = m.totalPlayed;
  S.stats.underruns = m.totalUnderruns;
  const p = S.play;
  if (!p || m.id !== p.id) { S.stats.playing = false; return; }
  p.played = m.played; p.level = m.level; p.primed = m.primed; p.cushion = m.cushion; p.underruns = m.underruns;
  if (p.kind === 'live' || p.kind === 'retake') {
    const t = p.take;
    t.underruns = m.underruns;                       // this take's own starvations while it streamed
    const pos = p.startPos + m.played, first = t.spliceSample || 0;   // a retake's own audio starts at the splice
    t.heardSamples = Math.max(t.heardSamples || 0, pos - first);
    if (t.heardMs == null && t.sentAt != null && m.primed && pos > first) {
      // What the director hears: the first sample of the take's own audio leaving the speaker. The player
      // reports after a render quantum; what it played past that sample is already heard, so subtract it,
      // and add the output latency the browser states (the way to the speaker).
      const past = (pos - first) / SR * 1000;
      t.heardMs = Math.max(t.ttfaClient ?? 0, now() - t.sentAt - past) + audio.latencyMs();
    }
  }
  S.stats.bufferLevel = p.fed - p.played; S.stats.bufferMs = S.stats.bufferLevel / SR * 1000; S.stats.cushion = m.cushion;
  S.stats.playing = m.primed && m.active;
  if (m.drained) {
    S.stats.streamsDrained++;
    S.play = null; S.stats.playing = false;
    if (!S.live && !hasPending()) setStatus('Ready', lastTakeSummary());
    refreshTransport();
  } else feed();
  scheduleDraw();
}
function playheadSample() {
  const p = S.play;
  if (!p) return null;
  if (p.loop) return p.loop.from + (p.startPos - p.loop.from + p.played) % (p.loop.to - p.loop.from);
  return p.base + p.startPos + p.played;
}
function playLoop(take, from, to) {
  if (!take || !take.pcm || to <= from) return;
  audio.init().catch(() => {});
  stopPlayback();
  startStream(take, take.pcm, from, 0, 'local');
  S.play.loop = { from, to };
  setStatus('Looping ' + takeTitle(take), fmtSec(from) + ' – ' + fmtSec(to) + ', over and over (Esc stops).');
  refreshRegion();
}
function playLocal(take, from) {
  if (!take || !take.pcm || !take.pcm.length) return;
  audio.init().catch(() => {});
  if (from >= take.pcm.length - FRAME / 4) from = 0;
  stopPlayback();
  startStream(take, take.pcm, from, 0, 'local');
  if (S.selected !== take) selectTake(take, from);
  setStatus('Playing ' + take.name, 'From ' + fmtSec(from) + ', from the audio this page holds.');
}

/* ====================================== UI: transport & meters ====================================== */
function setConn(state, text) { const c = $('conn'); c.dataset.state = state; $('connText').textContent = text; refreshTransport(); }
function updateConnTitle() { $('conn').title = S.stats.rttMs != null ? 'Round trip ' + S.stats.rttMs.toFixed(0) + ' ms' : ''; }
function setStatus(main, sub) {
  $('statusMain').textContent = main; $('statusSub').textContent = sub || '';
  const title = (S.live ? '● ' : S.play ? '▶ ' : '') + 'moss_rt studio';
  if (document.title !== title) document.title = title;
}
function lastTakeSummary() {
  const t = S.selected; if (!t || !t.pcm) return '';
  return t.name + ' · ' + fmtSec(t.pcm.length) + ' · seed ' + (t.seed ?? '—');
}
function refreshTransport() {
  const busy = !!(hasPending() || S.live);
  $('speak').disabled = !conn.ready;
  $('speakLabel').textContent = busy ? 'Speak again' : 'Speak';
  $('cancel').disabled = !(busy || S.play || (S.rx && S.rx.kind === 'replay'));
  const t = S.selected;
  const canServer = serverHolds(t) && t.pcm && t.pcm.length > 0 && t.status !== 'streaming';
  const atEnd = !!(t && t.pcm && t.pcm.length && S.cursor >= t.pcm.length);
  $('replayBtn').disabled = !canServer || atEnd;
  $('retakeBtn').disabled = !(serverHolds(t) && t.pcm && t.pcm.length > 0);
  $('retakeBtn').textContent = atEnd && t.status !== 'streaming' ? 'Continue from the end' : 'Retake from here';
  const why = !t ? '' : !t.id ? '' : t.conn !== conn.serial ? 'This take belongs to an earlier connection: the service no longer has it in this session. Play and download still work.'
    : t.dropped ? 'The service no longer holds this take (it keeps the last ' + (S.limits.max_takes_kept || 32) + ' of a connection). Play and download still work.' : '';
  $('retakeBtn').title = why || 'Keep everything before the playhead, generate a new continuation (Ctrl+Shift+Enter)';
  $('replayBtn').title = why || (t && t.status === 'streaming' ? 'Available when the take has finished' : 'Have the service re-send this take\'s audio from the playhead');
  $('edPlay').disabled = !(t && t.pcm && t.pcm.length);
  $('edPlay').textContent = S.play && S.play.kind === 'local' && S.play.take === t ? 'Stop' : 'Play';
  $('speak').classList.toggle('busy', busy);
  if (hasPending() && !$('speak').querySelector('.spinner')) $('speak').prepend(el('span', { class: 'spinner' }));
  if (!hasPending()) { const sp = $('speak').querySelector('.spinner'); sp && sp.remove(); }
  refreshCompare(); refreshRegion();
}
function updateMeters() {
  const t = S.live || (S.play && S.play.take) || S.selected;
  if (t && t.pcm) {
    const fresh = t.pcm.length - (t.spliceSample || 0);
    $('mTtfa').innerHTML = t.heardMs != null ? t.heardMs.toFixed(0) + '<small> ms</small>' : '—';
    $('mTtfaS').textContent = [t.ttfaClient != null ? 'first audio ' + Math.round(t.ttfaClient) + ' ms' : null,
      t.end && t.end.ttfa_ms != null ? 'service ' + Math.round(t.end.ttfa_ms) + ' ms' : t.gpuFirstMs != null ? 'engine ' + Math.round(t.gpuFirstMs) + ' ms' : null].filter(Boolean).join(' · ') || 'Speak → sound';
    $('mTtfaS').title = 'Heard after: Speak (or Retake) → the take\'s first new sample leaving the speaker (after the jitter cushion; for a retake, after the pre-roll). '
      + 'First audio: Speak → its first PCM arriving here. Service: the service\'s own request → first PCM sent.';
    let rtf = null;
    if (t.end && t.end.rtf != null) rtf = t.end.rtf;
    else if (t.firstPcmAt != null && t.sentAt != null) { const wall = ((t.lastPcmAt || now()) - t.sentAt) / 1000; if (wall > 0 && fresh > 0) rtf = fresh / SR / wall; }
    $('mRtf').innerHTML = rtf != null ? rtf.toFixed(2) + '<small>×</small>' : '—';
    $('mRtfS').textContent = rtf != null ? describeRtf(rtf).split(' · ')[1] : 'audio s per wall s';
    const frames = Math.floor(t.pcm.length / FRAME);
    $('mFrames').textContent = String(frames);
    $('mFramesS').textContent = fmtSec(t.pcm.length) + (t.spliceFrame ? ' · ' + Math.floor(fresh / FRAME) + ' new' : '');
    $('mSeed').textContent = t.seed ?? '—';
    $('mSeedS').textContent = t.req && t.req.seed != null && t.req.seed !== '' ? 'fixed' : t.seed != null ? 'random' : '';
  } else {
    for (const id of ['mTtfa', 'mRtf', 'mFrames', 'mSeed']) $(id).textContent = '—';
  }
  const p = S.play;
  const lvl = p ? Math.max(0, p.fed - p.played) : 0;
  const cush = (p && p.cushion) || (+readParam(PARAMS.find((x) => x.key === 'cushion_ms')) || 200) * SR / 1000;
  $('mBuf').innerHTML = p ? (lvl / SR * 1000).toFixed(0) + '<small> ms</small>' : '—';
  $('mBufBar').style.width = clamp(lvl / HIGH_WATER * 100, 0, 100) + '%';
  $('mBufCushion').style.left = clamp(cush / HIGH_WATER * 100, 0, 100) + '%';
  $('mBufBar').style.background = p && !p.primed && p.played > 0 ? 'var(--cue)' : 'var(--accent)';
  const ut = (S.live && S.live.status === 'streaming') ? S.live : p ? p.take : null;
  const under = ut && ut.underruns ? ' · ' + plural(ut.underruns, 'underrun') : '';
  if (S.live && S.live.cancelling) setStatus('Cancelling…', 'Audio stopped.');
  else if (S.live && S.live.status === 'streaming') {
    const t2 = S.live, fresh = t2.pcm ? t2.pcm.length - (t2.spliceSample || 0) : 0;
    setStatus((t2.isRetake ? 'Retake · ' : 'Speaking · ') + t2.name, fmtSec(fresh) + ' received' + (S.play && !S.play.primed ? ' · buffering' : S.play ? ' · playing' : ' · not playing') + under);
  } else if (p && p.take.pcm) {
    const ph = playheadSample();
    setStatus((p.kind === 'replay' ? 'Replaying ' : 'Playing ') + p.take.name, fmtSec(ph) + ' / ' + fmtSec(p.kind === 'replay' ? p.take.pcm.length : p.store.length) + (p.primed ? '' : ' · buffering') + under);
  }
}

function showAlert(code, message, opts = {}) {
  S.lastError = { code, message };
  $('alertCode').textContent = code;
  $('alertMsg').textContent = message;
  $('alert').classList.toggle('info', !!opts.info);
  $('alertRetry').hidden = !opts.retry;
  $('alert').hidden = false;
}
function hideAlert(codes) {
  if (codes && S.lastError && !codes.includes(S.lastError.code)) return;
  $('alert').hidden = true; S.lastError = null;
}
function markField(field, message) {
  const map = { reference: 'voice', frame: 'wave', take: 'wave' };
  const input = $(map[field] || field);
  if (input) { input.classList.add('invalid'); if (PARAMS.some((p) => p.key === field)) $('advanced').open = true; }
  const box = document.querySelector(`.field-error[data-for="${field}"]`);
  if (box) { box.textContent = message; box.hidden = false; }
}
function clearFieldErrors(target) {
  for (const n of document.querySelectorAll('.invalid')) if (!target || n === target) n.classList.remove('invalid');
  for (const n of document.querySelectorAll('.field-error')) if (!target || n.dataset.for === target.id || (target.id === 'voice' && n.dataset.for === 'reference')) n.hidden = true;
}

/* ====================================== UI: waveform editor ====================================== */
const wave = $('wave');
let drawQueued = false;
function scheduleDraw() { if (!drawQueued) { drawQueued = true; requestAnimationFrame(drawAll); } }
function drawAll() {
  drawQueued = false;
  drawEditor();
  updateMeters();
  const t = S.live; if (t && t.card && (!t.lastCardDraw || now() - t.lastCardDraw > 250)) { t.lastCardDraw = now(); updateCard(t); }
  if (S.play && S.play.take.card) drawMini(S.play.take);
  if (S.play || S.live) scheduleDraw();
}
/* The part of the selected take the editor shows: all of it at zoom 1, 1/zoom of it from view.start. */
function viewRange(t) {
  const total = viewLength(t);
  const span = Math.min(total, Math.max(FRAME * 2, total / S.view.zoom));
  const start = clamp(S.view.start, 0, Math.max(0, total - span));
  return { start, span, total };
}
function setZoom(z, around) {
  const t = S.selected; if (!t || !t.pcm) return;
  const before = viewRange(t), anchor = around ?? S.cursor;
  S.view.zoom = clamp(z, 1, 256);
  const span = viewRange(t).span;
  S.view.start = Math.max(0, anchor - (anchor - before.start) / before.span * span);
  syncScrollbar(); scheduleDraw();
}
function syncScrollbar() {
  const t = S.selected, v = t && t.pcm ? viewRange(t) : null;
  const bar = $('waveScroll');
  bar.hidden = !v || S.view.zoom <= 1;
  if (v) { bar.max = String(Math.max(0, Math.round((v.total - v.span) / FRAME))); bar.value = String(Math.round(v.start / FRAME)); }
  $('zoomLevel').textContent = S.view.zoom <= 1 ? 'fit' : S.view.zoom.toFixed(S.view.zoom < 10 ? 1 : 0) + '×';
}
function viewLength(t) {
  if (!t || !t.pcm) return SR * 4;
  const n = t.pcm.length;
  return t.status === 'streaming' ? Math.max(SR * 4, Math.ceil(n * 1.2 / SR) * SR) : Math.max(n, FRAME);
}
function fitCanvas(c) {
  const dpr = window.devicePixelRatio || 1, w = Math.max(1, Math.round(c.clientWidth * dpr)), h = Math.max(1, Math.round(c.clientHeight * dpr));
  if (c.width !== w || c.height !== h) { c.width = w; c.height = h; }
  return { w, h, dpr };
}
/* Samples [from, from + span) of a take across w pixels. */
function drawWaveform(g, t, x0, w, h, span, colors, from = 0) {
  const pk = t.pcm.peaks, count = pk.count;
  if (!count) return;
  const gain = Math.min(0.92 / Math.max(pk.abs, pk.fill ? Math.max(Math.abs(pk.cmin), Math.abs(pk.cmax)) : 0, 1e-6), 400);   // display-normalised
  const mid = h / 2, bucketsPerPx = span / pk.B / w, b00 = from / pk.B;
  for (let x = 0; x < w; x++) {
    const b0 = Math.floor(b00 + x * bucketsPerPx), b1 = Math.max(b0 + 1, Math.floor(b00 + (x + 1) * bucketsPerPx));
    if (b0 >= count) break;
    let lo = 1, hi = -1;
    for (let b = b0; b < b1 && b < count; b++) { const [mn, mx] = pk.at(b); if (mn < lo) lo = mn; if (mx > hi) hi = mx; }
    const a = Math.min(1, Math.max(Math.abs(lo), Math.abs(hi)) * gain) * mid;   // mirrored peak envelope
    g.fillStyle = colors(x0 + x, b0 * pk.B);
    g.fillRect(x0 + x, mid - a, 1, Math.max(1, 2 * a));
  }
}
function drawEditor() {
  const t = S.selected;
  const { w, h, dpr } = fitCanvas(wave);
  const g = wave.getContext('2d');
  g.clearRect(0, 0, w, h);
  $('waveEmpty').hidden = !!(t && t.pcm && t.pcm.length) || (t && t.status === 'streaming');
  const rulerH = 16 * dpr, H = h - rulerH;
  const v = viewRange(t), total = v.span;
  const xOf = (s) => Math.round((s - v.start) / v.span * w);
  // Ruler.
  g.fillStyle = '#12171c'; g.fillRect(0, H, w, rulerH);
  g.font = `${10 * dpr}px ui-monospace, Menlo, monospace`; g.textBaseline = 'middle';
  const secs = v.span / SR, stepSec = [0.08, 0.16, 0.24, 0.5, 1, 2, 5, 10, 15, 30, 60].find((x) => secs / x <= 12) || 120;
  for (let k = Math.ceil(v.start / SR / stepSec); k * stepSec <= (v.start + v.span) / SR; k++) {
    const sec = +(k * stepSec).toFixed(2), x = xOf(sec * SR);
    g.fillStyle = '#2a323c'; g.fillRect(x, 0, 1, H);
    g.fillStyle = '#8a95a2'; g.fillText(Number.isInteger(sec) ? sec + 's' : String(sec), x + 3 * dpr, H + rulerH / 2);
  }
  if (!t || !t.pcm) return;
  // The selected region, then markers and splices (under the waveform's colours, over the background).
  const R = S.region;
  if (R) {
    g.fillStyle = 'rgba(154,165,232,.16)'; g.fillRect(xOf(R.from), 0, Math.max(1, xOf(R.to) - xOf(R.from)), H);
    g.fillStyle = '#9aa5e8'; g.fillRect(xOf(R.from), 0, Math.max(1, dpr), H); g.fillRect(xOf(R.to), 0, Math.max(1, dpr), H);
  }
  // Inherited prefix of a retake.
  const S0 = t.spliceSample || 0;
  if (S0) { g.fillStyle = 'rgba(216,166,87,.06)'; g.fillRect(0, 0, xOf(S0), H); }
  const ph = S.play && S.play.take === t ? playheadSample() : null;
  const phX = ph != null ? xOf(ph) : -1;
  drawWaveform(g, t, 0, w, H, total, (x, s) => {
    const played = phX >= 0 && x <= phX;
    if (S0 && s < S0) return played ? '#b8975d' : '#6e6450';
    return played ? '#7fd0c2' : '#4b8f86';
  }, v.start);
  const flag = (x, label, color, y) => {
    g.fillStyle = color; g.fillRect(x, 0, Math.max(1, dpr), H);
    g.font = `600 ${10 * dpr}px system-ui, sans-serif`; g.textBaseline = 'middle';
    const tw = g.measureText(label).width + 10 * dpr, lx = x + 4 * dpr + tw > w ? x - 4 * dpr - tw : x + 4 * dpr;
    g.beginPath(); if (g.roundRect) g.roundRect(lx, y, tw, 16 * dpr, 4 * dpr); else g.rect(lx, y, tw, 16 * dpr);
    g.fill(); g.fillStyle = '#0e1114'; g.fillText(label, lx + 5 * dpr, y + 8 * dpr);
  };
  for (const sp of t.splices || []) flag(xOf(sp.sample), 'splice · ' + sp.kind, '#9aa5e8', H - 22 * dpr);
  for (const m of t.markers || []) flag(xOf(m.sample), m.label, '#7cc593', 24 * dpr);
  if (S0) {
    const x = xOf(S0);
    g.fillStyle = '#d8a657'; g.fillRect(x, 0, Math.max(1, dpr), H);
    g.font = `600 ${10 * dpr}px system-ui, sans-serif`; g.textBaseline = 'middle';
    const label = 'retake @ ' + fmtSec(S0), tw = g.measureText(label).width + 10 * dpr;
    const lx = x + 4 * dpr + tw > w ? x - 4 * dpr - tw : x + 4 * dpr;
    g.fillStyle = '#d8a657'; g.beginPath();
    if (g.roundRect) g.roundRect(lx, 4 * dpr, tw, 16 * dpr, 4 * dpr); else g.rect(lx, 4 * dpr, tw, 16 * dpr);
    g.fill(); g.fillStyle = '#1b1406'; g.fillText(label, lx + 5 * dpr, 12 * dpr);
  }
  // Cursor (frame-aligned) and playhead.
  const cx = xOf(S.cursor);
  g.fillStyle = '#e9c27c'; g.fillRect(cx - Math.floor(dpr / 2), 0, Math.max(1, Math.round(1.5 * dpr)), H);
  g.beginPath(); g.moveTo(cx - 5 * dpr, 0); g.lineTo(cx + 5 * dpr, 0); g.lineTo(cx, 7 * dpr); g.closePath(); g.fill();
  if (phX >= 0) { g.fillStyle = '#e4e8ec'; g.fillRect(phX, 0, Math.max(1, dpr), H); }
  if (hoverX != null && !dragging) {          // where a click would put the playhead (frame-aligned)
    const maxF = Math.floor(t.pcm.length / FRAME);
    const hs = clamp(Math.round((v.start + hoverX * v.span) / FRAME), 0, maxF) * FRAME, hx = xOf(hs);
    g.fillStyle = 'rgba(233,194,124,.35)'; g.fillRect(hx, 0, Math.max(1, dpr), H);
    g.font = `${10 * dpr}px ui-monospace, Menlo, monospace`; g.textBaseline = 'bottom';
    const label = fmtSec(hs), tw = g.measureText(label).width;
    g.fillStyle = '#e9c27c'; g.fillText(label, hx + 4 * dpr + tw > w ? hx - 4 * dpr - tw : hx + 4 * dpr, H - 3 * dpr);
  }
  // Not yet received region while streaming.
  if (t.status === 'streaming') {
    const x = xOf(t.pcm.length);
    g.fillStyle = 'rgba(95,179,166,.10)'; g.fillRect(x, 0, Math.max(2, 3 * dpr), H);
  }
  const maxS = t.pcm.length;
  wave.setAttribute('aria-valuemax', String(Math.floor(maxS / FRAME)));
  wave.setAttribute('aria-valuenow', String(Math.floor(S.cursor / FRAME)));
  wave.setAttribute('aria-valuetext', takeTitle(t) + ': playhead at ' + fmtSec(S.cursor) + ' of ' + fmtSec(maxS) + ', frame ' + Math.floor(S.cursor / FRAME));
  $('edPos').innerHTML = '';
  $('edPos').append(fmtSec(S.cursor) + ' ', el('small', { text: 'frame ' + Math.floor(S.cursor / FRAME) + (S.cursor && S.cursor >= t.pcm.length && t.status !== 'streaming' ? ' (end)' : '') + (ph != null ? ' · playing ' + fmtSec(ph) : '') }));
}
function selectTake(take, cursor) {
  const prev = S.selected;
  S.selected = take;
  if (cursor != null) S.cursor = cursor;
  const maxC = take && take.pcm ? Math.floor(take.pcm.length / FRAME) * FRAME : 0;   // the end itself: continue the take
  if (take && take.status !== 'streaming') S.cursor = clamp(S.cursor, 0, maxC);
  if (prev && prev.card) prev.card.classList.remove('selected');
  if (take && take.card) take.card.classList.add('selected');
  if (take !== prev) {
    clearRetakeDirection();
    S.view = { zoom: 1, start: 0 }; S.deleteArmed = null;
    if (!(S.play && S.play.loop && S.play.take === take)) S.region = null;
  }
  $('edTitle').textContent = take ? takeTitle(take) : 'No take yet';
  $('edSub').textContent = take ? takeLineage(take) : '';
  syncScrollbar(); refreshDetails(); refreshMarkers(); refreshRegion();
  refreshTransport(); scheduleDraw();
}
/* The retake panel belongs to one take: another take starts from its own direction, never the last one typed. */
function clearRetakeDirection() {
  $('rtInstruction').value = ''; $('rtText').value = ''; $('rtSeedMode').value = 'new'; $('rtSeed').hidden = true; $('rtSeed').value = '';
  const r = S.selected && S.selected.req;
  $('rtInstruction').placeholder = r ? 'unchanged: ' + (r.instruction || '(none)').slice(0, 80) : 'unchanged';
  $('rtText').placeholder = r ? 'unchanged: ' + (r.text || '').slice(0, 80) : 'unchanged';
}
function setCursorFromEvent(e) {
  const t = S.selected; if (!t || !t.pcm) return;
  const r = wave.getBoundingClientRect();
  const v = viewRange(t);
  const s = v.start + clamp((e.clientX - r.left) / r.width, 0, 1) * v.span;
  if (regionDrag) { setRegion(regionDrag.anchor, Math.round(s / FRAME) * FRAME); return; }
  setCursor(Math.round(s / FRAME) * FRAME);
}
function setCursor(sample) {
  const t = S.selected; if (!t || !t.pcm) return;
  const maxF = Math.floor(t.pcm.length / FRAME);
  S.cursor = clamp(Math.round(sample / FRAME), 0, maxF) * FRAME;
  const v = viewRange(t);                     // zoomed in: keep the playhead in view
  if (S.view.zoom > 1 && (S.cursor < v.start || S.cursor > v.start + v.span)) { S.view.start = Math.max(0, S.cursor - v.span / 2); syncScrollbar(); }
  refreshTransport(); scheduleDraw();
}

/* ====================================== UI: regions, loop, markers ====================================== */
function setRegion(a, b) {
  const t = S.selected;
  if (a == null || !t || !t.pcm) S.region = null;
  else {
    const max = Math.floor(t.pcm.length / FRAME) * FRAME;
    const from = clamp(Math.min(a, b), 0, max), to = clamp(Math.max(a, b), 0, max);
    S.region = { from: Math.round(from / FRAME) * FRAME, to: Math.round(to / FRAME) * FRAME };
  }
  if (S.play && S.play.loop && (!S.region || S.play.take !== t)) { stopPlayback(); setStatus('Stopped', ''); }
  else if (S.play && S.play.loop) playLoop(t, S.region.from, S.region.to);   // a changed region loops anew
  refreshRegion(); scheduleDraw();
}
function refreshRegion() {
  const R = S.region, t = S.selected;
  const pos = $('regionPos'); pos.replaceChildren();
  if (R && R.to > R.from) pos.append('Region ' + fmtSec(R.from) + ' – ' + fmtSec(R.to) + ' ', el('small', { text: 'frames ' + R.from / FRAME + '–' + R.to / FRAME + ' · ' + fmtSec(R.to - R.from) }));
  else pos.append('No region ', el('small', {}, 'Shift+drag on the waveform, or ', el('kbd', { text: '[' }), ' ', el('kbd', { text: ']' }), ' at the playhead'));
  const has = !!(R && R.to > R.from && t && t.pcm);
  const looping = !!(S.play && S.play.loop);
  $('loopBtn').disabled = !has; $('loopBtn').setAttribute('aria-pressed', String(looping));
  $('loopBtn').textContent = looping ? 'Stop loop' : 'Loop region';
  $('retakeRegionBtn').disabled = !(has && serverHolds(t) && t.status !== 'streaming' && !hasPending());
  $('compAdd').disabled = !has; $('regionClear').disabled = !R;
  $('markerAdd').disabled = !(t && t.pcm && t.pcm.length);
}
function toggleLoop() {
  if (S.play && S.play.loop) { stopPlayback(); setStatus('Stopped', ''); refreshTransport(); refreshRegion(); return; }
  if (S.region) playLoop(S.selected, S.region.from, S.region.to);
}
function addMarker() {
  const t = S.selected; if (!t || !t.pcm) return;
  const label = $('markerLabel').value.trim() || 'marker ' + ((t.markers || []).length + 1);
  t.markers = [...(t.markers || []), { sample: S.cursor, label }].sort((a, b) => a.sample - b.sample);
  $('markerLabel').value = '';
  announce('Marker ' + label + ' at ' + fmtSec(S.cursor) + '.');
  takeChanged(t); refreshMarkers(); scheduleDraw();
}
function refreshMarkers() {
  const t = S.selected, box = $('markerList');
  box.replaceChildren(...((t && t.markers) || []).map((m) => el('span', { class: 'row', style: 'gap:2px' },
    el('button', { type: 'button', class: 'chip', text: m.label + ' @ ' + fmtSec(m.sample), title: 'Move the playhead to this marker', onclick: () => setCursor(m.sample) }),
    el('button', { type: 'button', class: 'x', text: '×', 'aria-label': 'Remove marker ' + m.label, onclick: () => { t.markers = t.markers.filter((x) => x !== m); takeChanged(t); refreshMarkers(); scheduleDraw(); } }))));
}

/* ====================================== UI: take details and filter ====================================== */
function refreshDetails() {
  const t = S.selected;
  $('takeDetails').hidden = !t;
  if (!t) return;
  if (document.activeElement !== $('takeName')) $('takeName').value = t.title || '';
  if (document.activeElement !== $('takeNote')) $('takeNote').value = t.note || '';
  $('takeStar').setAttribute('aria-pressed', String(!!t.starred)); $('takeStar').textContent = t.starred ? '★' : '☆';
  $('takeDelete').disabled = t === S.live;
  $('takeDelete').textContent = S.deleteArmed === t ? 'Delete ' + t.name + '?' : 'Delete';
}
/* A take's own notes changed (name, star, note, markers): redraw its card, and keep it for the session. */
function takeChanged(t) {
  updateCard(t); applyFilter(); refreshDetails(); if (S.selected === t) $('edTitle').textContent = takeTitle(t);
  sessionStore.saveNotes(t);
}
function takeVisible(t) {
  const mode = $('takeFilter').value, q = $('takeSearch').value.trim().toLowerCase();
  if (mode === 'starred' && !t.starred) return false;
  if (mode === 'kept' && (t.status === 'replaced' || t.status === 'cancelled')) return false;
  if (!q) return true;
  const r = t.req || {};
  return [t.name, t.title, t.note, r.text, r.instruction, t.id].some((x) => x && String(x).toLowerCase().includes(q));
}
function applyFilter() {
  let shown = 0;
  for (const t of S.takes) { const v = takeVisible(t); if (t.card) t.card.hidden = !v; if (v) shown++; }
  const n = S.takes.length;
  $('takesCount').textContent = !n ? '' : shown === n ? plural(n, 'take') : shown + ' of ' + plural(n, 'take');
}

/* ====================================== UI: region retake with the old tail, comp takes ====================================== */
const XFADE = 480;   // 10 ms: the crossfade where a region retake gives way to the old tail
/* A local take made here from held audio (a splice or a comp): playable, comparable, exportable as WAV. */
function localTake(pcm, props) {
  const t = newTake({ req: props.req || null });
  Object.assign(t, props, { pcm, status: 'done', local: true, conn: null });
  pcm.complete = true;
  addTake(t);
  selectTake(t, 0);
  updateCard(t); refreshTransport(); drawAll();
  return t;
}
/* new[0, to) + a crossfade into old[to, to + XFADE) + old[to + XFADE, end): the region re-done, the rest kept. */
function spliceOldTail(retake, source, to) {
  const ch = retake.pcm.ch, out = new PcmStore(ch, source.pcm.length + SR);
  out.append(retake.pcm.data.subarray(0, to * ch));
  const x = new Int16Array(XFADE * ch);
  for (let i = 0; i < XFADE; i++) {
    const w = (i + 0.5) / XFADE;
    for (let c = 0; c < ch; c++) x[i * ch + c] = Math.round(retake.pcm.sample(to + i, c) * (1 - w) + source.pcm.sample(to + i, c) * w);
  }
  out.append(x);
  out.append(source.pcm.data.subarray((to + XFADE) * ch, source.pcm.length * ch));
  return localTake(out, { req: retake.req, seed: retake.seed, parent: source.key, spliceSample: retake.spliceSample, spliceFrame: retake.spliceFrame,
    splices: [{ sample: to, kind: 'crossfade ' + Math.round(XFADE / SR * 1000) + ' ms' }], spliceOf: { retake: retake.key, source: source.key, to } });
}
function retakeRegion() {
  const R = S.region, t = S.selected;
  if (!R || !t) return;
  const tail = $('keepTail').checked && R.to + XFADE <= t.pcm.length ? { to: R.to, source: t } : null;
  setCursor(R.from);
  seek('retake', tail);
}
function renderComp() {
  $('comp').hidden = !S.comp.length;
  $('compList').replaceChildren(...S.comp.map((seg, i) => el('li', {},
    takeTitle(seg.take) + ' ' + fmtSec(seg.from) + ' – ' + fmtSec(seg.to),
    el('button', { type: 'button', class: 'x', text: '×', 'aria-label': 'Remove region ' + (i + 1) + ' from the comp', onclick: () => { S.comp.splice(i, 1); renderComp(); } }))));
  const total = S.comp.reduce((a, g) => a + g.to - g.from, 0);
  $('compInfo').textContent = S.comp.length ? plural(S.comp.length, 'region') + ' · ' + fmtSec(total) : '';
  $('compBuild').disabled = !S.comp.length;
}
function addToComp() {
  const R = S.region, t = S.selected; if (!R || !t || R.to <= R.from) return;
  S.comp.push({ take: t, from: R.from, to: R.to });
  renderComp(); announce('Region added to the comp.');
}
function compJoins() {
  const joins = []; let at = 0;
  S.comp.forEach((g, i) => { if (i) joins.push({ sample: at, kind: 'comp join' }); at += g.to - g.from; });
  return joins;
}
/* The regions joined in order, sample for sample (mono regions are doubled when any region is stereo). */
function buildComp() {
  if (!S.comp.length) return null;
  const ch = Math.max(...S.comp.map((g) => g.take.pcm.ch));
  const out = new PcmStore(ch, S.comp.reduce((a, g) => a + g.to - g.from, 0));
  for (const g of S.comp) {
    const src = g.take.pcm, n = g.to - g.from;
    if (src.ch === ch) out.append(src.data.subarray(g.from * ch, g.to * ch));
    else { const d = new Int16Array(n * ch); for (let i = 0; i < n; i++) for (let c = 0; c < ch; c++) d[i * ch + c] = src.sample(g.from + i, 0); out.append(d); }
  }
  const n = ++S.compSeq;
  const t = localTake(out, { req: { text: 'Comp ' + n + ' of ' + S.comp.map((g) => g.take.name).join(', ') }, title: 'Comp ' + n,
    comp: S.comp.map((g) => ({ take: g.take.key, from: g.from, to: g.to })),
    splices: compJoins() });
  announce('Built ' + takeTitle(t) + ', ' + fmtSec(out.length) + '.');
  return t;
}
let dragging = false, hoverX = null, regionDrag = null;
wave.addEventListener('pointerleave', () => { hoverX = null; scheduleDraw(); });
wave.addEventListener('pointerdown', (e) => {
  if (!S.selected || !S.selected.pcm) return;
  dragging = true; wave.setPointerCapture(e.pointerId);
  if (e.shiftKey) {            // Shift+drag selects a region (frame-aligned); a plain click or drag moves the playhead
    const r = wave.getBoundingClientRect(), v = viewRange(S.selected);
    regionDrag = { anchor: Math.round((v.start + clamp((e.clientX - r.left) / r.width, 0, 1) * v.span) / FRAME) * FRAME };
  }
  setCursorFromEvent(e);
});
wave.addEventListener('pointermove', (e) => {
  if (dragging) setCursorFromEvent(e);
  hoverX = e.pointerType === 'mouse' ? (e.clientX - wave.getBoundingClientRect().left) / wave.clientWidth : null;
  scheduleDraw();
});
const endDrag = () => {
  if (!dragging) return; dragging = false;
  if (regionDrag) { regionDrag = null; if (S.region && S.region.to - S.region.from < FRAME) setRegion(null); else setCursor(S.region.from); return; }
  const t = S.selected;   // scrubbing during local playback jumps the audio to the playhead
  if (S.play && S.play.kind === 'local' && S.play.take === t) playLocal(t, S.cursor);
};
wave.addEventListener('pointerup', endDrag); wave.addEventListener('pointercancel', endDrag);
wave.addEventListener('wheel', (e) => {       // Ctrl/⌘+wheel zooms around the mouse; a sideways (or Shift+) wheel scrolls
  const t = S.selected; if (!t || !t.pcm) return;
  const r = wave.getBoundingClientRect(), v = viewRange(t);
  if (e.ctrlKey || e.metaKey) {
    e.preventDefault();
    setZoom(S.view.zoom * (e.deltaY < 0 ? 1.25 : 0.8), v.start + clamp((e.clientX - r.left) / r.width, 0, 1) * v.span);
  } else if (S.view.zoom > 1 && (e.shiftKey || Math.abs(e.deltaX) > Math.abs(e.deltaY))) {
    e.preventDefault();
    S.view.start = clamp(v.start + (e.deltaX || e.deltaY) / r.width * v.span, 0, v.total - v.span); syncScrollbar(); scheduleDraw();
  }
}, { passive: false });
wave.addEventListener('keydown', (e) => {    // ←/→ are page-wide shortcuts (the keydown handler at the end)
  if (e.key === 'Home') { e.preventDefault(); setCursor(0); }
  else if (e.key === 'End' && S.selected && S.selected.pcm) { e.preventDefault(); setCursor(S.selected.pcm.length); }
});
new ResizeObserver(() => { scheduleDraw(); for (const t of S.takes) drawMini(t); }).observe(document.body);
new ResizeObserver(() => document.body.style.setProperty('--transport-h', $('transport').offsetHeight + 'px')).observe($('transport'));

/* ====================================== UI: take cards ====================================== */
function takeLineage(t) {
  const parent = t.parent && S.byKey.get(t.parent);
  const bits = [];
  if (t.spliceOf) bits.push('region ' + fmtSec(t.spliceSample) + ' – ' + fmtSec(t.spliceOf.to) + ' re-done from ' + (S.byKey.get(t.spliceOf.retake) || {}).name + ', then ' + (parent || {}).name + '\'s tail');
  else if (parent) bits.push('retake of ' + parent.name + ' @ ' + fmtSec(t.spliceSample) + ' (frame ' + t.spliceFrame + ')');
  if (t.comp) bits.push('comp of ' + t.comp.length + ' regions · made here');
  if (t.id) bits.push(t.id);
  return bits.join(' · ');
}
function paramSummary(req) {
  if (!req) return '';
  const d = S.defaults, out = [];
  const short = { audio_temperature: 'aT', audio_top_p: 'aP', audio_top_k: 'aK', audio_repetition_penalty: 'rep', text_temperature: 'tT', text_top_p: 'tP', text_top_k: 'tK', chunk_frames: 'chunk', max_new_tokens: 'max' };
  for (const k of Object.keys(short)) if (req[k] != null && req[k] !== d[k]) out.push(short[k] + ' ' + req[k]);
  if (req.tokens) out.push('dur ' + req.tokens);
  if (req.channels === 2) out.push('stereo');
  return out.length ? out.join(' · ') : 'service defaults';
}
function buildCard(t) {
  const mini = el('canvas', { 'aria-hidden': 'true' });
  const card = el('article', { class: 'take', 'data-key': t.key, tabindex: '0', 'aria-label': t.name });
  const nameEl = el('span', { class: 'name', text: t.name });
  const badge = el('span', { class: 'badge' });
  const when = el('span', { class: 'faint num', style: 'font-size:11.5px' });
  const lineage = el('span', { class: 'lineage' });
  const meta = el('div', { class: 'meta' });
  const dir = el('div', { class: 'dir' });
  const noteLine = el('div', { class: 'note-line' });
  const btn = (label, title, fn, cls) => el('button', { class: 'btn small' + (cls ? ' ' + cls : ''), title, text: label, onclick: (e) => { e.stopPropagation(); fn(e); } });
  const playB = btn('Play', 'Play this take (from the playhead when it is selected)', () => {
    if (S.play && S.play.take === t && S.play.kind === 'local') { stopPlayback(); refreshTransport(); return; }
    playLocal(t, S.selected === t ? S.cursor : 0);
  });
  const aB = btn('A', 'Compare: set as A', () => setAB('a', t));
  const bB = btn('B', 'Compare: set as B', () => setAB('b', t));
  const wavB = btn('WAV', 'Download the audio this page holds as a 16-bit WAV', () => downloadTake(t));
  const srvB = el('a', { class: 'btn small', title: 'Download the service\'s rendering of this take', text: 'Service WAV', download: '', onclick: (e) => e.stopPropagation() });
  const branchB = btn('Retake from…', 'Open in the editor: place the playhead, then Retake from here', () => { selectTake(t, S.selected === t ? S.cursor : Math.floor((t.pcm ? t.pcm.length : 0) / 2 / FRAME) * FRAME); wave.focus(); wave.scrollIntoView({ block: 'nearest', behavior: 'smooth' }); });
  const loadB = btn('Use direction', 'Copy this take\'s direction, voice, parameters and seed into the scene', () => loadIntoScene(t));
  card.append(
    el('div', { class: 't1' }, nameEl, badge, when, lineage), mini,
    meta, dir, noteLine,
    el('div', { class: 'actions' }, playB, aB, bB, wavB, srvB, branchB, loadB),
  );
  card.addEventListener('click', () => { if (S.selected !== t) selectTake(t, 0); });
  card.addEventListener('keydown', (e) => { if (e.key === 'Enter' && e.target === card) selectTake(t, 0); });
  t.card = card; t.ui = { noteLine, nameEl, badge, when, lineage, meta, dir, mini, playB, aB, bB, wavB, srvB, branchB, loadB };
  updateCard(t);
  return card;
}
function updateCard(t) {
  const u = t.ui; if (!u) return;
  u.badge.className = 'badge ' + t.status;
  u.badge.textContent = t.status === 'streaming' ? 'live' : t.local ? (t.comp ? 'comp' : 'splice') : t.status;
  const dur = t.pcm ? fmtSec(t.pcm.length) : '';
  u.when.textContent = t.created.toLocaleTimeString([], { hour: '2-digit', minute: '2-digit', second: '2-digit' }) + (dur ? ' · ' + dur : '');
  const parent = t.parent && S.byKey.get(t.parent);
  u.lineage.textContent = parent ? '↳ from ' + parent.name + ' @ ' + fmtSec(t.spliceSample) : '';
  const r = t.req || {};
  u.meta.textContent = ['seed ' + (t.seed ?? '—') + (r.seed != null && r.seed !== '' ? ' (fixed)' : ''), r.referenceName && r.reference !== 'none' ? 'voice ' + r.referenceName : null,
    r.language || null, paramSummary(r), t.end && t.end.rtf != null ? 'rtf ' + t.end.rtf : null, t.heardMs != null ? 'heard after ' + t.heardMs.toFixed(0) + ' ms' : null,
    t.underruns ? plural(t.underruns, 'underrun') : null]
    .filter(Boolean).join(' · ');
  u.meta.title = u.meta.textContent + (t.mismatch ? '\n⚠ ' + t.mismatch : '');
  u.dir.replaceChildren();
  if (r.instruction) u.dir.append(el('span', { class: 'ins', text: r.instruction.replace(/\s+/g, ' ').slice(0, 90) + ' — ' }));
  u.dir.append((r.text || '').replace(/\s+/g, ' ').slice(0, 160));
  u.dir.title = (r.instruction ? r.instruction + '\n\n' : '') + (r.text || '');
  const has = !!(t.pcm && t.pcm.length);
  u.playB.disabled = !has; u.wavB.disabled = !has; u.aB.disabled = !has; u.bB.disabled = !has;
  u.playB.textContent = S.play && S.play.take === t && S.play.kind === 'local' ? 'Stop' : 'Play';
  const nm = takeTitle(t);
  u.nameEl.replaceChildren(...(t.starred ? [el('span', { class: 'star-mark', text: '★', 'aria-label': 'starred' })] : []), nm);
  u.noteLine.textContent = t.note ? '✎ ' + t.note : ''; u.noteLine.hidden = !t.note;
  if (t.card) t.card.hidden = !takeVisible(t);
  t.card.setAttribute('aria-label', nm);
  u.playB.setAttribute('aria-label', u.playB.textContent + ' ' + nm);
  u.aB.setAttribute('aria-label', 'Compare ' + nm + ' as A');
  u.bB.setAttribute('aria-label', 'Compare ' + nm + ' as B');
  u.wavB.setAttribute('aria-label', 'Download ' + nm + ' as WAV (the audio this page holds)');
  u.srvB.setAttribute('aria-label', 'Service WAV of ' + nm);
  u.branchB.setAttribute('aria-label', 'Retake from… (' + nm + ')');   // names start with the visible text
  u.loadB.setAttribute('aria-label', 'Use direction of ' + nm);
  u.aB.classList.toggle('on', S.ab.a === t); u.bB.classList.toggle('on', S.ab.b === t); u.bB.classList.toggle('bsel', S.ab.b === t);
  if (t.id) u.srvB.href = auth.query('/api/takes/' + encodeURIComponent(t.id) + '.wav'); else u.srvB.removeAttribute('href');
  u.srvB.hidden = !serverHolds(t) || t.status === 'streaming';
  u.branchB.disabled = !(has && serverHolds(t));
  drawMini(t);
}
function drawMini(t) {
  const c = t.ui && t.ui.mini; if (!c || !c.clientWidth) return;
  const { w, h } = fitCanvas(c), g = c.getContext('2d');
  g.clearRect(0, 0, w, h);
  if (!t.pcm || !t.pcm.length) return;
  const total = Math.max(t.pcm.length, FRAME), S0 = t.spliceSample || 0;
  const ph = S.play && S.play.take === t ? playheadSample() : null, phX = ph != null ? ph / total * w : -1;
  drawWaveform(g, t, 0, w, h, total, (x, s) => (S0 && s < S0 ? (x <= phX ? '#b8975d' : '#6e6450') : (x <= phX ? '#7fd0c2' : '#4b8f86')));
  for (const sp of t.splices || []) { g.fillStyle = '#9aa5e8'; g.fillRect(Math.round(sp.sample / total * w), 0, 1, h); }
  if (S0) { g.fillStyle = '#d8a657'; g.fillRect(Math.round(S0 / total * w), 0, 1, h); }
}
function downloadTake(t) {
  if (!t.pcm || !t.pcm.length) return;
  const blob = wavBlob(t.pcm.data.subarray(0, t.pcm.length * t.pcm.ch), t.pcm.ch, SR);
  const a = el('a', { href: URL.createObjectURL(blob), download: `moss_rt-${t.name.replace(/\s+/g, '').toLowerCase()}-${t.id || t.key}-seed${t.seed ?? 'x'}.wav` });
  document.body.append(a); a.click(); a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 30000);
}
function loadIntoScene(t) {
  const r = t.req || {};
  if (r.instruction != null) $('instruction').value = r.instruction;
  if (r.text != null) $('text').value = r.text;
  $('language').value = r.language || '';
  if (r.reference) setVoice(r.reference);
  for (const p of PARAMS) if (p.key && !p.client && r[p.key] != null) writeParam(p, r[p.key]);
  if (t.seed != null) { setSeedMode('fixed'); $('seed').value = t.seed; }
  updateCounts(); paramChanged(); saveScene();
  setStatus('Scene loaded from ' + t.name, 'Direction, voice, parameters and seed ' + (t.seed ?? '') + '.');
}

/* ====================================== A/B compare ====================================== */
function setAB(slot, t) {
  S.ab[slot] = S.ab[slot] === t ? null : t;
  if (S.ab.a && S.ab.a === S.ab.b) S.ab[slot === 'a' ? 'b' : 'a'] = null;
  for (const x of S.takes) updateCard(x);
  refreshCompare();
}
function divergence(a, b) {           // the sample where two takes that share lineage start to differ
  const root = (t) => { const chain = []; for (let x = t; x; x = x.parent && S.byKey.get(x.parent)) chain.push(x); return chain; };
  const ca = root(a), cb = root(b);
  for (const x of ca) { const j = cb.indexOf(x); if (j >= 0) {
    const sa = ca.indexOf(x) === 0 ? a.pcm.length : ca[ca.indexOf(x) - 1].spliceSample;
    const sb = j === 0 ? b.pcm.length : cb[j - 1].spliceSample;
    return Math.min(sa, sb);
  } }
  return null;
}
function refreshCompare() {
  const { a, b } = S.ab;
  $('compare').hidden = !(a || b);
  const desc = (t) => t.name + ' · ' + (t.pcm ? fmtSec(t.pcm.length) : '') + ' · seed ' + (t.seed ?? '—') + (t.parent ? ' · from ' + (S.byKey.get(t.parent) || {}).name + ' @ ' + fmtSec(t.spliceSample) : '');
  $('abA').textContent = a ? desc(a) : 'choose a take with its A button';
  $('abB').textContent = b ? desc(b) : 'choose a take with its B button';
  $('abPlayA').disabled = !a; $('abPlayB').disabled = !b;
  $('abSwitch').disabled = !(a && b);
  const d = a && b ? divergence(a, b) : null;
  $('abSplice').hidden = d == null || d <= 0;
  $('abSplice').disabled = d == null;
  $('abNote').textContent = d != null ? 'They share the first ' + fmtSec(d) + '.' : a && b ? 'Independent takes: switching keeps the time position.' : '';
}
function playAB(slot) {
  const t = S.ab[slot]; if (!t) return;
  const ph = playheadSample();
  const from = S.play && (S.play.take === S.ab.a || S.play.take === S.ab.b) && ph != null ? ph : S.cursor;
  playLocal(t, Math.min(from, Math.max(0, t.pcm.length - FRAME)));
}
function switchAB() {
  const { a, b } = S.ab; if (!a || !b) return;
  const cur = S.play ? S.play.take : S.selected;
  playAB(cur === a ? 'b' : 'a');
}

/* ====================================== voices & upload ====================================== */
function voiceName(id) { if (!id || id === 'none') return null; const v = S.voiceById.get(id); return v ? v.name : id; }
async function loadVoices(selectId) {
  try {
    const r = await apiFetch('/api/voices', { cache: 'no-store' });
    if (!r.ok) throw new Error('HTTP ' + r.status);
    const body = await r.json();
    S.voices = body.voices || [];
  } catch (e) { $('uploadNote').className = 'note err'; $('uploadNote').textContent = 'Could not list voices: ' + e.message; return; }
  S.voiceById = new Map(S.voices.map((v) => [v.id, v]));
  const sel = $('voice'), keep = selectId || sel.value || savedScene.reference;
  const opt = (v) => el('option', { value: v.id, text: v.name + (v.duration ? ' · ' + (+v.duration).toFixed(1) + ' s' : '') });
  const builtin = S.voices.filter((v) => v.kind === 'builtin'), uploaded = S.voices.filter((v) => v.kind !== 'builtin');
  sel.replaceChildren(el('option', { value: 'none', text: 'No reference (model voice)' }));
  if (builtin.length) sel.append(el('optgroup', { label: 'Built-in' }, ...builtin.map(opt)));
  if (uploaded.length) sel.append(el('optgroup', { label: 'Uploaded' }, ...uploaded.map(opt)));
  setVoice(keep && (keep === 'none' || S.voiceById.has(keep)) ? keep : 'none');
}
function refreshVoicePlay() {
  const playing = !$('voicePreview').paused, id = $('voice').value;
  $('voicePlay').disabled = !playing && (!id || id === 'none');
  $('voicePlay').textContent = playing ? '■' : '▶';
  $('voicePlay').setAttribute('aria-label', playing ? 'Stop the voice' : 'Listen to the voice');
}
function setVoice(id) {
  const sel = $('voice');
  if (id !== 'none' && !S.voiceById.has(id)) sel.append(el('option', { value: id, text: id + ' (not listed)' }));
  sel.value = id;
  refreshVoicePlay();
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
async function uploadRef(blob, ext, name) {
  const note = $('uploadNote');
  const max = S.limits.max_upload_bytes;
  if (max && blob.size > max) { note.className = 'note err'; note.textContent = `That file is ${(blob.size / 1048576).toFixed(1)} MB; the limit is ${(max / 1048576).toFixed(0)} MB.`; return null; }
  note.className = 'note'; note.textContent = 'Uploading ' + name + '…';
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
    note.className = 'note ok';
    note.textContent = `Voice ready: ${body.name || name} · ${(+body.duration).toFixed(1)} s · ${body.frames} frames (${body.ref_id}).`;
    saveScene();
    return body;
  } catch (e) {
    note.className = 'note err'; note.textContent = 'Upload failed: ' + e.message;
    return null;
  }
}
$('uploadBtn').addEventListener('click', () => $('uploadFile').click());
$('uploadFile').addEventListener('change', async () => {
  const f = $('uploadFile').files[0]; if (!f) return;
  const ext = extFor(f);
  if (!ext) { $('uploadNote').className = 'note err'; $('uploadNote').textContent = 'Use a wav, flac, mp3 or ogg file.'; }
  else await uploadRef(f, ext, f.name);
  $('uploadFile').value = '';
});
$('refreshVoices').addEventListener('click', () => loadVoices());

/* Microphone recording: raw PCM through the recorder worklet, encoded to WAV here. */
const rec = { on: false, chunks: [], rate: SR, stream: null, node: null, src: null, t0: 0, timer: null, blob: null, url: null };
async function startRecording() {
  const note = $('uploadNote');
  if (!navigator.mediaDevices || !navigator.mediaDevices.getUserMedia) { note.className = 'note err'; note.textContent = 'Recording needs a secure page (https or localhost).'; return; }
  try {
    await audio.init();
    rec.stream = await navigator.mediaDevices.getUserMedia({ audio: { channelCount: 1, echoCancellation: false, noiseSuppression: false, autoGainControl: false } });
  } catch (e) { note.className = 'note err'; note.textContent = 'Microphone unavailable: ' + e.message; return; }
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
  note.className = 'note'; note.textContent = 'Recording… speak for 3 to 20 seconds.';
  const maxSec = S.limits.max_upload_seconds || 60;
  rec.timer = setInterval(() => {
    const sec = (now() - rec.t0) / 1000; $('recTime').textContent = fmtClock(sec);
    if (sec >= maxSec - 0.2) stopRecording();
  }, 100);
}
function stopRecording() {
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
  const sec = n / rec.rate, min = S.limits.min_upload_seconds || 0.5;
  rec.blob = wavBlob(pcm, 1, rec.rate);
  rec.url && URL.revokeObjectURL(rec.url); rec.url = URL.createObjectURL(rec.blob);
  $('recPreview').src = rec.url; $('recPreview').hidden = false; $('recActions').hidden = false;
  $('recTime').textContent = fmtClock(sec); $('recLevel').style.width = '0';
  const note = $('uploadNote');
  if (sec < min) { note.className = 'note err'; note.textContent = `That is ${sec.toFixed(1)} s; a reference needs at least ${min} s.`; $('recUse').disabled = true; }
  else { note.className = 'note'; note.textContent = `Recorded ${sec.toFixed(1)} s. Listen back, then use it as the voice.`; $('recUse').disabled = false; }
}
function discardRecording(keepBox) {
  rec.blob = null; if (rec.url) { URL.revokeObjectURL(rec.url); rec.url = null; }
  $('recPreview').removeAttribute('src');
  if (!keepBox) { $('recBox').hidden = true; $('recordLabel').textContent = 'Record from microphone'; $('uploadNote').textContent = ''; }
}
$('recordBtn').addEventListener('click', () => (rec.on ? stopRecording() : startRecording()));
$('recUse').addEventListener('click', async () => {
  if (!rec.blob) return;
  const stamp = new Date().toTimeString().slice(0, 5).replace(':', 'h');
  if (await uploadRef(rec.blob, 'wav', 'mic ' + stamp + '.wav')) { discardRecording(true); $('recBox').hidden = true; $('recordLabel').textContent = 'Record from microphone'; }
});
$('recDiscard').addEventListener('click', () => discardRecording());

/* ====================================== scene editing ====================================== */
let lastTextField = $('instruction');
let caretPos = { instruction: null, text: null };
for (const id of ['instruction', 'text', 'rtInstruction', 'rtText']) {
  const n = $(id);
  const keep = () => { lastTextField = n; caretPos[id] = [n.selectionStart, n.selectionEnd]; };
  n.addEventListener('focus', keep); n.addEventListener('keyup', keep); n.addEventListener('mouseup', keep); n.addEventListener('input', keep);
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
for (const cue of CUES) $('cueBar').append(el('button', { type: 'button', class: 'chip cue', text: cue, title: 'Insert ' + cue, onmousedown: (e) => e.preventDefault(), onclick: () => insertAtCaret(lastTextField, cue) }));
$('layoutBtn').addEventListener('mousedown', (e) => e.preventDefault());
$('layoutBtn').addEventListener('click', () => {
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
});
function updateCounts() {
  const c = (id, lim) => { const n = $(id).value.length; $(id + 'Count').textContent = lim ? n + ' / ' + lim : String(n); $(id + 'Count').style.color = lim && n > lim ? 'var(--danger)' : ''; };
  c('instruction', S.limits.max_instruction_chars); c('text', S.limits.max_text_chars);
  for (const [id, lim] of [['instruction', S.limits.max_instruction_chars], ['text', S.limits.max_text_chars]]) {
    const n = $(id).value.length, box = document.querySelector(`.field-error[data-for="${id}"]`);
    if (lim && n > lim) markField(id, `${n - lim} characters over the limit of ${lim}: shorten it before speaking.`);
    else if (box && !box.hidden && /over the limit/.test(box.textContent)) { box.hidden = true; $(id).classList.remove('invalid'); }
  }
}
function applyLimits() {
  const L = S.limits;
  // No maxLength: a paste over the limit would be cut silently. The counter and the field say it instead.
  for (const p of PARAMS) {
    const n = p.key && $(p.key); if (!n || p.type === 'select') continue;
    if (p.key === 'max_new_tokens' || p.key === 'tokens') n.max = L.max_new_tokens || p.max;
    if (p.key === 'chunk_frames') { n.min = L.min_chunk_frames || p.min; n.max = L.max_chunk_frames || p.max; }
    // Sampling ranges come from the service (hello.sampling_ranges), like the defaults.
    const r = ((S.hello && S.hello.sampling_ranges) || {})[p.key];
    if (r) { p.min = r.exclusive_minimum ? r.minimum + (p.step || 0.01) : r.minimum; p.max = r.maximum; n.min = p.min; n.max = p.max; }
  }
  updateCounts();
}
$('resetScene').addEventListener('click', () => { $('instruction').value = ''; $('text').value = ''; updateCounts(); saveScene(); $('instruction').focus(); });

/* Sampling panel. */
function buildParams() {
  const box = $('params');
  for (const p of PARAMS) {
    if (p.head) { box.append(el('div', { class: 'subhead', text: p.head })); continue; }
    const input = p.type === 'select'
      ? el('select', { id: p.key }, ...p.options.map(([v, l]) => el('option', { value: v, text: l })))
      : el('input', { id: p.key, type: 'number', min: p.min, max: p.max, step: p.step, placeholder: p.optional ? 'none' : '', inputmode: p.type === 'int' ? 'numeric' : 'decimal' });
    const def = el('span', { class: 'def' });
    box.append(el('div', { class: 'param', id: 'param_' + p.key }, el('label', { for: p.key }, el('span', { text: p.label }), def), input));
    p.defEl = def;
    input.addEventListener('input', () => { clearFieldErrors(input); paramChanged(); saveScene(); });
  }
}
function paramDefault(p) { return p.def !== undefined ? p.def : p.optional ? '' : S.defaults[p.key]; }
function readParam(p) {
  if (!p) return undefined;
  const raw = $(p.key).value.trim();
  if (raw === '') return p.optional ? undefined : paramDefault(p);
  if (p.type === 'select') return raw;
  const v = Number(raw);
  return p.type === 'int' ? Math.round(v) : v;
}
function writeParam(p, v) { $(p.key).value = v == null ? '' : String(v); }
function paramInvalid(p) {
  const raw = $(p.key).value.trim(); if (p.type === 'select' || raw === '') return false;
  const v = Number(raw), max = +$(p.key).max, min = +$(p.key).min;
  return !Number.isFinite(v) || v < min || v > max || (p.type === 'int' && !Number.isInteger(v));
}
function applyParamDefaults() {
  const saved = savedScene.params || {};
  for (const p of PARAMS) {
    if (!p.key) continue;
    const d = paramDefault(p);
    p.defEl.textContent = d === '' || d == null ? '' : p.type === 'select' ? '' : String(d);
    writeParam(p, saved[p.key] !== undefined ? saved[p.key] : d);
  }
  paramChanged();
}
function paramChanged() {
  let n = 0;
  for (const p of PARAMS) {
    if (!p.key) continue;
    const changed = String(readParam(p) ?? '') !== String(paramDefault(p) ?? '');
    $('param_' + p.key).classList.toggle('changed', changed); if (changed) n++;
  }
  $('advChanged').textContent = n ? n + ' changed' : 'service defaults';
}
$('resetParams').addEventListener('click', () => { for (const p of PARAMS) if (p.key) writeParam(p, paramDefault(p)); paramChanged(); clearFieldErrors(); saveScene(); });

/* Seed. */
let seedMode = 'random';
function setSeedMode(m) {
  seedMode = m;
  $('seedRandom').setAttribute('aria-pressed', String(m === 'random'));
  $('seedFixed').setAttribute('aria-pressed', String(m === 'fixed'));
  $('seed').disabled = m !== 'fixed';
  $('seed').placeholder = m === 'fixed' ? 'seed' : 'server picks';
  if (m === 'fixed' && !$('seed').value) $('seed').value = String(Math.floor(Math.random() * 2 ** 31));
  saveScene();
}
$('seedRandom').addEventListener('click', () => setSeedMode('random'));
$('seedFixed').addEventListener('click', () => setSeedMode('fixed'));
$('seedRoll').addEventListener('click', () => { $('seed').value = String(Math.floor(Math.random() * 2 ** 31)); setSeedMode('fixed'); });
$('rtSeedMode').addEventListener('change', () => { $('rtSeed').hidden = $('rtSeedMode').value !== 'fixed'; });
$('rtSeed').addEventListener('input', () => $('rtSeed').classList.remove('invalid'));
$('retakeOptsBtn').addEventListener('click', () => {
  const open = $('retakeOpts').hidden; $('retakeOpts').hidden = !open; $('retakeOptsBtn').setAttribute('aria-expanded', String(open));
  if (open && S.selected && S.selected.req) { $('rtInstruction').placeholder = 'unchanged: ' + (S.selected.req.instruction || '(none)').slice(0, 80); $('rtText').placeholder = 'unchanged: ' + (S.selected.req.text || '').slice(0, 80); }
});

/* Persistence of the scene (not of takes). */
let savedScene = {};
try { savedScene = JSON.parse(localStorage.getItem(STORAGE_KEY) || '{}') || {}; } catch (e) { savedScene = {}; }
let saveTimer = null;
function saveScene() {
  clearTimeout(saveTimer);
  saveTimer = setTimeout(() => {
    const params = {};
    for (const p of PARAMS) if (p.key && p.defEl) { const v = $(p.key).value; if (String(v) !== String(paramDefault(p) ?? '')) params[p.key] = v; }
    savedScene = { instruction: $('instruction').value, text: $('text').value, language: $('language').value, reference: $('voice').value, seedMode, seed: $('seed').value, params };
    try { localStorage.setItem(STORAGE_KEY, JSON.stringify(savedScene)); } catch (e) { /* private mode */ }
  }, 300);
}
for (const id of ['instruction', 'text', 'language', 'voice', 'seed']) $(id).addEventListener('input', (e) => { clearFieldErrors(e.target); updateCounts(); saveScene(); });
$('voice').addEventListener('change', saveScene);

/* ====================================== wiring ====================================== */
$('speak').addEventListener('click', speak);
$('cancel').addEventListener('click', cancelAll);
$('replayBtn').addEventListener('click', () => seek('replay'));
$('retakeBtn').addEventListener('click', () => seek('retake'));
$('edPlay').addEventListener('click', () => {
  const t = S.selected;
  if (S.play && S.play.kind === 'local' && S.play.take === t) { stopPlayback(); setStatus('Stopped', ''); refreshTransport(); return; }
  playLocal(t, S.cursor);
});
$('alertClose').addEventListener('click', () => hideAlert());
$('zoomIn').addEventListener('click', () => setZoom(S.view.zoom * 2));
$('zoomOut').addEventListener('click', () => setZoom(S.view.zoom / 2));
$('zoomFit').addEventListener('click', () => setZoom(1));
$('waveScroll').addEventListener('input', () => { S.view.start = +$('waveScroll').value * FRAME; scheduleDraw(); });
$('loopBtn').addEventListener('click', toggleLoop);
$('regionClear').addEventListener('click', () => setRegion(null));
$('retakeRegionBtn').addEventListener('click', retakeRegion);
$('compAdd').addEventListener('click', addToComp);
$('compBuild').addEventListener('click', buildComp);
$('compClear').addEventListener('click', () => { S.comp = []; renderComp(); });
$('markerAdd').addEventListener('click', addMarker);
$('markerLabel').addEventListener('keydown', (e) => { if (e.key === 'Enter') { e.preventDefault(); addMarker(); } });
$('takeStar').addEventListener('click', () => { const t = S.selected; if (t) { t.starred = !t.starred; takeChanged(t); } });
$('takeName').addEventListener('input', () => { const t = S.selected; if (t) { t.title = $('takeName').value.trim(); takeChanged(t); } });
$('takeNote').addEventListener('input', () => { const t = S.selected; if (t) { t.note = $('takeNote').value; takeChanged(t); } });
$('takeDelete').addEventListener('click', () => {
  const t = S.selected; if (!t || t === S.live) return;
  if (S.deleteArmed !== t) { S.deleteArmed = t; refreshDetails(); setTimeout(() => { if (S.deleteArmed === t) { S.deleteArmed = null; refreshDetails(); } }, 4000); return; }
  S.deleteArmed = null;
  announce(takeTitle(t) + ' deleted.');
  removeTake(t, false);
});
$('takeFilter').addEventListener('change', applyFilter);
$('sessionNew').addEventListener('click', () => { try { localStorage.removeItem(SESSION_KEY); } catch (e) { /* private mode */ } location.href = location.pathname; });
$('sessionImportBtn').addEventListener('click', () => $('sessionImport').click());
$('sessionImport').addEventListener('change', async () => {
  const f = $('sessionImport').files[0]; if (!f) return;
  try {
    const r = await apiFetch('/api/sessions/import', { method: 'POST', body: f, headers: { 'Content-Type': 'application/zip' } });
    const body = await r.json().catch(() => null);
    if (!r.ok) throw new Error((body && body.error && body.error.message) || 'HTTP ' + r.status);
    try { localStorage.setItem(SESSION_KEY, body.session); } catch (e) { /* private mode */ }
    location.href = location.pathname + '?session=' + encodeURIComponent(body.session);
  } catch (e) { showAlert('import', 'The session could not be imported: ' + e.message); }
  $('sessionImport').value = '';
});
window.addEventListener('beforeunload', (e) => {   // comps and splices live only in this page
  if (S.takes.some((t) => t.local)) { e.preventDefault(); e.returnValue = ''; }
});
$('takeSearch').addEventListener('input', applyFilter);
$('voice').addEventListener('change', refreshVoicePlay);
$('voicePlay').addEventListener('click', () => {
  const a = $('voicePreview'), id = $('voice').value;
  if (!a.paused) { a.pause(); return; }
  if (!id || id === 'none') return;
  a.src = auth.query('/api/voices/' + encodeURIComponent(id) + '/audio');
  a.play().catch((e) => { $('uploadNote').className = 'note err'; $('uploadNote').textContent = 'Could not play the voice: ' + e.message; });
});
$('voicePreview').addEventListener('play', refreshVoicePlay);
$('voicePreview').addEventListener('pause', refreshVoicePlay);
$('voicePreview').addEventListener('ended', refreshVoicePlay);
$('demoDismiss').addEventListener('click', () => { $('demoBanner').hidden = true; try { localStorage.setItem(DEMO_DISMISSED, '1'); } catch (e) { /* private mode */ } });
$('alertRetry').addEventListener('click', () => { hideAlert(); speak(); });
$('abPlayA').addEventListener('click', () => playAB('a'));
$('abPlayB').addEventListener('click', () => playAB('b'));
$('abSwitch').addEventListener('click', switchAB);
$('abClear').addEventListener('click', () => { S.ab = { a: null, b: null }; for (const t of S.takes) updateCard(t); refreshCompare(); });
$('abSplice').addEventListener('click', () => {
  const { a, b } = S.ab; const d = divergence(a, b); if (d == null) return;
  const cur = S.play ? S.play.take : null;
  playLocal(cur === a ? b : a, Math.max(0, d - SR));
});
const isMac = /Mac|iPhone|iPad/.test(navigator.platform || navigator.userAgent);
$('speakKbd').textContent = isMac ? '⌘ ↵' : 'Ctrl ↵';

document.addEventListener('keydown', (e) => {
  const typing = /^(INPUT|TEXTAREA|SELECT)$/.test(e.target.tagName) || e.target.isContentEditable;
  if ((e.ctrlKey || e.metaKey) && e.key === 'Enter') {
    e.preventDefault();
    if (e.shiftKey) { if (!$('retakeBtn').disabled) seek('retake'); } else if (!$('speak').disabled) speak();
    return;
  }
  if (e.key === 'Escape') { if (rec.on) stopRecording(); else cancelAll(); return; }
  if (typing || e.ctrlKey || e.metaKey || e.altKey) return;
  if (e.key === ' ') { if (/^(BUTTON|A|SUMMARY)$/.test(e.target.tagName)) return; e.preventDefault(); $('edPlay').click(); }
  else if (e.key === 'a' || e.key === 'A') playAB('a');
  else if (e.key === 'b' || e.key === 'B') playAB('b');
  else if (e.key === 'x' || e.key === 'X') switchAB();
  else if (e.key === '[' && S.selected) setRegion(S.cursor, S.region ? Math.max(S.region.to, S.cursor) : S.selected.pcm.length);
  else if (e.key === ']' && S.selected) setRegion(S.region ? Math.min(S.region.from, S.cursor) : 0, S.cursor);
  else if (e.key === 'l' || e.key === 'L') toggleLoop();
  else if (e.key === 'm' || e.key === 'M') addMarker();
  else if ((e.key === 'ArrowLeft' || e.key === 'ArrowRight') && S.selected) {
    e.preventDefault(); setCursor(S.cursor + (e.key === 'ArrowLeft' ? -1 : 1) * FRAME * (e.shiftKey ? 10 : 1));
  }
});

/* Test and automation hooks: counters and read-only views of what the page holds. */
window.studio = {
  stats: S.stats,
  get connected() { return conn.ready; },
  get hello() { return S.hello; },
  get audioMode() { return audio.mode; },
  get audioState() { return audio.ctx ? audio.ctx.state : null; },
  get busy() { return !!(hasPending() || S.live); },
  get playing() { return !!S.play; },
  get cursor() { return S.cursor; },
  get selected() { return S.selected ? S.selected.key : null; },
  get playingTake() { return S.play ? S.play.take.key : null; },
  get playhead() { return playheadSample(); },
  get connectionSerial() { return conn.serial; },
  get session() { return sessionStore.id; },
  takes() {
    return S.takes.map((t) => ({ key: t.key, name: t.name, id: t.id, status: t.status, seed: t.seed, samples: t.pcm ? t.pcm.length : 0,
      channels: t.pcm ? t.pcm.ch : null, parent: t.parent ? (S.byKey.get(t.parent) || {}).id || null : null, spliceSample: t.spliceSample || 0,
      spliceFrame: t.spliceFrame || 0, end: t.end || null, ttfaMs: t.ttfaClient ?? null, heardMs: t.heardMs ?? null, mismatch: t.mismatch || null, request: t.req,
      underruns: t.underruns || 0, dropped: !!t.dropped, title: t.title || null, starred: !!t.starred, note: t.note || '',
      local: !!t.local, stored: !!t.stored, loaded: !!(t.pcm && t.pcm.complete), splices: (t.splices || []).map((x) => ({ ...x })), markers: (t.markers || []).map((m) => ({ ...m })) }));
  },
  take(idOrKey) { const t = S.byId.get(idOrKey) || S.byKey.get(idOrKey); return t ? window.studio.takes().find((x) => x.key === t.key) : null; },
  /* Samples [from, to) of channel c of a take, as a plain array (tests check splices with it). */
  samples(idOrKey, from, to, c = 0) {
    const t = S.byId.get(idOrKey) || S.byKey.get(idOrKey); if (!t || !t.pcm) return null;
    const out = []; for (let i = Math.max(0, from); i < Math.min(to, t.pcm.length); i++) out.push(t.pcm.sample(i, c)); return out;
  },
  setCursorFrame(frame) { setCursor(frame * FRAME); return S.cursor; },
  select(idOrKey) { const t = S.byId.get(idOrKey) || S.byKey.get(idOrKey); if (t) selectTake(t, S.cursor); return !!t; },
  disconnect() { conn.drop(4001, 'test'); },
  describeRtf,
  setRegion(fromFrame, toFrame) { setRegion(fromFrame == null ? null : fromFrame * FRAME, toFrame * FRAME); return S.region; },
  get region() { return S.region; },
  get view() { const t = S.selected; return t && t.pcm ? viewRange(t) : null; },
  get loop() { return S.play && S.play.loop ? { ...S.play.loop } : null; },
  get comp() { return S.comp.map((g) => ({ key: g.take.key, from: g.from, to: g.to })); },
  markers(idOrKey) { const t = S.byId.get(idOrKey) || S.byKey.get(idOrKey); return t ? (t.markers || []).map((m) => ({ ...m })) : null; },
};

/* Boot. */
buildParams();
applyParamDefaults();
if (savedScene.instruction != null) $('instruction').value = savedScene.instruction;
$('text').value = savedScene.text != null ? savedScene.text : 'The lighthouse keeper counted the ships until the fog rolled in, and then he counted the silence.';
if (savedScene.language) $('language').value = savedScene.language;
if (savedScene.seedMode === 'fixed') { $('seed').value = savedScene.seed || ''; setSeedMode('fixed'); }
updateCounts();
refreshTransport();
scheduleDraw();
conn.connect();
audio.init().catch(() => {});   // starts suspended without a gesture in most browsers; resumed on the first click
