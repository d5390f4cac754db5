"""``moss-rt render`` as a user runs it: against a running service (``--url``) and in-process (``--local``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import wave
from collections.abc import Iterator
from pathlib import Path

import pytest

from moss_rt.config import Settings
from tests.helpers import RunningServer, ServerThread, free_port
from tests.web.conftest import scripted

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """\
@title Two lines
@cast ANNA instruction="warm"
ANNA: (softly) Good morning.
[pause 0.5s]
BEN: Morning to you.
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    tmp = tmp_path_factory.mktemp("render-cli")
    settings = Settings(host="127.0.0.1", port=free_port(), data_dir=tmp / "data", voices_dir=tmp / "voices",
                        engine="scripted", frame_ms=2.0, max_lead_sec=0.0)  # fmt: skip
    thread = ServerThread(settings, scripted(settings))
    yield thread.start()
    thread.stop()


def render(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MOSS_RT_")}
    return subprocess.run([sys.executable, "-m", "moss_rt", "render", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**clean, **(env or {})})  # fmt: skip


def test_render_against_a_running_service(server: RunningServer, tmp_path: Path) -> None:
    script = tmp_path / "scene.txt"
    script.write_text(SCRIPT)
    cast = tmp_path / "cast.json"
    cast.write_text(json.dumps({"BEN": {"instruction": "gruff"}}))
    out = tmp_path / "out"
    result = render(str(script), "-o", str(out), "--url", server.url, "--cast", str(cast), "--format", "flac")
    assert result.returncode == 0, result.stderr
    assert "wrote" in result.stdout and "2 lines" in result.stdout
    assert "line/s" in result.stderr or "2/2" in result.stderr  # the progress bar
    names = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert names == ["captions/lines.srt", "captions/lines.vtt", "cues.csv", "cues.json", "lines/001-ANNA.flac",
                     "lines/002-BEN.flac", "mix.flac", "script.json"]  # fmt: skip
    rendered = json.loads((out / "script.json").read_text())["rendered"]
    assert [x["instruction"] for x in rendered] == ["warm. softly", "gruff"]  # the cast file was laid over
    # Plain WAV by default, and a JSON script works the same way.
    json_script = tmp_path / "scene.json"
    json_script.write_text(json.dumps({"lines": [{"who": "A", "text": "Hello."}]}))
    result = render(str(json_script), "-o", str(tmp_path / "wav"), "--url", server.url, "--no-progress")
    assert result.returncode == 0, result.stderr
    with wave.open(str(tmp_path / "wav" / "mix.wav")) as w:
        assert w.getframerate() == 48000 and w.getnframes() > 0


def test_render_reports_a_bad_script_and_a_missing_service(server: RunningServer, tmp_path: Path) -> None:
    script = tmp_path / "bad.txt"
    script.write_text("ANNA: fine\nBEN has no colon\n")
    result = render(str(script), "-o", str(tmp_path / "o"), "--url", server.url)
    assert result.returncode == 1 and "line 2: expected a cue" in result.stderr
    script.write_text(SCRIPT)
    result = render(str(script), "-o", str(tmp_path / "o"), "--url", f"http://127.0.0.1:{free_port()}")
    assert result.returncode == 1 and "is the service running" in result.stderr


def test_render_in_process(tmp_path: Path) -> None:
    script = tmp_path / "scene.txt"
    script.write_text(SCRIPT)
    env = {"MOSS_RT_FRAME_MS": "2", "MOSS_RT_MAX_LEAD_SEC": "0"}
    result = render(str(script), "-o", str(tmp_path / "out"), "--local", "--engine", "scripted", "--data-dir",
                    str(tmp_path / "data"), "--no-progress", env=env)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out" / "mix.wav").is_file() and (tmp_path / "out" / "lines" / "002-BEN.wav").is_file()
