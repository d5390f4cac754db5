"""Directing sessions that survive a reload, a reconnect or a restart: their takes on disk in the data dir.

A session is an unguessable id (it is the capability to read it, like a take id) owning takes: each take's
parameters (the start request), seed, lineage, end reason and stats, the director's notes (name, star, note,
markers), its codes (so a retake of it can rebuild the model and codec state from them) and the audio as it was
heard. Records live in one SQLite database (the standard library's ``sqlite3``); the codes and audio of a take are
two files beside it:

    <root>/sessions.sqlite3
    <root>/<session id>/<take id>.pcm        int16 little-endian, interleaved when stereo (as streamed)
    <root>/<session id>/<take id>.codes.npy  [n_frames, 12] int64

Writes are atomic: a take's files are written first (temp file, fsync, rename), then its row in one transaction,
so a crash leaves at most an orphan file (swept when the store opens), never a record without its audio.

A session holds at most ``max_takes`` takes; one more is refused with a clear message (``SessionFull``), never
dropped silently. Sessions travel as one archive (``export_archive`` / ``import_archive``): a zip with
``session.json`` (the records), ``takes/<take id>.wav`` (the heard audio, playable anywhere) and
``takes/<take id>.codes.npy``.

Sans-I/O in the aiohttp sense: no event loop, no sockets. Every call blocks on the disk; the web layer runs them
on a worker thread. One lock serialises them (SQLite connection shared across threads).
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import re
import secrets
import shutil
import sqlite3
import threading
import time
import wave
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moss_rt.audio import wav_bytes
from moss_rt.protocol import FRAME_SAMPLES, N_CODEBOOKS, SAMPLE_RATE, ErrorCode, ProtocolError
from moss_rt.voices import atomic_write

log = logging.getLogger(__name__)

ARCHIVE_VERSION = 1
SESSION_ID = re.compile(r"^s_[A-Za-z0-9_-]{16,64}$")
TAKE_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
NOTE_FIELDS = ("title", "starred", "note", "markers")
MAX_TITLE = 80
MAX_NOTE = 2000
MAX_MARKERS = 200

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS takes (
    session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
    take_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    parent TEXT,
    branch_frame INTEGER NOT NULL,
    seed TEXT NOT NULL,
    request TEXT NOT NULL,
    reason TEXT,
    n_frames INTEGER NOT NULL,
    channels INTEGER NOT NULL,
    stats TEXT NOT NULL,
    title TEXT NOT NULL DEFAULT '',
    starred INTEGER NOT NULL DEFAULT 0,
    note TEXT NOT NULL DEFAULT '',
    markers TEXT NOT NULL DEFAULT '[]',
    created REAL NOT NULL,
    PRIMARY KEY (session_id, take_id)
);
"""


# Word timings of stored takes (moss_rt.align), added after the first release: a table of its own, created when an
# older database is opened, so old databases keep working and a take without a row is aligned on demand.
_WORDS_SCHEMA = """
CREATE TABLE IF NOT EXISTS take_words (
    session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
    take_id TEXT NOT NULL,
    aligner TEXT NOT NULL,
    words TEXT NOT NULL,
    created REAL NOT NULL,
    PRIMARY KEY (session_id, take_id)
);
"""


def new_session_id() -> str:
    return "s_" + secrets.token_urlsafe(18)


class SessionFull(ProtocolError):
    def __init__(self, max_takes: int) -> None:
        super().__init__(
            ErrorCode.TOO_LARGE,
            f"this session already keeps {max_takes} takes, the most one session may; delete takes you no longer "
            "need (or export the session and start a new one) to record more",
        )


@dataclass
class StoredTake:
    """One take of a session as stored: everything needed to list, play, download and retake it."""

    take_id: str
    request: dict[str, Any]  # StartTake.to_dict(): the take's own direction and parameters
    seed: int
    n_frames: int
    channels: int
    parent: str | None = None
    branch_frame: int = 0  # frames [0, branch_frame) came from the parent
    reason: str | None = None
    stats: dict[str, float] = field(default_factory=dict)
    title: str = ""
    starred: bool = False
    note: str = ""
    markers: list[dict[str, Any]] = field(default_factory=list)  # [{"sample": int, "label": str}]
    created: float = field(default_factory=time.time)
    seq: int = 0  # order within the session (assigned by the store)

    def public(self) -> dict[str, Any]:
        """The record as sent to a client (``resume``) and written to an archive's session.json."""
        return {**dataclasses.asdict(self), "seed": self.seed}


