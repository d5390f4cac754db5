"""Issue 23, finding 15: small traps.

- ``moss-rt say -o x.ogg`` (or ``.m4a``) wrote WAV bytes under that name: now ``.ogg`` is Ogg Opus (what the opus
  format is) and an extension it cannot write is refused before anything is generated;
- with no server running, ``say`` printed ``[Errno 111] Connect call failed`` and nothing else: now it says how to
  start one or point ``--url`` at one;
- ``make run`` left no ``moss-rt`` command in ``.venv/bin``: now it installs the package (editable, offline), through
  the ``install`` target it runs first.
"""

from __future__ import annotations

import io
import shutil
import site
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import soundfile as sf

from tests.helpers import RunningServer, free_port

REPO = Path(__file__).resolve().parents[2]


def say(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "moss_rt", "say", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60)


def test_say_writes_ogg_as_opus_and_refuses_what_it_cannot_write(
    fast_server: Callable[..., RunningServer], tmp_path: Path
) -> None:
    server = fast_server()
    out = tmp_path / "line.ogg"
    result = say("In Ogg, please.", "--seed", "1", "-o", str(out), "--url", server.url)
    assert result.returncode == 0, result.stderr
    data = out.read_bytes()
    assert data[:4] == b"OggS" and b"OpusHead" in data[:100]
    audio, rate = sf.read(io.BytesIO(data))
    assert rate == 48000 and len(audio) > 0

    for name in ("line.m4a", "line.mp4", "line.txt"):
        # Nothing listens on this port: the refusal must come first, before any attempt to connect.
        result = say("Not this.", "-o", str(tmp_path / name), "--url", f"http://127.0.0.1:{free_port()}")
        assert result.returncode == 2 and f"cannot write '{Path(name).suffix}' files" in result.stderr
        assert ".ogg" in result.stderr and not (tmp_path / name).exists()


def test_say_without_a_server_says_how_to_reach_one(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    for transport in ("ws", "http"):
        result = say("Anyone?", "-o", str(tmp_path / "x.wav"), "--url", url, "--transport", transport)
        assert result.returncode == 1
        assert f"no moss_rt service answers at {url}" in result.stderr, result.stderr
        assert "moss-rt serve" in result.stderr and "--url" in result.stderr and "Traceback" not in result.stderr


def test_make_install_puts_the_moss_rt_command_in_the_venv(tmp_path: Path) -> None:
    """What ``make run`` now does first, in a copy of the checkout and a fresh venv, offline: the venv sees the
    test interpreter's packages through a ``.pth`` file (as tests/test_packaging.py does), so the requirements
    are already there and the stamp that says so is fresh."""
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    for name in ("Makefile", "pyproject.toml", "README.md", "requirements.txt"):
        shutil.copy2(REPO / name, checkout / name)
    shutil.copytree(REPO / "static", checkout / "static")
    shutil.copytree(REPO / "moss_rt", checkout / "moss_rt", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    venv = checkout / ".venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    purelib = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout.strip()
    (Path(purelib) / "test-deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    (venv / ".run-installed").touch()  # requirements.txt is older: make installs no requirements

    result = subprocess.run(["make", "install"], cwd=checkout, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    script = venv / "bin" / "moss-rt"
    assert script.is_file()
    help_text = subprocess.run([str(script), "say", "--help"], cwd=tmp_path, capture_output=True, text=True,
                               timeout=60)
    assert help_text.returncode == 0 and "--url" in help_text.stdout
    # Editable: the command runs the checkout's code.
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import moss_rt; print(moss_rt.__file__)"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert Path(where.stdout.strip()).is_relative_to(checkout), where.stdout + where.stderr
    again = subprocess.run(["make", "-q", "install"], cwd=checkout, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0  # up to date: a second `make run` installs nothing
