"""A throwaway PostgreSQL server for tests: Debian's binaries, a cluster in a temporary folder, a unix socket only.

``PostgresCluster.start()`` runs ``initdb`` and ``pg_ctl start`` (as the ``postgres`` system user when the tests
run as root: initdb refuses root), listening on a socket in its own folder and on no TCP port; fsync is off (a test
database need not survive a power cut). Each test takes a fresh database from it (:meth:`PostgresCluster.new_db`).
:func:`why_no_postgres` says why none can be started here (the tests then skip with that reason; ``make test``
installs Debian's ``postgresql`` first, best effort, as it does Chromium).
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
from pathlib import Path
from urllib.parse import quote

START_TIMEOUT_SEC = 60


def pg_bin_dir() -> Path | None:
    """The folder of Debian's PostgreSQL server binaries (the newest installed), or wherever initdb is on PATH."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).resolve().parent if initdb else None


def why_no_postgres() -> str | None:
    """None when a test server can be started here, else the reason."""
    if importlib.util.find_spec("psycopg") is None or importlib.util.find_spec("psycopg_pool") is None:
        return "the PostgreSQL driver is not installed (pip install -r requirements-dev.txt)"
    bin_dir = pg_bin_dir()
    if bin_dir is None or not (bin_dir / "pg_ctl").exists():
        return "PostgreSQL is not installed (apt-get install postgresql; `make test` tries to)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root without a 'postgres' user to run the test server as"
        if shutil.which("runuser") is None:
            return "running as root without runuser to run the test server as 'postgres'"
    return None


class PostgresCluster:
    """One PostgreSQL server in a temporary folder (see the module)."""

    def __init__(self) -> None:
        bin_dir = pg_bin_dir()
        assert bin_dir is not None
        self.bin_dir = bin_dir
        self._as_postgres = os.geteuid() == 0
        # As root the server runs as 'postgres', who must reach the folder: under /tmp, not a private TMPDIR.
        where = "/tmp" if self._as_postgres and os.path.isdir("/tmp") else None
        self.folder = Path(tempfile.mkdtemp(prefix="moss_rt-pg-", dir=where))
        self.data = self.folder / "data"
        self.user = "moss"
        if self._as_postgres:
            account = pwd.getpwnam("postgres")
            os.chown(self.folder, account.pw_uid, account.pw_gid)
        self.folder.chmod(0o755)

    def _run(self, *args: str) -> None:
        cmd = [str(self.bin_dir / args[0]), *args[1:]]
        if self._as_postgres:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=START_TIMEOUT_SEC)
        if done.returncode != 0:
            log = self.folder / "log"
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise RuntimeError(f"{' '.join(args[:2])} failed: {done.stderr[-2000:]}{done.stdout[-500:]}{tail}")

    def init(self) -> PostgresCluster:
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", self.user, "-E", "UTF8", "--no-sync",
                  "--no-instructions")  # fmt: skip
        return self

    def start(self) -> PostgresCluster:
        options = f"-k {self.folder} -c listen_addresses='' -F -c max_connections=200 -c full_page_writes=off"
        self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.folder / "log"), "-w", "start")
        return self

    def stop(self) -> None:
        """Stop it at once (as a crash would: no shutdown checkpoint)."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def remove(self) -> None:
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://{self.user}@/{dbname}?host={quote(str(self.folder), safe='')}"

    def new_db(self) -> str:
        """A new empty database; its URL."""
        import psycopg

        name = "t_" + secrets.token_hex(6)
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def drop_db(self, url: str) -> None:
        import psycopg

        name = url.split("/", 3)[3].split("?", 1)[0]
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
