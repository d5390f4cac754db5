"""The studio, day two (issue 27): each defect a director met, as a test, at 1440×900 with the mouse and at 390×844
with touch events (a touch context, taps and CDP touch gestures), in headless Chromium on the scripted engine.

Every test here failed before its fix. Defects 1 and 2 (splices and comps kept by the service, stable take numbers)
are not the studio's alone and are not tested here. Screenshots of both sizes: artifacts/screenshots/day2-*.png.
"""

from __future__ import annotations

import io
import json
import time
import wave
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.browser.helpers import (
    FRAME,
    SHOTS,
    run_server,
    set_fixed_seed,
    set_param,
    shot,
    takes,
    wait_playback_drained,
    wait_session,
    wait_take_ended,
)
from tests.conftest import sine_wav

pytestmark = pytest.mark.browser

SIZES: dict[str, dict[str, Any]] = {
    "desktop": {"viewport": {"width": 1440, "height": 900}},
    "phone": {
        "viewport": {"width": 390, "height": 844},
        "device_scale_factor": 2,
        "is_mobile": True,
        "has_touch": True,
    },
}

# Watches the directing socket from inside the page: the JSON messages it sends (window.__sent), and, when a test
# asks for it (window.__dropPcmAt = n), loses the n-th PCM message from then on, as a lossy network would.
WS_TAP = """
(() => {
  const Native = window.WebSocket;
  window.__sent = []; window.__dropPcmAt = 0; window.__pcmSeen = 0;
  class Tapped extends Native {
    set onmessage(fn) {
      super.onmessage = fn && ((ev) => {
        if (ev.data instanceof ArrayBuffer && new Uint8Array(ev.data)[0] === 1 && window.__dropPcmAt) {
          if (++window.__pcmSeen === window.__dropPcmAt) { window.__dropPcmAt = 0; return; }
        }
        fn.call(this, ev);
      });
    }
    get onmessage() { return super.onmessage; }
    send(data) {
      if (typeof data === 'string') { try { window.__sent.push(JSON.parse(data)); } catch (e) { /* not JSON */ } }
      return super.send(data);
    }
  }
  window.WebSocket = Tapped;
})();
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # 20 ms per 80 ms frame: four times real time, so takes are quick and playback never starves.
    with run_server(
        tmp_path_factory.mktemp("studio-day-two"), engine=("--engine", "scripted", "--frame-ms", "20")
    ) as url:
        yield url


@dataclass
class Studio:
    """A page of the studio at one size, driven as a director there would: the mouse, or touch."""

    pg: Any
    size: str

    @property
    def phone(self) -> bool:
        return self.size == "phone"

    def press(self, selector: str) -> None:
        """Tap on the phone, click on the desktop."""
        if self.phone:
            self.pg.locator(selector).tap()
        else:
            self.pg.locator(selector).click()

    def press_locator(self, locator: Any) -> None:
        locator.tap() if self.phone else locator.click()

    def speak(self, count: int, frames: int | None = None) -> dict[str, Any]:
        if frames is not None:
            set_param(self.pg, "tokens", str(frames))
        self.press("#speak")
        wait_take_ended(self.pg, count)
        wait_playback_drained(self.pg)
        return takes(self.pg)[count - 1]

    def wave_x(self, fraction: float) -> tuple[float, float]:
        """The viewport point at ``fraction`` of the waveform's width (on screen first)."""
        wave = self.pg.locator("#wave")
        wave.scroll_into_view_if_needed()
        box = wave.bounding_box()
        return box["x"] + box["width"] * fraction, box["y"] + box["height"] * 0.4

    def drag_on_wave(self, start: float, end: float, *, hold_ms: int = 0, steps: int = 8) -> None:
        """Press at ``start`` (a fraction of the waveform's width), hold still ``hold_ms``, drag to ``end``, lift: with
        the mouse on the desktop, with a finger (CDP touch events) on the phone."""
        (x0, y), (x1, _) = self.wave_x(start), self.wave_x(end)
        if self.phone:
            cdp = self.pg.context.new_cdp_session(self.pg)
            try:
                cdp.send("Input.dispatchTouchEvent", {"type": "touchStart", "touchPoints": [{"x": x0, "y": y}]})
                if hold_ms:
                    self.pg.wait_for_timeout(hold_ms)
                for i in range(1, steps + 1):
                    x = x0 + (x1 - x0) * i / steps
                    cdp.send("Input.dispatchTouchEvent", {"type": "touchMove", "touchPoints": [{"x": x, "y": y}]})
                cdp.send("Input.dispatchTouchEvent", {"type": "touchEnd", "touchPoints": []})
            finally:
                cdp.detach()
            # Chromium's gesture recognizer settles after a lift (a tap right after a long press is sometimes taken
            # as part of it, without a click), as a finger would take a moment to reach the next button.
            self.pg.wait_for_timeout(400)
        else:
            self.pg.mouse.move(x0, y)
            self.pg.mouse.down()
            if hold_ms:
                self.pg.wait_for_timeout(hold_ms)
            self.pg.mouse.move(x1, y, steps=steps)
            self.pg.mouse.up()
        self.pg.wait_for_timeout(50)  # the pointer events' handlers

    def shot(self, name: str) -> None:
        shot(self.pg, f"day2-{name}-{self.size}", full_page=not self.phone)


