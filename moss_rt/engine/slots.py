"""Per-take state inside the real engine, and the LRU of finished takes' caches kept for cheap retakes."""

from __future__ import annotations

import enum
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from moss_rt.engine.base import RAMP_FRAMES, EndReason, TakePriority, TakeSpec
from moss_rt.engine.channel import TakeChannel
from moss_rt.generation import N_CODEBOOKS

if TYPE_CHECKING:
    from moss_rt.codec.streaming import DecoderState, KeptBlocks
    from moss_rt.engine.prompt_cache import PromptKeys
    from moss_rt.model.blocks import BlockRef


class EngineChannel(TakeChannel):
    """A TakeChannel whose cancel also wakes the worker, so an idle engine reacts at once."""

    def __init__(self, *args: object, wake: threading.Event, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._wake = wake

    def cancel(self, reason: EndReason = EndReason.CANCELLED) -> None:
        super().cancel(reason)
        self._wake.set()


class Phase(enum.Enum):
    WAITING = "waiting"  # admitted, no slot yet
    PREPARING = "preparing"  # slot held: prompt prefill / codec rebuild in progress
    RUNNING = "running"  # stepping frame by frame


class CacheReuse(enum.StrEnum):
    """Where a take's model cache came from (``moss_rt_seeks_total{path}`` counts retakes by it)."""

    FRESH = "fresh"  # prefilled (or taken from the prompt cache) like any new take
    SHARE = "share"  # a retake sharing its parent's cache blocks up to its branch frame: nothing prefilled
    REPREFILL = "reprefill"  # a retake whose prompt changed: prefilled again from its first changed row on


class CodecSource(enum.StrEnum):
    """How a take's codec streaming state began (``moss_rt_codec_states_total{source}``)."""

    FRESH = "fresh"  # a new stream
    SHARED = "shared"  # the parent's kept blocks, copy on write (a retake)
    REBUILT = "rebuilt"  # the kept frames decoded again (the parent's ring no longer held them, or stored codes)


@dataclass
class Take:
    """One take as the worker sees it. Frame numbers count from the start of the take (prefix included)."""

    spec: TakeSpec
    channel: EngineChannel
    admitted: float = field(default_factory=time.monotonic)
    # When its submit began (monotonic; None: handed in directly): before ``admitted``, its prompt rows were built
    # and checked (on a helper thread, or on the spot: engine/prompts.cheap_to_build; the end's ``prompt_ms``).
    submitted: float | None = None
    phase: Phase = Phase.WAITING
    model_slot: int | None = None
    decoder: DecoderState | None = None
    prompt: np.ndarray | None = None  # the prompt rows proper, built and checked at submit (off the worker)
    prompt_rows: np.ndarray | None = None  # rows to prefill from position 0 (may add prefix frames as assistant rows)
    prompt_len: int = 0  # rows of the prompt proper (without prefix frames)
    prefilled: int = 0  # rows of prompt_rows already in the cache
    prompt_keys: PromptKeys | None = None  # what the prompt cache names prompt_rows' blocks by (None: not used)
    waits_for: str | None = None  # the preparing take computing this take's next prompt block right now
    rebuilt: int = 0  # prefix frames already handed to the codec state (shared, or in rebuild calls)
    codec_source: CodecSource = CodecSource.FRESH  # how its codec state began
    blocks_promised: int = 0  # KV blocks its admission reserved (what a batch take counts against its share)
    frames: int = 0  # frames of the take so far (the next frame's index)
    frame_cap: int = 0  # total frames allowed (prefix + max_new_tokens, bounded by the cache)
    codes: list[np.ndarray] = field(default_factory=list)  # every frame [12] of the take, prefix included
    flushed: int = 0  # frames handed to the codec (the prefix counts as sent)
    # Its chunks are on the engine's shared cadence (one of them went to the codec on a cadence step after its first
    # min(chunk_frames, RAMP_FRAMES) new frames): its one-frame chunks are over (chunk_due). Set by flushed_on only.
    phased: bool = False
    # The codec worker's call holding the take's latest frames: the take ends (its codec state closed, its end
    # pushed) only once that call is done. Written by the scheduler only.
    codec_seq: int = 0
    # Written by the codec worker only: when its first PCM was ready, and why a decode of it failed.
    first_audio: float | None = None
    codec_error: str | None = None
    # What reached its channel, under ``out_lock`` (the codec worker pushes audio, the scheduler ends takes): ``sent``
    # frames so far (the prefix counts as sent); ``muted`` once the take's end is decided on a cancel: no audio of it
    # goes out any more, and the frames it made past ``sent`` are dropped (its end is not held for their decode).
    sent: int = 0
    muted: bool = False
    out_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # A retake whose parent's codec state is still in a running codec call (the parent was cancelled, its end is
    # out): it opens its own codec state from that parent's kept item once the call is done.
    codec_after: Retained | None = None
    kept_item: Retained | None = None  # its own kept caches, while its codec state waits for a call (draining)
    prep_started: float | None = None
    prep_ms: float = 0.0
    # Where its first audio's time went (monotonic; the end's timings): promoted to running, its first new frame made,
    # that frame handed to the codec worker, and (written by the worker) its decode begun.
    running_at: float | None = None
    first_frame_at: float | None = None
    first_chunk_at: float | None = None
    first_decode_at: float | None = None
    paused: bool = False
    reuse_path: CacheReuse = CacheReuse.FRESH  # where its model cache came from
    retain_key: np.ndarray | None = None  # the prompt rows proper: a retake may reuse this cache if equal
    ending: EndReason | None = None  # set when the take must end after its last chunk is flushed
    error: str | None = None

    @property
    def take_id(self) -> str:
        return self.spec.take_id

    @property
    def batch(self) -> bool:
        """Batch work (a script render): served with what interactive takes leave (scheduler)."""
        return self.spec.priority is TakePriority.BATCH

    @property
    def admission_class(self) -> int:
        """Admission order (lower first): retakes, continuations and barge-in starts of interactive takes (a
        director waits on a socket that was streaming), then other interactive takes, then batch work."""
        if self.batch:
            return 2
        return 0 if self.spec.parent_take is not None or self.spec.barge_in else 1

    @property
    def in_ramp(self) -> bool:
        """Its next chunk is part of its ramp (first audio and the frames after it, what its listener waits on; the
        codec's priority lane): its first RAMP_FRAMES new frames, and after them until it is in phase (one-frame
        chunks until one falls on the engine's shared cadence: ``phased``). Counted in frames and steps, never in
        time."""
        return not self.phased or self.in_first_frames

    @property
    def in_first_frames(self) -> bool:
        """Its next chunk is among its first RAMP_FRAMES new frames: the part of its ramp counted in frames alone.
        What steps on while the step is held for codec room (engine/codec_flow): the rest of the ramp ends on a step
        number, and steps made by some takes only must not decide it, or a take's chunks would depend on when the
        codec finished."""
        return self.flushed - self.spec.start_frame < RAMP_FRAMES

    def flushed_on(self, step: int) -> None:
        """Its pending frames go to the codec after step number ``step``: a chunk on the cadence once its first
        min(chunk_frames, RAMP_FRAMES) new frames are out puts it in phase (its one-frame chunks end; every later
        chunk keeps the cadence)."""
        every = max(1, self.spec.chunk_frames)
        if not self.phased and step % every == 0 and self.frames - self.spec.start_frame >= min(every, RAMP_FRAMES):
            self.phased = True
        self.flushed = self.frames

    @property
    def rebuild_left(self) -> int:
        """Kept frames not yet handed to its codec state (a rebuild from the codes)."""
        return self.spec.start_frame - self.rebuilt

    @property
    def positions(self) -> int:
        """Cache positions the take may fill: its prompt, kept and new frames, and the position a step writes past
        the last frame (what its block reservation covers)."""
        return self.prompt_len + self.frame_cap + 1

    @property
    def pending(self) -> int:
        return self.frames - self.flushed

    def chunk_due(self, step: int) -> bool:
        """First audio after one frame, then one-frame chunks while it is in its ramp (``in_ramp``: the first ones
        fill a client's jitter cushion fast, the rest bring it to the cadence), then on the engine's shared cadence of
        ``chunk_frames`` steps.

        Aligning chunks to the global step count (not to each take's own start) makes every take
        with the same ``chunk_frames`` flush on the same step, so one codec call serves them all; a take's ramp
        ends on a cadence step, and one that drops out of phase later (paused while its client catches up) sends one
        shorter chunk to get back in.

        Batch work (a script render's line) has no listener waiting for its first sound: no one-frame ramp, only the
        shared cadence (its first chunk the frames it made until then), so a render's lines cost the codec a call
        every ``chunk_frames`` steps, not one more every step of their first frames.

        It depends only on frames made and handed to the codec, never on when the codec finished them, so
        chunks (and the codec's batches) are the same whether the codec runs overlapped or inline.
        """
        return self._due(step, self.pending)

    def _due(self, step: int, pending: int) -> bool:
        if pending <= 0:
            return False
        every = self.spec.chunk_frames
        if self.batch:
            return step % every == 0 or pending >= every
        # One-frame chunks until it is in phase: it joins the cadence without an odd-length chunk (a codec call of its
        # own), and its listener never waits up to a whole cadence of steps for the frames after its first ones (~200
        # ms while a burst of 64 retakes prepared on an H200).
        return step % every == 0 or pending >= (max(1, every) if self.phased else 1)

    def bulk_chunk_after_step(self, step: int) -> bool:
        """Whether stepping it as step number ``step`` would make a chunk due that goes in the codec's bulk lane (not
        a director's ramp chunk): its cadence comes, or its frame budget ends it. (A stop drawn by the step also
        flushes what it has; that cannot be known before, and happens once a take.)"""
        if not self.batch and self.in_ramp:
            return False
        return self._due(step, self.pending + 1) or self.frames + 1 >= self.frame_cap

    def codes_array(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        part = self.codes[start:stop]
        if not part:
            return np.zeros((0, N_CODEBOOKS), dtype=np.int64)
        return np.stack(part).astype(np.int64, copy=False)


@dataclass
class Retained:
    """A finished take's caches (its KV blocks and codec state blocks, no slot), kept so retakes share them."""

    blocks: BlockRef
    prompt_rows: np.ndarray
    codes: np.ndarray  # [frames, 12] frames whose rows are in the cache after the prompt
    codec: KeptBlocks | None = None  # its codec state after its last decoded frame (None: not kept, or given back)
    batch: bool = False  # kept from batch work (evicted first when an interactive take needs room)
    # Its codec state is still in a running codec call (the take was cancelled and ended at once): ``codec`` is set
    # (or not, when it cannot be kept) once that call is done; retakes of it wait for that to open their own.
    codec_pending: bool = False
    dropped: bool = False  # its caches were given back (evicted): a pending codec state is closed, not kept


class RetainedCaches:
    """LRU of finished takes' caches, by take id. What falls out (or is evicted for room) is to be dropped."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(0, capacity)
        self._items: OrderedDict[str, Retained] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, take_id: str, item: Retained) -> list[Retained]:
        """Keep ``item`` (most recent); returns the items that fell out of the LRU (their caches to drop)."""
        if self.capacity == 0:
            return [item]
        self._items[take_id] = item
        self._items.move_to_end(take_id)
        evicted = []
        while len(self._items) > self.capacity:
            evicted.append(self._items.popitem(last=False)[1])
        return evicted

    def get(self, take_id: str | None) -> Retained | None:
        """The kept cache of ``take_id`` (it stays kept: several retakes may share it)."""
        if take_id is None or take_id not in self._items:
            return None
        self._items.move_to_end(take_id)
        return self._items[take_id]

    def evict_oldest(self, keep: str | None = None, batch_only: bool = False) -> Retained | None:
        """The least recently used item (batch work's first), removed; never ``keep``; with ``batch_only`` only
        items kept from batch work."""
        for only_batch in (True, False):
            for take_id, item in self._items.items():
                if take_id != keep and (item.batch or not only_batch):
                    return self._items.pop(take_id)
            if batch_only:
                return None
        return None

    def evict_codec(self, keep: str | None = None) -> KeptBlocks | None:
        """The codec state of the least recently used item that still has one (never ``keep``'s), taken from it:
        its KV blocks stay kept (a retake of it then rebuilds its codec state from the codes)."""
        for take_id, item in self._items.items():
            if take_id != keep and item.codec is not None:
                kept, item.codec = item.codec, None
                return kept
        return None

    def refs(self) -> list[BlockRef]:
        """The kept caches' block references (oldest first)."""
        return [item.blocks for item in self._items.values()]

    def codec_states(self) -> list[KeptBlocks]:
        """The kept codec states (oldest first)."""
        return [item.codec for item in self._items.values() if item.codec is not None]

    def clear(self) -> list[Retained]:
        items = list(self._items.values())
        self._items.clear()
        return items
