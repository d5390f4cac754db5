/* Drawing a take's waveform on a canvas (the editor's and the take cards' minis): canvas sizing for the device's
 * pixel ratio, and the mirrored peak envelope from the take's PeakTrack. No state. */

export function fitCanvas(c) {
  const dpr = window.devicePixelRatio || 1, w = Math.max(1, Math.round(c.clientWidth * dpr)), h = Math.max(1, Math.round(c.clientHeight * dpr));
  if (c.width !== w || c.height !== h) { c.width = w; c.height = h; }
  return { w, h, dpr };
}
/* Samples [from, from + span) of a take across w pixels. */
export function drawWaveform(g, t, x0, w, h, span, colors, from = 0) {
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
