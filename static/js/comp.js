/* The comp: regions of any takes queued in order ("Add to comp"), joined sample for sample into a new take:
 * bound to a session the service builds it from the stored takes and keeps it (a take of the session, with where
 * each region came from); otherwise it is made here. Playable, comparable and exportable as WAV either way. Owns
 * the queue. */
import { $, el, fmtSec, plural } from './util.js';
import { PcmStore } from './pcm.js';
import { announce, showAlert } from './status.js';
import { allTakes, takeEvents, takeTitle } from './takes.js';
import { openLocalTake, selectTake, selectedTake } from './selection.js';
import { createEdit, sessionId } from './sessions.js';
import { currentRegion } from './editor.js';

let comp = [];        // [{take, from, to}] samples, whole frames
let building = false; // the service is building one

/* The queued regions (read only). */
export function compSegments() { return comp; }

function renderComp() {
  $('comp').hidden = !comp.length;
  $('compList').replaceChildren(...comp.map((seg, i) => el('li', {},
    takeTitle(seg.take) + ' ' + fmtSec(seg.from) + ' – ' + fmtSec(seg.to),
    el('button', { type: 'button', class: 'x', text: '×', 'aria-label': 'Remove region ' + (i + 1) + ' from the comp', onclick: () => { comp.splice(i, 1); renderComp(); } }))));
  const total = comp.reduce((a, g) => a + g.to - g.from, 0);
  $('compInfo').textContent = comp.length ? plural(comp.length, 'region') + ' · ' + fmtSec(total) : '';
  $('compBuild').disabled = !comp.length || building;
}
function addToComp() {
  const R = currentRegion(), t = selectedTake(); if (!R || !t || R.to <= R.from) return;
  if (t.status === 'streaming') { showAlert('comp', 'Wait for ' + takeTitle(t) + ' to finish before adding it to the comp.', { info: true }); return; }
  comp.push({ take: t, from: R.from, to: R.to });
  renderComp(); announce('Region added to the comp.');
}
function compJoins() {
  const joins = []; let at = 0;
  comp.forEach((g, i) => { if (i) joins.push({ sample: at, kind: 'comp join' }); at += g.to - g.from; });
  return joins;
}
/* "Comp 3": one more than the comps the page knows of. */
function nextCompTitle() { return 'Comp ' + (allTakes().filter((t) => t.kind === 'comp' || t.comp).length + 1); }

/* The regions joined in order, sample for sample (mono regions are doubled when any region is stereo): by the
 * service (kept in the session), or here without one. */
async function buildComp() {
  if (!comp.length || building) return null;
  const title = nextCompTitle();
  if (!sessionId()) return buildLocalComp(title);
  building = true; renderComp();
  try {
    const t = await createEdit('comp', comp.map((g) => ({ take: g.take, from: g.from, to: g.to })), { title });
    selectTake(t, 0);
    announce('Built ' + takeTitle(t) + ', ' + fmtSec(comp.reduce((a, g) => a + g.to - g.from, 0)) + '.');
    return t;
  } catch (e) {
    showAlert('comp', 'The comp could not be built: ' + e.message);
    return null;
  } finally { building = false; renderComp(); }
}
function buildLocalComp(title) {
  const ch = Math.max(...comp.map((g) => g.take.pcm.ch));
  const out = new PcmStore(ch, comp.reduce((a, g) => a + g.to - g.from, 0));
  for (const g of comp) {
    const src = g.take.pcm, n = g.to - g.from;
    if (src.ch === ch) out.append(src.data.subarray(g.from * ch, g.to * ch));
    else { const d = new Int16Array(n * ch); for (let i = 0; i < n; i++) for (let c = 0; c < ch; c++) d[i * ch + c] = src.sample(g.from + i, 0); out.append(d); }
  }
  const t = openLocalTake(out, { req: { text: title + ' of ' + comp.map((g) => takeTitle(g.take)).join(', ') }, title,
    comp: comp.map((g) => ({ take: g.take.key, from: g.from, to: g.to })),
    splices: compJoins() });
  announce('Built ' + takeTitle(t) + ', ' + fmtSec(out.length) + '.');
  return t;
}

export function initComp() {
  takeEvents.on('removed', (take) => { comp = comp.filter((g) => g.take !== take); renderComp(); });
  for (const ev of ['notes', 'numbered']) takeEvents.on(ev, () => { if (comp.length) renderComp(); });   // the list names takes
  $('compAdd').addEventListener('click', addToComp);
  $('compBuild').addEventListener('click', buildComp);
  $('compClear').addEventListener('click', () => { comp = []; renderComp(); });
}
