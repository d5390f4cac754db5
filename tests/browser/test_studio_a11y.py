"""Accessibility of the studio: an automated axe-core check in the page, and the names a screen reader reads.

axe-core (Deque, MPL-2.0) is vendored as the single minified file tests/browser/vendor/axe.min.js (version in its
header; the licence beside it), so the test never touches the network; it is injected into the page under test.
The page is checked in its working states: after a take and a retake, with the retake panel, the sampling panel
and the A/B comparison open, and on a phone. Serious and critical violations fail the test.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.browser.helpers import run_server, set_param, shot, wait_playback_drained, wait_take_ended

pytestmark = pytest.mark.browser

AXE = Path(__file__).resolve().parent / "vendor" / "axe.min.js"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with run_server(tmp_path_factory.mktemp("studio-a11y")) as url:
        yield url


def axe_violations(pg: Any) -> list[dict[str, Any]]:
    """Serious and critical axe-core violations on the page as it is now (WCAG 2.x A and AA rules)."""
    if not pg.evaluate("!!window.axe"):
        pg.add_script_tag(path=str(AXE))
    result = pg.evaluate(
        """async () => {
            const tags = ['wcag2a', 'wcag2aa', 'wcag21a', 'wcag21aa', 'best-practice'];
            const r = await axe.run(document, { runOnly: { type: 'tag', values: tags }, resultTypes: ['violations'] });
            return r.violations.map((v) => ({ id: v.id, impact: v.impact, help: v.help,
                nodes: v.nodes.slice(0, 5).map((n) => ({ target: n.target.join(' '), summary: n.failureSummary })) }));
        }"""
    )
    return [v for v in result if v["impact"] in ("serious", "critical")]


def describe(violations: list[dict[str, Any]]) -> str:
    return "\n".join(
        f"{v['id']} ({v['impact']}): {v['help']}\n" + "\n".join(f"   {n['target']}: {n['summary']}" for n in v["nodes"])
        for v in violations
    )


def test_no_serious_accessibility_violations(page: Any) -> None:
    pg = page
    assert not (found := axe_violations(pg)), describe(found)  # the empty studio

    set_param(pg, "tokens", "20")
    pg.click("#speak")
    wait_take_ended(pg, 1)
    wait_playback_drained(pg)
    pg.evaluate("window.studio.setCursorFrame(8)")
    pg.click("#retakeOptsBtn")
    pg.click("#retakeBtn")
    wait_take_ended(pg, 2)
    wait_playback_drained(pg)
    pg.get_by_role("button", name="Compare Take 1 as A", exact=True).click()
    pg.get_by_role("button", name="Compare Take 2 as B", exact=True).click()
    assert pg.locator("#retakeOpts").is_visible()
    # The director's tools in use: a region, a marker, a comp in the making, a named and starred take.
    pg.evaluate("window.studio.setRegion(2, 6)")
    pg.click("#compAdd")
    pg.fill("#markerLabel", "breath")
    pg.click("#markerAdd")
    pg.fill("#takeName", "Keeper")
    pg.click("#takeStar")
    assert pg.locator("#comp").is_visible() and pg.locator("#sessionBar").is_visible()
    shot(pg, "a11y-working-state")
    assert not (found := axe_violations(pg)), describe(found)

    # What a screen reader names: the seed box, the retake boxes and menu, the waveform, each take's buttons.
    for label in ("Fixed seed", "Instruction from here", "Text from here", "Retake seed"):
        assert pg.get_by_label(label, exact=True).count() == 1, label
    wave = pg.get_by_role("slider", name="Waveform and playhead", exact=False)
    assert wave.count() == 1
    assert "Take 2" in (wave.get_attribute("aria-valuetext") or "")
    for title in ("Take 1", "Keeper (Take 2)"):
        for name in (f"Play {title}", f"Compare {title} as A", f"Compare {title} as B"):
            assert pg.get_by_role("button", name=name, exact=True).count() == 1, name


def test_no_serious_accessibility_violations_on_a_phone(browser: Any, server: str) -> None:
    context = browser.new_context(
        viewport={"width": 390, "height": 844}, device_scale_factor=2, is_mobile=True, has_touch=True
    )
    pg = context.new_page()
    try:
        pg.goto(server + "/")
        pg.wait_for_function("window.studio && window.studio.connected", timeout=15_000)
        set_param(pg, "tokens", "10")
        pg.locator("#speak").tap()
        wait_take_ended(pg, 1)
        wait_playback_drained(pg)
        shot(pg, "a11y-phone", full_page=False)
        assert not (found := axe_violations(pg)), describe(found)
    finally:
        context.close()
