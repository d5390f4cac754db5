/* Ring buffer core: the same class runs inside the AudioWorklet and, where AudioWorklet is
 * unavailable (plain http from another host), in a ScriptProcessor on the main thread.
 * It holds 48 kHz stereo, starts a stream only once the jitter cushion is buffered, counts
 * underruns after that, and reads with linear interpolation when the device rate is not 48 kHz.
 */
export class RingCore {
  constructor(deviceRate) {
    this.cap = 48000 * 8;
    this.L = new Float32Array(this.cap);
    this.R = new Float32Array(this.cap);
    this.step = 48000 / deviceRate;
    this.totalPlayed = 0;
    this.totalUnderruns = 0;
    this.reset(0);
    this.sinceReport = 0;
    this.event = false;
  }
  reset(id) {
    this.id = id; this.r = 0; this.w = 0; this.level = 0; this.frac = 0;
    this.primed = false; this.ended = false; this.active = id !== 0; this.played = 0; this.received = 0;
    this.underruns = 0; this.drained = false; this.fadeIn = 0; this.stopping = false;
  }
  msg(m) {
    if (m.t === 'stream') { this.reset(m.id); this.cushion = m.cushion; this.event = true; }
    else if (m.t === 'data' && m.id === this.id && this.active) this.write(m.l, m.r);
    else if (m.t === 'end' && m.id === this.id) { this.ended = true; this.event = true; }
    else if (m.t === 'stop') { if (this.active && this.primed && this.level > 0) this.stopping = true; else this.reset(0); this.event = true; }
  }
  write(l, r) {
    const n = Math.min(l.length, this.cap - this.level);   // the feeder never overfills; guard anyway
    let w = this.w;
    for (let i = 0; i < n; i++) { this.L[w] = l[i]; this.R[w] = r[i]; w = w + 1 === this.cap ? 0 : w + 1; }
    this.w = w; this.level += n; this.received += n;
  }
  render(outL, outR) {
    const n = outL.length;
    let i = 0;
    if (this.stopping) {        // stop within one render quantum, with a short fade instead of a click
      const m = Math.min(n, this.level);
      for (; i < m; i++) { const g = 1 - i / m; outL[i] = this.L[this.r] * g; outR[i] = this.R[this.r] * g; this.r = (this.r + 1) % this.cap; }
      for (; i < n; i++) { outL[i] = 0; outR[i] = 0; }
      this.reset(0);
      return;
    }
    if (this.active && !this.primed && this.ended && this.level < (this.step === 1 ? 1 : 2)) {
      // The end came after the ring ran dry (a take's end can follow its last audio by a while, e.g. while its
      // last words are aligned): nothing is left to play, so the stream has drained.
      this.drained = true; this.active = false; this.event = true;
    }
    if (this.active && !this.primed && (this.level >= this.cushion || (this.ended && this.level > 0))) {
      this.primed = true; this.fadeIn = 64; this.event = true;   // 1.3 ms ramp: no click when starting mid-signal
    }
    if (this.active && this.primed) {
      const need = this.step === 1 ? 1 : 2;
      for (; i < n; i++) {
        if (this.level < need) break;
        let a, b;
        if (this.step === 1) { a = this.L[this.r]; b = this.R[this.r]; }
        else {
          const r2 = (this.r + 1) % this.cap, f = this.frac;
          a = this.L[this.r] + (this.L[r2] - this.L[this.r]) * f;
          b = this.R[this.r] + (this.R[r2] - this.R[this.r]) * f;
        }
        if (this.fadeIn > 0) { const g = 1 - this.fadeIn / 64; a *= g; b *= g; this.fadeIn--; }
        outL[i] = a; outR[i] = b;
        let adv = 1;
        if (this.step !== 1) { this.frac += this.step; adv = Math.floor(this.frac); this.frac -= adv; }
        this.r = (this.r + adv) % this.cap; this.level -= adv; this.played += adv; this.totalPlayed += adv;
      }
      if (i < n) {
        if (this.ended) { if (this.level <= 1) { this.drained = true; this.active = false; this.event = true; } }
        else {
          // Starved mid-stream: fade the last few samples out, rebuffer with a larger cushion.
          const k = Math.min(i, 48);
          for (let j = 0; j < k; j++) { const g = j / k; outL[i - k + j] *= g; outR[i - k + j] *= g; }
          this.primed = false; this.underruns++; this.totalUnderruns++;
          this.cushion = Math.min(Math.round(this.cushion * 1.5), 48000 * 3);
          this.event = true;
        }
      }
    }
    for (; i < n; i++) { outL[i] = 0; outR[i] = 0; }
    this.sinceReport += n;
  }
  report() {
    if (!this.event && this.sinceReport < 1024) return null;
    this.event = false; this.sinceReport = 0;
    return { t: 'state', id: this.id, level: this.level, played: this.played, received: this.received,
      primed: this.primed, underruns: this.underruns, cushion: this.cushion, drained: this.drained,
      active: this.active, totalPlayed: this.totalPlayed, totalUnderruns: this.totalUnderruns };
  }
}
