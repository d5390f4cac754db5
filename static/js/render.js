/* The page's refresh and redraw hub. Modules low in the import graph change state that panels above them show;
 * instead of importing those panels they call refresh() (controls: enabled/disabled, labels; synchronous) or
 * scheduleDraw() (canvases and meters, once per animation frame). main.js registers what each does. */

const refreshers = [];
const drawers = [];
const animating = [];
let drawQueued = false;

/* fn() runs on every refresh(), in the order registered. */
export function onRefresh(fn) { refreshers.push(fn); }
/* fn() runs on every frame drawn, in the order registered. */
export function onDraw(fn) { drawers.push(fn); }
/* While any pred() is true, frames keep being drawn (audio streaming or playing). */
export function keepDrawingWhile(pred) { animating.push(pred); }

export function refresh() { for (const fn of refreshers) fn(); }
export function scheduleDraw() { if (!drawQueued) { drawQueued = true; requestAnimationFrame(drawAll); } }
export function drawAll() {
  drawQueued = false;
  for (const fn of drawers) fn();
  if (animating.some((pred) => pred())) scheduleDraw();
}

/* On a phone the waveform sits below the whole scene form: bring it up when a take starts playing. */
export function showWaveOnPhone() {
  if (!matchMedia('(max-width: 860px)').matches) return;
  requestAnimationFrame(() => document.getElementById('wave').scrollIntoView({ block: 'center', behavior: 'smooth' }));
}
