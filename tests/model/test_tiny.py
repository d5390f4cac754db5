"""The tiny random checkpoint writer and the make-tiny / say CLI commands."""

from __future__ import annotations

import json

import numpy as np
import torch
from transformers import PreTrainedTokenizerFast

from moss_rt.model import load_model
from moss_rt.model.commands import MakeTiny, SayCodes, make_tiny_command, say_codes_command
from moss_rt.model.prompt import encode_text
from moss_rt.model.tiny import TINY_SPECIAL_TOKENS, build_random_model, tiny_config, write_tiny_checkpoint


def test_writer_is_deterministic_per_seed(tmp_path):
    a = write_tiny_checkpoint(tmp_path / "a", seed=0)
    b = write_tiny_checkpoint(tmp_path / "b", seed=0)
    c = write_tiny_checkpoint(tmp_path / "c", seed=1)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_text() == (c / "tokenizer.json").read_text()


def test_in_memory_random_model_equals_the_written_checkpoint(tmp_path):
    # What the benchmarks build instead of writing (and reading) a full-size checkpoint.
    written = load_model(write_tiny_checkpoint(tmp_path / "t", seed=3)).model.state_dict()
    built = build_random_model(tiny_config(), seed=3).state_dict()
    assert written.keys() == built.keys()
    assert all(torch.equal(written[k], built[k]) for k in written)


def test_tokenizer_special_ids_and_text_ids(tiny, tmp_path):
    cfg = tiny.config
    for name, (tid, text) in TINY_SPECIAL_TOKENS.items():
        assert getattr(cfg, name) == tid
        assert tiny.tokenizer.token_to_id(text) == tid
    ids = encode_text(tiny.tokenizer, "Héllo — 你好 <user_inst>\n- Text:")
    assert ids and max(ids) < cfg.pad_token_id
    # the transformers fast tokenizer (what upstream uses) agrees
    folder = write_tiny_checkpoint(tmp_path / "t")
    hf = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    assert hf.encode("Héllo — 你好 <|im_start|>x", add_special_tokens=False) == encode_text(
        tiny.tokenizer, "Héllo — 你好 <|im_start|>x"
    )


def test_stop_head_is_biased_to_continue_for_a_few_seconds(tiny, make_runner):
    """Per-frame stop probability ~1.6 % (median take ~3.5 s at 12.5 frames/s), never ~50 %."""
    runner = make_runner(max_slots=1)
    slot = runner.alloc_slot()
    rows = runner.build_prompt(text="The night is long, and the stars are listening.", instruction="Softly.")
    runner.prefill(slot, rows)
    hidden = runner.slot_cache(slot, len(rows))[2]  # backbone outputs the local transformer may see
    codes = torch.randint(0, 1024, (len(rows), 12), generator=torch.Generator().manual_seed(0))
    stop, _ = tiny.model.teacher_forced_local(hidden, codes)
    p_stop = torch.softmax(stop, dim=-1)[:, 1]
    assert 0.008 < float(p_stop.median()) < 0.03
    assert float(p_stop.max()) < 0.06
    assert (stop[:, 0] > stop[:, 1]).all()  # greedy never stops


def test_make_tiny_and_say_commands(tmp_path, capsys):
    assert make_tiny_command(MakeTiny(dir=tmp_path / "m", seed=0, dtype="bf16")) == 0
    assert json.loads((tmp_path / "m" / "config.json").read_text())["model_type"] == "moss_tts_local"
    outs = []
    for name in ("a", "b"):
        args = SayCodes(
            model=str(tmp_path / "m"),
            text="Hello there.",
            instruction="",
            language="",
            reference="none",
            seed=5,
            tokens=None,
            temperature=0.0,
            max_new_tokens=12,
            codes_out=tmp_path / f"{name}.npy",
            device="cpu",
            codec=None,
            output=None,
            channels=1,
        )
        assert say_codes_command(args) == 0
        outs.append(np.load(tmp_path / f"{name}.npy"))
    assert outs[0].shape == (12, 12) and outs[0].dtype == np.int64
    np.testing.assert_array_equal(outs[0], outs[1])
    assert "12 frames" in capsys.readouterr().out
    assert load_model(tmp_path / "m").model.transformer.norm.weight.dtype == torch.float32
