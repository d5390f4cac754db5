/* What the service said about itself in its last hello (kept across reconnects): limits, models, ranges.
 * Written by connection.js when a hello arrives; read by every module that honours a limit. */

let lastHello = null;
let lastLimits = {};

export function setHello(msg) { lastHello = msg; lastLimits = msg.limits || {}; }
/* The last hello message (null before the first). */
export function hello() { return lastHello; }
/* hello.limits: max_text_chars, max_takes_kept, max_upload_bytes... ({} before the first hello). */
export function limits() { return lastLimits; }
