"""``--model auto|tiny``: on a machine without CUDA, auto serves the tiny demo and says so everywhere."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import requests
import torch

from moss_rt.client import DirectingClient
from moss_rt.config import Settings
from moss_rt.engine.moss import MossEngine
from moss_rt.engine.resolve import choose_codec, choose_model, placement
from moss_rt.serving import build_engine
from tests.engine.helpers import LONG
from tests.helpers import run


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto picks the real model on a CUDA machine")
def test_auto_falls_back_to_tiny_demo_and_announces_it(moss_server, tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.WARNING)
    data = tmp_path / "fresh-data"
    srv = moss_server(model="auto", codec="auto", device="auto", dtype="auto", data_dir=data)
    assert (data / "tiny" / "model" / "config.json").is_file()
    assert (data / "tiny" / "codec" / "config.json").is_file()
    assert any("TINY RANDOM" in r.getMessage() for r in caplog.records)

    models = requests.get(srv.url + "/api/models", timeout=10).json()
    assert models["demo"] is True and models["engine"] == "moss" and models["default"] == "v2-best"
    info = requests.get(srv.url + "/api/info", timeout=10).json()
    assert info["demo"] is True and info["ready"] is True and info["device"] == "cpu"
    assert info["details"]["model"] == "tiny" and "noise" in info["details"]["banner"]
    assert info["details"]["dtype"] == "float32"

    async def scenario() -> None:
        async with DirectingClient.connect(srv.ws_url) as client:
            assert client.hello["demo"] is True and client.hello["engine"] == "moss"
            take = await client.speak("Hello.", max_new_tokens=4, **LONG)
            assert take.end["n_frames"] == 4

    run(scenario())


def test_tiny_is_written_once_and_reused(tmp_path: Path) -> None:
    settings = Settings(model="tiny", codec="auto", data_dir=tmp_path)
    where = placement(settings)
    first = choose_model(settings, where.device)
    stamp = (Path(first.source) / "model.safetensors").stat().st_mtime_ns
    again = choose_model(settings, where.device)
    assert again.source == first.source and again.demo and again.label == "tiny"
    assert (Path(again.source) / "model.safetensors").stat().st_mtime_ns == stamp
    codec = choose_codec(settings, first)
    assert codec.demo and Path(codec.source, "config.json").is_file()
    # No half-written folders are left behind.
    assert sorted(p.name for p in (tmp_path / "tiny").iterdir()) == ["codec", "model"]


def test_explicit_sources_and_defaults(tmp_path: Path) -> None:
    assert Settings().engine == "moss"
    assert isinstance(build_engine(Settings(data_dir=tmp_path)), MossEngine)
    s = Settings(model="some-org/some-model", codec="/models/codec", device="cpu", data_dir=tmp_path)
    m = choose_model(s, torch.device("cpu"))
    assert (m.source, m.demo) == ("some-org/some-model", False)
    c = choose_codec(s, m)
    assert (c.source, c.demo, c.label) == ("/models/codec", False, "codec")
    with pytest.raises(RuntimeError):
        placement(Settings(dtype="float8"))
