"""End-to-end: the directing studio (static/index.html) in headless Chromium against a real server.

The server is ``python -m moss_rt serve --engine scripted`` in a subprocess on a free port of
127.0.0.1. The scripted engine's audio encodes where it came from: in stereo, every left sample of
frame ``i`` is ``i + 1`` and every right sample is ``-(seed % 1024 + 1)``, so a splice can be
checked to the sample. The page exposes read-only counters as ``window.studio`` (samples received
over the socket, samples the AudioWorklet played, underruns after the jitter cushion, ...).

Needs: the ``playwright`` Python package (requirements-dev.txt) and Debian's ``chromium`` at
/usr/bin/chromium (``apt-get install -y chromium``; ``make test`` does it). Playwright's own browser
download is never used. Without either the tests skip with the reason; with both they must pass.
Screenshots land in artifacts/screenshots/.
"""

from __future__ import annotations

import io
import time
import urllib.request
import wave
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.browser.helpers import (
    FRAME,
    SR,
    held_audio,
    http_json,
    place_playhead_with_the_mouse,
    retake_whispering,
    run_server,
    seed_marker,
    set_fixed_seed,
    set_param,
    shot,
    speak_and_finish,
    stats,
    takes,
    wait_playback_drained,
    wait_take_ended,
)
from tests.conftest import sine_wav

pytestmark = pytest.mark.browser

@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with run_server(tmp_path_factory.mktemp("studio")) as url:
        yield url



# --------------------------------------------------------------------------- tests


def test_speak_streams_and_plays_through_the_worklet(page: Any) -> None:
    pg = page
    hello = pg.evaluate("window.studio.hello")
    assert hello["protocol"] == 1 and hello["sr"] == SR and hello["frame_samples"] == FRAME
    assert pg.locator("#demoBanner").is_visible(), "hello says demo: the banner must show"
    assert pg.locator("#audio_temperature").input_value() == "1.7"
    assert pg.locator("#chunk_frames").input_value() == "0.64"  # 8 frames, asked in seconds

    # Direction through the helper: GENERAL/SCRIPT layout and a delivery cue.
    pg.click("#instruction")
    pg.click("#layoutBtn")
    pg.keyboard.type("a calm narrator, close to the microphone")
    pg.click("#cueBar >> text=(a soft laugh)")
    instruction = pg.locator("#instruction").input_value()
    assert instruction.startswith("GENERAL: a calm narrator") and "\nSCRIPT:" in instruction
    assert "(a soft laugh)" in instruction

    set_param(pg, "tokens", "60")  # 4.8 s of audio, generated in 1.2 s
    pg.fill("#text", "Testing the studio: the first frames should play while the rest is still being made.")
    pg.focus("#text")
    pg.keyboard.press("Control+Enter")  # the shortcut, not the button

    # Playback starts while the take is still streaming (first frames, not the whole take).
    status_when_playing = pg.wait_for_function(
        "window.studio.stats.samplesPlayed > 0 && window.studio.takes()[0].status", timeout=10_000
    ).json_value()
    assert status_when_playing == "streaming"
    shot(pg, "studio-streaming", full_page=False)

    take = wait_take_ended(pg, 1)
    wait_playback_drained(pg)
    st = stats(pg)
    assert take["end"]["reason"] == "done"
    assert take["end"]["n_frames"] == 60
    assert take["samples"] == 60 * FRAME
    assert st["samplesReceived"] == 60 * FRAME
    assert take["ttfaMs"] is not None and take["ttfaMs"] < 5000
    assert take["heardMs"] is not None and take["heardMs"] >= take["ttfaMs"]
    assert take["seed"] and take["seed"].isdigit()
    assert take["request"]["instruction"] == instruction
    # The worklet played everything it was given, without starving after the cushion.
    assert st["audioMode"] == "worklet"
    assert st["samplesPlayed"] >= 60 * FRAME
    assert st["underruns"] == 0
    assert st["streamsDrained"] == 1
    # The take is in the history with its seed and the live numbers are shown.
    card = pg.locator("article.take").first
    assert take["seed"] in card.inner_text()
    assert pg.locator("#mFrames").inner_text() == "4.80 s"  # 60 frames
    assert pg.locator("#mSeed").inner_text() == take["seed"]
    shot(pg, "studio-after-take")


