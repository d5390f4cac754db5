"""End-to-end: the directing studio in headless Chromium against the real engine on the tiny model.

The server is ``python -m moss_rt serve --engine moss --model tiny --codec tiny --device cpu`` in a subprocess
on 127.0.0.1: the real scheduler, model runner and streaming codec, with the tiny random-weight model and
codec that moss_rt writes itself (its audio is noise, everything else is real; the service says DEMO).
test_studio.py runs the same journey on the scripted engine, whose audio encodes the frame index, for the
checks to the sample; here the checks are what a director observes on the real engine: the demo banner, audio
that arrives and plays through the AudioWorklet, cancel, a retake spliced where the service acknowledged it,
an uploaded voice, a downloaded take.

Takes are short and their lengths exact: with text temperature 0 (greedy) the tiny model's stop head never
fires, so a take runs to ``max_new_tokens`` frames (end reason ``max_frames``). CI runs this on a slow, shared
2-core CPU: the waits are generous and nothing asserts how fast the model is. Screenshots land in
artifacts/screenshots/ (tiny-*.png and the per-test final ones). Skips like test_studio.py without Chromium.
"""

from __future__ import annotations

import io
import time
import urllib.request
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.browser.helpers import (
    FRAME,
    SR,
    TINY_MODEL_ENGINE,
    held_audio,
    http_json,
    place_playhead_with_the_mouse,
    retake_whispering,
    run_server,
    set_fixed_seed,
    set_param,
    shot,
    stats,
    takes,
    wait_playback_drained,
    wait_take_ended,
)
from tests.conftest import sine_wav

pytestmark = pytest.mark.browser

WAIT_MS = 60_000  # generous: the CI box is slow and shared; no assertion is about speed
# The studio's "Jitter cushion" (Player settings), raised from its 200 ms default as a director on a slow box
# would: the CPU model shares 2 cores with Chromium and maybe another test run, and PCM comes in chunks of
# 8 frames (0.64 s). With the default, a busy box underran now and then; playback still starts mid-take.
CUSHION_MS = 1000
# A stream whose audio fell this close to the cushion behind real time may starve the player (its render quantum, the
# feed's timer): assert_no_underrun counts that as the machine's doing.
LAG_SLACK_MS = 100


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # The first start writes the tiny model and codec into the data dir, then loads them.
    with run_server(tmp_path_factory.mktemp("studio-tiny"), engine=TINY_MODEL_ENGINE, ready_timeout=180) as url:
        yield url


def direct_frames(pg: Any, frames: int) -> None:
    """A take of exactly ``frames`` frames: greedy text (the stop never fires) capped by max_new_tokens."""
    set_param(pg, "cushion_ms", str(CUSHION_MS))
    set_param(pg, "text_temperature", "0")
    set_param(pg, "max_new_tokens", str(frames))
    set_param(pg, "tokens", str(frames))


def speak_frames(pg: Any, count: int, frames: int) -> dict[str, Any]:
    direct_frames(pg, frames)
    pg.click("#speak")
    take = wait_take_ended(pg, count, timeout=WAIT_MS)
    wait_playback_drained(pg, timeout=WAIT_MS)
    return take


def held_pcm(pg: Any, key: str, channel: int = 0) -> np.ndarray:
    """Channel ``channel`` of the samples the page holds for a take (int16 values)."""
    return held_audio(pg, key)[:, channel]


def service_wav(server: str, take_id: str) -> tuple[Any, np.ndarray]:
    """The service's own rendering of a take (GET /api/takes/{id}.wav): parameters and samples."""
    with urllib.request.urlopen(f"{server}/api/takes/{take_id}.wav", timeout=30) as r:
        with wave.open(io.BytesIO(r.read())) as w:
            return w.getparams(), np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.int32)


def assert_no_underrun(pg: Any, take: dict[str, Any]) -> None:
    """Playback never starved once the cushion was buffered (with what to look at when it did).

    Only a promise while the audio comes at least as fast as it plays: on a loaded 2-core runner the tiny model
    on the CPU can fall below real time for a while (its ``rtf`` says so over the whole take; the page's ``lagMs``,
    the longest its audio fell behind real time over any stretch, the page's own stalls included, says so of any
    moment: a player whose cushion is at least that never starves), and then starving is the machine's doing."""
    st = stats(pg)
    rtf = take["end"].get("rtf")
    lag = take.get("lagMs")
    assert lag is not None and lag >= 0, take  # the page measures every streamed take
    slow = (rtf is not None and rtf < 1.5) or lag > CUSHION_MS - LAG_SLACK_MS
    if st["underruns"] and slow:
        return
    assert st["underruns"] == 0, {"end": take["end"], "ttfaMs": take["ttfaMs"], "heardMs": take["heardMs"],
                                  "lagMs": lag, **st}


