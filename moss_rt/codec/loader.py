"""Load MOSS-Audio-Tokenizer-v2 from a local folder or a Hugging Face hub id.

Layout (the real checkpoint's): ``config.json`` plus either ``model.safetensors`` or shards listed in
``model.safetensors.index.json`` (``{"weight_map": {key: shard_file}}``). Keys are the real ones
(section 6.2 of the internals doc); weight-normed quantizer convs are folded here, once.

Weights are read as fp32. ``compute_dtype=torch.bfloat16`` then stores the transformer linears in
bf16 for compute (LayerNorm/LayerScale/quantizer stay fp32). ``decode_only=True`` never reads the
encoder or the quantizer's encode-side tensors, and keeps only the first ``decode_levels`` levels.
"""

from __future__ import annotations

import json
import logging
import os
from collections import defaultdict
from pathlib import Path

import torch

from moss_rt.meta_init import materialize
from moss_rt.safetensors_read import TensorEntry, TensorFileError, free_pinned_cache, read_header, read_into

from .config import CodecConfig
from .model import DEFAULT_DECODE_LEVELS, CodecModel
from .quantizer import fold_weight_norm

__all__ = ["CodecLoadError", "DEFAULT_CODEC_REPO", "load_codec", "resolve_codec_dir", "read_checkpoint_keys"]

log = logging.getLogger(__name__)

DEFAULT_CODEC_REPO = "OpenMOSS-Team/MOSS-Audio-Tokenizer-v2"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_WN_G = ".parametrizations.weight.original0"
_WN_V = ".parametrizations.weight.original1"


class CodecLoadError(RuntimeError):
    """The codec checkpoint is missing, incomplete, or does not match its config."""


def resolve_codec_dir(name_or_path: str | os.PathLike[str], *, revision: str | None = None) -> Path:
    """A local folder as is; otherwise download ``name_or_path`` from the hub (progress bars on,
    ``HF_HUB_OFFLINE=1`` honoured: then only the local cache is used)."""
    p = Path(name_or_path)
    if p.is_dir():
        return p
    if p.exists() or str(name_or_path).startswith((".", "/")):
        raise CodecLoadError(f"codec path {str(name_or_path)!r} is not a directory")
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:  # pragma: no cover - dependency is pinned
        raise CodecLoadError("huggingface_hub is required to download the codec") from exc
    log.info("fetching codec %s from the Hugging Face hub (or its local cache)", name_or_path)
    try:
        local = snapshot_download(
            repo_id=str(name_or_path),
            revision=revision,
            allow_patterns=["*.json", "*.safetensors"],
        )
    except Exception as exc:  # huggingface_hub raises many types (offline, 404, auth, network)
        raise CodecLoadError(
            f"could not get codec {str(name_or_path)!r} from the hub or its cache "
            f"(offline={os.environ.get('HF_HUB_OFFLINE', '0')}): {exc}"
        ) from exc
    return Path(local)


def _weight_map(folder: Path) -> dict[str, str]:
    """key → shard file name."""
    index = folder / INDEX_FILE
    if index.is_file():
        with open(index, encoding="utf-8") as fh:
            wm = json.load(fh).get("weight_map")
        if not isinstance(wm, dict) or not wm:
            raise CodecLoadError(f"{index} has no weight_map")
        missing = sorted({f for f in wm.values() if not (folder / f).is_file()})
        if missing:
            raise CodecLoadError(f"codec shards missing in {folder}: {', '.join(missing)}")
        return dict(wm)
    single = folder / SINGLE_FILE
    if single.is_file():
        return {k: SINGLE_FILE for k in _read_shard_header(folder, SINGLE_FILE)}
    raise CodecLoadError(f"no {INDEX_FILE} or {SINGLE_FILE} in {folder}")


def _read_shard_header(folder: Path, shard: str) -> dict[str, TensorEntry]:
    try:
        return read_header(folder / shard)
    except TensorFileError as exc:
        raise CodecLoadError(f"cannot read {shard} in {folder}: {exc}") from exc


def read_checkpoint_keys(folder: str | os.PathLike[str]) -> list[str]:
    """All tensor keys of the checkpoint in ``folder`` (sorted)."""
    return sorted(_weight_map(Path(folder)))


def _source_keys(model_key: str) -> list[str]:
    """Checkpoint keys that make up one model parameter (two for a folded weight-norm conv)."""
    if model_key.startswith("quantizer.") and model_key.endswith(".weight") and ".codebook." not in model_key:
        base = model_key[: -len(".weight")]
        return [base + _WN_G, base + _WN_V]
    return [model_key]


