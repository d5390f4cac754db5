"""The start-up memory plan: a pure function checked with fake free-memory figures, and as the service shows it."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import requests
import torch

from moss_rt.client import DirectingClient
from moss_rt.engine.memory_plan import (
    DEFAULT_CPU_SEQ_LEN,
    DEFAULT_CPU_SLOTS,
    GIB,
    KEPT_CACHE_HEADROOM,
    MIB,
    PLANNED_TAKE_POSITIONS,
    MemoryCosts,
    MemoryPlanError,
    plan_memory,
)
from tests.engine.helpers import LONG, metrics
from tests.helpers import next_message, run

# Full-size figures: bf16 backbone (36 layers x 8 KV heads x 128 x K,V + 2560 hidden), a 10 s codec window.
FULL = MemoryCosts(
    bytes_per_position=(2 * 36 * 8 * 128 + 2560) * 2,
    slot_bytes=12 * 1024 + 224,
    codec_bytes_per_stream=380 * MIB,
    codec_extra_streams=3,
    work_bytes=int(2.5 * GIB),
    work_bytes_per_slot=8 * MIB,
)
WEIGHTS = 13 * GIB  # model + codec + CUDA context


def card(total_gib: float, **kw: object):  # type: ignore[no-untyped-def]
    total = int(total_gib * GIB)
    return plan_memory(FULL, device="cuda:0", total_bytes=total, free_bytes=total - WEIGHTS, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("total_gib", [24, 40, 48, 80, 139])
def test_plan_fits_the_budget_and_uses_most_of_it(total_gib: float) -> None:
    plan = card(total_gib)
    assert plan.source == "measured" and plan.max_slots >= 1 and plan.max_seq_len == DEFAULT_CPU_SEQ_LEN
    assert plan.in_use_bytes == WEIGHTS
    assert plan.budget_bytes == int(0.9 * total_gib * GIB) - WEIGHTS
    assert plan.planned_bytes <= plan.budget_bytes
    assert plan.unplanned_bytes < 16 * FULL.bytes_per_position  # less than one block is left over
    # The pool holds every slot at the planned take length (it is shared: one take may grow much longer).
    assert plan.kv_positions >= plan.max_slots * PLANNED_TAKE_POSITIONS
    assert plan.backbone_cache_bytes >= plan.kv_positions * FULL.bytes_per_position


def test_bigger_cards_hold_more_takes() -> None:
    slots = [card(g).max_slots for g in (24, 48, 80, 139)]
    assert slots == sorted(slots) and slots[0] < slots[-1]
    assert card(24).max_slots >= 4 and card(80).max_slots >= 64  # the device proof is in bench/RESULTS.md


def test_utilization_bounds_the_plan() -> None:
    assert card(80, utilization=0.5).max_slots < card(80, utilization=0.9).max_slots
    with pytest.raises(MemoryPlanError, match="utilization"):
        card(80, utilization=1.5)


def test_flags_win_when_given() -> None:
    plan = card(80, max_slots=4, max_seq_len=1024)
    assert (plan.max_slots, plan.max_seq_len) == (4, 1024)
    assert (plan.slots_from, plan.seq_len_from) == ("flag", "flag")
    only_len = card(80, max_seq_len=8192)
    assert only_len.max_seq_len == 8192 and only_len.slots_from == "plan"
    assert only_len.max_slots == card(80).max_slots  # the cap of one take reserves nothing
    only_slots = card(80, max_slots=8)
    assert only_slots.max_slots == 8 and only_slots.max_seq_len == DEFAULT_CPU_SEQ_LEN
    assert only_slots.kv_blocks > card(80).kv_blocks  # fewer codec streams: a bigger pool


def test_both_flags_size_the_pool_to_them_and_leave_the_rest_of_the_card_free() -> None:
    plan = card(139, max_slots=8, max_seq_len=256)
    # 8 takes at their cap (257 positions = 17 blocks of 16), a copy-on-write block each, the kept-cache
    # headroom and the scratch block: not the ~100 GiB the budget would allow.
    running = 8 * 17
    assert plan.kv_blocks == running + 8 + int(KEPT_CACHE_HEADROOM * running + 0.999) + 1
    assert plan.kv_positions >= 8 * 257
    assert plan.unplanned_bytes > 50 * GIB  # another engine (a test, a replica) fits beside it
    # Two such engines on one card: the second plans from what the first left free and still fits.
    first_total = plan.planned_bytes + WEIGHTS
    total = int(139 * GIB)
    second = plan_memory(FULL, device="cuda:0", total_bytes=total, free_bytes=total - first_total - WEIGHTS,
                         max_slots=8, max_seq_len=256)
    assert second.kv_blocks == plan.kv_blocks
    # The budget still bounds it: a small card gets what fits, or the plan says what to change.
    with pytest.raises(MemoryPlanError, match="--max-seq-len"):
        card(24, max_slots=8, max_seq_len=10_000_000)


def test_a_small_card_gets_shorter_takes_before_none() -> None:
    plan = card(19.6)  # room for one take of ~1000 positions, not for a planned slot's 1280
    assert plan.max_slots == 1 and 512 <= plan.max_seq_len < PLANNED_TAKE_POSITIONS


def test_a_plan_that_cannot_hold_one_take_fails_saying_what_to_change() -> None:
    with pytest.raises(MemoryPlanError) as err:
        card(15)  # 13.5 GiB usable, 13 GiB already held by the weights
    text = str(err.value)
    assert "cannot hold" in text and "GiB" in text and "--gpu-memory-utilization" in text
    with pytest.raises(MemoryPlanError, match="--max-slots"):
        card(24, max_slots=500)


def test_cpu_plan_comes_from_the_settings() -> None:
    plan = plan_memory(FULL, device="cpu", total_bytes=None, free_bytes=None)
    assert (plan.max_slots, plan.max_seq_len, plan.source) == (DEFAULT_CPU_SLOTS, DEFAULT_CPU_SEQ_LEN, "settings")
    given = plan_memory(FULL, device="cpu", total_bytes=None, free_bytes=None, max_slots=3, max_seq_len=300)
    assert (given.max_slots, given.max_seq_len) == (3, 300)
    assert given.kv_blocks == 3 * 19 + 1  # every slot at its cap (301 positions in blocks of 16) + scratch
    assert given.backbone_cache_bytes == 58 * 16 * FULL.bytes_per_position + 3 * FULL.slot_bytes
    assert "memory plan" in given.table() and "backbone KV cache" in given.table()


def test_the_service_shows_its_plan_and_admits_by_it(moss_server) -> None:  # type: ignore[no-untyped-def]
    srv = moss_server(max_slots=0, max_seq_len=0, max_queue=1)  # the plan chooses (CPU: from the settings)
    info = requests.get(srv.url + "/api/info", timeout=10).json()
    plan = info["memory_plan"]
    assert plan["source"] == "settings" and plan["max_slots"] == DEFAULT_CPU_SLOTS
    assert info["details"]["max_slots"] == str(DEFAULT_CPU_SLOTS)
    assert plan["codec_state_dtype"] == "bf16" and info["details"]["codec_state_dtype"].startswith("bf16 (auto")
    figures = run(metrics(srv))
    assert figures["moss_rt_memory_plan_slots"] == DEFAULT_CPU_SLOTS
    assert figures['moss_rt_memory_plan_bytes{part="backbone_cache"}'] == plan["backbone_cache_bytes"]


def test_admission_refuses_beyond_the_planned_slots_and_queue(moss_server) -> None:  # type: ignore[no-untyped-def]
    srv = moss_server(max_slots=1, max_queue=1, max_takes_per_client=0)

    async def scenario() -> list[str]:
        async with (
            DirectingClient.connect(srv.ws_url) as a,
            DirectingClient.connect(srv.ws_url) as b,
            DirectingClient.connect(srv.ws_url) as c,
        ):
            await a.start("Hello there, a longer take.", max_new_tokens=300, **LONG)
            await next_message(a, "start")  # a holds the one slot
            await b.start("Hello there, a longer take.", max_new_tokens=5, **LONG)
            for _ in range(2000):  # until b waits in the one queue place
                if srv.engine.queued_count >= 1:
                    break
                await asyncio.sleep(0.01)
            await c.start("Hello.", max_new_tokens=2)
            refused = await next_message(c, "error")
            ends = [(await x.collect()).end["reason"] for x in (a, b)]  # one ran, one waited, both end
            return [str(refused.code), *ends]

    assert run(scenario()) == ["busy", "max_frames", "max_frames"]


def test_codec_scratch_blocks_are_planned() -> None:
    import dataclasses

    total = 80 * GIB
    base = plan_memory(FULL, device="cuda:0", total_bytes=total, free_bytes=total - WEIGHTS, max_slots=32)
    costs = dataclasses.replace(FULL, codec_fixed_bytes=40 * MIB)
    plan = plan_memory(costs, device="cuda:0", total_bytes=total, free_bytes=total - WEIGHTS, max_slots=32)
    assert plan.codec_state_bytes == base.codec_state_bytes + 40 * MIB
    assert plan.planned_bytes <= plan.budget_bytes


# fp8 codec state: about 53% of bf16's bytes per stream (head_dim 64: 1 byte a value + a 4-byte scale per 64).
FULL8 = dataclasses.replace(FULL, codec_fp8_bytes_per_stream=FULL.codec_bytes_per_stream * 68 // 128)


def test_auto_codec_state_stays_bf16_unless_max_slots_needs_fp8() -> None:
    total = 139 * GIB
    h200 = {"device": "cuda:0", "total_bytes": total, "free_bytes": total - WEIGHTS}
    chosen = plan_memory(FULL8, **h200)  # the plan chooses the slots: never fp8 on its own
    assert chosen.codec_state_dtype == "bf16" and "plan chooses" in chosen.codec_state_reason
    fits = chosen.max_slots
    asked = plan_memory(FULL8, **h200, max_slots=fits)
    assert asked.codec_state_dtype == "bf16" and f"--max-slots {fits} fits" in asked.codec_state_reason
    more = plan_memory(FULL8, **h200, max_slots=fits + 40)
    assert more.codec_state_dtype == "fp8" and f"{fits} slots bf16" in more.codec_state_reason
    assert more.codec_state_bytes < asked.codec_state_bytes  # 40 more streams in less codec memory
    assert more.kv_positions >= more.max_slots * PLANNED_TAKE_POSITIONS  # each take still fits its planned length
    assert more.planned_bytes <= more.budget_bytes
    assert ("codec state dtype", f"fp8 ({more.codec_state_reason})") in more.rows()
    assert more.as_dict()["codec_state_dtype"] == "fp8"
    # Without fp8 figures (a codec that offers none), on a CPU: bf16.
    assert plan_memory(FULL, **h200, max_slots=fits + 40).codec_state_dtype == "bf16"
    assert plan_memory(FULL8, device="cpu", total_bytes=None, free_bytes=None).codec_state_dtype == "bf16"


def test_codec_state_dtype_setting_is_kept_and_checked() -> None:
    total = 80 * GIB
    card80 = {"device": "cuda:0", "total_bytes": total, "free_bytes": total - WEIGHTS}
    bf16, fp8 = (plan_memory(FULL8, **card80, codec_state_dtype=d) for d in ("bf16", "fp8"))
    assert (bf16.codec_state_dtype, fp8.codec_state_dtype) == ("bf16", "fp8")
    assert fp8.codec_state_reason == "set by --codec-state-dtype"
    assert fp8.max_slots > bf16.max_slots  # the plan fits more takes with the smaller state
    over = bf16.max_slots + 10
    assert plan_memory(FULL8, **card80, max_slots=over, codec_state_dtype="bf16").codec_state_dtype == "bf16"
    with pytest.raises(MemoryPlanError, match="--codec-state-dtype fp8"):  # the advice offers the smaller state
        plan_memory(FULL8, **card80, max_slots=500, codec_state_dtype="bf16")
    with pytest.raises(MemoryPlanError, match="--codec-state-dtype"):
        plan_memory(FULL8, **card80, codec_state_dtype="int8")
    with pytest.raises(MemoryPlanError, match="fp8 is not available"):
        plan_memory(FULL, **card80, codec_state_dtype="fp8")


def test_the_service_decodes_with_the_codec_state_dtype_it_planned(moss_server) -> None:  # type: ignore[no-untyped-def]
    srv = moss_server(max_slots=1, max_queue=1, codec_state_dtype="fp8")
    info = requests.get(srv.url + "/api/info", timeout=10).json()
    assert info["memory_plan"]["codec_state_dtype"] == "fp8"
    assert info["details"]["codec_state_dtype"] == "fp8 (set by --codec-state-dtype)"
    assert srv.engine._decoder.state_dtype == torch.float8_e4m3fn

    async def take() -> tuple[str, int]:
        async with DirectingClient.connect(srv.ws_url) as c:
            await c.start("Hello there.", max_new_tokens=6, **LONG)
            result = await c.collect()
            return str(result.end["reason"]), len(result.pcm)

    reason, samples = run(take())
    assert reason == "max_frames" and samples > 0