def test_cancel_stops_audio_at_once(page: Any) -> None:
    pg = page
    set_param(pg, "tokens", "600")  # 48 s of audio: far longer than the test waits
    pg.click("#speak")
    pg.wait_for_function(f"window.studio.stats.samplesPlayed > {SR // 2}", timeout=15_000)
    assert pg.evaluate("window.studio.busy")
    played_at_cancel = pg.evaluate(
        "(() => { document.getElementById('cancel').click(); return window.studio.stats.samplesPlayed; })()"
    )
    take = wait_take_ended(pg, 1)
    assert take["end"]["reason"] == "cancelled"
    time.sleep(0.5)
    st = stats(pg)
    # Audio stops within a render quantum plus one player report (~21 ms); allow 100 ms.
    assert st["samplesPlayed"] - played_at_cancel < SR // 10, (played_at_cancel, st["samplesPlayed"])
    assert not pg.evaluate("window.studio.playing")
    assert not pg.evaluate("window.studio.busy")
    assert take["end"]["n_frames"] < 600
    assert pg.locator("#speak").is_enabled()
    assert "cancelled" in pg.locator("article.take").first.inner_text().lower()

    # Cancel in the same instant as Speak: nothing is heard, and the page is not left waiting.
    played = stats(pg)["samplesPlayed"]
    pg.evaluate("document.getElementById('speak').click(); document.getElementById('cancel').click();")
    pg.wait_for_function("!window.studio.busy", timeout=10_000)
    time.sleep(0.3)
    assert stats(pg)["samplesPlayed"] == played
    assert not pg.evaluate("window.studio.playing")


def test_cushion_above_two_seconds_still_plays_while_streaming(page: Any) -> None:
    """A jitter cushion of more than the 2 s the page normally feeds ahead (set by the director, or grown by
    underruns up to 3 s) is still filled: playback starts mid-take, not only once the take has ended."""
    pg = page
    set_param(pg, "cushion_ms", "2500")
    set_param(pg, "tokens", "300")  # 24 s of audio, generated in 6 s
    pg.click("#speak")
    status_when_playing = pg.wait_for_function(
        "window.studio.stats.samplesPlayed > 0 && window.studio.takes()[0].status", timeout=15_000
    ).json_value()
    assert status_when_playing == "streaming"
    assert stats(pg)["cushion"] == 2500 * SR // 1000
    pg.click("#cancel")
    assert wait_take_ended(pg, 1)["end"]["reason"] == "cancelled"


