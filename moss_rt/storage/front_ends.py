"""The front ends sharing one session store, so that none deletes files another is still writing.

Every open store registers its front end (an id, the host, the pid) in ``front_ends`` and renews ``seen`` every
:data:`HEARTBEAT_SEC` while its application runs (``moss_rt/web/session_upkeep.py``). Files without a record are
normal for a moment (a take's files are written before its row is committed, an import's folder is renamed into
place before its rows): the sweep that removes such orphans therefore removes all of them only when no other
front end may be alive, and otherwise only those older than a grace period (``session_store.ORPHAN_GRACE_SEC``).
Each front end stages its imports under its own id; the staging folders of front ends that are gone are removed
whole.

A front end is gone for certain when it ran on this very host (same boot, same pid namespace) and its process no
longer exists (so a restart after a crash cleans up at once, as a single front end always did), or when it has
not renewed ``seen`` for :data:`EXPIRY_SEC`. Otherwise it may be alive, and its files are left alone.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import time
from functools import cache

from moss_rt.storage.database import CLOSING_WAIT_SEC, Database

HEARTBEAT_SEC = 30.0
EXPIRY_SEC = 3600.0  # not seen for this long: gone (a front end cut off from the database that long is stopped)
FRONT_END_PREFIX = "fe_"


def new_front_end_id() -> str:
    return FRONT_END_PREFIX + secrets.token_hex(8)


@cache
def host_key() -> str:
    """This host as far as pids mean anything: its name, this boot, this pid namespace."""
    parts = [socket.gethostname()]
    with contextlib.suppress(OSError):
        parts.append(open("/proc/sys/kernel/random/boot_id").read().strip())  # noqa: SIM115 - tiny, read once
    with contextlib.suppress(OSError):
        parts.append(str(os.stat("/proc/self/ns/pid").st_ino))
    return "/".join(parts)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def register(db: Database, front_end: str) -> None:
    now = time.time()
    with db.transaction() as tx:
        tx.execute(
            "INSERT INTO front_ends (id, host, pid, started, seen) VALUES (?, ?, ?, ?, ?)"
            " ON CONFLICT (id) DO UPDATE SET seen = excluded.seen",
            (front_end, host_key(), os.getpid(), now, now),
        )


def heartbeat(db: Database, front_end: str) -> None:
    """Renew this front end's ``seen`` (registering it again if a sweep removed it meanwhile)."""
    register(db, front_end)


def unregister(db: Database, front_end: str) -> None:
    """This front end is gone (it is shutting down: a short wait for the database, its row would expire anyway)."""
    with db.transaction(wait_sec=CLOSING_WAIT_SEC) as tx:
        tx.execute("DELETE FROM front_ends WHERE id = ?", (front_end,))


def alive_others(db: Database, me: str) -> set[str]:
    """The ids of the other front ends that may be alive; the rows of those gone for certain are removed."""
    now = time.time()
    alive, gone = set(), []
    for row in db.query("SELECT id, host, pid, seen FROM front_ends WHERE id <> ?", (me,)):
        dead_here = row["host"] == host_key() and not _process_exists(int(row["pid"]))
        if dead_here or row["seen"] < now - EXPIRY_SEC:
            gone.append(row["id"])
        else:
            alive.add(str(row["id"]))
    if gone:
        with db.transaction() as tx:
            tx.executemany("DELETE FROM front_ends WHERE id = ?", [(i,) for i in gone])
    return alive
