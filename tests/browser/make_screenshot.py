"""Regenerate docs/studio.png: the studio after a short directing session.

    .venv/bin/python -m tests.browser.make_screenshot [--engine tiny|scripted] [docs/studio.png]

By default the service runs the real engine on the tiny random-weight model on CPU (what `make run`
serves without a GPU), so the picture shows the real engine and its demo banner; ``--engine scripted``
uses the scripted test engine instead. Needs the same things as the browser test (playwright +
Debian's chromium). The scene is driven through the UI like a director would: two takes, a retake
from a point with new direction, an A/B pair, and the last take playing.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from playwright.sync_api import sync_playwright

from tests.browser.helpers import (
    CHROMIUM_ARGS,
    ROOT,
    SCRIPTED_ENGINE,
    TINY_MODEL_ENGINE,
    find_chromium,
    run_server,
    seconds_of,
)

ENGINES = {"tiny": TINY_MODEL_ENGINE, "scripted": SCRIPTED_ENGINE}
FRAMES = 110  # 8.8 s per take

INSTRUCTION = (
    "GENERAL: A weathered lighthouse keeper in his late sixties, warm and unhurried, close to the microphone "
    "in a quiet room.\nSCRIPT: starts wry (a soft laugh), turns tender on the last line [pause] and lets it land."
)
TEXT = (
    "Forty years I counted the ships. Then one night the fog came in so thick that all I could count was "
    "the silence. [pause] Funny thing: it was the best count I ever kept."
)


def main(out: Path, engine: str = "tiny") -> None:
    chromium = find_chromium()
    if chromium is None:
        raise SystemExit("chromium not found (apt-get install -y chromium)")
    with (
        tempfile.TemporaryDirectory() as tmp,
        run_server(Path(tmp), engine=ENGINES[engine], ready_timeout=180) as url,
        sync_playwright() as pw,
    ):
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True)
        pg = browser.new_page(viewport={"width": 1440, "height": 1000})
        # The studio is ES modules: one that fails to load leaves an inert page, not a picture worth keeping.
        errors: list[str] = []
        pg.on("pageerror", lambda e: errors.append(str(e)))
        pg.goto(url + "/")
        pg.wait_for_function("window.studio && window.studio.connected", timeout=15_000)
        pg.fill("#instruction", INSTRUCTION)
        pg.fill("#text", TEXT)
        pg.fill("#language", "English")
        pg.click("#advanced > summary")
        pg.fill("#tokens", seconds_of(FRAMES))  # the studio asks durations in seconds
        if engine == "tiny":
            # Takes of exactly FRAMES frames: with greedy text the tiny model's random stop head never fires.
            pg.fill("#text_temperature", "0")
            pg.fill("#max_new_tokens", seconds_of(FRAMES))
        pg.click("#advanced > summary")

        def take(n: int) -> None:
            pg.wait_for_function(
                f"window.studio.takes().length >= {n} && window.studio.takes()[{n - 1}].end !== null", timeout=120_000
            )
            pg.wait_for_function("!window.studio.busy", timeout=120_000)

        pg.click("#speak")
        take(1)
        pg.keyboard.press("Escape")
        pg.click("#seedFixed")
        pg.fill("#seed", "20240611")
        pg.click("#speak")
        take(2)
        pg.keyboard.press("Escape")
        box = pg.locator("#wave").bounding_box()
        assert box is not None
        pg.mouse.click(box["x"] + box["width"] * 0.52, box["y"] + 40)
        pg.click("#retakeOptsBtn")
        pg.fill("#rtInstruction", "SCRIPT: from here on (whispering), slower, almost to himself [pause]")
        pg.click("#retakeBtn")
        take(3)
        pg.click("#retakeOptsBtn")
        pg.get_by_role("button", name="Compare Take 2 as A", exact=True).click()
        pg.get_by_role("button", name="Compare Take 3 as B", exact=True).click()
        pg.evaluate("window.studio.setCursorFrame(40)")
        pg.click("#abPlayB")
        pg.wait_for_function("window.studio.playhead > 48000 * 4.3", timeout=15_000)
        pg.mouse.move(0, 0)
        pg.evaluate("window.scrollTo(0, 0)")
        time.sleep(0.05)
        if errors:
            raise SystemExit(f"the studio raised errors, no screenshot written: {errors}")
        out.parent.mkdir(parents=True, exist_ok=True)
        pg.screenshot(path=str(out))
        browser.close()
    print(f"wrote {out} ({out.stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, default=ROOT / "docs" / "studio.png")
    parser.add_argument(
        "--engine", choices=sorted(ENGINES), default="tiny", help="tiny: the real engine on the tiny model (default)"
    )
    args = parser.parse_args()
    main(args.out, args.engine)
