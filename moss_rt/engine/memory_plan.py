"""The memory plan made at start: how many takes run at once and how long each may grow.

Made once, after the model and codec weights are loaded, from what the device has free then
(``--gpu-memory-utilization`` of the whole device is the ceiling; what others, the weights and the
CUDA context already use is subtracted). The budget is split between

- the backbone KV cache (keys, values and the per-position hidden state of every take),
- the codec's streaming state (one K/V ring set per stream: slots, renders, warm-up),
- work memory (CUDA-graph pools, prefill scores and activations), and
- a margin for the allocator's fragmentation and library workspaces.

A pure function of numbers (no torch, no device), so it is tested with fake free-memory figures. On
a CPU the plan is computed from the settings alone (host memory is not planned).
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30
MIB = 1 << 20

DEFAULT_CPU_SLOTS = 64  # CPU (and settings-only) defaults when --max-slots / --max-seq-len are not given
DEFAULT_CPU_SEQ_LEN = 5120
AUTO_SEQ_LEN = 2048  # cache positions per take when the plan chooses: a 400-row prompt + 2 minutes of audio
MIN_SEQ_LEN = 512  # below this even one short take cannot run; the plan fails instead
MAX_AUTO_SLOTS = 256  # the plan never goes beyond this many slots on its own (step batch buckets end here)
MARGIN_FRACTION = 0.03  # of the usable budget, at least MIN_MARGIN
MIN_MARGIN = 512 * MIB


class MemoryPlanError(RuntimeError):
    """The budget cannot hold even one take; the message says what to change."""


@dataclass(frozen=True)
class MemoryCosts:
    """What one unit of each consumer costs in bytes (from the loaded model and codec)."""

    bytes_per_position: int  # backbone cache: K + V over every layer + the hidden state, one take position
    slot_bytes: int  # fixed per-slot state (sampler state, repetition-penalty bitmap)
    codec_bytes_per_stream: int  # the codec's streaming K/V rings of one stream
    codec_extra_streams: int  # codec streams beyond one per slot (renders, warm-up, scratch)
    work_bytes: int  # CUDA-graph pools, prefill scores and activations (independent of slots)
    work_bytes_per_slot: int = 0  # graph activations growing with the batch


@dataclass(frozen=True)
class MemoryPlan:
    """The plan (bytes), and where each figure came from."""

    device: str
    source: str  # "measured" (free device memory) or "settings" (CPU: no device budget)
    max_slots: int
    max_seq_len: int
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

    @property
    def planned_bytes(self) -> int:
        return self.backbone_cache_bytes + self.codec_state_bytes + self.work_bytes + self.margin_bytes

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
            (f"positions per take (max_seq_len, from {self.seq_len_from})", str(self.max_seq_len)),
            ("backbone KV cache", gib(self.backbone_cache_bytes)),
            ("codec streaming state", gib(self.codec_state_bytes)),
            ("graph pools and work memory", gib(self.work_bytes)),
            ("margin", gib(self.margin_bytes)),
        ]
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
        }


def per_slot_bytes(costs: MemoryCosts, seq_len: int) -> int:
    """One slot: its cache rows (max_seq_len + the scratch position), fixed state, codec stream, graph work."""
    return (
        (seq_len + 1) * costs.bytes_per_position
        + costs.slot_bytes
        + costs.codec_bytes_per_stream
        + costs.work_bytes_per_slot
    )


def _split(costs: MemoryCosts, slots: int, seq_len: int, margin: int) -> tuple[int, int, int]:
    backbone = slots * ((seq_len + 1) * costs.bytes_per_position + costs.slot_bytes)
    codec = (slots + costs.codec_extra_streams) * costs.codec_bytes_per_stream
    work = costs.work_bytes + slots * costs.work_bytes_per_slot
    return backbone, codec, work


def plan_memory(
    costs: MemoryCosts,
    *,
    device: str,
    total_bytes: int | None,
    free_bytes: int | None,
    utilization: float = 0.90,
    max_slots: int = 0,
    max_seq_len: int = 0,
) -> MemoryPlan:
    """Plan slots x positions within the budget; ``max_slots`` / ``max_seq_len`` > 0 are kept as given.

    ``total_bytes`` / ``free_bytes`` None (CPU): nothing is measured; unset values take the CPU
    defaults and the figures only report what the settings cost.
    """
    if not 0.0 < utilization <= 1.0:
        raise MemoryPlanError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    slots_from = "flag" if max_slots > 0 else "plan"
    seq_from = "flag" if max_seq_len > 0 else "plan"
    if max_seq_len and max_seq_len < 2:
        raise MemoryPlanError("--max-seq-len must be at least 2")
    if total_bytes is None or free_bytes is None:
        slots = max_slots or DEFAULT_CPU_SLOTS
        seq_len = max_seq_len or DEFAULT_CPU_SEQ_LEN
        backbone, codec, work = _split(costs, slots, seq_len, 0)
        return MemoryPlan(device, "settings", slots, seq_len, 0, 0, utilization, backbone + codec + work,
                          backbone, codec, work, 0, "flag" if max_slots else "default",
                          "flag" if max_seq_len else "default")

    in_use = max(0, total_bytes - free_bytes)
    budget = int(utilization * total_bytes) - in_use
    margin = max(MIN_MARGIN, int(MARGIN_FRACTION * max(budget, 0)))
    fixed = costs.codec_extra_streams * costs.codec_bytes_per_stream + costs.work_bytes + margin
    room = budget - fixed

    def slots_for(seq_len: int) -> int:
        return max(0, room // per_slot_bytes(costs, seq_len)) if room > 0 else 0

    def seq_for(slots: int) -> int:
        if room <= 0:
            return 0
        per_slot_rest = costs.slot_bytes + costs.codec_bytes_per_stream + costs.work_bytes_per_slot
        positions = (room // slots - per_slot_rest) // costs.bytes_per_position - 1
        return int(max(0, positions))

    if max_slots and max_seq_len:
        slots, seq_len = max_slots, max_seq_len
    elif max_seq_len:
        seq_len = max_seq_len
        slots = min(MAX_AUTO_SLOTS, slots_for(seq_len))
    elif max_slots:
        slots = max_slots
        seq_len = min(DEFAULT_CPU_SEQ_LEN, seq_for(slots) // 256 * 256)
    else:
        seq_len = AUTO_SEQ_LEN
        slots = min(MAX_AUTO_SLOTS, slots_for(seq_len))
        if slots == 0:  # a small card: shorter takes before none at all
            seq_len = max(MIN_SEQ_LEN, seq_for(1) // 256 * 256)
            slots = min(MAX_AUTO_SLOTS, slots_for(seq_len))

    backbone, codec, work = _split(costs, slots, seq_len, margin)
    too_short = seq_len < (2 if max_seq_len else MIN_SEQ_LEN)
    if slots < 1 or too_short or backbone + codec + work + margin > budget:
        raise MemoryPlanError(_advice(costs, device, total_bytes, in_use, budget, utilization,
                                      max_slots, max_seq_len, fixed))
    return MemoryPlan(device, "measured", slots, seq_len, total_bytes, in_use, utilization, budget,
                      backbone, codec, work, margin, slots_from, seq_from)


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
) -> str:
    want_slots = max(1, max_slots or 1)
    want_seq = max_seq_len or MIN_SEQ_LEN
    need = fixed + want_slots * per_slot_bytes(costs, want_seq)
    msg = (
        f"the memory plan cannot hold {want_slots} take(s) of {want_seq} positions on {device}: "
        f"it needs {need / GIB:.2f} GiB but the budget is {budget / GIB:.2f} GiB "
        f"({utilization:.2f} x {total / GIB:.2f} GiB minus {in_use / GIB:.2f} GiB already in use by the weights, "
        f"the CUDA context and other processes). "
    )
    hints = []
    if max_slots:
        hints.append("lower --max-slots (or leave it unset so the plan chooses)")
    if max_seq_len:
        hints.append("lower --max-seq-len (or leave it unset)")
    if utilization < 0.95:
        hints.append("raise --gpu-memory-utilization")
    hints.append("free GPU memory used by other processes, or use a GPU with more memory")
    return msg + "To fix: " + "; ".join(hints) + "."
