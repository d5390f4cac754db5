"""Sampling rules against hand-computed distributions, and the counter-based RNG."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from moss_rt.model.sampling import (
    apply_repetition_penalty,
    filter_top_k_top_p,
    filtered_distribution,
    fmix32,
    sample,
    split_seed,
    token_keys,
    uniforms,
)

NEG = float("-inf")


def _filter(scores: list[float], k: int, p: float) -> list[float]:
    out = filter_top_k_top_p(torch.tensor([scores]), torch.tensor([k]), torch.tensor([p]))
    return out[0].tolist()


def test_top_k_keeps_ties_at_threshold():
    assert _filter([3.0, 1.0, 3.0, 2.0], 1, 1.0) == [3.0, NEG, 3.0, NEG]
    assert _filter([3.0, 1.0, 2.0, 2.0], 2, 1.0) == [3.0, NEG, 2.0, 2.0]


@pytest.mark.parametrize("k", [0, -1, 4, 10])
def test_top_k_disabled_outside_1_to_vocab_minus_1(k):
    assert _filter([3.0, 1.0, 2.0, 0.5], k, 1.0) == [3.0, 1.0, 2.0, 0.5]


def test_top_p_keeps_smallest_prefix_including_crossing_token():
    logits = [math.log(x) for x in (0.5, 0.3, 0.15, 0.05)]
    # cumulative 0.5, 0.8, ...: 0.5 < 0.7 so the crossing token (0.3) is kept, the rest dropped
    kept = _filter(logits, 0, 0.7)
    assert [v != NEG for v in kept] == [True, True, False, False]
    # p below the top token's mass keeps exactly the top token
    assert [v != NEG for v in _filter(logits, 0, 0.2)] == [True, False, False, False]
    # unsorted input: the filter maps back to the original positions
    shuffled = [logits[2], logits[0], logits[3], logits[1]]
    assert [v != NEG for v in _filter(shuffled, 0, 0.7)] == [False, True, False, True]


@pytest.mark.parametrize("p", [1.0, 0.0, 1.5])
def test_top_p_only_active_strictly_between_0_and_1(p):
    logits = [math.log(x) for x in (0.5, 0.3, 0.15, 0.05)]
    assert all(v != NEG for v in _filter(logits, 0, p))


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    # top-k=3 renormalises (0.4,0.3,0.2) -> (4/9,3/9,2/9); cumulative 0.444, 0.778 -> p=0.7 keeps 2.
    logits = [math.log(x) for x in (0.4, 0.3, 0.2, 0.1)]
    assert [v != NEG for v in _filter(logits, 3, 0.7)] == [True, True, False, False]
    # without top-k the cumulative is 0.4, 0.7, 0.9: 0.7 is not > 0.7, so the third survives too
    assert [v != NEG for v in _filter(logits, 0, 0.75)] == [True, True, True, False]


def test_repetition_penalty_divides_positive_multiplies_negative():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0]])
    presence = torch.tensor([[True, True, False, False]])
    out = apply_repetition_penalty(logits, presence, torch.tensor([2.0]))
    assert out.tolist() == [[1.0, -4.0, 1.0, -1.0]]
    same = apply_repetition_penalty(logits, presence, torch.tensor([1.0]))
    assert torch.equal(same, logits)


def test_filtered_distribution_hand_computed_chain():
    # penalty 2 on token 0 (logit 2 -> 1), temperature 0.5, top-k 3, top-p 0.9
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.0]])
    presence = torch.tensor([[True, False, False, False]])
    probs = filtered_distribution(logits, 0.5, 3, 0.9, presence=presence, penalty=2.0)
    scaled = torch.tensor([2.0, 3.0, 2.0, 0.0])  # (1, 1.5, 1, 0) / 0.5
    # top-k 3 keeps 3.0 and both 2.0 (tie at the threshold); top-p over those:
    e = torch.exp(scaled[:3] - 3.0)
    p = e / e.sum()  # sorted: token1 0.576, then 0.212, 0.212 -> cum 0.576, 0.788 < 0.9, third kept
    expected = torch.tensor([p[0], p[1], p[2], 0.0])
    assert torch.allclose(probs[0], expected, atol=1e-6)


def test_greedy_when_temperature_zero_uses_penalised_argmax():
    logits = torch.tensor([[5.0, 4.0, 1.0]])
    presence = torch.tensor([[True, False, False]])
    pen = apply_repetition_penalty(logits, presence, torch.tensor([2.0]))  # 5 -> 2.5: token 1 wins
    u = torch.rand(1, 3)
    out = sample(pen, torch.tensor([0.0]), torch.tensor([50]), torch.tensor([1.0]), u)
    assert out.tolist() == [1]


def test_draws_follow_the_filtered_distribution():
    torch.manual_seed(0)
    vocab, draws = 6, 40000
    logits = torch.tensor([1.0, 0.2, -0.5, 0.8, 2.0, -1.0])
    temp, k, p = 0.9, 4, 0.9
    expected = filtered_distribution(logits[None], temp, k, p)[0]
    keys = token_keys(vocab, torch.device("cpu"))
    seeds = torch.full((draws,), 7, dtype=torch.int64)
    u = uniforms(seeds, torch.zeros_like(seeds), torch.arange(draws), keys)
    batch = logits.expand(draws, -1)
    got = sample(batch, torch.full((draws,), temp), torch.full((draws,), k), torch.full((draws,), p), u)
    freq = torch.bincount(got, minlength=vocab).float() / draws
    assert torch.all(freq[expected == 0] == 0)
    # 4 sigma of a binomial proportion at 40000 draws is < 0.01
    assert torch.allclose(freq, expected, atol=0.01), (freq, expected)


def _fmix32_reference(x: int) -> int:
    m = 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & m
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & m
    return x ^ (x >> 16)


def test_hash_is_exact_32_bit_arithmetic_without_int64_overflow():
    values = [0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0xDEADBEEF, 123456789]
    got = fmix32(torch.tensor(values, dtype=torch.int64)).tolist()
    assert got == [_fmix32_reference(v) for v in values]


def test_uniforms_are_a_pure_function_of_seed_counter_token():
    keys = token_keys(1024, torch.device("cpu"))
    lo, hi = split_seed(2**63 - 1)
    seeds_lo = torch.tensor([lo, 5, lo], dtype=torch.int64)
    seeds_hi = torch.tensor([hi, 0, hi], dtype=torch.int64)
    counters = torch.tensor([3, 3, 3], dtype=torch.int64)
    u = uniforms(seeds_lo, seeds_hi, counters, keys)
    alone = uniforms(seeds_lo[:1], seeds_hi[:1], counters[:1], keys)
    assert torch.equal(u[0], alone[0]) and torch.equal(u[0], u[2])
    assert not torch.equal(u[0], u[1])
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    big = uniforms(torch.tensor([1]), torch.tensor([0]), torch.tensor([10**6]), keys)
    assert abs(float(big.mean()) - 0.5) < 0.05


def test_split_seed_rejects_out_of_range():
    with pytest.raises(ValueError):
        split_seed(-1)
    with pytest.raises(ValueError):
        split_seed(2**63)


def _reference_keep(scores: list[float], k: int, p: float) -> list[bool]:
    """The upstream rules written out per row with plain Python (distinct scores, so no tie ambiguity)."""
    vocab = len(scores)
    keep = [True] * vocab
    if 0 < k < vocab:
        kth = sorted(scores, reverse=True)[k - 1]
        keep = [s >= kth for s in scores]
    if 0 < p < 1:
        order = sorted((i for i in range(vocab) if keep[i]), key=lambda i: -scores[i])
        top = max(scores[i] for i in order)
        weights = [math.exp(scores[i] - top) for i in order]
        total, mass = sum(weights), 0.0
        survivors = set()
        for i, w in zip(order, weights, strict=True):
            if mass > p:
                break
            survivors.add(i)
            mass += w / total
        keep = [i in survivors for i in range(vocab)]
    return keep


@settings(max_examples=150, deadline=None)
@given(
    scores=st.lists(st.floats(-8, 8, allow_nan=False), min_size=2, max_size=24, unique=True),
    k=st.integers(-1, 30),
    p=st.one_of(st.just(0.0), st.floats(1e-6, 1.2)),  # per-row p is float32 (see set_sampling)
)
def test_filter_matches_a_plain_reading_of_the_rules(scores, k, p):
    ordered = sorted(scores)
    assume(min(b - a for a, b in zip(ordered, ordered[1:], strict=False)) > 1e-4)  # no float32 ties
    got = _filter(scores, k, p)
    expected = _reference_keep(scores, k, p)
    # float32 cumulative sums may differ from Python's float64 right at the threshold
    if 0 < p < 1:
        assume(all(abs(c - p) > 1e-5 for c in _cumulative(scores, k)))
    assert [v != NEG for v in got] == expected, (scores, k, p)


def _cumulative(scores: list[float], k: int) -> list[float]:
    vocab = len(scores)
    kept = sorted(scores, reverse=True)
    if 0 < k < vocab:
        kept = kept[:k]
    top = kept[0]
    weights = [math.exp(s - top) for s in kept]
    total = sum(weights)
    out, acc = [], 0.0
    for w in weights:
        acc += w / total
        out.append(acc)
    return out
