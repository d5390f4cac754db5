"""A front end closing its session store while the database is gone (it may be why the service is stopping): the
calls that tidy up (its front-end row, a render's lease) wait a short while for a connection, not the pool's whole
wait, and fail quietly; both would run out by themselves."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from moss_rt.scripts.store import ScriptStore
from moss_rt.session_store import open_session_store
from moss_rt.storage import postgres
from moss_rt.storage.database import CLOSING_WAIT_SEC, StoreUnavailable
from tests.postgres import PostgresCluster, why_no_postgres


def test_closing_with_the_database_gone_waits_a_short_while_not_the_pools_wait(tmp_path: Path) -> None:
    reason = why_no_postgres()
    if reason is not None:
        pytest.skip(reason)
    assert CLOSING_WAIT_SEC < postgres.POOL_WAIT_SEC / 2  # the service's figures: 1 s against 5 s
    cluster = PostgresCluster().init().start()  # its own server: this test stops it
    try:
        store = open_session_store(cluster.url(), tmp_path / "files")
        scripts = ScriptStore(store.db)
        store.create()
        cluster.stop()

        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable):  # a render's lease given up at shutdown
            scripts.release("sc_gone", "runner-a")
        lease_wait = time.monotonic() - t0
        time.sleep(postgres.RETRY_AFTER_SEC + 0.2)  # past the "away a moment ago" window: the next call waits again
        t0 = time.monotonic()
        store.close()  # unregisters its front end (that fails quietly), then closes the pool
        close_wait = time.monotonic() - t0
        # A short wait each (1 s and its overheads), well short of the pool's 5 s for a call made while serving.
        assert lease_wait < postgres.POOL_WAIT_SEC - 1.5, lease_wait
        assert close_wait < postgres.POOL_WAIT_SEC - 1.5, close_wait
    finally:
        cluster.remove()