@pytest.fixture(params=sorted(SIZES))
def studio(request: pytest.FixtureRequest, browser: Any, server: str) -> Iterator[Studio]:
    context = browser.new_context(**SIZES[request.param], accept_downloads=True)
    context.add_init_script(WS_TAP)
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(server + "/")
    pg.wait_for_function("window.studio && window.studio.connected && window.studio.session", timeout=15_000)
    yield Studio(pg, request.param)
    SHOTS.mkdir(parents=True, exist_ok=True)
    pg.screenshot(path=str(SHOTS / f"{request.node.name}-final.png"), full_page=True)
    context.close()
    assert not errors, f"uncaught page errors: {errors}"


def region(pg: Any) -> dict[str, int] | None:
    return pg.evaluate("window.studio.region")


def stored_takes(pg: Any) -> list[dict[str, Any]]:
    """The session's records as the service keeps them (asked from the page: its owner cookie)."""
    return pg.evaluate("fetch('/api/sessions/' + window.studio.session).then((r) => r.json()).then((b) => b.takes)")


def card(pg: Any, take: dict[str, Any]) -> Any:
    return pg.locator(f"article.take[data-key='{take['key']}']")


# --------------------------------------------------------------------------- 3. touch, regions, the phone layout


def test_regions_by_long_press_and_drag_and_by_their_handles(studio: Studio) -> None:
    s, pg = studio, studio.pg
    s.speak(1, frames=40)
    total = 40 * FRAME

    def near(sample: int, fraction: float) -> bool:
        return abs(sample - fraction * total) <= FRAME  # frame-aligned: within one frame of the finger

    # A plain drag moves the playhead and selects nothing (as before).
    s.drag_on_wave(0.2, 0.4)
    assert region(pg) is None and near(pg.evaluate("window.studio.cursor"), 0.4)
    # Long-press, then drag: a region.
    s.drag_on_wave(0.2, 0.6, hold_ms=700)
    r = region(pg)
    assert r is not None and near(r["from"], 0.2) and near(r["to"], 0.6), r
    assert pg.evaluate("window.studio.stats.longPresses") == 1
    assert "Region" in pg.locator("#regionPos").inner_text()
    assert pg.locator("#loopBtn").is_enabled() and pg.locator("#compAdd").is_enabled()
    s.shot("region")
    # Its ends are handles: drag the end, then the start; the other end stays.
    s.drag_on_wave(r["to"] / total, 0.8)
    moved = region(pg)
    assert moved["from"] == r["from"] and near(moved["to"], 0.8), (r, moved)
    s.drag_on_wave(moved["from"] / total, 0.1)
    moved2 = region(pg)
    assert moved2["to"] == moved["to"] and near(moved2["from"], 0.1), (moved, moved2)
    assert pg.evaluate("window.studio.stats.handleDrags") == 2
    # The region is usable from here: loop it.
    s.press("#loopBtn")
    pg.wait_for_function("window.studio.loop !== null", timeout=10_000)
    assert pg.evaluate("window.studio.loop") == {"from": moved2["from"], "to": moved2["to"]}
    s.press("#loopBtn")
    assert pg.evaluate("window.studio.loop") is None


