"""Bounded soak test: ``make soak`` (``python -m tests.soak``); minutes, not part of ``make test``.

Starts a real server process (the tiny random-weight MOSS model when the real engine is
available, else the scripted test engine, and says which), then runs for ``--duration`` seconds:

* ``--ws-clients`` WebSocket clients, each doing random start / cancel / seek (retake) / replay /
  barge-in / ping / bad messages / abrupt disconnects;
* ``--http-clients`` legacy HTTP stream clients, some of which hang up mid-take;
* one uploader sending valid and invalid reference voices, deleting most of them after use;
* one hostile client cycling through: downloads of a long take that it never reads (each must be
  dropped by the send-stall timeout), request bodies that stop arriving (each must get 408),
  cross-origin / text-plain posts (each must be refused 403 / 415), and session imports: a hostile
  archive (tests/reliability/archives.py: broken zips, bombs, JSON too large or deep, forged codes,
  lying audio; each must be a 4xx) then a valid one, which must import whole and be deleted by its owner;
* ``--droppers`` clients that drop formatted takes mid-stream with a TCP reset, right after their first
  encoded bytes: WebSocket takes with a ``format`` and ``/v1/audio/speech`` requests (issue 23, finding 1:
  this crashed the server in FFmpeg; the server must live through every one).

It reports requests, errors by kind, takes by end reason and server RSS at start (after warm-up)
and end, and fails on any 5xx, any ``internal`` error, any stuck take (started but never ended
within ``--take-timeout``), engine slots still busy after the clients leave, a server that dies,
or RSS growth beyond ``--rss-growth-mb`` (default 150 MB: allocator and cache slack for a
process that holds a model; a leak of per-take state over thousands of takes exceeds it).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import io
import json
import logging
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import soundfile as sf
import websockets

from tests.helpers import free_port
from tests.reliability.archives import hostile_archives, valid_archive

log = logging.getLogger("soak")
REPO = Path(__file__).resolve().parents[1]
HEARD_AUDIO_MB = 16  # the server's budget for held streamed PCM during the soak
STALL_SEC = 3.0  # the server's send- and body-stall timeouts during the soak
LONG_TAKE_FRAMES = 400  # the take the hostile client downloads without reading (3 MB of PCM)
TEXTS = ["Hello there.", "The quick brown fox jumps over the lazy dog.", "Again, with feeling!", "No.", "Wait... what?"]
GARBAGE: list[str | bytes] = [
    "{not json",
    "[]",
    '{"type": "dance"}',
    '{"type": "start", "text": ""}',
    b"\xc1\xc1",
    b"\x00" * 64,
    '{"type": "start", "text": "x", "chunk_frames": 0}',
    "x" * 70000,
]


@dataclass
class Stats:
    requests: collections.Counter[str] = field(default_factory=collections.Counter)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    http_status: collections.Counter[str] = field(default_factory=collections.Counter)
    end_reasons: collections.Counter[str] = field(default_factory=collections.Counter)
    failures: list[str] = field(default_factory=list)
    stuck: int = 0

    def fail(self, message: str) -> None:
        if len(self.failures) < 50:
            self.failures.append(message)
        log.error("FAIL: %s", message)


# --------------------------------------------------------------------------- server process


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def choose_engine(requested: str) -> tuple[str, list[str]]:
    if requested in ("auto", "moss"):
        try:
            import moss_rt.engine.moss  # noqa: F401  (needs torch and the real engine)

            return "moss", ["--engine", "moss", "--model", "tiny", "--codec", "tiny", "--device", "cpu"]
        except Exception as exc:  # the engine is not there (yet) or torch is missing
            if requested == "moss":
                raise
            log.warning("real engine unavailable (%s): FALLING BACK TO THE SCRIPTED TEST ENGINE", exc)
    return "scripted", ["--engine", "scripted", "--frame-ms", "20"]


def start_server(engine_args: list[str], data_dir: Path, port: int, log_path: Path) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "moss_rt",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--data-dir",
        str(data_dir),
        "--voices-dir",
        str(data_dir / "builtin"),
        # Every soak client shares 127.0.0.1: the per-address request rate would refuse most of them.
        "--http-requests-per-sec",
        "0",
        # Held streamed PCM is bounded by design; a small budget keeps it from hiding a leak in RSS.
        "--heard-audio-mb",
        str(HEARD_AUDIO_MB),
        # Short stall timeouts so the hostile client's stalled downloads and bodies cycle quickly.
        "--send-stall-timeout-sec",
        str(STALL_SEC),
        "--body-stall-timeout-sec",
        str(STALL_SEC),
        *engine_args,
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOSS_RT_")}
    with open(log_path, "wb") as out:
        return subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)


async def wait_ready(http: aiohttp.ClientSession, url: str, proc: subprocess.Popen[bytes], within: float) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        with contextlib.suppress(aiohttp.ClientError):
            async with http.get(url + "/readyz") as r:
                if r.status == 200:
                    return
        await asyncio.sleep(0.2)
    raise RuntimeError("server never became ready")


async def metric(http: aiohttp.ClientSession, url: str, name: str) -> float | None:
    async with http.get(url + "/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return None


# --------------------------------------------------------------------------- WebSocket clients


def frame_of(data: str | bytes) -> tuple[int, Any]:
    assert isinstance(data, bytes), "the server sends binary frames only"
    tag, length = data[0], int.from_bytes(data[1:5], "big")
    payload = data[5 : 5 + length]
    return tag, json.loads(payload) if tag == 0 else payload


class WsClient:
    """One directing client. Tracks takes it asked for until their end (or an error) arrives."""

    def __init__(self, url: str, stats: Stats, rng: random.Random, take_timeout: float) -> None:
        self.url = url
        self.stats = stats
        self.rng = rng
        self.take_timeout = take_timeout
        self.pending: dict[int, float] = {}  # outstanding start/seek requests (by sequence) → sent at
        self.sent: dict[int, str] = {}  # what each pending request was (for the failure report)
        self.log: collections.deque[str] = collections.deque(maxlen=12)  # recent traffic, for diagnosis
        self.seq = 0
        self.finished: list[tuple[str, int]] = []  # (take id, n_frames) of ended takes
        self.running = False

    async def run(self, until: float) -> None:
        while time.monotonic() < until:
            try:
                async with websockets.connect(self.url, max_size=None, open_timeout=20) as ws:
                    self.stats.requests["ws_connect"] += 1
                    await self.session(ws, until)
            except websockets.InvalidStatus as exc:
                code = exc.response.status_code
                self.stats.http_status[str(code)] += 1
                if code >= 500 and code != 503:
                    self.stats.fail(f"WebSocket upgrade answered {code}")
                await asyncio.sleep(0.5)
            except (websockets.ConnectionClosed, OSError) as exc:
                self.stats.errors[f"ws_closed:{type(exc).__name__}"] += 1
            self.check_stuck(final=False)
            self.pending.clear()  # a disconnect ends what was pending on that socket
            self.sent.clear()
            self.running = False

    async def session(self, ws: websockets.ClientConnection, until: float) -> None:
        reader = asyncio.create_task(self.read(ws), name="soak-ws-reader")
        try:
            await asyncio.sleep(0)
            while time.monotonic() < until and not reader.done():
                await self.act(ws)
                if self.rng.random() < 0.03:  # abrupt disconnect mid-whatever
                    self.stats.requests["ws_disconnect"] += 1
                    if self.rng.random() < 0.5:
                        ws.transport.abort()
                    return
                await asyncio.sleep(self.rng.uniform(0.05, 0.6))
                self.check_stuck(final=False)
            # Let what is running finish, then leave cleanly.
            deadline = time.monotonic() + self.take_timeout
            while self.pending and time.monotonic() < deadline and not reader.done():  # noqa: ASYNC110 - polls two sources
                await asyncio.sleep(0.05)
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader

    async def act(self, ws: websockets.ClientConnection) -> None:
        r = self.rng.random()
        if r < 0.35 or not self.finished:
            await self.send(
                ws,
                {
                    "type": "start",
                    "text": self.rng.choice(TEXTS),
                    "seed": self.rng.randrange(1000),
                    "max_new_tokens": self.rng.randint(8, 60),
                    "chunk_frames": self.rng.choice([1, 2, 4, 8]),
                    "channels": self.rng.choice([1, 2]),
                },
                "start",
                expects_take=True,
            )
        elif r < 0.50:
            await self.send(ws, {"type": "cancel"}, "cancel")
        elif r < 0.65:
            take, n = self.rng.choice(self.finished)
            await self.send(
                ws,
                {
                    "type": "seek",
                    "take": take,
                    "frame": self.rng.randint(0, max(0, n)),
                    "seed": self.rng.randrange(1000),
                },
                "seek_retake",
                expects_take=True,
            )
        elif r < 0.78:
            take, n = self.rng.choice(self.finished)
            await self.send(
                ws,
                {"type": "seek", "take": take, "frame": self.rng.randint(0, max(0, n)), "mode": "replay"},
                "seek_replay",
                expects_take=True,
            )
        elif r < 0.90:
            await self.send(ws, {"type": "ping", "t": time.time()}, "ping")
        else:
            self.stats.requests["ws_bad_message"] += 1
            await ws.send(self.rng.choice(GARBAGE))

    async def send(
        self, ws: websockets.ClientConnection, msg: dict[str, Any], kind: str, *, expects_take: bool = False
    ) -> None:
        self.stats.requests[f"ws_{kind}"] += 1
        if expects_take:
            self.seq += 1
            self.pending[self.seq] = time.monotonic()
            self.sent[self.seq] = json.dumps(msg)[:160]
        self.log.append(f"{time.strftime('%H:%M:%S')} > {json.dumps(msg)[:120]}")
        await ws.send(json.dumps(msg))

    def resolve_one(self) -> None:
        if self.pending:
            seq = min(self.pending)
            del self.pending[seq]
            self.sent.pop(seq, None)

    async def read(self, ws: websockets.ClientConnection) -> None:
        open_take: str | None = None  # between a start and its end: the only time audio may arrive
        async for data in ws:
            tag, obj = frame_of(data)
            if tag != 0:
                if open_take is None:  # issue 23, finding 3: a cancelled replay's audio after its end
                    self.stats.fail(f"tag-{tag} audio outside a take; recent traffic: {list(self.log)}")
                continue
            kind = obj["type"]
            if kind == "start":
                open_take = obj["take"]
            elif kind == "end":
                open_take = None
            if kind != "pong":
                self.log.append(f"{time.strftime('%H:%M:%S')} < {json.dumps(obj)[:160]}")
            if kind == "end":
                self.stats.end_reasons[obj["reason"]] += 1
                self.resolve_one()
                if obj["reason"] in ("done", "max_frames", "cancelled", "replaced") and obj.get("n_frames"):
                    self.finished = (self.finished + [(obj["take"], int(obj["n_frames"]))])[-16:]
            elif kind == "error":
                self.stats.errors[obj["code"]] += 1
                if obj["code"] == "internal":
                    self.stats.fail(f"internal error: {obj}")
                if obj.get("take") or obj.get("field") in ("take", "frame") or obj["code"] in ("busy", "rate_limited"):
                    self.resolve_one()  # the request that expected a take was refused

    def check_stuck(self, *, final: bool) -> None:
        now = time.monotonic()
        for seq, sent in list(self.pending.items()):
            if now - sent > self.take_timeout:
                self.stats.stuck += 1
                self.stats.fail(
                    f"take request {seq} ({self.sent.get(seq)}) got no end within {self.take_timeout} s; "
                    f"recent traffic: {list(self.log)}"
                )
                del self.pending[seq]


# --------------------------------------------------------------------------- HTTP clients


async def http_streamer(
    http: aiohttp.ClientSession, url: str, stats: Stats, rng: random.Random, until: float, take_timeout: float
) -> None:
    while time.monotonic() < until:
        body = {"text": rng.choice(TEXTS), "max_new_tokens": rng.randint(8, 60), "chunk_frames": rng.choice([1, 4, 8])}
        stats.requests["http_stream"] += 1
        hang_up = rng.random() < 0.2
        try:
            async with asyncio.timeout(take_timeout):
                async with http.post(url + "/api/stream", json=body) as r:
                    stats.http_status[str(r.status)] += 1
                    if r.status >= 500 and r.status != 503:
                        stats.fail(f"/api/stream answered {r.status}")
                    if r.status != 200:
                        continue
                    buf = b""
                    last: dict[str, Any] | None = None
                    async for chunk in r.content.iter_chunked(65536):
                        buf += chunk
                        while len(buf) >= 5 and len(buf) >= 5 + int.from_bytes(buf[1:5], "big"):
                            n = 5 + int.from_bytes(buf[1:5], "big")
                            tag, obj = frame_of(buf[:n])
                            buf = buf[n:]
                            if tag == 0:
                                last = obj
                        if hang_up:
                            stats.requests["http_hang_up"] += 1
                            break
                    if not hang_up:
                        if last is None or last["type"] != "end":
                            stats.fail(f"HTTP stream ended without an end frame: {last}")
                        else:
                            stats.end_reasons["http_" + last["reason"]] += 1
        except TimeoutError:
            stats.stuck += 1
            stats.fail(f"HTTP stream took longer than {take_timeout} s")
        except aiohttp.ClientError as exc:
            stats.errors[f"http:{type(exc).__name__}"] += 1
        await asyncio.sleep(rng.uniform(0.05, 0.5))


def wav_bytes(seconds: float, sr: int, seed: int) -> bytes:
    data = 0.1 * np.random.default_rng(seed).standard_normal(int(seconds * sr)).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, data, sr, format="WAV")
    return buf.getvalue()


async def uploader(http: aiohttp.ClientSession, url: str, stats: Stats, rng: random.Random, until: float) -> None:
    i = 0
    while time.monotonic() < until:
        i += 1
        r = rng.random()
        if r < 0.6:
            data, ext = wav_bytes(rng.uniform(0.6, 3.0), rng.choice([16000, 24000, 48000]), i), "wav"
        elif r < 0.8:
            data, ext = os.urandom(rng.randint(0, 5000)), "wav"
        else:
            good = wav_bytes(1.0, 16000, i)
            data, ext = good[: len(good) // 2], "wav"
        stats.requests["http_upload"] += 1
        try:
            async with http.post(url + "/api/upload_ref", params={"ext": ext}, data=data) as resp:
                stats.http_status[str(resp.status)] += 1
                if resp.status >= 500:
                    stats.fail(f"/api/upload_ref answered {resp.status}")
                elif resp.status == 200:
                    ref = (await resp.json())["ref_id"]
                    stats.requests["http_stream_with_voice"] += 1
                    async with http.post(
                        url + "/api/stream", json={"text": "voice", "reference": ref, "max_new_tokens": 10}
                    ) as s:
                        stats.http_status[str(s.status)] += 1
                        await s.read()
                        if s.status >= 500 and s.status != 503:
                            stats.fail(f"/api/stream with an uploaded voice answered {s.status}")
                    if rng.random() < 0.8:  # most voices are deleted by their owner after use
                        stats.requests["http_delete_voice"] += 1
                        async with http.delete(f"{url}/api/voices/{ref}") as d:
                            stats.http_status[str(d.status)] += 1
                            if d.status != 200:
                                stats.fail(f"DELETE of an own voice answered {d.status}")
        except aiohttp.ClientError as exc:
            stats.errors[f"http:{type(exc).__name__}"] += 1
        await asyncio.sleep(rng.uniform(0.2, 1.0))


# --------------------------------------------------------------------------- hostile client


async def raw_connection(port: int, head: bytes, *, rcvbuf: int | None = None) -> tuple[Any, Any]:
    """A raw HTTP/1.1 connection that has sent ``head``; a small receive window makes not reading bite."""
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock, limit=4096)
    writer.write(head)
    await writer.drain()
    return reader, writer


async def read_all(reader: Any, within: float) -> tuple[bytes, bool]:
    """What arrives until the server closes (True) or ``within`` passes (False)."""
    data = b""
    try:
        async with asyncio.timeout(within):
            while chunk := await reader.read(1 << 20):
                data += chunk
    except TimeoutError:
        return data, False
    except (ConnectionError, OSError):
        pass
    return data, True


async def long_take(http: aiohttp.ClientSession, url: str, stats: Stats) -> tuple[str | None, int]:
    """A fresh take of LONG_TAKE_FRAMES frames (takes are evicted from the store as the soak runs)."""
    # Greedy text: the tiny model's stop never fires, so the take really is that long.
    body = {
        "text": "a long take",
        "tokens": LONG_TAKE_FRAMES,
        "max_new_tokens": LONG_TAKE_FRAMES,
        "chunk_frames": 20,
        "text_temperature": 0,
    }
    async with http.post(url + "/api/stream", json=body) as r:
        data = await r.read()
    if r.status != 200:
        return None, 0
    take = json.loads(data[5 : 5 + int.from_bytes(data[1:5], "big")])["take"]
    async with http.get(f"{url}/api/takes/{take}") as r:
        frames = int((await r.json()).get("n_frames", 0)) if r.status == 200 else 0
    if frames < LONG_TAKE_FRAMES // 2:  # must be far more than the socket buffers hold
        stats.fail(f"the hostile client's long take has only {frames} frames")
        return None, 0
    return take, 44 + frames * 3840 * 2


async def hostile(
    http: aiohttp.ClientSession,
    url: str,
    port: int,
    stats: Stats,
    rng: random.Random,
    until: float,
    first_take: tuple[str | None, int],
    archives: list[tuple[str, bytes]],
) -> None:
    """Non-reading downloaders, stalled bodies, cross-site posts and session imports, in turns, all the soak long."""
    host = f"Host: 127.0.0.1:{port}\r\n"
    take, wav_length = first_take
    while time.monotonic() < until:
        kind = rng.choice(["download", "body", "cross_site", "import"])
        if kind == "download" and take is None:
            take, wav_length = await long_take(http, url, stats)
        stats.requests[f"hostile_{kind}"] += 1
        try:
            if kind == "download" and take is not None:
                head = f"GET /api/takes/{take}.wav HTTP/1.1\r\n{host}\r\n".encode()
                conns = [await raw_connection(port, head, rcvbuf=4096) for _ in range(4)]
                await asyncio.sleep(STALL_SEC + 2)  # never read: the server must drop each one
                for reader, writer in conns:
                    received, closed = await read_all(reader, 10)
                    writer.close()
                    status = received[9:12].decode(errors="replace")
                    stats.http_status[status] += 1
                    if status == "404":  # evicted from the take store meanwhile: make another
                        take, wav_length = await long_take(http, url, stats)
                    elif status == "503":
                        stats.requests["hostile_download_busy"] += 1
                    elif not closed or len(received) >= wav_length:
                        stats.fail(f"a non-reading download was not dropped ({received[:12]!r}, {len(received)} B)")
                    else:
                        stats.requests["hostile_download_dropped"] += 1
            elif kind == "body":
                path = rng.choice(["/api/stream", "/api/upload_ref?ext=wav"])
                head = f"POST {path} HTTP/1.1\r\n{host}Content-Length: 100000\r\n\r\nRIFF".encode()
                reader, writer = await raw_connection(port, head)
                try:
                    answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), STALL_SEC + 10)
                except (TimeoutError, asyncio.IncompleteReadError, ConnectionError) as exc:
                    answer = repr(exc).encode()
                writer.close()
                status = answer[9:12].decode(errors="replace")
                stats.http_status[status] += 1
                if status != "408":
                    stats.fail(f"a stalled body on {path} got {answer[:40]!r}, not 408")
            elif kind == "import":
                await hostile_import(url, stats, rng.choice(archives))
            else:
                evil = {"Origin": "https://evil.example", "Content-Type": "text/plain"}
                for path, data, want in [
                    ("/api/stream", b'{"text": "x"}', 403),
                    ("/api/upload_ref?ext=wav", b"RIFF", 403),
                    ("/api/stream", b'{"text": "x"}', 415),
                ]:
                    headers = evil if want == 403 else {"Content-Type": "text/plain"}
                    async with http.post(url + path, data=data, headers=headers) as resp:
                        stats.http_status[str(resp.status)] += 1
                        if resp.status != want:
                            stats.fail(f"cross-site post to {path} answered {resp.status}, not {want}")
        except (aiohttp.ClientError, OSError) as exc:
            stats.errors[f"hostile:{type(exc).__name__}"] += 1
        await asyncio.sleep(rng.uniform(0.1, 0.5))


async def hostile_import(url: str, stats: Stats, hostile: tuple[str, bytes]) -> None:
    """A hostile archive (must be a 4xx), then a valid one (must import whole; deleted by its owner only)."""
    # No cookie jar: the owner cookie is sent only where this says so.
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
        await _hostile_import(http, url, stats, hostile)


async def _hostile_import(http: aiohttp.ClientSession, url: str, stats: Stats, hostile: tuple[str, bytes]) -> None:
    name, data = hostile
    async with http.post(url + "/api/sessions/import", data=data) as r:
        stats.http_status[str(r.status)] += 1
        await r.read()
        if r.status in (429, 503):
            stats.requests["hostile_import_busy"] += 1
        elif not 400 <= r.status < 500:
            stats.fail(f"the hostile archive {name!r} was answered {r.status}, not a 4xx")
        else:
            stats.requests["hostile_import_refused"] += 1
    async with http.post(url + "/api/sessions/import", data=VALID_ARCHIVE) as r:
        stats.http_status[str(r.status)] += 1
        body = await r.json() if r.status == 200 else await r.text()
        owner = r.cookies.get("moss_rt_owner")
    if r.status in (429, 503):
        stats.requests["hostile_import_busy"] += 1
        return
    if r.status != 200 or owner is None or len(body["takes"]) != VALID_TAKES:
        stats.fail(f"a valid archive was answered {r.status}: {str(body)[:200]}")
        return
    # The session is its importer's (the owner cookie), and deleting it frees its room.
    async with http.delete(f"{url}/api/sessions/{body['session']}") as anonymous:
        stats.http_status[str(anonymous.status)] += 1
        if anonymous.status != 404:
            stats.fail(f"another identity's DELETE of a session answered {anonymous.status}, not 404")
    cookie = {"Cookie": f"moss_rt_owner={owner.value}"}
    async with http.delete(f"{url}/api/sessions/{body['session']}", headers=cookie) as d:
        stats.http_status[str(d.status)] += 1
        if d.status != 200:
            stats.fail(f"the owner's DELETE of an imported session answered {d.status}")


VALID_TAKES = 3
VALID_ARCHIVE = valid_archive(VALID_TAKES, 25)


# --------------------------------------------------------------------------- formatted takes dropped mid-stream

DROP_FORMATS = ["mp3", "opus", "aac", "flac", "wav"]


def reset(transport: Any) -> None:
    """Abort a connection with a TCP reset (SO_LINGER 0), as a client that vanishes does."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


