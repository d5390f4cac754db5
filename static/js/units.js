/* Durations as the director reads them: seconds wherever a duration is asked or shown. The model's 80 ms codec
 * frames (what the service counts in) appear beside the seconds only in the advanced view: "Show codec frames"
 * in the Advanced panel, kept in this browser. unitEvents 'change' when it is switched (views redraw). */
import { SR, FRAME } from './util.js';
import { createEmitter } from './events.js';

const STORAGE_KEY = 'moss_rt.studio.show_frames';
export const FRAME_SEC = FRAME / SR;       // 0.08 s

let frames = false;
try { frames = localStorage.getItem(STORAGE_KEY) === '1'; } catch (e) { /* private mode */ }

/* 'change': the advanced view was switched on or off. */
export const unitEvents = createEmitter();

/* Whether codec frames are shown beside seconds (the advanced view). */
export function showFrames() { return frames; }
export function setShowFrames(on) {
  frames = !!on;
  try { localStorage.setItem(STORAGE_KEY, frames ? '1' : '0'); } catch (e) { /* private mode */ }
  unitEvents.emit('change');
}

/* Frames ↔ seconds for the parameters the service counts in frames (a duration hint, the longest take, the
 * chunk): seconds as typed → whole frames (at least one); frames → seconds as shown ("2.4"). */
export function secondsToFrames(sec) { return Math.max(1, Math.round(sec / FRAME_SEC)); }
export function framesToSeconds(n) { return String(+(n * FRAME_SEC).toFixed(2)); }

/* "frame 30" in the advanced view, '' otherwise: the part a position shows beside its seconds. */
export function frameNote(samples) { return frames ? 'frame ' + Math.floor(samples / FRAME) : ''; }
/* " (frame 30)" in the advanced view, '' otherwise. */
export function frameSuffix(samples) { return frames ? ' (frame ' + Math.floor(samples / FRAME) + ')' : ''; }
