"""Splices and comps as takes of a session, and take numbers (issue 27, items 1 and 2), on a real server:
``POST /api/sessions/{id}/takes`` and its refusals, the ``stored`` message and ``next_number``, ``discard``, a
replay and a retake of a comp over the WebSocket (scripted engine: its stereo audio encodes frame index and seed),
and on the tiny model a retake of a whole-frame splice rebuilt from its codes exactly as a take restored from the
same stored codes is."""

from __future__ import annotations

import asyncio
import io
import json
import wave
import zipfile
from typing import Any

import numpy as np

from moss_rt.protocol import FRAME_SAMPLES, Limits
from tests.conftest import RunningServer
from tests.engine.conftest import moss_server, tiny_data_dir  # noqa: F401 - fixtures
from tests.helpers import OwnerJar
from tests.web.conftest import FRAME_MS, scripted
from tests.web.helpers import expected_stereo, stereo_frames
from tests.web.test_sessions import Channel, connect, run

F = FRAME_SAMPLES


def wav_samples(data: bytes) -> bytes:
    with wave.open(io.BytesIO(data)) as w:
        return w.readframes(w.getnframes())


def archive_members(data: bytes) -> tuple[dict[str, Any], dict[str, bytes]]:
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return json.loads(z.read("session.json")), {name: z.read(name) for name in z.namelist()}


def codes_of(members: dict[str, bytes], take_id: str) -> np.ndarray:
    return np.load(io.BytesIO(members[f"takes/{take_id}.codes.npy"]))


async def stored_take(ch: Channel, **start: Any) -> tuple[dict[str, Any], dict[str, Any], bytes]:
    """Run a start to its end on a socket bound to a session: its ``stored`` message, its end, its PCM (the end
    of a take it replaces, and anything of that take, is passed over)."""
    await ch.send(**start)
    take: str | None = None
    stored: dict[str, Any] | None = None
    pcm = bytearray()
    while True:
        data = await ch.ws.recv()
        if data[0] == 1:
            pcm += data[5:] if take is not None else b""
            continue
        msg = json.loads(data[5:])
        if msg["type"] == "error":
            raise AssertionError(msg)
        if msg["type"] == "start" and take is None:
            take = msg["take"]
        if msg["type"] == "stored":
            assert msg["take"] == take, f"only the takes the director kept are stored: {msg}"
            stored = msg
        if msg["type"] == "end" and msg["take"] == take:
            assert stored is not None, "stored comes before the end"
            return stored, msg, bytes(pcm)


