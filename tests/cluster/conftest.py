"""A local Ray cluster for the cluster tests: bounded (3 CPUs, no GPU, 100 MB object store), on
loopback only, in a temporary directory, torn down after the module.

Two CPU replicas of the tiny model are created once per module (named, detached actors, as a
real front end creates them) and shared by every front end the tests start.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from moss_rt.cluster.launch import FRONT_END_RAY_ENV
from moss_rt.config import Settings
from tests.helpers import RunningServer

pytestmark = pytest.mark.cluster

# Ray binds its services to a non-loopback address of the machine by default; on the platforms
# where it does not run clusters it binds to 127.0.0.1, and this switch selects that behaviour.
# Usage statistics stay off (tests never touch the network), and the token authentication that
# would write ~/.ray is unnecessary on loopback.
RAY_TEST_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    **FRONT_END_RAY_ENV,  # this process is the front end and starts the cluster itself
}
REPLICAS = 2


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """The cluster's GCS address (for a front end in another process)."""
    saved = {k: os.environ.get(k) for k in RAY_TEST_ENV}
    os.environ.update(RAY_TEST_ENV)  # before Ray is imported: it reads them at import
    ray = pytest.importorskip("ray")
    # Short: Ray's unix socket paths live under it (108-byte limit).
    temp = tempfile.mkdtemp(prefix="mrt", dir="/tmp")
    try:
        ray.init(
            num_cpus=REPLICAS + 1,
            num_gpus=0,
            include_dashboard=False,
            object_store_memory=100 * 1024 * 1024,
            namespace="moss_rt",
            _temp_dir=temp,
            logging_level="WARNING",
        )
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def cluster_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cluster-data")


def cluster_settings(data_dir: Path, **overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "cluster": "auto",
        "replicas": REPLICAS,
        "replica_cpus": 1.0,
        "engine": "moss",
        "model": "tiny",
        "codec": "tiny",
        "device": "cpu",
        "data_dir": data_dir,
        "max_slots": 4,
        "max_queue": 4,
        "max_seq_len": 1024,
        # Paced like a real listener: takes last as long as their audio, so they overlap.
        "max_lead_sec": 0.5,
        "max_takes_per_client": 0,
    }
    base.update(overrides)
    return base


@pytest.fixture
def cluster_server(
    ray_cluster: str, make_server: Callable[..., RunningServer], cluster_data_dir: Path
) -> Callable[..., RunningServer]:
    """Factory: a front end (the real app) on the module's cluster; waits until every replica is ready."""
    from moss_rt.cluster.router import ClusterEngine

    def _make(**overrides: Any) -> RunningServer:
        srv = make_server(ClusterEngine, **cluster_settings(cluster_data_dir, **overrides))
        return srv

    return _make


def engine_settings(srv: RunningServer) -> Settings:
    return srv.state.settings
