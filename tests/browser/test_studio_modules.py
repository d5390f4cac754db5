"""The studio is native ES modules (static/js/*.js, no build step): every one of them loads, and none errors.

A module that fails to load (a 404, a type other than JavaScript, a syntax error, an import of a name another
module does not export) stops the whole module graph and leaves the page inert. So this test watches from the
browser's side: every file under static/js/ is fetched with
200 and a JavaScript type, no request fails, no console or page error is raised, and the entry point ran
(window.studio connects). (That the import graph is whole and has no cycle: tests/web/test_static_files.py.)

The AudioWorklet's module (audio-worklet.js, with its own import of ring-core.js) is fetched by the worklet, out of
the page's sight (neither Playwright nor the page's resource timing sees it): that it loaded and ran shows as the
audio path, 'worklet', which the page reports only once audioWorklet.addModule() resolved and the 'moss-player'
processor the module registers was created.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.browser.helpers import ROOT, run_server

pytestmark = pytest.mark.browser

MODULES = sorted(p.name for p in (ROOT / "static" / "js").glob("*.js"))
WORKLET = "audio-worklet.js"  # fetched by the audio worklet, not the page


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with run_server(tmp_path_factory.mktemp("studio-modules")) as url:
        yield url


def settled(pg: Any, condition: str) -> bool:
    try:
        pg.wait_for_function(condition, timeout=15_000)
    except Exception:  # the assertions say what did not load
        return False
    return True


def test_every_module_loads_and_none_errors(browser: Any, server: str) -> None:
    context = browser.new_context()
    pg = context.new_page()
    fetched: dict[str, tuple[int, str]] = {}
    failed: list[str] = []
    errors: list[str] = []
    context.on("response", lambda r: fetched.__setitem__(r.url, (r.status, r.headers.get("content-type", ""))))
    context.on("requestfailed", lambda r: failed.append(f"{r.url}: {r.failure}"))
    pg.on("pageerror", lambda e: errors.append(f"page error: {e}"))
    pg.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    try:
        pg.goto(server + "/")
        started = settled(pg, "window.studio && window.studio.connected")
        # The audio path is known once audio output started, or failed (it says so in the alert).
        settled(
            pg,
            "window.studio && (window.studio.stats.audioMode !== null"
            " || document.getElementById('alertCode').textContent === 'audio')",
        )
        audio_mode = pg.evaluate("window.studio ? window.studio.audioMode : null")
        alert = pg.evaluate("document.getElementById('alert').hidden ? '' : document.getElementById('alert').innerText")
    finally:
        context.close()
    assert not failed, f"requests failed: {failed}"
    assert not errors, errors
    modules = {url.split("/static/js/", 1)[1]: answer for url, answer in fetched.items() if "/static/js/" in url}
    for name, (status, content_type) in modules.items():
        assert status == 200 and content_type.startswith("text/javascript"), (name, status, content_type)
    expected = set(MODULES) - {WORKLET}
    assert set(modules) == expected, (
        f"not loaded: {sorted(expected - set(modules))}; unexpected: {sorted(set(modules) - expected)}"
    )
    assert started, "the entry point did not start (window.studio never connected)"
    assert audio_mode == "worklet", (
        f"the AudioWorklet module did not load or run (audio mode {audio_mode!r}; {alert!r})"
    )