async def drop_ws_take(ws_url: str, stats: Stats, rng: random.Random) -> None:
    """A WebSocket take in a delivery format, reset after its first few tag-2 frames."""
    async with websockets.connect(ws_url, max_size=None, open_timeout=20) as ws:
        start = {"type": "start", "text": rng.choice(TEXTS) * 4, "max_new_tokens": rng.randint(40, 200),
                 "chunk_frames": rng.choice([1, 4, 20]), "format": rng.choice(DROP_FORMATS),
                 "sample_rate": rng.choice([48000, 24000, 16000])}
        await ws.send(json.dumps(start))
        wanted, seen = rng.randint(1, 4), 0
        async with asyncio.timeout(30):
            while seen < wanted:
                tag, obj = frame_of(await ws.recv())
                if tag == 2:
                    seen += 1
                elif tag == 0 and obj["type"] in ("end", "error"):
                    return  # refused or already over: nothing to drop
        stats.requests["drop_ws_formatted"] += 1
        reset(ws.transport)


async def drop_speech(port: int, stats: Stats, rng: random.Random) -> None:
    """A /v1/audio/speech request (mp3 by default, as OpenAI's), reset after its first bytes."""
    body = json.dumps({"input": rng.choice(TEXTS) * 4, "voice": "none", "max_new_tokens": rng.randint(40, 200),
                       "chunk_frames": rng.choice([1, 4, 20]),
                       **({"response_format": rng.choice(DROP_FORMATS)} if rng.random() < 0.5 else {})})
    head = (f"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n{body}").encode()
    reader, writer = await raw_connection(port, head)
    try:
        async with asyncio.timeout(30):
            status = (await reader.readuntil(b"\r\n\r\n"))[9:12].decode(errors="replace")
            stats.http_status[status] += 1
            if status.startswith("5") and status != "503":
                stats.fail(f"/v1/audio/speech answered {status}")
            if status == "200":
                await reader.read(rng.choice([1, 512, 4096]))  # its first encoded bytes
                stats.requests["drop_speech"] += 1
    finally:
        reset(writer.transport)


