"""docs/protocol.md stays true: its examples are checked against the protocol package (no network)."""

from __future__ import annotations

import json
import re
import sys
import types
import wave
from pathlib import Path
from typing import Any

import pytest

from moss_rt.protocol import (
    FRAME_SAMPLES,
    ErrorCode,
    Limits,
    decode_client_text,
    decode_frame,
    encode_json_frame,
    encode_pcm_frame,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


@pytest.fixture(scope="module")
def doc() -> str:
    return DOC.read_text(encoding="utf-8")


def code_blocks(doc: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", doc, flags=re.S)


def test_json_examples_are_valid_json(doc: str) -> None:
    for block in code_blocks(doc, "json"):
        for line in block.strip().splitlines():
            assert isinstance(json.loads(line), dict), line


def test_client_examples_decode(doc: str) -> None:
    client = 0
    for block in code_blocks(doc, "json"):
        for line in block.strip().splitlines():
            obj = json.loads(line)
            client_types = ("start", "cancel", "seek", "ping", "append", "flush", "end_of_text")
            if obj.get("type") in client_types and "sr" not in obj and "from_take" not in obj:
                decode_client_text(line)
                client += 1
    assert client >= 5


def test_error_code_table_is_complete(doc: str) -> None:
    for code in ErrorCode:
        assert f"| `{code.value}` |" in doc, code


def test_limits_table_matches_defaults(doc: str) -> None:
    """Every Limits field has a row in the Limits table with its default (add one with a new limit)."""
    section = doc.split("\n## Limits\n", 1)[1].split("\n## ", 1)[0]
    for name, value in Limits().to_dict().items():
        row = next((line for line in section.splitlines() if line.startswith("| `") and f"`{name}`" in line), None)
        assert row is not None, f"limit {name} is not documented"
        assert re.search(rf"\b{value:g}\b" if isinstance(value, float) else rf"\b{value}\b", row), (name, row)


def test_hex_examples(doc: str) -> None:
    start = encode_json_frame({"type": "start", "sr": 48000, "gpu_first_ms": 41})
    hex_start = " ".join(f"{b:02x}" for b in start)
    doc_hex = " ".join(re.findall(r"^((?:[0-9a-f]{2} ?)+)\s", doc, flags=re.M)).split()
    assert hex_start in " ".join(doc_hex)
    pcm = encode_pcm_frame(b"\x00\x00\xff\x7f\x00\x80\x01\x00")
    assert "01  00 00 00 08  00 00  ff 7f  00 80  01 00" in doc
    assert decode_frame(pcm).payload == b"\x00\x00\xff\x7f\x00\x80\x01\x00"


class FakeResponse:
    status_code = 200
    text = ""

    def __init__(self, chunks: list[bytes]) -> None:
        self._chunks = chunks

    def iter_content(self, chunk_size: int | None = None) -> Any:
        yield from self._chunks


def test_requests_client_example(doc: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (source,) = [b for b in code_blocks(doc, "python") if "requests.post" in b]
    pcm_frames = [bytes([i]) * (2 * FRAME_SAMPLES) for i in range(1, 4)]
    stream = (
        encode_json_frame({"type": "start", "sr": 48000, "gpu_first_ms": 12, "channels": 1})
        + b"".join(encode_pcm_frame(p) for p in pcm_frames)
        + encode_json_frame({"type": "end", "gpu_total_ms": 5.0, "n_frames": 3, "duration_sec": 0.24})
    )
    cuts = [0, 1, 3, 5, 7, 100, 7000, 7681, 15000, len(stream) - 2, len(stream)]
    chunks = [stream[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
    calls: list[dict[str, Any]] = []

    def post(url: str, **kwargs: Any) -> FakeResponse:
        calls.append({"url": url, **kwargs})
        return FakeResponse(chunks)

    monkeypatch.setitem(sys.modules, "requests", types.SimpleNamespace(post=post))
    monkeypatch.chdir(tmp_path)
    exec(compile(source, "docs/protocol.md", "exec"), {"__name__": "__doc_example__"})  # noqa: S102

    assert calls[0]["url"].endswith("/api/stream") and calls[0]["stream"] is True
    with wave.open(str(tmp_path / "out.wav")) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (48000, 1, 2)
        assert w.readframes(w.getnframes()) == b"".join(pcm_frames)
