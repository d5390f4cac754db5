"""Fixtures shared by the studio's browser tests: Chromium and a fresh page on the module's ``server``.

Each test module defines its own module-scoped ``server`` fixture (the base URL of a running service):
test_studio.py runs the scripted engine, test_studio_tiny_model.py the real engine on the tiny model.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.browser.helpers import CHROMIUM_ARGS, SHOTS, find_chromium


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as exc:  # pragma: no cover - depends on the environment
        pytest.skip(f"the playwright package is not installed ({exc}); pip install -r requirements-dev.txt")
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("Chromium not found at /usr/bin/chromium (install Debian's: apt-get install -y chromium)")
    pw = sync_playwright().start()
    try:
        try:
            b = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True, timeout=60_000)
        except Exception as exc:  # pragma: no cover - depends on the environment
            pytest.skip(f"Chromium at {chromium} could not be started: {exc}")
        yield b
        b.close()
    finally:
        pw.stop()


@pytest.fixture
def page(browser: Any, server: str, request: pytest.FixtureRequest) -> Iterator[Any]:
    """A fresh browser context (empty storage) on the studio, connected and ready."""
    context = browser.new_context(viewport={"width": 1440, "height": 960}, accept_downloads=True)
    context.grant_permissions(["microphone"], origin=server)
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(server + "/")
    pg.wait_for_function("window.studio && window.studio.connected", timeout=15_000)
    yield pg
    SHOTS.mkdir(parents=True, exist_ok=True)
    pg.screenshot(path=str(SHOTS / f"{request.node.name}-final.png"), full_page=True)
    context.close()
    assert not errors, f"uncaught page errors: {errors}"
