"""Rendering a script from the command line (``moss-rt render``): post it, follow its events, unpack its zip.

Against a running service (``--url``), or an in-process one (``--local``: the same service on a free local port,
with the engine the settings name), through the same HTTP API either way. The event stream is followed with
``Last-Event-ID``, so a dropped connection resumes where it stopped; a progress bar (tqdm) counts lines.

A script is its session's, and a session its owner's (docs/security.md): under an API key the key (sent as the
Bearer key), on a keyless server the owner cookie the server gives with the first post. That cookie is kept in
an :class:`OwnerFile`, by server, so a later run (``--script-id``, ``--session``) acts as the same owner.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import tempfile
import zipfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import aiohttp
from aiohttp.abc import AbstractCookieJar
from yarl import URL

log = logging.getLogger(__name__)

RECONNECT_SEC = 1.0
MAX_RECONNECTS = 30
OWNER_COOKIE = "moss_rt_owner"  # moss_rt/web/owners.py
MAX_OWNER_FILE_BYTES = 1024 * 1024


class RenderError(Exception):
    """The service refused the script or the render failed (the message says why)."""


@dataclass
class RenderResult:
    script_id: str
    session_id: str
    title: str
    lines_done: int = 0
    audio_sec: float = 0.0
    files: list[Path] = field(default_factory=list)
    failed: list[dict[str, Any]] = field(default_factory=list)


def default_owner_file() -> Path:
    """Where owner cookies are kept unless told otherwise: ``$XDG_STATE_HOME/moss_rt/owners.json`` (by default
    ``~/.local/state/moss_rt/owners.json``)."""
    state_home = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state_home) / "moss_rt" / "owners.json"


class OwnerFile:
    """The owner cookies keyless servers gave this command line, by server: a JSON object ``{key: cookie}`` in a
    file only its user may read (a cookie is the identity that owns the sessions and scripts made with it).

    Blocking (small file reads and writes): call it from a worker thread in async code.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def get(self, key: str) -> str | None:
        value = self._read().get(key)
        return value if isinstance(value, str) else None

    def put(self, key: str, cookie: str) -> None:
        """Keep ``cookie`` for ``key`` (read again first, so that another run's servers are kept too)."""
        entries = self._read()
        if entries.get(key) == cookie:
            return
        entries[key] = cookie
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)  # mode 0600
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(entries, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _read(self) -> dict[str, Any]:
        try:
            with self.path.open("rb") as f:
                data = f.read(MAX_OWNER_FILE_BYTES + 1)
        except FileNotFoundError:
            return {}
        try:
            if len(data) > MAX_OWNER_FILE_BYTES:
                raise ValueError("too large")
            entries = json.loads(data)
            if not isinstance(entries, dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            raise RenderError(f"{self.path} is not an owner file ({exc}); move it away to start a new one") from None
        return entries


def owner_key(url: str) -> str:
    """The key of a server's owner cookie in an :class:`OwnerFile`: its origin (scheme, host, port)."""
    u = URL(url)
    return str(u.origin()) if u.is_absolute() else url


def script_body(path: Path, cast: dict[str, Any] | None, session: str | None) -> tuple[bytes, str]:
    """The POST body and its content type: a ``.json`` file is the JSON form, anything else plain text."""
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".json":
        obj = json.loads(text)
        if not isinstance(obj, dict):
            raise RenderError(f"{path}: a JSON script is an object")
        if cast:
            obj["cast"] = {**(obj.get("cast") or {}), **cast}
    elif cast or session:
        obj = {"script": text, **({"cast": cast} if cast else {})}
    else:
        return text.encode("utf-8"), "text/plain; charset=utf-8"
    if session:
        obj["session"] = session
    return json.dumps(obj).encode(), "application/json"


async def _error_text(response: aiohttp.ClientResponse) -> str:
    try:
        body = await response.json(content_type=None)
        error = body.get("error", {})
        return f"{error.get('code')}: {error.get('message')}"
    except (ValueError, aiohttp.ContentTypeError, AttributeError):
        return f"HTTP {response.status}"


async def sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[tuple[str, str, dict[str, Any]]]:
    """(id, event, data) of a text/event-stream response, as they arrive."""
    event_id, kind = "", "message"
    data: list[str] = []
    async for raw in response.content:
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line:
            if data:
                yield event_id, kind, json.loads("\n".join(data))
            kind, data = "message", []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "id":
            event_id = value
        elif name == "event":
            kind = value
        elif name == "data":
            data.append(value)


class Progress:
    """A tqdm bar over the script's lines (nothing when ``enabled`` is off)."""

    def __init__(self, enabled: bool) -> None:
        self._bar: Any = None
        self._enabled = enabled
        self._counted = 0

    def update(self, state: dict[str, Any], title: str) -> None:
        if not self._enabled:
            return
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=state["lines_total"], unit="line", desc=title or "render", file=sys.stderr)
        finished = int(state.get("lines_done", 0)) + int(state.get("lines_failed", 0))
        if finished > self._counted:
            self._bar.update(finished - self._counted)
            self._counted = finished
        self._bar.set_postfix(
            rendering=state.get("lines_rendering", 0),
            failed=state.get("lines_failed", 0),
            audio=f"{state.get('audio_sec', 0):.0f}s",
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


async def render_script(
    url: str,
    out_dir: Path,
    *,
    script_path: Path | None = None,
    script_id: str | None = None,
    cast: dict[str, Any] | None = None,
    session: str | None = None,
    fmt: str | None = None,
    sample_rate: int | None = None,
    api_key: str | None = None,
    progress: bool = True,
    owners: OwnerFile | None = None,
    owners_key: str | None = None,
) -> RenderResult:
    """Post ``script_path`` (or follow ``script_id``), wait for its render, unpack its zip into ``out_dir``.

    Without ``api_key``, the owner cookie kept in ``owners`` under ``owners_key`` (default: the server's origin) is
    sent, and the one the server gives is kept there (nothing is kept without ``owners``: the identity then lasts
    as long as this call)."""
    base = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=None)
    # unsafe: a cookie of a server addressed by IP (127.0.0.1, a LAN address) is kept too.
    jar: AbstractCookieJar = aiohttp.DummyCookieJar() if api_key else aiohttp.CookieJar(unsafe=True)
    key = owners_key or owner_key(base)
    if owners is not None and not api_key:
        kept = await asyncio.to_thread(owners.get, key)
        if kept is not None:
            jar.update_cookies({OWNER_COOKIE: kept}, URL(base))
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, cookie_jar=jar) as http:
        if script_id is None:
            assert script_path is not None
            body, content_type = script_body(script_path, cast, session)
            async with http.post(f"{base}/api/scripts", data=body, headers={"Content-Type": content_type}) as r:
                if r.status != 201:
                    raise RenderError(await _error_text(r))
                script_id = (await r.json())["script"]
            if owners is not None and not api_key:
                await _keep_owner(jar, base, owners, key)  # before anything else: a later run follows it as this
        assert script_id is not None
        state = await _follow(http, base, script_id, Progress(progress))
        result = RenderResult(
            script_id,
            state["session"],
            state.get("title", ""),
            state["lines_done"],
            state["lines_failed"],
            state.get("audio_sec", 0.0),
        )
        result.failed = [line for line in state["lines"] if line["status"] == "failed"]
        result.files = await _download(http, base, script_id, out_dir, fmt, sample_rate, partial=False)
        return result