def test_splices_and_comps_over_http_with_numbers_discards_and_refusals(make_server) -> None:
    server = make_server(
        scripted, engine="scripted", frame_ms=FRAME_MS, max_lead_sec=0.0,
        limits=Limits(max_session_takes=6, max_splice_parts=3),
    )  # fmt: skip
    jar, other = OwnerJar(), OwnerJar()

    async def record() -> tuple[str, list[str]]:
        ws, ch, session = await connect(server, None, jar)
        assert session["next_number"] == 1
        ids = []
        for n, seed in enumerate((3, 4), start=1):
            stored, end, _ = await stored_take(ch, type="start", text=f"line {n}", seed=seed, channels=2, tokens=12,
                                               take=f"label {n}")
            assert stored["number"] == n and stored["session"] == session["session"]
            ids.append(end["take"])
        # A discard that comes after its take ended on its own (the client replaced it as it ended) is no error, and
        # the take, kept already, stays (the next error below is the unknown take's).
        await ch.send(type="discard", take="label 2")
        # A take replaced before it was heard, discarded: not kept, its number not used.
        await ch.send(type="start", text="never heard", tokens=400, take="junk")
        start = await ch.until("start")
        await ch.send(type="discard", take=start["take"])
        _, end, _ = await stored_take(ch, type="start", text="line 3", seed=5, channels=2, tokens=6)
        ids.append(end["take"])
        await ch.send(type="discard", take="t_nothing_here")
        err = await ch.until("error")
        assert err["code"] == "not_found" and err["field"] == "take" and not err["fatal"]
        assert "t_nothing_here" in err["message"], err
        await ws.close()
        return session["session"], ids

    sid, ids = run(record())
    base = f"{server.url}/api/sessions/{sid}"
    listed = jar.request("GET", base).json()
    assert [(t["take_id"], t["number"]) for t in listed["takes"]] == list(zip(ids, (1, 2, 3), strict=True))
    assert listed["next_number"] == 4

    body = {
        "kind": "splice",
        "parts": [{"take": ids[1], "from": 0, "to": 8 * F}, {"take": ids[0], "from": 8 * F, "to": 12 * F}],
        "crossfade": 480,
    }
    r = jar.request("POST", f"{base}/takes", json=body)
    assert r.status_code == 201, r.text
    splice = r.json()
    assert (splice["kind"], splice["number"], splice["n_frames"], splice["has_codes"]) == ("splice", 4, 12, False)
    assert [p["number"] for p in splice["parts"]] == [2, 1] and splice["crossfade"] == 480
    comp_body = {"kind": "comp", "parts": [{"take": ids[2], "from": 0, "to": 6 * F}, body["parts"][1]], "title": "C"}
    comp = jar.request("POST", f"{base}/takes", json=comp_body).json()
    assert (comp["number"], comp["title"], comp["has_codes"], comp["n_frames"]) == (5, "C", True, 10)
    heard = wav_samples(jar.request("GET", f"{base}/takes/{comp['take_id']}.wav").content)
    assert stereo_frames(heard) == expected_stereo(0, 6, 5) + expected_stereo(8, 4, 3)

    refusals = [
        ({"kind": "mix", "parts": body["parts"]}, 422, "kind"),
        ({"kind": "comp", "parts": []}, 422, "parts"),
        ({"kind": "comp", "parts": [body["parts"][0]] * 4}, 422, "parts"),  # max_splice_parts
        ({"kind": "comp", "parts": [{"take": ids[0], "from": 100, "to": 8 * F}]}, 422, "parts[0]"),
        ({"kind": "comp", "parts": [{"take": ids[0], "from": 0, "to": 13 * F}]}, 422, "parts[0]"),
        ({"kind": "comp", "parts": [{"take": "t_nope", "from": 0, "to": F}]}, 404, "take"),
        ({"kind": "comp", "parts": body["parts"], "crossfade": F + 1}, 422, "crossfade"),
        ({"kind": "comp", "parts": body["parts"], "take_id": "t_mine"}, 422, "take_id"),
        ({"kind": "comp", "parts": body["parts"], "title": "x" * 81}, 422, "title"),
        ([1, 2], 400, None),  # not an object: bad_message
    ]
    for bad, status, field in refusals:
        r = jar.request("POST", f"{base}/takes", json=bad)
        assert (r.status_code, r.json()["error"].get("field")) == (status, field), (bad, r.text)
    assert jar.request("POST", f"{base}/takes", data=b"{not json").status_code == 400
    assert other.request("POST", f"{base}/takes", json=body).status_code == 404  # another owner: no such session
    # The session keeps 6 takes: one more edit is refused like one more take, and nothing is left behind.
    assert jar.request("POST", f"{base}/takes", json=comp_body).status_code == 201
    full = jar.request("POST", f"{base}/takes", json=comp_body)
    assert full.status_code == 413 and "6 takes" in full.json()["error"]["message"]
    jar.request("DELETE", f"{base}/takes/{ids[2]}")  # deleting frees a place, never a number
    assert jar.request("POST", f"{base}/takes", json=body).json()["number"] == 7
    listed = jar.request("GET", base).json()
    assert [t["number"] for t in listed["takes"]] == [1, 2, 4, 5, 6, 7] and listed["next_number"] == 8
    assert [p["take"] for p in listed["takes"][3]["parts"]] == [ids[2], ids[0]]  # says what it was made of


def test_a_comp_is_replayed_and_retaken_from_its_own_audio_and_codes(make_server) -> None:
    server = make_server(scripted, engine="scripted", frame_ms=FRAME_MS, max_lead_sec=0.0)
    jar = OwnerJar()

    async def scenario() -> None:
        ws, ch, session = await connect(server, None, jar)
        sid = session["session"]
        ids = []
        for seed in (3, 4):
            _, end, _ = await stored_take(ch, type="start", text="a line", seed=seed, channels=2, tokens=10)
            ids.append(end["take"])
        body = {"kind": "comp", "parts": [{"take": ids[0], "from": 2 * F, "to": 6 * F},
                                          {"take": ids[1], "from": 0, "to": 4 * F}]}  # fmt: skip
        r = await asyncio.to_thread(jar.request, "POST", f"{server.url}/api/sessions/{sid}/takes", json=body)
        comp = r.json()
        expected = expected_stereo(2, 4, 3) + expected_stereo(0, 4, 4)
        await ch.send(type="resume", session=sid)  # the socket takes it up, as the studio's sync does
        resumed = await ch.until("session")
        assert resumed["next_number"] == 4 and resumed["takes"][-1]["take_id"] == comp["take_id"]
        await ch.send(type="seek", take=comp["take_id"], frame=1, mode="replay")
        ack = await ch.until("seek")
        assert ack["take"] == comp["take_id"]
        _, replayed = await ch.to_end()
        assert stereo_frames(replayed) == expected[1:]  # its own audio, not its codes decoded
        await ch.send(type="seek", take=comp["take_id"], frame=6, seed=9)
        ack = await ch.until("seek")
        end, new = await ch.to_end()
        assert end["take"] == ack["take"] and stereo_frames(new)[0] == expected_stereo(6, 1, 9)[0]
        await ws.close()
        url = f"{server.url}/api/sessions/{sid}/takes/{ack['take']}.wav"
        for _ in range(100):  # stored right after its end frame went out
            r = await asyncio.to_thread(jar.request, "GET", url)
            if r.status_code == 200:
                break
            await asyncio.sleep(0.05)
        kept = wav_samples(r.content)
        assert stereo_frames(kept)[:6] == expected[:6]  # the retake keeps the comp's frames as they sound

    run(scenario())


