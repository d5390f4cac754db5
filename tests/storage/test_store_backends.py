"""The session store behaves the same on SQLite and PostgreSQL: takes that survive a restart, notes, owners and
shares, quotas, retention, words, archives (an import whole or not at all), script records, migrations."""

from __future__ import annotations

import io
import json
import time
import zipfile

import numpy as np
import pytest

from moss_rt.protocol import ErrorCode, Limits, ProtocolError, StartTake
from moss_rt.scripts.store import MIGRATIONS as SCRIPT_MIGRATIONS
from moss_rt.scripts.store import new_script_id
from moss_rt.session_records import SessionFull, StorageFull
from moss_rt.session_store import SessionStore, StoreBudget
from moss_rt.storage import session_schema
from moss_rt.storage.database import StoreConfigError
from moss_rt.storage.migrations import version
from tests.storage.conftest import StoreBackend
from tests.test_session_store import make_take

MB = 1024 * 1024


def test_takes_survive_a_restart_with_their_audio_codes_notes_and_words(store_backend: StoreBackend) -> None:
    store = store_backend.open()
    sid = store.create(owner="cookie:a", client="10.0.0.1")
    one, codes1, pcm1 = make_take("t_one", 5)
    two, codes2, pcm2 = make_take("t_two", 8, channels=2, parent="t_one", branch=3, seed=2**63 - 1)
    store.put_take(sid, one, codes1, pcm1)
    store.put_take(sid, two, codes2, pcm2)
    store.update_notes(sid, "t_two", title="Keeper", starred=True, markers=[{"sample": 3840, "label": "breath"}])
    words = [{"word": "line", "start": 0.1, "end": 0.4, "chars": [0, 4]}]
    store.put_words(sid, "t_one", words, "pocketsphinx")
    store.close()

    again = store_backend.open()  # a restart (or another front end)
    takes = again.takes(sid)
    assert [t.take_id for t in takes] == ["t_one", "t_two"] and [t.seq for t in takes] == [1, 2]
    assert takes[1].parent == "t_one" and takes[1].branch_frame == 3 and takes[1].channels == 2
    assert takes[1].seed == 2**63 - 1  # 64-bit seeds stay exact
    assert (takes[1].title, takes[1].starred) == ("Keeper", True)
    assert takes[1].markers == [{"sample": 3840, "label": "breath"}]
    assert StartTake.parse(takes[0].request, Limits()).text == "line of t_one" and takes[0].stats == {"ttfa_ms": 52.5}
    assert np.array_equal(again.codes(sid, "t_two"), codes2) and again.pcm(sid, "t_one") == pcm1
    assert again.words(sid, "t_one") == words and again.words(sid, "t_two") is None
    again.put_take(sid, one, codes1, pcm1)  # storing a take again keeps its words
    assert again.words(sid, "t_one") == words and again.count(sid) == 2
    again.delete_take(sid, "t_one")
    assert [t.take_id for t in again.takes(sid)] == ["t_two"]
    assert not (store_backend.files / sid / "t_one.pcm").exists()
    with pytest.raises(ProtocolError) as err:
        again.words(sid, "t_one")
    assert err.value.code == ErrorCode.NOT_FOUND
    listed = again.list_sessions("cookie:a")
    assert [(s["session"], s["takes"]) for s in listed] == [(sid, 1)] and listed[0]["bytes"] == again.usage()["bytes"]


def test_owners_shares_and_unknown_ids(store_backend: StoreBackend) -> None:
    store = store_backend.open()
    sid = store.create(owner="cookie:a")
    store.check_access(sid, "cookie:a")
    for who in ("cookie:b", None):
        with pytest.raises(ProtocolError) as err:
            store.check_access(sid, who)
        assert err.value.code == ErrorCode.NOT_FOUND
    token = store.share(sid)
    assert store.share(sid) == token == store.shared_token(sid)
    store.check_access(sid, "cookie:b", share=token)
    assert store.unshare(sid) and not store.unshare(sid)
    with pytest.raises(ProtocolError):
        store.check_access(sid, "cookie:b", share=token)
    legacy = store.create()  # no owner (as before owners existed): the first identity adopts it
    store.check_access(legacy, "cookie:b")
    with pytest.raises(ProtocolError):
        store.check_access(legacy, "cookie:a")
    for bad in ("", "s_nope", "../etc", "s_" + "A" * 24):
        assert not store.exists(bad)
        with pytest.raises(ProtocolError):
            store.takes(bad)


