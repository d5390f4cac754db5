"""The ``--session-store`` setting: which backend keeps the sessions' records, and how logs name it.

- empty (the default) or ``sqlite``: SQLite in ``<data dir>/sessions/sessions.sqlite3``, the takes' files beside it;
- ``postgresql://user:password@host:5432/dbname?sslmode=…`` (or ``postgres://``, or a libpq key/value string
  such as ``host=/run/postgresql dbname=moss``): PostgreSQL, the takes' files in ``--session-files`` (a directory
  every front end mounts).

The URL is handed to libpq as it is, so every libpq parameter and ``PG*`` variable (``PGPASSWORD``,
``PGPASSFILE``, ``PGSSLMODE``…) works.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from moss_rt.storage.database import StoreConfigError

SQLITE = "sqlite"
POSTGRESQL = "postgresql"


@dataclass(frozen=True)
class StoreChoice:
    backend: str  # SQLITE | POSTGRESQL
    url: str  # the libpq connection string ("" for SQLite)


def parse_store_setting(value: str) -> StoreChoice:
    """The backend a ``--session-store`` value names; :class:`StoreConfigError` for anything else."""
    value = value.strip()
    if value in ("", SQLITE, "sqlite:"):
        return StoreChoice(SQLITE, "")
    scheme = value.split(":", 1)[0].lower() if "://" in value else ""
    if scheme in ("postgresql", "postgres"):
        return StoreChoice(POSTGRESQL, value)
    if not scheme and re.search(r"\b(host|dbname|service)=", value):  # a libpq key/value string
        return StoreChoice(POSTGRESQL, value)
    raise StoreConfigError(
        f"--session-store {redact_url(value)!r}: expected empty (SQLite in the data dir) or a PostgreSQL URL "
        "(postgresql://user@host:5432/dbname)"
    )


def redact_url(url: str) -> str:
    """The URL without its password (for logs and error messages)."""
    if "://" in url:
        parts = urlsplit(url)
        if parts.password is not None:
            host = parts.hostname or ""
            if parts.port is not None:
                host = f"{host}:{parts.port}"
            netloc = f"{parts.username or ''}:***@{host}"
            url = urlunsplit(parts._replace(netloc=netloc))
        return re.sub(r"(?i)(password=)[^&\s]*", r"\1***", url)
    return re.sub(r"(?i)(password\s*=\s*)('[^']*'|\S+)", r"\1***", url)
