"""The fused sampling kernel (moss_rt/model/fused_sampling.py) against the torch path (sampling.py) it replaces.

The checks run on CUDA (marked ``gpu``; skipped without a GPU) and, where Triton is installed and there is no
GPU, on CPU tensors through Triton's interpreter (a subprocess: TRITON_INTERPRET is read when the kernels are
built and must not leak into the session). Without either, both skip.

What "equal" means (fused_sampling.py's docstring): codes equal the torch path's row for row, except that a row
may keep one token more or fewer under top-p when the softmax mass before some sorted position lies within
float32 summation rounding of p (the two paths add the same probabilities in different orders). A mismatching
row passes only if it is such a row: its exact (float64) cumulative mass comes within ``TOP_P_TOL`` of p, and the
kernel's code is what the torch path draws with p moved by ``TOP_P_TOL`` to either side. Greedy rows, rows
without top-p, the uniforms, the presence marks and batch invariance must match exactly.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import pytest
import torch

from moss_rt.model.sampling import (
    apply_repetition_penalty,
    filter_top_k_top_p,
    gumbel,
    sample,
    split_seed,
    token_keys,
    uniforms,
)
from tests.kernels import HAS_TRITON, needs_interpreter, run_interpreted

TOP_P_TOL = 1e-5  # well above the ~1e-6 by which float32 sums of 1024 probabilities in two orders differ
CTR_MUL, CTR_ADD = 13, 7  # the step's counter: frame * (n_vq + 1) + draw

TEMPERATURES = (0.0, 0.3, 1.7)
TOP_KS = (0, 1, 25, 1024)
TOP_PS = (0.0, 0.5, 0.8, 1.0)
PENALTIES = (1.0, 1.1, 2.0)


KINDS = 8


def _logits(
    gen: torch.Generator, kind: int, vocab: int, k: int, penalty: float, presence: torch.Tensor
) -> torch.Tensor:
    """One row of logits of a given kind (ties, signed zeros, peaks...); may edit the row's ``presence``."""
    x = torch.randn(vocab, generator=gen)
    if kind == 0:
        return x * 2
    if kind == 1:  # peaked: most of the mass on a few tokens, many probabilities underflow
        return x * 8
    if kind == 2:  # coarse levels: ties everywhere, including at the k-th value and around the top-p crossing
        return torch.round(x * 3) / 2
    if kind == 3:  # ties exactly at the k-th largest value (ranks k-3 .. k+2 share it)
        x = x * 2
        order = torch.argsort(x, descending=True)
        r = min(max(k, 25), vocab) - 1
        group = order[max(0, r - 2) : r + 3]
        x[group] = float(x[order[r]])
        return x
    if kind == 4:  # signed zeros tie at the maximum (-0.0 == +0.0 for argmax and sort)
        x = -x.abs() - 0.5
        x[torch.randint(0, vocab, (6,), generator=gen)] = 0.0
        x[torch.randint(0, vocab, (6,), generator=gen)] = -0.0
        return x
    if kind == 5:  # several equal maxima
        x = x * 2
        x[torch.randint(0, vocab, (4,), generator=gen)] = x.max() + 1.0
        return x
    if kind == 6 and vocab > 2:  # a penalised maximum ties exactly (IEEE a / penalty) with a later, unpenalised one
        x = x * 2
        a = torch.tensor(float(x.max()) + 1.0)
        i, j = sorted(torch.randperm(vocab, generator=gen)[:2].tolist())
        x[i], x[j] = a, a / penalty
        presence[i], presence[j] = True, False
        return x
    # a few large levels: probability steps of 1/2, 1/8... (top-p crossings inside tie groups)
    x = torch.full((vocab,), -20.0) + x * 0.01
    levels = torch.tensor([4.0, 2.0, 2.0, 2.0, 2.0, 1.0, 1.0, 1.0, 0.0])[:vocab]
    x[torch.randperm(vocab, generator=gen)[: len(levels)]] = levels
    return x


