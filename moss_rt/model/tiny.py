"""Random-weight checkpoints in the real on-disk layout (tiny for tests/demo, full size for benchmarks).

Both write ``config.json`` with the real field names, ``model.safetensors`` with every
checkpoint key (tied copies written as separate, equal tensors, as in the release) and a
``tokenizer.json``. The random stop head is biased towards "continue": with a random head
the stop class would fire about every other frame, and a take that ends at frame 0 tests
nothing. ``local_transformer.ln_f`` gets weight 0 and bias ``margin/2`` on coordinate 0, so
that coordinate of the local output is a constant; the stop-head rows are +-(e_0 + noise*u)
(u a random unit vector off coordinate 0). The continue-minus-stop logit is then
``margin + 2*noise*(u . LN(x))``: a nearly constant per-frame stop hazard of about
sigmoid(-margin), with a little dependence on the input.
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from pathlib import Path
from typing import Any, cast

import torch

from moss_rt.model.config import BackboneConfig, LocalConfig, MossTTSConfig
from moss_rt.model.network import MossTTSLocalModel, build_model
from moss_rt.model.safetensors_stream import write_streaming

logger = logging.getLogger(__name__)

TINY_SPECIAL_TOKENS = {
    "pad_token_id": (2000, "<|endoftext|>"),
    "im_start_token_id": (2001, "<|im_start|>"),
    "im_end_token_id": (2002, "<|im_end|>"),
    "audio_user_slot_token_id": (2003, "<|vision_pad|>"),
    "audio_assistant_slot_token_id": (2004, "<|video_pad|>"),
    "audio_start_token_id": (2005, "<|audio_start|>"),
    "audio_end_token_id": (2006, "<|audio_end|>"),
}
TINY_VOCAB = 2048
# (margin, noise). Tiny: hazard ~ sigmoid(-4.1) = 1.6 % per frame at text temperature 1, i.e. a median
# take of ~3.5 s (checked in tests/model/test_tiny.py); greedy never stops.
TINY_STOP_BIAS = (4.1, 0.1)
# Full-size random model: practically never stops, so benchmarks run fixed lengths.
FULL_STOP_BIAS = (40.0, 0.0)
INIT_STD = 0.02


def tiny_config() -> MossTTSConfig:
    """Section 8.2 of the internals doc; head_dim != hidden/heads on purpose (as in the real model)."""
    ids = {name: tid for name, (tid, _) in TINY_SPECIAL_TOKENS.items()}
    return MossTTSConfig(
        backbone=BackboneConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,
            intermediate_size=128,
            vocab_size=TINY_VOCAB,
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-6,
        ),
        local=LocalConfig(
            n_embd=64,
            n_layer=1,
            n_head=4,
            n_inner=128,
            activation_function="silu",
            layer_norm_epsilon=1e-6,
            rope_base=1_000_000.0,
        ),
        n_vq=12,
        audio_vocab_size=1024,
        audio_pad_token_id=1024,
        local_text_head_mode="binary",
        sampling_rate=48000,
        **cast("dict[str, Any]", ids),  # the special tokens' ids, by the config's field names
    )


def full_config() -> MossTTSConfig:
    """The released 4.55B shape (section 8.1)."""
    return MossTTSConfig(
        backbone=BackboneConfig(),
        local=LocalConfig(),
    )


def checkpoint_specs(config: MossTTSConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor in the on-disk layout, each tied copy right after its source."""
    with torch.device("meta"):
        model = MossTTSLocalModel(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict(keep_vars=True).items()}
    tied = model.tied_keys()
    order: list[str] = []
    for name in shapes:
        if name in tied:
            continue
        order.append(name)
        order.extend(target for target, source in tied.items() if source == name)
    return [(name, shapes[name]) for name in order]


