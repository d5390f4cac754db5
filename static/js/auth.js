/* API key and browser tokens. With an API key configured, the page trades the key for a short-lived token
 * (POST /api/token) and sends the token as a Bearer header on HTTP and as ?token= on the WebSocket URL and
 * downloads. The key is kept in sessionStorage (and in localStorage when the director asks to remember it). */
import { $ } from './util.js';
import { createEmitter } from './events.js';

const KEY_STORAGE = 'moss_rt.api_key';

/* 'key': the director entered a key (connect again); 'renewed': a fresh token (links that carry one are stale). */
export const authEvents = createEmitter();

export const auth = {
  key: sessionStorage.getItem(KEY_STORAGE) || localStorage.getItem(KEY_STORAGE) || null,
  token: null, expiresAt: 0, required: null, timer: null,
  fresh(margin) { return this.token && this.expiresAt - Date.now() / 1000 > margin; },
  async ensure() {
    if (this.required === false) return null;
    if (this.fresh(60)) return this.token;
    const cred = this.key;               // only the key buys a token (a token cannot renew itself)
    const r = await fetch('/api/token', { method: 'POST', headers: cred ? { Authorization: 'Bearer ' + cred } : {}, cache: 'no-store' });
    if (r.status === 404 || r.status === 405) { this.required = false; return null; }   // a service without tokens
    if (r.status === 401 || r.status === 403) { this.token = null; this.required = true; const e = new Error('unauthorized'); e.auth = true; throw e; }
    if (!r.ok) throw new Error('token request failed: HTTP ' + r.status);
    const body = await r.json();
    this.required = !!body.auth_required;
    this.token = body.token || null;
    this.expiresAt = body.expires_at || 0;
    clearTimeout(this.timer);
    if (this.token && body.expires_in) this.timer = setTimeout(() => this.ensure().then(() => authEvents.emit('renewed')).catch(() => {}), Math.max(5, body.expires_in - 60) * 1000);
    return this.token;
  },
  headers() { return this.token ? { Authorization: 'Bearer ' + this.token } : {}; },
  query(url) { return this.token ? url + (url.includes('?') ? '&' : '?') + 'token=' + encodeURIComponent(this.token) : url; },
  /* A key that was refused: forget it everywhere. */
  forgetKey() { this.key = null; sessionStorage.removeItem(KEY_STORAGE); localStorage.removeItem(KEY_STORAGE); },
};

/* fetch() with the token as a Bearer header. */
export function apiFetch(url, opts = {}) { return fetch(url, { ...opts, headers: { ...(opts.headers || {}), ...auth.headers() } }); }

export function askForKey(message) {
  const d = $('keyDialog');
  $('keyError').hidden = !message; $('keyError').textContent = message || '';
  $('apiKey').value = '';
  if (!d.open) { if (d.showModal) d.showModal(); else d.setAttribute('open', ''); }
  $('apiKey').focus();
}

export function initAuth() {
  $('keyForm').addEventListener('submit', (e) => {
    e.preventDefault();
    const key = $('apiKey').value.trim(); if (!key) return;
    auth.key = key; auth.token = null;
    sessionStorage.setItem(KEY_STORAGE, key);
    if ($('rememberKey').checked) localStorage.setItem(KEY_STORAGE, key); else localStorage.removeItem(KEY_STORAGE);
    $('keyDialog').close ? $('keyDialog').close() : $('keyDialog').removeAttribute('open');
    authEvents.emit('key');
  });
}