def test_the_layout_fits_the_screen_and_every_target_is_large_enough(studio: Studio) -> None:
    s, pg = studio, studio.pg
    s.speak(1, frames=10)
    pg.locator("#advanced > summary").click()
    width = SIZES[s.size]["viewport"]["width"]
    height = SIZES[s.size]["viewport"]["height"]
    assert pg.evaluate("document.documentElement.scrollWidth") <= width + 1  # nothing wider than the screen
    # The search box and the voice picker are whole, on the screen.
    for selector, least in (("#takeSearch", 300 if s.phone else 200), ("#voice", 250 if s.phone else 120)):
        pg.locator(selector).scroll_into_view_if_needed()
        box = pg.locator(selector).bounding_box()
        assert box["x"] >= 0 and box["x"] + box["width"] <= width and box["width"] >= least, (selector, box)
    assert pg.locator("#voicePlay").bounding_box()["x"] + pg.locator("#voicePlay").bounding_box()["width"] <= width
    if not s.phone:
        assert pg.locator("#meters").is_visible() and pg.locator("#metersToggle").is_hidden()
        s.shot("layout")
        return
    # The transport bar at the bottom stays small: its meters fold away behind one button.
    bar = pg.locator("#transport").bounding_box()
    assert bar["height"] <= 0.15 * height, bar
    assert pg.locator("#meters").is_hidden()
    s.press("#metersToggle")
    assert pg.locator("#mSeed").is_visible() and pg.locator("#mTtfa").is_visible()
    assert pg.locator("#metersToggle").get_attribute("aria-expanded") == "true"
    s.shot("meters-open")
    s.press("#metersToggle")
    assert pg.locator("#meters").is_hidden() and pg.locator("#transport").bounding_box()["height"] <= 0.15 * height
    # The seed field is not hidden under it.
    pg.locator("#seed").scroll_into_view_if_needed()
    seed, bar = pg.locator("#seed").bounding_box(), pg.locator("#transport").bounding_box()
    assert seed["y"] + seed["height"] <= bar["y"], (seed, bar)
    # Every control a finger may touch is at least 44 × 44 px (a checkbox by its label).
    small = pg.evaluate(
        """() => {
            const out = [];
            const controls = 'button, a[href], select, input:not([type=hidden]):not([type=file]), summary, '
                + 'textarea, [role=slider]';
            for (const n of document.querySelectorAll(controls)) {
                if (n.closest('[hidden], dialog:not([open])')) continue;
                const style = getComputedStyle(n);
                if (style.display === 'none' || style.visibility === 'hidden') continue;
                let r = n.getBoundingClientRect();
                if (!r.width && !r.height) continue;
                if (n.type === 'checkbox' || n.type === 'radio') {
                    const l = n.closest('label'); if (l) r = l.getBoundingClientRect();
                }
                const name = n.id || n.textContent.trim().slice(0, 24) || n.tagName;
                const size = Math.round(r.width) + '×' + Math.round(r.height);
                if (r.width < 43.5 || r.height < 43.5) out.push(name + ' ' + size);
            }
            return out;
        }"""
    )
    assert small == [], small
    s.shot("layout")


