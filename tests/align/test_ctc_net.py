"""Our own forward of the CTC network (moss_rt/align/ctc_net.py, the one CUDA graphs capture) equals the Hugging Face
module's on tiny random checkpoints of each layout: layer-norm feature encoder with pre-norm layers (MMS), group-norm
encoder with post-norm layers (wav2vec2-base), and MMS language adapters; padded rows and padded samples included."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

from moss_rt.align import ctc_net
from moss_rt.align.ctc import ctc_config
from moss_rt.align.ctc_net import CtcNet, unsupported

LAYOUTS = {
    "mms": {},
    "base": {"feat_extract_norm": "group", "do_stable_layer_norm": False},
    "adapters": {"adapter_attn_dim": 8},
}


def _model(extra: dict[str, Any]) -> Wav2Vec2ForCTC:
    torch.manual_seed(0)
    model = Wav2Vec2ForCTC(Wav2Vec2Config(**{**ctc_config("tiny"), **extra})).eval()
    with torch.no_grad():  # fresh norms are identity and biases zero: shake every tensor so a mix-up shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_our_forward_equals_the_hf_module(layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if layout != "mms":  # the feature encoder two rows at a time (as 16 rows of 6 s go on a GPU)
        monkeypatch.setattr(ctc_net, "FEATURE_CHUNK_SAMPLES", 2 * 24000)
    model = _model(LAYOUTS[layout])
    net = CtcNet(model)
    rng = np.random.default_rng(0)
    lengths = [16000, 23456, 9999, 400]  # 400 samples: a single frame
    samples = 24000
    raw = rng.normal(0, 0.3, (5, samples)).astype(np.float32)  # row 4: a padding row; past each length: junk
    x = np.zeros_like(raw)
    mask = np.zeros(raw.shape, dtype=np.int64)
    for row, n in enumerate(lengths):
        a = raw[row, :n]
        x[row, :n] = (a - a.mean()) / np.sqrt(a.var() + 1e-7)  # what the aligner's eager path feeds the module
        mask[row, :n] = 1
    mask[4, :320] = 1
    with torch.inference_mode():
        kwargs = {"attention_mask": torch.from_numpy(mask)} if model.config.feat_extract_norm == "layer" else {}
        if not kwargs:  # a group-norm checkpoint is run unmasked: padding is zeros, as the eager path pads it
            raw = np.where(mask.astype(bool), raw, 0).astype(np.float32)
        ref = torch.log_softmax(model(torch.from_numpy(x), **kwargs).logits.float(), dim=-1)
        ours = net(torch.from_numpy(raw), torch.tensor([*lengths, samples]))
        frames = model._get_feat_extract_output_lengths(torch.tensor(lengths))
        assert ours.shape == ref.shape and ours.dtype == torch.float32
        assert net.frames(torch.tensor(lengths)).tolist() == frames.tolist()
        for row, n in enumerate(frames.tolist()):
            assert n > 0
            torch.testing.assert_close(ours[row, :n], ref[row, :n], atol=1e-5, rtol=1e-5)


def test_a_feature_adapter_is_left_to_the_hf_module() -> None:
    config = Wav2Vec2Config(**{**ctc_config("tiny"), "add_adapter": True})
    assert unsupported(config) is not None
    assert unsupported(Wav2Vec2Config(**ctc_config("tiny"))) is None
    with pytest.raises(ValueError, match="adapter"):
        CtcNet(Wav2Vec2ForCTC(config))