def test_a_retake_of_a_whole_frame_splice_is_rebuilt_from_its_codes_exactly(moss_server) -> None:  # noqa: F811
    """On the tiny model: a comp of two takes' frames (no crossfade) has their codes, concatenated; a retake of it
    from frame 6 gives, code for code and sample for sample, what a retake of a plain take imported with the same
    codes, audio and request gives (both rebuild the model's and the codec's state from those codes)."""
    server: RunningServer = moss_server()
    jar = OwnerJar()
    base_start = {"text": "The rain had stopped an hour ago.", "max_new_tokens": 12, "text_temperature": 0.0,
                  "chunk_frames": 2}  # fmt: skip

    async def retake(sid: str, take_id: str) -> tuple[str, bytes]:
        ws, ch, _ = await connect(server, sid, jar)
        await ch.send(type="seek", take=take_id, frame=6, seed=5)
        ack = await ch.until("seek")
        assert ack["frame"] == 6
        end, pcm = await ch.to_end()
        await ws.close()
        assert end["take"] == ack["take"] and pcm
        return ack["take"], pcm

    async def scenario() -> None:
        ws, ch, session = await connect(server, None, jar)
        sid = session["session"]
        ends = [(await stored_take(ch, type="start", seed=seed, **base_start))[1] for seed in (1, 2)]
        await ws.close()
        a, b = (e["take"] for e in ends)
        assert min(e["n_frames"] for e in ends) >= 8, ends
        body = {"kind": "comp", "parts": [{"take": a, "from": 0, "to": 4 * F}, {"take": b, "from": 4 * F, "to": 8 * F}]}
        r = await asyncio.to_thread(jar.request, "POST", f"{server.url}/api/sessions/{sid}/takes", json=body)
        comp = r.json()
        assert r.status_code == 201 and comp["has_codes"] is True
        exported = await asyncio.to_thread(jar.request, "GET", f"{server.url}/api/sessions/{sid}/archive")
        manifest, members = archive_members(exported.content)
        codes = codes_of(members, comp["take_id"])
        assert np.array_equal(codes, np.concatenate([codes_of(members, a)[:4], codes_of(members, b)[4:8]]))

        # The same codes, audio and request as a plain take of another session (an archive of just that take).
        record = next(t for t in manifest["takes"] if t["take_id"] == comp["take_id"])
        plain = {**record, "kind": "take", "parts": [], "take_id": "t_plain"}
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w") as z:
            z.writestr("session.json", json.dumps({"moss_rt_session": 1, "sample_rate": 48000, "takes": [plain]}))
            z.writestr("takes/t_plain.wav", members[f"takes/{comp['take_id']}.wav"])
            z.writestr("takes/t_plain.codes.npy", members[f"takes/{comp['take_id']}.codes.npy"])
        imported = await asyncio.to_thread(
            jar.request, "POST", f"{server.url}/api/sessions/import", data=out.getvalue()
        )
        other_sid = imported.json()["session"]
        [plain_id] = [t["take_id"] for t in imported.json()["takes"]]

        from_comp, pcm_comp = await retake(sid, comp["take_id"])
        from_plain, pcm_plain = await retake(other_sid, plain_id)
        assert pcm_comp == pcm_plain  # the new audio, to the last bit
        got: list[np.ndarray] = []
        for s, take_id in ((sid, from_comp), (other_sid, from_plain)):
            for _ in range(100):  # stored right after its end frame went out
                data = await asyncio.to_thread(jar.request, "GET", f"{server.url}/api/sessions/{s}/archive")
                _, files = archive_members(data.content)
                if f"takes/{take_id}.codes.npy" in files:
                    got.append(codes_of(files, take_id))
                    break
                await asyncio.sleep(0.05)
        assert len(got) == 2 and np.array_equal(got[0], got[1])
        assert np.array_equal(got[0][:6], codes[:6])  # its kept frames are the comp's codes

    asyncio.run(asyncio.wait_for(scenario(), 300))
