"""The studio's Script panel (issue 26), in headless Chromium on the scripted engine (whose mono audio encodes the
frame index and the seed, so a line's file can be matched to the take it came from, sample for sample).

One director's session, in order: a script with a fault is refused with its line (or cast row) shown and selected;
a script is pasted, its cast filled (an uploaded voice, a direction, a language) and rendered, every line done; a
line's take opens in the studio and plays; it is retaken with the studio's own retake tool and the retake accepted
as the line's take; the zip is exported (WAV and FLAC) and holds every line, the mix (the lines joined with their
gaps and pause, to the sample, line 2 being the accepted retake), cue sheets and captions; after a reload the
session's script is listed and opened again; on a phone (390×844) the panel fits the screen and a line opens with a
tap. axe-core finds no serious violation with the panel in use, on the desktop and on the phone.
Screenshots: script-*.png.
"""

from __future__ import annotations

import io
import json
import wave
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.browser.helpers import (
    FRAME,
    SR,
    held_audio,
    run_server,
    shot,
    takes,
    wait_playback_drained,
    wait_take_ended,
)
from tests.browser.test_studio_a11y import axe_violations, describe
from tests.conftest import sine_wav

pytestmark = pytest.mark.browser

SCRIPT = """\
@title Browser scene
@gap 200ms
# three lines and a pause
ANNA: (softly) Good morning, Ben.
BEN: Morning. Did you sleep?
[pause 0.3s]
ANNA: Not a wink.
"""
GAP, PAUSE = SR * 200 // 1000, SR * 300 // 1000
BIG_SEED = str(2**53 + 1)
LINE_FILES = ["lines/001-ANNA", "lines/002-BEN", "lines/003-ANNA"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with run_server(tmp_path_factory.mktemp("studio-script")) as url:
        yield url


def fill_script(pg: Any, text: str) -> None:
    """Paste a script and wait until the panel has read it (its count line ends with the text's size)."""
    pg.fill("#scriptText", text)
    size = len(text.encode())
    pg.wait_for_function(f"document.getElementById('scriptCount').textContent.endsWith(' · {size} bytes')")


def render_refused(pg: Any) -> str:
    pg.click("#scriptRender")
    pg.wait_for_selector("#scriptError:not([hidden])", timeout=10_000)
    return pg.locator("#scriptError").inner_text()


def selected_text(pg: Any) -> str:
    return pg.evaluate("(() => { const t = document.getElementById('scriptText');"
                       " return t.value.slice(t.selectionStart, t.selectionEnd); })()")  # fmt: skip


def script_state(pg: Any) -> dict[str, Any]:
    """The script as the service has it (asked from the page: its owner cookie goes along)."""
    sid = pg.evaluate("window.studio.script.script")
    return pg.evaluate(f"fetch('/api/scripts/{sid}').then((r) => r.json())")


def wait_lines_held(pg: Any) -> list[dict[str, Any]]:
    """Every line's take joined the page (from the session) with its audio; the page's records of them."""
    pg.wait_for_function(
        """(() => { const s = window.studio.script; if (!s || s.state !== 'done') return false;
            return s.lines.every((l) => { const t = window.studio.take(l.take); return t && t.loaded; }); })()""",
        timeout=30_000,
    )
    return [pg.evaluate(f"window.studio.take('{line['take']}')") for line in pg.evaluate("window.studio.script.lines")]


def wav_samples(data: bytes) -> np.ndarray:
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (SR, 1, 2)
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")


def export(pg: Any, fmt: str, tmp_path: Path) -> zipfile.ZipFile:
    pg.select_option("#scriptFormat", fmt)
    with pg.expect_download(timeout=30_000) as info:
        pg.click("#scriptExport")
    path = tmp_path / f"export-{fmt}.zip"
    info.value.save_as(path)
    assert info.value.suggested_filename == "Browser-scene.zip"
    return zipfile.ZipFile(path)


def test_script_panel_renders_directs_accepts_and_exports(browser: Any, server: str, tmp_path: Path) -> None:
    context = browser.new_context(viewport={"width": 1440, "height": 960}, accept_downloads=True)
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    try:
        pg.goto(server + "/")
        pg.wait_for_function("window.studio && window.studio.connected && window.studio.session", timeout=15_000)
        # A voice for the cast: uploaded with the scene's own tool, listed in the cast table's pickers.
        voice_file = tmp_path / "anna.wav"
        voice_file.write_bytes(sine_wav(1.5, sr=24000))
        pg.set_input_files("#uploadFile", str(voice_file))
        pg.wait_for_function(
            "document.getElementById('uploadNote').textContent.startsWith('Voice ready')", timeout=15_000
        )
        ref_id = pg.locator("#voice").input_value()

        assert pg.locator("#scriptBody").is_hidden()
        pg.click("#scriptToggle")
        assert pg.locator("#scriptBody").is_visible() and pg.locator("#scriptJob").is_hidden()

        # --- faults: the line (or the cast row, or the JSON value) the service names is shown and selected.
        fill_script(pg, "@title Bad\nANNA: Good morning.\nBEN fine\n")
        refused = render_refused(pg)
        assert "line 3:" in refused and "BEN fine" in refused and "Show line 3 in the script" in refused
        assert selected_text(pg) == "BEN fine"
        assert "invalid" in (pg.get_attribute("#scriptText", "class") or "")
        shot(pg, "script-error-line", full_page=False)

        fill_script(pg, "@cast BEN voice=nobody_here\nANNA: Hello.\nBEN: Hi.\n")
        refused = render_refused(pg)
        assert "cast.BEN" in refused and "nobody_here" in refused
        assert pg.locator('#castTable .cast-row.invalid [aria-label="Voice of BEN"]').count() == 1

        bad_json = json.dumps(
            {"lines": [{"who": "ANNA", "text": "Hi."}, {"who": "BEN", "text": "Yo.", "seed": "seven"}]}, indent=1
        )
        script_file = tmp_path / "scene.json"  # opened from a file this time
        script_file.write_text(bad_json)
        pg.set_input_files("#scriptFile", str(script_file))
        pg.wait_for_function(
            f"document.getElementById('scriptCount').textContent.endsWith(' · {len(bad_json.encode())} bytes')"
        )
        assert pg.locator("#scriptText").input_value() == bad_json
        assert pg.locator("#castTable .cast-row").count() == 2
        refused = render_refused(pg)
        assert "lines[1].seed" in refused
        assert selected_text(pg) == '"seven"'
        fill_script(pg, '{"lines": [1, 2,, 3]}')
        assert "line 1, column 17" in render_refused(pg)
        assert pg.evaluate("window.studio.script") is None  # nothing was rendered

        # --- the script, its cast, the render: progress per line, every line done.
        fill_script(pg, SCRIPT)
        assert pg.locator("#castTable .cast-row").count() == 2
        pg.select_option('[aria-label="Voice of ANNA"]', ref_id)
        pg.fill('[aria-label="Language of ANNA"]', "English")
        pg.fill('[aria-label="Direction of BEN"]', "tired, low")
        assert pg.locator('[aria-label="Listen to the voice of ANNA"]').is_enabled()
        assert pg.locator('[aria-label="Listen to the voice of BEN"]').is_disabled()  # no reference to hear
        pg.click("#scriptRender")
        pg.wait_for_selector("#scriptJob:not([hidden])", timeout=10_000)
        assert pg.locator("#scriptError").is_hidden() and pg.locator("#scriptCompose").is_hidden()
        pg.wait_for_function(
            "[...document.querySelectorAll('#scriptLines .badge')].map((b) => b.textContent).join()"
            " === 'done,done,done'",
            timeout=30_000,
        )
        # The bar follows the progress events (each comes right after the line's).
        pg.wait_for_function("document.getElementById('scriptProgress').getAttribute('aria-valuenow') === '3'")
        assert pg.get_attribute("#scriptProgress", "aria-valuemax") == "3"
        assert pg.locator("#scriptTitle").inner_text() == "Browser scene"
        state = script_state(pg)
        assert state["state"] == "done" and state["session"] == pg.evaluate("window.studio.session")
        assert state["cast"]["ANNA"] == {"voice": ref_id, "instruction": "", "language": "English"}
        assert state["cast"]["BEN"]["instruction"] == "tired, low"
        assert [line["instruction"] for line in state["lines"]] == ["softly", "tired, low", ""]
        held = wait_lines_held(pg)  # the lines are takes of the session the studio is in
        assert [t["title"] for t in held] == ["Line 1 · ANNA", "Line 2 · BEN", "Line 3 · ANNA"]
        assert pg.locator("#scriptExport").is_enabled()

        # --- a line opens its take in the studio, and plays.
        pg.click('#scriptLines li[data-line="2"] .sline-open')
        assert pg.evaluate("window.studio.selected") == held[1]["key"]
        assert pg.get_attribute('#scriptLines li[data-line="2"]', "aria-current") == "true"
        assert "Line 2 · BEN" in pg.locator("#lineDetail").inner_text()
        pg.click('#scriptLines li[data-line="1"] button[aria-label="Play line 1"]')
        pg.wait_for_function(f"window.studio.playingTake === '{held[0]['key']}'", timeout=10_000)
        assert pg.evaluate("window.studio.selected") == held[0]["key"]
        wait_playback_drained(pg)

        # --- direct line 2 with the studio's retake tool, then accept the retake as the line's take.
        pg.click('#scriptLines li[data-line="2"] .sline-open')
        pg.evaluate("window.studio.setCursorFrame(4)")
        pg.click("#retakeOptsBtn")
        pg.select_option("#rtSeedMode", "fixed")
        pg.fill("#rtSeed", "77")
        count = len(takes(pg))
        pg.click("#retakeBtn")
        retake = wait_take_ended(pg, count + 1)
        wait_playback_drained(pg)
        assert retake["parent"] == held[1]["id"] and retake["seed"] == "77" and retake["spliceSample"] == 4 * FRAME
        accept = pg.get_by_role("button", name=f"Accept {retake['name']} as line 2", exact=True)
        assert "made from this line's take" in pg.locator("#lineDetail .ld-accept").inner_text()
        shot(pg, "script-accept", full_page=False)
        accept.click()
        pg.wait_for_function(f"window.studio.script.lines[1].take === '{retake['id']}'", timeout=10_000)
        assert script_state(pg)["lines"][1]["take"] == retake["id"]
        assert accept.count() == 0  # the editor shows the line's own take now
        pg.wait_for_function("window.studio.script.state === 'done'", timeout=10_000)
        pg.wait_for_function("!document.getElementById('scriptExport').disabled", timeout=10_000)

        # --- a line retaken from the panel: new words, a fixed seed; its new take joins the page.
        pg.click('#scriptLines li[data-line="3"] .sline-open')
        pg.click("text=Retake this line…")
        pg.fill("#slText", "Not a single wink.")
        pg.fill("#slSeed", BIG_SEED)  # past 2^53: it must stay exact all the way
        old_take = held[2]["id"]
        pg.click("#slRetake button:has-text('Retake line')")
        pg.wait_for_function(
            "(() => { const l = window.studio.script.lines[2];"
            f" return l.status === 'done' && l.take !== '{old_take}'; }})()",
            timeout=30_000,
        )
        pg.wait_for_function("window.studio.script.state === 'done'", timeout=10_000)
        held = wait_lines_held(pg)
        assert held[2]["seed"] == BIG_SEED and held[2]["request"]["text"] == "Not a single wink."
        assert pg.evaluate("window.studio.script.lines[2].seed") == BIG_SEED
        assert held[1]["id"] == retake["id"]
        # The editor showed line 3's old take: it follows the new one.
        pg.wait_for_function(f"window.studio.selected === '{held[2]['key']}'", timeout=10_000)

        # --- export: every line, the mix to the sample, cue sheets, captions.
        pg.wait_for_function("!document.getElementById('scriptExport').disabled", timeout=10_000)
        zf = export(pg, "wav", tmp_path)
        names = set(zf.namelist())
        assert {f + ".wav" for f in LINE_FILES} | {"mix.wav", "cues.csv", "cues.json", "script.json",
                                                  "captions/lines.srt", "captions/lines.vtt"} <= names  # fmt: skip
        assert not {n for n in names if n.startswith("lines/")} - {f + ".wav" for f in LINE_FILES}
        lines = [wav_samples(zf.read(f + ".wav")) for f in LINE_FILES]
        for line, take in zip(lines, held, strict=True):
            assert len(line) == take["samples"]
            assert line.tolist() == held_audio(pg, take["key"])[:, 0].tolist()
        mix = wav_samples(zf.read("mix.wav"))
        silence = lambda n: np.zeros(n, dtype="<i2")  # noqa: E731
        expected = np.concatenate([lines[0], silence(GAP), lines[1], silence(GAP + PAUSE), lines[2]])
        assert len(mix) == len(expected) and np.array_equal(mix, expected)
        cues = json.loads(zf.read("cues.json"))
        assert [c["take"] for c in cues["lines"]] == [t["id"] for t in held]
        assert cues["lines"][2]["seed"] == int(BIG_SEED)
        assert "BEN: Morning. Did you sleep?" in zf.read("captions/lines.srt").decode()
        flac = export(pg, "flac", tmp_path)
        assert {f + ".flac" for f in LINE_FILES} | {"mix.flac"} <= set(flac.namelist())

        # --- desktop accessibility with the panel in use (the compose form open beside the script).
        pg.click("#scriptNew")
        assert pg.locator("#scriptCompose").is_visible() and pg.locator("#scriptJob").is_visible()
        assert not (found := axe_violations(pg)), describe(found)
        shot(pg, "script-desktop")

        # --- after a reload: the session's script is listed and opened again, its lines playable.
        pg.reload()
        pg.wait_for_function("window.studio && window.studio.connected && window.studio.session", timeout=15_000)
        pg.wait_for_function("window.studio.script && window.studio.script.state === 'done'", timeout=15_000)
        assert pg.locator("#scriptBody").is_visible()  # the panel stays open
        options = pg.locator("#scriptList option").all_inner_texts()
        assert len(options) == 1 and options[0].startswith("Browser scene · 3 lines · done")
        pg.wait_for_function("document.querySelectorAll('#scriptLines .badge').length === 3", timeout=10_000)
        assert pg.evaluate("window.studio.script.lines[1].take") == retake["id"]
        held_again = wait_lines_held(pg)
        assert [t["id"] for t in held_again] == [t["id"] for t in held]

        # --- the phone layout: the same director (cookies, storage) on a 390×844 touch screen.
        phone = browser.new_context(viewport={"width": 390, "height": 844}, device_scale_factor=2, is_mobile=True,
                                    has_touch=True, storage_state=context.storage_state())  # fmt: skip
        try:
            ph = phone.new_page()
            ph.on("pageerror", lambda e: errors.append("phone: " + str(e)))
            ph.goto(server + "/")
            ph.wait_for_function("window.studio && window.studio.connected && window.studio.session", timeout=15_000)
            ph.wait_for_function("window.studio.script && window.studio.script.state === 'done'", timeout=15_000)
            assert ph.evaluate("window.studio.session") == pg.evaluate("window.studio.session")
            ph.wait_for_function("document.querySelectorAll('#scriptLines .badge').length === 3", timeout=10_000)
            ph.locator('#scriptLines li[data-line="2"] .sline-open').scroll_into_view_if_needed()
            ph.locator('#scriptLines li[data-line="2"] .sline-open').tap()
            ph.wait_for_function(
                f"window.studio.take('{retake['id']}')"
                f" && window.studio.selected === window.studio.take('{retake['id']}').key",
                timeout=15_000,
            )
            assert ph.evaluate("document.documentElement.scrollWidth") <= 390  # nothing sticks out sideways
            for sel in (
                "#scriptExport",
                "#scriptFormat",
                "#scriptDelete",
                "#lineDetail",
                "#scriptLines",
                "#scriptToggle",
            ):
                box = ph.locator(sel).bounding_box()
                assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= 390, sel
            transport = ph.locator("#transport").bounding_box()
            ph.locator("#scriptExport").scroll_into_view_if_needed()
            export_box = ph.locator("#scriptExport").bounding_box()
            assert export_box["y"] + export_box["height"] <= transport["y"]  # not under the fixed transport bar
            ph.locator('#scriptLines li[data-line="2"]').scroll_into_view_if_needed()
            shot(ph, "script-phone", full_page=False)
            ph.locator("#scriptNew").tap()  # the compose form and its cast table fit too
            ph.wait_for_selector('#castTable [aria-label="Direction of BEN"]', timeout=5_000)
            # The script being written and its cast table were kept in this browser's storage.
            assert ph.locator('[aria-label="Language of ANNA"]').input_value() == "English"
            assert ph.locator('[aria-label="Direction of BEN"]').input_value() == "tired, low"
            assert ph.evaluate("document.documentElement.scrollWidth") <= 390
            box = ph.locator('#castTable [aria-label="Direction of BEN"]').bounding_box()
            assert box is not None and box["x"] + box["width"] <= 390 and box["width"] >= 200  # a usable width
            ph.locator("#castTable").scroll_into_view_if_needed()
            shot(ph, "script-phone-compose", full_page=False)
            ph.locator("#scriptToggle").tap()  # closed, the panel is one line that fits too
            assert ph.locator("#scriptBody").is_hidden()
            assert ph.evaluate("document.documentElement.scrollWidth") <= 390
            ph.locator("#scriptToggle").tap()
            assert not (found := axe_violations(ph)), describe(found)
        finally:
            phone.close()
    finally:
        shot(pg, "script-final")
        context.close()
    assert not errors, f"uncaught page errors: {errors}"


def test_script_panel_under_an_api_key(browser: Any, tmp_path: Path) -> None:
    """Under an API key every script route is the key's: the page posts and exports with its Bearer token and
    follows the render's events with ?token= (an EventSource sends no header)."""
    with run_server(tmp_path, "--api-key", "script-key") as url:
        context = browser.new_context(viewport={"width": 1280, "height": 900}, accept_downloads=True)
        pg = context.new_page()
        try:
            pg.goto(url + "/")
            pg.wait_for_selector("#keyDialog[open]", timeout=10_000)
            pg.fill("#apiKey", "script-key")
            pg.click("#keySubmit")
            pg.wait_for_function("window.studio && window.studio.connected && window.studio.session", timeout=15_000)
            pg.click("#scriptToggle")
            fill_script(pg, "@title Keyed\nANNA: One line.\nBEN: And another.\n")
            pg.click("#scriptRender")
            pg.wait_for_function("window.studio.script && window.studio.script.state === 'done'", timeout=30_000)
            # The progress came through the first stream opened (with its token), not by asking again after a 401.
            assert pg.evaluate("window.studio.stats.streamOpens") == 1
            assert pg.evaluate("window.studio.stats.scriptEvents") >= 3
            held = wait_lines_held(pg)
            with pg.expect_download(timeout=30_000) as info:
                pg.click("#scriptExport")
            path = tmp_path / "keyed.zip"
            info.value.save_as(path)
            names = zipfile.ZipFile(path).namelist()
            assert {"mix.wav", "lines/001-ANNA.wav", "lines/002-BEN.wav"} <= set(names)
            assert [t["title"] for t in held] == ["Line 1 · ANNA", "Line 2 · BEN"]
        finally:
            context.close()