# --------------------------------------------------------------------------- 4. honest figures


WATCH_HEARD = """([button, splice]) => {
    // Independently of the page's own figure: the click, and the frame the playhead first passes the splice.
    window.__heard = { click: null, heard: null };
    const before = new Set(window.studio.takes().map((t) => t.key));
    document.getElementById(button).addEventListener('click', () => { window.__heard.click = performance.now(); },
                                                     { capture: true, once: true });
    const poll = () => {
        const s = window.studio, h = window.__heard;
        const mine = s.playingTake && !before.has(s.playingTake);   // a take made by this click
        if (h.click !== null && mine && s.playhead !== null && s.playhead > splice) {
            h.heard = performance.now(); return;
        }
        requestAnimationFrame(poll);
    };
    poll();
}"""


def test_heard_after_counts_to_the_first_new_sample_and_leaves_the_preroll_out(studio: Studio) -> None:
    s, pg = studio, studio.pg
    assert pg.locator("#preroll").input_value() == "1"  # the default pre-roll: 1 s of kept audio first
    checked = []
    for kind, button, frame in (
        ("fresh", "#speak", 0),
        ("retake", "#retakeBtn", 20),
        ("continuation", "#retakeBtn", None),
    ):
        count = len(takes(pg)) + 1
        if kind == "fresh":
            set_param(pg, "tokens", "30")
        elif frame is None:
            pg.evaluate("window.studio.setCursorFrame(1e6)")  # the end of the take: "Continue from the end"
            assert pg.locator("#retakeBtn").inner_text() == "Continue from the end"
            frame = pg.evaluate("window.studio.cursor") // FRAME
        else:
            pg.evaluate(f"window.studio.setCursorFrame({frame})")
        pg.evaluate(WATCH_HEARD, [button.lstrip("#"), frame * FRAME])
        s.press(button)
        take = wait_take_ended(pg, count)
        wait_playback_drained(pg)
        take = takes(pg)[count - 1]
        watched = pg.evaluate("window.__heard")
        heard_at = watched["heard"] - watched["click"]  # the click → the first new sample played, pre-roll and all
        latency = pg.evaluate("window.studio.audioLatencyMs")
        preroll = take["prerollMs"]
        assert take["heardMs"] is not None and take["heardMs"] >= take["ttfaMs"], take
        if kind == "fresh":
            assert preroll == 0
        else:
            assert preroll == pytest.approx(1000, abs=1), take  # 1 s of kept audio played before the new audio
            assert heard_at >= 1000
            assert "pre-roll 1.0 s not counted" in pg.locator("#mTtfaS").inner_text()
        # "Heard after" is the wait for the new audio: the click → its first sample out, less the pre-roll, never
        # before the new audio arrived. (Before the fix, a retake's figure was heard_at itself: over 1 s.)
        assert take["heardMs"] <= max(heard_at + latency - preroll + 60, take["ttfaMs"] + latency + 1), (
            kind,
            take,
            heard_at,
        )
        # The meter shows it, with the service's own first-audio time beside it.
        assert pg.locator("#mTtfa").inner_text().replace(" ", "") == f"{round(take['heardMs'])}ms"
        assert "service" in pg.locator("#mTtfaS").inner_text()
        checked.append(kind)
    assert checked == ["fresh", "retake", "continuation"]
    s.shot("heard-after")


# --------------------------------------------------------------------------- 5. A/B and names everywhere