def test_retake_from_a_point_splices_at_the_acknowledged_sample(page: Any) -> None:
    pg = page
    set_param(pg, "channels", "2")  # stereo: left = frame index + 1, right = seed marker
    set_fixed_seed(pg, 7)
    first = speak_and_finish(pg, 1, frames=40)
    assert first["channels"] == 2 and first["seed"] == "7"
    left = held_audio(pg, first["key"], 0, 40 * FRAME)[:, 0]
    assert left[::FRAME].tolist() == list(range(1, 41))

    frame = place_playhead_with_the_mouse(pg, 0.6)
    assert 10 < frame < 39
    retake_whispering(pg, seed=99)
    second = wait_take_ended(pg, 2)
    wait_playback_drained(pg)

    ack = stats(pg)["lastSeek"]
    assert ack["from_take"] == first["id"] and ack["take"] == second["id"] != first["id"]
    assert ack["frame"] == frame and ack["sample"] == frame * FRAME
    splice = ack["sample"]
    assert second["parent"] == first["id"]
    assert second["spliceSample"] == splice
    assert second["seed"] == "99"
    assert second["request"]["instruction"].startswith("GENERAL: the same voice, now whispering")
    assert second["end"]["reason"] == "done"
    assert second["samples"] == second["end"]["n_frames"] * FRAME
    assert second["end"]["new_frames"] == second["end"]["n_frames"] - frame

    # Before the splice: the first take's samples, bit for bit (both channels).
    same_prefix = pg.evaluate(
        """([a, b, n]) => [0, 1].every((c) => {
            const x = window.studio.samples(a, 0, n, c), y = window.studio.samples(b, 0, n, c);
            return x.length === n && y.length === n && x.every((v, i) => v === y[i]);
        })""",
        [first["key"], second["key"], splice],
    )
    assert same_prefix
    # At the splice, exactly: the frame counter continues, the seed marker changes.
    around_l = pg.evaluate(f"window.studio.samples('{second['key']}', {splice - 1}, {splice + 1}, 0)")
    around_r = pg.evaluate(f"window.studio.samples('{second['key']}', {splice - 1}, {splice + 1}, 1)")
    assert around_l == [frame, frame + 1]
    assert around_r == [seed_marker(7), seed_marker(99)]
    tail_r = held_audio(pg, second["key"], splice, second["samples"])[:, 1]
    assert set(tail_r.tolist()) == {seed_marker(99)}
    st = stats(pg)
    assert st["underruns"] == 0
    assert "from Take 1" in pg.locator("article.take").first.inner_text()
    shot(pg, "studio-retake")

    # Replay from a point: the service re-sends the stored audio; it matches what the page holds.
    pg.evaluate("window.studio.setCursorFrame(5)")
    pg.click("#replayBtn")
    pg.wait_for_function(
        f"window.studio.stats.lastSeek && window.studio.stats.lastSeek.take === '{second['id']}'"
        f" && window.studio.stats.lastSeek.from_take === '{second['id']}'",
        timeout=10_000,
    )
    replay_ack = stats(pg)["lastSeek"]
    assert replay_ack["frame"] == 5 and replay_ack["sample"] == 5 * FRAME
    wait_playback_drained(pg)
    st = stats(pg)
    assert st["replayMismatches"] == 0
    assert st["underruns"] == 0

    # A/B: compare the two takes, switch at the playhead.
    # Each card's buttons are named with their take.
    pg.get_by_role("button", name="Compare Take 1 as A", exact=True).click()
    pg.get_by_role("button", name="Compare Take 2 as B", exact=True).click()
    assert pg.locator("#compare").is_visible()
    pg.click("#abPlayA")
    pg.wait_for_function(f"window.studio.playingTake === '{first['key']}'", timeout=5_000)
    pg.wait_for_function("window.studio.playhead > 24000", timeout=5_000)
    pg.click("#abSwitch")
    pg.wait_for_function(f"window.studio.playingTake === '{second['key']}'", timeout=5_000)
    assert pg.evaluate("window.studio.playhead") >= 24000  # kept the position, did not restart
    shot(pg, "studio-ab")
    pg.keyboard.press("Escape")
    pg.wait_for_function("!window.studio.playing", timeout=5_000)

    # Continue a take from its very end (seek to N = n_frames) with a new line of text.
    pg.evaluate(f"window.studio.select('{first['key']}')")
    assert pg.evaluate("window.studio.setCursorFrame(100000)") == 40 * FRAME
    assert pg.locator("#retakeBtn").inner_text() == "Continue from the end"
    assert pg.locator("#replayBtn").is_disabled()
    pg.fill("#rtInstruction", "")
    pg.fill("#rtText", "And then, the next line.")
    pg.click("#retakeBtn")
    third = wait_take_ended(pg, 3)
    wait_playback_drained(pg)
    assert third["parent"] == first["id"] and third["spliceSample"] == 40 * FRAME
    assert third["request"]["text"] == "And then, the next line."
    assert pg.evaluate(f"window.studio.samples('{third['key']}', {40 * FRAME - 1}, {40 * FRAME + 1}, 0)") == [40, 41]


def test_upload_reference_then_speak_with_it(page: Any, server: str, tmp_path: Path) -> None:
    pg = page
    path = tmp_path / "my voice.wav"
    path.write_bytes(sine_wav(1.5, sr=24000))  # a 220 Hz tone, 16-bit WAV
    pg.set_input_files("#uploadFile", str(path))
    pg.wait_for_function("document.getElementById('uploadNote').textContent.startsWith('Voice ready')", timeout=15_000)
    ref_id = pg.locator("#voice").input_value()
    assert ref_id.startswith("ref_")
    listed = {v["id"]: v for v in http_json(server + "/api/voices")["voices"]}
    assert ref_id in listed and listed[ref_id]["kind"] == "uploaded"
    assert abs(listed[ref_id]["duration"] - 1.5) < 0.05

    take = speak_and_finish(pg, 1, frames=12)
    assert take["request"]["reference"] == ref_id
    assert take["end"]["reason"] == "done"
    assert "voice my voice" in pg.locator("article.take").first.inner_text()

    # A file the service cannot use is refused with a clear message, and nothing breaks.
    bad = tmp_path / "notes.txt"
    bad.write_text("not audio")
    pg.set_input_files("#uploadFile", str(bad))
    pg.wait_for_function("document.getElementById('uploadNote').textContent.includes('wav, flac, mp3 or ogg')")
    fake = tmp_path / "fake.wav"
    fake.write_bytes(b"RIFF0000WAVEnot really")
    pg.set_input_files("#uploadFile", str(fake))
    pg.wait_for_function(
        "document.getElementById('uploadNote').textContent.startsWith('Upload failed')", timeout=10_000
    )
    assert pg.evaluate("window.studio.connected")


