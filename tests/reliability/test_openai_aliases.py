"""Issue 23, finding 14: "works unchanged with OpenAI clients" was oversold: ``voice="alloy"`` answered 400 and
``model="tts-1"`` 404, and many tools hard-code those names. OpenAI's voice and model names are now aliases,
on by default and configurable (``openai_voice_aliases``, ``openai_model_aliases``), listed in ``/v1/models``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import requests

from moss_rt.config import Settings
from moss_rt.engine.scripted import ScriptedEngine
from moss_rt.openai_aliases import OPENAI_MODELS, OPENAI_VOICES, OpenAIAliases, parse_pairs
from moss_rt.web.app import create_app
from tests.conftest import sine_wav
from tests.helpers import RunningServer

SHORT = {"tokens": 2, "max_new_tokens": 2, "response_format": "pcm"}


def speak(server: RunningServer, **body: object) -> requests.Response:
    return requests.post(server.url + "/v1/audio/speech", json={"input": "Hi.", **SHORT, **body}, timeout=30)


def take_request(server: RunningServer, r: requests.Response) -> dict[str, object]:
    assert r.status_code == 200, r.text
    summary = requests.get(f"{server.url}/api/takes/{r.headers['X-Take-Id']}", timeout=10).json()
    return summary["request"]


@pytest.fixture
def server(fast_server: Callable[..., RunningServer]) -> RunningServer:
    return fast_server(http_requests_per_sec=0.0)


def test_openai_names_work_by_default(server: RunningServer) -> None:
    for voice, model in zip(OPENAI_VOICES, [*OPENAI_MODELS] * 5, strict=False):
        request = take_request(server, speak(server, voice=voice, model=model))
        assert (request["reference"], request["model"]) == ("none", "v2-best")
    openai = pytest.importorskip("openai")  # the SDK itself, as OpenAI's users run it
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
        audio = client.audio.speech.create(model="tts-1", voice="alloy", input="Hi.", response_format="pcm",
                                           extra_body={"tokens": 2, "max_new_tokens": 2})
        assert len(audio.content) == 2 * 3840  # 2 frames at OpenAI's 24 kHz pcm
        models = client.models.list()
        assert [(m.id, (m.model_extra or {}).get("alias_of")) for m in models.data] == [
            ("v2-best", None), ("tts-1", "v2-best"), ("tts-1-hd", "v2-best"), ("gpt-4o-mini-tts", "v2-best")
        ]
        assert client.models.retrieve("gpt-4o-mini-tts").model_extra == {"alias_of": "v2-best"}


def test_aliases_are_configurable_and_ours_come_first(
    fast_server: Callable[..., RunningServer], tmp_path: Path
) -> None:
    voices = tmp_path / "builtin"
    voices.mkdir()
    (voices / "narrator.wav").write_bytes(sine_wav(1.0))
    (voices / "echo.wav").write_bytes(sine_wav(1.0))  # a voice of ours named like one of OpenAI's
    server = fast_server(
        voices_dir=voices,
        http_requests_per_sec=0.0,
        openai_voice_aliases=("alloy=narrator", "echo=none", "nova=missing"),
        openai_model_aliases=("tts-1-hd=v2-best",),
    )
    assert take_request(server, speak(server, voice="alloy"))["reference"] == "narrator"
    assert take_request(server, speak(server, voice="echo"))["reference"] == "echo"  # ours, not the alias
    assert take_request(server, speak(server, model="tts-1-hd"))["model"] == "v2-best"

    broken = speak(server, voice="nova").json()["error"]
    assert broken["param"] == "voice" and "'nova' is mapped to 'missing'" in broken["message"]
    unmapped = speak(server, voice="ash").json()["error"]  # not in this server's map
    assert unmapped["param"] == "voice" and "OpenAI's names: alloy, echo, nova " in unmapped["message"]
    assert speak(server, model="tts-1").status_code == 404
    assert [m["id"] for m in requests.get(server.url + "/v1/models", timeout=10).json()["data"]] == [
        "v2-best", "tts-1-hd"
    ]


def test_empty_maps_turn_the_aliases_off(fast_server: Callable[..., RunningServer]) -> None:
    server = fast_server(http_requests_per_sec=0.0, openai_voice_aliases=(), openai_model_aliases=())
    assert speak(server, voice="alloy").status_code == 400
    assert speak(server, model="tts-1").status_code == 404
    assert [m["id"] for m in requests.get(server.url + "/v1/models", timeout=10).json()["data"]] == ["v2-best"]


def test_a_malformed_alias_setting_fails_at_start(tmp_path: Path) -> None:
    assert parse_pairs([" alloy = narrator "], "x") == {"alloy": "narrator"}
    for bad in (["alloy"], ["alloy=a b"], ["=none"], ["alloy=none", "alloy=x"]):
        with pytest.raises(ValueError, match="openai_voice_aliases"):
            OpenAIAliases.parse(bad, [])
    settings = Settings(data_dir=tmp_path, openai_model_aliases=("tts-1",))
    with pytest.raises(ValueError, match="openai_model_aliases: 'tts-1' is not NAME=TARGET"):
        create_app(settings, ScriptedEngine())
