"""Fuzzing the live WebSocket endpoint: random, garbage and near-valid messages never hurt the server.

The decoders themselves have property tests in tests/protocol; this drives the whole path
(aiohttp, rate limiter, dispatcher, takes, engine) over a real socket.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time
from typing import Any

import msgpack
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from moss_rt.protocol import ErrorCode, Limits
from tests.helpers import decode

FIELDS = [
    "type",
    "text",
    "instruction",
    "language",
    "reference",
    "seed",
    "audio_temperature",
    "audio_top_p",
    "audio_top_k",
    "audio_repetition_penalty",
    "text_temperature",
    "text_top_p",
    "text_top_k",
    "max_new_tokens",
    "chunk_frames",
    "model",
    "tokens",
    "take",
    "channels",
    "frame",
    "time_sec",
    "mode",
    "t",
]
TYPES = ["start", "seek", "cancel", "ping", "hello", "end", "", "START", "\x00"]
CODES = {c.value for c in ErrorCode}

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
    | st.sampled_from(["none", "t_x", "ref_" + "0" * 24, "../../etc/passwd", "replay", "retake"])
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
near_valid = st.fixed_dictionaries(
    {"type": st.sampled_from(TYPES) | st.text(max_size=10)},
    optional={name: values for name in FIELDS[1:]},
)


def to_json(obj: Any) -> str:
    # Python's json writes NaN/Infinity, which strict JSON (and the server) refuses: good garbage too.
    return json.dumps(obj, allow_nan=True)


def to_msgpack(obj: Any) -> bytes:
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except (OverflowError, TypeError, ValueError):
        return b"\xc1"  # a byte msgpack never uses


messages = st.one_of(
    st.text(max_size=200),
    st.binary(max_size=200),
    near_valid.map(to_json),
    near_valid.map(to_msgpack),
    st.lists(values, max_size=3).map(to_json),
    values.map(to_msgpack),
)


class Session:
    """One socket, reopened when a message legitimately closes it (fatal errors, oversize)."""

    def __init__(self, url: str, stack: contextlib.ExitStack) -> None:
        self.url = url
        self.stack = stack
        self.ws: ClientConnection | None = None
        self.counter = itertools.count()
        self.reopened = 0

    def socket(self) -> ClientConnection:
        if self.ws is None:
            self.ws = self.stack.enter_context(connect(self.url, max_size=None, open_timeout=10))
            hello = decode(self.ws.recv(timeout=10))[1]
            assert hello["type"] == "hello"
        return self.ws

    def exchange(self, message: str | bytes) -> None:
        """Send ``message`` then a ping; everything the server says until the pong must be sane."""
        ws = self.socket()
        t = next(self.counter)
        try:
            ws.send(message)
            ws.send(json.dumps({"type": "ping", "t": t}))
            while True:
                tag, obj = decode(ws.recv(timeout=10))
                if tag != 0:
                    continue
                assert isinstance(obj, dict) and isinstance(obj.get("type"), str)
                if obj["type"] == "error":
                    assert obj["code"] in CODES and obj["code"] != "internal", obj
                if obj["type"] == "pong" and obj["t"] == t:
                    return
        except ConnectionClosed as closed:
            # Only a fatal protocol error (1008) or an oversize message (1009) may end the socket.
            assert closed.rcvd is not None and closed.rcvd.code in (1008, 1009), closed
            self.ws = None
            self.reopened += 1


def test_websocket_survives_random_messages(fast_server) -> None:
    srv = fast_server(
        frame_ms=1.0,
        # Takes stay short, and the rate limiter is off so every message reaches the decoders.
        limits=Limits(max_new_tokens=24, ws_messages_per_sec=0.0),
    )
    stack = contextlib.ExitStack()
    session = Session(srv.ws_url, stack)

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(batch=st.lists(messages, min_size=1, max_size=3))
    def fuzz(batch: list[str | bytes]) -> None:
        for message in batch:
            session.exchange(message)

    with stack:
        fuzz()
    # The server still serves: health, a full take on a fresh socket, no leaked slots.
    assert requests.get(f"{srv.url}/healthz").status_code == 200
    with connect(srv.ws_url) as ws:
        decode(ws.recv(timeout=10))
        ws.send(json.dumps({"type": "start", "text": "after the storm", "tokens": 5}))
        while True:
            tag, obj = decode(ws.recv(timeout=10))
            if tag == 0 and obj["type"] == "end":
                assert obj["reason"] == "done" and obj["n_frames"] == 5
                break
    deadline = time.monotonic() + 5
    while srv.engine.active_count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert srv.engine.active_count == 0, "a take outlived its socket"


def test_websocket_survives_protocol_level_garbage(fast_server) -> None:
    """Raw bytes after the upgrade (not even WebSocket frames) only cost that one socket."""
    import os

    from tests.reliability.conftest import raw_ws_connect

    srv = fast_server()
    port = int(srv.url.rsplit(":", 1)[1])
    for i in range(20):
        sock = raw_ws_connect(port)
        sock.sendall(os.urandom(64 + i * 50))
        sock.close()
    assert requests.get(f"{srv.url}/api/models").status_code == 200
    with connect(srv.ws_url) as ws:
        assert decode(ws.recv(timeout=10))[1]["type"] == "hello"
