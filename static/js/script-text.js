/* The script as the director writes it, read in the page: which form it is, which characters it names (for the
 * cast table), and where in the text a fault the service reports lies. Pure functions, no DOM, no state.
 *
 * The service's parser (moss_rt/scripts/format.py, docs/scripts.md) is the one judge of a script: this module only
 * reads enough to fill the cast table before the script is posted and to point at the line a 422 names. */

/* A character's name: starts with a letter, digit or underscore; no colon, brackets, parentheses or control
 * characters (as the service's _NAME). */
const CUE_RE = /^([\p{L}\p{N}_][^:()[\]\x00-\x1f\x7f]*?)\s*:(.*)$/u;
const CAST_KEYS = ['voice', 'instruction', 'language'];

/* JSON.parse, except that a "seed" past 2^53 stays exact: as a string of its digits (wire.js encodeMessage sends
 * such a string back as the number it is). */
export function parseJsonExact(text) { return JSON.parse(text.replace(/"seed"(\s*):(\s*)(\d{16,})/g, '"seed"$1:$2"$3"')); }

/* 'json' when the text is the JSON form (an object), else 'text'. */
export function scriptForm(text) { return /^\s*\{/.test(text) ? 'json' : 'text'; }

/* Split a header value as a POSIX shell would (quotes group, a backslash escapes): `KEEPER voice=x
 * instruction="calm, low"` → ['KEEPER', 'voice=x', 'instruction=calm, low']. Unclosed quotes end the token. */
export function shellWords(s) {
  const out = []; let cur = null, quote = null;
  for (let i = 0; i < s.length; i++) {
    const c = s[i];
    if (quote) {
      if (c === quote) quote = null;
      else if (c === '\\' && quote === '"' && i + 1 < s.length && '"\\$`'.includes(s[i + 1])) cur += s[++i];
      else cur += c;
    } else if (/\s/.test(c)) { if (cur !== null) { out.push(cur); cur = null; } }
    else {
      if (cur === null) cur = '';
      if (c === '"' || c === "'") quote = c;
      else if (c === '\\' && i + 1 < s.length) cur += s[++i];
      else cur += c;
    }
  }
  if (cur !== null) out.push(cur);
  return out;
}

/* The characters a script names, in order of appearance: [{name, voice, instruction, language, declared}], where
 * `declared` says the script's own cast gives the entry (a `@cast` line, or the JSON's "cast"). Names match
 * whatever their case and keep the cast's spelling, else their first. Never throws: what it cannot read (the
 * service will say why) it leaves out. Also {title, cues} (how many lines are spoken). */
export function readCast(text) {
  const byKey = new Map();
  const add = (name, entry, declared) => {
    name = String(name).trim(); if (!name || name.length > 64) return;
    const key = name.toLocaleLowerCase();
    const known = byKey.get(key);
    if (known) { if (declared && !known.declared) Object.assign(known, entry, { name, declared: true }); return; }
    byKey.set(key, { name, voice: 'none', instruction: '', language: '', ...entry, declared });
  };
  let title = '', cues = 0;
  if (scriptForm(text) === 'json') {
    let obj;
    try { obj = JSON.parse(text); } catch (e) { return { title, cues, cast: [] }; }
    if (!obj || typeof obj !== 'object' || Array.isArray(obj)) return { title, cues, cast: [] };
    if (typeof obj.title === 'string') title = obj.title.trim();
    if (obj.cast && typeof obj.cast === 'object' && !Array.isArray(obj.cast)) {
      for (const [name, e] of Object.entries(obj.cast)) add(name, castEntry(e || {}), true);
    }
    for (const line of Array.isArray(obj.lines) ? obj.lines : []) {
      if (line && typeof line.who === 'string' && typeof line.text === 'string') { cues++; add(line.who, {}, false); }
    }
  } else {
    let header = true;
    for (const raw of text.split(/\r\n|\r|\n/)) {
      const line = raw.trim();
      if (!line || line.startsWith('#')) continue;
      if (line.startsWith('@')) {
        if (!header) continue;
        const [directive, ...rest] = line.slice(1).split(/\s+/);
        const value = line.slice(1 + directive.length).trim();
        if (directive.toLowerCase() === 'title') title = value;
        if (directive.toLowerCase() === 'cast' && rest.length) {
          const [name, ...pairs] = shellWords(value);
          const entry = {};
          for (const p of pairs) { const i = p.indexOf('='); if (i > 0) entry[p.slice(0, i).trim().toLowerCase()] = p.slice(i + 1); }
          add(name, castEntry(entry), true);
        }
        continue;
      }
      header = false;
      if (line.startsWith('[')) continue;
      const m = CUE_RE.exec(line);
      if (m) { cues++; add(m[1], {}, false); }
    }
  }
  return { title, cues, cast: [...byKey.values()] };
}

function castEntry(e) {
  const out = {};
  for (const k of CAST_KEYS) if (typeof e[k] === 'string') out[k] = k === 'voice' ? (e[k].trim() || 'none') : e[k].trim();
  return out;
}

/* ------------------------------------------------------------------ where a fault lies */

/* [start, end) of line n (1-based) of the text, without its line break; null past the end. */
export function lineRange(text, n) {
  let start = 0;
  for (let i = 1; i < n; i++) {
    const nl = text.indexOf('\n', start);
    if (nl < 0) return null;
    start = nl + 1;
  }
  let end = text.indexOf('\n', start); if (end < 0) end = text.length;
  if (end > start && text[end - 1] === '\r') end--;
  return [start, end];
}

/* The line (1-based) the character at `offset` is on. */
export function lineOf(text, offset) {
  let n = 1; for (let i = 0; i < offset && i < text.length; i++) if (text[i] === '\n') n++;
  return n;
}

/* What a service message about the script points at: {kind: 'line', line} (plain text), {kind: 'path', path}
 * (JSON: ['lines', 3, 'seed'], ['gap_sec']), {kind: 'cast', name} (the cast table's row), or null. */
export function faultOf(message) {
  let m = /^line (\d+)(?:,? column \d+)?:/.exec(message);
  if (m) return { kind: 'line', line: +m[1] };
  m = /^cast\.([^:]+):/.exec(message);
  if (m) return { kind: 'cast', name: m[1] };
  m = /^((?:[A-Za-z_]\w*|\[\d+\])(?:\.[A-Za-z_]\w*|\[\d+\])*):/.exec(message);
  if (m) {
    const path = [];
    for (const part of m[1].matchAll(/([A-Za-z_]\w*)|\[(\d+)\]/g)) path.push(part[1] != null ? part[1] : +part[2]);
    return { kind: 'path', path };
  }
  return null;
}

/* [start, end) of the JSON value at `path` in the text (['lines', 3] → the fourth line's object), or the nearest
 * enclosing value found; null when the text is not JSON. */
export function jsonRange(text, path) {
  let found = null, depthFound = -1;
  try {
    scanJson(text, (p, start, end) => {
      let k = 0; while (k < p.length && k < path.length && p[k] === path[k]) k++;
      if (k === p.length && k > depthFound) { found = [start, end]; depthFound = k; }
    });
  } catch (e) { return null; }
  return found;
}

/* Where JSON text stops parsing: {offset, line, column, message}, or null when it parses. */
export function jsonSyntaxError(text) {
  try { scanJson(text, () => {}); return null; } catch (e) {
    if (e.offset == null) throw e;
    const line = lineOf(text, e.offset);
    const column = e.offset - (text.lastIndexOf('\n', e.offset - 1) + 1) + 1;
    return { offset: e.offset, line, column, message: e.message };
  }
}

/* A strict JSON reader that calls visit(path, start, end) for every value (the document's own path is []). */
function scanJson(text, visit) {
  let i = 0;
  const fail = (what) => { const e = new Error(what); e.offset = i; throw e; };
  const ws = () => { while (i < text.length && ' \t\n\r'.includes(text[i])) i++; };
  const str = () => {
    i++;
    let out = '';
    while (i < text.length && text[i] !== '"') {
      const c = text[i];
      if (c < ' ') fail('a control character inside a string');
      if (c === '\\') {
        const e = text[i + 1];
        if (e === 'u') { if (!/^[0-9a-fA-F]{4}$/.test(text.slice(i + 2, i + 6))) fail('a bad \\u escape'); out += String.fromCharCode(parseInt(text.slice(i + 2, i + 6), 16)); i += 6; continue; }
        if (!'"\\/bfnrt'.includes(e)) fail('a bad escape');
        out += { b: '\b', f: '\f', n: '\n', r: '\r', t: '\t' }[e] || e; i += 2; continue;
      }
      out += c; i++;
    }
    if (i >= text.length) fail('a string that is never closed');
    i++;
    return out;
  };
  const value = (path) => {
    ws();
    const start = i, c = text[i];
    if (c === '{') {
      i++; ws();
      if (text[i] === '}') i++;
      else for (;;) {
        ws(); if (text[i] !== '"') fail('expected a key in double quotes');
        const key = str(); ws();
        if (text[i] !== ':') fail("expected ':' after the key"); i++;
        value([...path, key]); ws();
        if (text[i] === ',') { i++; continue; }
        if (text[i] === '}') { i++; break; }
        fail("expected ',' or '}'");
      }
    } else if (c === '[') {
      i++; ws();
      if (text[i] === ']') i++;
      else for (let n = 0; ; n++) {
        value([...path, n]); ws();
        if (text[i] === ',') { i++; continue; }
        if (text[i] === ']') { i++; break; }
        fail("expected ',' or ']'");
      }
    } else if (c === '"') str();
    else if (/[-0-9]/.test(c || '')) { const m = /^-?(0|[1-9]\d*)(\.\d+)?([eE][-+]?\d+)?/.exec(text.slice(i)); if (!m) fail('a bad number'); i += m[0].length; }
    else { const m = /^(true|false|null)/.exec(text.slice(i, i + 5)); if (!m) fail(i >= text.length ? 'the text ends too early' : 'an unexpected character'); i += m[0].length; }
    visit(path, start, i);
  };
  value([]);
  ws();
  if (i < text.length) fail('text after the end of the JSON');
}
