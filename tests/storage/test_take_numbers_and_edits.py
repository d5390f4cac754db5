"""Take numbers that are never reused, and splices and comps kept as takes (issue 27, items 1 and 2), the same on
SQLite and PostgreSQL: numbers across deletes, restarts, archives and the migration that brings them to takes
stored before; a splice or comp assembled from stored audio to the sample, with its provenance, kept across a
restart and an export/import, whole frames of codes without a crossfade and audio only with one."""

from __future__ import annotations

import time

import numpy as np
import pytest

from moss_rt.protocol import FRAME_SAMPLES, ErrorCode, ProtocolError
from moss_rt.session_records import SessionFull
from moss_rt.session_store import DB_FILE
from moss_rt.splices import parse_edit_request
from moss_rt.storage import session_schema
from moss_rt.storage.database import Database, SqliteDatabase
from moss_rt.storage.migrations import MigrationContext, migrate
from tests.storage.conftest import StoreBackend
from tests.test_session_store import make_take

F = FRAME_SAMPLES


def audio(pcm: bytes, channels: int) -> np.ndarray:
    return np.frombuffer(pcm, "<i2").reshape(-1, channels)


def edit(kind: str, parts: list[tuple[str, int, int]], **fields: object):  # noqa: ANN201 - an EditRequest
    body = {"kind": kind, "parts": [{"take": t, "from": a * F, "to": b * F} for t, a, b in parts], **fields}
    return parse_edit_request(body, max_parts=64)


def test_a_number_is_given_once_and_never_again_in_the_session(store_backend: StoreBackend) -> None:
    store = store_backend.open()
    sid, other = store.create(), store.create()
    for n in range(1, 7):
        take, codes, pcm = make_take(f"t_{n}", 2)
        assert store.put_take(sid, take, codes, pcm).number == n
    store.delete_take(sid, "t_5")
    store.delete_take(sid, "t_6")  # the newest too: its number is not given back
    again = store_backend.open()  # a restart
    assert [(t.take_id, t.number) for t in again.takes(sid)] == [(f"t_{n}", n) for n in range(1, 5)]
    take, codes, pcm = make_take("t_new", 2)
    assert again.put_take(sid, take, codes, pcm).number == 7 and again.next_number(sid) == 8
    take, codes, pcm = make_take("t_1", 3)
    assert again.put_take(sid, take, codes, pcm).number == 1  # stored again: it keeps its number
    take, codes, pcm = make_take("t_x", 2)
    assert again.put_take(other, take, codes, pcm).number == 1  # each session numbers its own


def test_a_splice_with_a_crossfade_is_kept_as_audio_only_to_the_sample(store_backend: StoreBackend) -> None:
    store = store_backend.open()
    sid = store.create(owner="cookie:a")
    old, old_codes, old_pcm = make_take("t_old", 12, channels=2)
    new, new_codes, new_pcm = make_take("t_new", 9, channels=2, parent="t_old", branch=3, seed=99)
    store.put_take(sid, old, old_codes, old_pcm)
    store.put_take(sid, new, new_codes, new_pcm)
    # The region 3-8 re-done (t_new), then t_old's tail from frame 8, with the studio's 10 ms crossfade.
    record, pcm = store.put_edit(sid, edit("splice", [("t_new", 0, 8), ("t_old", 8, 12)], crossfade=480), "t_s")
    assert (record.kind, record.number, record.n_frames, record.channels) == ("splice", 3, 12, 2)
    assert record.has_codes is False and record.crossfade == 480
    assert record.parts == [
        {"take": "t_new", "number": 2, "from": 0, "to": 8 * F},
        {"take": "t_old", "number": 1, "from": 8 * F, "to": 12 * F},
    ]
    assert record.request == new.request and record.seed == 99  # what a retake of it would start from
    a, b, out = audio(new_pcm, 2).astype(np.float64), audio(old_pcm, 2).astype(np.float64), audio(pcm, 2)
    cut = 8 * F
    assert np.array_equal(out[:cut], audio(new_pcm, 2)[:cut])
    assert np.array_equal(out[cut + 480 :], audio(old_pcm, 2)[cut + 480 :])
    w = ((np.arange(480) + 0.5) / 480)[:, None]
    expected = np.floor(a[cut : cut + 480] * (1 - w) + b[cut : cut + 480] * w + 0.5)
    assert np.array_equal(out[cut : cut + 480], expected.astype(np.int16))
    assert not (store_backend.files / sid / "t_s.codes.npy").exists()
    with pytest.raises(ValueError, match="no codes"):
        store.codes(sid, "t_s")

    again = store_backend.open()  # a restart keeps it whole
    kept = again.get_take(sid, "t_s")
    assert (kept.kind, kept.number, kept.parts, kept.crossfade, kept.has_codes) == (
        "splice", 3, record.parts, 480, False
    )  # fmt: skip
    assert again.pcm(sid, "t_s") == pcm
    # Its sources may go; it stays, and still says what it was made of.
    again.delete_take(sid, "t_old")
    assert again.get_take(sid, "t_s").parts[1]["number"] == 1 and again.pcm(sid, "t_s") == pcm


