"""Two front ends on one store (one database, one files folder), on both backends: concurrent writers lose
nothing, the caps hold across both, neither removes files the other is writing, scripts render on one of them at
a time, and both sign owner cookies with the same secret."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from moss_rt.protocol import ErrorCode, ProtocolError
from moss_rt.scripts.store import LeaseLost, new_script_id
from moss_rt.session_records import SessionFull, StorageFull
from moss_rt.session_store import ORPHAN_GRACE_SEC, STAGING, StoreBudget
from tests.storage.conftest import StoreBackend
from tests.test_session_store import make_take


def together(*calls: Callable[[], Any]) -> list[Any]:
    """Run the calls on threads released at once; what each returned (or raised)."""
    start = threading.Barrier(len(calls))
    results: list[Any] = [None] * len(calls)

    def run(i: int, call: Callable[[], Any]) -> None:
        start.wait()
        try:
            results[i] = call()
        except Exception as exc:  # the test looks at it
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_concurrent_writers_on_two_front_ends_lose_nothing(store_backend: StoreBackend) -> None:
    a, b = store_backend.open(), store_backend.open()
    sid = a.create(owner="cookie:x", client="10.0.0.1")

    def writer(store: Any, prefix: str) -> Callable[[], None]:
        def write() -> None:
            for n in range(6):
                store.put_take(sid, *make_take(f"t_{prefix}{n}", 2))
                store.update_notes(sid, f"t_{prefix}{n}", title=prefix)

        return write

    results = together(writer(a, "a"), writer(b, "b"), writer(a, "c"), writer(b, "d"))
    assert results == [None] * 4, results
    takes = b.takes(sid)
    assert len(takes) == 24 and sorted(t.seq for t in takes) == list(range(1, 25))  # one place each, none lost
    assert {t.title for t in takes} == {"a", "b", "c", "d"}
    on_disk = sum(f.stat().st_size for f in (store_backend.files / sid).iterdir())
    assert a.usage()["bytes"] == on_disk == b.list_sessions("cookie:x")[0]["bytes"]
    # Notes on different fields of one take, from both front ends at once: both kept.
    together(lambda: a.update_notes(sid, "t_a0", note="from a"), lambda: b.update_notes(sid, "t_a0", starred=True))
    take = a.get_take(sid, "t_a0")
    assert (take.note, take.starred) == ("from a", True)


def test_caps_hold_across_front_ends(store_backend: StoreBackend) -> None:
    budget = StoreBudget(max_sessions=3, reserve_free_bytes=0)
    a, b = (store_backend.open(max_session_takes=5, budget=budget) for _ in range(2))
    sid = a.create()

    def fill(store: Any, prefix: str) -> Callable[[], list[str]]:
        def put() -> list[str]:
            refused = []
            for n in range(4):
                try:
                    store.put_take(sid, *make_take(f"t_{prefix}{n}", 2))
                except SessionFull:
                    refused.append(f"t_{prefix}{n}")
            return refused

        return put

    refused = together(fill(a, "a"), fill(b, "b"))
    assert len(a.takes(sid)) == 5 and sum(len(r) for r in refused) == 3
    recorded = {t.take_id for t in a.takes(sid)}
    files = {f.name.split(".")[0] for f in (store_backend.files / sid).iterdir()}
    assert files == recorded  # a refused take's files were removed by the front end that wrote them

    made = together(*[(lambda s=s: s.create()) for s in (a, b, a, b)])  # one session exists: 2 more fit
    assert sum(isinstance(m, str) for m in made) == 2
    assert all(isinstance(m, StorageFull) for m in made if not isinstance(m, str))

    small = StoreBudget(max_bytes_per_client=300_000, reserve_free_bytes=0)
    c, d = store_backend.open(budget=small), store_backend.open(budget=small)
    one, two = c.create(client="10.0.0.7"), d.create(client="10.0.0.7")
    results = together(lambda: c.put_take(one, *make_take("t_c", 25)), lambda: d.put_take(two, *make_take("t_d", 25)))
    assert sum(isinstance(r, StorageFull) for r in results) == 1, results  # 2 x 0.2 MB: one passes the cap
    assert c.usage()["bytes"] <= 300_000 + 7 * 1024 * 1024  # the earlier sessions' takes, plus at most one


def _orphan(folder: Path, name: str, age_sec: float = 0.0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_bytes(b"\0" * 16)
    if age_sec:
        then = time.time() - age_sec
        os.utime(path, (then, then))
        os.utime(folder, (then, then))
    return path


def test_no_front_end_removes_files_another_may_be_writing(store_backend: StoreBackend) -> None:
    a = store_backend.open()
    sid = a.create()
    a.put_take(sid, *make_take("t_kept", 2))
    files = store_backend.files
    # What a live front end has in flight: a take's files before its row, an import's folder before its rows,
    # a temp file, its staging folder.
    young = [_orphan(files / sid, "t_inflight.pcm"), _orphan(files / sid, ".t_x.pcm.123.tmp")]
    fresh_session = files / "s_AAAAAAAAAAAAAAAAAAAAAAAA"
    _orphan(fresh_session, "t_1.pcm")
    staging = a.new_staging()
    (staging / "upload.zip").write_bytes(b"PK")
    # What a crash left long ago.
    old = [_orphan(files / sid, "t_ghost.pcm", ORPHAN_GRACE_SEC + 60)]
    old_session = files / "s_BBBBBBBBBBBBBBBBBBBBBBBB"
    _orphan(old_session, "t_1.pcm", ORPHAN_GRACE_SEC + 60)

    b = store_backend.open()  # another front end starts: a is alive
    assert all(p.exists() for p in young) and fresh_session.exists() and staging.exists()
    assert not any(p.exists() for p in old) and not old_session.exists()
    assert sorted(t.take_id for t in b.takes(sid)) == ["t_kept"]

    a.close()  # a is gone: what it left is an orphan now, whatever its age
    b.sweep_orphans()
    assert not any(p.exists() for p in young) and not fresh_session.exists() and not (files / STAGING).exists()
    assert sorted(p.name for p in (files / sid).iterdir()) == ["t_kept.codes.npy", "t_kept.pcm"]


def test_a_crashed_front_end_on_this_host_is_gone_at_once(store_backend: StoreBackend) -> None:
    a = store_backend.open()
    sid = a.create()
    stray = _orphan(store_backend.files / sid, "t_stray.pcm")
    with a.db.transaction() as tx:  # a's row as a front end whose process died would leave it
        tx.execute("UPDATE front_ends SET pid = ? WHERE id = ?", (2**22 + 12345, a.front_end))
    store_backend.open()
    assert not stray.exists()


def test_scripts_render_on_one_front_end_at_a_time(store_backend: StoreBackend) -> None:
    a, b = store_backend.open(), store_backend.open()
    sa, sb = store_backend.scripts(a), store_backend.scripts(b)
    session = a.create()
    script_id = new_script_id()
    sa.create(script_id, session, "10.0.0.1", "t", {}, [1, 2], runner=a.front_end, lease_sec=60)
    assert sb.unfinished(b.front_end) == [] and sa.unfinished(a.front_end) == [script_id]
    assert not sb.claim(script_id, b.front_end, 60)  # a holds it
    render = {"take": "t_1", "seed": 1, "text": "x", "instruction": "", "parent": None, "frame": 0}
    sa.start_render(script_id, 1, render, runner=a.front_end)
    # A director retakes a line through b: b takes the script over; a's result is no longer recorded.
    assert sb.claim(script_id, b.front_end, 60, take_over=True)
    with pytest.raises(LeaseLost):
        sa.finish_line(script_id, 1, take_id="t_1", seed=1, n_frames=4, text=None, instruction=None,
                       runner=a.front_end)  # fmt: skip
    assert sa.renew([script_id], a.front_end, 60) == [script_id]
    sb.finish_line(script_id, 1, take_id="t_2", seed=1, n_frames=4, text=None, instruction=None, runner=b.front_end)
    assert sa.get(script_id).lines[0].take_id == "t_2"
    # b stops renewing (it died): once the lease ran out, a may resume it.
    sb.claim(script_id, b.front_end, 0.0)
    assert sa.unfinished(a.front_end) == [script_id] and sa.claim(script_id, a.front_end, 60)
    sb.release(script_id, b.front_end)  # not b's any more: nothing changes
    assert sa.get(script_id).runner == a.front_end
    a.delete_session(session)
    with pytest.raises(ProtocolError) as err:
        sa.claim(script_id, a.front_end, 60)
    assert err.value.code == ErrorCode.NOT_FOUND


def test_front_ends_agree_on_one_secret(store_backend: StoreBackend) -> None:
    a, b = store_backend.open(), store_backend.open()
    results = together(lambda: a.shared_secret("owner_cookies", b"a" * 32),
                       lambda: b.shared_secret("owner_cookies", b"b" * 32))  # fmt: skip
    assert results[0] == results[1] and results[0] in (b"a" * 32, b"b" * 32)
    assert store_backend.open().shared_secret("owner_cookies", b"c" * 32) == results[0]


def test_the_lease_of_a_front_end_that_is_gone_is_free_at_once(store_backend: StoreBackend) -> None:
    a, b = store_backend.open(), store_backend.open()
    sa, sb = store_backend.scripts(a), store_backend.scripts(b)
    script_id = new_script_id()
    sa.create(script_id, a.create(), "10.0.0.1", "t", {}, [1], runner=a.front_end, lease_sec=3600)
    assert sb.unfinished(b.front_end) == []
    a.close()  # stopped (a crashed front end of this host is removed from the registry by the next one to open)
    assert sb.unfinished(b.front_end) == [script_id] and sb.claim(script_id, b.front_end, 60)


def test_a_front_end_that_does_not_share_the_files_says_so(
    postgres_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from moss_rt.session_store import open_session_store

    a = open_session_store(postgres_url, tmp_path / "shared")
    try:
        a.put_take(a.create(), *make_take("t_a", 2))
        with caplog.at_level("WARNING", logger="moss_rt.session_store"):
            b = open_session_store(postgres_url, tmp_path / "not-shared")  # its own local folder: a mistake
        b.close()
    finally:
        a.close()
    assert any("must share their files directory" in r.getMessage() for r in caplog.records)
