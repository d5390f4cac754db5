/* Audio output: one AudioContext and the player node. Where AudioWorklet exists the player is the 'moss-player'
 * processor of audio-worklet.js (loaded as its own module file); elsewhere (plain http from another host) the same
 * RingCore runs in a ScriptProcessor on the main thread. What to play comes from playback.js through post();
 * the player's state reports go to the listener set with onPlayerState(). */
import { SR } from './util.js';
import { RingCore } from './ring-core.js';
import { showAlert, hideAlert } from './status.js';

let stateListener = () => {};
/* fn(report) for every report of the player (see RingCore.report()). */
export function onPlayerState(fn) { stateListener = fn; }

export const stats = { audioMode: null };

export const audio = {
  ctx: null, node: null, mode: null, ready: false, initPromise: null, error: null,
  post: null,     // post(message, transfer): to the player
  latencyMs() { const c = this.ctx; return c ? ((c.baseLatency || 0) + (c.outputLatency || 0)) * 1000 : 0; },
  /* Starts the context and the player once; later calls resume a suspended context. */
  init() {
    if (this.initPromise) { if (this.ctx && this.ctx.state === 'suspended') this.ctx.resume(); return this.initPromise; }
    this.initPromise = (async () => {
      const Ctx = window.AudioContext || window.webkitAudioContext;
      if (!Ctx) throw new Error('this browser has no Web Audio');
      try { this.ctx = new Ctx({ sampleRate: SR, latencyHint: 'interactive' }); } catch (e) { this.ctx = new Ctx({ latencyHint: 'interactive' }); }
      if (this.ctx.audioWorklet && window.isSecureContext !== false) {
        await this.ctx.audioWorklet.addModule(new URL('./audio-worklet.js', import.meta.url));
        this.node = new AudioWorkletNode(this.ctx, 'moss-player', { numberOfInputs: 0, numberOfOutputs: 1, outputChannelCount: [2] });
        this.node.port.onmessage = (e) => stateListener(e.data);
        this.post = (m, transfer) => this.node.port.postMessage(m, transfer || []);
        this.mode = 'worklet';
      } else {
        // Fallback for insecure origins where AudioWorklet does not exist: same ring, main thread.
        const core = new RingCore(this.ctx.sampleRate);
        this.node = this.ctx.createScriptProcessor(2048, 1, 2);
        this.node.onaudioprocess = (e) => {
          core.render(e.outputBuffer.getChannelData(0), e.outputBuffer.getChannelData(1));
          const r = core.report(); if (r) stateListener(r);
        };
        this.post = (m) => core.msg(m);
        this.mode = 'script-processor';
      }
      this.node.connect(this.ctx.destination);
      if (this.ctx.state !== 'running') await Promise.race([this.ctx.resume(), new Promise((r) => setTimeout(r, 300))]);
      this.ready = true;
      stats.audioMode = this.mode;
    })().catch((e) => { this.error = e; showAlert('audio', 'Audio output could not start: ' + e.message); throw e; });
    return this.initPromise;
  },
};

/* Browsers start audio suspended without a user gesture: the first click anywhere resumes it. */
export function resumeAudioOnGesture() {
  document.addEventListener('pointerdown', () => { if (audio.ctx && audio.ctx.state === 'suspended') audio.ctx.resume().then(() => hideAlert(['audio'])); }, true);
}
