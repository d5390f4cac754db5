/* The top bar and the demo banner: the model picker, the engine tag, the notice that the audio is not a real
 * voice (random weights or the scripted engine), dismissable for good on this device. */
import { $, el, SR } from './util.js';
import { hello } from './service.js';

const DEMO_DISMISSED = 'moss_rt.studio.demo_dismissed';

/* The model to ask for: the picker's, else the service's default. */
export function chosenModel() { const h = hello(); return $('model').value || (h && h.default_model) || undefined; }

export function applyHelloToTopbar(msg) {
  const sel = $('model'); const keep = sel.value;
  sel.replaceChildren(...(msg.models || []).map((m) => el('option', { value: m, text: m })));
  sel.value = (msg.models || []).includes(keep) ? keep : (msg.default_model || (msg.models || [])[0] || '');
  sel.disabled = (msg.models || []).length < 2;
  $('engineTag').textContent = [msg.engine && ('engine ' + msg.engine), (msg.sr || SR) / 1000 + ' kHz'].filter(Boolean).join(' · ');
  $('demoBanner').hidden = !msg.demo || localStorage.getItem(DEMO_DISMISSED) === '1';
  if (msg.demo && msg.engine === 'scripted') {
    $('demoText').textContent = 'The service is running its scripted test engine (no model): the audio is a test signal, everything else (streaming, seeking, takes) is real.';
    $('demoShort').textContent = 'Scripted test engine; the rest is real.';
  }
  $('demoBanner').title = $('demoText').textContent;
}

export function initTopbar() {
  $('demoDismiss').addEventListener('click', () => { $('demoBanner').hidden = true; try { localStorage.setItem(DEMO_DISMISSED, '1'); } catch (e) { /* private mode */ } });
}
