"""The script tables beside the session store: migrations applied once, records as written, renders that resume,
and a deleted session taking its scripts with it."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from moss_rt.protocol import ProtocolError
from moss_rt.scripts.store import MIGRATIONS, ScriptStore, new_script_id
from moss_rt.session_store import SessionStore


@pytest.fixture
def stores(tmp_path: Path) -> tuple[SessionStore, ScriptStore]:
    sessions = SessionStore(tmp_path / "sessions")
    scripts = ScriptStore(tmp_path / "sessions" / "sessions.sqlite3")
    yield sessions, scripts
    scripts.close()
    sessions.close()


def test_migrations_are_versioned_and_applied_once(tmp_path: Path) -> None:
    sessions = SessionStore(tmp_path)
    path = tmp_path / "sessions.sqlite3"
    first = ScriptStore(path)
    assert first.schema_version == len(MIGRATIONS)
    session = sessions.create()
    first.create(new_script_id(), session, "10.0.0.1", "t", {"lines": []}, [1, 2])
    first.close()
    again = ScriptStore(path)  # opening it again changes nothing and keeps the rows
    assert again.schema_version == len(MIGRATIONS) and len(again.unfinished()) == 1
    again.close()
    with sqlite3.connect(path) as db:
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        assert {"scripts", "script_lines", "schema_migrations", "sessions", "takes"} <= tables
        applied = db.execute("SELECT version FROM schema_migrations WHERE component = 'scripts'").fetchall()
        assert sorted(v for (v,) in applied) == list(range(1, len(MIGRATIONS) + 1))
    sessions.close()


def test_a_database_of_the_first_version_is_adopted_upgraded_and_keeps_its_scripts(tmp_path: Path) -> None:
    sessions = SessionStore(tmp_path)
    path = tmp_path / "sessions.sqlite3"
    session = sessions.create()
    # The tables as the first version made them, with a script in them, versioned by the older bookkeeping.
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE script_schema (version INTEGER NOT NULL)")
        db.execute("INSERT INTO script_schema (version) VALUES (1)")
        db.executescript(str(MIGRATIONS[0].sqlite))
        db.execute(
            "INSERT INTO scripts (id, session_id, owner, title, source, created, updated)"
            " VALUES ('sc_old_one_of_version_1', ?, '10.0.0.9', 'Old', '{}', 1, 1)",
            (session,),
        )
        db.execute(
            "INSERT INTO script_lines (script_id, line, status, seed, updated)"
            " VALUES ('sc_old_one_of_version_1', 1, 'pending', 5, 1)"
        )
    store = ScriptStore(path)
    assert store.schema_version == len(MIGRATIONS) == 3  # version 1 adopted; the rename and the leases applied
    row = store.get("sc_old_one_of_version_1")
    assert (row.client, row.title, [x.seed for x in row.lines]) == ("10.0.0.9", "Old", [5])  # the address it had
    assert store.unfinished() == ["sc_old_one_of_version_1"]
    store.close()
    with sqlite3.connect(path) as db:
        indexes = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
        assert "scripts_by_client" in indexes and "scripts_by_owner" not in indexes
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        assert "script_schema" not in tables  # one bookkeeping: schema_migrations
    sessions.close()


def test_lines_record_renders_results_and_failures(stores: tuple[SessionStore, ScriptStore]) -> None:
    sessions, scripts = stores
    session = sessions.create()
    script_id = new_script_id()
    scripts.create(script_id, session, "10.0.0.7", "Title", {"lines": ["…"]}, [11, 22, 33])
    row = scripts.get(script_id)
    assert (row.session_id, row.client, row.title, row.failure) == (session, "10.0.0.7", "Title", None)
    assert [(x.line, x.status, x.seed, x.attempts) for x in row.lines] == [
        (1, "pending", 11, 0), (2, "pending", 22, 0), (3, "pending", 33, 0),
    ]  # fmt: skip
    render = {"take": "t_one", "seed": 11, "text": "x", "instruction": "", "parent": None, "frame": 0}
    scripts.start_render(script_id, 1, render)
    assert scripts.get(script_id).lines[0].render == render and scripts.get(script_id).lines[0].attempts == 1
    scripts.finish_line(script_id, 1, take_id="t_one", seed=11, n_frames=40, text=None, instruction=None)
    scripts.fail_line(script_id, 2, "refused", keep_take=False)
    line1, line2, _ = scripts.get(script_id).lines
    assert (line1.status, line1.take_id, line1.n_frames, line1.render) == ("done", "t_one", 40, None)
    assert (line2.status, line2.error) == ("failed", "refused")
    assert scripts.unfinished() == [script_id]  # line 3 is still pending
    # A retake queued on a done line keeps the script unfinished until it is made.
    scripts.finish_line(script_id, 3, take_id="t_three", seed=33, n_frames=20, text="new words", instruction="low")
    assert scripts.unfinished() == []
    scripts.queue_render(script_id, 3, {**render, "take": "t_again"})
    assert scripts.unfinished() == [script_id]
    scripts.fail_line(script_id, 3, "the retake failed: refused", keep_take=True)
    line3 = scripts.get(script_id).lines[2]
    assert (line3.status, line3.take_id, line3.text, line3.error) == ("done", "t_three", "new words",
                                                                        "the retake failed: refused")  # fmt: skip
    scripts.fail_script(script_id, "gone")
    assert scripts.get(script_id).failure == "gone"
    with pytest.raises(ProtocolError) as info:
        scripts.finish_line("sc_" + "x" * 20, 1, take_id="t", seed=1, n_frames=1, text=None, instruction=None)
    assert info.value.field == "script"


def test_deleting_a_session_deletes_its_scripts(stores: tuple[SessionStore, ScriptStore]) -> None:
    sessions, scripts = stores
    keep, drop = sessions.create(), sessions.create()
    kept, dropped = new_script_id(), new_script_id()
    scripts.create(kept, keep, "o", "", {}, [1])
    scripts.create(dropped, drop, "o", "", {}, [1, 2])
    sessions.delete_session(drop)
    assert scripts.exists(kept) and not scripts.exists(dropped)
    with pytest.raises(ProtocolError):
        scripts.get(dropped)
    assert [r.script_id for r in scripts.of_session(keep)] == [kept]
    scripts.delete(kept)
    assert not scripts.exists(kept)
    with pytest.raises(ProtocolError):
        scripts.delete(kept)
