"""Where directing sessions keep their records: one small database interface, two backends.

- :mod:`moss_rt.storage.database`: the interface (:class:`Database`, transactions, rows) and its SQLite backend,
  the default (one file in the data dir, nothing to run).
- :mod:`moss_rt.storage.postgres`: the PostgreSQL backend (several front ends share one database; the takes'
  files go to a directory they all mount). Its driver (``psycopg``) is optional and imported only when a
  ``postgresql://`` URL asks for it.
- :mod:`moss_rt.storage.migrations`: versioned schema migrations, one mechanism for both backends.
- :mod:`moss_rt.storage.front_ends`: the front ends sharing a store, so that none deletes files another is
  writing.
- :mod:`moss_rt.storage.url`: the ``--session-store`` setting: which backend, and its URL for logs.

The records' own logic (sessions, takes, budgets, scripts) is written once against :class:`Database`, in
``moss_rt/session_store.py`` and ``moss_rt/scripts/store.py``.
"""
