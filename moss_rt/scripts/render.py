"""One line of a script rendered as a take of the director's session: engine in, stored take out.

The take is made exactly as a director's would be (the same :class:`~moss_rt.session.TakeRecord` → ``TakeSpec``,
reference voice codes from the voice store), but at the priority the caller gives (``BATCH`` for a render,
``INTERACTIVE`` for a retake someone waits on); its codes and audio are collected and stored in the session as a
take like any other, titled "Line N · WHO". An engine at capacity is waited for, never counted as a failure.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from moss_rt.engine.base import AudioChunk, EndReason, EngineBusy, TakeFinished, TakePriority
from moss_rt.generation import FRAME_SAMPLES, N_CODEBOOKS
from moss_rt.protocol import DEFAULT_CHUNK_FRAMES, ErrorCode, ProtocolError, StartTake
from moss_rt.scripts.format import Cue, Script, line_take_title
from moss_rt.session import TakeRecord
from moss_rt.session_records import SessionFull, StorageFull, StoredTake
from moss_rt.session_store import SessionStore
from moss_rt.storage.database import StoreUnavailable
from moss_rt.web.state import ServiceState
from moss_rt.web.takes import reference_codes

log = logging.getLogger(__name__)

FRAME_BYTES = FRAME_SAMPLES * 2  # mono int16
BUSY_RETRY_MAX_SEC = 2.0


class LineFailed(Exception):
    """This attempt at the line failed (the reason is shown to the director); it may be tried again."""


class LineNoRoom(LineFailed):
    """The session cannot keep one more take (it is full, or the storage budget or the disk is spent): trying
    again, or rendering the script's other lines, would only make takes to be refused."""


class LineInterrupted(Exception):
    """The engine stopped the take (shutting down): not the line's fault; its render stays queued."""


class SessionGone(Exception):
    """The director's session was deleted: the script cannot go on."""


@dataclass(frozen=True)
class Rendered:
    take_id: str
    seed: int
    n_frames: int
    text: str
    instruction: str


def line_request(script: Script, cue: Cue, render: dict[str, Any], max_new_tokens: int) -> StartTake:
    """The take's request: the character's voice and language, the render's words, direction and seed."""
    member = script.member(cue.who)
    return StartTake(
        text=render["text"],
        instruction=render["instruction"],
        language=member.language,
        reference=member.voice,
        seed=int(render["seed"]),
        max_new_tokens=min(max_new_tokens, cue.max_new_tokens or script.max_new_tokens or max_new_tokens),
        tokens=cue.tokens,
        chunk_frames=DEFAULT_CHUNK_FRAMES,
        channels=1,
    )


async def render_line(
    state: ServiceState,
    sessions: SessionStore,
    session_id: str,
    script: Script,
    cue: Cue,
    render: dict[str, Any],
    priority: TakePriority,
    generated: Callable[[], None] | None = None,
) -> Rendered:
    """Generate ``render`` (take id, seed, text, instruction, parent, frame) and store it in the session.

    A take already stored under the render's id (the server stopped between storing it and recording the line)
    is adopted, not rendered again. ``generated`` is called once the engine is done with the take (before it is
    stored), so the caller can give its engine place to the next line. Raises :class:`LineFailed`,
    :class:`LineInterrupted` or :class:`SessionGone`; cancelling it cancels the engine's take.
    """
    take_id = render["take"]
    existing = await _stored(sessions, session_id, take_id)
    if existing is not None:
        log.info("script line %d: take %s was stored before the restart; adopting it", cue.number, take_id)
        return Rendered(take_id, existing.seed, existing.n_frames, render["text"], render["instruction"])
    request = line_request(script, cue, render, state.settings.limits.max_new_tokens)
    parent, frame = render.get("parent"), int(render.get("frame") or 0)
    prefix_codes, prefix_pcm = await _prefix(sessions, session_id, parent, frame)
    record = TakeRecord(take_id, request, parent=parent, branch_frame=frame)
    try:
        ref = await reference_codes(state, record)
    except ProtocolError as err:
        raise LineFailed(err.message) from None
    spec = dataclasses.replace(record.engine_spec(reference_codes=ref, prefix_codes=prefix_codes), priority=priority)
    codes, pcm, finished = await _generate(state, spec)
    if generated is not None:
        generated()
    if finished.reason is EndReason.ERROR:
        raise LineFailed(finished.error or "generation failed")
    if finished.reason in (EndReason.CANCELLED, EndReason.SHUTDOWN, EndReason.REPLACED):
        raise LineInterrupted(finished.reason.value)
    new_frames = int(codes.shape[0])
    if new_frames == 0:
        raise LineFailed("the model ended the line before any audio")
    all_codes = codes if prefix_codes is None else np.concatenate([prefix_codes, codes], axis=0)
    all_pcm = prefix_pcm + pcm
    stored = StoredTake(
        take_id=take_id,
        request=request.to_dict(),
        seed=request.seed or 0,
        n_frames=int(all_codes.shape[0]),
        channels=1,
        parent=parent,
        branch_frame=frame,
        reason=finished.reason.value,
        stats={
            "gpu_total_ms": round(finished.gpu_total_ms, 2),
            **({"gpu_first_ms": round(finished.gpu_first_ms, 2)} if finished.gpu_first_ms is not None else {}),
        },
        title=line_take_title(cue),
    )
    try:
        await asyncio.to_thread(sessions.put_take, session_id, stored, all_codes, all_pcm)
    except ProtocolError as err:
        raise _refusal(err) from None
    except (OSError, ValueError) as exc:
        log.exception("script line %d: take %s could not be stored", cue.number, take_id)
        raise LineFailed(f"the take could not be stored ({type(exc).__name__})") from None
    return Rendered(take_id, stored.seed, stored.n_frames, request.text, request.instruction)