def test_quotas_takes_sessions_and_bytes(store_backend: StoreBackend) -> None:
    budget = StoreBudget(max_sessions=3, max_sessions_per_client=2, max_bytes_per_client=MB, reserve_free_bytes=0)
    store = store_backend.open(max_session_takes=2, budget=budget)
    sid = store.create(client="10.0.0.1")
    store.put_take(sid, *make_take("t_a", 2))
    store.put_take(sid, *make_take("t_b", 2))
    with pytest.raises(SessionFull):
        store.put_take(sid, *make_take("t_c", 2))
    store.create(client="10.0.0.1")
    with pytest.raises(ProtocolError) as err:
        store.create(client="10.0.0.1")
    assert err.value.code == ErrorCode.RATE_LIMITED
    big = store.create(client="10.0.0.2")
    with pytest.raises(StorageFull):
        store.create(client="10.0.0.3")  # max_sessions in all
    store.put_take(big, *make_take("t_big", 60))  # 0.47 MB
    with pytest.raises(StorageFull):
        store.put_take(big, *make_take("t_more", 80))  # past this client's MB
    assert [t.take_id for t in store.takes(big)] == ["t_big"]
    assert sorted(p.name for p in (store_backend.files / big).iterdir()) == ["t_big.codes.npy", "t_big.pcm"]
    assert store.usage()["sessions"] == 3


def test_retention_deletes_what_was_not_used_since(store_backend: StoreBackend) -> None:
    store = store_backend.open()
    old, used = store.create(), store.create()
    store.put_take(old, *make_take("t_a", 1))
    cutoff = time.time()
    store.touch(used)
    assert store.expire(cutoff) == 1
    assert not store.exists(old) and store.exists(used) and not (store_backend.files / old).exists()


