"""``pip install .`` into a fresh virtual environment, offline, then the installed ``moss-rt`` command.

The new venv gets no packages of its own: a ``.pth`` file makes the test interpreter's site-packages
(the dependencies, setuptools, pip) visible, and pip installs the project from a copy of the source
with ``--no-index --no-deps --no-build-isolation``, so nothing is fetched. What is checked is what
a user of the package relies on: the console script and its help, that every declared dependency is
satisfied by the versions we test with, that the installed package (not the source tree) is the one
imported, and that the installed service serves the studio page and speech.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.ecosystem.audio_check import decode
from tests.helpers import free_port

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("packaging")
    src = work / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "static", src / "static")
    # symlinks=True: moss_rt/static is a link to ../static, as in a checkout.
    shutil.copytree(ROOT / "moss_rt", src / "moss_rt", symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    env_dir = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    purelib = Path(
        subprocess.run(
            [str(env_dir / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True, timeout=60,
        ).stdout.strip()
    )
    (purelib / "test-deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    result = subprocess.run(
        [str(env_dir / "bin" / "python"), "-m", "pip", "install", "--no-index", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "-q", str(src)],
        cwd=work, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return env_dir


def run_in(venv: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    # cwd outside the source tree, so `import moss_rt` can only find the installed copy.
    return subprocess.run(list(args), cwd=venv, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": ""})


def test_console_script_and_help(venv: Path) -> None:
    script = venv / "bin" / "moss-rt"
    assert script.is_file()
    top = run_in(venv, str(script), "--help")
    assert top.returncode == 0 and "usage: moss-rt" in top.stdout
    for command, flag in (("serve", "--max-slots"), ("say", "--transport"), ("make-tiny", "--dtype")):
        result = run_in(venv, str(script), command, "--help")
        assert result.returncode == 0 and flag in result.stdout, result.stderr


def test_installed_package_is_the_one_imported_with_its_studio_page(venv: Path) -> None:
    probe = (
        "import moss_rt; from moss_rt.config import Settings; s = Settings().static_dir; "
        "print(moss_rt.__file__); print((s / 'index.html').is_file())"
    )
    result = run_in(venv, str(venv / "bin" / "python"), "-c", probe)
    assert result.returncode == 0, result.stderr
    module_file, page_found = result.stdout.split()
    assert Path(module_file).is_relative_to(venv) and page_found == "True"
    # Its type hints ship with it (PEP 561).
    assert (Path(module_file).parent / "py.typed").is_file()


def test_declared_dependencies_are_satisfied(venv: Path) -> None:
    probe = (
        "from importlib.metadata import requires, version\n"
        "from packaging.requirements import Requirement\n"
        "reqs = [Requirement(r) for r in requires('moss-rt')]\n"
        "bad = [str(r) for r in reqs if not r.specifier.contains(version(r.name), prereleases=True)]\n"
        "print(len(reqs), bad)\n"
    )
    result = run_in(venv, str(venv / "bin" / "python"), "-c", probe)
    assert result.returncode == 0, result.stderr
    count, bad = result.stdout.split(" ", 1)
    assert int(count) >= 10 and bad.strip() == "[]"


@pytest.fixture
def installed_server(venv: Path, tmp_path: Path) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [str(venv / "bin" / "moss-rt"), "serve", "--engine", "scripted", "--frame-ms", "5", "--port", str(port),
         "--data-dir", str(tmp_path / "data"), "--voices-dir", str(tmp_path / "voices")],
        cwd=venv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": ""},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if requests.get(url + "/readyz", timeout=1).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if proc.poll() is not None:
                raise AssertionError(proc.stdout.read().decode() if proc.stdout else "server exited")
            time.sleep(0.1)
        else:
            raise AssertionError("the installed server did not become ready")
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def test_installed_service_serves_the_studio_and_speech(installed_server: str) -> None:
    page = requests.get(installed_server + "/", timeout=10)
    assert page.status_code == 200 and "<html" in page.text.lower()
    # The page's styles and ES modules (a subfolder of the package data) are installed and served as such.
    assets = [ROOT / "static" / "studio.css", *sorted((ROOT / "static" / "js").glob("*.js"))]
    assert len(assets) > 10
    for asset in assets:
        path = asset.relative_to(ROOT / "static").as_posix()
        r = requests.get(f"{installed_server}/static/{path}", timeout=10)
        assert r.status_code == 200 and r.content == asset.read_bytes(), path
        kind = "text/css" if path.endswith(".css") else "text/javascript"
        assert r.headers["Content-Type"].startswith(kind), (path, r.headers["Content-Type"])
    # The API's description is package data too.
    doc = requests.get(installed_server + "/api/openapi.json", timeout=10)
    assert doc.status_code == 200 and "/api/stream" in doc.json()["paths"]
    speech = requests.post(
        installed_server + "/v1/audio/speech",
        json={"model": "v2-best", "voice": "none", "input": "Installed.", "response_format": "wav"},
        timeout=60,
    )
    assert speech.status_code == 200, speech.text
    decoded = decode(speech.content, "wav")
    assert decoded.sample_rate == 48000 and decoded.samples > 0 and decoded.samples % 3840 == 0
