"""The test suite's one helpers module: free ports, in-process servers, server messages, waiting.

Client-side helpers read the wire as a client does (raw frames, or :mod:`moss_rt.client`);
``ServerThread`` runs ``create_app(settings, engine)`` on its own loop and thread, like a deployed
service (the ``make_server`` fixture in conftest.py uses it).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import requests
import websockets
from aiohttp import web

from moss_rt.client import DirectingClient
from moss_rt.config import Settings
from moss_rt.engine.base import Engine
from moss_rt.protocol import ServerMessage
from moss_rt.web.app import create_app
from moss_rt.web.state import STATE, ServiceState

T = TypeVar("T")


# --------------------------------------------------------------------------- ports and servers


def free_port() -> int:
    """A loopback port for a server to listen on, reserved: no other process's ``bind(0)`` gets it for a minute.

    A port that is merely free when asked for may be handed to someone else before the server binds it (a server
    subprocess takes seconds to start, and under pytest-xdist other workers ask for ports at the same time). So the
    port is connected to once and closed from its own side first, which leaves it in TIME_WAIT: the kernel skips it
    when it picks ports for ``bind(0)``, while a server binding it by number with SO_REUSEADDR (aiohttp's default,
    so every moss_rt server) gets it at once.
    """
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        address = listener.getsockname()
        with socket.create_connection(address):
            accepted, _ = listener.accept()
            accepted.close()  # closed first on the port's side: the TIME_WAIT is the port's
        return int(address[1])


@dataclass
class RunningServer:
    url: str
    ws_url: str
    state: ServiceState
    loop: asyncio.AbstractEventLoop

    @property
    def engine(self) -> Engine:
        return self.state.engine


class ServerThread:
    """Runs create_app(settings, engine) on its own loop and thread, like a deployed service."""

    def __init__(self, settings: Settings, engine: Engine, *, send_buffer_bytes: int | None = None) -> None:
        self.settings = settings
        self.engine = engine
        # The kernel's send buffer of every connection, fixed (no autotuning): how much a client that stops reading
        # lets the server write before its sends block. Linux 6.18 grows it to tcp_wmem's 4 MB even toward a peer
        # offering a 4 KB window, so a test of back-pressure must bound it on the server's side.
        self.send_buffer_bytes = send_buffer_bytes
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self.server: RunningServer | None = None

    def start(self, ready_timeout: float = 60.0) -> RunningServer:
        self._thread.start()
        app = create_app(self.settings, self.engine)

        async def _start() -> None:
            self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=2.0)
            await self._runner.setup()
            if self.send_buffer_bytes is None:
                await web.TCPSite(self._runner, self.settings.host, self.settings.port).start()
            else:  # accepted sockets inherit the listening socket's buffer size and its lock against autotuning
                listening = socket.create_server((self.settings.host, self.settings.port))
                listening.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer_bytes)
                await web.SockSite(self._runner, listening).start()
            for _ in range(int(ready_timeout * 20)):
                if app[STATE].engine.info.ready:
                    return
                await asyncio.sleep(0.05)
            raise RuntimeError("engine never became ready")

        asyncio.run_coroutine_threadsafe(_start(), self.loop).result(ready_timeout + 5)
        base = f"http://{self.settings.host}:{self.settings.port}"
        self.server = RunningServer(base, base.replace("http", "ws") + "/api/ws", app[STATE], self.loop)
        return self.server

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


# --------------------------------------------------------------------------- running and waiting


def run(coro: Coroutine[Any, Any, T], timeout: float = 120.0) -> T:
    """Run an async test scenario to completion within ``timeout`` seconds."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def error_of(r: requests.Response) -> dict[str, Any]:
    assert r.headers["Content-Type"].startswith("application/json"), r.headers
    body = r.json()
    assert set(body) == {"error"}, body
    return body["error"]


def decode(data: str | bytes) -> tuple[int, Any]:
    """(tag, JSON object or PCM bytes) of one server frame."""
    assert isinstance(data, bytes)
    tag, length = data[0], int.from_bytes(data[1:5], "big")
    payload = data[5 : 5 + length]
    return tag, (json.loads(payload) if tag == 0 else payload)


async def next_json(ws: websockets.ClientConnection, kind: str | None = None, within: float = 10.0) -> dict[str, Any]:
    """The next tag-0 message (of ``kind`` if given), skipping audio and other messages."""

    async def _wait() -> dict[str, Any]:
        while True:
            tag, obj = decode(await ws.recv())
            if tag == 0 and (kind is None or obj["type"] == kind):
                return obj

    return await asyncio.wait_for(_wait(), within)


async def hello(ws: websockets.ClientConnection) -> dict[str, Any]:
    return await next_json(ws, "hello")


def parse_frames(body: bytes) -> list[tuple[int, Any]]:
    frames, pos = [], 0
    while pos < len(body):
        length = int.from_bytes(body[pos + 1 : pos + 5], "big")
        frames.append(decode(body[pos : pos + 5 + length]))
        pos += 5 + length
    return frames


async def wait_until(pred: Callable[[], object], within: float = 5.0, interval: float = 0.005) -> float:
    """Seconds until ``pred()`` held; raises AssertionError on timeout."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while not pred():
        if loop.time() - t0 > within:
            raise AssertionError(f"condition not met within {within} s")
        await asyncio.sleep(interval)
    return loop.time() - t0


async def next_message(client: DirectingClient, kind: str) -> ServerMessage:
    """The next server message of ``kind`` read through :class:`DirectingClient`, skipping the rest."""
    while True:
        item = await client.receive()
        if isinstance(item, ServerMessage) and item.type == kind:
            return item


# --------------------------------------------------------------------------- owners of stored sessions


class OwnerJar:
    """The owner cookie a keyless server gives a client (stored sessions belong to it, moss_rt/web/owners.py):
    kept from the first answer that sets it, sent with every later request and WebSocket upgrade."""

    NAME = "moss_rt_owner"

    def __init__(self) -> None:
        self.cookie: str | None = None

    def headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        out = dict(extra or {})
        if self.cookie is not None:
            out["Cookie"] = f"{self.NAME}={self.cookie}"
        return out

    def keep(self, headers: Any) -> None:
        """Take the owner cookie from an answer's headers (``requests`` or ``websockets``), when it sets one."""
        values = headers.get_all("Set-Cookie") if hasattr(headers, "get_all") else [headers.get("Set-Cookie")]
        for value in values or []:
            if value and value.startswith(self.NAME + "="):
                self.cookie = value.split(";", 1)[0].split("=", 1)[1]

    def request(self, method: str, url: str, **kwargs: Any) -> requests.Response:
        kwargs["headers"] = self.headers(kwargs.get("headers"))
        kwargs.setdefault("timeout", 10)
        r = requests.request(method, url, **kwargs)
        self.keep(r.headers)
        return r

    async def connect(
        self, ws_url: str, *, headers: dict[str, str] | None = None, **kwargs: Any
    ) -> websockets.ClientConnection:
        ws = await websockets.connect(ws_url, additional_headers=self.headers(headers), **kwargs)
        if ws.response is not None:
            self.keep(ws.response.headers)
        return ws