def test_export_then_import_and_a_failed_import_leaves_nothing(
    store_backend: StoreBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = store_backend.open()
    sid = store.create(owner="cookie:a")
    store.put_take(sid, *make_take("t_one", 4))
    store.put_take(sid, *make_take("t_two", 6, channels=2, parent="t_one", branch=2))
    store.update_notes(sid, "t_two", title="B", starred=True)
    archive = store.export_archive(sid)
    with zipfile.ZipFile(io.BytesIO(archive)) as z:
        assert json.loads(z.read("session.json"))["moss_rt_session"] == 1

    new = store.import_archive(archive, owner="cookie:b", client="10.0.0.9")
    a, b = store.takes(sid), store.takes(new)
    assert b[1].parent == b[0].take_id and (b[1].title, b[1].starred) == ("B", True)
    for x, y in zip(a, b, strict=True):
        assert store.pcm(sid, x.take_id) == store.pcm(new, y.take_id)
        assert np.array_equal(store.codes(sid, x.take_id), store.codes(new, y.take_id))
    store.check_access(new, "cookie:b")

    # A failure inside the records' transaction (the second take's row): no session, no folder, no staging.
    real, seen = SessionStore._insert_take, [0]

    def failing(self: SessionStore, *args: object) -> None:
        seen[0] += 1
        if seen[0] == 2:
            raise OSError("the database went away")
        real(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(SessionStore, "_insert_take", failing)
    before = store.usage()["sessions"]
    with pytest.raises(OSError):
        store.import_archive(archive)
    assert store.usage()["sessions"] == before
    folders = sorted(p.name for p in store_backend.files.iterdir() if p.is_dir())
    assert folders == sorted([sid, new])


def test_text_the_database_cannot_keep_is_a_clear_error(store_backend: StoreBackend) -> None:
    store = store_backend.open()
    sid = store.create()
    store.put_take(sid, *make_take("t_a", 1))
    for bad in ("nul\x00inside", "lone \ud800 surrogate"):
        with pytest.raises(ProtocolError) as err:
            store.update_notes(sid, "t_a", note=bad)
        assert err.value.code == ErrorCode.INVALID_FIELD
    assert store.get_take(sid, "t_a").note == ""


def test_script_records_and_their_session(store_backend: StoreBackend) -> None:
    sessions = store_backend.open()
    scripts = store_backend.scripts(sessions)
    keep, drop = sessions.create(), sessions.create()
    script_id = new_script_id()
    scripts.create(script_id, keep, "10.0.0.1", "Title", {"lines": []}, [11, 2**62])
    render = {"take": "t_one", "seed": 11, "text": "x", "instruction": "", "parent": None, "frame": 0}
    scripts.start_render(script_id, 1, render)
    scripts.finish_line(script_id, 1, take_id="t_one", seed=11, n_frames=40, text=None, instruction=None)
    row = scripts.get(script_id)
    assert (row.client, row.title) == ("10.0.0.1", "Title")
    assert [(x.status, x.seed, x.attempts) for x in row.lines] == [("done", 11, 1), ("pending", 2**62, 0)]
    assert scripts.unfinished() == [script_id]
    dropped = new_script_id()
    scripts.create(dropped, drop, "10.0.0.1", "", {}, [1])
    sessions.delete_session(drop)
    assert not scripts.exists(dropped) and scripts.exists(script_id)


def test_migrations_are_recorded_once_and_a_newer_schema_is_refused(store_backend: StoreBackend) -> None:
    store = store_backend.open()
    store_backend.scripts(store)
    assert version(store.db, session_schema.COMPONENT) == len(session_schema.MIGRATIONS)
    assert version(store.db, "scripts") == len(SCRIPT_MIGRATIONS)
    again = store_backend.open()  # opening again applies nothing
    store_backend.scripts(again)
    rows = store.db.query("SELECT component, version FROM schema_migrations ORDER BY component, version")
    assert len(rows) == len(session_schema.MIGRATIONS) + len(SCRIPT_MIGRATIONS)
    with store.db.transaction() as tx:  # what a newer release would leave behind
        tx.execute(
            "INSERT INTO schema_migrations (component, version, name, applied) VALUES (?, ?, ?, ?)",
            (session_schema.COMPONENT, len(session_schema.MIGRATIONS) + 1, "from the future", 0.0),
        )
    with pytest.raises(StoreConfigError, match="newer than this moss_rt knows"):
        store_backend.open()


def test_both_backends_have_the_same_migrations() -> None:
    for migrations in (session_schema.MIGRATIONS, SCRIPT_MIGRATIONS):
        for m in migrations:
            assert m.sqlite and m.postgresql, m.name


def test_the_store_setting_is_checked_before_anything_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    from moss_rt.session_store import check_store_setting
    from moss_rt.storage.url import POSTGRESQL, SQLITE, parse_store_setting, redact_url

    assert parse_store_setting("").backend == SQLITE and parse_store_setting("sqlite").backend == SQLITE
    for url in ("postgresql://moss@db:5432/moss_rt", "postgres://db/x", "host=/run/postgresql dbname=moss"):
        assert parse_store_setting(url).backend == POSTGRESQL
    with pytest.raises(StoreConfigError, match="expected empty") as err:
        check_store_setting("mysql://moss:hunter2@db/x")
    assert "hunter2" not in str(err.value)  # a password never reaches a message or a log
    assert redact_url("postgresql://moss:hunter2@db:5432/x?sslmode=require") == (
        "postgresql://moss:***@db:5432/x?sslmode=require"
    )
    assert "hunter2" not in redact_url("host=db password=hunter2 dbname=x")
    monkeypatch.setitem(__import__("sys").modules, "psycopg", None)  # the driver not installed
    with pytest.raises(StoreConfigError, match="requirements-cluster.txt"):
        check_store_setting("postgresql://moss@db/x")
