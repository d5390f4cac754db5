"""What ``serve`` runs: the engine the settings name, in this process or as a cluster of replicas.

Above both :mod:`moss_rt.engine` and :mod:`moss_rt.cluster` (a cluster's replicas build their engines with
:func:`moss_rt.engine.factory.build_local_engine`), so neither imports the other's chooser.
"""

from __future__ import annotations

import importlib.util

from moss_rt.config import Settings
from moss_rt.engine.base import Engine
from moss_rt.engine.factory import UnknownEngine, build_local_engine


def build_engine(settings: Settings) -> Engine:
    """The engine ``settings`` name (not started). Cluster mode is imported only when chosen: a single process
    never imports Ray. SystemExit with the reason when the choice cannot be served (no Ray, unknown engine)."""
    if settings.cluster:
        if importlib.util.find_spec("ray") is None:
            raise SystemExit("--cluster needs Ray: pip install -r requirements-cluster.txt (docs/cluster.md)")
        from moss_rt.cluster.router import ClusterEngine

        return ClusterEngine(settings)
    try:
        return build_local_engine(settings)
    except UnknownEngine as exc:
        raise SystemExit(str(exc)) from None
