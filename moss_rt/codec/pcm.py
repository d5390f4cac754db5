"""Codec audio to int16 PCM on the decoder's device: one conversion and one copy to the host per batched call.

Why: the streaming path copied each stream's float32 audio to the host separately (a synchronous copy per stream,
padding rows of a graphed call included) and converted it with numpy on the codec thread, which holds the GIL
through several passes per chunk: at 64 streams that was about a fifth of the codec thread's time, beside the
engine thread. Here the batch is converted where it was made and half the bytes cross to the host, once.

The result is ``audio.to_int16_pcm``'s, bit for bit: the same float32 operations in the same order (the mean of
two channels is a single add and an exact halving; round half to even; NaN to 0, +-inf to +-1; clip).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["int16_pcm"]


def int16_pcm(audio: Sequence[torch.Tensor], channels: Sequence[int]) -> list[bytes]:
    """``audio[i]`` float ``[2, S]`` (equal S) → int16 little-endian bytes, mono (the channel mean) or interleaved
    stereo as ``channels[i]`` (1 or 2) says, like ``audio.to_int16_pcm``."""
    if len(audio) != len(channels):
        raise ValueError(f"{len(audio)} streams but {len(channels)} channel counts")
    bad = [c for c in channels if c not in (1, 2)]
    if bad:
        raise ValueError(f"channels must be 1 or 2, got {bad[0]}")
    if not audio:
        return []
    batch = torch.stack([a.float() for a in audio])  # [B, 2, S]
    if batch.dim() != 3 or batch.shape[1] != 2:
        raise ValueError(f"expected [2, S] audio per stream, got {tuple(batch.shape[1:])}")
    out: list[bytes] = [b""] * len(audio)
    for count in (1, 2):
        rows = [i for i, c in enumerate(channels) if c == count]
        if not rows:
            continue
        x = batch[rows] if len(rows) < len(audio) else batch
        mixed = x.mean(dim=1) if count == 1 else x.transpose(1, 2).reshape(len(rows), -1)
        mixed = torch.nan_to_num(mixed, nan=0.0, posinf=1.0, neginf=-1.0)
        pcm = torch.round(mixed * 32767.0).clamp_(-32768, 32767).to(torch.int16)
        host = pcm.cpu().numpy().astype("<i2", copy=False)
        for j, i in enumerate(rows):
            out[i] = host[j].tobytes()
    return out