def _refusal(err: ProtocolError) -> Exception:
    """What the store's refusal to keep a line's take means for the line."""
    if isinstance(err, StoreUnavailable):  # the database is away: the render stops and resumes once it is back
        return err
    if err.code is ErrorCode.NOT_FOUND and err.field == "session":
        return SessionGone(err.message)
    if isinstance(err, StorageFull | SessionFull):
        return LineNoRoom(err.message)
    return LineFailed(err.message)  # e.g. a take longer than a stored take may be: this line's own


async def _stored(sessions: SessionStore, session_id: str, take_id: str) -> StoredTake | None:
    try:
        return await asyncio.to_thread(sessions.get_take, session_id, take_id)
    except ProtocolError as err:
        if err.field == "session":
            raise SessionGone(err.message) from None
        return None


async def _prefix(
    sessions: SessionStore, session_id: str, parent: str | None, frame: int
) -> tuple[np.ndarray | None, bytes]:
    """The kept frames of a retake from ``frame`` of ``parent``: their codes and the audio as stored (only the kept
    part of it is read)."""
    if parent is None or frame <= 0:
        return None, b""
    try:
        codes = await asyncio.to_thread(sessions.codes, session_id, parent)
        pcm = await asyncio.to_thread(_read_prefix, sessions, session_id, parent, frame * FRAME_BYTES)
    except ProtocolError as err:
        if err.field == "session":
            raise SessionGone(err.message) from None
        raise LineFailed(f"the take this retake starts from is gone ({err.message})") from None
    codes = np.asarray(codes, dtype=np.int64).reshape(-1, N_CODEBOOKS)
    if frame > codes.shape[0]:
        raise LineFailed(f"frame {frame} is past the {codes.shape[0]} frames of take {parent}")
    return codes[:frame], pcm[: frame * FRAME_BYTES]


def _read_prefix(sessions: SessionStore, session_id: str, take_id: str, n_bytes: int) -> bytes:
    with sessions.open_pcm(session_id, take_id) as f:
        return f.read(n_bytes)


async def _generate(state: ServiceState, spec: Any) -> tuple[np.ndarray, bytes, TakeFinished]:
    """Submit (waiting while the engine is busy or loading) and collect the take's new frames."""
    delay = 0.05
    while True:
        try:
            handle = await state.engine.submit(spec)
            break
        except EngineBusy as busy:
            # Not the line's fault: the engine is full of interactive work, or still loading.
            await asyncio.sleep(min(BUSY_RETRY_MAX_SEC, max(delay, 0.0), busy.retry_after_sec))
            delay = min(BUSY_RETRY_MAX_SEC, delay * 2)
        except ProtocolError as err:
            raise LineFailed(err.message) from None
    codes: list[np.ndarray] = []
    pcm: list[bytes] = []
    finished: TakeFinished | None = None
    events = aiter(handle)
    try:
        async for event in events:
            if isinstance(event, AudioChunk):
                codes.append(np.asarray(event.codes, dtype=np.int64).reshape(-1, N_CODEBOOKS))
                pcm.append(event.pcm)
            elif isinstance(event, TakeFinished):
                finished = event
    except (asyncio.CancelledError, LineFailed):
        raise
    except Exception as exc:
        log.exception("script take %s failed in the engine", spec.take_id)
        raise LineFailed(f"generation failed ({type(exc).__name__})") from None
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()
    if finished is None:
        raise LineFailed("the engine ended the take without an end")
    all_codes = np.concatenate(codes, axis=0) if codes else np.zeros((0, N_CODEBOOKS), dtype=np.int64)
    return all_codes, b"".join(pcm), finished
