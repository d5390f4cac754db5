"""Config parsing: real key names, window sizes per stage, overrides, refusals."""

from __future__ import annotations

import copy

import pytest

from moss_rt.codec.config import CodecConfig, CodecConfigError, PatchSpec, TransformerSpec
from moss_rt.codec.tiny import full_size_config, tiny_config


def _contexts(stages: tuple) -> list[int]:
    return [s.context for s in stages if isinstance(s, TransformerSpec)]


def test_full_size_windows_and_rates() -> None:
    cfg = CodecConfig.from_dict(full_size_config(10.0))
    assert cfg.sampling_rate == 48000 and cfg.downsample_rate == 3840 and cfg.interleave_factor == 2
    assert cfg.frame_rate == 12.5
    # Encoder stages run at 400, 200, 100, 50, 25, 12.5 Hz; decoder the reverse.
    assert _contexts(cfg.encoder) == [4000, 2000, 1000, 500, 250, 125]
    assert _contexts(cfg.decoder) == [125, 250, 500, 1000, 2000, 4000]
    assert cfg.tokens_per_frame_decoder == [1, 2, 4, 8, 16, 32]
    assert isinstance(cfg.decoder[-1], PatchSpec) and cfg.decoder[-1].patch_size == 240
    q = cfg.quantizer
    assert (q.input_dim, q.rvq_dim, q.output_dim, q.num_quantizers, q.codebook_size, q.codebook_dim) == (
        768, 512, 768, 32, 1024, 8,
    )


def test_tiny_windows() -> None:
    cfg = CodecConfig.from_dict(tiny_config(0.16))
    assert _contexts(cfg.decoder) == [2, 4, 8, 16, 32, 64]


def test_per_stage_context_duration_override() -> None:
    raw = tiny_config(0.16)
    raw["decoder_kwargs"][0]["context_duration"] = 0.8  # 12.5 Hz * 0.8 s = 10 tokens
    cfg = CodecConfig.from_dict(raw)
    assert _contexts(cfg.decoder) == [10, 4, 8, 16, 32, 64]


def test_legacy_aliases() -> None:
    raw = tiny_config()
    raw["sample_rate"] = raw.pop("sampling_rate")
    raw["channels_numbers"] = raw.pop("number_channels")
    cfg = CodecConfig.from_dict(raw)
    assert cfg.sampling_rate == 48000 and cfg.number_channels == 2


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda c: c.pop("number_channels"), "v1"),
        (lambda c: c["decoder_kwargs"][0].update(gating="silu"), "gating"),
        (lambda c: c["decoder_kwargs"][0].update(positional_embedding="sin"), "positional_embedding"),
        (lambda c: c["decoder_kwargs"][0].update(causal=False), "causal"),
        (lambda c: c["decoder_kwargs"][2].update(input_dimension=21), "input_dimension"),
        (lambda c: c["quantizer_kwargs"].update(quantizer_type="rvq"), "quantizer_type"),
        (lambda c: c["encoder_kwargs"][0].update(patch_size=120), "invert|patch product"),
        (lambda c: c.pop("decoder_kwargs"), "malformed"),
    ],
)
def test_unsupported_configs_are_refused(mutate, match: str) -> None:
    raw = copy.deepcopy(tiny_config())
    mutate(raw)
    with pytest.raises(CodecConfigError, match=match):
        CodecConfig.from_dict(raw)
