"""The memory plan made at start: how many takes run at once and how long each may grow.

Made once, after the model and codec weights are loaded, from what the device has free then
(``--gpu-memory-utilization`` of the whole device is the ceiling; what others, the weights and the
CUDA context already use is subtracted). The budget is split between

- the backbone KV cache (keys, values and the per-position hidden state of every take),
- the codec's streaming state (paged K/V blocks: the pools hold one whole window per codec stream, slots,
  renders and warm-up, so every take admitted can grow to the full window; a stream holds only the blocks its
  age has reached, the rest stay free for the streams that grow),
- work memory (CUDA-graph pools, prefill scores and activations),
- the word aligner's device memory when it runs on this GPU (its weights, its graphs' pool and its eager calls,
  each bounded: moss_rt.align.memory), reserved here whether it has loaded yet or not, and
- a margin for the allocator's fragmentation and library workspaces.

A pure function of numbers (no torch, no device), so it is tested with fake free-memory figures. On
a CPU the plan is computed from the settings alone (host memory is not planned).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

GIB = 1 << 30
MIB = 1 << 20

DEFAULT_CPU_SLOTS = 64  # CPU (and settings-only) defaults when --max-slots / --max-seq-len are not given
DEFAULT_CPU_SEQ_LEN = 5120
PLANNED_TAKE_POSITIONS = 1280  # sizing slots: each could hold a 400-row prompt + 70 s of audio at once
MIN_SEQ_LEN = 512  # below this even one short take cannot run; the plan fails instead
MAX_AUTO_SLOTS = 256  # the plan never goes beyond this many slots on its own (each reserves a codec window)
MARGIN_FRACTION = 0.03  # of the usable budget, at least MIN_MARGIN
MIN_MARGIN = 512 * MIB
# When --max-slots and --max-seq-len are both given, the pool holds every slot at its cap plus this
# fraction again for the caches of finished takes kept for retakes (evicted first when a take needs
# room, so the headroom only decides how many stay reusable), rather than the whole budget: several
# engines (tests, replicas) can then share one card.
KEPT_CACHE_HEADROOM = 0.5


class MemoryPlanError(RuntimeError):
    """The budget cannot hold even one take; the message says what to change."""


@dataclass(frozen=True)
class MemoryCosts:
    """What one unit of each consumer costs in bytes (from the loaded model and codec)."""

    bytes_per_position: int  # backbone cache: K + V over every layer + the hidden state, one take position
    slot_bytes: int  # fixed per-slot state (sampler state, repetition-penalty bitmap)
    codec_bytes_per_stream: int  # the codec's K/V blocks one stream may hold (its whole window): reserved per stream
    codec_extra_streams: int  # codec streams beyond one per slot (renders, warm-up)
    work_bytes: int  # CUDA-graph pools, prefill scores and activations (independent of slots)
    work_bytes_per_slot: int = 0  # graph activations growing with the batch
    codec_fixed_bytes: int = 0  # the codec's scratch blocks (graph capture, padding rows of batched calls)
    aligner_bytes: int = 0  # the word aligner on this device, what it will hold beyond what it holds already
    # The same codec figures with fp8 K/V (moss_rt/codec/kv_quant.py; 0: fp8 codec state not offered).
    codec_fp8_bytes_per_stream: int = 0
    codec_fp8_fixed_bytes: int = 0

    def with_fp8_codec_state(self) -> MemoryCosts:
        return dataclasses.replace(self, codec_bytes_per_stream=self.codec_fp8_bytes_per_stream,
                                   codec_fixed_bytes=self.codec_fp8_fixed_bytes)


@dataclass(frozen=True)
class MemoryPlan:
    """The plan (bytes), and where each figure came from."""

    device: str
    source: str  # "measured" (free device memory) or "settings" (CPU: no device budget)
    max_slots: int
    max_seq_len: int  # the cap of one take (prompt + frames); it reserves nothing
    kv_blocks: int  # blocks of the paged KV pool, the scratch block included
    block_size: int  # positions per block
    total_bytes: int  # the device's memory (0 on CPU)
    in_use_bytes: int  # already used when planning: weights, CUDA context, other processes
    utilization: float
    budget_bytes: int  # utilization x total - in use: what the plan may hand out
    backbone_cache_bytes: int
    codec_state_bytes: int
    work_bytes: int
    margin_bytes: int
    slots_from: str  # "flag" or "plan"
    seq_len_from: str
    aligner_bytes: int = 0  # reserved for the word aligner on this device (beyond what it held when planned)
    codec_state_dtype: str = "bf16"  # how the codec's K/V are stored: "bf16" (the compute dtype) or "fp8"
    codec_state_reason: str = "set by --codec-state-dtype"  # why the plan chose it

    @property
    def kv_positions(self) -> int:
        """Positions the pool holds, shared by every take (the scratch block excluded)."""
        return (self.kv_blocks - 1) * self.block_size

    @property
    def planned_bytes(self) -> int:
        cache = self.backbone_cache_bytes + self.codec_state_bytes
        return cache + self.work_bytes + self.margin_bytes + self.aligner_bytes

    @property
    def unplanned_bytes(self) -> int:
        """Budget left over (never negative on a device; on CPU the budget is the plan itself)."""
        return max(0, self.budget_bytes - self.planned_bytes)

    def rows(self) -> list[tuple[str, str]]:
        """(item, value) rows of the table in the log and of /api/info."""

        def gib(n: int) -> str:
            return f"{n / GIB:.2f} GiB"

        rows = [("device", f"{self.device} ({self.source})")]
        if self.total_bytes:
            rows += [
                ("device memory", gib(self.total_bytes)),
                ("in use before the plan (weights, context, others)", gib(self.in_use_bytes)),
                (f"budget at utilization {self.utilization:.2f}", gib(self.budget_bytes)),
            ]
        rows += [
            (f"concurrent takes (slots, from {self.slots_from})", str(self.max_slots)),
            (f"longest take in positions (max_seq_len, from {self.seq_len_from})", str(self.max_seq_len)),
            (
                "backbone KV cache (paged pool)",
                f"{gib(self.backbone_cache_bytes)}: {self.kv_blocks} blocks x {self.block_size} = "
                f"{self.kv_positions} positions, {self.kv_positions // max(1, self.max_slots)} per slot",
            ),
            ("codec streaming state", gib(self.codec_state_bytes)),
            ("codec state dtype", f"{self.codec_state_dtype} ({self.codec_state_reason})"),
            ("graph pools and work memory", gib(self.work_bytes)),
            ("margin", gib(self.margin_bytes)),
        ]
        if self.aligner_bytes:
            rows.insert(-1, ("word aligner (weights, graph pool, eager calls)", gib(self.aligner_bytes)))
        if self.total_bytes:
            rows.append(("left unplanned", gib(self.unplanned_bytes)))
        return rows

    def table(self) -> str:
        rows = self.rows()
        width = max(len(k) for k, _ in rows)
        lines = [f"  {k.ljust(width)}  {v}" for k, v in rows]
        return "memory plan:\n" + "\n".join(lines)

    def as_dict(self) -> dict[str, object]:
        """The figures for /api/info (bytes as integers)."""
        return {
            "device": self.device,
            "source": self.source,
            "max_slots": self.max_slots,
            "max_seq_len": self.max_seq_len,
            "kv_blocks": self.kv_blocks,
            "block_size": self.block_size,
            "kv_positions": self.kv_positions,
            "total_bytes": self.total_bytes,
            "in_use_bytes": self.in_use_bytes,
            "utilization": self.utilization,
            "budget_bytes": self.budget_bytes,
            "backbone_cache_bytes": self.backbone_cache_bytes,
            "codec_state_bytes": self.codec_state_bytes,
            "work_bytes": self.work_bytes,
            "margin_bytes": self.margin_bytes,
            "slots_from": self.slots_from,
            "seq_len_from": self.seq_len_from,
            "aligner_bytes": self.aligner_bytes,
            "codec_state_dtype": self.codec_state_dtype,
            "codec_state_reason": self.codec_state_reason,
        }


def _blocks_for(positions: int, block_size: int) -> int:
    return -(-positions // block_size)


def min_blocks(seq_len: int, block_size: int) -> int:
    """Pool blocks one take of ``seq_len`` positions needs: its blocks, one copy-on-write, the scratch block."""
    return _blocks_for(seq_len + 1, block_size) + 2


def settings_blocks(slots: int, seq_len: int, block_size: int) -> int:
    """Pool blocks when both slot count and cap are given: every slot at its cap with its copy-on-write
    block, ``KEPT_CACHE_HEADROOM`` more for kept retake caches, and the scratch block."""
    running = slots * _blocks_for(seq_len + 1, block_size)
    return running + slots + math.ceil(KEPT_CACHE_HEADROOM * running) + 1


CODEC_STATE_DTYPES = ("auto", "bf16", "fp8")


def plan_memory(
    costs: MemoryCosts,
    *,
    device: str,
    total_bytes: int | None,
    free_bytes: int | None,
    utilization: float = 0.90,
    max_slots: int = 0,
    max_seq_len: int = 0,
    block_size: int = 16,
    codec_state_dtype: str = "auto",
) -> MemoryPlan:
    """The plan of :func:`plan_codec_state`'s choice of codec state dtype (the plan records it and why)."""
    dtype, reason = plan_codec_state(costs, codec_state_dtype, total_bytes=total_bytes, free_bytes=free_bytes,
                                     utilization=utilization, max_slots=max_slots, block_size=block_size)
    plan = _plan_memory(costs.with_fp8_codec_state() if dtype == "fp8" else costs, device=device,
                        total_bytes=total_bytes, free_bytes=free_bytes, utilization=utilization, max_slots=max_slots,
                        max_seq_len=max_seq_len, block_size=block_size)
    return dataclasses.replace(plan, codec_state_dtype=dtype, codec_state_reason=reason)


