"""Regenerate docs/studio.png: the studio after a short directing session, on the scripted engine.

    .venv/bin/python -m tests.browser.make_screenshot [docs/studio.png]

Needs the same things as the browser test (playwright + Debian's chromium). The scene is driven
through the UI like a director would: two takes, a retake from a point with new direction, an A/B
pair, and the last take playing.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from playwright.sync_api import sync_playwright

from tests.browser.test_studio import CHROMIUM_ARGS, ROOT, find_chromium, run_server

INSTRUCTION = (
    "GENERAL: A weathered lighthouse keeper in his late sixties, warm and unhurried, close to the microphone "
    "in a quiet room.\nSCRIPT: starts wry (a soft laugh), turns tender on the last line [pause] and lets it land."
)
TEXT = (
    "Forty years I counted the ships. Then one night the fog came in so thick that all I could count was "
    "the silence. [pause] Funny thing: it was the best count I ever kept."
)


def main(out: Path) -> None:
    chromium = find_chromium()
    if chromium is None:
        raise SystemExit("chromium not found (apt-get install -y chromium)")
    with tempfile.TemporaryDirectory() as tmp, run_server(Path(tmp)) as url, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True)
        pg = browser.new_page(viewport={"width": 1440, "height": 1000})
        pg.goto(url + "/")
        pg.wait_for_function("window.studio && window.studio.connected", timeout=15_000)
        pg.fill("#instruction", INSTRUCTION)
        pg.fill("#text", TEXT)
        pg.fill("#language", "English")
        pg.click("#advanced > summary")
        pg.fill("#tokens", "110")
        pg.click("#advanced > summary")

        def take(n: int) -> None:
            pg.wait_for_function(
                f"window.studio.takes().length >= {n} && window.studio.takes()[{n - 1}].end !== null", timeout=30_000
            )
            pg.wait_for_function("!window.studio.busy", timeout=30_000)

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
        cards = pg.locator("article.take")
        cards.nth(1).get_by_role("button", name="A", exact=True).click()
        cards.nth(0).get_by_role("button", name="B", exact=True).click()
        pg.evaluate("window.studio.setCursorFrame(40)")
        pg.click("#abPlayB")
        pg.wait_for_function("window.studio.playhead > 48000 * 4.3", timeout=15_000)
        pg.mouse.move(0, 0)
        time.sleep(0.05)
        out.parent.mkdir(parents=True, exist_ok=True)
        pg.screenshot(path=str(out))
        browser.close()
    print(f"wrote {out} ({out.stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "studio.png")
