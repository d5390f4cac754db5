"""``moss-rt render`` as a user runs it: against a running service (``--url``), keyless (its owner cookie kept in
the owner file, so a later run follows the script or renders into the session as the same owner) or keyed, and
in-process (``--local``)."""

from __future__ import annotations

import json
import os
import re
import stat
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
    # No word aligner: its worker processes would only slow these runs (captions by word: tests/web/test_words.py).
    settings = Settings(host="127.0.0.1", port=free_port(), data_dir=tmp / "data", voices_dir=tmp / "voices",
                        engine="scripted", frame_ms=2.0, max_lead_sec=0.0, aligner="none")  # fmt: skip
    thread = ServerThread(settings, scripted(settings))
    yield thread.start()
    thread.stop()


def render(*args: str, state: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The command, with ``state`` as its XDG state folder (where the owner file is kept by default)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MOSS_RT_")}
    env = {**clean, "XDG_STATE_HOME": str(state), **(env or {})}
    return subprocess.run([sys.executable, "-m", "moss_rt", "render", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=env)  # fmt: skip


def ids_of(stdout: str) -> tuple[str, str]:
    """(script id, session id) from the command's summary line."""
    found = re.search(r"script (sc_[\w-]+), session (s_[\w-]+)", stdout)
    assert found, stdout
    return found.group(1), found.group(2)


def test_render_against_a_running_service(server: RunningServer, tmp_path: Path) -> None:
    script = tmp_path / "scene.txt"
    script.write_text(SCRIPT)
    cast = tmp_path / "cast.json"
    cast.write_text(json.dumps({"BEN": {"instruction": "gruff"}}))
    out = tmp_path / "out"
    state = tmp_path / "state"
    result = render(str(script), "-o", str(out), "--url", server.url, "--cast", str(cast), "--format", "flac",
                    state=state)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "wrote" in result.stdout and "2 lines" in result.stdout
    assert "line/s" in result.stderr or "2/2" in result.stderr  # the progress bar
    names = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert names == ["captions/lines.srt", "captions/lines.vtt", "captions/words.srt", "captions/words.vtt",
                     "cues.csv", "cues.json", "lines/001-ANNA.flac", "lines/002-BEN.flac", "mix.flac",
                     "script.json"]  # fmt: skip
    rendered = json.loads((out / "script.json").read_text())["rendered"]
    assert [x["instruction"] for x in rendered] == ["warm. softly", "gruff"]  # the cast file was laid over
    # Plain WAV by default, and a JSON script works the same way.
    json_script = tmp_path / "scene.json"
    json_script.write_text(json.dumps({"lines": [{"who": "A", "text": "Hello."}]}))
    result = render(str(json_script), "-o", str(tmp_path / "wav"), "--url", server.url, "--no-progress", state=state)
    assert result.returncode == 0, result.stderr
    with wave.open(str(tmp_path / "wav" / "mix.wav")) as w:
        assert w.getframerate() == 48000 and w.getnframes() > 0


def test_a_later_run_acts_as_the_same_owner_on_a_keyless_server(server: RunningServer, tmp_path: Path) -> None:
    script = tmp_path / "scene.txt"
    script.write_text(SCRIPT)
    state = tmp_path / "state"
    first = render(str(script), "-o", str(tmp_path / "one"), "--url", server.url, "--no-progress", state=state)
    assert first.returncode == 0, first.stderr
    script_id, session_id = ids_of(first.stdout)
    # The server's owner cookie is kept by server, readable by its user only.
    owners = state / "moss_rt" / "owners.json"
    assert list(json.loads(owners.read_text())) == [server.url]
    assert stat.S_IMODE(owners.stat().st_mode) == 0o600
    # A later run follows the script, and renders into the session, as the same owner.
    again = render("--script-id", script_id, "-o", str(tmp_path / "two"), "--url", server.url, "--no-progress",
                   state=state)  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "two" / "mix.wav").read_bytes() == (tmp_path / "one" / "mix.wav").read_bytes()
    more = render(str(script), "-o", str(tmp_path / "three"), "--url", server.url, "--session", session_id,
                  "--no-progress", state=state)  # fmt: skip
    assert more.returncode == 0, more.stderr
    assert ids_of(more.stdout)[1] == session_id
    # Another owner file is another owner: the script and the session are not theirs.
    other = tmp_path / "other.json"
    stranger = render("--script-id", script_id, "-o", str(tmp_path / "four"), "--url", server.url,
                      "--owner-file", str(other), "--no-progress", state=state)  # fmt: skip
    assert stranger.returncode == 1 and "not_found" in stranger.stderr and not (tmp_path / "four").exists()
    stranger = render(str(script), "-o", str(tmp_path / "five"), "--url", server.url, "--session", session_id,
                      "--owner-file", str(other), "--no-progress", state=state)  # fmt: skip
    assert stranger.returncode == 1 and "no such session" in stranger.stderr


def test_render_against_a_keyed_service(tmp_path: Path) -> None:
    key = "k" * 32
    settings = Settings(host="127.0.0.1", port=free_port(), data_dir=tmp_path / "data", voices_dir=tmp_path / "v",
                        engine="scripted", frame_ms=2.0, max_lead_sec=0.0, api_key=key, aligner="none")  # fmt: skip
    thread = ServerThread(settings, scripted(settings))
    server = thread.start()
    try:
        script = tmp_path / "scene.txt"
        script.write_text(SCRIPT)
        state = tmp_path / "state"
        result = render(str(script), "-o", str(tmp_path / "out"), "--url", server.url, "--no-progress",
                        state=state, env={"MOSS_RT_API_KEY": key})  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert (tmp_path / "out" / "mix.wav").is_file()
        assert not (state / "moss_rt" / "owners.json").exists()  # the key is the owner: no cookie to keep
        script_id, _ = ids_of(result.stdout)
        again = render("--script-id", script_id, "-o", str(tmp_path / "again"), "--url", server.url,
                       "--no-progress", state=state, env={"MOSS_RT_API_KEY": key})  # fmt: skip
        assert again.returncode == 0, again.stderr
        keyless = render(str(script), "-o", str(tmp_path / "no"), "--url", server.url, state=state)
        assert keyless.returncode == 1 and "unauthorized" in keyless.stderr
    finally:
        thread.stop()


def test_render_reports_a_bad_script_and_a_missing_service(server: RunningServer, tmp_path: Path) -> None:
    script = tmp_path / "bad.txt"
    script.write_text("ANNA: fine\nBEN has no colon\n")
    state = tmp_path / "state"
    result = render(str(script), "-o", str(tmp_path / "o"), "--url", server.url, state=state)
    assert result.returncode == 1 and "line 2: expected a cue" in result.stderr
    script.write_text(SCRIPT)
    result = render(str(script), "-o", str(tmp_path / "o"), "--url", f"http://127.0.0.1:{free_port()}", state=state)
    assert result.returncode == 1 and "is the service running" in result.stderr


def test_render_in_process(tmp_path: Path) -> None:
    script = tmp_path / "scene.txt"
    script.write_text(SCRIPT)
    env = {"MOSS_RT_FRAME_MS": "2", "MOSS_RT_MAX_LEAD_SEC": "0", "MOSS_RT_ALIGNER": "none"}
    local = ("--local", "--engine", "scripted", "--data-dir", str(tmp_path / "data"), "--no-progress")
    state = tmp_path / "state"
    result = render(str(script), "-o", str(tmp_path / "out"), *local, env=env, state=state)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out" / "mix.wav").is_file() and (tmp_path / "out" / "lines" / "002-BEN.wav").is_file()
    # A new port every run, the same data dir: a later run is the same owner of its session.
    _, session_id = ids_of(result.stdout)
    again = render(str(script), "-o", str(tmp_path / "again"), *local, "--session", session_id, env=env, state=state)
    assert again.returncode == 0, again.stderr
