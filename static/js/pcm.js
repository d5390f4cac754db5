/* Audio held by the page: PcmStore (int16 samples of a take, growing as they stream, with PeakTrack's min/max
 * per 10 ms for the waveforms), and 16-bit WAV in and out. No DOM, no state of its own. */
import { SR, LITTLE_ENDIAN } from './util.js';

export class PcmStore {
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
export class PeakTrack {
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

export function wavBlob(int16, channels, rate) {
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

/* 16-bit PCM WAV (what the service writes) → channels and interleaved samples. */
export function parseWav(buf) {
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