def assert_same_audio(held: np.ndarray, rendered: np.ndarray) -> None:
    """The audio the page holds is the service's rendering of the take, sample for sample.

    The service renders a take from its codes in one pass; the page got it decoded frame by frame as it
    streamed. On the real codec the two may differ by float rounding (1 LSB at a few samples in ten
    thousand); anything misplaced, even by one sample, differs by thousands (the tiny model's audio is noise).
    """
    assert held.shape == rendered.shape, (held.shape, rendered.shape)
    diff = np.abs(held - rendered)
    assert diff.max() <= 1, f"max |held - rendered| = {diff.max()} at sample {int(diff.argmax())}"
    assert np.count_nonzero(diff) <= held.size // 100


# --------------------------------------------------------------------------- tests


def test_tiny_model_speak_streams_and_plays(page: Any, server: str) -> None:
    pg = page
    # The service says it is the demo model, and the studio says so where the director looks.
    info = http_json(server + "/api/info")
    assert info["engine"] == "moss" and info["demo"] is True
    hello = pg.evaluate("window.studio.hello")
    assert hello["sr"] == SR and hello["frame_samples"] == FRAME and hello["demo"] is True
    banner = pg.locator("#demoBanner")
    assert banner.is_visible()
    banner_text = banner.inner_text()
    assert "Demo model." in banner_text and "random weights" in banner_text and "tiny demo" in banner_text, banner_text
    assert "scripted" not in banner_text
    # Not hidden under anything (the sticky top bar): what is drawn at its middle is the banner.
    assert pg.evaluate(
        """() => { const r = document.getElementById('demoBanner').getBoundingClientRect();
                   const hit = document.elementFromPoint(r.left + r.width / 2, r.top + r.height / 2);
                   return r.height > 0 && !!hit && !!hit.closest('#demoBanner'); }"""
    )
    assert "engine moss" in pg.locator("#engineTag").inner_text()
    shot(pg, "tiny-demo-banner", full_page=False)

    set_fixed_seed(pg, 11)
    direct_frames(pg, 40)  # 3.2 s of audio
    pg.fill("#text", "The tiny model speaks noise, but it streams like the real one.")
    assert stats(pg)["samplesPlayed"] == 0
    pg.click("#speak")

    # PCM arrives and the worklet plays it: the played-sample counter advances, and keeps advancing.
    pg.wait_for_function("window.studio.stats.samplesPlayed > 0", timeout=WAIT_MS)
    first = stats(pg)["samplesPlayed"]
    pg.wait_for_function(f"window.studio.stats.samplesPlayed > {first + SR // 2}", timeout=WAIT_MS)
    shot(pg, "tiny-streaming", full_page=False)

    take = wait_take_ended(pg, 1, timeout=WAIT_MS)
    wait_playback_drained(pg, timeout=WAIT_MS)
    st = stats(pg)
    assert take["end"]["reason"] == "max_frames"
    assert take["end"]["n_frames"] == 40
    assert take["samples"] == 40 * FRAME
    assert take["mismatch"] is None
    assert st["samplesReceived"] == 40 * FRAME
    assert take["seed"] == "11"
    assert take["ttfaMs"] is not None and take["heardMs"] is not None
    # Real audio (noise), not silence.
    assert np.abs(held_pcm(pg, take["key"])).max() > 1000
    # The worklet played all of it, without starving once the jitter cushion was buffered.
    assert st["audioMode"] == "worklet"
    assert st["samplesPlayed"] >= 40 * FRAME
    assert_no_underrun(pg, take)
    assert st["streamsDrained"] == 1
    assert not pg.evaluate("window.studio.playing")
    card = pg.locator("article.take").first
    assert "seed 11" in card.inner_text()
    assert card.locator(".badge").text_content() == "max_frames"
    assert pg.locator("#mFrames").inner_text() == "3.20 s"  # 40 frames
    shot(pg, "tiny-after-take")