async def dropper(ws_url: str, port: int, stats: Stats, rng: random.Random, until: float) -> None:
    while time.monotonic() < until:
        try:
            if rng.random() < 0.5:
                await drop_ws_take(ws_url, stats, rng)
            else:
                await drop_speech(port, stats, rng)
        except (TimeoutError, OSError, asyncio.IncompleteReadError, websockets.WebSocketException) as exc:
            stats.errors[f"dropper:{type(exc).__name__}"] += 1
        await asyncio.sleep(rng.uniform(0.02, 0.3))


# --------------------------------------------------------------------------- main


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    engine, engine_args = choose_engine(args.engine)
    workdir = Path(tempfile.mkdtemp(prefix="moss-rt-soak-"))
    port = args.port or free_port()
    url, ws_url = f"http://127.0.0.1:{port}", f"ws://127.0.0.1:{port}/api/ws"
    proc = start_server(engine_args, workdir / "data", port, workdir / "server.log")
    stats = Stats()
    rng = random.Random(args.seed)
    report: dict[str, Any] = {
        "engine": engine,
        "duration_sec": args.duration,
        "ws_clients": args.ws_clients,
        "http_clients": args.http_clients,
        "droppers": args.droppers,
        "server_log": str(workdir / "server.log"),
    }
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10)) as http:
            await wait_ready(http, url, proc, args.ready_timeout)
            # Warm-up before the RSS baseline: first takes allocate caches that are not leaks.
            for _ in range(3):
                async with http.post(url + "/api/stream", json={"text": "warm up", "max_new_tokens": 20}) as r:
                    await r.read()
            # The hostile client's long take is made now: generated under the soak's load it can take minutes.
            first_take = await long_take(http, url, stats)
            archives = list((await asyncio.to_thread(hostile_archives)).items())
            rss_start = rss_mb(proc.pid)
            log.info("engine %s, RSS after warm-up %.1f MB; soaking for %.0f s", engine, rss_start, args.duration)
            t0 = time.monotonic()
            until = t0 + args.duration
            clients = [
                WsClient(ws_url, stats, random.Random(rng.random()), args.take_timeout) for _ in range(args.ws_clients)
            ]
            tasks = [asyncio.create_task(c.run(until), name=f"soak-ws-{i}") for i, c in enumerate(clients)]
            tasks += [
                asyncio.create_task(
                    http_streamer(http, url, stats, random.Random(rng.random()), until, args.take_timeout),
                    name=f"soak-http-{i}",
                )
                for i in range(args.http_clients)
            ]
            tasks.append(
                asyncio.create_task(uploader(http, url, stats, random.Random(rng.random()), until), name="soak-upload")
            )
            tasks.append(
                asyncio.create_task(
                    hostile(http, url, port, stats, random.Random(rng.random()), until, first_take, archives),
                    name="soak-hostile",
                )
            )
            tasks += [
                asyncio.create_task(
                    dropper(ws_url, port, stats, random.Random(rng.random()), until), name=f"soak-drop-{i}"
                )
                for i in range(args.droppers)
            ]
            rss_peak = rss_start
            rss_timeline: list[tuple[int, float]] = [(0, round(rss_start, 1))]  # (s, MB) every 15 s: leak or plateau?
            while not all(t.done() for t in tasks):
                await asyncio.sleep(1.0)
                if proc.poll() is not None:
                    stats.fail(f"server died with {proc.returncode}")
                    break
                rss_now = rss_mb(proc.pid)
                rss_peak = max(rss_peak, rss_now)
                elapsed = int(time.monotonic() - t0)
                if elapsed >= rss_timeline[-1][0] + 15:
                    rss_timeline.append((elapsed, round(rss_now, 1)))
            for t in tasks:
                t.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            for res in results:
                if isinstance(res, Exception):
                    stats.fail(f"client crashed: {res!r}")
            for c in clients:
                c.check_stuck(final=True)
            # Every slot must be free once the clients are gone (moss engine exposes the gauge).
            busy_slots = None
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                busy_slots = await metric(http, url, "moss_rt_active_slots")
                if not busy_slots:
                    break
                await asyncio.sleep(0.2)
            if busy_slots:
                stats.fail(f"{busy_slots:.0f} engine slots still busy after every client left")
            async with http.get(url + "/readyz") as r:
                if r.status != 200:
                    stats.fail(f"/readyz answered {r.status} after the soak")
            heard_bytes = await metric(http, url, "moss_rt_heard_audio_bytes") or 0.0
            if heard_bytes > HEARD_AUDIO_MB * 1024 * 1024:
                stats.fail(f"held streamed PCM {heard_bytes / 2**20:.1f} MB is over its {HEARD_AUDIO_MB} MB budget")
            await asyncio.sleep(1.0)
            rss_end = rss_mb(proc.pid)
            growth = rss_end - rss_start
            if growth > args.rss_growth_mb:
                stats.fail(f"RSS grew by {growth:.1f} MB (bound {args.rss_growth_mb} MB)")
            report.update(
                elapsed_sec=round(time.monotonic() - t0, 1),
                rss_start_mb=round(rss_start, 1),
                rss_end_mb=round(rss_end, 1),
                rss_peak_mb=round(rss_peak, 1),
                rss_growth_mb=round(growth, 1),
                rss_bound_mb=args.rss_growth_mb,
                slots_busy_after=busy_slots,
                heard_audio_mb=round(heard_bytes / 2**20, 1),
                rss_timeline=rss_timeline,
            )
        # Graceful exit is part of the soak: SIGTERM must end the process quickly.
        t_term = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            report["exit_code"] = proc.wait(30)
            report["exit_sec"] = round(time.monotonic() - t_term, 2)
        except subprocess.TimeoutExpired:
            stats.fail("server did not exit within 30 s of SIGTERM")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    report.update(
        requests=dict(sorted(stats.requests.items())),
        total_requests=sum(stats.requests.values()),
        errors_by_kind=dict(sorted(stats.errors.items())),
        http_status=dict(sorted(stats.http_status.items())),
        end_reasons=dict(sorted(stats.end_reasons.items())),
        stuck_takes=stats.stuck,
        failures=stats.failures,
        passed=not stats.failures,
    )
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=float(os.environ.get("SOAK_DURATION", 120)))
    p.add_argument("--ws-clients", type=int, default=8)
    p.add_argument("--http-clients", type=int, default=3)
    p.add_argument("--droppers", type=int, default=2, help="clients that reset formatted takes mid-stream")
    p.add_argument("--engine", choices=("auto", "moss", "scripted"), default="auto")
    p.add_argument("--take-timeout", type=float, default=60.0, help="a take request without an end after this is stuck")
    p.add_argument("--rss-growth-mb", type=float, default=150.0)
    p.add_argument("--ready-timeout", type=float, default=180.0)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--report", type=Path, default=REPO / "artifacts" / "soak-report.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)-7s %(name)s: %(message)s")
    report = asyncio.run(soak(args))
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    print(f"soak {'PASSED' if report['passed'] else 'FAILED'} (report: {args.report})")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
