"""A deterministic scripted engine for tests and UI work: no model, real threading and timing.

Its audio encodes where it came from, so tests can check seek, replay and splices exactly:
in frame ``i`` of a take with seed ``s``, every left-channel sample is ``frame_marker(i)`` and
every right-channel sample is ``seed_marker(s)`` (seed modulo 1024); mono output averages the two. Codes are
``(i * 7 + s + k) % 1024`` for codebook ``k``. A take lasts ``tokens`` frames when given, else a
number of frames derived from the text length, capped by ``max_new_tokens``.

It is the test engine, never the production default.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import io
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np
import soundfile as sf

from moss_rt.engine.base import (
    AudioChunk,
    EndReason,
    EngineBusy,
    EngineInfo,
    EngineLifecycle,
    EngineStatus,
    TakeFinished,
    TakeFirstAudio,
    TakeSpec,
    checked_codes,
    chunk_target,
)
from moss_rt.engine.channel import TakeChannel
from moss_rt.generation import FRAME_RATE, FRAME_SAMPLES, N_CODEBOOKS
from moss_rt.protocol import DEFAULT_MODEL_ALIAS

log = logging.getLogger(__name__)


def frame_marker(frame: int) -> int:
    return (frame % 16000) + 1


def seed_marker(seed: int) -> int:
    return -((seed % 1024) + 1)


def scripted_frame_count(spec: TakeSpec) -> tuple[int, bool]:
    """Total frames of the take (prefix included) and whether max_new_tokens cut it."""
    natural = spec.tokens if spec.tokens is not None else max(6, math.ceil(len(spec.text) * 0.9))
    total = spec.start_frame + natural if spec.prefix_codes is not None else natural
    cap = spec.start_frame + spec.max_frames if spec.prefix_codes is not None else spec.max_frames
    return min(total, cap), total > cap


def scripted_codes(first: int, n: int, seed: int) -> np.ndarray:
    frames = np.arange(first, first + n, dtype=np.int64)[:, None]
    return (frames * 7 + seed + np.arange(N_CODEBOOKS, dtype=np.int64)[None, :]) % 1024


def scripted_pcm(first: int, n: int, seed: int, channels: int) -> bytes:
    """int16 PCM of frames ``first .. first+n-1``."""
    left = np.repeat(np.array([frame_marker(i) for i in range(first, first + n)], dtype=np.int16), FRAME_SAMPLES)
    right = np.full(left.shape, seed_marker(seed), dtype=np.int16)
    if channels == 2:
        return np.stack([left, right], axis=1).reshape(-1).astype("<i2").tobytes()
    mono = ((left.astype(np.int32) + right.astype(np.int32)) // 2).astype("<i2")
    return mono.tobytes()


@dataclass
class _Active:
    spec: TakeSpec
    channel: TakeChannel
    total_frames: int
    capped: bool
    next_frame: int
    admitted: float
    first_audio: float | None = None
    pending_from: int = 0  # first frame not yet flushed
    next_due: float = 0.0


class ScriptedEngine(EngineLifecycle):
    """Runs takes on one worker thread at ``frame_ms`` per frame, flushing chunks like the real one."""

    def __init__(
        self,
        *,
        frame_ms: float = 80.0,
        max_slots: int = 64,
        max_queue: int = 64,
        max_lead_sec: float = 20.0,
    ) -> None:
        self._info = EngineInfo(
            name="scripted",
            models=(DEFAULT_MODEL_ALIAS,),
            default_model=DEFAULT_MODEL_ALIAS,
            demo=True,
            device="cpu",
            details={"engine": "scripted test engine (no model)"},
        )
        self._frame_s = frame_ms / 1000.0
        self._max_slots = max_slots if max_slots > 0 else 64  # 0 (the settings default): the memory plan's CPU value
        # 0 disables pacing in the web layer; the engine still bounds what may wait unconsumed.
        self._lead_frames = max(1, int((max_lead_sec if max_lead_sec > 0 else 20.0) * FRAME_RATE))
        self._inbox: queue.Queue[_Active] = queue.Queue(maxsize=max_queue)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._status = EngineStatus.LOADING
        self._loop: asyncio.AbstractEventLoop | None = None
        self.active_count = 0  # read by metrics and tests; written by the worker only
        self.steps = 0

    @property
    def info(self) -> EngineInfo:
        return dataclasses.replace(self._info, status=self._status)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="moss-rt-scripted-engine", daemon=True)
        self._thread.start()
        self._status = EngineStatus.READY

    async def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5.0)
        self._status = EngineStatus.STOPPED

    async def submit(self, spec: TakeSpec) -> TakeChannel:
        assert self._loop is not None, "engine not started"
        channel = TakeChannel(self._loop, spec.take_id, self._lead_frames)
        total, capped = scripted_frame_count(spec)
        item = _Active(spec, channel, total, capped, spec.start_frame, time.monotonic())
        item.pending_from = spec.start_frame
        try:
            self._inbox.put_nowait(item)
        except queue.Full:
            raise EngineBusy(retry_after_sec=1.0) from None
        return channel

    async def render(self, codes: np.ndarray, channels: int) -> bytes:
        codes = checked_codes(codes, self._info.codebook_size)  # as the real engine: damaged codes are refused
        # Scripted codes carry (frame*7 + seed) in codebook 0, but the frame index is their row.
        seeds = [(int(row[0]) - 7 * i) % 1024 for i, row in enumerate(codes)]
        parts = [scripted_pcm(i, 1, seed, channels) for i, seed in enumerate(seeds)]
        return b"".join(parts)

    async def encode_reference(self, audio: bytes) -> np.ndarray:
        def _encode() -> np.ndarray:
            info = sf.info(io.BytesIO(audio))
            n = max(1, int(info.duration * FRAME_RATE))
            digest = int.from_bytes(hashlib.sha256(audio).digest()[:4], "big")
            return scripted_codes(0, n, digest % 1024)

        return await asyncio.to_thread(_encode)

    # -- worker thread --------------------------------------------------------------------

    def _run(self) -> None:
        active: list[_Active] = []
        while not self._stop.is_set():
            while len(active) < self._max_slots:
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                item.next_due = time.monotonic()
                active.append(item)
            self.active_count = len(active)
            now = time.monotonic()
            for item in list(active):
                if self._advance(item, now):
                    active.remove(item)
            self.active_count = len(active)
            self.steps += 1
            time.sleep(min(self._frame_s, 0.01) if active else 0.005)
        for item in active:
            self._finish(item, EndReason.SHUTDOWN)
        while True:
            try:
                self._finish(self._inbox.get_nowait(), EndReason.SHUTDOWN)
            except queue.Empty:
                break

    def _advance(self, item: _Active, now: float) -> bool:
        """Generate what is due for one take; True when the take is over."""
        if item.channel.cancel_reason is not None:
            self._flush(item)
            self._finish(item, item.channel.cancel_reason)
            return True
        if item.channel.paused:
            item.next_due = now  # a paused slot does not bank frames
            return False
        while now >= item.next_due and item.next_frame < item.total_frames:
            item.next_frame += 1
            item.next_due += self._frame_s
            produced = item.next_frame - item.pending_from
            if produced >= chunk_target(item.pending_from - item.spec.start_frame, item.spec.chunk_frames):
                self._flush(item)
        if item.next_frame >= item.total_frames:
            self._flush(item)
            self._finish(item, EndReason.MAX_FRAMES if item.capped else EndReason.DONE)
            return True
        return False

    def _flush(self, item: _Active) -> None:
        n = item.next_frame - item.pending_from
        if n <= 0:
            return
        if item.first_audio is None:
            item.first_audio = time.monotonic()
            item.channel.push(TakeFirstAudio((item.first_audio - item.admitted) * 1000.0))
        seed = item.spec.seed
        codes = scripted_codes(item.pending_from, n, seed)
        pcm = scripted_pcm(item.pending_from, n, seed, item.spec.channels)
        item.channel.push(AudioChunk(item.pending_from, codes, pcm))
        item.pending_from = item.next_frame

    def _finish(self, item: _Active, reason: EndReason) -> None:
        elapsed = (time.monotonic() - item.admitted) * 1000.0
        first = None if item.first_audio is None else (item.first_audio - item.admitted) * 1000.0
        item.channel.push(TakeFinished(reason, item.next_frame, elapsed, first))
