"""Infrastructure of the studio's browser tests: Chromium, the service as a subprocess, page helpers.

Shared by every module in tests/browser (and make_screenshot.py); the fixtures are in conftest.py.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.helpers import free_port

ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "artifacts" / "screenshots"
SR = 48000
FRAME = 3840
FRAME_MS = 20  # scripted engine: 4x faster than real time, so playback never starves
# The engine arguments of `moss_rt serve`: the scripted test engine (the default here) or the real engine on the
# tiny random-weight model and codec on CPU (test_studio_tiny_model.py, make_screenshot.py).
SCRIPTED_ENGINE = ("--engine", "scripted", "--frame-ms", str(FRAME_MS))
TINY_MODEL_ENGINE = ("--engine", "moss", "--model", "tiny", "--codec", "tiny", "--device", "cpu")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--autoplay-policy=no-user-gesture-required",
    # A fake microphone (a beep) and auto-accepted permission prompt, for the recording test.
    "--use-fake-device-for-media-stream",
    "--use-fake-ui-for-media-stream",
]


def find_chromium() -> str | None:
    explicit = os.environ.get("MOSS_RT_CHROMIUM")
    if explicit:
        return explicit if Path(explicit).exists() else None
    for name in ("/usr/bin/chromium", "chromium", "chromium-browser"):
        path = name if os.path.isabs(name) else shutil.which(name)
        if path and Path(path).exists():
            return path
    return None


def seed_marker(seed: int) -> int:
    return -((seed % 1024) + 1)


def http_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


# --------------------------------------------------------------------------- the service


@contextlib.contextmanager
def run_server(
    base: Path,
    *extra: str,
    engine: Sequence[str] = SCRIPTED_ENGINE,
    ready_timeout: float = 60.0,
    port: int | None = None,
    module: str = "moss_rt",
) -> Iterator[str]:
    """The real service as a subprocess (by default on the scripted engine); yields its base URL. The same
    ``base`` (data dir) and ``port`` again is a restart of the same service (same origin for the browser).
    ``module`` is what ``python -m`` runs: ``moss_rt``, or a test launcher that wraps its CLI."""
    port = port or free_port()
    log_path = base / "server.log"
    cmd = [
        sys.executable, "-m", module, "serve", *engine,
        "--host", "127.0.0.1", "--port", str(port),
        "--data-dir", str(base / "data"), "--voices-dir", str(base / "voices"),
        *extra,
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + ready_timeout
            while True:
                if proc.poll() is not None:
                    pytest.fail(f"server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
                try:
                    with urllib.request.urlopen(url + "/readyz", timeout=1) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    pytest.fail(f"server not ready after {ready_timeout:.0f} s:\n{log_path.read_text()[-4000:]}")
                time.sleep(0.1)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def held_audio(pg: Any, key: str, start: int = 0, end: int | None = None) -> np.ndarray:
    """Samples [start, end) of a take the page holds (to its end by default), as int32 ``[n, channels]``: the
    page's int16 values, read in one string (``window.studio.pcm``; a plain array of 100k+ samples takes seconds)."""
    got = pg.evaluate("([k, a, b]) => window.studio.pcm(k, a, b)", [key, start, end])
    assert got is not None, f"the page holds no audio of {key}"
    values = np.frombuffer(base64.b64decode(got["data"]), dtype="<i2").astype(np.int32)
    return values.reshape(-1, got["channels"])


def shot(pg: Any, name: str, *, full_page: bool = True) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    pg.screenshot(path=str(SHOTS / f"{name}.png"), full_page=full_page)


def stats(pg: Any) -> dict[str, Any]:
    return pg.evaluate("JSON.parse(JSON.stringify(window.studio.stats))")


def takes(pg: Any) -> list[dict[str, Any]]:
    return pg.evaluate("window.studio.takes()")


# The parameters the service counts in 80 ms frames; the studio asks them in seconds.
FRAME_PARAMS = ("tokens", "max_new_tokens", "chunk_frames")


def seconds_of(frames: int | str) -> str:
    """``frames`` codec frames as the studio's duration fields take them (seconds: 30 → "2.40")."""
    return f"{int(frames) * FRAME / SR:.2f}"