def test_record_reference_from_the_microphone(page: Any, server: str) -> None:
    pg = page
    pg.click("#recordBtn")
    pg.wait_for_function("document.getElementById('recTime').textContent >= '0:01.2'", timeout=10_000)
    pg.click("#recordBtn")
    pg.wait_for_selector("#recUse:not([disabled])", state="visible", timeout=10_000)
    before = {v["id"] for v in http_json(server + "/api/voices")["voices"]}
    pg.click("#recUse")
    pg.wait_for_function("document.getElementById('uploadNote').textContent.startsWith('Voice ready')", timeout=15_000)
    ref_id = pg.locator("#voice").input_value()
    after = {v["id"]: v for v in http_json(server + "/api/voices")["voices"]}
    assert ref_id in after and ref_id not in before
    assert after[ref_id]["duration"] >= 1.0


def test_download_take_as_wav(page: Any, server: str, tmp_path: Path) -> None:
    pg = page
    set_fixed_seed(pg, 3)
    take = speak_and_finish(pg, 1, frames=20)
    card = pg.locator("article.take").first
    with pg.expect_download() as info:
        card.get_by_role("button", name="Download Take 1 as WAV", exact=False).click()
    local = tmp_path / "client.wav"
    info.value.save_as(local)
    with wave.open(str(local)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (SR, 1, 2)
        assert w.getnframes() == take["samples"] == 20 * FRAME
        client_pcm = w.readframes(w.getnframes())
    # Named by the session and the take's name (issue 27): moss_rt-<session>-take-1.wav.
    session = pg.evaluate("window.studio.session")
    assert info.value.suggested_filename == f"moss_rt-{session[2:10]}-take-1.wav"

    # One WAV button: the service's own rendering (GET /api/takes/{id}.wav) is the same audio, so no other.
    assert card.get_by_role("link", name="as rendered", exact=False).count() == 0 or not card.locator("a").is_visible()
    with urllib.request.urlopen(f"{server}/api/takes/{take['id']}.wav", timeout=10) as r:
        with wave.open(io.BytesIO(r.read())) as w:
            assert w.readframes(w.getnframes()) == client_pcm


def test_errors_and_reconnect(page: Any) -> None:
    pg = page
    # Empty text is caught before sending.
    pg.fill("#text", "   ")
    pg.click("#speak")
    assert pg.locator("#text").evaluate("n => n.classList.contains('invalid')")
    assert not pg.evaluate("window.studio.busy")

    # A server-side refusal (unknown voice) shows the tag-0 error code and leaves the page usable.
    pg.fill("#text", "Hello there.")
    pg.evaluate(
        """() => { const s = document.getElementById('voice');
                   s.append(new Option('ghost', 'ref_000000000000000000000000'));
                   s.value = 'ref_000000000000000000000000'; }"""
    )
    pg.click("#speak")
    pg.wait_for_selector("#alert", state="visible", timeout=10_000)
    assert pg.locator("#alertCode").inner_text() == "not_found"
    pg.wait_for_function("!window.studio.busy", timeout=5_000)
    assert pg.locator("#voice").evaluate("n => n.classList.contains('invalid')")
    shot(pg, "studio-error")

    # A finished take, then a dropped socket: the page reconnects by itself.
    pg.select_option("#voice", "none")
    take = speak_and_finish(pg, 1, frames=10)
    serial = pg.evaluate("window.studio.connectionSerial")
    state_when_down = pg.evaluate(
        "window.studio.disconnect(), new Promise((ok) => { const t = setInterval(() => { if (!window.studio.connected)"
        " { clearInterval(t); ok(document.getElementById('conn').dataset.state); } }, 5); })"
    )
    assert state_when_down in ("reconnecting", "connecting", "closed")
    pg.wait_for_function(f"window.studio.connected && window.studio.connectionSerial > {serial}", timeout=15_000)
    assert pg.locator("#conn").get_attribute("data-state") == "open"
    assert stats(pg)["reconnects"] >= 1
    # The page resumes its directing session on the new connection: the old take is playable and the
    # service holds it again, so it can be retaken.
    pg.wait_for_function("window.studio.session !== null", timeout=10_000)
    pg.evaluate(f"window.studio.select('{take['key']}')")
    assert pg.locator("#edPlay").is_enabled()
    pg.wait_for_function("!document.getElementById('retakeBtn').disabled", timeout=10_000)
    take2 = speak_and_finish(pg, 2, frames=10)
    assert take2["end"]["reason"] == "done"


def test_phone_layout(browser: Any, server: str) -> None:
    context = browser.new_context(
        viewport={"width": 390, "height": 844}, device_scale_factor=2, is_mobile=True, has_touch=True
    )
    pg = context.new_page()
    try:
        pg.goto(server + "/")
        pg.wait_for_function("window.studio && window.studio.connected", timeout=15_000)
        assert pg.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1"), "horizontal overflow"
        speak = pg.locator("#speak").bounding_box()
        assert speak is not None and speak["y"] + speak["height"] <= 844, "Speak must be reachable without scrolling"
        pg.locator("#speak").tap()
        pg.wait_for_function(
            "window.studio.takes().length === 1 && window.studio.takes()[0].end !== null", timeout=30_000
        )
        assert pg.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")
        shot(pg, "studio-phone", full_page=False)
        pg.keyboard.press("Escape")
    finally:
        context.close()


def test_api_key_prompt_token_and_downloads(browser: Any, tmp_path: Path) -> None:
    """With --api-key the page asks for the key, trades it for a token and uses it everywhere."""
    with run_server(tmp_path, "--api-key", "studio-test-key") as url:
        context = browser.new_context(viewport={"width": 1280, "height": 900}, accept_downloads=True)
        pg = context.new_page()
        try:
            pg.goto(url + "/")
            pg.wait_for_selector("#keyDialog[open]", timeout=10_000)
            assert pg.locator("#conn").get_attribute("data-state") == "closed"
            shot(pg, "studio-api-key", full_page=False)
            pg.fill("#apiKey", "wrong-key")
            pg.click("#keySubmit")
            pg.wait_for_function(
                "document.getElementById('keyDialog').open && !document.getElementById('keyError').hidden",
                timeout=10_000,
            )
            assert "not accepted" in pg.locator("#keyError").inner_text()
            pg.fill("#apiKey", "studio-test-key")
            pg.click("#keySubmit")
            pg.wait_for_function("window.studio && window.studio.connected", timeout=15_000)
            assert pg.locator("#voice").input_value() == "none"  # /api/voices answered with the token
            take = speak_and_finish(pg, 1, frames=10)
            assert take["end"]["reason"] == "done"
            # Links to the service carry the token (the session's archive here).
            link = pg.locator("#sessionExport")
            assert "token=" in (link.get_attribute("href") or "")
            with pg.expect_download() as info:
                link.click()
            saved = tmp_path / "session.zip"
            info.value.save_as(saved)
            with zipfile.ZipFile(saved) as z:
                with wave.open(io.BytesIO(z.read(f"takes/{take['id']}.wav"))) as w:
                    assert w.getnframes() == 10 * FRAME
        finally:
            context.close()


def test_speak_again_replaces_the_running_take(page: Any) -> None:
    """Barge-in: a new Speak while a take streams replaces it; requests map to their own takes."""
    pg = page
    set_param(pg, "tokens", "400")
    pg.fill("#text", "The first line, which will be interrupted.")
    pg.click("#speak")
    pg.wait_for_function(f"window.studio.stats.samplesPlayed > {SR // 4}", timeout=15_000)
    set_param(pg, "tokens", "15")
    pg.fill("#text", "The second line.")
    pg.click("#speak")
    second = wait_take_ended(pg, 2)
    wait_playback_drained(pg)
    first = takes(pg)[0]
    assert first["end"]["reason"] == "replaced"
    assert first["request"]["text"] == "The first line, which will be interrupted."
    assert second["request"]["text"] == "The second line."
    assert second["end"]["reason"] == "done" and second["samples"] == 15 * FRAME

    # Two starts in the same instant: the last one wins and carries its own direction.
    pg.evaluate(
        """() => {
            const t = document.getElementById('text'), b = document.getElementById('speak');
            t.value = 'Quick one.'; b.click(); t.value = 'Quick two.'; b.click();
        }"""
    )
    pg.wait_for_function(
        "!window.studio.busy && window.studio.takes().at(-1).request.text === 'Quick two.'"
        " && window.studio.takes().at(-1).end !== null",
        timeout=20_000,
    )
    wait_playback_drained(pg)
    last = takes(pg)[-1]
    assert last["end"]["reason"] == "done"
    assert [t["name"] for t in takes(pg)] == [f"Take {i + 1}" for i in range(len(takes(pg)))]
    for t in takes(pg):
        if t["request"]["text"] == "Quick one.":
            assert t["end"]["reason"] == "replaced"


def test_a_take_discarded_before_it_ended_on_its_own_leaves_the_page_too(browser: Any, server: str) -> None:
    """Two Speaks in the same instant, the first short enough to end on its own before the second start reaches the
    service (held here in the socket until it has): the session was told to discard it while it ran and does not keep
    it, so the page drops it too (it showed it beside the next take, both numbered as the next one)."""
    import json

    context = browser.new_context(viewport={"width": 1440, "height": 960})
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    held: list[str] = []
    sockets: list[Any] = []

    def route(ws: Any) -> None:
        service = ws.connect_to_server()
        sockets.append(service)

        def from_page(message: str | bytes) -> None:
            if isinstance(message, str) and json.loads(message).get("text") == "The second one.":
                held.append(message)  # sent on below, once the first take has ended at the service
            else:
                service.send(message)

        ws.on_message(from_page)

    try:
        pg.route_web_socket("**/api/ws", route)
        pg.goto(server + "/")
        pg.wait_for_function("window.studio && window.studio.connected && window.studio.session", timeout=15_000)
        set_param(pg, "tokens", "10")  # 0.2 s at the scripted engine's pace: the discard comes while it runs
        pg.evaluate(
            """() => {
                const t = document.getElementById('text'), b = document.getElementById('speak');
                t.value = 'The first one.'; b.click(); t.value = 'The second one.'; b.click();
            }"""
        )
        pg.wait_for_function("window.studio.stats.takesEnded >= 1", timeout=15_000)
        assert len(held) == 1
        # It ended on its own ("done", not replaced), after the session was told to discard it: the page drops it.
        assert pg.evaluate("window.studio.stats.lastEnd.reason") == "done"
        pg.wait_for_function("window.studio.takes().every((t) => t.request.text !== 'The first one.')", timeout=5_000)
        sockets[-1].send(held.pop())
        listed = pg.wait_for_function(
            "(() => { const t = window.studio.takes(); return t.some((x) => x.end && x.numbered) ? t : null; })()",
            timeout=15_000,
        ).json_value()
        assert len(listed) == 1, listed
        second = listed[0]
        assert (second["request"] or {}).get("text") == "The second one.", listed
        assert second["end"]["reason"] == "done", listed
        assert second["name"] == f"Take {second['number']}" == "Take 1"
        assert pg.evaluate("window.studio.stats.errors") == []  # the discard was no refusal
        assert not errors, errors
    finally:
        context.close()


def test_limit_error_shows_and_retry_works(browser: Any, tmp_path: Path) -> None:
    """A refused take (one take per client at a time) is shown with its code and can be retried."""
    with run_server(tmp_path, "--max-takes-per-client", "1") as url:
        context = browser.new_context(viewport={"width": 1280, "height": 860})
        first, second = context.new_page(), context.new_page()
        try:
            for pg in (first, second):
                pg.goto(url + "/")
                pg.wait_for_function("window.studio && window.studio.connected", timeout=15_000)
            set_param(first, "tokens", "500")
            first.click("#speak")
            first.wait_for_function("window.studio.stats.samplesReceived > 0", timeout=10_000)
            set_param(second, "tokens", "10")
            second.click("#speak")
            second.wait_for_selector("#alert", state="visible", timeout=10_000)
            assert second.locator("#alertCode").inner_text() == "rate_limited"
            assert second.locator("#alertRetry").is_visible()
            second.wait_for_function("!window.studio.busy", timeout=5_000)
            assert takes(second) == []
            shot(second, "studio-limit")
            first.click("#cancel")
            first.wait_for_function("!window.studio.busy", timeout=10_000)
            second.click("#alertRetry")
            take = wait_take_ended(second, 1)
            assert take["end"]["reason"] == "done"
            assert second.locator("#alert").is_hidden()
        finally:
            context.close()