class _RandomWeights:
    """Deterministic tensors by name; tied copies repeat their source's values."""

    def __init__(self, config: MossTTSConfig, seed: int, stop_bias: tuple[float, float], device: torch.device) -> None:
        self.config = config
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.tied = MossTTSLocalModel.tied_keys_for(config)
        self.cache: dict[str, torch.Tensor] = {}
        margin, noise = stop_bias
        hidden = config.hidden_size
        axis = torch.zeros(hidden, device=device)
        axis[0] = 1.0
        u = torch.randn(hidden, generator=self.generator, device=device)
        u[0] = 0.0
        u = u / u.norm()
        self.ln_f_weight = 1.0 - axis
        self.ln_f_bias = axis * (margin / 2.0)
        row = axis + noise * u
        self.stop_head = torch.stack([row, -row])

    def __call__(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name in self.tied:
            return self.cache.pop(self.tied[name])
        if name == "local_transformer.ln_f.bias":
            tensor = self.ln_f_bias
        elif name == "local_transformer.ln_f.weight":
            tensor = self.ln_f_weight
        elif name == "local_text_lm_head.weight":
            tensor = self.stop_head
        elif name.endswith("norm.weight") or (".ln_" in name and name.endswith(".weight")):
            tensor = torch.ones(shape, device=self.device)
        elif name.endswith(".bias"):
            tensor = torch.zeros(shape, device=self.device)
        else:
            tensor = torch.randn(shape, generator=self.generator, device=self.device) * INIT_STD
        if name in self.tied.values():
            self.cache[name] = tensor
        return tensor


def write_checkpoint(
    folder: str | Path,
    config: MossTTSConfig,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    stop_bias: tuple[float, float] = TINY_STOP_BIAS,
    device: str | torch.device = "cpu",
    tokenizer_json: str | None = None,
) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    content = config.to_json()
    content["moss_rt_random_weights"] = True  # lets the loader announce a demo model
    (folder / "config.json").write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
    weights = _RandomWeights(config, seed, stop_bias, torch.device(device))
    nbytes = write_streaming(
        folder / "model.safetensors", checkpoint_specs(config), dtype, weights, metadata={"format": "pt"}
    )
    (folder / "tokenizer.json").write_text(tokenizer_json or build_tiny_tokenizer_json(config), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "pad_token": "<|endoftext|>",
                "eos_token": "<|im_end|>",
                "model_max_length": 131072,
            },
            indent=2,
        )
        + "\n",
        encoding="utf-8",
    )
    logger.info("wrote random checkpoint (%s, %.1f MB) to %s", dtype, nbytes / 1e6, folder)
    return folder


def write_tiny_checkpoint(folder: str | Path, seed: int = 0, *, dtype: torch.dtype = torch.float32) -> Path:
    """A ~2M-parameter model with every structural feature of the real one."""
    return write_checkpoint(folder, tiny_config(), seed=seed, dtype=dtype, stop_bias=TINY_STOP_BIAS)