def load_codec(
    name_or_path: str | os.PathLike[str] = DEFAULT_CODEC_REPO,
    *,
    device: str | torch.device = "cpu",
    compute_dtype: torch.dtype = torch.float32,
    decode_only: bool = False,
    decode_levels: int = DEFAULT_DECODE_LEVELS,
    revision: str | None = None,
) -> CodecModel:
    """Build the codec and load its weights by name.

    Args:
        name_or_path: local folder in the checkpoint layout, or a hub repo id.
        device: where the model lives.
        compute_dtype: torch.float32, or torch.bfloat16 for bf16 compute of the transformer linears.
        decode_only: skip the encoder (≈ half the parameters) and keep ``decode_levels`` quantizer levels.
        decode_levels: levels kept when ``decode_only`` (12 for MOSS-TTS).
    Raises:
        CodecLoadError: missing files/shards/tensors or shape mismatches.
        CodecConfigError: unsupported config.
    """
    folder = resolve_codec_dir(name_or_path, revision=revision)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise CodecLoadError(f"no config.json in {folder}")
    config = CodecConfig.from_file(cfg_path)
    wm = _weight_map(folder)

    with torch.device("meta"):
        model = CodecModel(
            config, with_encoder=not decode_only, quantizer_levels=decode_levels if decode_only else None
        )
    if compute_dtype != torch.float32:
        model.set_compute_dtype(compute_dtype)  # on meta: the linears' storage dtype, before they get memory
    needed: dict[str, list[str]] = {k: _source_keys(k) for k, _ in model.named_parameters()}
    missing = sorted(src for srcs in needed.values() for src in srcs if src not in wm)
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise CodecLoadError(f"{len(missing)} tensors missing from the codec checkpoint: {shown}")
    used = {src for srcs in needed.values() for src in srcs}
    extra = [k for k in wm if k not in used]
    skipped_ok = ("encoder.", "quantizer.input_proj.", "quantizer.quantizers.")
    unexpected = [k for k in extra if not (decode_only and k.startswith(skipped_ok))]
    if unexpected:
        log.warning("ignoring %d unexpected codec tensors, e.g. %s", len(unexpected), unexpected[:4])

    # Every parameter a view into one allocation (meta_init.materialize: ~2,000 cudaMallocs at full size otherwise),
    # the linears already in the compute dtype (the file's fp32 is converted as it is read: no fp32 copy of them on
    # the device, then a second allocation each). Then shard by shard straight into the parameters, in large pieces
    # through a few reused host buffers (moss_rt.safetensors_read): peak host memory is those buffers, not the
    # checkpoint. The weight-norm convs' two halves (small) are read to the host in fp32 and folded there, once both
    # are in (a pair may straddle two shards), then copied to their parameter.
    materialize(model, device)
    params = dict(model.named_parameters())
    by_shard: dict[str, list[tuple[str, torch.Tensor]]] = defaultdict(list)
    halves: dict[str, torch.Tensor] = {}
    headers = {shard: _read_shard_header(folder, shard) for shard in sorted({wm[src] for src in used})}
    for name, srcs in needed.items():
        for src in srcs:
            entry = headers[wm[src]].get(src)
            if entry is None:  # the index named a shard that does not hold it
                raise CodecLoadError(f"tensor {src} not found in its shard {wm[src]}")
            if len(srcs) == 1:
                if entry.shape != tuple(params[name].shape):
                    raise CodecLoadError(
                        f"{name}: checkpoint shape {entry.shape} != expected {tuple(params[name].shape)}"
                    )
                by_shard[wm[src]].append((src, params[name]))
            else:
                halves[src] = torch.empty(entry.shape, dtype=torch.float32)
                by_shard[wm[src]].append((src, halves[src]))
    for shard, requests in sorted(by_shard.items()):
        log.info("reading %d tensors from %s", len(requests), shard)
        try:
            read_into(folder / shard, requests, header=headers[shard])
        except (TensorFileError, OSError) as exc:
            raise CodecLoadError(f"cannot read {shard} in {folder}: {exc}") from exc
    for name, srcs in needed.items():
        if len(srcs) != 2:
            continue
        folded = fold_weight_norm(halves[srcs[0]], halves[srcs[1]]).squeeze(-1)
        p = params[name]
        if tuple(folded.shape) != tuple(p.shape):
            raise CodecLoadError(f"{name}: checkpoint shape {tuple(folded.shape)} != expected {tuple(p.shape)}")
        with torch.no_grad():
            p.copy_(folded)
    free_pinned_cache()
    model = model.eval().requires_grad_(False)
    model.quantizer.build_lut()
    n = sum(p.numel() for p in model.parameters())
    log.info(
        "codec loaded from %s: %.1fM params, encoder=%s, compute=%s, device=%s",
        folder, n / 1e6, not decode_only, compute_dtype, device,
    )
    return model
