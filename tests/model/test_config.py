"""config.json parsing: real field names, upstream defaults, clear rejections."""

from __future__ import annotations

import copy
import json

import pytest

from moss_rt.model.config import ConfigError, MossTTSConfig
from moss_rt.model.tiny import full_config, tiny_config
from tests.model.conftest import TINY


@pytest.fixture
def raw() -> dict:
    return json.loads((TINY / "config.json").read_text())


def test_tiny_config_file_parses_to_the_writer_config(raw):
    assert MossTTSConfig.from_dict(raw) == tiny_config()
    assert MossTTSConfig.from_file(TINY) == tiny_config()


def test_round_trip_of_full_config():
    cfg = full_config()
    assert MossTTSConfig.from_dict(json.loads(json.dumps(cfg.to_json()))) == cfg
    assert cfg.backbone.head_dim * cfg.backbone.num_attention_heads == 4096


def test_language_config_is_an_alias_for_qwen3_config(raw):
    alt = copy.deepcopy(raw)
    alt["language_config"] = alt.pop("qwen3_config")
    alt["language_config"]["hidden_size"] = 64
    assert MossTTSConfig.from_dict(alt).backbone == tiny_config().backbone


def test_local_rope_base_defaults_to_upstream_10000_when_absent(raw):
    alt = copy.deepcopy(raw)
    del alt["gpt2_config"]["rope_base"]
    assert MossTTSConfig.from_dict(alt).local.rope_base == 10000.0
    assert MossTTSConfig.from_dict(raw).local.rope_base == 1e6


def test_backbone_rope_theta_from_rope_parameters_or_default(raw):
    alt = copy.deepcopy(raw)
    del alt["qwen3_config"]["rope_theta"]
    assert MossTTSConfig.from_dict(alt).backbone.rope_theta == 1e6
    alt["qwen3_config"]["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e5}
    assert MossTTSConfig.from_dict(alt).backbone.rope_theta == 5e5


def test_local_transformer_layers_overrides_gpt2_n_layer(raw):
    alt = copy.deepcopy(raw)
    alt["local_transformer_layers"] = 2
    assert MossTTSConfig.from_dict(alt).local.n_layer == 2


def test_gen_slot_and_pad_code_aliases(raw):
    alt = copy.deepcopy(raw)
    alt["audio_assistant_gen_slot_token_id"] = 1999
    alt["audio_pad_code"] = 2000
    cfg = MossTTSConfig.from_dict(alt)
    assert cfg.audio_assistant_slot_token_id == 1999 and cfg.audio_pad_token_id == 2000


def test_null_head_mode_means_full_vocab_like_upstream(raw):
    alt = copy.deepcopy(raw)
    alt["local_text_head_mode"] = None
    assert MossTTSConfig.from_dict(alt).local_text_head_mode == "full_vocab"
    alt["local_text_head_mode"] = "Full-Vocab"
    assert MossTTSConfig.from_dict(alt).local_text_head_mode == "full_vocab"


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("gpt2_config", "n_embd"), 32, "n_embd=32 must equal the backbone hidden_size=64"),
        (("audio_pad_token_id",), 1000, "audio_pad_token_id=1000 must be outside the audio vocab"),
        (("audio_pad_code",), 5, "must be outside the audio vocab"),
        (("local_text_head_mode",), "ternary", "local_text_head_mode='ternary' is unknown"),
        (("gpt2_config", "position_embedding_type"), "absolute", "position_embedding_type='absolute'"),
        (("gpt2_config", "activation_function"), "relu6", "activation_function='relu6'"),
        (("qwen3_config", "num_key_value_heads"), 3, "multiple of num_key_value_heads=3"),
        (("qwen3_config", "head_dim"), 23, "head_dim must be positive and even"),
        (("audio_end_token_id",), 4096, "audio_end_token_id=4096 is outside the text vocab"),
        (("n_vq",), "twelve", "n_vq must be an integer"),
        (("audio_codebook_sizes",), [1024] * 11, "audio_codebook_sizes must be a list of n_vq=12"),
    ],
)
def test_inconsistent_values_are_rejected_with_a_clear_message(raw, path, value, message):
    alt = copy.deepcopy(raw)
    target = alt
    for key in path[:-1]:
        target = target[key]
    if path[-1] == "audio_pad_token_id":
        alt.pop("audio_pad_code", None)
    target[path[-1]] = value
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        MossTTSConfig.from_dict(alt)


def test_missing_or_broken_file(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        MossTTSConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(ConfigError, match="not valid JSON"):
        MossTTSConfig.from_file(tmp_path)
