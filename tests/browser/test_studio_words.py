"""Word timing in the studio (issue 25), as a director uses it in headless Chromium on the real engine with the
tiny model: the take's words under the waveform, the word being heard highlighted, a click that puts the playhead
at a word's start and a retake from there, a Shift+click span as the region, caption downloads, the words of takes
restored after a reload, and the phone layout.

The tiny model's audio is noise, so the aligner places no word itself: every word gets an estimated time (flag
``interpolated``), which is all the studio needs. Takes are greedy (text temperature 0) and capped by
``max_new_tokens``, so their lengths are exact (end reason ``max_frames``). The server runs with its default
aligner (``auto``: PocketSphinx on a CPU). Screenshots: words-*.png.
"""

from __future__ import annotations

import math
import urllib.request
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
    run_server,
    set_fixed_seed,
    set_param,
    shot,
    stats,
    takes,
    wait_playback_drained,
    wait_take_ended,
)

pytestmark = pytest.mark.browser

WAIT_MS = 60_000  # generous: the CI box is slow and shared; no assertion is about speed
TEXT = "Forty ships sailed out before the storm came in."
WORDS = ["Forty", "ships", "sailed", "out", "before", "the", "storm", "came", "in"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with run_server(tmp_path_factory.mktemp("studio-words"), engine=TINY_MODEL_ENGINE, ready_timeout=180) as url:
        yield url


def word_frame(word: dict[str, Any]) -> int:
    """The frame where a word starts, by the service's rule (``seek`` with ``word``): its sample's frame."""
    return round(word["start"] * SR) // FRAME


def word_end_sample(word: dict[str, Any]) -> int:
    return math.ceil(round(word["end"] * SR) / FRAME) * FRAME


def speak(pg: Any, count: int, frames: int, text: str = TEXT) -> dict[str, Any]:
    set_param(pg, "cushion_ms", "1000")  # a slow shared box: playback waits for a full second of audio
    set_param(pg, "text_temperature", "0")
    set_param(pg, "max_new_tokens", str(frames))
    set_param(pg, "tokens", str(frames))
    pg.fill("#text", text)
    pg.click("#speak")
    take = wait_take_ended(pg, count, timeout=WAIT_MS)
    wait_playback_drained(pg, timeout=WAIT_MS)
    return take


def words_of(pg: Any, take: str) -> dict[str, Any]:
    return pg.evaluate(f"window.studio.words('{take}')")


def strip_words(pg: Any) -> list[str]:
    return pg.locator("#words button.word").all_inner_texts()


def held_pcm(pg: Any, key: str) -> np.ndarray:
    return held_audio(pg, key)[:, 0]


def region_of(pg: Any) -> tuple[int, int] | None:
    region = pg.evaluate("window.studio.region")
    return (region["from"], region["to"]) if region else None


def fetch_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode("utf-8")


def test_words_click_retake_span_captions_and_reload(page: Any, server: str, tmp_path: Path) -> None:
    pg = page
    hello = pg.evaluate("window.studio.hello")
    assert hello["words"] is True and hello["aligner"]
    # The Scene asks for words: on by default when the service has an aligner.
    assert pg.locator("#wordsField").is_visible() and pg.locator("#wantWords").is_checked()

    set_fixed_seed(pg, 5)
    one = speak(pg, 1, 50)  # 4 s of noise: room for every word of the text at the estimated speaking rate
    assert one["end"]["reason"] == "max_frames" and one["samples"] == 50 * FRAME
    assert one["request"]["words"] is True
    assert stats(pg)["wordMessages"] >= 1  # streamed as `words` messages, not fetched
    held = words_of(pg, one["key"])
    assert held["complete"] and not held["loading"] and held["error"] is None
    words = held["words"]
    assert [w["word"] for w in words] == WORDS
    assert all(0 <= w["start"] < w["end"] <= one["samples"] / SR + 1e-6 for w in words)
    assert all(a["end"] <= b["start"] + 1e-6 for a, b in zip(words, words[1:], strict=False))
    # The service's own list of the take's words is the one the page holds.
    assert http_json(f"{server}/api/takes/{one['id']}/words")["words"] == words

    # Under the waveform: one button per word, in order.
    assert strip_words(pg) == WORDS
    wave, strip = pg.locator("#wave").bounding_box(), pg.locator("#words").bounding_box()
    assert strip["y"] >= wave["y"] + wave["height"] - 1
    assert "9 words" in pg.locator("#wordsInfo").inner_text()
    shot(pg, "words-strip", full_page=False)

    # Played from the start: the word being heard is highlighted, and it is the word at the playhead.
    pg.evaluate("window.studio.setCursorFrame(0)")
    pg.click("#edPlay")
    pg.wait_for_function(
        """() => { const h = document.querySelector('#words .word.heard'); const ph = window.studio.playhead;
                   if (!h || ph == null) return false;
                   const w = window.studio.words(window.studio.selected).words[+h.dataset.i], t = ph / 48000;
                   return w.start - 0.1 <= t && t < w.end + 0.1; }""",
        timeout=WAIT_MS,
    )
    assert pg.locator("#words .word.heard").count() == 1
    pg.click("#edPlay")  # stop
    pg.wait_for_function("!window.studio.playing", timeout=WAIT_MS)

    # A click on a word puts the playhead on the frame where it starts, and marks the word there.
    k = next(i for i, w in enumerate(words) if 8 <= word_frame(w) <= 40 and i >= 3)
    frame = word_frame(words[k])
    pg.locator("#words button.word").nth(k).click()
    assert pg.evaluate("window.studio.cursor") == frame * FRAME
    shown = f"{frame * FRAME / 48000:.2f} s"  # the position in seconds (frames: the advanced view)
    pg.wait_for_function(f"document.getElementById('edPos').textContent.startsWith('{shown}')")  # drawn next frame
    assert pg.locator("#words .word.at").all_inner_texts() == [WORDS[k]]

    # Retake from there: the new take's kept prefix ends exactly at the word's start frame.
    pg.click("#retakeBtn")
    two = wait_take_ended(pg, 2, timeout=WAIT_MS)
    wait_playback_drained(pg, timeout=WAIT_MS)
    ack = stats(pg)["lastSeek"]
    assert ack["from_take"] == one["id"] and ack["take"] == two["id"]
    assert ack["frame"] == frame and ack["sample"] == frame * FRAME
    assert two["parent"] == one["id"] and two["spliceFrame"] == frame and two["spliceSample"] == frame * FRAME
    assert two["request"]["words"] is True
    a, b = held_pcm(pg, one["key"]), held_pcm(pg, two["key"])
    assert np.array_equal(a[: frame * FRAME], b[: frame * FRAME])
    assert not np.array_equal(a[frame * FRAME : (frame + 1) * FRAME], b[frame * FRAME : (frame + 1) * FRAME])
    # Its words: the first take's words before the splice come first, unchanged; the strip shows the new take.
    retaken = words_of(pg, two["key"])
    assert retaken["complete"]
    kept = [w for w in words if w["end"] <= frame / 12.5]  # the service keeps those ending by the branch time
    assert kept and retaken["words"][: len(kept)] == kept
    assert pg.evaluate("window.studio.selected") == two["key"]
    assert strip_words(pg) == [w["word"] for w in retaken["words"]]
    shot(pg, "words-retake", full_page=False)

    # Shift+click a second word: the words from the one clicked to it are the region, for Loop and Retake region.
    pg.evaluate(f"window.studio.select('{one['key']}')")
    assert strip_words(pg) == WORDS
    buttons = pg.locator("#words button.word")
    buttons.nth(1).click()
    buttons.nth(3).click(modifiers=["Shift"])
    region = pg.evaluate("window.studio.region")
    assert region == {"from": word_frame(words[1]) * FRAME, "to": word_end_sample(words[3])}
    assert pg.evaluate("window.studio.cursor") == region["from"]
    shaded = pg.locator("#words .word.inreg").all_inner_texts()
    assert shaded == WORDS[1:4]  # the words of the region are shaded
    assert pg.locator("#loopBtn").is_enabled() and pg.locator("#retakeRegionBtn").is_enabled()
    pg.click("#loopBtn")
    assert pg.evaluate("window.studio.loop") == region
    pg.click("#loopBtn")
    assert pg.evaluate("window.studio.loop") is None
    # Backwards too, from the same anchor (word 1) to an earlier word.
    buttons.nth(0).click(modifiers=["Shift"])
    assert region_of(pg) == (word_frame(words[0]) * FRAME, word_end_sample(words[1]))
    shot(pg, "words-span", full_page=False)
    # From the keyboard: the strip is one tab stop; arrows move between words (not the playhead), Enter places the
    # playhead at the word, Shift+Enter selects from the last word chosen.
    assert pg.locator("#words button.word[tabindex='0']").count() == 1
    buttons.nth(0).focus()
    for _ in range(3):
        pg.keyboard.press("ArrowRight")
    assert pg.evaluate("document.activeElement.textContent") == WORDS[3]
    assert pg.evaluate("window.studio.cursor") == word_frame(words[0]) * FRAME  # the arrows did not move it
    pg.keyboard.press("Enter")
    assert pg.evaluate("window.studio.cursor") == word_frame(words[3]) * FRAME
    pg.keyboard.press("ArrowRight")
    pg.keyboard.press("Shift+Enter")
    assert region_of(pg) == (word_frame(words[3]) * FRAME, word_end_sample(words[4]))

    # Captions beside the WAV on the card (and in the strip): SubRip and WebVTT, the service's cues.
    card = pg.locator(f"article.take[data-key='{one['key']}']")
    served = {fmt: fetch_text(f"{server}/api/takes/{one['id']}.{fmt}") for fmt in ("srt", "vtt")}
    for fmt in ("srt", "vtt"):
        with pg.expect_download() as info:
            card.get_by_role("link", name=f"{fmt.upper()} captions of Take 1").click()
        path = tmp_path / f"take1.{fmt}"
        info.value.save_as(path)
        got = path.read_text("utf-8")
        assert got == served[fmt]
        assert "-->" in got and "Forty ships" in got
    assert served["vtt"].startswith("WEBVTT") and served["srt"].startswith("1\n")
    assert pg.locator("#wordsSrt").is_visible() and pg.locator("#wordsVtt").is_visible()
    with pg.expect_download() as info:
        pg.click("#wordsVtt")
    assert Path(info.value.path()).read_text("utf-8") == served["vtt"]

    # After a reload the session's takes come back: a restored take shows its words (fetched: no stream now).
    pg.reload()
    pg.wait_for_function(
        "window.studio && window.studio.connected && window.studio.takes().length === 2"
        " && window.studio.takes().every((t) => t.loaded)",
        timeout=WAIT_MS,
    )
    assert stats(pg)["wordMessages"] == 0
    pg.evaluate(f"window.studio.select('{one['id']}')")
    pg.wait_for_function(f"(window.studio.words('{one['id']}') || {{}}).complete === true", timeout=WAIT_MS)
    assert words_of(pg, one["id"])["words"] == words
    assert stats(pg)["wordFetches"] >= 1
    assert strip_words(pg) == WORDS
    # ... and a click there still puts the playhead at the word's start.
    pg.locator("#words button.word").nth(k).click()
    assert pg.evaluate("window.studio.cursor") == frame * FRAME
    restored_key = pg.evaluate(f"window.studio.take('{one['id']}').key")
    restored_card = pg.locator(f"article.take[data-key='{restored_key}']")
    assert restored_card.get_by_role("link", name="SRT captions of Take 1").is_visible()
    shot(pg, "words-after-reload", full_page=False)


def test_words_on_a_phone(browser: Any, server: str) -> None:
    context = browser.new_context(
        viewport={"width": 390, "height": 844}, device_scale_factor=2, is_mobile=True, has_touch=True
    )
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    try:
        pg.goto(server + "/")
        pg.wait_for_function("window.studio && window.studio.connected", timeout=15_000)
        text = "The lighthouse keeper counted the ships until the fog rolled in, then counted the silence."
        one = speak(pg, 1, 80, text)
        words = words_of(pg, one["key"])["words"]
        assert len(words) >= 10
        strip = pg.locator("#words")
        assert strip.is_visible()
        # The words wrap inside the screen (no sideways scrolling), each a target a finger can hit.
        boxes = pg.locator("#words button.word").evaluate_all(
            "bs => bs.map((b) => b.getBoundingClientRect()).map((r) => [r.left, r.right, r.width, r.height, r.top])"
        )
        assert len(boxes) == len(words)
        assert all(left >= 0 and right <= 390 for left, right, *_ in boxes)
        assert all(w >= 40 and h >= 40 for _, _, w, h, _ in boxes)
        assert len({round(top) for *_, top in boxes}) >= 2  # more than one line: they wrap
        assert pg.evaluate("document.documentElement.scrollWidth") <= 390
        # A tap puts the playhead at the word's start.
        k = len(words) // 2
        pg.locator("#words button.word").nth(k).scroll_into_view_if_needed()
        pg.locator("#words button.word").nth(k).tap()
        assert pg.evaluate("window.studio.cursor") == word_frame(words[k]) * FRAME
        # No Shift on a phone: "Select span", then a second tap, makes the region.
        pg.locator("#wordSpan").tap()
        assert pg.locator("#wordSpan").get_attribute("aria-pressed") == "true"
        pg.locator("#words button.word").nth(k + 2).tap()
        assert pg.evaluate("window.studio.region") == {
            "from": word_frame(words[k]) * FRAME,
            "to": word_end_sample(words[k + 2]),
        }
        assert pg.locator("#wordSpan").get_attribute("aria-pressed") == "false"
        shaded = pg.locator("#words .word.inreg").all_inner_texts()
        assert shaded == [w["word"] for w in words[k : k + 3]]
        shot(pg, "words-phone", full_page=False)

        # Word timing off: the take asks for none, and the strip is gone.
        pg.locator("#wantWords").uncheck()
        assert not pg.locator("#wordsBar").is_visible()
        before = stats(pg)["wordMessages"]
        two = speak(pg, 2, 10)
        assert not two["request"].get("words")
        assert stats(pg)["wordMessages"] == before
        assert not pg.locator("#wordsBar").is_visible() and words_of(pg, two["key"]) is None
        assert takes(pg)[1]["end"]["reason"] == "max_frames"
    finally:
        context.close()
    assert not errors, errors


@pytest.mark.parametrize("device_rate", [48000, 44100])
def test_a_stream_that_ends_after_the_player_ran_dry_drains(page: Any, device_rate: int) -> None:
    """A take's ``end`` can come well after its last audio (its last words are aligned first): by then the player
    may have played everything and be waiting, starved, for more. The end must still finish the stream (it
    never did: the page showed the take playing forever, Cancel lit, and playback never "drained")."""
    result = page.evaluate(
        """async (rate) => {
            const { RingCore } = await import('/static/js/ring-core.js');
            const core = new RingCore(rate), outL = new Float32Array(128), outR = new Float32Array(128);
            core.msg({ t: 'stream', id: 1, cushion: 256 });
            const tone = new Float32Array(512).fill(0.25);
            core.msg({ t: 'data', id: 1, l: tone, r: tone });
            for (let i = 0; i < 8; i++) core.render(outL, outR);   // all of it played, then starved
            const starved = { level: core.level, primed: core.primed, underruns: core.underruns,
                              drained: core.drained };
            core.msg({ t: 'end', id: 1 });
            core.render(outL, outR);
            return { starved, drained: core.drained, active: core.active, played: core.played, report: core.report() };
        }""",
        device_rate,
    )
    assert result["starved"]["level"] <= 1 and not result["starved"]["primed"]
    assert result["starved"]["underruns"] == 1 and not result["starved"]["drained"]
    assert result["drained"] and not result["active"]
    assert result["played"] >= 511
    assert result["report"]["drained"] is True