def test_tiny_model_cancel_stops_the_audio(page: Any) -> None:
    pg = page
    direct_frames(pg, 400)  # 32 s of audio: far longer than the test waits
    pg.click("#speak")
    pg.wait_for_function(f"window.studio.stats.samplesPlayed > {SR // 2}", timeout=WAIT_MS)
    assert pg.evaluate("window.studio.busy")
    assert pg.evaluate("window.studio.takes()[0].status") == "streaming"
    played_at_cancel = pg.evaluate(
        "(() => { document.getElementById('cancel').click(); return window.studio.stats.samplesPlayed; })()"
    )
    take = wait_take_ended(pg, 1, timeout=WAIT_MS)
    assert take["end"]["reason"] == "cancelled"
    assert 0 < take["end"]["n_frames"] < 400
    assert take["samples"] == take["end"]["n_frames"] * FRAME
    pg.wait_for_function("!window.studio.playing && !window.studio.busy", timeout=WAIT_MS)
    time.sleep(0.3)
    st = stats(pg)
    # The audio stopped at the click (within a render quantum and a player report; generous for a busy CI
    # box), nothing is left queued for the player, and nothing more plays or arrives.
    assert st["samplesPlayed"] - played_at_cancel < SR // 4, (played_at_cancel, st["samplesPlayed"])
    assert st["bufferLevel"] == 0 and not st["playing"]
    time.sleep(0.5)
    later = stats(pg)
    assert later["samplesPlayed"] == st["samplesPlayed"]
    assert later["samplesReceived"] == st["samplesReceived"]
    assert pg.locator("#speak").is_enabled()
    assert "cancelled" in pg.locator("article.take").first.inner_text().lower()
    shot(pg, "tiny-cancelled")


def test_tiny_model_retake_splices_at_the_acknowledged_sample(page: Any, server: str) -> None:
    pg = page
    set_fixed_seed(pg, 7)
    first = speak_frames(pg, 1, 40)
    assert first["end"]["reason"] == "max_frames" and first["samples"] == 40 * FRAME

    frame = place_playhead_with_the_mouse(pg, 0.6)
    assert 10 < frame < 39
    retake_whispering(pg, seed=99)
    second = wait_take_ended(pg, 2, timeout=WAIT_MS)
    wait_playback_drained(pg, timeout=WAIT_MS)

    # The service acknowledged the seek at the frame the director picked, with its sample offset ...
    ack = stats(pg)["lastSeek"]
    assert ack["from_take"] == first["id"] and ack["take"] == second["id"] != first["id"]
    assert ack["frame"] == frame and ack["sample"] == frame * FRAME
    splice = ack["sample"]
    # ... and the studio spliced the new take there.
    assert second["parent"] == first["id"]
    assert second["spliceSample"] == splice and second["spliceFrame"] == frame
    assert second["seed"] == "99"
    assert second["request"]["instruction"].startswith("GENERAL: the same voice, now whispering")
    assert second["end"]["reason"] == "max_frames"
    assert second["end"]["new_frames"] == second["end"]["n_frames"] - frame == 40
    assert second["samples"] == second["end"]["n_frames"] * FRAME
    assert second["mismatch"] is None
    # The history shows where it came from: the card and the editor's caption.
    at = f"{splice / SR:.2f} s"
    assert f"from Take 1 @ {at}" in pg.locator("article.take").first.inner_text()
    assert f"retake of Take 1 @ {at}" in pg.locator("#edSub").inner_text()  # seconds (frames: the advanced view)

    # Before the splice the new take is the first one; from it on, new audio (another seed).
    a, b = held_pcm(pg, first["key"]), held_pcm(pg, second["key"])
    assert np.array_equal(a[:splice], b[:splice])
    assert not np.array_equal(a[splice : splice + FRAME], b[splice : splice + FRAME])
    # The service's renderings agree: its take 2 keeps take 1's audio before the splice bit for bit, and
    # what the page holds is the service's take 2, so the streamed continuation landed at the acked sample.
    params_a, rendered_a = service_wav(server, first["id"])
    params_b, rendered_b = service_wav(server, second["id"])
    assert params_b.framerate == SR and params_b.nframes == second["samples"]
    assert np.array_equal(rendered_a[:splice], rendered_b[:splice])
    assert_same_audio(b, rendered_b)
    assert_no_underrun(pg, second)
    shot(pg, "tiny-retake")