async def _keep_owner(jar: AbstractCookieJar, base: str, owners: OwnerFile, key: str) -> None:
    morsel = jar.filter_cookies(URL(base)).get(OWNER_COOKIE)
    if morsel is not None and morsel.value:
        try:
            await asyncio.to_thread(owners.put, key, morsel.value)
        except OSError as exc:  # the render goes on; only a later run could not act as its owner
            log.warning("could not keep the owner cookie in %s (%s)", owners.path, exc)


async def _follow(http: aiohttp.ClientSession, base: str, script_id: str, bar: Progress) -> dict[str, Any]:
    """Follow the script's events until ``done``; returns its final state."""
    last_id: str | None = None
    title = ""
    failures = 0
    try:
        while True:
            headers = {"Last-Event-ID": last_id} if last_id else {}
            try:
                async with http.get(f"{base}/api/scripts/{script_id}/events", headers=headers) as r:
                    if r.status != 200:
                        raise RenderError(await _error_text(r))
                    async for event_id, kind, data in sse_events(r):
                        last_id = event_id or last_id
                        failures = 0
                        if kind == "state":
                            title = data.get("title", "")
                            bar.update(data, title)
                            if data["state"] == "done":
                                return data
                        elif kind == "progress":
                            bar.update(data, title)
                        elif kind == "error":
                            raise RenderError(f"{data.get('code')}: {data.get('message')}")
                        elif kind == "done":
                            bar.update(data, title)
                            async with http.get(f"{base}/api/scripts/{script_id}") as s:
                                if s.status != 200:
                                    raise RenderError(await _error_text(s))
                                state: dict[str, Any] = await s.json()
                                return state
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as exc:
                failures += 1
                if failures > MAX_RECONNECTS:
                    hint = f"follow it again with --script-id {script_id}"
                    raise RenderError(f"lost the service ({exc}); {hint}") from exc
                log.info("event stream dropped (%s); reconnecting", exc)
            await asyncio.sleep(RECONNECT_SEC)
    finally:
        bar.close()


