"""The session store: takes that survive a restart, a per-session quota, notes, archives (pure unit tests)."""

from __future__ import annotations

import io
import json
import wave
import zipfile
from pathlib import Path

import numpy as np
import pytest

from moss_rt.protocol import FRAME_SAMPLES, ErrorCode, Limits, ProtocolError, StartTake
from moss_rt.session_records import SessionFull, StoredTake
from moss_rt.session_store import SessionStore


def make_take(
    take_id: str, frames: int, *, channels: int = 1, parent: str | None = None, branch: int = 0, seed: int = 7
):
    rng = np.random.default_rng(abs(hash(take_id)) % 2**32)
    codes = rng.integers(0, 1024, size=(frames, 12), dtype=np.int64)
    pcm = rng.integers(-32768, 32767, size=frames * FRAME_SAMPLES * channels, dtype=np.int16).tobytes()
    request = StartTake(text=f"line of {take_id}", seed=seed, channels=channels).to_dict()
    take = StoredTake(
        take_id=take_id, request=request, seed=seed, n_frames=frames, channels=channels, parent=parent,
        branch_frame=branch, reason="done", stats={"ttfa_ms": 52.5},
    )  # fmt: skip
    return take, codes, pcm


def test_takes_survive_a_restart_in_order_with_their_audio_and_codes(tmp_path: Path) -> None:
    store = SessionStore(tmp_path)
    sid = store.create()
    one, codes1, pcm1 = make_take("t_one", 5)
    two, codes2, pcm2 = make_take("t_two", 8, channels=2, parent="t_one", branch=3, seed=2**63 - 1)
    store.put_take(sid, one, codes1, pcm1)
    store.put_take(sid, two, codes2, pcm2)
    store.close()

    again = SessionStore(tmp_path)  # a restart
    assert again.exists(sid)
    takes = again.takes(sid)
    assert [t.take_id for t in takes] == ["t_one", "t_two"] and [t.seq for t in takes] == [1, 2]
    assert takes[1].parent == "t_one" and takes[1].branch_frame == 3 and takes[1].channels == 2
    assert takes[1].seed == 2**63 - 1  # 64-bit seeds stay exact
    assert StartTake.parse(takes[0].request, Limits()).text == "line of t_one"  # the request comes back whole
    assert np.array_equal(again.codes(sid, "t_two"), codes2)
    assert again.pcm(sid, "t_one") == pcm1
    assert takes[0].stats == {"ttfa_ms": 52.5}


def test_unknown_sessions_and_takes_are_not_found(tmp_path: Path) -> None:
    store = SessionStore(tmp_path)
    for bad in ("", "s_nope", "../etc", "s_" + "A" * 24):
        assert not store.exists(bad)
        with pytest.raises(ProtocolError) as err:
            store.takes(bad)
        assert err.value.code == ErrorCode.NOT_FOUND
    sid = store.create()
    with pytest.raises(ProtocolError) as err:
        store.pcm(sid, "t_missing")
    assert err.value.code == ErrorCode.NOT_FOUND and err.value.field == "take"


def test_a_full_session_refuses_with_a_clear_message_and_deleting_makes_room(tmp_path: Path) -> None:
    store = SessionStore(tmp_path, max_session_takes=2)
    sid = store.create()
    for name in ("t_a", "t_b"):
        store.put_take(sid, *make_take(name, 2))
    with pytest.raises(SessionFull) as err:
        store.put_take(sid, *make_take("t_c", 2))
    assert err.value.code == ErrorCode.TOO_LARGE and "2 takes" in err.value.message and "delete" in err.value.message
    assert [t.take_id for t in store.takes(sid)] == ["t_a", "t_b"]  # nothing dropped silently
    store.delete_take(sid, "t_a")
    assert not (tmp_path / sid / "t_a.pcm").exists()
    store.put_take(sid, *make_take("t_c", 2))
    assert [t.take_id for t in store.takes(sid)] == ["t_b", "t_c"]


def test_notes_are_validated_and_kept(tmp_path: Path) -> None:
    store = SessionStore(tmp_path)
    sid = store.create()
    store.put_take(sid, *make_take("t_a", 3))
    t = store.update_notes(
        sid, "t_a", title="Keeper", starred=True, note="the good one", markers=[{"sample": 3840, "label": "breath"}]
    )
    assert (t.title, t.starred, t.note, t.markers) == (
        "Keeper",
        True,
        "the good one",
        [{"sample": 3840, "label": "breath"}],
    )
    for bad in (
        {"starred": "yes"},
        {"title": "x" * 81},
        {"markers": [{"sample": -1, "label": "x"}]},
        {"colour": "red"},
    ):
        with pytest.raises(ProtocolError) as err:
            store.update_notes(sid, "t_a", **bad)
        assert err.value.code == ErrorCode.INVALID_FIELD
    assert SessionStore(tmp_path).get_take(sid, "t_a").title == "Keeper"


