"""Which model, codec, device and dtype the real engine serves (``--model auto|tiny|PATH|HUB_ID``).

``auto`` means the real checkpoints on a CUDA GPU (downloaded with progress when missing and the
network allows), and otherwise the tiny random-weight demo model and codec, written once under
``data_dir/tiny/`` and announced loudly: its audio is noise, everything else is real.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from moss_rt.config import REAL_CODEC_ID, REAL_MODEL_ID, Settings

log = logging.getLogger(__name__)

DEMO_BANNER = "DEMO MODE: serving a TINY RANDOM-WEIGHT model and codec; the audio is noise, everything else is real"
FULL_RANDOM_BANNER = (
    "DEMO MODE: serving RANDOM WEIGHTS at FULL SIZE (a benchmark checkpoint); "
    "the audio is noise, everything else is real"
)
RANDOM_CODEC_BANNER = "DEMO MODE: the codec has RANDOM WEIGHTS; the audio is noise, everything else is real"


def demo_banner(kind: str) -> str:
    """The banner for a random-weight checkpoint: ``kind`` from ``random_weights_label`` (or "random codec")."""
    if kind == "tiny random demo":
        return DEMO_BANNER
    if kind == "random weights, full size":
        return FULL_RANDOM_BANNER
    return RANDOM_CODEC_BANNER


def has_random_weights(folder: str | Path) -> bool:
    """A checkpoint folder written by our random-weight writers (model or codec) says so in config.json."""
    try:
        return bool(json.loads((Path(folder) / "config.json").read_text()).get("moss_rt_random_weights", False))
    except (OSError, ValueError):
        return False


@dataclass(frozen=True)
class Placement:
    device: torch.device
    dtype: torch.dtype


@dataclass(frozen=True)
class Choice:
    """What to load: a folder or hub id, and whether it is the tiny demo."""

    source: str
    demo: bool  # random weights (tiny or full size): the audio is noise
    label: str  # short, file-name safe: used in /api/info and as the voice-codes cache tag
    tiny: bool = False  # the tiny demo written under data_dir (pairs with the tiny codec)


def placement(settings: Settings) -> Placement:
    device = settings.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"--device {settings.device}: no CUDA device is available")
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if settings.dtype == "auto":
        # bf16 is what the real checkpoint ships; fp32 on CPU keeps takes bit-reproducible.
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    elif settings.dtype in names:
        dtype = names[settings.dtype]
    else:
        raise RuntimeError(f"unknown dtype {settings.dtype!r} (auto, float32 or bfloat16)")
    return Placement(dev, dtype)


def tiny_root(settings: Settings) -> Path:
    return settings.data_dir / "tiny"


def _write_once(folder: Path, writer: object) -> Path:
    """Write a checkpoint into ``folder`` atomically (temp folder + rename), unless it exists."""
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    try:
        writer(tmp)  # type: ignore[operator]
        try:
            os.replace(tmp, folder)
        except OSError:
            if not (folder / "config.json").is_file():  # someone else won the race: use theirs
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def tiny_model_dir(settings: Settings) -> Path:
    from moss_rt.model.tiny import write_tiny_checkpoint

    return _write_once(tiny_root(settings) / "model", write_tiny_checkpoint)


def tiny_codec_dir(settings: Settings) -> Path:
    from moss_rt.codec.tiny import write_tiny_codec

    return _write_once(tiny_root(settings) / "codec", write_tiny_codec)


def _label(source: str) -> str:
    return Path(source).name if os.sep in source or Path(source).exists() else source.replace("/", "--")


def choose_model(settings: Settings, device: torch.device) -> Choice:
    spec = settings.model.strip()
    if spec == "tiny" or (spec == "auto" and device.type != "cuda"):
        if spec == "auto":
            log.warning("--model auto without a CUDA device: falling back to the tiny demo model")
        return Choice(str(tiny_model_dir(settings)), True, "tiny", tiny=True)
    if spec == "auto":
        return Choice(REAL_MODEL_ID, False, _label(REAL_MODEL_ID))
    return Choice(spec, has_random_weights(spec), _label(spec))


def choose_codec(settings: Settings, model: Choice) -> Choice:
    spec = settings.codec.strip()
    if spec == "tiny" or (spec == "auto" and model.tiny):
        return Choice(str(tiny_codec_dir(settings)), True, "tiny", tiny=True)
    if spec == "auto":
        return Choice(REAL_CODEC_ID, False, _label(REAL_CODEC_ID))
    return Choice(spec, has_random_weights(spec), _label(spec))
