/* The directing channel: one WebSocket at a time (/api/ws, with the token), reconnecting with backoff, pinging,
 * and decoding what the service sends (wire.js). What arrives goes to the modules that subscribed:
 * onMessage(type, fn) for a JSON message of that type ('hello', 'start', 'seek', 'end', 'error', 'session', and any
 * type a later protocol adds: a type nobody subscribed to is ignored), onPcm(fn) for audio (an Int16Array),
 * onClose(fn) for the socket's close event. Each connection has a serial: a take records the serial it was made on. */
import { now } from './util.js';
import { createEmitter } from './events.js';
import { decodeMessage, encodeMessage } from './wire.js';
import { auth, askForKey } from './auth.js';
import { setHello } from './service.js';
import { setConn, setRtt, setStatus, showAlert } from './status.js';

const messages = createEmitter();   // JSON messages, by their type
const events = createEmitter();     // 'pcm', 'closed'

export function onMessage(type, fn) { return messages.on(type, fn); }
export function onPcm(fn) { return events.on('pcm', fn); }
export function onClose(fn) { return events.on('closed', fn); }

export const stats = { jsonMessages: 0, protocolErrors: 0, reconnects: 0, connects: 0, rttMs: null };

export const conn = {
  ws: null, serial: 0, state: 'idle', attempt: 0, timer: null, pingTimer: null, lastPong: 0, hello: null,
  /* Open, and the service's hello received. */
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
        auth.forgetKey();
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
      events.emit('closed', ev);
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
      if (left > 0) this.timer = setTimeout(tick, Math.min(left, 500)); else { stats.reconnects++; this.connect(); }
    };
    tick();
  },
  /* Send a client message; false (and an alert) when not connected. */
  send(obj) {
    if (!this.ready) { showAlert('offline', 'Not connected to the service; waiting for the connection to come back.'); return false; }
    this.ws.send(encodeMessage(obj));
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
  const m = decodeMessage(data);
  if (m.kind === 'invalid') { stats.protocolErrors++; showAlert('protocol', m.reason); return; }
  if (m.kind === 'pcm') { events.emit('pcm', m.pcm); return; }
  const msg = m.msg;
  stats.jsonMessages++;
  switch (msg.type) {
    case 'hello':
      conn.hello = msg; conn.attempt = 0; stats.connects++;
      setHello(msg);
      break;
    case 'pong': conn.lastPong = now(); if (typeof msg.t === 'number') stats.rttMs = now() - msg.t; setRtt(stats.rttMs); return;
    default: break;
  }
  if (typeof msg.type === 'string') messages.emit(msg.type, msg);   // forward compatible: unknown types go nowhere
}
