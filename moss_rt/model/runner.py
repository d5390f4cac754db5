"""ModelRunner: the engine's handle on the model (slots, prefill, seek, batched steps).

Slots are rows of preallocated device state (state.py). A batched step always runs on
a contiguous range of rows [0, B) (B = a batch bucket covering the highest slot
stepped); rows in that range that are not stepped compute into a scratch position and
keep their state. That is what makes the step CUDA-graph capturable with static
buffers: on CUDA one graph is captured per (batch bucket, key-length bucket), lazily
or in ``warmup()``. On CPU the step runs eagerly one slot at a time, which makes a
take's codes bit-identical whatever else is in the batch (CPU GEMMs are not row-
invariant across batch sizes).

Slot operations (allocation, attaching kept blocks, truncation, sampling settings, lengths after a prefill) do not
write the device one value at a time: they change host mirrors and stage the slot, and ``apply_staged`` writes every
staged slot with one batched scatter per tensor (block table, per-slot scalars, presence). Every pass (prefill, step,
graph capture) applies what is staged first, and so does reading ``state``, so nothing ever reads a stale value; the
scheduler applies a round's admissions once, right after them. An admission then costs the engine's thread no
device operation of its own (each is a small launch or copy through torch, which lets the codec worker and the web
threads take the interpreter in between), only its share of a constant few a round.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from moss_rt.generation import SamplingParams
from moss_rt.model.blocks import BlockPool, BlockRef, PoolExhausted
from moss_rt.model.config import MossTTSConfig
from moss_rt.model.network import MossTTSLocalModel
from moss_rt.model.prefill_graphs import GraphShape, PrefillGraphs
from moss_rt.model.prompt import KeptTokens, build_prompt_rows
from moss_rt.model.sampling import split_seed
from moss_rt.model.staging import PinnedStaging
from moss_rt.model.state import FLOAT_DEFAULT, FLOAT_FIELDS, INT_DEFAULT, INT_FIELDS, SlotState
from moss_rt.model.step import Tables, Timer, frame_step, prefill_batch_rows

logger = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
MIN_KEY_BUCKET = 256
DEFAULT_BLOCK_SIZE = 16  # positions per KV block (1.28 s of frames)
DEFAULT_PREFILL_MAX_ROWS = 8192  # padded prompt rows per prefill pass (the scheduler also bounds rows x keys)


class SlotError(RuntimeError):
    """A slot operation that cannot be done (full, unknown slot, out of positions...)."""


@dataclass(frozen=True)
class PrefillRequest:
    """Prompt rows [T,1+n_vq] for positions [start, start+T) of a slot; anything after is dropped."""

    slot: int
    rows: np.ndarray
    start: int = 0


@dataclass
class StepResult:
    codes: np.ndarray  # [B, n_vq] int64; pad codes where stop is True
    stop: np.ndarray  # [B] bool: the stop head fired, no frame was produced
    total_ms: float
    backbone_ms: float | None = None
    local_ms: float | None = None
    sampling_ms: float | None = None


class ModelRunner:
    def __init__(
        self,
        model: MossTTSLocalModel,
        tokenizer: Any,
        config: MossTTSConfig,
        *,
        max_slots: int,
        max_seq_len: int,
        device: torch.device | str,
        dtype: torch.dtype,
        use_cuda_graphs: bool | None = None,
        cpu_batch_invariant: bool = True,
        prefill_max_rows: int = DEFAULT_PREFILL_MAX_ROWS,
        prefill_graph_rows: int = 0,
        num_blocks: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
    ) -> None:
        if max_slots < 1 or max_seq_len < 2:
            raise ValueError("max_slots must be >= 1 and max_seq_len >= 2")
        if prefill_max_rows < 1:
            raise ValueError("prefill_max_rows must be >= 1")
        self.prefill_max_rows = int(prefill_max_rows)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self._prompt_tokens = KeptTokens(tokenizer)  # a retake's prompt re-tokenizes only what it changed
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_slots = int(max_slots)
        self.max_seq_len = int(max_seq_len)
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        max_blocks = -(-(self.max_seq_len + 1) // block_size)
        if num_blocks is None:  # as much as every slot at max_seq_len (+ the scratch block)
            num_blocks = self.max_slots * max_blocks + 1
        self.blocks = BlockPool(num_blocks, block_size, self.max_slots, max_blocks)
        self._state = SlotState.allocate(
            config, self.max_slots, self.max_seq_len, self.device, dtype, num_blocks=num_blocks, block_size=block_size
        )
        self.tables = Tables.build(model, self._state.positions, self.device, dtype)
        cuda = self.device.type == "cuda"
        self.use_cuda_graphs = cuda if use_cuda_graphs is None else bool(use_cuda_graphs and cuda)
        # On CPU each slot steps alone so that batching never changes a take's numbers (CPU GEMMs are not
        # row-invariant across batch sizes); cpu_batch_invariant=False batches them instead (faster with
        # many slots, same code as the CUDA graphs, codes then equal only up to float rounding).
        self.per_slot_eager = not cuda and cpu_batch_invariant
        # Host mirrors of the per-slot scalars (the rows of state.slot_ints / slot_floats): slot operations change
        # them and stage the slot; apply_staged writes the staged slots' columns to the device. The device changes
        # only lengths and frame counters itself (a step), and step() keeps the mirror in step with it.
        self._ints = np.full((len(INT_FIELDS), self.max_slots), INT_DEFAULT, dtype=np.int64)
        self._floats = np.full((len(FLOAT_FIELDS), self.max_slots), FLOAT_DEFAULT, dtype=np.float32)
        self._lengths = self._ints[INT_FIELDS.index("lengths")]  # views: written in place, never rebound
        self._frames = self._ints[INT_FIELDS.index("frame_index")]
        self._staged_slots: set[int] = set()
        self._staged_presence: dict[int, np.ndarray | None] = {}  # None: cleared (no history)
        self._staging = PinnedStaging(self.device)  # what apply_staged copies, in one copy a call
        self._allocated = np.zeros(self.max_slots, dtype=bool)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        # The memory pool every graph of this runner shares (they all run on this thread, one at a time). A handle,
        # not a callback into the runner: a reference cycle would leave a closed runner's graphs to the cyclic
        # garbage collector, which may then destroy them in the middle of another graph's capture (an abort).
        self._pool: Any = torch.cuda.graph_pool_handle() if self.use_cuda_graphs else None
        # A lone prompt piece's pass through a graph, from position 0 or after a prefix (prefill_graphs; the
        # common shapes captured by warmup, the rest by capture_next).
        self.prefill_graphs = PrefillGraphs(
            model, self._state, self.tables, min(self.max_seq_len, self.prefill_max_rows), self._pool,
            max_pieces=self.max_slots, max_padded_rows=min(prefill_graph_rows, self.prefill_max_rows),
        )
        self._active_host = torch.zeros(self.max_slots, dtype=torch.bool, pin_memory=cuda)
        logger.info(
            "model runner: %d slots, takes up to %d positions, paged KV cache of %d blocks x %d positions "
            "on %s/%s, state %.1f MiB, cuda graphs %s",
            self.max_slots,
            self.max_seq_len,
            num_blocks,
            block_size,
            self.device,
            dtype,
            self._state.nbytes() / 2**20,
            "on" if self.use_cuda_graphs else "off",
        )

    # ------------------------------------------------------------------ prompts
    def tokens_known(self, text: str) -> bool:
        """Whether ``text``'s token ids are remembered from an earlier prompt (building one with it costs little)."""
        return self._prompt_tokens.knows(text)

    def build_prompt(
        self,
        *,
        text: str,
        instruction: str = "",
        language: str = "",
        tokens: int | None = None,
        reference_codes: np.ndarray | None = None,
        continuation_codes: np.ndarray | None = None,
    ) -> np.ndarray:
        return build_prompt_rows(
            self._prompt_tokens,
            self.config,
            text=text,
            instruction=instruction,
            language=language,
            tokens=tokens,
            reference_codes=reference_codes,
            continuation_codes=continuation_codes,
        )

    # ------------------------------------------------------------------ slots
    def alloc_slot(self, *, default_sampling: bool = True) -> int:
        """A free slot, empty, with the default sampling unless the caller sets its own right after
        (``default_sampling=False``: the scheduler's admissions, which cost the engine's thread every device write)."""
        free = np.flatnonzero(~self._allocated)
        if free.size == 0:
            raise SlotError(f"all {self.max_slots} slots are in use")
        slot = int(free[0])  # lowest first keeps active rows packed at the front (small buckets)
        self._allocated[slot] = True
        self._lengths[slot] = 0
        self._stage(slot)
        if default_sampling:
            self.set_sampling(slot, SamplingParams(), 0)
        return slot

    def free_slot(self, slot: int) -> None:
        """End the slot's take: its blocks (and what it had reserved) go back to the pool."""
        self._check_slot(slot)
        self.blocks.release(slot)
        self._allocated[slot] = False
        self._lengths[slot] = 0
        self._stage(slot)

    # ------------------------------------------------------------------ paged cache
    @property
    def free_blocks(self) -> int:
        """Blocks of the KV pool not held by any slot or kept take (the free-block gauge)."""
        return self.blocks.free_blocks

    def blocks_needed(self, positions: int, shared: int = 0) -> int:
        """Blocks a take of ``positions`` positions may allocate when it shares its first ``shared``."""
        full_shared = shared // self.blocks.block_size
        cow = 1 if shared % self.blocks.block_size else 0  # the branch block is copied on the first write
        return max(0, self.blocks.blocks_for(positions) - full_shared) + cow

    def reserve(self, slot: int, positions: int, shared: int = 0) -> bool:
        """Promise the slot every block it may need to reach ``positions`` (False: not available now)."""
        self._check_slot(slot)
        return self.blocks.reserve(slot, self.blocks_needed(positions, shared))

    def detach(self, slot: int) -> BlockRef:
        """Free the slot but keep its cache (prompt + frames) alive as a BlockRef, for retakes to share."""
        self._check_slot(slot)
        ref = self.blocks.detach(slot, int(self._lengths[slot]))
        self._allocated[slot] = False
        self._lengths[slot] = 0
        self._stage(slot)
        return ref

    def attach(self, slot: int, ref: BlockRef, length: int) -> None:
        """The fresh ``slot`` continues from ``ref``'s first ``length`` positions, sharing their blocks;
        its first write into the shared last block copies that block (copy on write)."""
        self._check_slot(slot)
        if self._lengths[slot] != 0:
            raise SlotError(f"slot {slot} is not empty")
        if not 1 <= length <= ref.length:
            raise SlotError(f"cannot continue from position {length} of a cache of {ref.length}")
        self.blocks.attach(slot, ref, length)
        self._lengths[slot] = int(length)
        self._stage(slot)

    def share_prefix(self, slot: int, blocks: Sequence[int], length: int, positions: int) -> None:
        """The slot, empty or holding only blocks it shares, continues from ``blocks`` holding its first
        ``length`` positions (kept prompt blocks; none with length 0); its reservation becomes what reaching
        ``positions`` from there needs. Raises PoolExhausted when that is not available (a caller's
        bookkeeping bug: the scheduler made the room first)."""
        self._check_slot(slot)
        self.blocks.release(slot)  # a shorter prefix it shared before, and the reservation made for it
        self._lengths[slot] = 0
        self._stage(slot)
        if length:
            self.attach(slot, BlockRef(list(blocks), length), length)
        if not self.reserve(slot, positions, length):
            raise PoolExhausted(f"slot {slot} cannot reserve the blocks to reach {positions} positions")

    def drop(self, ref: BlockRef) -> None:
        self.blocks.drop(ref)

    def _make_writable(self, writes: Iterable[tuple[int, int, int]]) -> None:
        """Positions ``[start, end)`` of each ``(slot, start, end)`` writable: missing blocks allocated, shared ones
        copied (keys, values and hidden states; nothing staged touches them), all in one batched copy."""
        self._state.copy_blocks([pair for slot, start, end in writes
                                 for pair in self.blocks.prepare_write(slot, start, end)])

    # ------------------------------------------------------------------ staged slot writes
    @property
    def state(self) -> SlotState:
        """The device state with every staged slot write applied (for readers outside the runner: tests, benches
        that call the step functions themselves)."""
        self.apply_staged()
        return self._state

    def _stage(self, slot: int) -> None:
        """The slot's scalars changed on the host (self._ints / self._floats): written by the next apply_staged."""
        self._staged_slots.add(int(slot))

    @property
    def staged(self) -> bool:
        """Whether slot writes wait for apply_staged."""
        return bool(self._staged_slots or self._staged_presence or self.blocks.dirty)

    @torch.inference_mode()
    def apply_staged(self) -> bool:
        """Write what slot operations staged to the device, whatever the number of slots a few operations: the
        changed block-table rows, the staged slots' scalars and their presence rows, packed into one host-to-device
        copy (model/staging) and scattered into the state (one scatter per tensor). The values are the host's at this
        call: the last write of each slot and field wins, as if each had been written at once. Every pass calls this
        first; False: nothing was staged."""
        arrays: list[np.ndarray] = []
        dirty = sorted(self.blocks.dirty)
        scalars = bool(self._staged_slots)
        if dirty:
            tables = np.empty((len(dirty), 1 + self.blocks.max_blocks_per_slot), dtype=np.int64)  # column 0: slots
            tables[:, 0] = dirty
            tables[:, 1:] = self.blocks.table[dirty]
            self.blocks.dirty.clear()
            arrays.append(tables)
        if self._staged_slots:
            slots = sorted(self._staged_slots)
            self._staged_slots.clear()
            ints = np.empty((1 + len(INT_FIELDS), len(slots)), dtype=np.int64)  # row 0: the slots
            ints[0] = slots
            ints[1:] = self._ints[:, slots]
            arrays += [ints, self._floats[:, slots]]  # copies: later host changes never race the copy to the device
        if self._staged_presence:
            staged = sorted(self._staged_presence.items())
            self._staged_presence.clear()
            rows = np.zeros((len(staged), self.config.n_vq, self.config.audio_vocab_size), dtype=bool)
            for j, (_, row) in enumerate(staged):
                if row is not None:
                    rows[j] = row
            arrays += [np.array([slot for slot, _ in staged], dtype=np.int64), rows]
        if not arrays:
            return False
        dev = iter(self._staging.copy(arrays))
        st = self._state
        if dirty:
            table_rows = next(dev)
            st.block_table[table_rows[:, 0]] = table_rows[:, 1:]
        if scalars:
            ints_dev, floats_dev = next(dev), next(dev)
            index = ints_dev[0]
            st.slot_ints[:, index] = ints_dev[1:]
            st.slot_floats[:, index] = floats_dev
        presence = list(dev)
        if presence:
            st.presence[presence[0]] = presence[1]
        return True

    def slot_cache(self, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copies of the slot's keys, values [L,Hkv,length,D] and hidden states [length,H] (for tests)."""
        st = self.state  # what is staged applied first
        index = st.pool_index(torch.tensor([slot], device=self.device), torch.arange(length, device=self.device)[None])
        return st.k_cache[:, index[0]].transpose(1, 2).clone(), st.v_cache[:, index[0]].transpose(1, 2).clone(), \
            st.hidden[index[0]].clone()

    def slot_length(self, slot: int) -> int:
        """Positions filled: prompt rows + frames produced (after truncation)."""
        self._check_slot(slot)
        return int(self._lengths[slot])

    def slot_frame_index(self, slot: int) -> int:
        """The RNG counter of the slot's next frame (set_sampling's frame_index + frames produced since)."""
        self._check_slot(slot)
        return int(self._frames[slot])

    @property
    def free_slots(self) -> int:
        return int((~self._allocated).sum())

    def _check_slot(self, slot: int) -> None:
        if not 0 <= int(slot) < self.max_slots or not self._allocated[slot]:
            raise SlotError(f"slot {slot} is not allocated")

    # ------------------------------------------------------------------ prefill / seek
    def prefill(self, slot: int, rows: np.ndarray, *, start: int = 0) -> None:
        """Write prompt rows at positions [start, start+T); anything after is dropped."""
        self.prefill_batch([PrefillRequest(slot, rows, start)])

    @torch.inference_mode()
    def prefill_batch(self, requests: Sequence[PrefillRequest]) -> int:
        """Prefill several slots together; returns the number of passes they were grouped into.

        Chunks of different lengths and start offsets share one pass, padded to the longest;
        passes hold at most ``prefill_max_rows`` padded rows (a longer chunk is cut into
        consecutive pieces). Every request is checked before anything is written, and a slot's
        length changes only once all passes ran. The cache contents equal those of prefilling
        each slot alone: valid rows attend only to their own slot's keys (bit for bit on the CPU,
        where a pass runs slot by slot as steps do; to float rounding with
        ``cpu_batch_invariant=False`` and on CUDA, where one padded backbone call serves the pass).
        """
        checked = [self._checked_request(r) for r in requests]
        slots = [slot for slot, _, _ in checked]
        if len(set(slots)) != len(slots):
            raise ValueError(f"duplicate slots in {slots}")
        self._make_writable((slot, start, start + int(rows.shape[0])) for slot, rows, start in checked)
        self.apply_staged()  # block tables (and whatever else slot operations staged) before the passes read them
        passes = plan_prefill_passes([int(rows.shape[0]) for _, rows, _ in checked], self.prefill_max_rows)
        for group in passes:
            pieces = [(checked[i][0], checked[i][1][off : off + n], checked[i][2] + off) for i, off, n in group]
            self._prefill_pass(pieces)
        for slot, rows, start in checked:
            self._lengths[slot] = start + int(rows.shape[0])
            self._stage(slot)
        return len(passes)

    def _checked_request(self, request: PrefillRequest) -> tuple[int, torch.Tensor, int]:
        slot, start = int(request.slot), int(request.start)
        self._check_slot(slot)
        rows = np.asarray(request.rows, dtype=np.int64)
        # Prompt rows are shared read-only (engine/prompts.PromptRowsCache); torch wraps only writable arrays.
        rows_t = torch.from_numpy(rows if rows.flags.writeable else rows.copy())
        if rows_t.ndim != 2 or rows_t.shape[1] != self.config.n_channels or rows_t.shape[0] == 0:
            raise ValueError(f"rows must be a non-empty [T,{self.config.n_channels}] array, got {tuple(rows_t.shape)}")
        if not 0 <= start <= self._lengths[slot]:
            raise SlotError(f"prefill start {start} is beyond the slot's length {self._lengths[slot]}")
        end = start + int(rows_t.shape[0])
        if end > self.max_seq_len:
            raise SlotError(f"prefill to {end} positions exceeds max_seq_len={self.max_seq_len}")
        self._check_row_values(rows_t)
        return slot, rows_t, start

    def _prefill_pass(self, pieces: list[tuple[int, torch.Tensor, int]]) -> None:
        """One backbone pass over (slot, rows, start) pieces of distinct slots, padded to the longest.

        With ``per_slot_eager`` (the CPU default) each piece runs as a pass of its own, the shapes of
        prefilling that slot alone, for the reason ``step`` runs slot by slot there: CPU GEMMs are not
        row-invariant across row counts (a chunk of a few rows takes another kernel path batched with
        hundreds), so any shared projection could change a slot's numbers with its neighbours.

        With CUDA graphs a lone piece replays a prefill graph when one of its shape is captured (prefill_graphs:
        from position 0, or after a prefix the slot already holds, e.g. a line's opening shared by the prompt
        cache, or the earlier chunks of a long prompt), and so does a pass of a few short pieces (a render's lines, a
        burst of retakes' rows); larger passes (compute-bound) run eagerly.
        """
        if self.per_slot_eager and len(pieces) > 1:
            for piece in pieces:
                self._prefill_pass([piece])
            return
        if self.use_cuda_graphs and self.prefill_graphs.run_pass(pieces):  # False: no graph holds it (or none yet)
            return
        width = max(int(rows.shape[0]) for _, rows, _ in pieces)
        padded = torch.zeros((len(pieces), width, self.config.n_channels), dtype=torch.int64)  # ids 0 are valid
        for b, (_, rows, _) in enumerate(pieces):
            padded[b, : rows.shape[0]] = rows
        slots = [slot for slot, _, _ in pieces]
        starts = [start for _, _, start in pieces]
        counts = [int(rows.shape[0]) for _, rows, _ in pieces]
        prefill_batch_rows(
            self.model,
            self._state,
            self.tables,
            torch.tensor(slots, device=self.device),
            padded.to(self.device),
            torch.tensor(starts, device=self.device),
            torch.tensor(counts, device=self.device),
            max(s + c for s, c in zip(starts, counts, strict=True)),
            from_zero=not any(starts),
        )

    def _check_row_values(self, rows: torch.Tensor) -> None:
        cfg = self.config
        text = rows[:, 0]
        if bool(((text < 0) | (text >= cfg.backbone.vocab_size)).any()):
            raise ValueError("row text ids must be within the text vocab")
        codes = rows[:, 1:]
        if bool((((codes < 0) | (codes >= cfg.audio_vocab_size)) & (codes != cfg.audio_pad_token_id)).any()):
            raise ValueError(f"row codes must be in [0,{cfg.audio_vocab_size}) or the pad code")

    def truncate(self, slot: int, length: int) -> None:
        """Keep the first ``length`` positions; the stored hidden state at length-1 becomes pending."""
        self._check_slot(slot)
        if not 1 <= length <= self._lengths[slot]:
            raise SlotError(f"cannot truncate slot {slot} of length {self._lengths[slot]} to {length}")
        self.blocks.truncate(slot, int(length))  # whole blocks past the new end go back to the pool
        self._lengths[slot] = int(length)
        self._stage(slot)

    # ------------------------------------------------------------------ sampling state
    def set_sampling(
        self,
        slot: int,
        params: SamplingParams,
        seed: int,
        *,
        frame_index: int = 0,
        history: np.ndarray | None = None,
    ) -> None:
        """The slot's seed, sampling parameters, RNG counter and repetition history (``history`` [N, n_vq]: the codes
        the penalty counts as already produced; none: an empty table). Checked now, staged: on the device before
        the next pass reads them (apply_staged), or once ``state`` is read."""
        self._check_slot(slot)
        if params.audio_temperature < 0 or params.text_temperature < 0:
            raise ValueError("temperatures must be >= 0")
        if params.audio_repetition_penalty <= 0:
            raise ValueError("audio_repetition_penalty must be > 0")
        if frame_index < 0:
            raise ValueError("frame_index must be >= 0")
        lo, hi = split_seed(seed)
        presence = None if history is None or not len(history) else self._presence_row(history)
        ints, floats = self._ints, self._floats
        for name, value in (("seed_lo", lo), ("seed_hi", hi), ("frame_index", int(frame_index)),
                            ("audio_top_k", int(params.audio_top_k)), ("text_top_k", int(params.text_top_k))):
            ints[_INT_ROW[name], slot] = value
        for name, fvalue in (("audio_temperature", float(params.audio_temperature)),
                             ("audio_top_p", _float32_top_p(params.audio_top_p)),
                             ("audio_penalty", float(params.audio_repetition_penalty)),
                             ("text_temperature", float(params.text_temperature)),
                             ("text_top_p", _float32_top_p(params.text_top_p))):
            floats[_FLOAT_ROW[name], slot] = fvalue  # float32, rounded as a device write rounds it
        self._stage(slot)
        self._staged_presence[int(slot)] = presence  # None: the slot's table is cleared

    def _presence_row(self, history: np.ndarray) -> np.ndarray:
        """The presence table [n_vq, vocab] of ``history`` [N, n_vq] (pad codes are not history), on the host."""
        n_vq, vocab = self.config.n_vq, self.config.audio_vocab_size
        hist = np.asarray(history).astype(np.int64, copy=False)
        if hist.ndim != 2 or hist.shape[1] != n_vq:
            raise ValueError(f"history must be [N,{n_vq}], got {tuple(hist.shape)}")
        codebook = np.broadcast_to(np.arange(n_vq), hist.shape)
        valid = (hist >= 0) & (hist < vocab)
        row = np.zeros((n_vq, vocab), dtype=bool)
        row[codebook[valid], hist[valid]] = True
        return row

    # ------------------------------------------------------------------ stepping
    @torch.inference_mode()
    def step(self, slots: list[int]) -> StepResult:
        """Advance every listed slot by one frame; results are in the order of ``slots``."""
        t0 = time.perf_counter()
        slots = [int(s) for s in slots]
        if not slots:
            raise ValueError("step needs at least one slot")
        if len(set(slots)) != len(slots):
            raise ValueError(f"duplicate slots in {slots}")
        for s in slots:
            self._check_slot(s)
            if self._lengths[s] < 1:
                raise SlotError(f"slot {s} has no prompt: prefill it first")
            if self._lengths[s] >= self.max_seq_len:
                raise SlotError(f"slot {s} is full ({self.max_seq_len} positions)")
        # The position each row writes: a fresh block at a block boundary, a copy if shared.
        self._make_writable((s, int(self._lengths[s]), int(self._lengths[s]) + 1) for s in slots)
        self.apply_staged()  # the tables those writes changed, and every slot write staged since the last pass
        st = self._state
        timer: Timer | None = None
        if self.per_slot_eager:
            timer = Timer()
            for s in slots:
                st.active.zero_()
                st.active[s] = True
                frame_step(self.model, st, self.tables, s, s + 1, int(self._lengths[s]) + 1, timer)
            st.active.zero_()
        else:
            self._active_host.zero_()
            self._active_host[slots] = True
            st.active.copy_(self._active_host, non_blocking=True)
            batch = _bucket(max(slots) + 1, self._batch_buckets())
            key_len = self._key_bucket(max(int(self._lengths[s]) for s in slots) + 1)
            if self.use_cuda_graphs:
                self._graph(batch, key_len).replay()
            else:
                frame_step(self.model, st, self.tables, 0, batch, key_len)
        index = torch.tensor(slots, device=self.device)
        codes = st.codes[index].cpu().numpy()
        stop = st.stop[index].cpu().numpy()
        for s, stopped in zip(slots, stop, strict=True):
            if not stopped:
                self._lengths[s] += 1
                self._frames[s] += 1
        total = (time.perf_counter() - t0) * 1000.0
        if timer is not None:
            sampling = timer.sampling_ms + timer.bookkeeping_ms  # the draws and what follows from them
            return StepResult(codes, stop, total, timer.backbone_ms, timer.local_ms, sampling)
        return StepResult(codes, stop, total)

    # ------------------------------------------------------------------ CUDA graphs
    def _batch_buckets(self) -> list[int]:
        buckets = [b for b in BATCH_BUCKETS if b < self.max_slots]
        return buckets + [self.max_slots]

    def _key_bucket(self, needed: int) -> int:
        bucket = MIN_KEY_BUCKET
        while bucket < needed:
            bucket *= 2
        return min(bucket, self._state.positions)

    def key_buckets(self) -> list[int]:
        """Every key-length bucket a step can use (a step needs length+1 <= max_seq_len keys)."""
        out, bucket = [], MIN_KEY_BUCKET
        while True:
            out.append(min(bucket, self._state.positions))
            if bucket >= self.max_seq_len:
                return out
            bucket *= 2

    def _graph(self, batch: int, key_len: int) -> torch.cuda.CUDAGraph:
        key = (batch, key_len)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture(batch, key_len)
            self._graphs[key] = graph
        return graph

    def _capture(self, batch: int, key_len: int) -> torch.cuda.CUDAGraph:
        """Capture frame_step for rows [0,batch). Runs with all rows inactive, so it has no effect."""
        t0 = time.perf_counter()
        st = self.state  # what is staged applied first (a graph reads the state's addresses, but warm-up runs read it)
        saved_active = st.active.clone()
        st.active.zero_()
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            # One warm-up outside the capture (kernels compiled or loaded); a second only cost start-up time.
            frame_step(self.model, st, self.tables, 0, batch, key_len)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            frame_step(self.model, st, self.tables, 0, batch, key_len)
        torch.cuda.synchronize(self.device)
        st.active.copy_(saved_active)
        logger.info("captured step graph batch=%d keys=%d in %.0f ms", batch, key_len, (time.perf_counter() - t0) * 1e3)
        return graph

    def pending_graphs(self) -> list[tuple[int, int]]:
        """(batch, keys) step graphs not captured yet, the likeliest first (small batches, short keys)."""
        if not self.use_cuda_graphs:
            return []
        every = [(b, k) for k in self.key_buckets() for b in self._batch_buckets()]
        return sorted((key for key in every if key not in self._graphs), key=lambda bk: (bk[1], bk[0]))

    def prefill_graph_fits(self, widths: Sequence[int], starts: Sequence[int]) -> bool:
        """Whether a prefill pass of pieces of ``widths[i]`` rows starting at ``starts[i]`` has a graph shape
        (prefill_graphs: a lone piece, or a batch of short ones within the padded-rows bounds). It answers by shape,
        not by what is captured yet (the scheduler cuts passes by it, and pass composition must not follow timing),
        and the same without CUDA graphs."""
        return self.prefill_graphs.shape_for_pass(list(widths), list(starts)) is not None

    def prefill_graph_rule(self) -> Callable[[Sequence[int], Sequence[int]], bool] | None:
        """What a pass must fit for a prefill graph to replay it (prefill_graph_fits), or None where no graph ever
        replays one (no CUDA graphs: the CPU): passes are then cut by their rows alone."""
        return self.prefill_graph_fits if self.use_cuda_graphs else None

    def pending_prefill_graphs(self) -> list[GraphShape]:
        """Prefill graphs (prefill_graphs) not captured yet, the likeliest first."""
        return self.prefill_graphs.pending() if self.use_cuda_graphs else []

    @torch.inference_mode()
    def capture_next(self) -> bool:
        """Capture the likeliest missing graph (the engine calls this while idle); False: none left.

        Step graphs and prefill graphs by key window: a prefill graph comes after the step graphs of the shorter
        windows (every take steps; few prompts reach past the first prefill window, which warmup captures), a batched
        pass's after those of its own window too (PrefillGraphs.idle_rank)."""
        self.apply_staged()  # a prefill graph's capture runs its pass first
        steps = self.pending_graphs()
        prefills = self.pending_prefill_graphs()
        if prefills and (not steps or self.prefill_graphs.idle_rank(prefills[0]) < steps[0][1]):
            self.prefill_graphs.capture(prefills[0])
            return True
        if not steps:
            return False
        self._graph(*steps[0])
        return True

    @torch.inference_mode()
    def compile_step(self, batch: int, key_len: int) -> None:
        """Run the step of rows [0, batch) over ``key_len`` keys once, eagerly, every row inactive (they compute into
        the scratch position: nothing a take reads changes). It compiles the shape's kernels ahead of its capture
        (engine/warm_compile.py runs several such passes on threads at once). Before serving only: no slot may be
        allocated, and no step run meanwhile. It applies nothing staged (it may run on several threads at once): with
        every row inactive, nothing it reads is kept."""
        if self._allocated.any():
            raise SlotError("compile_step runs before any slot is allocated")
        batch, key_len = _bucket(batch, self._batch_buckets()), self._key_bucket(key_len)
        frame_step(self.model, self._state, self.tables, 0, batch, key_len)

    @torch.inference_mode()
    def compile_prefill(self, shape: GraphShape) -> None:
        """Run a prefill graph's pass once, eagerly, every row padding (writes only the scratch position): its
        kernels compile ahead of its capture (see ``compile_step``)."""
        self.prefill_graphs.run_padded(shape)

    @torch.inference_mode()
    def warmup(
        self, batch_sizes: list[int] | None = None, key_lengths: list[int] | None = None, prefill: bool = True
    ) -> None:
        """Capture graphs ahead of serving (no-op without CUDA graphs): steps of these batch sizes and key lengths
        (default: all), and with ``prefill`` the common lone-prompt prefill graphs (prefill_graphs.common_shapes)."""
        if not self.use_cuda_graphs:
            return
        if prefill:
            self.prefill_graphs.capture_common()
        batches = sorted({_bucket(b, self._batch_buckets()) for b in (batch_sizes or self._batch_buckets())})
        keys = sorted({self._key_bucket(k) for k in (key_lengths or self.key_buckets())})
        for b in batches:
            for k in keys:
                self._graph(b, k)


_INT_ROW = {name: row for row, name in enumerate(INT_FIELDS)}
_FLOAT_ROW = {name: row for row, name in enumerate(FLOAT_FIELDS)}


def _float32_top_p(p: float) -> float:
    """top_p is stored in float32; a tiny positive p must not underflow to 0 (= off): any p below
    1e-6 keeps just the top token, exactly like 1e-6 does."""
    p = float(p)
    return 1e-6 if 0.0 < p < 1e-6 else p


def plan_prefill_passes(lengths: Sequence[int], max_rows: int) -> list[list[tuple[int, int, int]]]:
    """Group prompt chunks into backbone passes of at most ``max_rows`` padded rows (chunks x longest).

    Returns the passes in order, each a list of (request index, row offset, row count) of distinct
    requests. A request longer than ``max_rows`` is cut into consecutive pieces that go to later
    and later passes, so every piece sees the keys its earlier pieces wrote.
    """
    if max_rows < 1:
        raise ValueError("max_rows must be >= 1")
    pieces = [[(i, off, min(max_rows, n - off)) for off in range(0, n, max_rows)] for i, n in enumerate(lengths)]
    passes: list[list[tuple[int, int, int]]] = []
    for depth in range(max((len(p) for p in pieces), default=0)):
        current: list[tuple[int, int, int]] = []
        widest = 0
        for piece in (p[depth] for p in pieces if depth < len(p)):
            wider = max(widest, piece[2])
            if current and wider * (len(current) + 1) > max_rows:
                passes.append(current)
                current, wider = [], piece[2]
            current.append(piece)
            widest = wider
        if current:
            passes.append(current)
    return passes


def _bucket(value: int, buckets: list[int]) -> int:
    for b in buckets:
        if b >= value:
            return b
    raise SlotError(f"batch of {value} rows exceeds the largest bucket {buckets[-1]}")
