"""The director's tools (issue 15), in headless Chromium on the scripted engine.

The scripted engine's stereo audio encodes where it came from (left = frame index + 1, right = -(seed % 1024 + 1);
see test_studio.py), so a loop, a splice or a comp can be checked to the sample. Screenshots: director-*.png.
"""

from __future__ import annotations

import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.browser.helpers import (
    FRAME,
    SR,
    held_audio,
    retake_region_keeping_tail,
    run_server,
    seed_marker,
    shot,
    stats,
    stereo_take,
    takes,
)
from tests.conftest import sine_wav

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with run_server(tmp_path_factory.mktemp("studio-director")) as url:
        yield url


def test_region_loop_plays_exactly_the_region(page: Any) -> None:
    pg = page
    take = stereo_take(pg, 1, seed=4, frames=40)
    # A region from the keyboard: [ at frame 10, ] at frame 16.
    pg.evaluate("window.studio.setCursorFrame(10)")
    pg.locator("#takes h2").click()
    pg.keyboard.press("[")
    pg.evaluate("window.studio.setCursorFrame(16)")
    pg.keyboard.press("]")
    region = pg.evaluate("window.studio.region")
    assert region == {"from": 10 * FRAME, "to": 16 * FRAME}
    assert "1.28 s" in pg.locator("#regionPos").inner_text()

    played0 = stats(pg)["samplesPlayed"]
    pg.click("#loopBtn")
    assert pg.locator("#loopBtn").get_attribute("aria-pressed") == "true"
    length = 6 * FRAME
    positions = []
    while stats(pg)["samplesPlayed"] < played0 + 3 * length:  # at least three passes
        head = pg.evaluate("window.studio.playhead")
        if head is not None:
            positions.append(head)
        pg.wait_for_timeout(30)
    shot(pg, "director-loop", full_page=False)
    assert positions and all(10 * FRAME <= p < 16 * FRAME for p in positions), positions
    # What was handed to the player: the region, pass after pass, nothing outside it, no gap.
    log = pg.evaluate("window.studio.stats.loopLog")
    assert log[0][0] == 10 * FRAME
    for (a0, b0), (a1, _) in zip(log, log[1:], strict=False):
        assert 10 * FRAME <= a0 < b0 <= 16 * FRAME
        assert a1 == (10 * FRAME if b0 == 16 * FRAME else b0), log
    assert sum(b - a for a, b in log) >= 3 * length
    # And the region is the take's frames 10..15 (scripted left channel = frame index + 1).
    lefts = held_audio(pg, take["key"], 10 * FRAME, 16 * FRAME)[:, 0]
    assert list(lefts[::FRAME]) == list(range(11, 17))
    pg.keyboard.press("Escape")
    pg.wait_for_function("!window.studio.playing", timeout=5_000)
    assert pg.evaluate("window.studio.loop") is None

    # Shift+drag on the waveform selects a region too (frame-aligned).
    box = pg.locator("#wave").bounding_box()
    pg.keyboard.down("Shift")
    pg.mouse.move(box["x"] + box["width"] * 0.2, box["y"] + 40)
    pg.mouse.down()
    pg.mouse.move(box["x"] + box["width"] * 0.45, box["y"] + 40, steps=4)
    pg.mouse.up()
    pg.keyboard.up("Shift")
    region = pg.evaluate("window.studio.region")
    assert region["from"] % FRAME == 0 and region["to"] % FRAME == 0
    assert 6 <= region["from"] // FRAME <= 10 and 16 <= region["to"] // FRAME <= 20, region


