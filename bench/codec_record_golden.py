"""Record golden outputs of the UPSTREAM MOSS-Audio-Tokenizer-v2 code on a codec folder.

Run OUTSIDE the test suite, with the upstream module importable from a folder outside this
repository (see docs/codec_golden.md). This file holds no upstream code: it imports it.

    python bench/codec_record_golden.py --upstream /work/ref/codec/refpkg \
        tests/fixtures/codec/tiny tests/fixtures/codec/golden_v2_tiny.npz

The upstream copy (vLLM-Omni 0.30.0 ``moss_tts/audio_tokenizer_v2.py`` + its config module) names
weights ``self_attn.in_projs.0`` / ``linear1`` / ``linear2``; its own load hook maps ``in_proj``/
``out_proj``, and ``ffn.0``/``ffn.2`` are renamed here.
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import sys

import numpy as np
import torch
from safetensors.torch import load_file

log = logging.getLogger("codec_record_golden")

DECODE_FRAMES = 12
ENCODE_SAMPLES = 27000  # 0.5625 s: 7 whole frames and a partial one (exercises padding + floor)


def fixed_waveform() -> np.ndarray:
    """Deterministic stereo test signal ``[2, ENCODE_SAMPLES]`` float32 at 48 kHz."""
    t = np.arange(ENCODE_SAMPLES) / 48000.0
    left = 0.5 * np.sin(2 * np.pi * 220.0 * t) + 0.1 * np.sin(2 * np.pi * 3150.0 * t)
    right = 0.4 * np.sin(2 * np.pi * 330.0 * t + 0.3) * np.cos(2 * np.pi * 2.0 * t)
    return np.stack([left, right]).astype(np.float32)


def fixed_codes() -> np.ndarray:
    """Deterministic codes ``[DECODE_FRAMES, 12]`` int64."""
    return np.random.default_rng(1234).integers(0, 1024, size=(DECODE_FRAMES, 12)).astype(np.int64)


def load_upstream(upstream_dir: str, folder: str):  # noqa: ANN201 - upstream type
    sys.path.insert(0, upstream_dir)
    from moss_ref.audio_tokenizer_v2 import MossAudioTokenizerModel
    from moss_ref.configuration_moss_audio_tokenizer_v2 import MossAudioTokenizerConfig

    with open(f"{folder}/config.json", encoding="utf-8") as fh:
        cfg = json.load(fh)
    cfg = {k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype", "model_type")}
    model = MossAudioTokenizerModel(MossAudioTokenizerConfig(**cfg)).eval()
    sd: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(f"{folder}/model-*.safetensors")):
        sd.update(load_file(f))
    mapped = {k.replace(".ffn.0.", ".linear1.").replace(".ffn.2.", ".linear2."): v for k, v in sd.items()}
    missing, unexpected = model.load_state_dict(mapped, strict=False)
    missing = [m for m in missing if not m.startswith("quantizer._decode_lut")]
    if missing or unexpected:
        raise SystemExit(f"weight mismatch: missing={missing[:5]} unexpected={unexpected[:5]}")
    return model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--upstream", required=True, help="folder holding the upstream package moss_ref/")
    ap.add_argument("codec_dir")
    ap.add_argument("out_npz")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO)
    model = load_upstream(args.upstream, args.codec_dir)
    codes = fixed_codes()
    wav = fixed_waveform()
    with torch.no_grad():
        dec = model.decode(torch.from_numpy(codes).T.unsqueeze(1), return_dict=True)  # codes [12, 1, T]
        audio = dec.audio[0].float().numpy()  # [2, T * 3840]
        enc = model.batch_encode([torch.from_numpy(wav)], num_quantizers=12)
        n = int(enc.audio_codes_lengths[0])
        enc_codes = enc.audio_codes[:, 0, :n].T.contiguous().numpy()  # [T, 12]
        enc_hidden = enc.encoder_hidden_states[0, :, :n].T.contiguous().float().numpy()  # [T, D]
    np.savez_compressed(
        args.out_npz,
        codes=codes,
        audio=audio,
        enc_codes=enc_codes,
        enc_hidden=enc_hidden,
        torch_version=np.array(torch.__version__),
    )
    log.info("decode %s peak %.3f; encode %s", audio.shape, float(np.abs(audio).max()), enc_codes.shape)


if __name__ == "__main__":
    main()
