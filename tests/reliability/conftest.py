"""Fixtures for the reliability suite: in-process servers on the scripted engine, subprocess servers,
and a raw WebSocket client that can misbehave (never read, never answer pings)."""

from __future__ import annotations

import base64
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests

from tests.helpers import RunningServer, free_port
from tests.web.conftest import scripted

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def fast_server(make_server: Callable[..., RunningServer]) -> Callable[..., RunningServer]:
    """Factory: a scripted-engine server at 10 ms per frame, unpaced, with overrides."""

    def _make(**overrides: object) -> RunningServer:
        opts: dict[str, object] = {"engine": "scripted", "frame_ms": 10.0, "max_lead_sec": 0.0}
        opts.update(overrides)
        return make_server(scripted, **opts)

    return _make


# --------------------------------------------------------------------------- subprocess servers


class ServerProcess:
    """``python -m moss_rt serve --engine scripted`` in its own process, as deployed."""

    def __init__(self, data_dir: Path, *extra: str, log_path: Path | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}/api/ws"
        self.data_dir = data_dir
        self.extra = extra
        self.log_path = log_path or data_dir.parent / f"server-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> ServerProcess:
        cmd = [
            sys.executable,
            "-m",
            "moss_rt",
            "serve",
            "--engine",
            "scripted",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--data-dir",
            str(self.data_dir),
            "--voices-dir",
            str(self.data_dir.parent / "builtin-voices"),
            *self.extra,
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env = {k: v for k, v in env.items() if not k.startswith("MOSS_RT_")}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.log_path.read_text()[-2000:]}")
            try:
                if requests.get(self.url + "/readyz", timeout=1).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.05)
        raise RuntimeError("server never became ready")

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture
def server_process(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    started: list[ServerProcess] = []

    def _make(*extra: str, data_dir: Path | None = None) -> ServerProcess:
        proc = ServerProcess(data_dir or tmp_path / "data", *extra).start()
        started.append(proc)
        return proc

    yield _make
    for proc in started:
        proc.stop()


# --------------------------------------------------------------------------- raw websocket


def ws_client_frame(payload: bytes, opcode: int = 0x1) -> bytes:
    """One masked client frame (RFC 6455), built by hand so tests control every byte."""
    mask = os.urandom(4)
    n = len(payload)
    if n < 126:
        header = bytes([0x80 | opcode, 0x80 | n])
    elif n < 65536:
        header = bytes([0x80 | opcode, 0x80 | 126]) + n.to_bytes(2, "big")
    else:
        header = bytes([0x80 | opcode, 0x80 | 127]) + n.to_bytes(8, "big")
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return header + mask + masked


def raw_http(port: int, head: str, *, rcvbuf: int | None = None, timeout: float = 5.0) -> socket.socket:
    """A socket that has sent ``head`` (request line + headers) and nothing else."""
    sock = socket.socket()
    if rcvbuf is not None:
        # A small receive window makes "stops reading" bite after little data.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(timeout)
    sock.connect(("127.0.0.1", port))
    sock.sendall(head.encode())
    return sock


def read_head(sock: socket.socket) -> tuple[int, str]:
    """Status code and header block of an HTTP answer (the body stays in the socket)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(1)
        if not chunk:
            break
        data += chunk
    head = data.decode("latin-1")
    return int(head.split(" ", 2)[1]), head


def raw_ws_connect(port: int, *, rcvbuf: int | None = None, headers: str = "") -> socket.socket:
    key = base64.b64encode(os.urandom(16)).decode()
    sock = raw_http(
        port,
        f"GET /api/ws HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n{headers}\r\n",
        rcvbuf=rcvbuf,
    )
    status, head = read_head(sock)
    assert status == 101, head
    return sock