def write_full_size_random_checkpoint(folder: str | Path, seed: int = 0, *, device: str | None = None) -> Path:
    """The 4.55B layout in bf16 (~9.1 GB), streamed tensor by tensor; generated on CUDA when available."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = full_config()
    # The real vocab needs the real tokenizer; a byte-level stand-in with the real special ids is enough
    # for benchmarks (text ids stay far below the pad id).
    return write_checkpoint(
        folder,
        cfg,
        seed=seed,
        dtype=torch.bfloat16,
        stop_bias=FULL_STOP_BIAS,
        device=device,
        tokenizer_json=build_tiny_tokenizer_json(cfg, specials=_real_specials()),
    )


def build_random_model(
    config: MossTTSConfig,
    *,
    seed: int = 0,
    stop_bias: tuple[float, float] = TINY_STOP_BIAS,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> MossTTSLocalModel:
    """The model ``write_checkpoint`` writes with the same arguments, built in memory (the same values once cast
    to ``dtype``), without the round trip through the disk."""
    device = torch.device(device)
    model = build_model(config, device, dtype)
    params = model.state_dict(keep_vars=True)
    weights = _RandomWeights(config, seed, stop_bias, device)
    with torch.no_grad():
        for name, shape in checkpoint_specs(config):
            tensor = weights(name, shape)  # every name, in the file's order: the generator's sequence is the file's
            if name in params:
                params[name].copy_(tensor)
    return model


def build_full_size_random_model(
    seed: int = 0, *, device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16
) -> tuple[MossTTSLocalModel, MossTTSConfig]:
    """``write_full_size_random_checkpoint``'s model in memory (benchmarks skip ~9 GB of disk writes and reads).
    No tokenizer: feed prompt rows directly."""
    config = full_config()
    return build_random_model(config, seed=seed, stop_bias=FULL_STOP_BIAS, device=device, dtype=dtype), config


# --------------------------------------------------------------------------- tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-ins for bytes (what byte-level BPE vocabularies are written in)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars), strict=True))


_MERGE_CORPUS = (
    "<user_inst>\n- Reference(s):\nNone\n- Instruction:\n- Tokens:\n- Quality:\n- Sound Event:\n"
    "- Ambient Sound:\n- Language:\n- Text:\n</user_inst>\nuser\nassistant\nEnglish French German "
    "the quick brown fox jumps over the lazy dog. Hello there, how are you today? "
    "She whispered: the night is long, and the stars are listening. Speak slowly and warmly. "
)


def _learn_merges(count: int) -> list[tuple[str, str]]:
    """A small deterministic BPE merge list (most frequent pair, ties broken lexicographically)."""
    table = _bytes_to_unicode()
    # Roughly what the byte-level pre-tokenizer does: a word keeps its leading space.
    pieces = re.findall(r" ?[^\s]+|\n", _MERGE_CORPUS)
    words = [[table[b] for b in piece.encode("utf-8")] for piece in pieces]
    merges: list[tuple[str, str]] = []
    for _ in range(count):
        pairs: Counter[tuple[str, str]] = Counter()
        for word in words:
            pairs.update(zip(word, word[1:], strict=False))
        if not pairs:
            break
        best = min(pairs.items(), key=lambda item: (-item[1], item[0]))[0]
        if pairs[best] < 2:
            break
        merges.append(best)
        joined = best[0] + best[1]
        new_words = []
        for word in words:
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(joined)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            new_words.append(out)
        words = new_words
    return merges


def _real_specials() -> dict[str, tuple[int, str]]:
    return {
        "pad_token_id": (151643, "<|endoftext|>"),
        "im_start_token_id": (151644, "<|im_start|>"),
        "im_end_token_id": (151645, "<|im_end|>"),
        "audio_user_slot_token_id": (151654, "<|vision_pad|>"),
        "audio_assistant_slot_token_id": (151656, "<|video_pad|>"),
        "audio_start_token_id": (151669, "<|audio_start|>"),
        "audio_end_token_id": (151670, "<|audio_end|>"),
    }


def build_tiny_tokenizer_json(
    config: MossTTSConfig, specials: dict[str, tuple[int, str]] | None = None, merges: int = 160
) -> str:
    """A deterministic byte-level BPE tokenizer whose special tokens sit at the config's ids.

    Every byte is a token (ids 0..255), learned merges follow, then reserved filler up to
    the vocab size; special tokens occupy their configured ids, all above the text ids.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    specials = specials or TINY_SPECIAL_TOKENS
    byte_chars = list(_bytes_to_unicode().values())
    merge_list = _learn_merges(merges)
    vocab: dict[str, int] = {}
    for ch in byte_chars:
        vocab[ch] = len(vocab)
    for a, b in merge_list:
        vocab.setdefault(a + b, len(vocab))
    special_ids = {tid: text for tid, text in specials.values()}
    lowest_special = min(special_ids)
    if len(vocab) > lowest_special:
        raise ValueError("tokenizer text vocab collides with the special ids")
    # Fill up to the vocab size so that every special token keeps its configured id.
    for tid in range(len(vocab), config.backbone.vocab_size):
        vocab[special_ids.get(tid, f"<|reserved_{tid}|>")] = tid
    for tid, text in special_ids.items():
        if vocab.get(text) != tid:
            raise ValueError(f"special token {text} would not get id {tid}")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merge_list))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(text, special=True, normalized=False) for text in special_ids.values()])
    return tok.to_str(pretty=False)