def test_a_crash_between_files_and_record_leaves_no_half_take(tmp_path: Path) -> None:
    store = SessionStore(tmp_path)
    sid = store.create()
    store.put_take(sid, *make_take("t_a", 2))
    # What a crash after the files and before the row leaves behind, plus a temp file of an interrupted write.
    (tmp_path / sid / "t_ghost.pcm").write_bytes(b"\0" * 10)
    (tmp_path / sid / ".t_a.pcm.123.tmp").write_bytes(b"\0")
    store.close()
    again = SessionStore(tmp_path)
    assert sorted(p.name for p in (tmp_path / sid).iterdir()) == ["t_a.codes.npy", "t_a.pcm"]
    assert [t.take_id for t in again.takes(sid)] == ["t_a"]


def test_a_take_whose_audio_does_not_match_its_frames_is_refused(tmp_path: Path) -> None:
    store = SessionStore(tmp_path)
    sid = store.create()
    take, codes, pcm = make_take("t_a", 4)
    with pytest.raises(ValueError):
        store.put_take(sid, take, codes, pcm[:-2])
    assert store.takes(sid) == [] and not (tmp_path / sid / "t_a.pcm").exists()


def test_export_then_import_gives_an_equal_session_with_new_take_ids(tmp_path: Path) -> None:
    store = SessionStore(tmp_path / "a")
    sid = store.create()
    store.put_take(sid, *make_take("t_one", 4))
    store.put_take(sid, *make_take("t_two", 6, channels=2, parent="t_one", branch=2))
    store.update_notes(sid, "t_two", title="B", starred=True)
    archive = store.export_archive(sid)

    with zipfile.ZipFile(io.BytesIO(archive)) as z:
        names = sorted(z.namelist())
        assert names == [
            "session.json",
            "takes/t_one.codes.npy",
            "takes/t_one.wav",
            "takes/t_two.codes.npy",
            "takes/t_two.wav",
        ]
        with z.open("takes/t_two.wav") as f, wave.open(f) as w:
            assert (w.getframerate(), w.getnchannels(), w.getnframes()) == (48000, 2, 6 * FRAME_SAMPLES)
        assert json.loads(z.read("session.json"))["moss_rt_session"] == 1

    other = SessionStore(tmp_path / "b")  # another service
    new = other.import_archive(archive)
    assert new != sid
    a, b = store.takes(sid), other.takes(new)
    assert [t.take_id for t in b] != [t.take_id for t in a]
    assert b[1].parent == b[0].take_id and b[1].branch_frame == 2  # lineage follows the new ids
    assert (b[1].title, b[1].starred) == ("B", True)
    for x, y in zip(a, b, strict=True):
        assert x.request == y.request and x.seed == y.seed and x.n_frames == y.n_frames
        assert store.pcm(sid, x.take_id) == other.pcm(new, y.take_id)
        assert np.array_equal(store.codes(sid, x.take_id), other.codes(new, y.take_id))


@pytest.mark.parametrize(
    ("archive", "words"),
    [
        (b"not a zip", "not a zip file"),
        ("no-manifest", "session.json is missing"),
        ("wrong-version", "unknown version"),
        ("missing-audio", "missing or damaged"),
    ],
)
def test_bad_archives_are_refused_and_leave_nothing(tmp_path: Path, archive: bytes | str, words: str) -> None:
    store = SessionStore(tmp_path)
    if isinstance(archive, str):
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as z:
            if archive == "wrong-version":
                z.writestr("session.json", json.dumps({"moss_rt_session": 99, "takes": []}))
            elif archive == "missing-audio":
                z.writestr(
                    "session.json",
                    json.dumps({"moss_rt_session": 1, "takes": [{"take_id": "t_x", "request": {}, "seed": 1}]}),
                )
            else:
                z.writestr("other.txt", "hello")
        archive = buf.getvalue()
    with pytest.raises(ProtocolError) as err:
        store.import_archive(archive)
    assert err.value.code == ErrorCode.INVALID_FIELD and words in err.value.message
    assert [p for p in tmp_path.iterdir() if p.is_dir()] == []
