"""What the Triton kernel tests share: the skip for interpreter runs, a kernel switch set for a block, and a check
script run through Triton's interpreter in a subprocess (TRITON_INTERPRET is read when the kernels are built, so it
cannot be flipped inside this process)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

import pytest
import torch

T = TypeVar("T")
HAS_TRITON = importlib.util.find_spec("triton") is not None
_interpreter_skip = pytest.mark.skipif(
    not HAS_TRITON or torch.cuda.is_available(), reason="needs Triton (interpreter) and no GPU"
)


def needs_interpreter(test: T) -> T:
    """A test that runs kernels through Triton's interpreter: skipped without Triton or with a GPU, and ``slow``
    (tens of seconds of one CPU), which parallel runs start first (tests/conftest.py)."""
    return pytest.mark.slow(_interpreter_skip(test))


@contextmanager
def kernel_switch(name: str, mode: str) -> Iterator[None]:
    """``os.environ[name] = mode`` for the block (the kernels read their switch at each call), restored after."""
    old = os.environ.get(name)
    os.environ[name] = mode
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def run_interpreted(script: str, switch: str, timeout: float = 900, **env: str) -> None:
    """Run ``script`` in a fresh interpreter with Triton's interpreter on and ``switch`` set to ``interpret`` (plus
    ``env``); it must exit 0 and print "ok"."""
    full_env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(sys.path), **{switch: "interpret"})
    full_env.update(env)
    r = subprocess.run([sys.executable, "-c", script], env=full_env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
