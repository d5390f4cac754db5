"""A start that tells the truth: loading answers, failed starts, honest labels, fallbacks (tiny model, CPU)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import requests

from moss_rt.client import DirectingClient
from moss_rt.config import Settings
from moss_rt.engine import moss as moss_module
from moss_rt.engine.moss import MossEngine
from moss_rt.engine.resolve import Choice, choose_model, tiny_model_dir
from moss_rt.model.loader import ModelUnavailable
from tests.engine.helpers import LONG
from tests.helpers import ServerThread, free_port, next_message, run

ROOT = Path(__file__).resolve().parents[2]


class GatedEngine(MossEngine):
    """The real engine whose warm-up waits for a gate: the test sees the service while it loads."""

    def __init__(self, settings: Settings, gate: threading.Event) -> None:
        super().__init__(settings)
        self.gate = gate

    def _warm_up(self) -> None:
        self.gate.wait(60)
        super()._warm_up()


def _tiny_settings(data_dir: Path, **overrides: object) -> Settings:
    return Settings(
        host="127.0.0.1", port=free_port(), engine="moss", model="tiny", codec="tiny", device="cpu",
        data_dir=data_dir, voices_dir=data_dir / "voices", max_slots=2, max_queue=2, max_seq_len=512,
        max_lead_sec=0.0,
    ).replace(**overrides)


def test_requests_while_loading_get_503_loading_then_takes_run(tiny_data_dir: Path) -> None:
    gate = threading.Event()
    settings = _tiny_settings(tiny_data_dir)
    server = ServerThread(settings, GatedEngine(settings, gate))
    started = threading.Thread(target=server.start, daemon=True)
    started.start()
    url = f"http://127.0.0.1:{settings.port}"
    try:
        for _ in range(600):
            try:
                if requests.get(url + "/healthz", timeout=1).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            threading.Event().wait(0.05)
        ready = requests.get(url + "/readyz", timeout=5)
        assert ready.status_code == 503 and ready.json()["status"] == "loading"
        answer = requests.post(url + "/api/stream", json={"text": "Hello."}, timeout=10)
        assert answer.status_code == 503
        assert answer.json()["error"]["code"] == "loading"
        assert int(answer.headers["Retry-After"]) >= 1

        async def ws_start() -> str:
            async with DirectingClient.connect(url.replace("http", "ws") + "/api/ws") as client:
                await client.start("Hello.", max_new_tokens=2)
                return str((await next_message(client, "error")).code)

        assert run(ws_start()) == "loading"
    finally:
        gate.set()
        started.join(60)

    async def speak() -> int:
        async with DirectingClient.connect(url.replace("http", "ws") + "/api/ws") as client:
            take = await client.speak("Hello.", max_new_tokens=3, **LONG)
            return int(take.end["n_frames"])

    try:
        assert requests.get(url + "/readyz", timeout=5).status_code == 200
        assert run(speak()) == 3
    finally:
        server.stop()


def _broken_checkpoint(tiny_data_dir: Path, tmp_path: Path) -> Path:
    """A copy of the tiny model without its tokenizer."""
    src = tiny_model_dir(Settings(data_dir=tiny_data_dir))
    broken = tmp_path / "no-tokenizer"
    shutil.copytree(src, broken)
    (broken / "tokenizer.json").unlink()
    return broken


def test_failed_start_exits_non_zero_with_the_reason(tiny_data_dir: Path, tmp_path: Path) -> None:
    broken = _broken_checkpoint(tiny_data_dir, tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "moss_rt", "serve", "--model", str(broken), "--codec", "tiny", "--device", "cpu",
         "--port", str(free_port()), "--data-dir", str(tiny_data_dir)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert "failed to start" in last and "tokenizer.json" in last, result.stderr[-2000:]


def test_auto_falls_back_only_when_the_weights_cannot_be_obtained(
    tiny_data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = _broken_checkpoint(tiny_data_dir, tmp_path)
    settings = Settings(model="auto", codec="tiny", device="cpu", data_dir=tiny_data_dir, max_slots=1,
                        max_queue=1, max_seq_len=256)
    # As on a CUDA machine: auto names the real weights. They are there but broken -> an error naming it.
    monkeypatch.setattr(moss_module, "choose_model", lambda s, d: Choice(str(broken), False, "real"))
    engine = MossEngine(settings)
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        run(engine.start())
    run(engine.close())

    # The weights cannot be obtained (offline): the tiny demo, announced as such.
    from moss_rt.model import loader  # moss.py imports open_model from here inside _load

    real_open = loader.open_model

    def offline_then_real(source: str, **kwargs: object):  # type: ignore[no-untyped-def]
        if source == "org/real-model":
            raise ModelUnavailable("cannot get 'org/real-model' from the Hugging Face hub: offline mode")
        return real_open(source, **kwargs)

    monkeypatch.setattr(loader, "open_model", offline_then_real)
    monkeypatch.setattr(moss_module, "choose_model", lambda s, d: Choice("org/real-model", False, "real"))
    engine = MossEngine(settings)
    try:
        run(engine.start())
        assert engine.info.demo is True and engine.info.details["model"] == "tiny"
        assert engine.info.details["weights"] == "tiny random demo"
    finally:
        run(engine.close())


def test_random_weight_checkpoint_by_path_is_labelled_demo(tiny_data_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "random-by-path"
    shutil.copytree(tiny_model_dir(Settings(data_dir=tiny_data_dir)), folder)
    assert json.loads((folder / "config.json").read_text())["moss_rt_random_weights"] is True
    choice = choose_model(Settings(model=str(folder), data_dir=tiny_data_dir), torch_cpu())
    assert choice.demo is True and choice.tiny is False
    settings = Settings(model=str(folder), codec="tiny", device="cpu", data_dir=tiny_data_dir, max_slots=1,
                        max_queue=1, max_seq_len=256)
    engine = MossEngine(settings)
    assert engine.info.demo is True  # already while loading
    try:
        run(engine.start())
        assert engine.info.demo is True
        assert engine.info.details["weights"] == "tiny random demo"
        assert "TINY" in engine.info.details["banner"]
    finally:
        run(engine.close())


def torch_cpu():  # type: ignore[no-untyped-def]
    import torch

    return torch.device("cpu")


def test_make_run_honours_moss_rt_settings(tmp_path: Path) -> None:
    """`MOSS_RT_PORT=N make run` listens on N; other MOSS_RT_* settings reach the server too."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    # Newer than requirements.txt and pyproject.toml: make installs nothing (an editable install here would go
    # into the test interpreter's own venv; `make install` is tests/reliability/test_small_traps.py's, in a copy).
    (venv / ".run-installed").touch()
    (venv / ".package-installed").touch()
    port = free_port()
    env = {
        "PATH": "/usr/bin:/bin",
        "MOSS_RT_PORT": str(port),
        "MOSS_RT_ENGINE": "scripted",
        "MOSS_RT_DATA_DIR": str(tmp_path / "data"),
        "HOST": "some-shell-hostname",  # exported by some shells: must not become --host
    }
    proc = subprocess.Popen(
        ["make", "-s", "-C", str(ROOT), "run", f"VENV={venv}"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            try:
                if requests.get(url + "/readyz", timeout=1).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            threading.Event().wait(0.05)
        else:
            raise AssertionError("make run never became ready on MOSS_RT_PORT")
        assert requests.get(url + "/api/info", timeout=5).json()["engine"] == "scripted"
    finally:
        import os
        import signal

        os.killpg(proc.pid, signal.SIGTERM)  # the group this test started: make and its server
        proc.wait(30)
