"""Sessions that survive (issue 15), as a director sees them in headless Chromium on the scripted engine: every
take comes back after a reload and after a server restart, playable (the same samples) and retakeable (the
retake's kept frames are the old take's, to the sample), with its name, star and note. Screenshots: session-*.png.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.browser.helpers import (
    FRAME,
    held_audio,
    run_server,
    seed_marker,
    shot,
    stereo_take,
    takes,
    wait_playback_drained,
    wait_session,
    wait_take_ended,
)
from tests.helpers import free_port

pytestmark = pytest.mark.browser


def open_studio(pg: Any, url: str, count: int) -> None:
    pg.goto(url + "/")
    pg.wait_for_function(
        f"window.studio && window.studio.connected && window.studio.session"
        f" && window.studio.takes().length === {count} && window.studio.takes().every((t) => t.loaded)",
        timeout=20_000,
    )


def stored(url: str, session: str, context: Any) -> list[dict[str, Any]]:
    """The session's records as the service keeps them, asked with the page's owner cookie (sessions have
    owners: without it the service answers 404)."""
    cookie = next(c["value"] for c in context.cookies(url) if c["name"] == "moss_rt_owner")
    request = urllib.request.Request(f"{url}/api/sessions/{session}", headers={"Cookie": f"moss_rt_owner={cookie}"})
    with urllib.request.urlopen(request, timeout=10) as r:
        return json.loads(r.read())["takes"]


def test_takes_come_back_after_a_reload_and_a_restart(browser: Any, tmp_path: Path) -> None:
    port = free_port()
    context = browser.new_context(viewport={"width": 1440, "height": 960}, accept_downloads=True)
    pg = context.new_page()
    try:
        with run_server(tmp_path, port=port) as url:
            open_studio(pg, url, 0)
            session = pg.evaluate("window.studio.session")
            assert session.startswith("s_")
            one = stereo_take(pg, 1, seed=11, frames=30)
            two = stereo_take(pg, 2, seed=12, frames=24)
            pg.evaluate(f"window.studio.select('{one['key']}')")
            pg.fill("#takeName", "Keeper")
            pg.click("#takeStar")
            pg.fill("#takeNote", "the warm one")
            pg.wait_for_function("window.studio.stats.notesSaved >= 1", timeout=10_000)
            wait_session(pg, "b.takes[0].title === 'Keeper' && b.takes[0].note === 'the warm one'")
            before = {t["id"]: held_audio(pg, t["key"]) for t in (one, two)}

            pg.reload()  # a reload: the page starts empty and asks for its session
            open_studio(pg, url, 2)
            assert pg.evaluate("window.studio.session") == session
            back = takes(pg)
            assert [t["id"] for t in back] == [one["id"], two["id"]]
            assert [t["name"] for t in back] == ["Take 1", "Take 2"]
            assert (back[0]["title"], back[0]["starred"], back[0]["note"]) == ("Keeper", True, "the warm one")
            assert back[0]["seed"] == "11" and back[0]["request"]["text"] == one["request"]["text"]
            for t in back:
                assert np.array_equal(held_audio(pg, t["key"]), before[t["id"]])  # the audio as it was heard
            assert "Keeper (Take 1)" in pg.locator("article.take").last.inner_text()
            shot(pg, "session-after-reload")

        with run_server(tmp_path, port=port) as url:  # a restart: same data dir, same address
            pg.reload()
            open_studio(pg, url, 2)
            back = takes(pg)
            assert [t["id"] for t in back] == [one["id"], two["id"]]
            for t in back:
                assert np.array_equal(held_audio(pg, t["key"]), before[t["id"]])
            # A take from before the restart is retakeable: its kept frames are the old ones, to the sample.
            pg.evaluate(f"window.studio.select('{back[0]['key']}'); window.studio.setCursorFrame(10)")
            assert pg.locator("#retakeBtn").is_enabled()
            pg.click("#retakeOptsBtn")
            pg.select_option("#rtSeedMode", "fixed")
            pg.fill("#rtSeed", "77")
            pg.click("#retakeBtn")
            retake = wait_take_ended(pg, 3)
            wait_playback_drained(pg)
            assert retake["parent"] == one["id"] and retake["spliceSample"] == 10 * FRAME
            new = held_audio(pg, retake["key"])
            old = before[one["id"]]
            assert np.array_equal(new[: 10 * FRAME], old[: 10 * FRAME])
            assert set(new[10 * FRAME :, 1].tolist()) == {seed_marker(77)}
            assert [t["take_id"] for t in stored(url, session, context)][-1] == retake["id"]
            # Delete: gone from the session too.
            pg.evaluate("window.studio.undoGraceMs = 1000")  # a shorter Undo time: less to wait for
            pg.evaluate(f"window.studio.select('{back[1]['key']}')")
            pg.click("#takeDelete")  # gone from the session once its Undo time has passed
            wait_session(pg, "b.takes.length === 2", timeout=20_000)
            shot(pg, "session-after-restart")
            # The whole session as one archive.
            assert pg.locator("#sessionExport").get_attribute("href").endswith(f"/api/sessions/{session}/archive")
    finally:
        context.close()