def test_a_comp_of_whole_frames_has_its_sources_codes_and_survives_an_archive(store_backend: StoreBackend) -> None:
    store = store_backend.open()
    sid = store.create(owner="cookie:a")
    one, codes1, pcm1 = make_take("t_one", 10, channels=1)
    two, codes2, pcm2 = make_take("t_two", 10, channels=2)
    store.put_take(sid, one, codes1, pcm1)
    store.put_take(sid, two, codes2, pcm2)
    store.delete_take(sid, store.put_take(sid, *make_take("t_gone", 1)).take_id)  # number 3 used, then deleted
    comp, pcm = store.put_edit(
        sid, edit("comp", [("t_two", 6, 9), ("t_one", 2, 5), ("t_two", 0, 1)], title="Comp 1", starred=True), "t_c"
    )
    assert (comp.number, comp.title, comp.starred, comp.has_codes, comp.channels) == (4, "Comp 1", True, True, 2)
    mono = audio(pcm1, 1)[2 * F : 5 * F]
    expected = np.concatenate([audio(pcm2, 2)[6 * F : 9 * F], np.repeat(mono, 2, axis=1), audio(pcm2, 2)[:F]])
    assert np.array_equal(audio(pcm, 2), expected)  # a mono part doubled, as the studio does
    assert np.array_equal(store.codes(sid, "t_c"), np.concatenate([codes2[6:9], codes1[2:5], codes2[0:1]]))
    splice, _ = store.put_edit(sid, edit("splice", [("t_c", 0, 3), ("t_one", 5, 10)], crossfade=240), "t_s")
    assert splice.number == 5 and not splice.has_codes

    archive = store.export_archive(sid)
    new_sid = store_backend.open().import_archive(archive, owner="cookie:a")
    takes = {t.number: t for t in store.takes(new_sid)}
    assert sorted(takes) == [1, 2, 4, 5] and store.next_number(new_sid) == 6  # numbers kept, 3 never reused
    ids = {n: t.take_id for n, t in takes.items()}
    assert "t_one" not in ids.values()  # take ids issued anew; the parts follow them
    assert [p["take"] for p in takes[4].parts] == [ids[2], ids[1], ids[2]]
    assert [p["take"] for p in takes[5].parts] == [ids[4], ids[1]]
    assert (takes[4].kind, takes[4].title, takes[5].kind, takes[5].crossfade) == ("comp", "Comp 1", "splice", 240)
    assert takes[5].has_codes is False and takes[4].has_codes is True
    assert store.pcm(new_sid, ids[4]) == pcm and store.pcm(new_sid, ids[5]) == store.pcm(sid, "t_s")
    assert np.array_equal(store.codes(new_sid, ids[4]), store.codes(sid, "t_c"))
    take, codes, data = make_take("t_after", 1)
    assert store.put_take(new_sid, take, codes, data).number == 6


def test_edits_are_refused_like_takes_and_for_parts_that_do_not_fit(store_backend: StoreBackend) -> None:
    store = store_backend.open(max_session_takes=3)
    sid = store.create()
    store.put_take(sid, *make_take("t_a", 4))
    store.put_take(sid, *make_take("t_b", 4))
    with pytest.raises(ProtocolError) as err:
        store.put_edit(sid, edit("comp", [("t_a", 0, 2), ("t_nope", 0, 1)]), "t_c")
    assert err.value.code == ErrorCode.NOT_FOUND and "t_nope" in err.value.message
    with pytest.raises(ProtocolError) as err:
        store.put_edit(sid, edit("comp", [("t_a", 2, 5)]), "t_c")  # past the take's 4 frames
    assert err.value.code == ErrorCode.INVALID_FIELD and err.value.field == "parts[0]"
    with pytest.raises(ProtocolError) as err:  # no audio after frame 4 of t_a to fade out
        store.put_edit(sid, edit("splice", [("t_a", 0, 4), ("t_b", 0, 4)], crossfade=480), "t_c")
    assert err.value.code == ErrorCode.INVALID_FIELD and "fade" in err.value.message
    assert store.put_edit(sid, edit("comp", [("t_a", 0, 1)]), "t_c")[0].number == 3
    with pytest.raises(SessionFull):
        store.put_edit(sid, edit("comp", [("t_a", 0, 1)]), "t_d")
    assert [t.take_id for t in store.takes(sid)] == ["t_a", "t_b", "t_c"]
    assert not (store_backend.files / sid / "t_d.pcm").exists()


def _open_database(store_backend: StoreBackend) -> Database:
    if store_backend.name == "sqlite":
        return SqliteDatabase(store_backend.files / DB_FILE)
    from moss_rt.storage.postgres import PostgresDatabase

    return PostgresDatabase(store_backend.setting)


def test_takes_stored_before_numbers_get_the_numbers_a_reload_showed(store_backend: StoreBackend) -> None:
    """A store at schema version 4 (before numbers), with a session whose takes were deleted in the middle: the
    migration numbers them in their order (as the studio showed them after a reload), and the next take after."""
    store_backend.files.mkdir(parents=True, exist_ok=True)
    db = _open_database(store_backend)
    migrate(db, session_schema.COMPONENT, session_schema.MIGRATIONS[:4], MigrationContext(store_backend.files))
    now = time.time()
    with db.transaction() as tx:
        for sid in ("s_" + "a" * 20, "s_" + "b" * 20):
            tx.execute("INSERT INTO sessions (id, created, updated) VALUES (?, ?, ?)", (sid, now, now))
        for sid, take_id, seq in [("a", "t_1", 1), ("a", "t_2", 2), ("a", "t_4", 4), ("b", "t_9", 7)]:
            tx.execute(
                "INSERT INTO takes (session_id, take_id, seq, branch_frame, seed, request, n_frames, channels, stats,"
                " created) VALUES (?, ?, ?, 0, '1', '{}', 1, 1, '{}', ?)",
                ("s_" + sid * 20, take_id, seq, now),
            )
    db.close()
    store = store_backend.open()
    assert [(t.take_id, t.number) for t in store.takes("s_" + "a" * 20)] == [("t_1", 1), ("t_2", 2), ("t_4", 3)]
    assert store.next_number("s_" + "a" * 20) == 4 and store.next_number("s_" + "b" * 20) == 2
    assert all(t.kind == "take" and t.has_codes and t.parts == [] for t in store.takes("s_" + "b" * 20))
