"""Load a MOSS-TTS-Local checkpoint folder (or hub id) into our network.

The model is built on the ``meta`` device and materialised once on the target device; its tensors are then filled
from ``model.safetensors`` in large pieces through a few reused (pinned) host buffers (``moss_rt.safetensors_read``),
so host memory never holds a second full copy. Tied heads are single tensors in memory: their on-disk copies are
only read when the source is missing.

Two steps, so the engine can plan and start other work between them: ``open_model`` resolves the checkpoint, reads
its config and tokenizer and allocates the network on the device (its memory is taken, its values not read yet);
``OpenedModel.read_weights`` fills it. ``load_model`` does both.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moss_rt.model.config import MossTTSConfig
from moss_rt.model.network import MossTTSLocalModel, build_model
from moss_rt.model.prompt import load_tokenizer
from moss_rt.model.tiny import write_tiny_checkpoint
from moss_rt.safetensors_read import TensorEntry, TensorFileError, free_pinned_cache, read_header, read_into

logger = logging.getLogger(__name__)

DEFAULT_HUB_ID = "laion/moss-tts-local-transformer-4.55b-voice-acting-v2"
# "*.safetensors" covers both the single file and sharded checkpoints (index + model-0000k-of-0000n).
HUB_FILES = ["config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer*", "*.txt", "*.model"]
TINY_PARAMS = 50_000_000  # random checkpoints below this are the tiny demo; above, full-size benchmark weights


class ModelSourceError(RuntimeError):
    """A model source that cannot be found, downloaded or read."""


class ModelUnavailable(ModelSourceError):
    """The weights cannot be obtained at all (offline and not cached, or the download failed).

    The only failure after which ``--model auto`` may fall back to the tiny demo; a checkpoint that
    is there but broken (config or tensor mismatch, no tokenizer) is an error that names the problem.
    """


def random_weights_label(params: int) -> str:
    """How the logs and /api/info name a random-weight checkpoint of ``params`` parameters."""
    return "tiny random demo" if params < TINY_PARAMS else "random weights, full size"


@dataclass(frozen=True)
class ModelSource:
    path: Path
    kind: str  # "local", "hub" or "tiny"
    demo: bool  # random weights: audio is noise

    def describe(self) -> str:
        return f"{self.kind}:{self.path}" + (" (DEMO: random weights)" if self.demo else "")


@dataclass
class LoadedModel:
    model: MossTTSLocalModel
    config: MossTTSConfig
    tokenizer: Any
    source: ModelSource
    seconds: float


def _is_checkpoint_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and (
        (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()
    )


def tiny_cache_dir() -> Path:
    """Where the tiny model is written when no folder is given (the service and the CLI give their data dir's)."""
    return Path(tempfile.gettempdir()) / "moss_rt" / "tiny-seed0"


def resolve_model_source(
    spec: str,
    *,
    cache_dir: str | Path | None = None,
    offline: bool | None = None,
    tiny_dir: str | Path | None = None,
) -> ModelSource:
    """``auto`` | ``tiny`` | a local folder | a Hugging Face hub id -> a folder in the real layout.

    ``auto`` = the default hub model when a CUDA device is present and the weights can be
    found (cache or download), else the tiny random model, announced loudly.
    """
    spec = str(spec).strip()
    if spec == "tiny":
        return _tiny_source(tiny_dir)
    if spec == "auto":
        if not torch.cuda.is_available():
            logger.warning("--model auto: no CUDA device, serving the TINY RANDOM demo model (audio is noise)")
            return _tiny_source(tiny_dir)
        try:
            return _hub_source(DEFAULT_HUB_ID, cache_dir=cache_dir, offline=offline)
        except ModelUnavailable as exc:
            logger.warning("--model auto: %s; serving the TINY RANDOM demo model (audio is noise)", exc)
            return _tiny_source(tiny_dir)
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir() or not _is_checkpoint_dir(path):
            raise ModelSourceError(f"{path} is not a checkpoint folder (needs config.json and model.safetensors)")
        return ModelSource(path.resolve(), "local", demo=_is_demo(path))
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        return _hub_source(spec, cache_dir=cache_dir, offline=offline)
    raise ModelSourceError(f"model {spec!r} is neither a folder, a hub id (owner/name), 'auto' nor 'tiny'")


def _is_demo(path: Path) -> bool:
    try:
        return bool(json.loads((path / "config.json").read_text()).get("moss_rt_random_weights", False))
    except (OSError, ValueError):
        return False


def _tiny_source(tiny_dir: str | Path | None) -> ModelSource:
    folder = Path(tiny_dir) if tiny_dir is not None else tiny_cache_dir()
    if not _is_checkpoint_dir(folder):
        write_tiny_checkpoint(folder)
    return ModelSource(folder.resolve(), "tiny", demo=True)


def _hub_source(repo_id: str, *, cache_dir: str | Path | None, offline: bool | None) -> ModelSource:
    from huggingface_hub import snapshot_download

    if offline is None:
        offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}
    try:
        folder = snapshot_download(
            repo_id,
            allow_patterns=HUB_FILES,
            cache_dir=None if cache_dir is None else str(cache_dir),
            local_files_only=offline,
        )
    except Exception as exc:  # the hub raises many types (offline, 404, auth, network)
        how = "offline mode (HF_HUB_OFFLINE) and not in the local cache" if offline else "download failed"
        raise ModelUnavailable(f"cannot get {repo_id!r} from the Hugging Face hub: {how}: {exc}") from exc
    path = Path(folder)
    if not _is_checkpoint_dir(path):
        raise ModelSourceError(f"hub snapshot of {repo_id!r} at {path} lacks config.json or model.safetensors")
    return ModelSource(path, "hub", demo=False)


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / name for name in names]
    raise ModelSourceError(f"no model.safetensors in {folder}")


