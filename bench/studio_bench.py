"""Studio "heard after" benchmark (issue 27): how soon a director hears a take, measured by the studio page itself.

    python bench/studio_bench.py                     # the real engine on the tiny model, on the CPU
    python bench/studio_bench.py --device cuda       # the same on a CUDA machine
    python bench/studio_bench.py --engine scripted   # the scripted test engine (no model)

Starts ``python -m moss_rt serve`` and drives the studio in headless Chromium (playwright + Debian's chromium,
as the browser tests), with the studio's defaults (chunk 8, jitter cushion 200 ms) unless told otherwise:

- ``fresh``: Speak, ``--takes`` times;
- ``retake``: Retake from the middle of the last take, with a ``--preroll`` second pre-roll;
- ``continuation``: "Continue from the end" of the last take, with the same pre-roll.

For each it prints what the meter shows: ``heard`` (the click → the take's first NEW sample out of the speaker, the
pre-roll not counted), ``heard_at`` (the same with the pre-roll: when the first new sample actually played),
``first_audio`` (the click → the first new PCM arriving in the page) and ``service`` (the service's own request →
first PCM sent), as min / median / max in ms, then one JSON object (``--json`` also writes it to a file).
Numbers only: nothing is asserted (tests/browser check that these figures are reported and honest).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.browser.helpers import (  # noqa: E402
    CHROMIUM_ARGS,
    FRAME,
    SCRIPTED_ENGINE,
    find_chromium,
    run_server,
    seconds_of,
)

WAIT_MS = 180_000


def engine_args(engine: str, device: str) -> tuple[str, ...]:
    if engine == "scripted":
        return SCRIPTED_ENGINE
    return ("--engine", "moss", "--model", "tiny", "--codec", "tiny", "--device", device)


def summary(values: list[float]) -> dict[str, float] | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"min": round(min(values), 1), "median": round(statistics.median(values), 1), "max": round(max(values), 1)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from playwright.sync_api import sync_playwright

    chromium = find_chromium()
    if chromium is None:
        raise SystemExit("chromium not found (apt-get install -y chromium)")
    records: dict[str, list[dict[str, Any]]] = {"fresh": [], "retake": [], "continuation": []}
    with (
        tempfile.TemporaryDirectory() as tmp,
        run_server(Path(tmp), engine=engine_args(args.engine, args.device), ready_timeout=300) as url,
        sync_playwright() as pw,
    ):
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True)
        pg = browser.new_page(viewport={"width": 1440, "height": 900})
        pg.goto(url + "/")
        pg.wait_for_function("window.studio && window.studio.connected", timeout=60_000)
        pg.click("#advanced > summary")
        pg.fill("#tokens", seconds_of(args.frames))
        if args.engine != "scripted":  # takes of exactly --frames frames: greedy text never stops the tiny model
            pg.fill("#text_temperature", "0")
            pg.fill("#max_new_tokens", seconds_of(args.frames))
        if args.cushion_ms:
            pg.fill("#cushion_ms", str(args.cushion_ms))
        pg.select_option("#preroll", str(args.preroll))

        def finish(kind: str) -> None:
            pg.wait_for_function("!window.studio.busy && !window.studio.playing", timeout=WAIT_MS)
            t = pg.evaluate("window.studio.takes()")[-1]
            end = t["end"] or {}
            records[kind].append({
                "take": t["name"], "heard": t["heardMs"], "heard_at": t["heardAtMs"], "first_audio": t["ttfaMs"],
                "service": end.get("ttfa_ms"), "rtf": end.get("rtf"), "preroll_ms": t["prerollMs"],
                "underruns": t["underruns"],
            })  # fmt: skip

        for _ in range(args.takes):
            pg.click("#speak")
            finish("fresh")
        for _ in range(args.takes):
            pg.evaluate(f"window.studio.setCursorFrame({args.frames // 2})")
            pg.click("#retakeBtn")
            finish("retake")
        for _ in range(args.takes):
            pg.evaluate("window.studio.setCursorFrame(1e6)")  # the end: "Continue from the end"
            pg.click("#retakeBtn")
            finish("continuation")
        browser.close()
    result: dict[str, Any] = {
        "engine": args.engine, "device": args.device, "frames": args.frames, "preroll_s": args.preroll,
        "frame_ms": FRAME / 48,
    }  # fmt: skip
    for kind, rows in records.items():
        result[kind] = {key: summary([r[key] for r in rows]) for key in ("heard", "heard_at", "first_audio", "service")}
        result[kind]["rtf"] = summary([r["rtf"] for r in rows])
        result[kind]["takes"] = rows
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("tiny", "scripted"), default="tiny")
    parser.add_argument("--device", default="cpu", help="for the tiny model: cpu or cuda")
    parser.add_argument("--takes", type=int, default=5, help="takes of each kind")
    parser.add_argument("--frames", type=int, default=30, help="frames per take (80 ms each)")
    parser.add_argument("--preroll", type=int, choices=(0, 1, 2, 3), default=1, help="a retake's pre-roll, seconds")
    parser.add_argument("--cushion-ms", type=int, default=0, help="the player's jitter cushion (0: the studio's)")
    parser.add_argument("--json", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    result = run(args)
    print(f"heard after, ms (min / median / max), {args.engine} on {args.device}, {args.frames}-frame takes:")
    for kind in ("fresh", "retake", "continuation"):
        row = result[kind]
        cells = []
        for key in ("heard", "heard_at", "first_audio", "service"):
            s = row[key]
            cells.append(f"{key} {s['min']:.0f} / {s['median']:.0f} / {s['max']:.0f}" if s else f"{key} —")
        print(f"  {kind:<13}" + " · ".join(cells))
    text = json.dumps({k: v for k, v in result.items()}, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text)


if __name__ == "__main__":
    main()
