"""Directing sessions that survive a reload, a reconnect, a restart, or a client moving to another front end.

A session is an unguessable id (it is the capability to read it, like a take id) owning takes: each take's
parameters (the start request), seed, lineage, end reason and stats, the director's notes (name, star, note,
markers), its codes (so a retake of it can rebuild the model and codec state from them) and the audio as it was
heard. Records live in a database (:mod:`moss_rt.storage`): SQLite in the data dir by default, or PostgreSQL
shared by several front ends (``--session-store postgresql://…``). The codes and audio of a take are two files
in the store's files directory (beside the SQLite file, or a directory every front end mounts):

    <root>/sessions.sqlite3                  (SQLite only)
    <root>/<session id>/<take id>.pcm        int16 little-endian, interleaved when stereo (as streamed)
    <root>/<session id>/<take id>.codes.npy  [n_frames, 12] int64
    <root>/.staging/<front end>/…            imports being unpacked, per front end

Writes are atomic: a take's files are written first (temp file, fsync, rename), then its row in one transaction,
so a crash leaves at most an orphan file, never a record without its audio. An import is unpacked into a staging
folder, renamed into place whole and then recorded, session and takes, in one transaction: a crash at any point
leaves the whole session or none of it. Orphans are swept when a store opens (and by the application's upkeep):
all of them when no other front end may be writing, else only those older than :data:`ORPHAN_GRACE_SEC`
(moss_rt/storage/front_ends.py).

Every session has an owner (an opaque identity string chosen by the web layer: an API key's principal or a
signed browser cookie) and the client address that created it. Sessions are bounded on disk: a cap on their
number (in all and per client), a byte budget (in all and per client, plus free space left on the disk) past
which takes and imports are refused with :class:`StorageFull` (HTTP 507), and :meth:`SessionStore.expire` for
the retention sweep. A session may be shared read-only through a revocable share token. The checks that count
what every front end stored run in the same serialized transaction as the write they allow, so front ends
sharing a store enforce the caps together.

A session holds at most ``max_session_takes`` takes (``Limits.max_session_takes``); one more is refused with a
clear message (``SessionFull``), never dropped silently. The records (:class:`StoredTake`, ids, notes, the store's
refusals) are in :mod:`moss_rt.session_records`, which the archive format shares. Sessions travel as one archive
(``export_archive`` / ``import_archive``): a zip with ``session.json`` (the records), ``takes/<take id>.wav`` (the
heard audio, playable anywhere) and ``takes/<take id>.codes.npy``.

Sans-I/O in the aiohttp sense: no event loop, no sockets of its own. Every call blocks on the disk (or the
database's network); the web layer runs them on worker threads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import json
import logging
import os
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, BinaryIO

import numpy as np

from moss_rt.atomic_files import atomic_write, fsync_dir
from moss_rt.protocol import DEFAULT_LIMITS, FRAME_SAMPLES, N_CODEBOOKS, ErrorCode, Limits, ProtocolError
from moss_rt.session_archive import ArchiveBounds, unpack_archive, write_archive
from moss_rt.session_records import (
    SESSION_ID,
    TAKE_ID,
    SessionFull,
    StorageFull,
    StoredTake,
    check_notes,
    new_session_id,
    pcm_bytes,
    short_id,
)
from moss_rt.splices import EditRequest, PartAudio, Source, assemble, assemble_codes, check_sources, has_codes
from moss_rt.storage import front_ends, session_schema
from moss_rt.storage.database import Database, Reader, SqliteDatabase, StoreUnavailable, Tx
from moss_rt.storage.migrations import MigrationContext, migrate
from moss_rt.storage.url import SQLITE, parse_store_setting

log = logging.getLogger(__name__)

ARCHIVE_VERSION = 1  # the archive format (moss_rt/session_archive.py)
DB_FILE = "sessions.sqlite3"  # the SQLite backend's file, in the root
STAGING = ".staging"  # imports being unpacked, one folder per front end (moss_rt/storage/front_ends.py)
# Files without a record younger than this are left alone while another front end may be writing them (a take's
# files wait for their row a few milliseconds; an import's folder for its rows a few seconds).
ORPHAN_GRACE_SEC = 15 * 60.0
CODEBOOK_SIZE = 1024  # the codebook of the MOSS audio tokenizer (and the scripted engine); engines may say otherwise


@dataclass(frozen=True)
class StoreBudget:
    """What the stored sessions may take; 0 means no cap."""

    max_sessions: int = 0  # in all (507 past it)
    max_sessions_per_client: int = 0  # created by one client address (429 past it)
    max_bytes: int = 0  # audio and codes of every session
    max_bytes_per_client: int = 0  # of the sessions one client address created
    max_take_frames: int = 0  # frames of one take (kept frames of a retake included)
    reserve_free_bytes: int = 256 * 1024 * 1024  # disk space always left free for the rest of the service


class SessionStore:
    """Sessions and their takes: records in ``database`` (default: SQLite in ``root``), files under ``root``
    (created if missing).

    ``limits`` bounds what imports may hold (their JSON, their takes' requests); ``budget`` what the sessions may
    take on disk. Owners are only checked by :meth:`check_access`, which the web layer calls with the request's
    identity before anything else; the other methods trust their caller. The store owns ``database`` (closes it).
    """

    def __init__(
        self,
        root: Path,
        *,
        max_session_takes: int = DEFAULT_LIMITS.max_session_takes,
        limits: Limits | None = None,
        budget: StoreBudget | None = None,
        database: Database | None = None,
    ) -> None:
        self.root = Path(root)
        self.max_session_takes = max_session_takes  # takes one session keeps
        self.limits = limits or Limits()
        self.budget = budget or StoreBudget()
        self.front_end = front_ends.new_front_end_id()  # this store's name among those sharing the database
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self.db = database if database is not None else SqliteDatabase(self.root / DB_FILE)
        except BaseException:
            if database is not None:
                database.close()
            raise
        try:
            migrate(
                self.db,
                session_schema.COMPONENT,
                session_schema.MIGRATIONS,
                MigrationContext(self.root),
                adopt=session_schema.adopt_sqlite if self.db.dialect == SQLITE else None,
            )
            front_ends.register(self.db, self.front_end)
            self._check_files_dir()
            self.sweep_orphans()
        except BaseException:
            self.db.close()
            raise

    @property
    def shared(self) -> bool:
        """Whether front ends on other hosts may share this store (PostgreSQL)."""
        return self.db.shared

    def close(self) -> None:
        with contextlib.suppress(StoreUnavailable):
            front_ends.unregister(self.db, self.front_end)
        self.db.close()

    def heartbeat(self) -> None:
        """This front end is still using the store (the application calls it every ``front_ends.HEARTBEAT_SEC``)."""
        front_ends.heartbeat(self.db, self.front_end)

    def shared_secret(self, name: str, proposal: bytes) -> bytes:
        """The secret every front end of this store uses under ``name``: ``proposal`` if none was kept yet (the
        first front end's wins), else the kept one."""
        with self.db.transaction() as tx:
            tx.execute(
                "INSERT INTO store_secrets (name, value, created) VALUES (?, ?, ?) ON CONFLICT (name) DO NOTHING",
                (name, proposal.hex(), time.time()),
            )
            value = tx.scalar("SELECT value FROM store_secrets WHERE name = ?", (name,))
        return bytes.fromhex(str(value))

    # ------------------------------------------------------------------ sessions
    def create(self, *, owner: str | None = None, client: str | None = None) -> str:
        """A new empty session owned by ``owner``, counted against ``client``'s caps."""
        session_id = new_session_id()
        now = time.time()
        with self.db.transaction(serialized=True) as tx:
            self._check_new_session(tx, client)
            tx.execute(
                "INSERT INTO sessions (id, created, updated, owner, client) VALUES (?, ?, ?, ?, ?)",
                (session_id, now, now, owner, client),
            )
        return session_id

    def exists(self, session_id: str) -> bool:
        if not SESSION_ID.match(session_id or ""):
            return False
        return self.db.one("SELECT 1 FROM sessions WHERE id = ?", (session_id,)) is not None

    def require(self, session_id: str) -> None:
        if not self.exists(session_id):
            raise _no_session()

    def check_access(self, session_id: str, owner: str | None, *, share: str | None = None) -> None:
        """Let ``owner`` (or the holder of the session's ``share`` token) at the session, else ``not_found``;
        ``owner`` None is a caller with no identity, who owns nothing.

        Another identity is told the session does not exist, as for an unknown id. A session stored before sessions
        had owners is adopted by the first identity that opens it (its id was the capability until then).
        """
        if not SESSION_ID.match(session_id or ""):
            raise _no_session()
        row = self.db.one("SELECT owner FROM sessions WHERE id = ?", (session_id,))
        if row is None:
            raise _no_session()
        if owner is not None and row["owner"] == owner:
            return
        if share is not None:
            shared = self.db.one("SELECT 1 FROM shares WHERE token = ? AND session_id = ?", (share, session_id))
            if shared is not None:
                return
        if row["owner"] is None and owner is not None:
            with self.db.transaction() as tx:
                adopted = tx.execute(
                    "UPDATE sessions SET owner = ? WHERE id = ? AND owner IS NULL", (owner, session_id)
                )
            if adopted or self.db.scalar("SELECT owner FROM sessions WHERE id = ?", (session_id,)) == owner:
                log.info("session %s: adopted by its first owner", short_id(session_id))
                return
        raise _no_session()

    def list_sessions(self, owner: str) -> list[dict[str, Any]]:
        """``owner``'s sessions, most recently used first: id, times, take count, bytes on disk."""
        rows = self.db.query(
            "SELECT s.id, s.created, s.updated, s.bytes, COUNT(t.take_id) AS takes FROM sessions s"
            " LEFT JOIN takes t ON t.session_id = s.id WHERE s.owner = ?"
            " GROUP BY s.id, s.created, s.updated, s.bytes ORDER BY s.updated DESC",
            (owner,),
        )
        return [
            {"session": r["id"], "created": r["created"], "updated": r["updated"], "takes": int(r["takes"]),
             "bytes": int(r["bytes"])}
            for r in rows
        ]  # fmt: skip

    def touch(self, session_id: str) -> None:
        """Mark the session used now (retention counts from its last use)."""
        with self.db.transaction() as tx:
            tx.execute("UPDATE sessions SET updated = ? WHERE id = ?", (time.time(), session_id))

    def delete_session(self, session_id: str) -> None:
        """Its records first (one transaction), then its files: a crash in between leaves files the next sweep
        removes, never a record without them."""
        self.require(session_id)
        with self.db.transaction() as tx:
            tx.execute("DELETE FROM sessions WHERE id = ?", (session_id,))
        shutil.rmtree(self._dir(session_id), ignore_errors=True)

    def expire(self, unused_since: float, *, batch: int = 500) -> int:
        """Delete sessions not used since ``unused_since`` (Unix seconds), at most ``batch``; how many went.

        A session used meanwhile (on another front end, between the query and the delete) is kept."""
        with self.db.transaction() as tx:
            ids = [
                r[0]
                for r in tx.query(
                    "SELECT id FROM sessions WHERE updated < ? ORDER BY updated LIMIT ?", (unused_since, batch)
                )
            ]
            gone = [
                i for i in ids if tx.execute("DELETE FROM sessions WHERE id = ? AND updated < ?", (i, unused_since))
            ]
        for session_id in gone:
            shutil.rmtree(self._dir(session_id), ignore_errors=True)
        return len(gone)

    # ------------------------------------------------------------------ sharing
    def share(self, session_id: str) -> str:
        """The session's share token (read-only access for whoever holds it), made on first call."""
        self.require(session_id)
        with self.db.transaction() as tx:
            tx.execute(
                "INSERT INTO shares (token, session_id, created) VALUES (?, ?, ?) ON CONFLICT (session_id) DO NOTHING",
                ("sh_" + secrets.token_urlsafe(18), session_id, time.time()),
            )
            token = tx.scalar("SELECT token FROM shares WHERE session_id = ?", (session_id,))
        if token is None:  # the session was deleted meanwhile
            raise _no_session()
        return str(token)

    def unshare(self, session_id: str) -> bool:
        """Revoke the session's share token; False when it had none."""
        self.require(session_id)
        with self.db.transaction() as tx:
            return tx.execute("DELETE FROM shares WHERE session_id = ?", (session_id,)) > 0

    def shared_token(self, session_id: str) -> str | None:
        token = self.db.scalar("SELECT token FROM shares WHERE session_id = ?", (session_id,))
        return None if token is None else str(token)

    # ------------------------------------------------------------------ budgets
    def room(self, client: str | None) -> int:
        """Bytes the sessions of ``client`` may still add: within every budget and the disk's free space."""
        return self._room(self.db, client)

    def usage(self) -> dict[str, int]:
        row = self.db.one("SELECT COUNT(*), CAST(COALESCE(SUM(bytes), 0) AS BIGINT) FROM sessions")
        assert row is not None
        return {"sessions": int(row[0]), "bytes": int(row[1])}

    # ------------------------------------------------------------------ takes
    def put_take(self, session_id: str, take: StoredTake, codes: np.ndarray, pcm: bytes) -> StoredTake:
        """Store a finished take (its files, then its record); refused when the session is full (``SessionFull``),
        the take longer than a stored take may be (``too_large``) or the budgets spent (``StorageFull``). A take
        stored for the first time gets the session's next number (``StoredTake.number``); stored again, it keeps
        its own.

        The early checks spare writing files that could not be kept; the session's take count and the budgets are
        checked again in the transaction that records the take (another front end may have stored meanwhile)."""
        self.require(session_id)
        if not TAKE_ID.match(take.take_id):
            raise ProtocolError(ErrorCode.INVALID_FIELD, "bad take id", field="take")
        codes = np.asarray(codes, dtype=np.int64).reshape(-1, N_CODEBOOKS)
        if codes.shape[0] != take.n_frames or len(pcm) != take.n_frames * FRAME_SAMPLES * take.channels * 2:
            raise ValueError(
                f"take {take.take_id}: {codes.shape[0]} frames of codes and {len(pcm)} PCM bytes"
                f" for {take.n_frames} frames"
            )
        cap = self.budget.max_take_frames
        if cap and take.n_frames > cap:
            raise ProtocolError(
                ErrorCode.TOO_LARGE,
                f"take {take.take_id} has {take.n_frames} frames; a stored take keeps at most {cap}",
            )
        return self._keep(session_id, take, codes, pcm)

    def _keep(self, session_id: str, take: StoredTake, codes: np.ndarray | None, pcm: bytes) -> StoredTake:
        """Write a take's files (``codes`` None: audio only), then record it (see :meth:`put_take`)."""
        known = self._take_bytes(self.db, session_id, take.take_id) is not None
        if not known and self._take_count(self.db, session_id) >= self.max_session_takes:
            raise SessionFull(self.max_session_takes)
        buf = io.BytesIO()
        if codes is not None:
            np.save(buf, codes, allow_pickle=False)
        nbytes = len(pcm) + buf.tell()
        client = self._client_of(session_id)
        if self.room(client) < nbytes:
            raise StorageFull(f"the sessions' budget has no room for this take ({nbytes} bytes)")
        pcm_path, codes_path = self._pcm_path(session_id, take.take_id), self._codes_path(session_id, take.take_id)
        try:
            atomic_write(pcm_path, pcm)
            if codes is not None:
                atomic_write(codes_path, buf.getvalue())
            else:
                codes_path.unlink(missing_ok=True)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StorageFull("the disk is full") from None
            raise
        try:
            with self.db.transaction(serialized=True) as tx:
                if tx.one("SELECT 1 FROM sessions WHERE id = ?", (session_id,)) is None:
                    raise _no_session()  # deleted meanwhile
                old = tx.one(
                    "SELECT bytes, number FROM takes WHERE session_id = ? AND take_id = ?", (session_id, take.take_id)
                )
                if old is None and self._take_count(tx, session_id) >= self.max_session_takes:
                    raise SessionFull(self.max_session_takes)
                grow = nbytes - (0 if old is None else int(old["bytes"]))
                self._check_bytes(tx, client, grow, on_disk=True)
                seq = tx.scalar("SELECT COALESCE(MAX(seq), 0) + 1 FROM takes WHERE session_id = ?", (session_id,))
                if old is None or not old["number"]:
                    number = self._next_number(tx, session_id)
                else:
                    number = int(old["number"])
                take = dataclasses.replace(take, seq=take.seq or int(seq), number=number, has_codes=codes is not None)
                self._insert_take(tx, session_id, take, nbytes)
                tx.execute(
                    "UPDATE sessions SET updated = ?, bytes = bytes + ? WHERE id = ?", (time.time(), grow, session_id)
                )
        except BaseException:
            if not known:  # not recorded: its files would be orphans until the next sweep
                pcm_path.unlink(missing_ok=True)
                codes_path.unlink(missing_ok=True)
            raise
        return take

    @staticmethod
    def _next_number(tx: Tx, session_id: str) -> int:
        """The session's next take number, taken (never given again, whatever is deleted)."""
        number = int(tx.scalar("SELECT next_number FROM sessions WHERE id = ?", (session_id,)))
        tx.execute("UPDATE sessions SET next_number = ? WHERE id = ?", (number + 1, session_id))
        return number

    def next_number(self, session_id: str) -> int:
        """The number the session's next take will get."""
        value = self.db.scalar("SELECT next_number FROM sessions WHERE id = ?", (session_id,))
        if value is None:
            raise _no_session()
        return int(value)

    def put_edit(self, session_id: str, edit: EditRequest, take_id: str) -> tuple[StoredTake, bytes]:
        """A splice or comp of the session's stored takes (moss_rt/splices.py), assembled from their stored audio
        (and codes, when it is whole frames of them), stored as take ``take_id``; the record and its PCM.

        Its request and seed are its first part's take's (what a retake of it starts from). Refused like any
        take (``SessionFull``, ``StorageFull``, longer than a stored take may be: ``too_large``), and
        ``not_found`` / ``invalid_field`` for parts that name no stored take or lie outside theirs."""
        self.require(session_id)
        takes = {}
        for part in edit.parts:
            if part.take not in takes:
                takes[part.take] = self.get_take(session_id, part.take)  # not_found: not (yet) stored
        sources = {take_id: Source(t.n_frames * FRAME_SAMPLES, t.channels, t.has_codes) for take_id, t in takes.items()}
        check_sources(edit, sources)
        n_frames = edit.samples // FRAME_SAMPLES
        cap = self.budget.max_take_frames or self.limits.max_new_tokens  # as an import would take it back
        if n_frames > cap:
            raise ProtocolError(
                ErrorCode.TOO_LARGE,
                f"the {edit.kind} would hold {n_frames} frames; a {edit.kind} holds at most {cap} (max_new_tokens)",
                field="parts",
            )
        if self._take_count(self.db, session_id) >= self.max_session_takes:
            raise SessionFull(self.max_session_takes)
        pieces = []
        last = len(edit.parts) - 1
        for i, part in enumerate(edit.parts):
            source = takes[part.take]
            fade_out = edit.crossfade if i < last else 0
            with self.open_pcm(session_id, part.take) as f:
                f.seek(part.start * source.channels * 2)
                data = f.read((part.samples + fade_out) * source.channels * 2)
            audio = np.frombuffer(data, dtype="<i2").reshape(-1, source.channels)
            pieces.append(PartAudio(audio[: part.samples], audio[part.samples :] if fade_out else None))
        pcm = assemble(pieces, edit.crossfade)
        codes = None
        if has_codes(edit, sources):
            codes = assemble_codes(edit.parts, [self.codes(session_id, p.take) for p in edit.parts])
        first = takes[edit.parts[0].take]
        record = StoredTake(
            take_id=take_id, request=dict(first.request), seed=first.seed, n_frames=n_frames,
            channels=int(pcm.shape[1]), reason="done", kind=edit.kind, crossfade=edit.crossfade,
            parts=[
                {"take": p.take, "number": takes[p.take].number, "from": p.start, "to": p.end} for p in edit.parts
            ],
            **edit.notes,
        )  # fmt: skip
        data = pcm.astype("<i2", copy=False).tobytes()
        return self._keep(session_id, record, codes, data), data

    def takes(self, session_id: str) -> list[StoredTake]:
        self.require(session_id)
        rows = self.db.query("SELECT * FROM takes WHERE session_id = ? ORDER BY seq", (session_id,))
        return [self._take_of(row) for row in rows]

    def count(self, session_id: str) -> int:
        self.require(session_id)
        return self._take_count(self.db, session_id)

    def check_room(self, session_id: str) -> None:
        """Refuse (SessionFull, StorageFull) before a take is generated that the session could not keep."""
        if self.count(session_id) >= self.max_session_takes:
            raise SessionFull(self.max_session_takes)
        if self.room(self._client_of(session_id)) <= 0:
            raise StorageFull("the sessions' budget is spent")

    def get_take(self, session_id: str, take_id: str) -> StoredTake:
        self.require(session_id)
        row = self.db.one("SELECT * FROM takes WHERE session_id = ? AND take_id = ?", (session_id, take_id))
        if row is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no take {take_id!r} in this session", field="take")
        return self._take_of(row)

    def update_notes(self, session_id: str, take_id: str, /, **notes: Any) -> StoredTake:
        """The director's own notes on a take: title, starred, note, markers.

        The ids are positional-only, so any key a client sends lands in ``notes`` (and is refused there), even
        ``session_id``, ``take_id`` or ``self``. Only the given fields change, so notes written on two front ends
        at once keep both (the same field: the later write)."""
        checked = check_notes(notes)
        self.get_take(session_id, take_id)
        if checked:
            cols = ", ".join(f"{k} = ?" for k in checked)  # keys are NOTE_FIELDS only, never client text
            values = [json.dumps(v) if k == "markers" else int(v) if k == "starred" else v for k, v in checked.items()]
            with self.db.transaction() as tx:
                tx.execute(
                    f"UPDATE takes SET {cols} WHERE session_id = ? AND take_id = ?", (*values, session_id, take_id)
                )
                tx.execute("UPDATE sessions SET updated = ? WHERE id = ?", (time.time(), session_id))
        return self.get_take(session_id, take_id)

    def delete_take(self, session_id: str, take_id: str) -> None:
        self.get_take(session_id, take_id)
        with self.db.transaction() as tx:
            nbytes = self._take_bytes(tx, session_id, take_id)
            tx.execute("DELETE FROM takes WHERE session_id = ? AND take_id = ?", (session_id, take_id))
            tx.execute("DELETE FROM take_words WHERE session_id = ? AND take_id = ?", (session_id, take_id))
            if nbytes is not None:
                tx.execute(
                    "UPDATE sessions SET bytes = CASE WHEN bytes > ? THEN bytes - ? ELSE 0 END WHERE id = ?",
                    (nbytes, nbytes, session_id),
                )
        self._pcm_path(session_id, take_id).unlink(missing_ok=True)
        self._codes_path(session_id, take_id).unlink(missing_ok=True)

    def codes(self, session_id: str, take_id: str) -> np.ndarray:
        """The take's codes, [n_frames, 12] int64 (ValueError when the file is damaged)."""
        take = self.get_take(session_id, take_id)
        if not take.has_codes:
            raise ValueError(f"take {take_id} is audio only (a splice with a crossfade): it has no codes")
        codes: np.ndarray = np.load(self._codes_path(session_id, take_id), allow_pickle=False)
        if codes.dtype.kind not in "iu" or codes.shape != (take.n_frames, N_CODEBOOKS):
            raise ValueError(f"take {take_id}: stored codes {codes.dtype}{list(codes.shape)} are damaged")
        return codes.astype(np.int64, copy=False)

    def pcm(self, session_id: str, take_id: str) -> bytes:
        with self.open_pcm(session_id, take_id) as f:
            return f.read()

    def open_pcm(self, session_id: str, take_id: str) -> BinaryIO:
        """The take's audio as heard, open for reading in pieces; ``not_found`` when its file is missing or not as
        long as the record says (damaged stored data is never sent, nor a reason for a 500)."""
        take = self.get_take(session_id, take_id)
        path = self._pcm_path(session_id, take_id)
        try:
            f = open(path, "rb")  # noqa: SIM115 - the caller closes it
        except OSError:
            raise _damaged(take_id) from None
        if os.fstat(f.fileno()).st_size != pcm_bytes(take):
            f.close()
            raise _damaged(take_id)
        return f

    # ------------------------------------------------------------------ word timings
    def put_words(self, session_id: str, take_id: str, words: list[dict[str, Any]], aligner: str) -> None:
        """Keep a stored take's word timings (``WordTime.to_record`` dicts), replacing earlier ones."""
        self.get_take(session_id, take_id)
        with self.db.transaction() as tx:
            tx.execute(
                "INSERT INTO take_words (session_id, take_id, aligner, words, created) VALUES (?, ?, ?, ?, ?)"
                " ON CONFLICT (session_id, take_id) DO UPDATE SET aligner = excluded.aligner,"
                " words = excluded.words, created = excluded.created",
                (session_id, take_id, aligner, json.dumps(words), time.time()),
            )

    def words(self, session_id: str, take_id: str) -> list[dict[str, Any]] | None:
        """A stored take's word timings, or None when they were never stored."""
        self.get_take(session_id, take_id)
        row = self.db.one("SELECT words FROM take_words WHERE session_id = ? AND take_id = ?", (session_id, take_id))
        if row is None:
            return None
        words = json.loads(row["words"])
        return words if isinstance(words, list) else None

    # ------------------------------------------------------------------ archives
    def export_archive(self, session_id: str) -> bytes:
        """The whole session as one zip in memory (tests, small sessions; the web layer streams
        :meth:`write_archive`)."""
        buf = io.BytesIO()
        self.write_archive(self.exportable_takes(session_id), session_id, buf)
        return buf.getvalue()

    def exportable_takes(self, session_id: str) -> list[StoredTake]:
        """The session's takes whose files are whole (others are logged and left out of an export)."""
        out = []
        for t in self.takes(session_id):
            pcm_ok = self._file_size(self._pcm_path(session_id, t.take_id)) == pcm_bytes(t)
            if pcm_ok and (not t.has_codes or _codes_file_ok(self._codes_path(session_id, t.take_id), t.n_frames)):
                out.append(t)
            else:
                log.warning("session %s: take %s is damaged; left out of the export", short_id(session_id), t.take_id)
        return out

    def write_archive(self, takes: list[StoredTake], session_id: str, out: IO[bytes]) -> None:
        """Write the archive of ``takes`` (from :meth:`exportable_takes`) into ``out`` (need not be seekable)."""
        write_archive(
            out,
            takes,
            self.next_number(session_id),
            lambda take_id: open(self._pcm_path(session_id, take_id), "rb"),
            lambda take_id: self._codes_path(session_id, take_id),
        )

    def new_staging(self) -> Path:
        """A fresh folder for an import in progress, under this front end's own staging folder (removed by a
        later sweep if the process dies)."""
        path = self.root / STAGING / self.front_end / secrets.token_hex(8)
        for _ in range(3):  # another import may remove the empty parents between the mkdirs
            try:
                path.mkdir(parents=True)
                return path
            except FileNotFoundError:
                continue
        path.mkdir(parents=True)
        return path

    def drop_staging(self, path: Path) -> None:
        """Remove a staging folder (and the staging folders above it once empty)."""
        shutil.rmtree(path, ignore_errors=True)
        for parent in (path.parent, self.root / STAGING):
            with contextlib.suppress(OSError):
                parent.rmdir()

    def import_archive(
        self,
        data: bytes | Path | IO[bytes],
        *,
        owner: str | None = None,
        client: str | None = None,
        codebook_size: int = CODEBOOK_SIZE,
        max_unpacked_bytes: int | None = None,
    ) -> str:
        """A new session from an exported archive, all of it or nothing; take ids are issued anew (lineage kept).

        Everything is checked before it is kept (see :mod:`moss_rt.session_archive`); bad archives are 4xx
        ``ProtocolError``, no room is ``StorageFull`` (507), and nothing is left behind either way.
        """
        self._check_new_session(self.db, client)  # before any work: the caps are known now
        bounds = ArchiveBounds(
            limits=self.limits,
            max_session_takes=self.max_session_takes,
            max_take_frames=self.budget.max_take_frames or self.limits.max_new_tokens,
            codebook_size=codebook_size,
            max_unpacked_bytes=(
                self.limits.max_session_archive_unpacked_bytes if max_unpacked_bytes is None else max_unpacked_bytes
            ),
            room_bytes=self.room(client),
        )
        staging = self.new_staging()
        try:
            source = io.BytesIO(data) if isinstance(data, bytes | bytearray) else data
            unpacked, next_number = unpack_archive(source, staging / "session", bounds)
            return self._commit_import(staging / "session", unpacked, next_number, owner=owner, client=client)
        finally:
            self.drop_staging(staging)

    def _commit_import(
        self, folder: Path, unpacked: list[Any], next_number: int, *, owner: str | None, client: str | None
    ) -> str:
        """Put an unpacked session in place: its folder renamed whole, then session and takes in one transaction.
        A crash between the two leaves a folder without a record, which a later sweep removes."""
        folder.mkdir(parents=True, exist_ok=True)
        fsync_dir(folder)
        session_id = new_session_id()
        final = self._dir(session_id)
        os.rename(folder, final)
        fsync_dir(self.root)
        total = sum(u.nbytes for u in unpacked)
        now = time.time()
        try:
            with self.db.transaction(serialized=True) as tx:
                self._check_new_session(tx, client)
                self._check_bytes(tx, client, total, on_disk=True)
                tx.execute(
                    "INSERT INTO sessions (id, created, updated, owner, client, bytes, next_number)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (session_id, now, now, owner, client, total, next_number),
                )
                for seq, u in enumerate(unpacked, start=1):
                    self._insert_take(tx, session_id, dataclasses.replace(u.take, seq=seq), u.nbytes)
        except BaseException:
            shutil.rmtree(final, ignore_errors=True)
            raise
        return session_id

    def _check_files_dir(self) -> None:
        """Say so when the files directory holds none of the latest takes the records name: front ends sharing a
        database must share the files too (``--session-files`` on a shared mount), or resumes find no audio."""
        rows = self.db.query("SELECT session_id, take_id FROM takes ORDER BY created DESC LIMIT 5")
        if rows and not any(self._pcm_path(r[0], r[1]).exists() for r in rows):
            log.warning(
                "sessions: none of the latest stored takes is in %s; front ends sharing %s must share their files "
                "directory too (--session-files on a shared mount)",
                self.root,
                self.db.describe(),
            )

    # ------------------------------------------------------------------ orphans
    def sweep_orphans(self) -> int:
        """Remove files without a record (a crash between the files and the row, or a deleted session), temp files,
        and imports that never finished; how many entries went.

        When another front end may be writing into the same directory, only what is older than
        :data:`ORPHAN_GRACE_SEC` goes (and the staging folders of front ends that are gone)."""
        others = front_ends.alive_others(self.db, self.front_end)
        cutoff = time.time() - ORPHAN_GRACE_SEC if others else float("inf")
        removed = 0
        staging = self.root / STAGING
        if staging.is_dir():
            for d in staging.iterdir():
                if d.name == self.front_end or (d.name in others and _newest_mtime(d) >= cutoff):
                    continue
                shutil.rmtree(d, ignore_errors=True) if d.is_dir() else d.unlink(missing_ok=True)
                removed += 1
            with contextlib.suppress(OSError):
                staging.rmdir()
        sessions = {r[0] for r in self.db.query("SELECT id FROM sessions")}
        for d in self.root.iterdir():
            if not d.is_dir() or not SESSION_ID.match(d.name):
                continue
            if d.name not in sessions:
                if _newest_mtime(d) < cutoff and not self.exists(d.name):  # asked again: it may have just been made
                    log.info("removing the files of an unrecorded session %s", short_id(d.name))
                    shutil.rmtree(d, ignore_errors=True)
                    removed += 1
                continue
            known = {r[0] for r in self.db.query("SELECT take_id FROM takes WHERE session_id = ?", (d.name,))}
            for f in d.iterdir():
                take_id = f.name.split(".", 1)[0]
                if f.name.startswith(".") or take_id not in known:
                    if _mtime(f) >= cutoff:
                        continue
                    log.info("removing orphan session file %s/%s", short_id(d.name), f.name)
                    f.unlink(missing_ok=True)
                    removed += 1
        return removed

    # ------------------------------------------------------------------ internals
    def _client_of(self, session_id: str) -> str | None:
        row = self.db.one("SELECT client FROM sessions WHERE id = ?", (session_id,))
        return None if row is None else row[0]

    @staticmethod
    def _take_count(db: Reader, session_id: str) -> int:
        return int(db.scalar("SELECT COUNT(*) FROM takes WHERE session_id = ?", (session_id,)))

    @staticmethod
    def _take_bytes(db: Reader, session_id: str, take_id: str) -> int | None:
        value = db.scalar("SELECT bytes FROM takes WHERE session_id = ? AND take_id = ?", (session_id, take_id))
        return None if value is None else int(value)

    def _check_new_session(self, db: Reader, client: str | None) -> None:
        b = self.budget
        if b.max_sessions and int(db.scalar("SELECT COUNT(*) FROM sessions")) >= b.max_sessions:
            raise StorageFull(f"the service already keeps {b.max_sessions} sessions (max_sessions)")
        if b.max_sessions_per_client and client is not None:
            mine = int(db.scalar("SELECT COUNT(*) FROM sessions WHERE client = ?", (client,)))
            if mine >= b.max_sessions_per_client:
                raise ProtocolError(
                    ErrorCode.RATE_LIMITED,
                    f"this client already keeps {mine} sessions (max_sessions_per_client is "
                    f"{b.max_sessions_per_client}); delete sessions it no longer needs (DELETE /api/sessions/<id>)",
                    field="session",
                )
        if self._free_disk() < b.reserve_free_bytes:
            raise StorageFull("the disk is nearly full")

    def _room(self, db: Reader, client: str | None, *, written: int = 0) -> int:
        """``written``: bytes already on disk for the write being checked (the disk's free space has paid for
        them; the budgets have not)."""
        b = self.budget
        room = self._free_disk() + written - b.reserve_free_bytes
        if b.max_bytes:
            total = int(db.scalar("SELECT CAST(COALESCE(SUM(bytes), 0) AS BIGINT) FROM sessions"))
            room = min(room, b.max_bytes - total)
        if b.max_bytes_per_client and client is not None:
            mine = int(
                db.scalar("SELECT CAST(COALESCE(SUM(bytes), 0) AS BIGINT) FROM sessions WHERE client = ?", (client,))
            )
            room = min(room, b.max_bytes_per_client - mine)
        return int(room)

    def _check_bytes(self, db: Reader, client: str | None, grow: int, *, on_disk: bool) -> None:
        """Within the budgets after growing by ``grow`` bytes (``on_disk``: they are written already, so the
        disk's free space has paid for them)."""
        if grow <= 0:
            return
        room = self._room(db, client, written=grow if on_disk else 0)
        if grow > room:
            raise StorageFull(f"{grow} more bytes would pass the sessions' budget")

    def _free_disk(self) -> int:
        try:
            return shutil.disk_usage(self.root).free
        except OSError:
            return 0

    @staticmethod
    def _file_size(path: Path) -> int:
        try:
            return path.stat().st_size
        except OSError:
            return -1

    def _insert_take(self, db: Tx, session_id: str, take: StoredTake, nbytes: int) -> None:
        db.execute(
            "INSERT INTO takes (session_id, take_id, seq, parent, branch_frame, seed, request, reason,"
            " n_frames, channels, stats, title, starred, note, markers, created, bytes,"
            " number, kind, parts, crossfade, has_codes)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT (session_id, take_id) DO UPDATE SET seq = excluded.seq, parent = excluded.parent,"
            " branch_frame = excluded.branch_frame, seed = excluded.seed, request = excluded.request,"
            " reason = excluded.reason, n_frames = excluded.n_frames, channels = excluded.channels,"
            " stats = excluded.stats, title = excluded.title, starred = excluded.starred, note = excluded.note,"
            " markers = excluded.markers, created = excluded.created, bytes = excluded.bytes,"
            " number = excluded.number, kind = excluded.kind, parts = excluded.parts,"
            " crossfade = excluded.crossfade, has_codes = excluded.has_codes",
            (
                session_id, take.take_id, take.seq, take.parent, take.branch_frame, str(take.seed),
                json.dumps(take.request), take.reason, take.n_frames, take.channels, json.dumps(take.stats),
                take.title, int(take.starred), take.note, json.dumps(take.markers), take.created, nbytes,
                take.number, take.kind, json.dumps(take.parts), take.crossfade, int(take.has_codes),
            ),
        )  # fmt: skip

    def _dir(self, session_id: str) -> Path:
        return self.root / session_id

    def _pcm_path(self, session_id: str, take_id: str) -> Path:
        return self._dir(session_id) / f"{take_id}.pcm"

    def _codes_path(self, session_id: str, take_id: str) -> Path:
        return self._dir(session_id) / f"{take_id}.codes.npy"

    @staticmethod
    def _take_of(row: Any) -> StoredTake:
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
            number=row["number"],
            kind=row["kind"],
            parts=json.loads(row["parts"]),
            crossfade=row["crossfade"],
            has_codes=bool(row["has_codes"]),
        )


def check_store_setting(setting: str) -> None:
    """Refuse a ``--session-store`` value that cannot work (an unknown scheme, PostgreSQL without its driver)
    before anything starts: :class:`~moss_rt.storage.database.StoreConfigError`."""
    if parse_store_setting(setting).backend != SQLITE:
        from moss_rt.storage.postgres import load_driver

        load_driver()


def open_session_store(
    setting: str,
    root: Path,
    *,
    max_session_takes: int = DEFAULT_LIMITS.max_session_takes,
    limits: Limits | None = None,
    budget: StoreBudget | None = None,
) -> SessionStore:
    """The store a ``--session-store`` value names (empty: SQLite in ``root``), its files under ``root``."""
    choice = parse_store_setting(setting)
    database: Database | None = None
    if choice.backend != SQLITE:
        from moss_rt.storage.postgres import PostgresDatabase  # the optional driver, only when asked for

        database = PostgresDatabase(choice.url)
    store = SessionStore(root, max_session_takes=max_session_takes, limits=limits, budget=budget, database=database)
    log.info("sessions: records in %s, files in %s", store.db.describe(), root)
    return store


def _mtime(path: Path) -> float:
    try:
        return path.lstat().st_mtime
    except OSError:
        return 0.0


def _newest_mtime(folder: Path) -> float:
    """The newest modification time in ``folder`` and under it (a folder being filled is young)."""
    newest = _mtime(folder)
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in (*dirnames, *filenames):
            newest = max(newest, _mtime(Path(dirpath) / name))
    return newest


def _codes_file_ok(path: Path, n_frames: int) -> bool:
    """The codes file is a .npy of [n_frames, 12] integers, as far as its header says (read without the data)."""
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            if version not in ((1, 0), (2, 0)):
                return False
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, _, dtype = read(f)
        return bool(dtype.kind in "iu" and tuple(shape) == (n_frames, N_CODEBOOKS))
    except (OSError, ValueError):
        return False


def _no_session() -> ProtocolError:
    return ProtocolError(ErrorCode.NOT_FOUND, "no such session (it may have been deleted)", field="session")


def _damaged(take_id: str) -> ProtocolError:
    return ProtocolError(
        ErrorCode.NOT_FOUND, f"the stored audio of take {take_id!r} is missing or damaged", field="take"
    )