def plan_codec_state(
    costs: MemoryCosts,
    setting: str,
    *,
    total_bytes: int | None,
    free_bytes: int | None,
    utilization: float,
    max_slots: int,
    block_size: int,
) -> tuple[str, str]:
    """("bf16" | "fp8", why): the setting when it is not ``auto``; ``auto`` keeps bf16 (exact streaming) unless
    ``--max-slots`` asks for more takes than bf16 codec state fits on this device, each able to hold
    ``PLANNED_TAKE_POSITIONS`` (the plan's own sizing rule), and fp8 is offered. fp8 costs audio quality (a few
    times bf16's error, docs/codec.md), so the plan never picks it just to hold more takes than asked for."""
    if setting not in CODEC_STATE_DTYPES:
        raise MemoryPlanError(f"--codec-state-dtype must be one of {', '.join(CODEC_STATE_DTYPES)}, got {setting!r}")
    if setting == "fp8" and not costs.codec_fp8_bytes_per_stream:
        raise MemoryPlanError("--codec-state-dtype fp8 is not available for this codec")
    if setting != "auto":
        return setting, "set by --codec-state-dtype"
    if not costs.codec_fp8_bytes_per_stream:
        return "bf16", "auto: fp8 codec state not available"
    if total_bytes is None or free_bytes is None:
        return "bf16", "auto: no device budget to fit"
    if not max_slots:
        return "bf16", "auto: the plan chooses the slots bf16 codec state fits (--max-slots or fp8 for more)"
    fit = _fitting_slots(costs, total_bytes, free_bytes, utilization, block_size)
    if max_slots <= fit:
        return "bf16", f"auto: --max-slots {max_slots} fits with bf16 codec state (up to {fit} slots)"
    fit8 = _fitting_slots(costs.with_fp8_codec_state(), total_bytes, free_bytes, utilization, block_size)
    return "fp8", (f"auto: --max-slots {max_slots} is more than the {fit} slots bf16 codec state fits at "
                   f"{PLANNED_TAKE_POSITIONS} positions each; fp8 fits {fit8} (lower audio precision: docs/codec.md)")


