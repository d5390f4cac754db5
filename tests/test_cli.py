"""The command line, as a user runs it: serve in a subprocess, say over both transports, env settings."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import wave
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from moss_rt.cli import build_parser
from moss_rt.config import Settings, settings_from_env
from tests.ecosystem.audio_check import decode
from tests.helpers import free_port

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def served(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "MOSS_RT_PORT": str(port), "MOSS_RT_ENGINE": "scripted", "MOSS_RT_FRAME_MS": "5"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moss_rt", "serve", "--data-dir", str(tmp_path / "data")],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                if requests.get(url + "/readyz", timeout=1).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(0.05)
        else:
            raise RuntimeError("server did not start")
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize("transport", ["ws", "http"])
def test_say_writes_a_wav(served: str, tmp_path: Path, transport: str) -> None:
    out = tmp_path / f"{transport}.wav"
    result = subprocess.run(
        [sys.executable, "-m", "moss_rt", "say", "Hello from the command line.", "--instruction", "calm",
         "--seed", "3", "-o", str(out), "--url", served, "--transport", transport],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "wrote" in result.stdout and "end done" in result.stdout
    with wave.open(str(out)) as w:
        assert w.getframerate() == 48000 and w.getnchannels() == 1 and w.getnframes() % 3840 == 0
        assert w.getnframes() > 0


def test_say_reports_server_errors(served: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "moss_rt", "say", "x", "--reference", "nobody", "--url", served,
         "--transport", "http", "-o", str(tmp_path / "x.wav")],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 1 and "not_found" in result.stderr


def test_settings_from_env() -> None:
    s = settings_from_env(
        {"MOSS_RT_PORT": "9000", "MOSS_RT_MODEL": "/m", "MOSS_RT_DATA_DIR": "/d", "MOSS_RT_MAX_LEAD_SEC": "2.5",
         "MOSS_RT_LIMIT_MAX_TEXT_CHARS": "100", "MOSS_RT_TRUSTED_PROXIES": "10.0.0.0/8, ::1"}
    )
    assert s.trusted_proxies == ("10.0.0.0/8", "::1")
    assert (s.port, s.model, str(s.data_dir), s.max_lead_sec) == (9000, "/m", "/d", 2.5)
    assert s.limits.max_text_chars == 100 and s.limits.max_new_tokens == Settings().limits.max_new_tokens


def test_serve_help_lists_flags() -> None:
    result = subprocess.run([sys.executable, "-m", "moss_rt", "serve", "--help"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    for flag in ("--host", "--port", "--model", "--data-dir", "--voices-dir", "--max-slots", "--trusted-proxies"):
        assert flag in result.stdout


def test_every_flag_has_a_help_line() -> None:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(subparsers.choices) >= {"serve", "say", "make-tiny"}
    for name, sub in subparsers.choices.items():
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help and action.help.strip(), f"{name} {action.option_strings or action.dest} has no help"


def test_say_writes_the_format_its_extension_names(served: str, tmp_path: Path) -> None:
    out = tmp_path / "line.mp3"
    result = subprocess.run(
        [sys.executable, "-m", "moss_rt", "say", "In MP3, please.", "--seed", "1", "-o", str(out), "--url", served],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    decoded = decode(out.read_bytes(), "mp3")
    assert decoded.sample_rate == 48000 and decoded.channels == 1 and decoded.samples >= 3840


def test_every_setting_is_a_flag_and_flags_override_env() -> None:
    """Flags are derived from the Settings fields: adding a field adds its flag (and env variable)."""
    import argparse
    import dataclasses

    from moss_rt.config import add_setting_flags, settings_from_flags
    from moss_rt.protocol import Limits

    base = settings_from_env({"MOSS_RT_MAX_SLOTS": "7", "MOSS_RT_API_KEY": "k", "MOSS_RT_LIMIT_MAX_TEXT_CHARS": "99"})
    parser = argparse.ArgumentParser()
    add_setting_flags(parser, base)
    flags = {opt for action in parser._actions for opt in action.option_strings}
    for f in dataclasses.fields(Settings):
        if f.name not in ("limits", "static_dir"):
            assert "--" + f.name.replace("_", "-") in flags
    for f in dataclasses.fields(Limits):
        assert "--limit-" + f.name.replace("_", "-") in flags

    untouched = settings_from_flags(parser.parse_args([]), base)
    assert untouched == base and untouched.max_slots == 7 and untouched.limits.max_text_chars == 99
    args = parser.parse_args(
        ["--max-slots", "3", "--allowed-origins", "https://a, https://b", "--api-key", "", "--data-dir", "/x",
         "--max-lead-sec", "2.5", "--limit-max-new-tokens", "100", "--engine", "scripted"]
    )
    s = settings_from_flags(args, base)
    assert (s.max_slots, s.allowed_origins, s.api_key, str(s.data_dir)) == (3, ("https://a", "https://b"), None, "/x")
    assert (s.max_lead_sec, s.limits.max_new_tokens, s.limits.max_text_chars, s.engine) == (2.5, 100, 99, "scripted")
    with pytest.raises(SystemExit):
        parser.parse_args(["--engine", "nope"])


@pytest.mark.parametrize("transport", ["ws", "http"])
def test_say_writes_words_and_captions(served: str, tmp_path: Path, transport: str) -> None:
    """``--words``/``--srt``/``--vtt``: streamed with the take over the WebSocket, fetched after it over HTTP."""
    words, srt, vtt = tmp_path / "w.json", tmp_path / "c.srt", tmp_path / "c.vtt"
    result = subprocess.run(
        [sys.executable, "-m", "moss_rt", "say", "Hello (a sigh) from the command line.", "--seed", "3",
         "-o", str(tmp_path / "out.wav"), "--url", served, "--transport", transport,
         "--words", str(words), "--srt", str(srt), "--vtt", str(vtt)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    body = json.loads(words.read_text())
    assert [w["word"] for w in body["words"]] == ["Hello", "from", "the", "command", "line"]
    assert all(a["end"] <= b["start"] for a, b in zip(body["words"], body["words"][1:], strict=False))
    assert srt.read_text().startswith("1\n00:00:") and "Hello from the command line." in srt.read_text()
    assert vtt.read_text().startswith("WEBVTT\n\n00:00:")
