"""Streaming text input on the WebSocket: ``start`` with ``stream_text``, then ``append``, ``flush``, ``end_of_text``.

On the scripted engine, whose audio encodes each frame's index, the take is checked to the frame: one
take whose continuations follow each other without a hole; on the tiny model, the real continuation
path (the text so far in the prompt, every frame so far as the prefix) runs end to end.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from moss_rt.client import DirectingClient, TakeAudio
from moss_rt.protocol import FRAME_SAMPLES, ServerMessage
from tests.ecosystem.audio_check import decode
from tests.helpers import RunningServer, next_message
from tests.web.conftest import scripted
from tests.web.helpers import frame_indices

TEXT = "The night was quiet. A train went by far away. Nobody spoke, and then she laughed."
WORDS = [w + " " for w in TEXT.split(" ")]


def run(coro: Any, timeout: float = 120.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture
def scripted_server(make_server: Callable[..., RunningServer]) -> RunningServer:
    return make_server(scripted, engine="scripted", frame_ms=10.0, max_lead_sec=0.0)


async def produce(client: DirectingClient, delay: float) -> None:
    for word in WORDS:
        await client.send({"type": "append", "text": word})
        if delay:
            await asyncio.sleep(delay)
    await client.send({"type": "end_of_text"})


async def stream_take(server: RunningServer, delay: float, **start: Any) -> TakeAudio:
    async with DirectingClient.connect(server.ws_url) as client:
        await client.send({"type": "start", "stream_text": True, "seed": 5, **start})
        producer = asyncio.create_task(produce(client, delay))
        take = await client.collect()
        await producer
        return take


def summary(server: RunningServer, take: TakeAudio) -> dict[str, Any]:
    record = server.state.takes.get(take.take_id or "")
    assert record is not None
    return record.summary()


@pytest.mark.parametrize("delay", [0.1, 0.0], ids=["word-every-100ms", "fast"])
def test_one_take_spoken_sentence_by_sentence(scripted_server: RunningServer, delay: float) -> None:
    take = run(stream_take(scripted_server, delay, channels=2))
    kinds = [e["type"] for e in take.events]
    assert kinds == ["start", "end"], kinds  # one take for the client, however many continuations
    end = take.end
    assert end["reason"] == "done" and end["continuations"] >= 1
    # Continuations of the same take: frame after frame, no hole and no repeat, to the last one.
    assert frame_indices(bytes(take.pcm)) == list(range(end["n_frames"]))
    record = summary(scripted_server, take)
    assert record["request"]["text"] == TEXT + " " and record["status"] == "ended"
    if delay:
        # A word every 100 ms is slower than speech: the take waits for its next sentence.
        assert end["continuations"] >= 2 and end["text_waits"] >= 1
    else:
        # Text faster than speech: once speaking, the take never waits; later sentences are batched.
        assert end["text_waits"] == 0 and end["continuations"] <= 2


def test_flush_speaks_without_a_sentence_end(scripted_server: RunningServer) -> None:
    async def scenario() -> tuple[ServerMessage, TakeAudio]:
        async with DirectingClient.connect(scripted_server.ws_url) as client:
            await client.send({"type": "start", "stream_text": True, "text": "no full stop", "channels": 2})
            await client.send({"type": "flush"})
            started = await next_message(client, "start")  # spoken before any end of sentence or text
            await client.send({"type": "append", "text": " and more"})
            await client.send({"type": "end_of_text"})
            return started, await client.collect()

    started, take = run(scenario())
    assert started["take"] == take.end["take"] and take.end["reason"] == "done"
    assert take.end["continuations"] == 2
    assert frame_indices(bytes(take.pcm)) == list(range(take.end["n_frames"]))


def test_the_take_stays_directable(scripted_server: RunningServer) -> None:
    async def scenario() -> None:
        async with DirectingClient.connect(scripted_server.ws_url) as client:
            await client.send({"type": "start", "stream_text": True, "text": "First line here. ", "channels": 2})
            await client.send({"type": "append", "text": "Second line is longer than the first. "})
            await next_message(client, "start")
            await client.cancel()
            end = await next_message(client, "end")
            assert end["reason"] == "cancelled"
            # Cancelled: nothing waits for text any more.
            await client.send({"type": "append", "text": "Too late."})
            err = await next_message(client, "error")
            assert err["code"] == "not_found" and err["field"] == "take"
            # Retake from a frame of it: the frames before it are kept to the sample.
            frame = max(1, end["n_frames"] // 2)
            await client.seek(end["take"], frame)
            ack = await next_message(client, "seek")
            retake = await client.collect()
            assert ack["from_take"] == end["take"] and retake.end["reason"] == "done"
            assert frame_indices(bytes(retake.pcm)) == list(range(frame, retake.end["n_frames"]))
            record = scripted_server.state.takes.get(ack["take"])
            assert record is not None and record.request.text.startswith("First line here.")

    run(scenario())


def test_text_for_no_take_and_over_the_limit_are_errors(make_server: Callable[..., RunningServer]) -> None:
    from moss_rt.protocol import Limits

    server = make_server(scripted, engine="scripted", frame_ms=10.0, limits=Limits(max_text_chars=40))

    async def scenario() -> None:
        async with DirectingClient.connect(server.ws_url) as client:
            await client.send({"type": "append", "text": "Nobody asked."})
            err = await next_message(client, "error")
            assert err["code"] == "not_found" and not err.get("fatal")
            await client.send({"type": "start", "stream_text": True})
            await client.send({"type": "append", "text": "x" * 30})
            await client.send({"type": "append", "text": "y" * 11})  # 41 characters in all
            err = await next_message(client, "error")
            assert err["code"] == "invalid_field" and "limit is 40" in err["message"]
            await client.send({"type": "end_of_text"})
            take = await client.collect()
            assert take.end["reason"] == "done"  # the 30 accepted characters were spoken
            assert server.state.takes.get(take.take_id or "").request.text == "x" * 30  # type: ignore[union-attr]

    run(scenario())


def test_stream_text_needs_the_websocket(scripted_server: RunningServer) -> None:
    import requests

    r = requests.post(scripted_server.url + "/api/stream", json={"text": "Hi.", "stream_text": True}, timeout=30)
    assert r.status_code == 422 and r.json()["error"]["field"] == "stream_text"


@pytest.mark.parametrize("delay", [0.1, 0.0], ids=["word-every-100ms", "fast"])
def test_tiny_model_continuations(tiny_server_factory, delay: float) -> None:  # type: ignore[no-untyped-def]
    """The real engine: each continuation is prefilled with the text so far and every frame so far."""
    server = tiny_server_factory()
    # A stop head that fires now and then (the tiny model otherwise keeps going to max_new_tokens).
    take = run(stream_take(server, delay, text_temperature=1.5, max_new_tokens=300), timeout=300)
    end = take.end
    assert end["reason"] in ("done", "max_frames") and end["continuations"] >= 1
    assert len(take.pcm) == end["n_frames"] * FRAME_SAMPLES * 2
    record = server.state.takes.get(take.take_id or "")
    assert record is not None and record.n_frames == end["n_frames"]
    if end["reason"] == "done":
        assert record.request.text == TEXT + " "
    if delay and end["reason"] == "done":
        assert end["continuations"] >= 2


def test_streamed_take_in_a_format(scripted_server: RunningServer) -> None:
    take = run(stream_take(scripted_server, 0.0, format="flac", sample_rate=16000))
    assert take.start["format"] == "flac" and take.start["sample_rate"] == 16000
    assert not take.pcm  # encoded takes send no tag-1 PCM
    decoded = decode(bytes(take.encoded), "flac")
    assert decoded.sample_rate == 16000 and decoded.samples == take.end["n_frames"] * FRAME_SAMPLES // 3


def test_a_new_start_replaces_a_take_waiting_for_text(scripted_server: RunningServer) -> None:
    async def scenario() -> None:
        async with DirectingClient.connect(scripted_server.ws_url) as client:
            await client.send({"type": "start", "stream_text": True, "text": "Waiting for the rest"})
            await client.ping()  # the take is open, its text not ready: nothing is generating
            await client.start("Something else entirely.")
            first_end = await next_message(client, "end")
            assert first_end["reason"] == "replaced" and first_end["n_frames"] == 0
            second = await client.collect()
            assert second.end["reason"] == "done" and second.take_id != first_end["take"]

    run(scenario())
