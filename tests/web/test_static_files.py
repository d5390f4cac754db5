"""The studio's static files: the page is markup plus ES modules whose import graph is one-way; and as a
browser fetches them: module scripts need a JavaScript MIME type (or the browser refuses to run them), they
are revalidated on every load, and need no credentials. That they load and run: tests/browser/test_studio_modules.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest
import requests
from aiohttp import web_fileresponse

from tests.helpers import RunningServer
from tests.web.conftest import scripted

STATIC = Path(__file__).resolve().parents[2] / "static"
MODULES = sorted(p.relative_to(STATIC).as_posix() for p in (STATIC / "js").glob("*.js"))


ENTRY_POINTS = ("main.js", "audio-worklet.js")  # the page's, and the AudioWorklet's (audioWorklet.addModule)
IMPORT = re.compile(r"^import\s.*?\sfrom\s+'\./([\w-]+\.js)';", re.MULTILINE | re.DOTALL)


def imports() -> dict[str, set[str]]:
    """Each module of static/js and the modules it imports (relative static imports, the only kind it uses)."""
    return {p.name: set(IMPORT.findall(p.read_text())) for p in (STATIC / "js").glob("*.js")}


def test_the_studio_is_markup_styles_and_modules() -> None:
    page = (STATIC / "index.html").read_text()
    assert '<script type="module" src="/static/js/main.js">' in page
    assert "<style" not in page and "<script>" not in page and len(page.splitlines()) < 400
    assert (STATIC / "studio.css").is_file() and (STATIC / "README.md").is_file()


def test_the_module_graph_is_one_way_and_whole() -> None:
    graph = imports()
    for name, deps in graph.items():
        assert deps <= graph.keys(), f"{name} imports a module that does not exist: {sorted(deps - graph.keys())}"
    try:
        order = list(TopologicalSorter(graph).static_order())
    except CycleError as exc:
        raise AssertionError(f"import cycle among the studio's modules: {exc.args[1]}") from None
    assert len(order) == len(graph)
    reachable, todo = set(), list(ENTRY_POINTS)
    while todo:
        name = todo.pop()
        if name not in reachable:
            reachable.add(name)
            todo += graph[name]
    assert reachable == graph.keys(), f"modules nothing imports: {sorted(graph.keys() - reachable)}"
    # The page asks for every module it imports at once (modulepreload), not level by level.
    page = (STATIC / "index.html").read_text()
    preloaded = set(re.findall(r'<link rel="modulepreload" href="/static/js/([\w-]+\.js)">', page))
    page_modules = reachable - {"audio-worklet.js"} - {"main.js"}
    assert preloaded == page_modules, (sorted(page_modules - preloaded), sorted(preloaded - page_modules))


def test_modules_and_styles_are_served_with_their_types_and_revalidated(server: RunningServer) -> None:
    for path in MODULES:
        r = requests.get(f"{server.url}/static/{path}", timeout=10)
        assert r.status_code == 200, path
        assert r.headers["Content-Type"] == "text/javascript; charset=utf-8", path
        assert r.headers["Cache-Control"] == "no-cache", path
        assert r.content == (STATIC / path).read_bytes()
    css = requests.get(f"{server.url}/static/studio.css", timeout=10)
    assert css.status_code == 200 and css.headers["Content-Type"] == "text/css; charset=utf-8"
    # Revalidation is cheap: an unchanged file answers 304 to its ETag.
    main = requests.get(f"{server.url}/static/js/main.js", timeout=10)
    again = requests.get(f"{server.url}/static/js/main.js", headers={"If-None-Match": main.headers["ETag"]}, timeout=10)
    assert again.status_code == 304 and again.headers["Cache-Control"] == "no-cache"


def test_module_type_does_not_depend_on_the_hosts_mime_table(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Some hosts map .js to text/plain (a known Windows registry entry); browsers then refuse the module."""
    wrong = lambda path, strict=True: ("text/plain", None)  # noqa: E731
    monkeypatch.setattr(web_fileresponse.CONTENT_TYPES, "guess_type", wrong)
    monkeypatch.setattr(web_fileresponse.CONTENT_TYPES, "guess_file_type", wrong, raising=False)
    r = requests.get(f"{server.url}/static/js/main.js", timeout=10)
    assert r.headers["Content-Type"] == "text/javascript; charset=utf-8"


def test_static_files_need_no_key_and_list_no_folders(make_server: Callable[..., RunningServer]) -> None:
    srv = make_server(scripted, engine="scripted", frame_ms=10.0, max_lead_sec=0.0, api_key="s3cret-key")
    assert requests.get(f"{srv.url}/", timeout=10).status_code == 200
    for path in [*MODULES, "studio.css"]:
        assert requests.get(f"{srv.url}/static/{path}", timeout=10).status_code == 200, path
    # Folders, missing files and paths out of static/ get the service's JSON 404 (never the file).
    for path in (
        "/static/",
        "/static/js/",
        "/static/js",
        "/static/js/nope.js",
        "/static/%2e%2e/pyproject.toml",
        "/static/js/%2e%2e/%2e%2e/pyproject.toml",
        "/static/..%2fpyproject.toml",
        "/static/%00.js",
    ):
        r = requests.get(srv.url + path, timeout=10)
        assert r.status_code == 404, (path, r.status_code)
        assert r.json()["error"]["code"] == "not_found", path
