"""ModelRunner on CUDA (fp32 tiny fixture checkpoint, steps through CUDA graphs): upstream parity, graph vs
eager, batch independence, exact seek. The ``cpu`` variants run the same bodies on the CPU runner."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moss_rt.generation import SamplingParams
from moss_rt.model import ModelRunner, fused_sampling
from moss_rt.model.runner import PrefillRequest
from tests.gpu.conftest import DEVICES
from tests.model.test_golden import GREEDY, _prompt

# Greedy stop head (the tiny model's continue margin is positive): takes never end early.
PENALTY = SamplingParams(text_temperature=0.0, audio_repetition_penalty=1.1)  # 1.7 / 0.8 / 25 + penalty 1.1
# 247 prompt rows: a take crosses from the 256-key bucket into the next one after 9 frames.
LONG_TEXT = (
    "The night is long, and the stars are listening. Nobody else is awake at this hour, so speak softly "
    "to them and let the quiet answer."
)
TEXTS = ["Hello.", "Get out!", "A longer line of text, said calmly.", "Yes.", "No!", "Maybe?", "Why not."]


def _uses_the_fused_sampler(device: str) -> bool:
    """CUDA steps draw in the fused Triton kernel (fused_sampling.py) unless MOSS_RT_FUSED_SAMPLER=0; the CPU never."""
    return fused_sampling.available(torch.zeros(1, device=device))


def _frames(runner: ModelRunner, slot: int, frames: int) -> np.ndarray:
    codes = []
    for _ in range(frames):
        result = runner.step([slot])
        assert not result.stop[0]
        codes.append(result.codes[0])
    return np.stack(codes)


def _directed(runner: ModelRunner, golden_cases: dict, text: str | None = None) -> np.ndarray:
    case = next(c for c in golden_cases["prompts"] if c["name"] == "directed")
    return runner.build_prompt(
        text=text or case["text"], instruction=case["instruction"], language=case["language"], tokens=case["tokens"]
    )


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_codes_through_graphs_equal_upstream_golden(device, make_runner, golden, golden_cases) -> None:
    # 8 x 320 as in bench/model_bench.py's CUDA checks, whose H200 run first showed this parity: the "directed" case
    # has a near-tie (top-2 logits 2e-6 apart, relative) that a different cache layout could round the other way.
    runner = make_runner(device, max_slots=8, max_seq_len=320)
    slot = runner.alloc_slot()
    # All three cases on CUDA; on the CPU tests/model/test_golden.py already checks them all, one suffices here.
    for spec in golden_cases["greedy"] if device == "cuda" else golden_cases["greedy"][:1]:
        case = next(c for c in golden_cases["prompts"] if c["name"] == spec["prompt"])
        prompt = _prompt(runner, case, golden)
        np.testing.assert_array_equal(prompt, golden[f"prompt_{spec['prompt']}"])
        runner.prefill(slot, prompt)  # a new prompt from position 0 replaces the previous take
        runner.set_sampling(slot, GREEDY, seed=0)
        np.testing.assert_array_equal(
            _frames(runner, slot, spec["frames"]), golden[f"greedy_{spec['prompt']}"], err_msg=spec["prompt"]
        )


@pytest.mark.parametrize("device", DEVICES)
def test_graph_replay_equals_eager_step_for_sampled_takes_with_penalty(device, make_runner, golden_cases) -> None:
    """Three takes (penalty 1.1 and others) stepped together and apart, across the 256-key bucket boundary.

    CUDA: graph replay vs the same step run eagerly, both drawing in the fused sampling kernel. CPU (no graphs):
    the batched range step that the graphs capture (rows [0,B), unlisted rows inactive) vs the per-slot eager step."""
    assert _uses_the_fused_sampler(device) == (device == "cuda")
    graph_options, eager_options = (
        ({"use_cuda_graphs": True}, {"use_cuda_graphs": False})
        if device == "cuda"
        else ({"cpu_batch_invariant": False}, {})
    )
    params = [PENALTY, SamplingParams(text_temperature=0.0, audio_top_k=10), PENALTY.replace(audio_temperature=0.8)]
    runs = []
    for options in (graph_options, eager_options):
        runner = make_runner(device, max_slots=4, max_seq_len=320, **options)
        prompt = _directed(runner, golden_cases, LONG_TEXT)
        slots = [runner.alloc_slot() for _ in range(3)]
        for i, s in enumerate(slots):
            runner.prefill(s, prompt[: len(prompt) - 7 * i])
            runner.set_sampling(s, params[i], seed=40 + i)
        frames: dict[int, list[np.ndarray]] = {s: [] for s in slots}
        for t in range(40):  # 247 + 40 > 256: the later frames use the next key bucket
            stepped = [0, 1, 2] if t % 4 else [2, 0]  # slot 1 sits some out (rows inside the batch, inactive)
            result = runner.step(stepped)
            assert not result.stop.any()
            for s, codes in zip(stepped, result.codes, strict=True):
                frames[s].append(codes)
        assert runner.slot_length(0) > 256
        runs.append({s: np.stack(v) for s, v in frames.items()})
    graph, eager = runs
    for s in graph:
        np.testing.assert_array_equal(graph[s], eager[s], err_msg=f"slot {s}")


@pytest.mark.parametrize("device", DEVICES)
def test_take_is_identical_alone_and_in_a_batch_of_8(device, make_runner, golden_cases) -> None:
    assert _uses_the_fused_sampler(device) == (device == "cuda")  # on CUDA: the fused kernel's draws
    alone = make_runner(device, max_slots=8)
    prompt = _directed(alone, golden_cases)
    slot = alone.alloc_slot()
    assert slot == 0  # stepped alone it runs at batch bucket 1
    alone.prefill(slot, prompt)
    alone.set_sampling(slot, PENALTY, seed=5)
    solo = _frames(alone, slot, 20)

    crowd = make_runner(device, max_slots=8)
    slots = [crowd.alloc_slot() for _ in range(8)]
    target = slots[3]  # in the middle of the batch
    for i, s in enumerate(s for s in slots if s != target):
        crowd.prefill(s, crowd.build_prompt(text=TEXTS[i], instruction=f"style {i}"))
        crowd.set_sampling(
            s,
            SamplingParams(
                text_temperature=0.0,
                audio_temperature=0.5 + 0.2 * i,
                audio_top_k=10 * i,
                audio_repetition_penalty=1.0 + 0.05 * i,
            ),
            seed=i,
        )
    crowd.prefill(target, prompt)
    crowd.set_sampling(target, PENALTY, seed=5)
    order = [7, 2, 5, target, 0, 6, 1, 4]  # results come back in this order
    got = []
    for _ in range(20):
        result = crowd.step(order)
        assert not result.stop.any()
        got.append(result.codes[order.index(target)])
    np.testing.assert_array_equal(np.stack(got), solo)


@pytest.mark.parametrize("device", DEVICES)
def test_truncate_and_continue_equals_uninterrupted(device, make_runner, golden_cases) -> None:
    """Seek back across the key-bucket boundary: with history and counter restored the frames come out again
    bit-identically (nothing is recomputed), and a new seed branches off."""
    runner = make_runner(device, max_slots=2, max_seq_len=320)
    prompt = _directed(runner, golden_cases, LONG_TEXT)
    slot = runner.alloc_slot()
    runner.prefill(slot, prompt)
    runner.set_sampling(slot, PENALTY, seed=21)
    first = _frames(runner, slot, 40)
    assert runner.slot_length(slot) == len(prompt) + 40 > 256
    for n in (20, 5):  # 20: resumes in the upper key bucket; 5: below 256 keys, crossing the boundary again
        runner.truncate(slot, len(prompt) + n)
        runner.set_sampling(slot, PENALTY, seed=21, frame_index=n, history=first[:n])
        assert runner.slot_frame_index(slot) == n
        np.testing.assert_array_equal(_frames(runner, slot, 40 - n), first[n:], err_msg=f"seek to {n}")
    runner.truncate(slot, len(prompt) + 5)
    runner.set_sampling(slot, PENALTY, seed=22, frame_index=5, history=first[:5])
    assert not np.array_equal(_frames(runner, slot, 10), first[5:15])


@pytest.mark.parametrize("device", DEVICES)
def test_batched_prefill_equals_prefilling_each_slot_alone(device, make_runner, golden_cases) -> None:
    """Three prompts of different lengths, one of them re-prefilled from a nonzero start after a truncate, in
    ONE eager backbone pass vs one by one: same caches (bit for bit on the CPU; on CUDA to float rounding, as
    GEMM kernels may depend on the row count) and the same sampled codes with penalty through the graphs."""
    runs = []
    for batched in (False, True):
        runner = make_runner(device, max_slots=4, max_seq_len=320)
        prompts = [
            _directed(runner, golden_cases),
            runner.build_prompt(text=TEXTS[3]),
            _directed(runner, golden_cases, LONG_TEXT),
        ]
        slots = [runner.alloc_slot() for _ in range(3)]
        runner.prefill(slots[2], prompts[0])  # an earlier take in slot 2, cut back to 40 positions
        runner.truncate(slots[2], 40)
        requests = [
            PrefillRequest(slots[0], prompts[0]),
            PrefillRequest(slots[1], prompts[1]),
            PrefillRequest(slots[2], prompts[2][40:], start=40),
        ]
        if batched:
            assert runner.prefill_batch(requests) == 1
        else:
            for req in requests:
                runner.prefill(req.slot, req.rows, start=req.start)
        for i, s in enumerate(slots):
            runner.set_sampling(s, PENALTY, seed=60 + i)
        lengths = [runner.slot_length(s) for s in slots]
        assert lengths == [len(prompts[0]), len(prompts[1]), len(prompts[2])]
        caches = [
            (lambda k, v, h: (k, h))(*runner.slot_cache(s, n))
            for s, n in zip(slots, lengths, strict=True)
        ]
        codes = np.stack([runner.step(slots).codes for _ in range(12)], axis=1)
        runs.append((caches, codes))
    (alone_caches, alone_codes), (batch_caches, batch_codes) = runs
    for (k_a, h_a), (k_b, h_b) in zip(alone_caches, batch_caches, strict=True):
        if device == "cpu":
            assert torch.equal(k_a, k_b) and torch.equal(h_a, h_b)
        else:
            torch.testing.assert_close(k_b, k_a, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(h_b, h_a, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(batch_codes, alone_codes)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_sampler_draws_the_torch_samplers_codes(device, make_runner, golden_cases, monkeypatch) -> None:
    """The same takes through the graphs with the fused sampling kernel and with MOSS_RT_FUSED_SAMPLER=0 (the torch
    path): equal codes and presence history, frame by frame, with penalties (the kernel marks the presence bits) and
    slots that sit steps out. Top-p is off here: with it on, a draw may differ where the top-p mass lands within
    float32 summation rounding of p (tests/model/test_fused_sampling.py checks that case row by row). On the CPU
    both runs take the torch path."""
    params = [
        SamplingParams(text_temperature=0.0, audio_temperature=0.0, audio_repetition_penalty=1.3),
        SamplingParams(text_temperature=0.0, audio_top_p=1.0, audio_repetition_penalty=1.1),  # 1.7 / top-k 25
        SamplingParams(text_temperature=0.0, audio_temperature=0.8, audio_top_k=0, audio_top_p=1.0,
                       audio_repetition_penalty=2.0),
    ]
    runs = []
    for mode in ("1", "0"):
        monkeypatch.setenv("MOSS_RT_FUSED_SAMPLER", mode)
        assert _uses_the_fused_sampler(device) == (device == "cuda" and mode == "1")
        runner = make_runner(device, max_slots=4, max_seq_len=320)
        prompt = _directed(runner, golden_cases, LONG_TEXT)
        slots = [runner.alloc_slot() for _ in params]
        for i, s in enumerate(slots):
            runner.prefill(s, prompt[: len(prompt) - 5 * i])
            runner.set_sampling(s, params[i], seed=70 + i)
        frames: dict[int, list[np.ndarray]] = {s: [] for s in slots}
        for t in range(24):
            stepped = [0, 1, 2] if t % 4 else [2, 0]
            result = runner.step(stepped)
            assert not result.stop.any()
            for s, codes in zip(stepped, result.codes, strict=True):
                frames[s].append(codes)
        runs.append(({s: np.stack(v) for s, v in frames.items()}, runner.state.presence[:3].cpu()))
    (fused, fused_presence), (plain, plain_presence) = runs
    for s in fused:
        np.testing.assert_array_equal(fused[s], plain[s], err_msg=f"slot {s}")
    assert torch.equal(fused_presence, plain_presence)


@pytest.mark.parametrize("device", DEVICES)
def test_lone_prompt_prefill_through_a_graph_equals_eager(device, make_runner, golden_cases) -> None:
    """A fresh prompt alone is prefilled through a prefill graph (padded to its 256-row bucket) once warmup has
    captured them: the cache equals the eager pass's to float rounding and the sampled codes that follow are the
    same. The CPU has no graphs: both runs are eager there (the body's own logic still runs)."""
    runs = []
    for graphs in (True, False):
        options = {"use_cuda_graphs": graphs} if device == "cuda" else {}
        runner = make_runner(device, max_slots=2, max_seq_len=320, **options)
        runner.warmup(batch_sizes=[1], key_lengths=[256])
        prompt = _directed(runner, golden_cases, LONG_TEXT)
        assert 128 < len(prompt) <= 256
        slot = runner.alloc_slot()
        runner.prefill(slot, prompt)
        assert runner.prefill_graphs.replays == (1 if graphs and device == "cuda" else 0)
        assert runner.slot_length(slot) == len(prompt)
        runner.set_sampling(slot, PENALTY, seed=5)
        cache = runner.slot_cache(slot, len(prompt))
        codes = np.stack([runner.step([slot]).codes[0] for _ in range(16)])
        runs.append((cache, codes))
    (graph_cache, graph_codes), (eager_cache, eager_codes) = runs
    for x, y in zip(graph_cache, eager_cache, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(graph_codes, eager_codes)


# (start, rows) of a piece after a kept prefix, on the 320-position runner (row buckets 128 and 256, one key window
# of 320): bucket edges (1, 127, 128, 129, 256 rows), a line after its opening, block-aligned starts (no copy on
# write) and unaligned ones (the shared branch block copied first).
PREFIX_CASES = [(1, 1), (37, 127), (40, 128), (16, 129), (150, 160), (60, 256)]


@pytest.mark.parametrize("device", DEVICES)
def test_prompt_after_a_cached_prefix_through_a_graph_equals_eager(device, make_runner, golden_cases) -> None:
    """A lone piece continuing a kept prefix (start > 0: a line whose opening the prompt cache shares) is prefilled
    through an after-a-prefix prefill graph once warmup has captured them: its keys, values and hidden states equal
    the eager pass's to float rounding, nothing else in the pool changes (the slot's prefix, the kept blocks, the
    slot's positions past the piece: piece_after_prefix checks), and the sampled codes that follow are the same.
    The CPU has no graphs: both runs are eager there (tests/model/test_prefill_graphs.py runs the graph's own pass
    on the CPU)."""
    from tests.model.test_prefill_graphs import piece_after_prefix

    runs = []
    for graphs in (True, False):
        options = {"use_cuda_graphs": graphs} if device == "cuda" else {}
        runner = make_runner(device, max_slots=2, max_seq_len=320, **options)
        runner.warmup(batch_sizes=[1], key_lengths=[256])
        # One key window at 320 positions: every lone piece's graph captured by warmup (batched ones wait for idle).
        assert all(shape.pieces > 1 for shape in runner.pending_prefill_graphs())
        prompt = _directed(runner, golden_cases, LONG_TEXT)
        rows = np.resize(prompt, (320, prompt.shape[1]))  # the prompt's rows repeated: valid rows
        caches, codes = [], []
        for start, count in PREFIX_CASES:
            replays = runner.prefill_graphs.replays
            slot = piece_after_prefix(runner, rows, start, count)
            assert runner.prefill_graphs.replays - replays == (1 if graphs and device == "cuda" else 0)
            caches.append(runner.slot_cache(slot, start + count))
            if start + count + 8 <= runner.max_seq_len:
                runner.set_sampling(slot, PENALTY, seed=start)
                codes.append(np.stack([runner.step([slot]).codes[0] for _ in range(8)]))
            runner.free_slot(slot)
        runs.append((caches, codes))
    (graph_caches, graph_codes), (eager_caches, eager_codes) = runs
    for (start, count), graph_cache, eager_cache in zip(PREFIX_CASES, graph_caches, eager_caches, strict=True):
        for name, x, y in zip(("keys", "values", "hidden"), graph_cache, eager_cache, strict=True):
            where = f"{name} of {count} rows after {start}"
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5, msg=lambda m, w=where: f"{w}: {m}")
    assert len(graph_codes) == len(eager_codes) == len(PREFIX_CASES) - 1
    for x, y in zip(graph_codes, eager_codes, strict=True):
        np.testing.assert_array_equal(x, y)


# Pieces of one batched pass (start, rows) on the 320-position runner: a render's short lines after the cast's
# opening with one fresh piece, two mid-window pieces, and a pass of fresh prompts.
BATCH_PREFIX_CASES = [[(220, 30), (200, 33), (16, 1), (0, 40)], [(37, 64), (250, 12)], [(0, 30), (0, 64), (0, 5)]]


@pytest.mark.parametrize("device", DEVICES)
def test_a_batched_prefill_pass_through_a_graph_equals_eager(device, make_runner, golden_cases) -> None:
    """A pass of several short pieces (a render's lines after their cached opening, fresh prompts together) replays
    a batched prefill graph once it is captured (they are captured while idle: capture_next here): every piece's keys,
    values and hidden states equal the eager pass's to float rounding, nothing else in the pool changes
    (pieces_after_prefixes checks), and each slot's codes after it are the same. The CPU has no graphs: both runs are
    eager there (tests/model/test_prefill_graphs.py runs the graph's own pass on the CPU)."""
    from tests.model.test_prefill_graphs import pieces_after_prefixes

    runs = []
    for graphs in (True, False):
        options = {"use_cuda_graphs": graphs} if device == "cuda" else {}
        runner = make_runner(device, max_slots=8, max_seq_len=320, **options)
        runner.warmup(batch_sizes=[1], key_lengths=[256])
        while runner.pending_prefill_graphs():
            runner.capture_next()
        prompt = _directed(runner, golden_cases, LONG_TEXT)
        rows = np.resize(prompt, (320, prompt.shape[1]))
        caches, codes = [], []
        for cases in BATCH_PREFIX_CASES:
            replays = runner.prefill_graphs.replays
            slots = pieces_after_prefixes(runner, rows, cases)
            assert runner.prefill_graphs.replays - replays == (1 if graphs and device == "cuda" else 0)
            ends = [start + count for start, count in cases]
            caches.append([runner.slot_cache(slot, end) for slot, end in zip(slots, ends, strict=True)])
            for slot, (start, _) in zip(slots, cases, strict=True):
                runner.set_sampling(slot, PENALTY, seed=start)
            codes.append(np.stack([np.stack(runner.step(slots).codes) for _ in range(6)]))
            for slot in slots:
                runner.free_slot(slot)
        runs.append((caches, codes))
    (graph_caches, graph_codes), (eager_caches, eager_codes) = runs
    for cases, graph_pass, eager_pass in zip(BATCH_PREFIX_CASES, graph_caches, eager_caches, strict=True):
        for (start, count), graph_cache, eager_cache in zip(cases, graph_pass, eager_pass, strict=True):
            for name, x, y in zip(("keys", "values", "hidden"), graph_cache, eager_cache, strict=True):
                where = f"{name} of {count} rows after {start} in {cases}"
                torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5, msg=lambda m, w=where: f"{w}: {m}")
    for x, y in zip(graph_codes, eager_codes, strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("device", DEVICES)
def test_a_packed_pass_after_prefixes_writes_what_the_masked_pass_writes(device, golden_cases, monkeypatch) -> None:
    """MOSS_RT_PACKED_PREFILL: a pass of pieces after openings of different lengths, attended packed end to end
    (on CUDA flash attention's variable-length forward, bf16, eagerly and through its batched prefill graph; on the CPU
    the reference path, fp32, one padded pass) writes the keys, values and hidden states the masked pass writes, to
    the dtype's rounding, and nothing else in the pool (pieces_after_prefixes checks)."""
    from moss_rt.model import load_model
    from tests.model.conftest import TINY
    from tests.model.test_prefill_graphs import pieces_after_prefixes

    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    loaded = load_model(TINY, device=device, dtype=dtype)
    results = {}
    for packed in ("0", "1" if cuda else "interpret"):
        monkeypatch.setenv("MOSS_RT_PACKED_PREFILL", packed)
        for graphs in (False, True) if cuda else (False,):
            runner = ModelRunner(loaded.model, loaded.tokenizer, loaded.config, max_slots=8, max_seq_len=320,
                                 device=device, dtype=dtype, use_cuda_graphs=graphs)
            runner.per_slot_eager = False  # one padded pass, as on CUDA
            if graphs:
                runner.warmup(batch_sizes=[1], key_lengths=[256])
                while runner.pending_prefill_graphs():
                    runner.capture_next()
            prompt = _directed(runner, golden_cases, LONG_TEXT)
            rows = np.resize(prompt, (320, prompt.shape[1]))
            caches = []
            for cases in BATCH_PREFIX_CASES[:2]:  # both with pieces after a prefix
                replays = runner.prefill_graphs.replays
                slots = pieces_after_prefixes(runner, rows, cases)
                assert runner.prefill_graphs.replays - replays == (1 if graphs else 0)
                caches.append([runner.slot_cache(s, start + count) for s, (start, count) in zip(slots, cases,
                                                                                                strict=True)])
                for slot in slots:
                    runner.free_slot(slot)
            results[(packed, graphs)] = caches
    reference = results[("0", False)]
    for key, caches in results.items():
        for got_pass, want_pass in zip(caches, reference, strict=True):
            for got_cache, want_cache in zip(got_pass, want_pass, strict=True):
                for x, y in zip(got_cache, want_cache, strict=True):
                    if cuda:  # bf16: flash and the memory-efficient kernel round differently
                        error = float((x.float() - y.float()).norm() / y.float().norm().clamp(min=1e-6))
                        assert error < 2e-2, (key, error)
                    else:
                        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)
