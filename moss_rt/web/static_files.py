"""The studio's static files (``static/``: studio.css, js/*.js ES modules) under ``/static/``.

What aiohttp's stock static route does not guarantee, and the studio needs:

- **A JavaScript MIME type on every module.** Browsers refuse to run a module script (and
  ``audioWorklet.addModule``) served with any other type. aiohttp guesses types from the host's MIME
  tables, which on some hosts map ``.js`` to ``text/plain``; the type is therefore set here.
- **Revalidation on every load** (``Cache-Control: no-cache``). The modules import each other by
  plain relative URLs (there is no build step to put versions in them), so after an upgrade a
  heuristically cached old module would run against the new page. With ``no-cache`` the browser asks
  each time and gets a cheap ``304 Not Modified`` (``FileResponse`` sends ``ETag`` and
  ``Last-Modified``) while the file is unchanged.
- **A JSON 404** for a missing file, like every other error of the service (the stock route answers
  an empty ``application/octet-stream`` body), and no directory listings.

The static files stay reachable without credentials (``security.OPEN_PREFIXES``): the page asks for
the API key itself.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import web

STATIC_PREFIX = "/static/"
CONTENT_TYPES = {
    ".js": "text/javascript; charset=utf-8",
    ".mjs": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}


def add_static_routes(app: web.Application, static_dir: Path) -> None:
    """Serve the files under ``static_dir`` at /static/<path> (GET and HEAD)."""
    app.router.add_get(STATIC_PREFIX + "{path:.+}", _file_handler(static_dir.resolve()))


def _file_handler(root: Path) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def static_file(request: web.Request) -> web.StreamResponse:
        path = resolve_static(root, request.match_info["path"])
        if path is None:
            raise web.HTTPNotFound()
        headers = {"Cache-Control": "no-cache"}
        content_type = CONTENT_TYPES.get(path.suffix.lower())
        if content_type is not None:
            headers["Content-Type"] = content_type
        return web.FileResponse(path, headers=headers)

    return static_file


def resolve_static(root: Path, relative: str) -> Path | None:
    """The regular file ``relative`` names inside ``root``; None for anything else (a folder, a missing
    file, a path that leaves ``root`` through ``..`` or a link, a malformed name)."""
    try:
        path = (root / relative).resolve(strict=True)
    except (OSError, RuntimeError, ValueError):  # missing, a link loop, an embedded NUL
        return None
    if not path.is_relative_to(root) or not path.is_file():
        return None
    return path
