"""Logging for the processes moss_rt runs: the service, the CLI's commands, a cluster's engine replicas."""

from __future__ import annotations

import logging

LOG_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


def setup_logging(level: str) -> None:
    """Log to stderr at ``level`` (a name such as ``info``; an unknown one means INFO)."""
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), format=LOG_FORMAT)