def _cases(rows_per_combo: int, vocab: int = 1024, seed: int = 0) -> dict[str, torch.Tensor]:
    """Rows over every temperature x top-k x top-p x penalty combination, logits kinds and presence densities."""
    gen = torch.Generator().manual_seed(seed)
    combos = list(itertools.product(TEMPERATURES, TOP_KS, TOP_PS, PENALTIES)) * rows_per_combo
    order = torch.randperm(len(combos), generator=gen).tolist()
    combos = [combos[i] for i in order]
    n = len(combos)
    temp = torch.tensor([c[0] for c in combos], dtype=torch.float32)
    top_k = torch.tensor([min(c[1], vocab) for c in combos], dtype=torch.int64)
    top_p = torch.tensor([c[2] for c in combos], dtype=torch.float32)
    penalty = torch.tensor([c[3] for c in combos], dtype=torch.float32)
    density = torch.tensor([0.0, 0.1, 0.5])[torch.randint(0, 3, (n,), generator=gen)]
    presence = torch.rand(n, vocab, generator=gen) < density[:, None]
    logits = torch.stack(
        [_logits(gen, r % KINDS, vocab, int(top_k[r]), float(penalty[r]), presence[r]) for r in range(n)]
    )
    seeds = [split_seed(int(s)) for s in torch.randint(0, 2**62, (n,), generator=gen)]
    seeds[0] = split_seed(2**63 - 1)
    frame = torch.randint(0, 2**40, (n,), generator=gen)  # counters past 2^32: only their low 32 bits count
    return {
        "logits": logits,
        "temperature": temp,
        "top_k": top_k,
        "top_p": top_p,
        "penalty": penalty,
        "presence": presence,
        "seed_lo": torch.tensor([s[0] for s in seeds], dtype=torch.int64),
        "seed_hi": torch.tensor([s[1] for s in seeds], dtype=torch.int64),
        "frame": frame,
        "active": torch.rand(n, generator=gen) < 0.8,
        "stop": torch.randint(0, 2, (n,), generator=gen) * (torch.rand(n, generator=gen) < 0.3),
    }


def _reference(c: dict[str, torch.Tensor]) -> torch.Tensor:
    vocab = c["logits"].shape[1]
    x = apply_repetition_penalty(c["logits"], c["presence"], c["penalty"])
    u = uniforms(c["seed_lo"], c["seed_hi"], c["frame"] * CTR_MUL + CTR_ADD, token_keys(vocab, x.device))
    return sample(x, c["temperature"], c["top_k"], c["top_p"], u)


def _kernel(
    c: dict[str, torch.Tensor], rows_per_program: int, *, penalty: bool = True, mark: bool = False
) -> torch.Tensor:
    from moss_rt.model.fused_sampling import fused_draw

    out = torch.full((c["logits"].shape[0],), -1, dtype=torch.int64, device=c["logits"].device)
    fused_draw(
        out, c["logits"], c["temperature"], c["top_k"], c["top_p"], c["seed_lo"], c["seed_hi"], c["frame"],
        CTR_MUL, CTR_ADD, penalty=c["penalty"] if penalty else None, presence=c["presence"] if penalty else None,
        active=c["active"] if mark else None, stop=c["stop"] if mark else None, rows_per_program=rows_per_program,
    )
    return out


def _top_p_alternatives(c: dict[str, torch.Tensor], row: int) -> set[int]:
    """The codes the torch path's draw gives for every kept prefix that p -/+ TOP_P_TOL allows; empty when the
    row's exact (float64) cumulative mass stays TOP_P_TOL away from p, i.e. no rounding can move the crossing."""
    one = {k: v[row : row + 1].cpu() for k, v in c.items()}
    p, t = float(one["top_p"][0]), float(one["temperature"][0])
    if not (0 < p < 1 and t > 0):
        return set()
    s = apply_repetition_penalty(one["logits"], one["presence"], one["penalty"]) / one["temperature"][:, None]
    order = torch.sort(s[0], descending=True, stable=True).indices
    kept = filter_top_k_top_p(s, one["top_k"], torch.tensor([2.0]))[0] > float("-inf")  # top-k only
    exact = torch.softmax(torch.where(kept, s[0], float("-inf"))[order].double(), dim=0).cumsum(0)
    if not bool(((exact - p).abs() < TOP_P_TOL).any()):
        return set()
    counts = [
        int((filter_top_k_top_p(s, one["top_k"], torch.tensor([p + d * TOP_P_TOL]))[0] > float("-inf")).sum())
        for d in (-1, 1)
    ]
    vocab = s.shape[1]
    u = uniforms(one["seed_lo"], one["seed_hi"], one["frame"] * CTR_MUL + CTR_ADD, token_keys(vocab, s.device))
    noisy = (s + gumbel(u))[0]
    codes = set()
    for n in range(counts[0], counts[1] + 1):
        prefix = order[:n]
        best = noisy[prefix].max()
        codes.add(int(prefix[noisy[prefix] == best].min()))  # torch.argmax's first index
    return codes