def _check_notes(notes: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in notes.items():
        if key not in NOTE_FIELDS:
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"unknown take note {key!r}", field=key)
        if key == "starred":
            if not isinstance(value, bool):
                raise ProtocolError(ErrorCode.INVALID_FIELD, "'starred' must be true or false", field=key)
        elif key == "markers":
            if not isinstance(value, list) or len(value) > MAX_MARKERS:
                raise ProtocolError(
                    ErrorCode.INVALID_FIELD, f"'markers' must be a list of at most {MAX_MARKERS}", field=key
                )
            for m in value:
                if not (
                    isinstance(m, dict)
                    and isinstance(m.get("sample"), int)
                    and m["sample"] >= 0
                    and isinstance(m.get("label"), str)
                    and len(m["label"]) <= MAX_TITLE
                ):
                    raise ProtocolError(
                        ErrorCode.INVALID_FIELD, "a marker is {'sample': int >= 0, 'label': short text}", field=key
                    )
            value = [{"sample": m["sample"], "label": m["label"]} for m in value]
        else:
            limit = MAX_TITLE if key == "title" else MAX_NOTE
            if not isinstance(value, str) or len(value) > limit:
                raise ProtocolError(
                    ErrorCode.INVALID_FIELD, f"{key!r} must be text of at most {limit} characters", field=key
                )
        out[key] = value
    return out