def test_ab_shows_the_side_playing_keeps_the_selection_and_names_takes(studio: Studio) -> None:
    s, pg = studio, studio.pg
    # Takes 1 and 2 are long enough (9.6 s) to be still playing through both A/B switches below however slow the
    # machine: with 3.2 s takes, A had ended before X on a loaded machine, and X with nothing playing plays A. Their
    # playback after speaking is stopped (Esc), so they cost no more time than short ones heard out.
    for n in (1, 2):
        set_param(pg, "tokens", "120")
        s.press("#speak")
        wait_take_ended(pg, n)
        pg.keyboard.press("Escape")
        wait_playback_drained(pg)
    s.speak(3, frames=40)
    one, two, three = takes(pg)
    pg.evaluate(f"window.studio.select('{one['key']}')")
    pg.fill("#takeName", "Keeper")
    s.press_locator(card(pg, three).locator(".t1"))  # the director works on Take 3
    assert pg.evaluate("window.studio.selected") == three["key"]
    s.press_locator(pg.get_by_role("button", name="Compare Keeper (Take 1) as A", exact=True))
    s.press_locator(pg.get_by_role("button", name="Compare Take 2 as B", exact=True))
    assert "Keeper (Take 1)" in pg.locator("#abA").inner_text()
    # Play A: the panel says A plays, by name; the selection stays on Take 3.
    s.press("#abPlayA")
    pg.wait_for_function("window.studio.ab.playing === 'a'", timeout=10_000)
    assert pg.locator("#abNow").inner_text() == "▶ Playing A: Keeper (Take 1)"
    assert "playing" in (pg.locator("#abRowA").get_attribute("class") or "")
    assert "Keeper (Take 1)" in pg.locator("#statusMain").inner_text()
    assert pg.evaluate("window.studio.selected") == three["key"]
    s.shot("ab-playing")
    # X switches sides (the key on the desktop, the button on the phone); the selection still stays.
    for side in ("b", "a"):
        if s.phone:
            s.press("#abSwitch")
        else:
            pg.locator("#takes h2").click()
            pg.keyboard.press("x")
        pg.wait_for_function(f"window.studio.ab.playing === '{side}'", timeout=10_000)
        assert pg.evaluate("window.studio.selected") == three["key"]
    assert pg.locator("#abNow").inner_text() == "▶ Playing A: Keeper (Take 1)"
    # So a rename lands on the selected take, not on the one playing.
    pg.fill("#takeName", "Third")
    assert [t["title"] for t in takes(pg)] == ["Keeper", None, "Third"]
    pg.keyboard.press("Escape")
    # Names in the comp and in a retake's lineage.
    pg.evaluate(f"window.studio.select('{one['key']}'); window.studio.setRegion(2, 6)")
    s.press("#compAdd")
    assert "Keeper (Take 1)" in pg.locator("#compList").inner_text()
    pg.evaluate("window.studio.setCursorFrame(5)")
    s.press("#retakeBtn")
    retake = wait_take_ended(pg, 4)
    pg.keyboard.press("Escape")  # its names are what is checked, not its sound: no need to hear its 9 s out
    wait_playback_drained(pg)
    assert "retake of Keeper (Take 1) @" in pg.locator("#edSub").inner_text()
    assert "from Keeper (Take 1) @" in card(pg, retake).inner_text()


# --------------------------------------------------------------------------- 6. after a reload


