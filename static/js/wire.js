/* Wire protocol v1, pure functions (no state, no DOM, no socket).
 * Every server WebSocket binary message is one frame [u8 tag][u32 BE length][payload]:
 * tag 0 = a JSON object, tag 1 = int16 LE PCM at 48 kHz, interleaved when channels = 2.
 * Seeds are 64-bit: they travel as JSON numbers and are kept here as decimal strings, exact. */
import { LITTLE_ENDIAN } from './util.js';

/* One server message → { kind: 'json', msg } | { kind: 'pcm', pcm: Int16Array } | { kind: 'invalid', reason }. */
export function decodeMessage(data) {
  if (typeof data === 'string') return decodeControl(data);   // servers send frames; tolerate text JSON
  if (data.byteLength < 5) return invalid('a message shorter than a frame header');
  const dv = new DataView(data);
  const tag = dv.getUint8(0), len = dv.getUint32(1, false);
  if (len !== data.byteLength - 5) return invalid(`frame length ${len} does not match the message (${data.byteLength - 5} bytes)`);
  if (tag === 0) return decodeControl(new TextDecoder().decode(new Uint8Array(data, 5)));
  if (tag === 1) {
    if (len % 2) return invalid('odd PCM byte count');
    const pcm = new Int16Array(data.slice(5));
    if (!LITTLE_ENDIAN) for (let i = 0; i < pcm.length; i++) pcm[i] = ((pcm[i] & 0xff) << 8) | ((pcm[i] >> 8) & 0xff);
    return { kind: 'pcm', pcm };
  }
  return invalid('unknown frame tag ' + tag);
}

/* A JSON control message; "seed" stays an exact decimal string whatever its size. */
export function decodeControl(text) {
  let msg;
  text = text.replace(/"seed"\s*:\s*(\d{16,})/g, '"seed":"$1"');   // seeds past 2^53 stay exact (as strings)
  try { msg = JSON.parse(text); } catch (e) { return invalid('invalid JSON from the server'); }
  const seedMatch = /"seed"\s*:\s*(\d+)/.exec(text);       // keep 64-bit seeds exact
  if (seedMatch) msg.seed = seedMatch[1];
  return { kind: 'json', msg };
}

/* A client message as JSON text; a seed given as a string of digits is sent as a JSON number (it may exceed 2^53). */
export function encodeMessage(obj) {
  const text = JSON.stringify(obj, (k, v) => (k === 'seed' && typeof v === 'string' ? '\u0000seed' + v + '\u0000' : v));
  return text.replace(/"\\u0000seed(\d+)\\u0000"/g, '$1');
}

function invalid(reason) { return { kind: 'invalid', reason }; }