class SessionStore:
    """Sessions and their takes under ``root`` (created if missing)."""

    def __init__(self, root: Path, *, max_takes: int = 500) -> None:
        self.root = Path(root)
        self.max_takes = max_takes
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.root / "sessions.sqlite3", check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # a committed take survives a power cut
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.executescript(_SCHEMA)
        self._db.executescript(_WORDS_SCHEMA)
        self._sweep_orphans()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # ------------------------------------------------------------------ sessions
    def create(self) -> str:
        session_id = new_session_id()
        now = time.time()
        with self._tx() as db:
            db.execute("INSERT INTO sessions (id, created, updated) VALUES (?, ?, ?)", (session_id, now, now))
        return session_id

    def exists(self, session_id: str) -> bool:
        if not SESSION_ID.match(session_id or ""):
            return False
        with self._lock:
            row = self._db.execute("SELECT 1 FROM sessions WHERE id = ?", (session_id,)).fetchone()
        return row is not None

    def require(self, session_id: str) -> None:
        if not self.exists(session_id):
            raise ProtocolError(ErrorCode.NOT_FOUND, "no such session (it may have been deleted)", field="session")

    def delete_session(self, session_id: str) -> None:
        self.require(session_id)
        with self._tx() as db:
            db.execute("DELETE FROM sessions WHERE id = ?", (session_id,))
        shutil.rmtree(self._dir(session_id), ignore_errors=True)

    # ------------------------------------------------------------------ takes
    def put_take(self, session_id: str, take: StoredTake, codes: np.ndarray, pcm: bytes) -> StoredTake:
        """Store a finished take (its files, then its record); refused when the session is full."""
        self.require(session_id)
        if not TAKE_ID.match(take.take_id):
            raise ProtocolError(ErrorCode.INVALID_FIELD, "bad take id", field="take")
        codes = np.asarray(codes, dtype=np.int64).reshape(-1, N_CODEBOOKS)
        if codes.shape[0] != take.n_frames or len(pcm) != take.n_frames * FRAME_SAMPLES * take.channels * 2:
            raise ValueError(
                f"take {take.take_id}: {codes.shape[0]} frames of codes and {len(pcm)} PCM bytes"
                f" for {take.n_frames} frames"
            )
        with self._lock:
            count = self._db.execute("SELECT COUNT(*) FROM takes WHERE session_id = ?", (session_id,)).fetchone()[0]
            known = self._db.execute(
                "SELECT 1 FROM takes WHERE session_id = ? AND take_id = ?", (session_id, take.take_id)
            ).fetchone()
        if known is None and count >= self.max_takes:
            raise SessionFull(self.max_takes)
        buf = io.BytesIO()
        np.save(buf, codes, allow_pickle=False)
        atomic_write(self._pcm_path(session_id, take.take_id), pcm)
        atomic_write(self._codes_path(session_id, take.take_id), buf.getvalue())
        with self._tx() as db:
            seq = db.execute(
                "SELECT COALESCE(MAX(seq), 0) + 1 FROM takes WHERE session_id = ?", (session_id,)
            ).fetchone()[0]
            take = dataclasses.replace(take, seq=take.seq or seq)
            db.execute(
                "INSERT OR REPLACE INTO takes (session_id, take_id, seq, parent, branch_frame, seed, request, reason,"
                " n_frames, channels, stats, title, starred, note, markers, created)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    session_id, take.take_id, take.seq, take.parent, take.branch_frame, str(take.seed),
                    json.dumps(take.request), take.reason, take.n_frames, take.channels, json.dumps(take.stats),
                    take.title, int(take.starred), take.note, json.dumps(take.markers), take.created,
                ),
            )  # fmt: skip
            db.execute("UPDATE sessions SET updated = ? WHERE id = ?", (time.time(), session_id))
        return take

    def takes(self, session_id: str) -> list[StoredTake]:
        self.require(session_id)
        with self._lock:
            rows = self._db.execute("SELECT * FROM takes WHERE session_id = ? ORDER BY seq", (session_id,)).fetchall()
        return [self._take_of(row) for row in rows]

    def count(self, session_id: str) -> int:
        self.require(session_id)
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM takes WHERE session_id = ?", (session_id,)).fetchone()[0])

    def check_room(self, session_id: str) -> None:
        """Refuse (SessionFull) before a take is generated that the session could not keep."""
        if self.count(session_id) >= self.max_takes:
            raise SessionFull(self.max_takes)

    def get_take(self, session_id: str, take_id: str) -> StoredTake:
        self.require(session_id)
        with self._lock:
            row = self._db.execute(
                "SELECT * FROM takes WHERE session_id = ? AND take_id = ?", (session_id, take_id)
            ).fetchone()
        if row is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no take {take_id!r} in this session", field="take")
        return self._take_of(row)

    def update_notes(self, session_id: str, take_id: str, **notes: Any) -> StoredTake:
        """The director's own notes on a take: title, starred, note, markers."""
        checked = _check_notes(notes)
        self.get_take(session_id, take_id)
        if checked:
            cols = ", ".join(f"{k} = ?" for k in checked)
            values = [json.dumps(v) if k == "markers" else int(v) if k == "starred" else v for k, v in checked.items()]
            with self._tx() as db:
                db.execute(
                    f"UPDATE takes SET {cols} WHERE session_id = ? AND take_id = ?", (*values, session_id, take_id)
                )
        return self.get_take(session_id, take_id)

    def delete_take(self, session_id: str, take_id: str) -> None:
        self.get_take(session_id, take_id)
        with self._tx() as db:
            db.execute("DELETE FROM takes WHERE session_id = ? AND take_id = ?", (session_id, take_id))
            db.execute("DELETE FROM take_words WHERE session_id = ? AND take_id = ?", (session_id, take_id))
        self._pcm_path(session_id, take_id).unlink(missing_ok=True)
        self._codes_path(session_id, take_id).unlink(missing_ok=True)

    def codes(self, session_id: str, take_id: str) -> np.ndarray:
        self.get_take(session_id, take_id)
        return np.load(self._codes_path(session_id, take_id), allow_pickle=False)

    def pcm(self, session_id: str, take_id: str) -> bytes:
        self.get_take(session_id, take_id)
        return self._pcm_path(session_id, take_id).read_bytes()

    # ------------------------------------------------------------------ word timings
    def put_words(self, session_id: str, take_id: str, words: list[dict[str, Any]], aligner: str) -> None:
        """Keep a stored take's word timings (``WordTime.to_record`` dicts), replacing earlier ones."""
        self.get_take(session_id, take_id)
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO take_words (session_id, take_id, aligner, words, created)"
                " VALUES (?, ?, ?, ?, ?)",
                (session_id, take_id, aligner, json.dumps(words), time.time()),
            )

    def words(self, session_id: str, take_id: str) -> list[dict[str, Any]] | None:
        """A stored take's word timings, or None when they were never stored."""
        self.get_take(session_id, take_id)
        with self._lock:
            row = self._db.execute(
                "SELECT words FROM take_words WHERE session_id = ? AND take_id = ?", (session_id, take_id)
            ).fetchone()
        if row is None:
            return None
        words = json.loads(row["words"])
        return words if isinstance(words, list) else None

    # ------------------------------------------------------------------ archives
    def export_archive(self, session_id: str) -> bytes:
        """The whole session as one zip: session.json + takes/<id>.wav (heard audio) + takes/<id>.codes.npy."""
        takes = self.takes(session_id)
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as z:
            manifest = {
                "moss_rt_session": ARCHIVE_VERSION,
                "sample_rate": SAMPLE_RATE,
                "takes": [t.public() for t in takes],
            }
            z.writestr("session.json", json.dumps(manifest, indent=1))
            for t in takes:
                z.writestr(
                    f"takes/{t.take_id}.wav", wav_bytes(self.pcm(session_id, t.take_id), SAMPLE_RATE, t.channels)
                )
                z.write(self._codes_path(session_id, t.take_id), f"takes/{t.take_id}.codes.npy")
        return buf.getvalue()

    def import_archive(self, data: bytes, *, max_unpacked_bytes: int = 2 * 1024**3) -> str:
        """A new session from an exported archive; take ids are issued anew (lineage kept). Bad archives: 4xx."""

        def bad(why: str) -> ProtocolError:
            return ProtocolError(ErrorCode.INVALID_FIELD, f"not a moss_rt session archive: {why}", field="archive")

        try:
            z = zipfile.ZipFile(io.BytesIO(data))
        except zipfile.BadZipFile:
            raise bad("not a zip file") from None
        with z:
            if sum(i.file_size for i in z.infolist()) > max_unpacked_bytes:
                raise ProtocolError(ErrorCode.TOO_LARGE, "the archive unpacks to more than the limit", field="archive")
            try:
                manifest = json.loads(z.read("session.json"))
            except (KeyError, ValueError):
                raise bad("session.json is missing or not JSON") from None
            if not isinstance(manifest, dict) or manifest.get("moss_rt_session") != ARCHIVE_VERSION:
                raise bad(f"unknown version (this service reads version {ARCHIVE_VERSION})")
            records = manifest.get("takes")
            if not isinstance(records, list) or len(records) > self.max_takes:
                raise bad(f"'takes' must be a list of at most {self.max_takes}")
            renamed = {r.get("take_id"): "t_" + secrets.token_urlsafe(9) for r in records if isinstance(r, dict)}
            session_id = self.create()
            try:
                for r in records:
                    self._import_take(session_id, z, r, renamed, bad)
            except BaseException:
                self.delete_session(session_id)
                raise
        return session_id

    def _import_take(self, session_id: str, z: zipfile.ZipFile, r: Any, renamed: dict[Any, str], bad: Any) -> None:
        if not isinstance(r, dict) or not TAKE_ID.match(str(r.get("take_id", ""))):
            raise bad("a take record without a valid take_id")
        old = r["take_id"]
        try:
            with z.open(f"takes/{old}.wav") as f, wave.open(f) as w:
                channels, rate = w.getnchannels(), w.getframerate()
                pcm = w.readframes(w.getnframes())
            with z.open(f"takes/{old}.codes.npy") as f:
                codes = np.load(io.BytesIO(f.read()), allow_pickle=False)
        except (KeyError, wave.Error, ValueError, EOFError) as exc:
            raise bad(f"take {old}: its audio or codes are missing or damaged ({exc})") from None
        if rate != SAMPLE_RATE or channels not in (1, 2) or codes.dtype.kind not in "iu" or codes.ndim != 2:
            raise bad(f"take {old}: audio must be {SAMPLE_RATE} Hz mono or stereo, codes [frames, 12] integers")
        try:
            notes = _check_notes({k: r[k] for k in NOTE_FIELDS if k in r})
            take = StoredTake(
                take_id=renamed[old],
                request=dict(r["request"]),
                seed=int(r["seed"]),
                n_frames=int(codes.shape[0]),
                channels=channels,
                parent=renamed.get(r.get("parent")),
                branch_frame=int(r.get("branch_frame") or 0),
                reason=r.get("reason"),
                stats={k: v for k, v in dict(r.get("stats") or {}).items() if isinstance(v, int | float)},
                created=float(r.get("created") or time.time()),
                **notes,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise bad(f"take {old}: a field is missing or has the wrong type ({exc})") from None
        try:
            self.put_take(session_id, take, codes, pcm)
        except ValueError as exc:
            raise bad(str(exc)) from None

    # ------------------------------------------------------------------ internals
    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _dir(self, session_id: str) -> Path:
        return self.root / session_id

    def _pcm_path(self, session_id: str, take_id: str) -> Path:
        return self._dir(session_id) / f"{take_id}.pcm"

    def _codes_path(self, session_id: str, take_id: str) -> Path:
        return self._dir(session_id) / f"{take_id}.codes.npy"

    @staticmethod
    def _take_of(row: sqlite3.Row) -> StoredTake:
        return StoredTake(
            take_id=row["take_id"],
            request=json.loads(row["request"]),
            seed=int(row["seed"]),
            n_frames=row["n_frames"],
            channels=row["channels"],
            parent=row["parent"],
            branch_frame=row["branch_frame"],
            reason=row["reason"],
            stats=json.loads(row["stats"]),
            title=row["title"],
            starred=bool(row["starred"]),
            note=row["note"],
            markers=json.loads(row["markers"]),
            created=row["created"],
            seq=row["seq"],
        )

    def _sweep_orphans(self) -> None:
        """Files without a record (a crash between the files and the row, or a deleted session) and temp files."""
        with self._lock:
            known = {(r[0], r[1]) for r in self._db.execute("SELECT session_id, take_id FROM takes")}
            sessions = {r[0] for r in self._db.execute("SELECT id FROM sessions")}
        for d in self.root.iterdir():
            if not d.is_dir() or not SESSION_ID.match(d.name):
                continue
            if d.name not in sessions:
                shutil.rmtree(d, ignore_errors=True)
                continue
            for f in d.iterdir():
                take_id = f.name.split(".", 1)[0]
                if f.name.startswith(".") or (d.name, take_id) not in known:
                    log.info("removing orphan session file %s", f)
                    f.unlink(missing_ok=True)