def test_comp_export_equals_the_chosen_regions(page: Any, tmp_path: Path) -> None:
    pg = page
    one = stereo_take(pg, 1, seed=5, frames=30)
    two = stereo_take(pg, 2, seed=6, frames=30)
    pg.evaluate(f"window.studio.select('{one['key']}'); window.studio.setRegion(5, 12)")
    pg.click("#compAdd")
    pg.evaluate(f"window.studio.select('{two['key']}'); window.studio.setRegion(20, 26)")
    pg.click("#compAdd")
    assert pg.locator("#comp").is_visible()
    assert "2 regions" in pg.locator("#compInfo").inner_text()
    pg.click("#compBuild")  # the service builds it from the stored takes and keeps it
    pg.wait_for_function("window.studio.takes().some((t) => t.kind === 'comp' && t.loaded)", timeout=20_000)
    comp = takes(pg)[-1]
    assert comp["title"] == "Comp 1" and comp["samples"] == 13 * FRAME and comp["channels"] == 2
    assert comp["stored"] and not comp["local"] and comp["hasCodes"]
    assert [(p["take"], p["from"], p["to"]) for p in comp["parts"]] == [
        (one["id"], 5 * FRAME, 12 * FRAME),
        (two["id"], 20 * FRAME, 26 * FRAME),
    ]
    expected = np.concatenate(
        [held_audio(pg, one["key"], 5 * FRAME, 12 * FRAME), held_audio(pg, two["key"], 20 * FRAME, 26 * FRAME)]
    )
    # The scripted markers say where each part came from.
    assert set(expected[: 7 * FRAME, 1]) == {seed_marker(5)} and set(expected[7 * FRAME :, 1]) == {seed_marker(6)}
    shot(pg, "director-comp")

    card = pg.locator(f"article.take[data-key='{comp['key']}']")
    with pg.expect_download() as info:
        card.get_by_role("button", name="Download Comp 1 (Take 3) as WAV", exact=False).click()
    path = tmp_path / "comp.wav"
    info.value.save_as(path)
    with wave.open(str(path)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (SR, 2, 2)
        exported = np.frombuffer(w.readframes(w.getnframes()), "<i2").reshape(-1, 2)
    assert np.array_equal(exported, expected)


def test_retake_a_region_and_bring_the_old_tail_back(page: Any) -> None:
    pg = page
    first = stereo_take(pg, 1, seed=7, frames=40)
    pg.evaluate("window.studio.setRegion(10, 20)")
    retake_region_keeping_tail(pg, 99)
    spliced = next(t for t in takes(pg) if t["kind"] == "splice")
    assert spliced["stored"] and not spliced["local"] and not spliced["hasCodes"] and spliced["crossfade"] == 480
    assert spliced["samples"] == first["samples"]
    assert spliced["splices"] == [{"sample": 20 * FRAME, "kind": "crossfade 10 ms"}]
    a, b = held_audio(pg, first["key"], 0, first["samples"]), held_audio(pg, spliced["key"], 0, spliced["samples"])
    cut, tail = 10 * FRAME, 20 * FRAME + 480
    assert np.array_equal(b[:cut], a[:cut])  # kept before the region
    assert set(b[cut : 20 * FRAME, 1]) == {seed_marker(99)}  # the region re-done with the new seed
    assert list(b[cut : 20 * FRAME : FRAME, 0]) == list(range(11, 21))
    assert np.array_equal(b[tail:], a[tail:])  # the old tail, after a 10 ms crossfade
    mid = b[20 * FRAME + 240, 1]
    assert min(seed_marker(7), seed_marker(99)) < mid < max(seed_marker(7), seed_marker(99))
    retake = next(t for t in takes(pg) if t["parent"] == first["id"])
    assert pg.locator("#edSub").inner_text().startswith(f"splice: {retake['name']} 0.00 s – 1.60 s, then Take 1 1.60 s")
    # Its crossfade lies inside a frame: no codes, so the model cannot continue it, and the studio says why.
    assert pg.locator("#retakeBtn").is_disabled() and pg.locator("#replayBtn").is_disabled()
    assert "no codes" in pg.locator("#seekWhy").inner_text() and pg.locator("#seekWhy").is_visible()
    shot(pg, "director-region-splice")


def test_markers_names_stars_notes_filter_delete_and_zoom(page: Any) -> None:
    pg = page
    one = stereo_take(pg, 1, seed=1, frames=30)
    stereo_take(pg, 2, seed=2, frames=30)
    pg.evaluate(f"window.studio.select('{one['key']}'); window.studio.setCursorFrame(8)")
    pg.fill("#markerLabel", "breath")
    pg.click("#markerAdd")
    assert pg.evaluate(f"window.studio.markers('{one['key']}')") == [{"sample": 8 * FRAME, "label": "breath"}]
    pg.evaluate("window.studio.setCursorFrame(0)")
    pg.get_by_role("button", name="breath @ 0.64 s").click()
    assert pg.evaluate("window.studio.cursor") == 8 * FRAME

    pg.fill("#takeName", "Keeper")
    pg.click("#takeStar")
    pg.fill("#takeNote", "best reading of the last line")
    card = pg.locator(f"article.take[data-key='{one['key']}']")
    assert "Keeper (Take 1)" in card.inner_text() and "★" in card.inner_text()
    assert "best reading" in card.inner_text()
    assert pg.get_by_role("button", name="Play Keeper (Take 1)", exact=True).count() == 1
    pg.select_option("#takeFilter", "starred")
    assert pg.locator("article.take:visible").count() == 1
    pg.select_option("#takeFilter", "all")
    pg.fill("#takeSearch", "last line")
    assert pg.locator("article.take:visible").count() == 1
    pg.fill("#takeSearch", "")
    shot(pg, "director-take-notes")

    # Zoom in around the playhead, scroll, fit.
    total = pg.evaluate("window.studio.view.total")
    pg.click("#zoomIn")
    pg.click("#zoomIn")
    view = pg.evaluate("window.studio.view")
    assert view["span"] == pytest.approx(total / 4, rel=0.01)
    assert view["start"] <= 8 * FRAME <= view["start"] + view["span"]
    assert pg.locator("#waveScroll").is_visible()
    pg.locator("#waveScroll").fill("20")
    assert pg.evaluate("window.studio.view.start") == 20 * FRAME
    shot(pg, "director-zoomed", full_page=False)
    pg.click("#zoomFit")
    assert pg.evaluate("window.studio.view.span") == total and pg.locator("#waveScroll").is_hidden()

    # Delete hides the take at once (Undo for a few seconds, shortened here), then it is gone from the page.
    pg.evaluate("window.studio.undoGraceMs = 1000")
    pg.click("#takeDelete")
    assert pg.locator("#undoBar").is_visible()
    pg.wait_for_function("window.studio.takes().length === 1", timeout=15_000)
    assert [t["name"] for t in takes(pg)] == ["Take 2"]


def test_listen_to_an_uploaded_voice_before_using_it(page: Any, tmp_path: Path) -> None:
    pg = page
    assert pg.locator("#voicePlay").is_disabled()  # no voice chosen
    path = tmp_path / "reference.wav"
    path.write_bytes(sine_wav(2.0, sr=24000))
    pg.set_input_files("#uploadFile", str(path))
    pg.wait_for_function("document.getElementById('uploadNote').textContent.startsWith('Voice ready')", timeout=15_000)
    pg.click("#voicePlay")
    pg.wait_for_function(
        "(() => { const a = document.getElementById('voicePreview'); return !a.paused && a.currentTime > 0.2; })()",
        timeout=10_000,
    )
    assert pg.locator("#voicePlay").get_attribute("aria-label") == "Stop the voice"
    pg.click("#voicePlay")
    assert pg.evaluate("document.getElementById('voicePreview').paused")
