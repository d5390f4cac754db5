"""Nothing a director makes is lost, and names are stable (issue 27, items 1 and 2), in headless Chromium on the
scripted engine (its stereo audio says where each sample came from: left = frame index + 1, right = the seed's
marker).

- A region retake that keeps the old tail, and a named comp, are takes the session keeps: after a reload, a
  restart of the service and an export/import they are back with the same samples, their numbers, their names and
  where they came from. The comp (whole frames, no crossfade) can be retaken from its codes; the crossfaded splice
  cannot, and the studio says why.
- A take's number is the session's, given once: after deleting Take 5 and reloading, Take 6 is still Take 6, the
  next take is Take 7, and a retake names its source by name wherever it is shown (desktop, and a phone by touch).

Screenshots: persist-*.png.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.browser.helpers import (
    FRAME,
    held_audio,
    retake_region_keeping_tail,
    run_server,
    seed_marker,
    set_param,
    shot,
    stereo_take,
    takes,
    wait_playback_drained,
    wait_session,
    wait_take_ended,
)
from tests.helpers import free_port

pytestmark = pytest.mark.browser


def open_studio(pg: Any, url: str, count: int, query: str = "") -> None:
    pg.goto(url + "/" + query)
    pg.wait_for_function(
        f"window.studio && window.studio.connected && window.studio.session"
        f" && window.studio.takes().length === {count} && window.studio.takes().every((t) => t.loaded)",
        timeout=20_000,
    )


def by_kind(pg: Any) -> dict[str, dict[str, Any]]:
    return {t["kind"]: t for t in takes(pg) if t["kind"] in ("splice", "comp")}


def test_a_kept_tail_splice_and_a_named_comp_survive_a_reload_a_restart_and_an_archive(
    browser: Any, tmp_path: Path
) -> None:
    port = free_port()
    context = browser.new_context(viewport={"width": 1440, "height": 900}, accept_downloads=True)
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    try:
        with run_server(tmp_path, port=port) as url:
            open_studio(pg, url, 0)
            one = stereo_take(pg, 1, seed=7, frames=30)
            two = stereo_take(pg, 2, seed=8, frames=24)
            # Fix one word: retake frames 10-20 of Take 1 with a new seed, keeping its old tail.
            pg.evaluate(f"window.studio.select('{one['key']}'); window.studio.setRegion(10, 20)")
            retake_region_keeping_tail(pg, 99)
            # A comp of Take 1's frames 5-12 and Take 2's frames 20-24, named by the director.
            pg.evaluate(f"window.studio.select('{one['key']}'); window.studio.setRegion(5, 12)")
            pg.click("#compAdd")
            pg.evaluate(f"window.studio.select('{two['key']}'); window.studio.setRegion(20, 24)")
            pg.click("#compAdd")
            pg.click("#compBuild")
            pg.wait_for_function("window.studio.takes().some((t) => t.kind === 'comp' && t.loaded)", timeout=20_000)
            assert pg.evaluate("window.studio.selected") == by_kind(pg)["comp"]["key"]
            pg.fill("#takeName", "Opening comp")
            wait_session(pg, "b.takes.some((t) => t.kind === 'comp' && t.title === 'Opening comp')")
            made = by_kind(pg)
            splice, comp = made["splice"], made["comp"]
            assert (splice["number"], comp["number"]) == (4, 5) and splice["name"] == "Take 4"
            assert (splice["crossfade"], splice["hasCodes"], comp["hasCodes"]) == (480, False, True)
            audio = {"splice": held_audio(pg, splice["key"]), "comp": held_audio(pg, comp["key"])}
            old = held_audio(pg, one["key"])
            assert np.array_equal(audio["splice"][: 10 * FRAME], old[: 10 * FRAME])
            assert set(audio["splice"][10 * FRAME : 20 * FRAME, 1]) == {seed_marker(99)}
            assert np.array_equal(audio["splice"][20 * FRAME + 480 :], old[20 * FRAME + 480 :])
            assert np.array_equal(audio["comp"][: 7 * FRAME], old[5 * FRAME : 12 * FRAME])
            assert set(audio["comp"][7 * FRAME :, 1]) == {seed_marker(8)}
            session = pg.evaluate("window.studio.session")

            def check_kept(ids: dict[int, str]) -> None:
                back = by_kind(pg)
                assert set(back) == {"splice", "comp"}
                b_splice, b_comp = back["splice"], back["comp"]
                assert (b_splice["name"], b_comp["name"], b_comp["title"]) == ("Take 4", "Take 5", "Opening comp")
                assert not b_splice["local"] and not b_comp["local"]
                assert np.array_equal(held_audio(pg, b_splice["key"]), audio["splice"])
                assert np.array_equal(held_audio(pg, b_comp["key"]), audio["comp"])
                assert [(p["take"], p["number"], p["from"], p["to"]) for p in b_comp["parts"]] == [
                    (ids[1], 1, 5 * FRAME, 12 * FRAME),
                    (ids[2], 2, 20 * FRAME, 24 * FRAME),
                ]
                assert [(p["take"], p["number"]) for p in b_splice["parts"]] == [(ids[3], 3), (ids[1], 1)]
                assert b_splice["crossfade"] == 480 and b_splice["splices"] == [
                    {"sample": 20 * FRAME, "kind": "crossfade 10 ms"}
                ]
                pg.evaluate(f"window.studio.select('{b_comp['key']}')")
                assert pg.locator("#edTitle").inner_text() == "Opening comp (Take 5)"
                assert pg.locator("#edSub").inner_text().startswith("comp of Take 1 0.40 s – 0.96 s + Take 2")

            def ids_now() -> dict[int, str]:
                return {t["number"]: t["id"] for t in takes(pg)}

            pg.reload()
            open_studio(pg, url, 5)
            check_kept(ids_now())
            shot(pg, "persist-after-reload")

        with run_server(tmp_path, port=port) as url:  # a restart: same data dir, same address
            open_studio(pg, url, 5)
            check_kept(ids_now())
            # The comp is whole frames of codes: a retake of it keeps its frames, to the sample.
            comp = by_kind(pg)["comp"]
            pg.evaluate(f"window.studio.select('{comp['key']}'); window.studio.setCursorFrame(9)")
            assert pg.locator("#retakeBtn").is_enabled() and pg.locator("#seekWhy").is_hidden()
            pg.click("#retakeOptsBtn")
            pg.select_option("#rtSeedMode", "fixed")
            pg.fill("#rtSeed", "55")
            pg.click("#retakeBtn")
            retake = wait_take_ended(pg, 6)
            wait_playback_drained(pg)
            assert retake["parent"] == comp["id"] and retake["name"] == "Take 6"
            new = held_audio(pg, retake["key"])
            assert np.array_equal(new[: 9 * FRAME], audio["comp"][: 9 * FRAME])
            assert set(new[9 * FRAME :, 1]) == {seed_marker(55)}
            assert pg.locator("#edSub").inner_text().startswith("retake of Opening comp (Take 5) @ 0.72 s")
            # The splice's crossfade lies inside a frame: no codes to continue from, and the studio says so.
            pg.evaluate(f"window.studio.select('{by_kind(pg)['splice']['key']}')")
            assert pg.locator("#retakeBtn").is_disabled() and pg.locator("#replayBtn").is_disabled()
            why = pg.locator("#seekWhy")
            assert why.is_visible() and "10 ms crossfade inside a frame" in why.inner_text()
            shot(pg, "persist-splice-no-codes")

            # The whole session as one archive, into a new session: everything comes back.
            with pg.expect_download() as info:
                pg.click("#sessionExport")
            archive = tmp_path / "session.zip"
            info.value.save_as(archive)
            pg.set_input_files("#sessionImport", str(archive))
            pg.wait_for_function(f"window.studio && window.studio.session && window.studio.session !== '{session}'")
            pg.wait_for_function(
                "window.studio.takes().length === 6 && window.studio.takes().every((t) => t.loaded)", timeout=20_000
            )
            imported = ids_now()
            assert sorted(imported) == [1, 2, 3, 4, 5, 6] and one["id"] not in imported.values()
            check_kept(imported)
            shot(pg, "persist-after-import")
    finally:
        context.close()
    assert not errors, errors


@pytest.mark.parametrize("device", ["desktop", "phone"])
def test_a_deleted_take_leaves_the_others_their_numbers_after_a_reload(
    browser: Any, tmp_path: Path, device: str
) -> None:
    phone = device == "phone"
    viewport = {"width": 390, "height": 844} if phone else {"width": 1440, "height": 900}
    context = browser.new_context(viewport=viewport, has_touch=phone, is_mobile=phone, accept_downloads=True)
    pg = context.new_page()
    press = pg.tap if phone else pg.click
    try:
        with run_server(tmp_path) as url:
            open_studio(pg, url, 0)
            set_param(pg, "tokens", "4")
            for n in range(1, 7):
                press("#speak")
                wait_take_ended(pg, n)
                wait_playback_drained(pg)
            assert [t["name"] for t in takes(pg)] == [f"Take {n}" for n in range(1, 7)]
            five = takes(pg)[4]
            pg.evaluate("window.studio.undoGraceMs = 1000")  # a shorter Undo time: less to wait for
            pg.evaluate(f"window.studio.select('{five['key']}')")
            press("#takeDelete")  # hidden at once, deleted from the session when its Undo time is over
            wait_session(pg, "b.takes.length === 5", timeout=20_000)
            assert [t["name"] for t in takes(pg)] == ["Take 1", "Take 2", "Take 3", "Take 4", "Take 6"]

            pg.reload()
            open_studio(pg, url, 5)
            assert [t["name"] for t in takes(pg)] == ["Take 1", "Take 2", "Take 3", "Take 4", "Take 6"]
            six = takes(pg)[4]
            assert six["id"] not in (five["id"],) and six["number"] == 6
            card = pg.locator(f"article.take[data-key='{six['key']}']")
            assert card.get_attribute("aria-label") == "Take 6"
            # Names wherever a take is referred to: a retake of Take 2, after Take 2 is named.
            two = takes(pg)[1]
            pg.evaluate(f"window.studio.select('{two['key']}'); window.studio.setCursorFrame(2)")
            pg.fill("#takeName", "Keeper")
            press("#retakeBtn")
            retake = wait_take_ended(pg, 6)
            wait_playback_drained(pg)
            assert retake["name"] == "Take 7" and retake["number"] == 7
            assert pg.locator("#edSub").inner_text().startswith("retake of Keeper (Take 2) @ 0.16 s")
            retake_card = pg.locator(f"article.take[data-key='{retake['key']}']")
            assert "↳ from Keeper (Take 2)" in retake_card.inner_text()
            pg.reload()
            open_studio(pg, url, 6)
            assert [t["name"] for t in takes(pg)][-2:] == ["Take 6", "Take 7"]
            back = takes(pg)[-1]
            pg.evaluate(f"window.studio.select('{back['key']}')")
            assert pg.locator("#edSub").inner_text().startswith("retake of Keeper (Take 2)")
            shot(pg, f"persist-numbers-{device}")
    finally:
        context.close()
