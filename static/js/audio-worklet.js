/* The studio's AudioWorklet processors, loaded with audioWorklet.addModule(new URL('./audio-worklet.js', import.meta.url)).
 * moss-player: the jitter-buffered ring (RingCore) that plays the take; moss-recorder: raw microphone PCM in chunks. */
import { RingCore } from './ring-core.js';

class MossPlayer extends AudioWorkletProcessor {
  constructor() { super(); this.core = new RingCore(sampleRate); this.port.onmessage = (e) => this.core.msg(e.data); }
  process(inputs, outputs) {
    const o = outputs[0];
    this.core.render(o[0], o[1] || o[0]);
    const r = this.core.report();
    if (r) { r.time = currentTime; this.port.postMessage(r); }
    return true;
  }
}
registerProcessor('moss-player', MossPlayer);
class MossRecorder extends AudioWorkletProcessor {
  constructor() {
    super(); this.on = true; this.buf = new Float32Array(4800); this.n = 0; this.peak = 0;
    this.port.onmessage = (e) => { if (e.data === 'stop') { this.flush(); this.on = false; this.port.postMessage({ done: true }); } };
  }
  flush() { if (this.n) { const b = this.buf.slice(0, this.n); this.port.postMessage({ pcm: b, peak: this.peak }, [b.buffer]); this.n = 0; this.peak = 0; } }
  process(inputs) {
    const ch = inputs[0] && inputs[0][0];
    if (this.on && ch) for (let i = 0; i < ch.length; i++) {
      const v = ch[i]; this.buf[this.n++] = v; const a = v < 0 ? -v : v; if (a > this.peak) this.peak = a;
      if (this.n === this.buf.length) this.flush();
    }
    return this.on;
  }
}
registerProcessor('moss-recorder', MossRecorder);
