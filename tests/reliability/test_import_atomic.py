"""A killed import leaves no half-session (issue 23, finding 8): ``kill -9`` at any point of an import leaves,
after a restart, the whole session or nothing, and no files behind.

The crash points are hit exactly by an importing child process that kills itself there (SIGKILL: no cleanup
runs): while takes are being unpacked, between the folder's rename and the records' transaction, and inside
that transaction. Then a real server is killed while an import is in flight, and a client leaves one.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from moss_rt.session_store import SessionStore
from tests.helpers import OwnerJar
from tests.reliability.archives import valid_archive

REPO = Path(__file__).resolve().parents[2]
N_TAKES = 40

CHILD = r"""
import os, signal, sys
from pathlib import Path
import moss_rt.session_archive as archive
import moss_rt.session_store as store_module
from moss_rt.session_store import SessionStore

root, source, where = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
store = SessionStore(root, max_session_takes=200)

def die():
    os.kill(os.getpid(), signal.SIGKILL)

if where == "unpacking":  # the 7th file written: 3 takes whole, the 4th half
    real_write, count = archive._write_file, [0]
    def write(path, pieces):
        real_write(path, pieces)
        count[0] += 1
        if count[0] == 7:
            die()
    archive._write_file = write
elif where == "renamed":  # the session folder is in place, no record yet
    real_rename = os.rename
    def rename(a, b):
        real_rename(a, b)
        die()
    store_module.os.rename = rename
elif where == "transaction":  # 3 of the takes' rows inserted, not committed
    real_insert, count = SessionStore._insert_take, [0]
    def insert(self, *args):
        real_insert(self, *args)
        count[0] += 1
        if count[0] == 3:
            die()
    SessionStore._insert_take = insert
print(store.import_archive(source.read_bytes(), owner="cookie:me", client="127.0.0.1"), flush=True)
"""


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir())


@pytest.mark.parametrize("where", ["unpacking", "renamed", "transaction"])
def test_a_crash_at_any_point_of_an_import_leaves_nothing(tmp_path: Path, where: str) -> None:
    root = tmp_path / "sessions"
    source = tmp_path / "archive.zip"
    source.write_bytes(valid_archive(N_TAKES, 2))
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(root), str(source), where], cwd=REPO, capture_output=True, timeout=120
    )
    assert child.returncode == -9, child.stderr.decode()[-2000:]  # it died where it was told to
    store = SessionStore(root)  # the restart
    assert store.usage()["sessions"] == 0
    assert leftovers(root) == []  # no session folder, no staging area


def test_the_same_import_uninterrupted_is_whole(tmp_path: Path) -> None:
    root = tmp_path / "sessions"
    source = tmp_path / "archive.zip"
    source.write_bytes(valid_archive(N_TAKES, 2))
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(root), str(source), "none"], cwd=REPO, capture_output=True, timeout=120
    )
    assert child.returncode == 0, child.stderr.decode()[-2000:]
    session_id = child.stdout.decode().strip()
    assert len(SessionStore(root).takes(session_id)) == N_TAKES


def test_kill_9_of_the_server_mid_import_leaves_the_whole_session_or_none(server_process, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    server = server_process(data_dir=data_dir)
    jar = OwnerJar()
    jar.request("GET", server.url + "/")  # the studio page gives the owner cookie
    assert jar.cookie is not None
    archive = valid_archive(N_TAKES, 40)  # 40 takes of 3.2 s: long enough to be caught unpacking
    staging = data_dir / "sessions" / ".staging"

    def post() -> None:
        try:
            jar.request("POST", server.url + "/api/sessions/import", data=archive, timeout=60)
        except Exception:  # the server dies under it
            pass

    poster = threading.Thread(target=post, daemon=True)
    poster.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(list(staging.glob("*/*/session/*.pcm"))) < 3 and poster.is_alive():
        time.sleep(0.005)
    server.stop()  # SIGKILL
    poster.join(10)
    again = server_process(data_dir=data_dir)
    sessions = jar.request("GET", again.url + "/api/sessions").json()["sessions"]
    assert sessions == [] or [s["takes"] for s in sessions] == [N_TAKES], sessions
    assert not staging.exists()
    on_disk = [p.name for p in (data_dir / "sessions").iterdir() if p.is_dir()]
    assert sorted(on_disk) == sorted(s["session"] for s in sessions)


def test_a_client_that_leaves_mid_import_leaves_no_session_and_frees_its_slot(fast_server) -> None:
    srv = fast_server()
    data = valid_archive(N_TAKES, 40)  # unpacking takes a while; the client is gone long before it ends
    jar = OwnerJar()
    jar.request("POST", f"{srv.url}/api/sessions")  # an owner cookie, and one session to tell apart
    port = int(srv.url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port))
    head = (
        f"POST /api/sessions/import HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(data)}\r\n"
        f"Cookie: moss_rt_owner={jar.cookie}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    staging = srv.state.settings.data_dir / "sessions" / ".staging"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not list(staging.glob("*/*/session/*.pcm")):
        time.sleep(0.005)  # unpacking has begun
    sock.close()

    def busy() -> bool:  # the import's slot still held, or its unpacking thread still at work
        return bool(len(srv.state.archive_slots)) or (staging.exists() and any(staging.iterdir()))

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and busy():
        time.sleep(0.02)
    assert not busy()
    sessions = jar.request("GET", f"{srv.url}/api/sessions").json()["sessions"]
    assert [s["takes"] for s in sessions] == [0]  # only the empty one: the import nobody waited for is gone