def _fitting_slots(costs: MemoryCosts, total_bytes: int, free_bytes: int, utilization: float, block_size: int) -> int:
    """Slots the budget holds with each able to hold PLANNED_TAKE_POSITIONS (as plan_memory sizes them, uncapped)."""
    room = _budget(costs, total_bytes, free_bytes, utilization, block_size).room
    per_slot = costs.slot_bytes + costs.codec_bytes_per_stream + costs.work_bytes_per_slot
    return max(0, room // (per_slot + PLANNED_TAKE_POSITIONS * costs.bytes_per_position)) if room > 0 else 0


@dataclasses.dataclass(frozen=True)
class _Budget:
    in_use: int  # bytes of the device already taken (weights, other processes)
    budget: int  # what the plan may use: utilization x total, less in_use
    margin: int
    fixed: int  # the scratch block, the extra codec streams, work memory, the aligner and the margin
    room: int  # left for the slots and the KV pool


def _budget(costs: MemoryCosts, total_bytes: int, free_bytes: int, utilization: float, block_size: int) -> _Budget:
    """The device budget and what comes out of it before any slot (one rule for the plan and its dtype choice)."""
    in_use = max(0, total_bytes - free_bytes)
    budget = int(utilization * total_bytes) - in_use
    margin = max(MIN_MARGIN, int(MARGIN_FRACTION * max(budget, 0)))
    fixed = (block_size * costs.bytes_per_position + costs.codec_extra_streams * costs.codec_bytes_per_stream
             + costs.codec_fixed_bytes + costs.work_bytes + costs.aligner_bytes + margin)
    return _Budget(in_use, budget, margin, fixed, budget - fixed)


def _plan_memory(
    costs: MemoryCosts,
    *,
    device: str,
    total_bytes: int | None,
    free_bytes: int | None,
    utilization: float = 0.90,
    max_slots: int = 0,
    max_seq_len: int = 0,
    block_size: int = 16,
) -> MemoryPlan:
    """Slots, the per-take cap and the KV pool within the budget; ``max_slots`` / ``max_seq_len`` > 0 are kept.

    The KV cache is one pool of blocks shared by every take (paged): slots are chosen so each could
    hold ``PLANNED_TAKE_POSITIONS`` at once, and everything left after the codec streams and work
    memory goes to the pool; a take's cap (``max_seq_len``) only bounds one take, it reserves nothing.
    When both ``max_slots`` and ``max_seq_len`` are given the pool is sized to them instead
    (``settings_blocks``: every slot at its cap plus ``KEPT_CACHE_HEADROOM``), never beyond the budget.
    ``total_bytes`` / ``free_bytes`` None (CPU): nothing is measured; unset values take the CPU
    defaults, the pool holds every slot at its cap, and the figures only report what that costs.
    """
    if not 0.0 < utilization <= 1.0:
        raise MemoryPlanError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    if max_seq_len and max_seq_len < 2:
        raise MemoryPlanError("--max-seq-len must be at least 2")
    bpp = costs.bytes_per_position
    per_slot = costs.slot_bytes + costs.codec_bytes_per_stream + costs.work_bytes_per_slot  # besides the KV pool
    block_bytes = block_size * bpp

    def split(slots: int, blocks: int) -> tuple[int, int, int]:
        backbone = blocks * block_bytes + slots * costs.slot_bytes
        codec = (slots + costs.codec_extra_streams) * costs.codec_bytes_per_stream + costs.codec_fixed_bytes
        return backbone, codec, costs.work_bytes + slots * costs.work_bytes_per_slot

    if total_bytes is None or free_bytes is None:
        slots = max_slots or DEFAULT_CPU_SLOTS
        seq_len = max_seq_len or DEFAULT_CPU_SEQ_LEN
        blocks = slots * _blocks_for(seq_len + 1, block_size) + 1
        backbone, codec, work = split(slots, blocks)
        return MemoryPlan(device, "settings", slots, seq_len, blocks, block_size, 0, 0, utilization,
                          backbone + codec + work + costs.aligner_bytes, backbone, codec, work, 0,
                          "flag" if max_slots else "default", "flag" if max_seq_len else "default",
                          costs.aligner_bytes)

    # The scratch block, the extra codec streams, work memory and the margin come first.
    b = _budget(costs, total_bytes, free_bytes, utilization, block_size)
    in_use, budget, margin, fixed, room = b.in_use, b.budget, b.margin, b.fixed, b.room
    if max_slots:
        slots = max_slots
    else:
        slots = max(0, min(MAX_AUTO_SLOTS, room // (per_slot + PLANNED_TAKE_POSITIONS * bpp))) if room > 0 else 0
        if slots == 0 and room > per_slot + min_blocks(MIN_SEQ_LEN, block_size) * block_bytes:
            slots = 1  # a small card: one take, shorter than planned
    blocks = 1 + (room - slots * per_slot) // block_bytes if room > 0 else 0
    if max_slots and max_seq_len:
        blocks = min(blocks, settings_blocks(max_slots, max_seq_len, block_size))
    if max_seq_len:
        seq_len = max_seq_len
    else:
        seq_len = min(DEFAULT_CPU_SEQ_LEN, max(0, (blocks - 2) * block_size - 1))
    if slots < 1 or blocks < min_blocks(max(seq_len, 2 if max_seq_len else MIN_SEQ_LEN), block_size):
        raise MemoryPlanError(_advice(costs, device, total_bytes, in_use, budget, utilization,
                                      max_slots, max_seq_len, fixed + max(1, slots) * per_slot, block_size))
    backbone, codec, work = split(slots, blocks)
    return MemoryPlan(device, "measured", slots, seq_len, blocks, block_size, total_bytes, in_use, utilization,
                      budget, backbone, codec, work, margin,
                      "flag" if max_slots else "plan", "flag" if max_seq_len else "plan", costs.aligner_bytes)


def _advice(
    costs: MemoryCosts,
    device: str,
    total: int,
    in_use: int,
    budget: int,
    utilization: float,
    max_slots: int,
    max_seq_len: int,
    fixed: int,
    block_size: int,
) -> str:
    want_slots = max(1, max_slots)
    want_seq = max_seq_len or MIN_SEQ_LEN
    need = fixed + min_blocks(want_seq, block_size) * block_size * costs.bytes_per_position
    msg = (
        f"the memory plan cannot hold {want_slots} take(s) with one of {want_seq} positions on {device}: "
        f"it needs {need / GIB:.2f} GiB but the budget is {budget / GIB:.2f} GiB "
        f"({utilization:.2f} x {total / GIB:.2f} GiB minus {in_use / GIB:.2f} GiB already in use by the weights, "
        f"the CUDA context and other processes). "
    )
    hints = []
    if max_slots:
        hints.append("lower --max-slots (or leave it unset so the plan chooses)")
    if max_seq_len:
        hints.append("lower --max-seq-len (or leave it unset)")
    if costs.codec_fp8_bytes_per_stream and costs.codec_bytes_per_stream != costs.codec_fp8_bytes_per_stream:
        hints.append("use --codec-state-dtype fp8 (about half the codec state per take, lower audio precision)")
    if utilization < 0.95:
        hints.append("raise --gpu-memory-utilization")
    hints.append("free GPU memory used by other processes, or use a GPU with more memory")
    return msg + "To fix: " + "; ".join(hints) + "."
