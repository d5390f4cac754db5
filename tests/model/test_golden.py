"""Parity with the upstream reference implementation (fixtures recorded per docs/model_golden.md)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moss_rt.generation import SamplingParams

GREEDY = SamplingParams(audio_temperature=0.0, text_temperature=0.0)


def _prompt(runner, case: dict, golden: dict) -> np.ndarray:
    return runner.build_prompt(
        text=case["text"],
        instruction=case.get("instruction", ""),
        language=case.get("language", ""),
        tokens=case.get("tokens"),
        reference_codes=golden.get(f"reference_{case['name']}"),
        continuation_codes=golden.get(f"continuation_{case['name']}"),
    )


def test_prompt_rows_match_upstream(make_runner, golden, golden_cases):
    runner = make_runner(max_slots=1)
    for case in golden_cases["prompts"]:
        ours = _prompt(runner, case, golden)
        np.testing.assert_array_equal(ours, golden[f"prompt_{case['name']}"], err_msg=case["name"])


def test_teacher_forced_logits_match_upstream(make_runner, tiny, golden, golden_cases):
    tf = golden_cases["teacher_forced"]
    case = next(c for c in golden_cases["prompts"] if c["name"] == tf["prompt"])
    runner = make_runner(max_slots=1)
    prompt = _prompt(runner, case, golden)
    codes = golden[f"greedy_{tf['prompt']}"][: tf["frames"]]
    gen_rows = np.concatenate([np.full((len(codes), 1), tiny.config.audio_assistant_slot_token_id), codes], axis=1)
    slot = runner.alloc_slot()
    runner.prefill(slot, np.concatenate([prompt, gen_rows]))
    hidden = runner.slot_cache(slot, len(prompt) + len(codes))[2]

    def rel(ours: torch.Tensor, ref: np.ndarray) -> float:
        ref_t = torch.from_numpy(ref)
        return float((ours - ref_t).abs().max() / ref_t.abs().max())

    assert rel(hidden, golden["tf_backbone_hidden"]) < 1e-4
    text_logits = tiny.model.text_lm_head(hidden[-4:])
    assert rel(text_logits, golden["tf_text_logits_tail"]) < 1e-4
    first = len(prompt) - 1
    stop, audio = tiny.model.teacher_forced_local(hidden[first : first + len(codes)], torch.from_numpy(codes))
    assert rel(stop, golden["tf_stop_logits"]) < 1e-4
    assert rel(audio, golden["tf_audio_logits"]) < 1e-4


@pytest.mark.parametrize("index", [0, 1, 2])
def test_greedy_codes_match_upstream(make_runner, golden, golden_cases, index):
    spec = golden_cases["greedy"][index]
    case = next(c for c in golden_cases["prompts"] if c["name"] == spec["prompt"])
    runner = make_runner(max_slots=1, max_seq_len=256)
    slot = runner.alloc_slot()
    runner.prefill(slot, _prompt(runner, case, golden))
    runner.set_sampling(slot, GREEDY, seed=0)
    codes = []
    for _ in range(spec["frames"]):
        result = runner.step([slot])
        assert not result.stop[0]
        codes.append(result.codes[0])
    np.testing.assert_array_equal(np.stack(codes), golden[f"greedy_{spec['prompt']}"])