def check_draws(
    device: str, rows_per_combo: int, rows_per_program: int, *, vocab: int = 1024, seed: int = 0, penalty: bool = True
) -> dict[str, Any]:
    """The kernel's codes (and presence marks) vs the torch path over every parameter combination."""
    c = {k: v.to(device) for k, v in _cases(rows_per_combo, vocab, seed).items()}
    if not penalty:  # the stop head's draw: no repetition penalty
        c["presence"] = torch.zeros_like(c["presence"])
    n = c["logits"].shape[0]
    before = c["presence"].clone()
    got = _kernel(c, rows_per_program, penalty=penalty, mark=penalty)
    ref = _reference(dict(c, presence=before))
    if penalty:  # exactly the drawn code's bit is set, in rows that are active and did not stop
        produced = c["active"] & (c["stop"] != 1)
        expected = before.clone()
        expected[torch.arange(n, device=device)[produced], got[produced]] = True
        assert torch.equal(c["presence"], expected), "presence marks"
    c["presence"] = before
    bad = (got != ref).nonzero()[:, 0].tolist()
    for row in bad:  # only a top-p decision within summation rounding of p may differ
        alternatives = _top_p_alternatives(c, row)
        assert int(got[row]) in alternatives, (
            f"vocab {vocab} row {row}: kernel {int(got[row])} != torch {int(ref[row])} "
            f"(top-p alternatives {alternatives}; t={float(c['temperature'][row])} k={int(c['top_k'][row])} "
            f"p={float(c['top_p'][row])} penalty={float(c['penalty'][row])})"
        )
    greedy = c["temperature"] <= 0
    assert torch.equal(got[greedy], ref[greedy])
    assert len(bad) <= max(2, n // 100), f"{len(bad)} of {n} rows differ at a top-p boundary"
    return {"vocab": vocab, "rows": n, "top_p_boundary_mismatches": len(bad)}


def check_batch_invariance(device: str, rows_per_program: int) -> None:
    """A row's code does not depend on the other rows (subsets, shuffled order, one row alone, one row a program)."""
    c = {k: v.to(device) for k, v in _cases(1, seed=3).items()}
    n = c["logits"].shape[0]
    full = _kernel(c, rows_per_program)
    gen = torch.Generator().manual_seed(4)
    for size in (n // 6, 5, 1):
        pick = torch.randperm(n, generator=gen)[:size].to(device)
        sub = {k: v[pick].contiguous() for k, v in c.items()}
        assert torch.equal(_kernel(sub, rows_per_program), full[pick]), size
        assert torch.equal(_kernel(sub, 1), full[pick]), size


def check_small_vocabs(device: str, rows_per_program: int) -> list[dict[str, Any]]:
    """The stop head's draw (vocab 2, no penalty), a tiny vocab and a padded one (1000 -> 1024)."""
    return [
        check_draws(device, 8, rows_per_program, vocab=2, seed=2, penalty=False),
        check_draws(device, 2, rows_per_program, vocab=3, seed=3),
        check_draws(device, 1, rows_per_program, vocab=1000, seed=4),
    ]


def check_noise(device: str) -> None:
    """Uniforms equal bit for bit; the Gumbel noise too on CUDA (libdevice logf == torch's), to 1 ulp elsewhere."""
    from moss_rt.model.fused_sampling import fused_uniforms

    c = {k: v.to(device) for k, v in _cases(1, seed=5).items()}
    c = {k: v[:40] for k, v in c.items()}
    for vocab in (1024, 2, 1000):
        ref = uniforms(c["seed_lo"], c["seed_hi"], c["frame"] * CTR_MUL + CTR_ADD, token_keys(vocab, device))
        u = fused_uniforms(c["seed_lo"], c["seed_hi"], c["frame"], CTR_MUL, CTR_ADD, vocab)
        assert torch.equal(u, ref), vocab
        g = fused_uniforms(c["seed_lo"], c["seed_hi"], c["frame"], CTR_MUL, CTR_ADD, vocab, gumbel=True)
        if device == "cuda":
            assert torch.equal(g, gumbel(ref)), vocab
        else:
            torch.testing.assert_close(g, gumbel(ref), rtol=3e-7, atol=3e-7)


def check_steps_equal_the_torch_path(frames: int = 6) -> None:
    """Takes stepped through ``frame_step`` with the kernel == with the torch path: codes, stops and the presence
    history the penalty reads (marked in the kernel vs scattered by the bookkeeping), batched as the CUDA graphs
    are (rows [0,B), some sitting a step out). CPU through the interpreter (MOSS_RT_FUSED_SAMPLER=interpret)."""
    import numpy as np

    from moss_rt.generation import SamplingParams
    from moss_rt.model import ModelRunner, load_model
    from tests.model.conftest import TINY

    loaded = load_model(TINY, device="cpu", dtype=torch.float32)
    params = [
        SamplingParams(text_temperature=0.0, audio_temperature=0.0, audio_repetition_penalty=1.3),
        SamplingParams(audio_repetition_penalty=1.1),  # sampled stop head, 1.7 / 25 / 0.8
        SamplingParams(audio_repetition_penalty=2.0, audio_top_k=0, audio_top_p=0.5),
    ]
    texts = ["Hello there.", "Get out!", "Why not?"]
    runs = []
    for mode in ("0", "interpret"):
        os.environ["MOSS_RT_FUSED_SAMPLER"] = mode
        runner = ModelRunner(loaded.model, loaded.tokenizer, loaded.config, max_slots=4, max_seq_len=320,
                             device="cpu", dtype=torch.float32, cpu_batch_invariant=False)
        slots = [runner.alloc_slot() for _ in params]
        for s, p, text in zip(slots, params, texts, strict=True):
            runner.prefill(s, runner.build_prompt(text=text))
            runner.set_sampling(s, p, seed=10 + s)
        out = []
        for f in range(frames):
            result = runner.step(slots if f % 3 else [slots[2], slots[0]])  # slot 1 sits some steps out
            out.append((result.codes.copy(), result.stop.copy()))
        runs.append((out, runner.state.presence[: len(slots)].clone()))
    (ref, ref_presence), (got, presence) = runs
    for f, ((codes, stop), (ref_codes, ref_stop)) in enumerate(zip(got, ref, strict=True)):
        np.testing.assert_array_equal(codes, ref_codes, err_msg=f"frame {f}")
        np.testing.assert_array_equal(stop, ref_stop, err_msg=f"frame {f}")
    assert ref_stop.any() or any(s.any() for _, s in ref[:-1]), "no take stopped: the stop path went untested"
    assert torch.equal(presence, ref_presence)




@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_fused_sampler_equals_the_torch_path_on_cuda() -> None:
    check_noise("cuda")
    check_draws("cuda", rows_per_combo=40, rows_per_program=1)  # 5760 rows
    check_batch_invariance("cuda", rows_per_program=1)
    check_small_vocabs("cuda", rows_per_program=1)


_SCRIPT = r"""
import torch
from tests.model.test_fused_sampling import (
    check_batch_invariance, check_draws, check_noise, check_small_vocabs, check_steps_equal_the_torch_path
)
torch.set_num_threads(1)
check_noise("cpu")
summary = [check_draws("cpu", rows_per_combo=16, rows_per_program=64)]  # 2304 rows
check_batch_invariance("cpu", rows_per_program=16)  # also: one row a program (the GPU's launch) == 16 rows
summary += check_small_vocabs("cpu", rows_per_program=16)
check_steps_equal_the_torch_path()
print("ok", summary)
"""


@needs_interpreter
def test_fused_sampler_equals_the_torch_path_through_the_interpreter() -> None:
    run_interpreted(_SCRIPT, "MOSS_RT_FUSED_SAMPLER")


def test_the_cpu_keeps_the_torch_path() -> None:
    from moss_rt.model.fused_sampling import available

    if os.environ.get("MOSS_RT_FUSED_SAMPLER") == "interpret":
        pytest.skip("the interpreter mode runs the kernel on CPU on purpose")
    assert not available(torch.zeros(1, 4))


def test_the_switch_turns_the_kernel_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from moss_rt.model.fused_sampling import available

    monkeypatch.setenv("MOSS_RT_FUSED_SAMPLER", "0")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not available(torch.zeros(1, 4))