def test_a_reload_keeps_voice_names_random_seeds_the_picker_and_plain_words(studio: Studio, tmp_path: Path) -> None:
    s, pg = studio, studio.pg
    voice = tmp_path / f"sailor {s.size}.wav"
    voice.write_bytes(sine_wav(1.6 if s.phone else 1.5, sr=24000))  # other bytes, another voice
    pg.set_input_files("#uploadFile", str(voice))
    pg.wait_for_function("document.getElementById('uploadNote').textContent.startsWith('Voice ready')", timeout=15_000)
    ref = pg.locator("#voice").input_value()
    assert ref.startswith("ref_")
    # The upload is named after its file: rename it (the service keeps the name).
    s.press("#voiceRenameBtn")
    pg.fill("#voiceRenameInput", f"Old sailor {s.size}")
    s.press("#voiceRenameSave")
    pg.wait_for_function(
        "document.getElementById('uploadNote').textContent.startsWith('Voice renamed')", timeout=10_000
    )
    assert pg.locator("#voice option:checked").inner_text().startswith(f"Old sailor {s.size}")
    set_param(pg, "text_temperature", "0")
    set_param(pg, "max_new_tokens", "20")
    random_take = s.speak(1, frames=10)  # the service picks the seed
    set_fixed_seed(pg, 77)
    fixed_take = s.speak(2, frames=10)
    assert fixed_take["seed"] == "77"

    pg.reload()
    pg.wait_for_function(
        "window.studio && window.studio.connected && window.studio.takes().length === 2"
        " && window.studio.takes().every((t) => t.loaded)",
        timeout=20_000,
    )
    # The voice picker is back on the voice, by its name.
    pg.wait_for_function(f"document.getElementById('voice').value === '{ref}'", timeout=10_000)
    assert pg.locator("#voice option:checked").inner_text().startswith(f"Old sailor {s.size}")
    first, second = (card(pg, t).locator(".meta").inner_text() for t in takes(pg))
    # The voice's name, never its id; a random seed stays random; plain words, no jargon.
    assert f"voice Old sailor {s.size}" in first and "ref_" not in first, first
    assert f"random seed {random_take['seed']}" in first and "(fixed)" not in first, first
    assert "seed 77 (fixed)" in second, second
    assert "text temperature 0" in first and "at most 1.6 s" in first, first
    for jargon in ("tT ", "max ", "dur ", "rtf "):
        assert jargon not in first, (jargon, first)
    s.shot("after-reload")


# --------------------------------------------------------------------------- 7. delete with undo


def test_delete_offers_undo_and_a_closed_page_does_not_lose_it(studio: Studio) -> None:
    s, pg = studio, studio.pg
    for n in (1, 2, 3):
        s.speak(n, frames=5)
    one, two, three = takes(pg)
    pg.wait_for_function("window.studio.takes().every((t) => t.stored)", timeout=10_000)
    # The Undo time is 6 s, left so while Undo is pressed (a shortened one ran out before the press on a loaded
    # machine); shortened below, where the test waits for it to pass (the behaviour is the same).
    assert pg.evaluate("window.studio.undoGraceMs") == 6000
    pg.evaluate(f"window.studio.select('{two['key']}')")
    assert "from the session" in (pg.locator("#takeDelete").get_attribute("title") or "")
    s.press("#takeDelete")
    deleted_at = time.monotonic()
    # Gone from the list at once, with Undo; the service still has it.
    assert pg.locator("#undoBar").is_visible()
    assert pg.locator("#undoText").inner_text() == "Take 2 deleted from the session."
    assert card(pg, two).is_hidden() and pg.evaluate("window.studio.selected") != two["key"]
    assert two["id"] in [t["take_id"] for t in stored_takes(pg)]
    s.shot("undo")
    s.press("#undoDelete")
    assert pg.locator("#undoBar").is_hidden() and card(pg, two).is_visible()
    pg.wait_for_timeout(max(0.0, deleted_at + 6.5 - time.monotonic()) * 1000)  # past the Undo time: nothing deleted
    assert [t["take_id"] for t in stored_takes(pg)] == [one["id"], two["id"], three["id"]]
    pg.evaluate("window.studio.undoGraceMs = 1500")
    # Deleted for good once the Undo time has passed.
    pg.evaluate(f"window.studio.select('{two['key']}')")
    s.press("#takeDelete")
    pg.wait_for_function(f"!window.studio.takes().some((t) => t.key === '{two['key']}')", timeout=15_000)
    assert pg.locator("#undoBar").is_hidden()
    assert [t["take_id"] for t in stored_takes(pg)] == [one["id"], three["id"]]

    # The page is closed within the Undo time: the delete is sent as it goes.
    pg.evaluate(f"window.studio.select('{three['key']}')")
    s.press("#takeDelete")
    pg.reload()
    pg.wait_for_function("window.studio && window.studio.connected && window.studio.session", timeout=15_000)
    pg.wait_for_function("window.studio.takes().length === 1", timeout=10_000)
    assert [t["take_id"] for t in stored_takes(pg)] == [one["id"]]

    # And when that request is lost (the network dropped it), the next visit makes the delete and says so.
    studio_url = pg.url
    pg.evaluate("window.studio.undoGraceMs = 6000")  # (the reload set it back; said again: the page must go within it)
    pg.evaluate(f"window.studio.select('{takes(pg)[0]['key']}')")
    s.press("#takeDelete")
    pg.evaluate("() => { window.fetch = () => Promise.reject(new TypeError('the network is down')); }")  # lost
    pg.goto("about:blank")
    pg.goto(studio_url)
    pg.wait_for_function("window.studio && window.studio.connected && window.studio.session", timeout=15_000)
    pg.wait_for_function("window.studio.takes().length === 0", timeout=10_000)
    assert "Deleted now: Take 1" in pg.locator("#alertMsg").inner_text()
    wait_session(pg, "b.takes.length === 0")