async def _download(
    http: aiohttp.ClientSession,
    base: str,
    script_id: str,
    out_dir: Path,
    fmt: str | None,
    sample_rate: int | None,
    *,
    partial: bool,
) -> list[Path]:
    params: dict[str, str] = {}
    if fmt:
        params["format"] = fmt
    if sample_rate:
        params["sample_rate"] = str(sample_rate)
    if partial:
        params["partial"] = "true"
    await asyncio.to_thread(out_dir.mkdir, parents=True, exist_ok=True)
    archive = out_dir / f".{script_id}.zip.part"
    async with http.get(f"{base}/api/scripts/{script_id}.zip", params=params) as r:
        if r.status != 200:
            raise RenderError(await _error_text(r))
        f = await asyncio.to_thread(archive.open, "wb")
        try:
            async for chunk in r.content.iter_chunked(256 * 1024):
                await asyncio.to_thread(f.write, chunk)
        finally:
            await asyncio.to_thread(f.close)
    try:
        return await asyncio.to_thread(_unpack, archive, out_dir)
    finally:
        archive.unlink(missing_ok=True)


def _unpack(archive: Path, out_dir: Path) -> list[Path]:
    files = []
    with zipfile.ZipFile(archive) as z:
        for info in z.infolist():
            name = PurePosixPath(info.filename)
            if name.is_absolute() or ".." in name.parts or info.is_dir():
                continue
            target = out_dir.joinpath(*name.parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, target.open("wb") as dst:
                while chunk := src.read(1024 * 1024):
                    dst.write(chunk)
            files.append(target)
    return files


async def serve_in_process(settings: Any, ready_timeout: float = 600.0) -> tuple[str, Any]:
    """The service on a free 127.0.0.1 port in this process (``--local``); returns its URL and the runner to clean
    up. Waits until the engine is ready (or failed)."""
    import socket

    from aiohttp import web

    from moss_rt.serving import build_engine
    from moss_rt.web.app import create_app
    from moss_rt.web.state import STATE

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    settings = settings.replace(host="127.0.0.1", port=port)
    app = create_app(settings, build_engine(settings))
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=settings.shutdown_grace_sec)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    state = app[STATE]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + ready_timeout
    while not state.engine.info.ready:
        if state.engine_failure is not None or loop.time() > deadline:
            await runner.cleanup()
            raise RenderError(f"the engine did not start: {state.engine_failure or 'timed out'}")
        await asyncio.sleep(0.1)
    return f"http://127.0.0.1:{port}", runner
