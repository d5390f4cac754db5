"""The CTC network's forward, our own, over a loaded ``Wav2Vec2ForCTC``'s weights: fixed shapes, no host work, so a
CUDA graph can capture it (:mod:`moss_rt.align.ctc_graphs`).

The Hugging Face forward cannot be captured: building its attention mask asks the device whether any frame is padded
(``padding_mask.all()``, a host sync), padded frames are zeroed by boolean indexing, and the positional
convolution's weight norm is recomputed on every call. Here, for the same network:

- the input is the raw audio ``[rows, samples]`` (float32) and each row's length in samples; normalising each row
  over its own samples (zero mean, unit variance, as the checkpoint's feature extractor asks) and zeroing the
  padding happen on the device, so the host only copies the audio in;
- the convolutions run channels-last (a ``Conv1d`` as a ``[rows, channels, 1, time]`` 2-D convolution whose memory is
  ``[rows, time, channels]``): the feature encoder's layer norms over channels and the transformer read that memory
  as it is, with none of the transposes and ``.contiguous()`` copies the module stack makes; the feature encoder
  runs a few rows at a time (its first convolution's output is the biggest tensor of the whole pass);
- padded frames are masked by length (``arange < frames``) and attention is PyTorch's SDPA with a key mask;
- the positional convolution's weight norm is applied once, here;
- the log-softmax (float32) is part of the pass.

Checkpoints with a feature adapter (``add_adapter``) are not covered (:func:`unsupported` says why): the aligner then
runs the Hugging Face module eagerly. The result equals the module's own forward (tests/align/test_ctc_net.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

# The feature encoder runs at most FEATURE_CHUNK_SAMPLES input samples at once (moss_rt.align.memory: why, how much).
from moss_rt.align.memory import FEATURE_CHUNK_SAMPLES

NORM_EPS = 1e-7  # the feature extractor's normalisation (transformers' Wav2Vec2FeatureExtractor)


def unsupported(config: Any) -> str | None:
    """Why :class:`CtcNet` cannot run this checkpoint (None: it can)."""
    if getattr(config, "add_adapter", False):
        return "it has a feature adapter (add_adapter)"
    if config.feat_extract_norm not in ("layer", "group"):
        return f"feat_extract_norm {config.feat_extract_norm!r}"
    if not isinstance(config.hidden_act, str) or not isinstance(config.feat_extract_activation, str):
        return "its activations are not named"
    return None


@dataclass
class _Conv:
    weight: torch.Tensor  # [out, in, 1, kernel], channels-last
    bias: torch.Tensor | None
    stride: int
    norm: str  # "layer" (over channels), "group" (each channel over time), "" (none)
    norm_weight: torch.Tensor | None
    norm_bias: torch.Tensor | None
    norm_eps: float


def _as_2d_weight(conv: torch.nn.Conv1d) -> torch.Tensor:
    return conv.weight.detach().unsqueeze(2).contiguous(memory_format=torch.channels_last)


def _conv_time_major(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: int,
                     padding: int = 0, groups: int = 1) -> torch.Tensor:  # fmt: skip
    """A 1-D convolution of ``x`` [rows, time, channels] (time-major, channels last), answering the same layout:
    the 2-D convolution of its ``[rows, channels, 1, time]`` view, which is channels-last memory already."""
    out = F.conv2d(x.transpose(1, 2).unsqueeze(2), weight, bias, (1, stride), (0, padding), 1, groups)
    return out.squeeze(2).transpose(1, 2)


class CtcNet:
    """``Wav2Vec2ForCTC``'s forward from its weights (which it shares, not copies; the positional convolution's
    weight-normed weight is the one tensor it makes). Call it under ``torch.inference_mode()``."""

    def __init__(self, model: Any) -> None:
        from transformers.activations import ACT2FN

        config = model.config
        why = unsupported(config)
        if why is not None:
            raise ValueError(f"CtcNet cannot run this checkpoint: {why}")
        w2v = model.wav2vec2
        self.dtype = model.lm_head.weight.dtype
        self.masked = config.feat_extract_norm == "layer"  # "group" checkpoints are run without a mask (HF's rule)
        self.kernels = [int(k) for k in config.conv_kernel]
        self.strides = [int(s) for s in config.conv_stride]
        self.feat_act: Callable[[torch.Tensor], torch.Tensor] = ACT2FN[config.feat_extract_activation]
        self.act: Callable[[torch.Tensor], torch.Tensor] = ACT2FN[config.hidden_act]
        self.convs: list[_Conv] = []
        for layer in w2v.feature_extractor.conv_layers:
            norm = getattr(layer, "layer_norm", None)
            kind = "" if norm is None else ("group" if isinstance(norm, torch.nn.GroupNorm) else "layer")
            self.convs.append(_Conv(
                _as_2d_weight(layer.conv), layer.conv.bias, int(layer.conv.stride[0]), kind,
                None if norm is None else norm.weight, None if norm is None else norm.bias,
                0.0 if norm is None else float(norm.eps),
            ))  # fmt: skip
        proj = w2v.feature_projection
        self.proj_norm, self.proj = proj.layer_norm, proj.projection
        encoder = w2v.encoder
        pos = encoder.pos_conv_embed
        self.pos_weight = pos.conv.weight.detach().unsqueeze(2).contiguous(memory_format=torch.channels_last)
        self.pos_bias = pos.conv.bias
        self.pos_padding = int(pos.conv.padding[0])
        self.pos_groups = int(pos.conv.groups)
        self.pos_trim = pos.padding.num_pad_remove
        self.stable = bool(config.do_stable_layer_norm)  # pre-norm layers, the encoder's norm after them
        self.encoder_norm = encoder.layer_norm
        self.layers = list(encoder.layers)
        self.heads = int(config.num_attention_heads)
        self.lm_head = model.lm_head

    def frames(self, samples: torch.Tensor) -> torch.Tensor:
        """Emission frames of inputs of ``samples`` samples (the convolutions' output length; 0 when too short)."""
        for kernel, stride in zip(self.kernels, self.strides, strict=True):
            samples = torch.div(samples - kernel, stride, rounding_mode="floor") + 1
        return samples.clamp(min=0)

    def __call__(self, audio: torch.Tensor, lengths: torch.Tensor, *, normalize: bool = True) -> torch.Tensor:
        """Log-probabilities [rows, frames, vocabulary] (float32) of ``audio`` [rows, samples] (float32, any values
        past a row's length) whose rows hold ``lengths`` [rows] samples."""
        rows, samples = audio.shape
        valid = torch.arange(samples, device=audio.device) < lengths[:, None]
        x = torch.where(valid, audio, 0.0)
        if normalize:
            count = lengths.clamp(min=1).to(torch.float32)[:, None]
            mean = x.sum(dim=1, keepdim=True) / count
            centred = torch.where(valid, x - mean, 0.0)
            var = centred.square().sum(dim=1, keepdim=True) / count
            x = centred * torch.rsqrt(var + NORM_EPS)
        x = x.to(self.dtype)
        chunk = max(1, FEATURE_CHUNK_SAMPLES // max(1, samples))
        if chunk >= rows:
            features = self._features(x)
        else:
            features = torch.cat([self._features(x[i : i + chunk]) for i in range(0, rows, chunk)])
        hidden = F.linear(self.proj_norm(features), self.proj.weight, self.proj.bias)
        frames = hidden.shape[1]
        mask: torch.Tensor | None = None
        if self.masked:
            # At least one frame a row: a row with none would attend to nothing (NaN); its emissions are dropped.
            keep = torch.arange(frames, device=audio.device) < self.frames(lengths).clamp(min=1)[:, None]
            hidden = hidden * keep[:, :, None].to(hidden.dtype)
            mask = keep[:, None, None, :]  # [rows, 1, 1, keys]: a padded frame is no key
        pos = _conv_time_major(hidden, self.pos_weight, self.pos_bias, 1, self.pos_padding, self.pos_groups)
        if self.pos_trim:
            pos = pos[:, : pos.shape[1] - self.pos_trim]
        hidden = hidden + self.feat_act(pos)
        if not self.stable:
            hidden = self.encoder_norm(hidden)
        for layer in self.layers:
            hidden = self._layer(layer, hidden, mask)
        if self.stable:
            hidden = self.encoder_norm(hidden)
        return torch.log_softmax(self.lm_head(hidden).float(), dim=-1)

    def _features(self, x: torch.Tensor) -> torch.Tensor:
        """The feature encoder: [rows, samples] → [rows, frames, channels]."""
        h = x[:, :, None]  # [rows, time, 1 channel]
        for conv in self.convs:
            h = _conv_time_major(h, conv.weight, conv.bias, conv.stride)
            if conv.norm == "layer":
                h = F.layer_norm(h, h.shape[-1:], conv.norm_weight, conv.norm_bias, conv.norm_eps)
            elif conv.norm == "group":  # one group per channel: each channel normalised over time
                assert conv.norm_weight is not None and conv.norm_bias is not None  # GroupNorm(affine=True)
                hf = h.float()
                mean = hf.mean(dim=1, keepdim=True)
                var = hf.var(dim=1, unbiased=False, keepdim=True)
                h = ((hf - mean) * torch.rsqrt(var + conv.norm_eps)).to(h.dtype) * conv.norm_weight + conv.norm_bias
            h = self.feat_act(h)
        return h

    def _layer(self, layer: Any, hidden: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if self.stable:
            hidden = hidden + self._attention(layer.attention, layer.layer_norm(hidden), mask)
            hidden = hidden + self._feed_forward(layer.feed_forward, layer.final_layer_norm(hidden))
            adapter = getattr(layer, "adapter_layer", None)
            if adapter is not None:  # MMS language adapters
                a = F.linear(adapter.norm(hidden), adapter.linear_1.weight, adapter.linear_1.bias)
                hidden = hidden + F.linear(torch.relu(a), adapter.linear_2.weight, adapter.linear_2.bias)
            return hidden
        hidden = layer.layer_norm(hidden + self._attention(layer.attention, hidden, mask))
        out: torch.Tensor = layer.final_layer_norm(hidden + self._feed_forward(layer.feed_forward, hidden))
        return out

    def _attention(self, attn: Any, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        rows, frames, width = x.shape
        shape = (rows, frames, self.heads, width // self.heads)
        q = F.linear(x, attn.q_proj.weight, attn.q_proj.bias).view(shape).transpose(1, 2)
        k = F.linear(x, attn.k_proj.weight, attn.k_proj.bias).view(shape).transpose(1, 2)
        v = F.linear(x, attn.v_proj.weight, attn.v_proj.bias).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scaling)
        return F.linear(out.transpose(1, 2).reshape(rows, frames, width), attn.out_proj.weight, attn.out_proj.bias)

    def _feed_forward(self, ff: Any, x: torch.Tensor) -> torch.Tensor:
        h = self.act(F.linear(x, ff.intermediate_dense.weight, ff.intermediate_dense.bias))
        return F.linear(h, ff.output_dense.weight, ff.output_dense.bias)