# --------------------------------------------------------------------------- 8. downloads and voice names


def wav_frames(data: bytes) -> int:
    with wave.open(io.BytesIO(data)) as w:
        return w.getnframes()


def test_one_wav_button_named_by_session_and_take(studio: Studio, tmp_path: Path) -> None:
    s, pg = studio, studio.pg
    one = s.speak(1, frames=20)
    pg.evaluate(f"window.studio.select('{one['key']}')")
    pg.fill("#takeName", "Keeper")
    stem = "moss_rt-" + pg.evaluate("window.studio.session")[2:10]
    first = card(pg, one)
    downloads = first.locator("button:visible, a:visible").filter(has_text="WAV")
    assert downloads.count() == 1 and downloads.first.inner_text() == "WAV"  # the same bytes: one button
    with pg.expect_download() as got:
        s.press_locator(first.get_by_role("button", name="Download Keeper (Take 1) as WAV", exact=True))
    assert got.value.suggested_filename == f"{stem}-keeper-take-1.wav"
    heard = Path(got.value.path()).read_bytes()
    kept = pg.context.request.get(
        pg.url.rstrip("/") + f"/api/sessions/{pg.evaluate('window.studio.session')}/takes/{one['id']}.wav"
    )
    assert wav_frames(heard) == 20 * FRAME and heard[44:] == kept.body()[44:]
    assert pg.locator("#sessionExport").get_attribute("download") == f"{stem}-session.zip"

    # A take the page got only part of (one PCM message lost on the way): as heard and as rendered differ, and
    # both are offered, named apart.
    pg.evaluate("window.__pcmSeen = 0; window.__dropPcmAt = 3")
    two = s.speak(2, frames=20)
    assert two["mismatch"], two
    second = card(pg, two)
    assert second.locator("button:visible, a:visible").filter(has_text="WAV").count() == 2
    with pg.expect_download() as got_heard:
        s.press_locator(second.get_by_role("button", name="Download Take 2 as WAV, as heard", exact=True))
    with pg.expect_download() as got_rendered:
        s.press_locator(
            second.get_by_role("button", name="Download Take 2 as WAV, as rendered by the service", exact=True)
        )
    assert got_heard.value.suggested_filename == f"{stem}-take-2.wav"
    assert got_rendered.value.suggested_filename == f"{stem}-take-2-rendered.wav"
    assert wav_frames(Path(got_heard.value.path()).read_bytes()) == two["samples"] < 20 * FRAME
    assert wav_frames(Path(got_rendered.value.path()).read_bytes()) == 20 * FRAME
    s.shot("downloads")


# --------------------------------------------------------------------------- 9. seconds