@torch.inference_mode()
def load_weights(model: MossTTSLocalModel, folder: Path, device: torch.device) -> None:
    """Fill every parameter of ``model`` (already on ``device``) from the folder's safetensors."""
    params = dict(model.state_dict(keep_vars=True))
    tied = model.tied_keys()
    files = _safetensors_files(folder)
    headers: dict[Path, dict[str, TensorEntry]] = {}
    located: dict[str, Path] = {}
    for file in files:
        try:
            headers[file] = read_header(file)
        except TensorFileError as exc:
            raise ModelSourceError(f"cannot read the checkpoint in {folder}: {exc}") from exc
        for key in headers[file]:
            located[key] = file
    unexpected = sorted(set(located) - set(params))
    if unexpected:
        raise ModelSourceError(f"checkpoint has tensors the model does not: {unexpected[:8]}")
    wanted = {}
    for key in params:
        if key in tied and tied[key] in located:
            continue  # one tensor in memory; its on-disk copy is redundant
        source = key
        if key not in located:
            # A tied source may be stored only under its head's name.
            alt = next((t for t, s in tied.items() if s == key and t in located), None)
            if alt is None:
                raise ModelSourceError(f"checkpoint lacks tensor {key!r}")
            source = alt
        wanted[key] = source
    by_file: dict[Path, list[tuple[str, torch.Tensor]]] = {}
    for key, source in wanted.items():
        entry, param = headers[located[source]][source], params[key]
        if entry.shape != tuple(param.shape):
            raise ModelSourceError(
                f"{source}: checkpoint shape {entry.shape} != model shape {tuple(param.shape)}"
            )
        by_file.setdefault(located[source], []).append((source, param))
    for file, requests in by_file.items():
        try:
            read_into(file, requests, header=headers[file])
        except TensorFileError as exc:
            raise ModelSourceError(f"cannot read the checkpoint in {folder}: {exc}") from exc
    free_pinned_cache()


@dataclass
class OpenedModel:
    """A checkpoint resolved, its config and tokenizer read, its network allocated on ``device`` (values unread)."""

    source: ModelSource
    config: MossTTSConfig
    tokenizer: Any
    model: MossTTSLocalModel
    device: torch.device
    dtype: torch.dtype
    started: float  # time.perf_counter() when opening began

    @property
    def parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def read_weights(self) -> LoadedModel:
        """Fill the network from the checkpoint (every parameter; the memory was taken when it was opened)."""
        t0 = time.perf_counter()
        load_weights(self.model, self.source.path, self.device)
        seconds = time.perf_counter() - self.started
        logger.info("loaded %s on %s/%s in %.1f s (weights read in %.1f s)", self.source.describe(), self.device,
                    self.dtype, seconds, time.perf_counter() - t0)
        if self.source.demo:
            params = self.parameters
            logger.warning("MODEL HAS RANDOM WEIGHTS (%s, %.2fB parameters): generated audio is noise",
                           random_weights_label(params), params / 1e9)
        return LoadedModel(self.model, self.config, self.tokenizer, self.source, seconds)


def open_model(
    spec: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    cache_dir: str | Path | None = None,
    offline: bool | None = None,
    tiny_dir: str | Path | None = None,
) -> OpenedModel:
    """Resolve ``spec``, read its config and tokenizer, allocate the network on ``device`` (see the module docstring).
    Raises what ``load_model`` raises for the source, the config or the tokenizer; the weights are read later."""
    t0 = time.perf_counter()
    source = resolve_model_source(str(spec), cache_dir=cache_dir, offline=offline, tiny_dir=tiny_dir)
    config = MossTTSConfig.from_file(source.path / "config.json")
    tokenizer = load_tokenizer(source.path)  # before the device memory is taken: a missing one fails at once
    device = torch.device(device)
    if isinstance(dtype, str):
        dtype = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}[
            dtype
        ]
    model = build_model(config, device, dtype)
    return OpenedModel(source, config, tokenizer, model, device, dtype, t0)


def load_model(
    spec: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    cache_dir: str | Path | None = None,
    offline: bool | None = None,
    tiny_dir: str | Path | None = None,
) -> LoadedModel:
    """``open_model`` then ``read_weights``: the network on ``device`` with the checkpoint's weights."""
    return open_model(
        spec, device=device, dtype=dtype, cache_dir=cache_dir, offline=offline, tiny_dir=tiny_dir
    ).read_weights()