def test_tiny_model_upload_reference_then_speak_with_it(page: Any, server: str, tmp_path: Path) -> None:
    pg = page
    path = tmp_path / "my voice.wav"
    path.write_bytes(sine_wav(1.5, sr=24000))  # a 220 Hz tone, 16-bit WAV
    pg.set_input_files("#uploadFile", str(path))
    pg.wait_for_function(
        "document.getElementById('uploadNote').textContent.startsWith('Voice ready')", timeout=WAIT_MS
    )
    # Accepted: the new voice is in the picker, selected, and listed by the service.
    ref_id = pg.locator("#voice").input_value()
    assert ref_id.startswith("ref_")
    picked = pg.locator("#voice option:checked").inner_text()
    assert picked.startswith("my voice"), picked
    listed = {v["id"]: v for v in http_json(server + "/api/voices")["voices"]}
    assert ref_id in listed and listed[ref_id]["kind"] == "uploaded"

    take = speak_frames(pg, 1, 24)
    assert take["request"]["reference"] == ref_id
    assert take["end"]["reason"] == "max_frames" and take["samples"] == 24 * FRAME
    assert "voice my voice" in pg.locator("article.take").first.inner_text()
    assert_no_underrun(pg, take)
    shot(pg, "tiny-uploaded-voice")


def test_tiny_model_download_take_as_wav(page: Any, server: str, tmp_path: Path) -> None:
    pg = page
    set_fixed_seed(pg, 3)
    take = speak_frames(pg, 1, 20)
    n_frames = take["end"]["n_frames"]
    assert n_frames == 20
    card = pg.locator("article.take").first
    with pg.expect_download() as info:
        card.get_by_role("button", name="Download Take 1 as WAV", exact=False).click()
    session = pg.evaluate("window.studio.session")
    assert info.value.suggested_filename == f"moss_rt-{session[2:10]}-take-1.wav"  # the session, the take
    local = tmp_path / "client.wav"
    info.value.save_as(local)
    with wave.open(str(local)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (SR, 1, 2)
        assert w.getnframes() == n_frames * FRAME == take["samples"]
        client_pcm = np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.int32)
    assert np.array_equal(client_pcm, held_pcm(pg, take["key"]))

    # The service's rendering (GET /api/takes/{id}.wav) is the same take, so the card offers one WAV only.
    assert card.get_by_role("button", name="as rendered", exact=False).is_hidden()
    served = tmp_path / "server.wav"
    with urllib.request.urlopen(f"{server}/api/takes/{take['id']}.wav", timeout=30) as r:
        served.write_bytes(r.read())
    with wave.open(str(served)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (SR, 1, 2)
        assert w.getnframes() == n_frames * FRAME
        served_pcm = np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.int32)
    assert_same_audio(client_pcm, served_pcm)
    assert takes(pg)[0]["end"]["reason"] == "max_frames"


def test_tiny_model_sound_starts_from_the_first_frames(page: Any) -> None:
    """Default chunk (8) and cushion (200 ms): the first-chunk policy sends a take's first frames one by one, so the
    player starts on them rather than after a whole chunk; the page reports when the director heard the take (Speak
    click → first sample out of the player), with the service's own first-audio time beside it. How many ms that is
    on a given machine is for the benchmark (bench/studio_bench.py prints it), not an assertion: this shared CPU box
    runs the tiny model anywhere from 0.5x to 4x real time."""
    pg = page
    set_param(pg, "text_temperature", "0")
    set_param(pg, "max_new_tokens", "30")
    for n in range(1, 3):
        pg.click("#speak")
        wait_take_ended(pg, n, timeout=WAIT_MS)
        wait_playback_drained(pg, timeout=WAIT_MS)
        take = takes(pg)[n - 1]
        assert take["firstChunks"][:3] == [1, 1, 1], take["firstChunks"]
        assert take["heardMs"] is not None and take["heardMs"] >= take["ttfaMs"], take
        assert take["end"]["ttfa_ms"] is not None
    assert pg.locator("#mTtfa").inner_text().replace(" ", "") == f"{round(take['heardMs'])}ms"
    assert f"service {round(take['end']['ttfa_ms'])} ms" in pg.locator("#mTtfaS").inner_text()
    shot(pg, "tiny-heard-after")
