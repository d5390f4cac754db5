"""The CTC aligner: a wav2vec2-style acoustic model from the hub (MMS forced-alignment checkpoints and the like)
batched on the engine's device, and our own Viterbi over its emissions (:mod:`moss_rt.align.viterbi`).

A checkpoint is a folder in the Hugging Face layout of ``Wav2Vec2ForCTC``: ``config.json``,
``model.safetensors`` (or shards), ``vocab.json`` (character → id) and optionally ``preprocessor_config.json``
(sampling rate, normalisation). It comes from a local path or a hub id, downloaded once into the hub cache with
progress bars (``HF_HUB_OFFLINE=1``: the cache only), like the main weights. ``write_random_ctc_checkpoint`` writes
one with random weights in that layout (tiny for tests, MMS-300m size for benchmarks), so the loader, the batching
and the Viterbi run for real without a download.

A word is spelled in the vocabulary's characters (lowercase; characters it lacks are dropped; a word left with
none is unplaced and interpolated); the word delimiter (``|``) goes between words when the vocabulary has one.
Long audio is cut into overlapping windows of ``WINDOW_SEC`` for the network (attention is quadratic) and the
emissions are stitched back together before the one Viterbi pass.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moss_rt.align.base import AlignJob, AlignResult, Span
from moss_rt.align.memory import DEFAULT_GRAPH_MEMORY_BYTES, NetDims, pass_bytes
from moss_rt.align.viterbi import ctc_forced_align

log = logging.getLogger(__name__)

DEFAULT_CTC_MODEL = "MahmoudAshraf/mms-300m-1130-forced-aligner"
HUB_FILES = ["config.json", "*.safetensors", "model.safetensors.index.json", "vocab.json", "preprocessor_config.json"]
# On a GPU a worker waits this long for more jobs to join a batch: one network call costs about the same for one
# window or dozens (launch-bound), and the streams' jobs arrive spread out; it adds at most this to a word's lag
# (docs/words.md: p95 target 1.2 s). On a CPU the cost grows with the batch: no wait.
GPU_GATHER_SEC = 0.15
# … and up to this long when many takes stream (the service's rule, moss_rt.align.service.gather_time): fuller,
# fewer calls where the jobs come fast enough to fill them.
GPU_MAX_GATHER_SEC = 0.35
WINDOW_SEC = 20.0  # audio per network call; longer audio goes in overlapping windows
# A call's fixed cost (launches, the model's Python), in seconds of audio one row of the batch costs: a batch's
# windows are split into calls by length only when that saves more padding than this per extra call. On a GPU a
# call of the MMS-300m network costs several ms whatever its size; on a CPU the cost is all in the audio.
GPU_CALL_COST_SEC = 8.0
CPU_CALL_COST_SEC = 0.1
CONTEXT_SEC = 1.0  # each window's extra audio on both sides, whose frames are dropped when stitching
# On a GPU a batch is padded to a few shapes (rows to a power of two up to ROW_STEP then a multiple of it, samples to
# a multiple of SHAPE_STEP_SEC), one CUDA graph each (moss_rt.align.ctc_graphs). Before the graphs: cuDNN
# builds an execution plan for every new convolution shape, and streaming jobs of every length in batches of every
# size made nearly every call a new shape (an H200, 64 takes: 168 ms a call for ~26 windows of 1.4 s that take ~10 ms
# once planned). Padded samples are masked and padded rows dropped: the emissions do not change.
# A free-end path in blanks this long after the last word it reached: a pause, that word is over (AlignResult.settled;
# PocketSphinx's PAUSE_FRAMES).
PAUSE_SEC = 0.35
SHAPE_STEP_SEC = 0.25
ROW_STEP = 8  # rows: a power of two up to this, then a multiple of it (a replayed graph computes every padded row)
DELIMITERS = ("|", " ")
BLANKS = ("<pad>", "<blank>", "[PAD]", "<eps>")
RANDOM_VOCAB = ["<pad>", "<s>", "</s>", "<unk>", "|", *"abcdefghijklmnopqrstuvwxyz'"]


# Device memory the CTC aligners of this process hold on each CUDA device (weights and buffers), for the engine's
# memory plan: what it measures as in use already is not reserved again (moss_rt.align.select.planned_reserve_bytes).
_HELD_LOCK = threading.Lock()
_HELD: dict[int, tuple[int, int]] = {}  # id(aligner) -> (device index, bytes)


def held_device_bytes(index: int) -> int:
    """Bytes the loaded CTC aligners of this process hold on CUDA device ``index`` (weights and buffers)."""
    with _HELD_LOCK:
        return sum(n for i, n in _HELD.values() if i == index)


class AlignerSourceError(RuntimeError):
    """The CTC checkpoint cannot be found, downloaded or read."""


def resolve_ctc_source(spec: str, *, local_only: bool | None = None) -> Path:
    """A checkpoint folder, or a hub id fetched into (or found in) the hub cache."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return _checked(path)
    if path.exists() or spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise AlignerSourceError(f"aligner model {spec!r} is neither a checkpoint folder nor a hub id (owner/name)")
    from huggingface_hub import snapshot_download

    if local_only is None:
        local_only = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}
    try:
        folder = snapshot_download(spec, allow_patterns=HUB_FILES, local_files_only=local_only)
    except Exception as exc:  # the hub raises many types (offline, 404, auth, network)
        how = "not in the local hub cache" if local_only else "download failed"
        raise AlignerSourceError(f"cannot get aligner model {spec!r}: {how}: {exc}") from exc
    return _checked(Path(folder))