def test_durations_are_asked_and_shown_in_seconds(studio: Studio) -> None:
    s, pg = studio, studio.pg
    pg.locator("#advanced > summary").click()
    labels = pg.locator("#params label").all_inner_texts()
    assert any(label.startswith("Duration hint (s)") for label in labels), labels
    assert not any("frames" in label.lower() for label in labels), labels
    pg.fill("#tokens", "1.6")  # seconds: 20 frames of 80 ms
    take = s.speak(1)
    assert take["request"]["tokens"] == 20 and take["samples"] == 20 * FRAME
    assert pg.locator("#mFrames").inner_text() == "1.60 s"
    pg.evaluate("window.studio.setCursorFrame(5); window.studio.setRegion(2, 6)")
    # The playhead's label is written when the next frame is drawn (requestAnimationFrame): wait for it.
    pg.wait_for_function("document.getElementById('edPos').textContent.startsWith('0.40 s')")
    for selector in ("#edPos", "#regionPos", "#edSub", "#mFramesS"):
        assert "frame" not in pg.locator(selector).inner_text(), selector
    # Frames only in the advanced view.
    s.press("label.show-frames")
    assert pg.locator("#showFrames").is_checked()
    pg.wait_for_function("document.getElementById('edPos').textContent.includes('frame 5')")  # the next frame drawn
    assert "frames 2–6" in pg.locator("#regionPos").inner_text()
    assert "= 20 frames" in pg.locator("#param_tokens label").inner_text()
    assert "20 frames" in pg.evaluate("document.getElementById('mFramesS').textContent")
    s.shot("seconds-and-frames")
    s.press("label.show-frames")
    pg.wait_for_function("!document.getElementById('edPos').textContent.includes('frame')")


# --------------------------------------------------------------------------- 10. speak as I type


def test_speak_as_i_type_feeds_the_text_while_it_is_written(studio: Studio) -> None:
    s, pg = studio, studio.pg
    pg.fill("#text", "")
    s.press("label.type-mode")
    assert pg.locator("#typeMode").is_checked() and pg.locator("#typeModeHint").is_visible()
    s.press("#speak")
    assert pg.locator("#typingBar").is_visible() and pg.locator("#speakLabel").inner_text() == "Finish text"
    pg.locator("#text").focus()
    first, rest = "The fog came in. ", "Then the silence."
    pg.keyboard.type(first, delay=20)
    pg.wait_for_function(f"window.studio.typing.sent === {json.dumps(first)}", timeout=10_000)
    # The first sentence is spoken while the director goes on typing.
    pg.wait_for_function("window.studio.takes().length === 1 && window.studio.takes()[0].samples > 0", timeout=15_000)
    pg.keyboard.type(rest, delay=20)
    pg.wait_for_function(f"window.studio.typing.sent === {json.dumps(first + rest)}", timeout=10_000)
    s.shot("typing")
    s.press("#typeFinish")
    take = wait_take_ended(pg, 1, timeout=30_000)
    wait_playback_drained(pg)
    assert take["end"]["reason"] == "done" and take["samples"] > 0
    assert pg.locator("#typingBar").is_hidden() and pg.locator("#speakLabel").inner_text() == "Speak"
    # On the wire: a start with stream_text and the text so far, the additions as appends, then end_of_text.
    sent = [m for m in pg.evaluate("window.__sent") if m["type"] in ("start", "append", "end_of_text")]
    assert sent[0]["type"] == "start" and sent[0]["stream_text"] is True and sent[0]["text"] == ""
    appends = [m["text"] for m in sent if m["type"] == "append"]
    assert len(appends) >= 2 and "".join(appends) == first + rest
    assert sent[-1]["type"] == "end_of_text"
    assert pg.evaluate("window.studio.stats.textFinished") == 1
    # The take holds the whole line, on the page and in the session.
    assert takes(pg)[0]["request"]["text"] == first + rest
    pg.wait_for_function("window.studio.takes()[0].stored", timeout=10_000)
    assert stored_takes(pg)[0]["request"]["text"] == first + rest
    assert "text fed as typed" in card(pg, take).inner_text()