def set_param(pg: Any, key: str, value: str) -> None:
    """Set a sampling-panel field as a director would. The frame-counted parameters (``FRAME_PARAMS``) are given
    in frames, as the service counts them, and typed as the seconds the studio asks for."""
    if not pg.locator("#advanced").evaluate("d => d.open"):
        pg.click("#advanced > summary")
    if key == "channels":
        pg.select_option("#channels", value)
    elif key in FRAME_PARAMS:
        pg.fill(f"#{key}", seconds_of(value))
    else:
        pg.fill(f"#{key}", value)


def set_fixed_seed(pg: Any, seed: int) -> None:
    pg.click("#seedFixed")
    pg.fill("#seed", str(seed))


def wait_take_ended(pg: Any, count: int, timeout: float = 30_000) -> dict[str, Any]:
    pg.wait_for_function(
        f"window.studio.takes().length >= {count} && window.studio.takes()[{count - 1}].end !== null",
        timeout=timeout,
    )
    return takes(pg)[count - 1]


def wait_session(pg: Any, test: str, timeout: float = 10_000) -> None:
    """Wait until the stored session the page is bound to passes ``test``, a JavaScript expression over its JSON
    ``b`` (GET /api/sessions/{id}). Polled from here: ``wait_for_function`` does not wait for a promise (one is
    truthy, so it would pass at once)."""
    expr = f"fetch('/api/sessions/' + window.studio.session).then((r) => r.json()).then((b) => !!({test}))"
    deadline = time.monotonic() + timeout / 1000
    while not pg.evaluate(expr):
        if time.monotonic() > deadline:
            raise AssertionError(f"the session never passed {test}")
        pg.wait_for_timeout(100)


def wait_playback_drained(pg: Any, timeout: float = 30_000) -> None:
    pg.wait_for_function("!window.studio.playing && !window.studio.busy", timeout=timeout)


def place_playhead_with_the_mouse(pg: Any, fraction: float = 0.6) -> int:
    """Click the waveform at ``fraction`` of its width, as a director would; the frame it lands on."""
    box = pg.locator("#wave").bounding_box()
    pg.mouse.click(box["x"] + box["width"] * fraction, box["y"] + box["height"] / 3)
    cursor = pg.evaluate("window.studio.cursor")
    assert cursor % FRAME == 0  # the playhead snaps to whole frames
    return cursor // FRAME


def retake_whispering(pg: Any, seed: int = 99) -> None:
    """Retake from the playhead with a changed direction and a fixed new seed."""
    pg.click("#retakeOptsBtn")
    pg.fill("#rtInstruction", "GENERAL: the same voice, now whispering\nSCRIPT: (whispering) [pause]")
    pg.select_option("#rtSeedMode", "fixed")
    pg.fill("#rtSeed", str(seed))
    pg.click("#retakeBtn")


def speak_and_finish(pg: Any, count: int, *, frames: int = 30) -> dict[str, Any]:
    set_param(pg, "tokens", str(frames))
    pg.click("#speak")
    take = wait_take_ended(pg, count)
    wait_playback_drained(pg)
    return take


def stereo_take(pg: Any, n: int, seed: int, frames: int) -> dict[str, Any]:
    """Speak take ``n`` in stereo with a fixed seed and ``frames`` frames; wait until it ended and was heard out."""
    set_param(pg, "channels", "2")
    set_param(pg, "tokens", str(frames))
    set_fixed_seed(pg, seed)
    pg.click("#speak")
    wait_take_ended(pg, n)
    wait_playback_drained(pg)
    return takes(pg)[n - 1]


def retake_region_keeping_tail(pg: Any, seed: int) -> None:
    """Retake the selected region with a fixed ``seed``, keeping the take's old tail (a splice); wait until the
    splice is loaded and heard out."""
    pg.click("#retakeOptsBtn")
    pg.select_option("#rtSeedMode", "fixed")
    pg.fill("#rtSeed", str(seed))
    pg.check("#keepTail")
    pg.click("#retakeRegionBtn")
    pg.wait_for_function("window.studio.takes().some((t) => t.kind === 'splice' && t.loaded)", timeout=20_000)
    wait_playback_drained(pg)