def _checked(folder: Path) -> Path:
    has_weights = (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file()
    if not (folder / "config.json").is_file() or not has_weights or not (folder / "vocab.json").is_file():
        raise AlignerSourceError(f"{folder} is not a CTC checkpoint (needs config.json, model.safetensors, vocab.json)")
    return folder.resolve()


def _vocab(folder: Path) -> dict[str, int]:
    raw = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
    if raw and all(isinstance(v, dict) for v in raw.values()):  # multilingual layout: {lang: {char: id}}
        raw = raw.get("eng") or next(iter(raw.values()))
    if not isinstance(raw, dict) or not all(isinstance(v, int) for v in raw.values()):
        raise AlignerSourceError(f"{folder / 'vocab.json'} is not a character → id map")
    return dict(raw)


@dataclass(frozen=True)
class _Spelling:
    targets: list[int]
    word_tokens: list[tuple[int, int] | None]  # per word: its range in ``targets``; None for a word with no token


class CtcAligner:
    """Forced alignment with a CTC acoustic model; one worker thread feeds the device, many takes per batch."""

    workers = 1

    def __init__(
        self, source: str, *, device: str = "cpu", max_batch: int = 64, dtype: str = "auto",
        gather_sec: float | None = None, max_gather_sec: float | None = None, cuda_graphs: bool = True,
        graph_memory_bytes: int = DEFAULT_GRAPH_MEMORY_BYTES,
    ) -> None:  # fmt: skip
        self.source = source
        # The CUDA graphs' pool holds at most this, and no call computes more (moss_rt.align.memory).
        self.graph_memory_bytes = max(0, graph_memory_bytes)
        self._dims: NetDims | None = None
        self._fits: dict[tuple[int, int], bool] = {}
        self.name = f"ctc:{source}"
        self.device = device
        self.max_batch = max_batch
        cuda = device.startswith("cuda")
        self.gather_sec = (GPU_GATHER_SEC if cuda else 0.0) if gather_sec is None else gather_sec
        # The gather grows with the load up to this (a gather set by hand stays as set unless this is too).
        if max_gather_sec is None:
            max_gather_sec = GPU_MAX_GATHER_SEC if cuda and gather_sec is None else self.gather_sec
        self.max_gather_sec = max(self.gather_sec, max_gather_sec)
        self.cuda_graphs = cuda_graphs and cuda  # the network replayed per padded shape (moss_rt.align.ctc_graphs)
        self._graphed: Any = None
        self.call_cost_sec = GPU_CALL_COST_SEC if device.startswith("cuda") else CPU_CALL_COST_SEC
        self.pad_shapes = device.startswith("cuda")  # batches padded to a few shapes (SHAPE_STEP_SEC)
        self._dtype_name = dtype
        self.sample_rate = 16000
        self.demo = False
        self._model: Any = None
        self._vocab: dict[str, int] = {}
        self._blank = 0
        self._delimiter: int | None = None
        self._normalize = True
        self._stride = 320  # input samples per emission frame
        self.gpu_seconds = 0.0  # time spent in the network (the device's share of the aligner)

    def load(self) -> None:
        import torch
        from transformers import Wav2Vec2ForCTC

        t0 = time.perf_counter()
        folder = resolve_ctc_source(self.source)
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        self.demo = bool(config.get("moss_rt_random_weights", False))
        self._vocab = _vocab(folder)
        blank = next((self._vocab[b] for b in BLANKS if b in self._vocab), config.get("pad_token_id", 0))
        self._blank = int(blank)
        self._delimiter = next((self._vocab[d] for d in DELIMITERS if d in self._vocab), None)
        pre = folder / "preprocessor_config.json"
        if pre.is_file():
            prep = json.loads(pre.read_text(encoding="utf-8"))
            self.sample_rate = int(prep.get("sampling_rate", 16000))
            self._normalize = bool(prep.get("do_normalize", True))
        device = torch.device(self.device)
        # fp16 on a GPU (wav2vec2 runs well in it), fp32 on a CPU, unless asked otherwise.
        names = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
        dtype = names.get(self._dtype_name, torch.float16 if device.type == "cuda" else torch.float32)
        # With output_loading_info it returns (model, info); transformers' annotations say only the model.
        loaded: Any = Wav2Vec2ForCTC.from_pretrained(str(folder), dtype=dtype, output_loading_info=True)
        model, info = loaded
        if info.get("missing_keys"):
            raise AlignerSourceError(f"{folder}: the checkpoint lacks tensors {sorted(info['missing_keys'])[:6]}")
        self._model = model.to(device).eval().requires_grad_(False)
        self._stride = int(np.prod(model.config.conv_stride))
        self._dtype = dtype
        self._dims = NetDims.from_config(model.config)
        self._itemsize = torch.tensor([], dtype=dtype).element_size()
        if self.cuda_graphs:
            self._graphed = self._graph_runner(model, device)
        if device.type == "cuda":
            held = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
            held += 0 if self._graphed is None else self._graphed.buffer_bytes
            index = device.index if device.index is not None else torch.cuda.current_device()
            with _HELD_LOCK:
                _HELD[id(self)] = (index, held)
        params = sum(p.numel() for p in model.parameters())
        log.info(
            "aligner %s on %s/%s: %.0fM parameters, %d characters, loaded in %.1f s%s",
            self.name, device, str(dtype).removeprefix("torch."), params / 1e6, len(self._vocab),
            time.perf_counter() - t0, " (RANDOM WEIGHTS: its times mean nothing)" if self.demo else "",
        )  # fmt: skip

    def _graph_runner(self, model: Any, device: Any) -> Any:
        """Our own forward of the network (graph-safe) under a CUDA graph per padded shape; None when this
        checkpoint needs the Hugging Face module (it then runs eagerly)."""
        from moss_rt.align.ctc_graphs import GraphedCtc
        from moss_rt.align.ctc_net import CtcNet, unsupported

        why = unsupported(model.config)
        if why is not None:
            log.warning("aligner %s: no CUDA graphs, %s: the network runs eagerly", self.name, why)
            return None
        rows, _ = padded_shape(self.max_batch, 1, 1)
        ladder = sorted({padded_shape(r, 1, 1)[0] for r in range(1, rows + 1)}, reverse=True)
        return GraphedCtc(
            CtcNet(model), device, max_rows=rows, sample_rate=self.sample_rate, normalize=self._normalize,
            vocab=int(model.lm_head.out_features), estimate=lambda shape: self.pass_bytes(*shape),
            budget_bytes=self.graph_memory_bytes, rows_ladder=ladder,
        )  # fmt: skip

    def _call_fits(self, rows: int, samples: int) -> bool:
        """Whether a call of this padded shape stays within the budget (memoised: few shapes, many asks)."""
        found = self._fits.get((rows, samples))
        if found is None:
            found = self._fits[(rows, samples)] = self.pass_bytes(rows, samples) <= self.graph_memory_bytes
        return found

    def pass_bytes(self, rows: int, samples: int) -> int:
        """The bound of one network call's device memory over ``rows`` × ``samples`` (moss_rt.align.memory)."""
        assert self._dims is not None, "load() first"
        return pass_bytes(self._dims, rows, samples, itemsize=self._itemsize)

    @property
    def graph_stats(self) -> dict[str, Any] | None:
        """The CUDA graphs' counters (captures, replays, eager calls, pool memory); None without graphs."""
        return None if self._graphed is None else dict(self._graphed.stats)

    def close(self) -> None:
        self._model = None  # its memory goes back with the last reference
        self._graphed = None
        with _HELD_LOCK:
            _HELD.pop(id(self), None)

    # ------------------------------------------------------------------ text

    def _spell(self, words: Sequence[str]) -> _Spelling:
        targets: list[int] = []
        word_tokens: list[tuple[int, int] | None] = []
        for word in words:
            ids = [self._vocab[c] for c in _letters(word) if c in self._vocab]
            if not ids:
                word_tokens.append(None)
                continue
            if targets and self._delimiter is not None:
                targets.append(self._delimiter)
            word_tokens.append((len(targets), len(targets) + len(ids)))
            targets += ids
        return _Spelling(targets, word_tokens)

    # ------------------------------------------------------------------ audio

    def emissions(self, audios: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Log-probabilities [T, V] per audio (windows of all audios batched together on the device)."""
        window = int(WINDOW_SEC * self.sample_rate)
        context = int(CONTEXT_SEC * self.sample_rate)
        cuts: list[tuple[int, int, int, int, int]] = []  # (audio index, start, end, kept start, kept end)
        for i, audio in enumerate(audios):
            n = len(audio)
            for kept in range(0, max(n, 1), window):
                kept_end = min(n, kept + window)
                cuts.append((i, max(0, kept - context), min(n, kept_end + context), kept, kept_end))
        out: list[list[np.ndarray]] = [[] for _ in audios]
        order = sorted(range(len(cuts)), key=lambda k: cuts[k][2] - cuts[k][1])
        frames: dict[int, np.ndarray] = {}
        call_cost = int(self.call_cost_sec * self.sample_rate)
        step = int(SHAPE_STEP_SEC * self.sample_rate)
        shape = (lambda rows, samples: padded_shape(rows, samples, step)) if self.pad_shapes else None
        lengths = [cuts[k][2] - cuts[k][1] for k in order]
        rows = self.max_batch
        fits: Callable[[int, int], bool] | None = None
        if self.pad_shapes and self._dims is not None:
            # On a GPU no call computes more than the budget (it runs eagerly or in a graph: both bounded), and
            # while the graphs are on, no call has more rows than they take.
            graph_rows = 0 if self._graphed is None else self._graphed.max_rows
            rows = min(rows, graph_rows) if graph_rows else rows
            fits = self._call_fits
        for first, last in length_groups(lengths, rows, call_cost, shape=shape, fits=fits):
            group = [cuts[k] for k in order[first:last]]
            logits = self._forward([audios[i][s:e] for i, s, e, _, _ in group])
            for k, lp, (_, s, _, ks, ke) in zip(order[first:last], logits, group, strict=True):
                lo = (ks - s) // self._stride
                hi = lo + max(1, (ke - ks) // self._stride)
                frames[k] = lp[lo:hi]
        for k, (i, *_rest) in enumerate(cuts):
            out[i].append(frames[k])
        empty = np.zeros((0, len(self._vocab)), np.float32)
        return [np.concatenate(parts, axis=0) if parts else empty for parts in out]

    def _forward(self, batch: Sequence[np.ndarray]) -> list[np.ndarray]:
        import torch

        model = self._model
        longest = max(max(len(a) for a in batch), self._stride)
        rows = len(batch)
        if self.pad_shapes:
            rows, longest = padded_shape(rows, longest, int(SHAPE_STEP_SEC * self.sample_rate))
        if self._graphed is not None:
            t0 = time.perf_counter()
            with torch.inference_mode():
                lp = self._graphed.run(batch, (rows, longest))
            self.gpu_seconds += time.perf_counter() - t0
            frames = model._get_feat_extract_output_lengths(torch.tensor([len(a) for a in batch]))
            return [lp[row, : int(frames[row])] for row in range(len(batch))]
        x = np.zeros((rows, longest), dtype=np.float32)
        mask = np.zeros((rows, longest), dtype=np.int64)
        mask[len(batch) :, : self._stride] = 1  # a padding row holds one frame of silence: no row is all masked
        for row, audio in enumerate(batch):
            a = audio.astype(np.float32, copy=False)
            if self._normalize and len(a):
                a = (a - a.mean()) / np.sqrt(a.var() + 1e-7)
            x[row, : len(a)] = a
            mask[row, : len(a)] = 1
        t0 = time.perf_counter()
        with torch.inference_mode():
            inputs = torch.from_numpy(x).to(self._model.device, self._dtype)
            kwargs = {}
            if getattr(model.config, "feat_extract_norm", "group") == "layer":
                kwargs["attention_mask"] = torch.from_numpy(mask).to(self._model.device)
            logits = model(inputs, **kwargs).logits.float()
            lengths = model._get_feat_extract_output_lengths(torch.from_numpy(mask.sum(axis=1)))
            lp = torch.log_softmax(logits, dim=-1).cpu().numpy()
        self.gpu_seconds += time.perf_counter() - t0
        return [lp[row, : int(lengths[row])] for row in range(len(batch))]

    # ------------------------------------------------------------------ alignment

    def align_batch(self, jobs: Sequence[AlignJob]) -> list[AlignResult]:
        spellings = [self._spell(job.words) for job in jobs]
        try:
            emissions = self.emissions([job.audio for job in jobs])
        except Exception:  # a device fault must not fail the takes: their words are interpolated
            log.exception("aligner %s: the acoustic model failed on a batch of %d", self.name, len(jobs))
            return [AlignResult([] if job.free_end else [None] * len(job.words)) for job in jobs]
        return [self._place(job, spelling, lp) for job, spelling, lp in zip(jobs, spellings, emissions, strict=True)]

    def _place(self, job: AlignJob, spelling: _Spelling, lp: np.ndarray) -> AlignResult:
        n = len(job.words)
        nothing = AlignResult([] if job.free_end else [None] * n)
        if not spelling.targets or len(lp) == 0:
            return nothing
        token_frames = ctc_forced_align(lp, spelling.targets, self._blank, free_end=job.free_end)
        if token_frames is None:
            return nothing
        seconds = len(job.audio) / self.sample_rate / len(lp)  # per emission frame
        spans: list[Span] = []
        reached = len(token_frames)
        whole = False  # the last word placed was reached to its last letter
        for tokens in spelling.word_tokens:
            if tokens is None:
                spans.append(None)
                continue
            first, last = tokens
            if first >= reached:
                break
            end_frame = token_frames[min(last, reached) - 1][1]
            spans.append((token_frames[first][0] * seconds, end_frame * seconds))
            whole = last <= reached
        settled = None
        if job.free_end:
            while spans and spans[-1] is None:
                spans.pop()
            # The path ends PAUSE_SEC or more past the whole of the last word (blanks, a word delimiter): no letter
            # of the next word in that time, the speaker paused and the word is over (as PocketSphinx reports it).
            # Without this a word before a pause waited for the next word to begin, and every job read it again.
            last_word = spans[-1] if spans else None
            if last_word is not None and whole and len(lp) * seconds - last_word[1] >= PAUSE_SEC - 1e-9:
                settled = len(spans)
        else:
            spans += [None] * (n - len(spans))
        return AlignResult(spans, settled)


def length_groups(
    lengths: Sequence[int],
    max_rows: int,
    call_cost: int,
    *,
    shape: Callable[[int, int], tuple[int, int]] | None = None,
    fits: Callable[[int, int], bool] | None = None,
) -> list[tuple[int, int]]:
    """Windows sorted by length (``lengths``, ascending) split into calls [first, last): each call computes its
    rows padded to its longest (and, with ``shape``, to the (rows, samples) that maps them to: a GPU's padded
    shapes), and costs ``call_cost`` (in the same units) more. The split that computes least, at most ``max_rows``
    rows a call and, with ``fits``, only calls whose (padded) shape it accepts, or of one row (dynamic programming
    over the sorted lengths: a call's rows are neighbours)."""
    n = len(lengths)
    rows = max(1, max_rows)
    best = [0] + [0] * n  # best[j]: the least cost of the first j windows
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        best[j] = -1
        for i in range(max(0, j - rows), j):
            padded_rows, padded_len = (j - i, lengths[j - 1]) if shape is None else shape(j - i, lengths[j - 1])
            if fits is not None and j - i > 1 and not fits(padded_rows, padded_len):
                continue
            cost = best[i] + padded_rows * padded_len + call_cost
            if best[j] < 0 or cost < best[j]:
                best[j], cut[j] = cost, i
    groups: list[tuple[int, int]] = []
    j = n
    while j > 0:
        groups.append((cut[j], j))
        j = cut[j]
    return groups[::-1]


def padded_shape(rows: int, samples: int, step: int) -> tuple[int, int]:
    """A batch's shape on the GPU: rows up to the next power of two up to ROW_STEP, then the next multiple of
    ROW_STEP; samples up to the next multiple of ``step``."""
    padded = 1 << max(0, rows - 1).bit_length() if rows <= ROW_STEP else -(-rows // ROW_STEP) * ROW_STEP
    return padded, -(-samples // step) * step


def _letters(word: str) -> str:
    """A word in plain lowercase letters: accents off (é → e), so a romanised vocabulary can spell it."""
    decomposed = unicodedata.normalize("NFKD", word.lower())
    return "".join(c for c in decomposed if not unicodedata.combining(c))


# --------------------------------------------------------------------------- random checkpoints


def ctc_config(size: str) -> dict[str, Any]:
    """Wav2Vec2ForCTC config fields: ``tiny`` (tests) or ``mms-300m`` (the size of the MMS-300m aligners)."""
    common = {
        "vocab_size": len(RANDOM_VOCAB), "pad_token_id": 0, "feat_extract_norm": "layer", "do_stable_layer_norm": True,
        "conv_stride": (5, 2, 2, 2, 2, 2, 2), "conv_kernel": (10, 3, 3, 3, 3, 2, 2), "ctc_loss_reduction": "mean",
    }  # fmt: skip
    if size == "tiny":
        return {
            **common, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
            "conv_dim": (32,) * 7, "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 4,
        }  # fmt: skip
    if size == "mms-300m":
        return {
            **common, "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
            "intermediate_size": 4096, "conv_dim": (512,) * 7, "num_conv_pos_embeddings": 128,
            "num_conv_pos_embedding_groups": 16,
        }  # fmt: skip
    raise ValueError(f"unknown size {size!r} (tiny or mms-300m)")


def write_random_ctc_checkpoint(folder: str | Path, *, size: str = "tiny", seed: int = 0) -> Path:
    """A Wav2Vec2ForCTC checkpoint with random weights in the hub layout (config.json, model.safetensors,
    vocab.json, preprocessor_config.json), marked as random so the service reports its times as meaningless."""
    import torch
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = Wav2Vec2ForCTC(Wav2Vec2Config(**ctc_config(size)))
    model.save_pretrained(str(folder), safe_serialization=True)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["moss_rt_random_weights"] = True
    config_path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (folder / "vocab.json").write_text(json.dumps({c: i for i, c in enumerate(RANDOM_VOCAB)}), encoding="utf-8")
    prep = {"feature_extractor_type": "Wav2Vec2FeatureExtractor", "sampling_rate": 16000, "do_normalize": True,
            "feature_size": 1, "padding_value": 0.0, "return_attention_mask": True}  # fmt: skip
    (folder / "preprocessor_config.json").write_text(json.dumps(prep, indent=2), encoding="utf-8")
    return folder
