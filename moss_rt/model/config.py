"""Parse and validate the MOSS-TTS-Local v1.5 ``config.json``.

The field names are the ones the released checkpoint uses (``qwen3_config`` or
``language_config``, ``gpt2_config``, ``n_vq``, ...). Defaults follow the upstream
remote code, including its quirks (for instance the local transformer's
``rope_base`` falls back to 10000 when the key is absent, although every real and
tiny config we know of sets 1e6 explicitly). Anything we cannot run faithfully is
rejected with a message that names the field.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# Activations the upstream code reaches through transformers' ACT2FN that we implement.
SUPPORTED_LOCAL_ACTIVATIONS = ("silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh")


class ConfigError(ValueError):
    """The checkpoint's config.json is inconsistent or describes something we cannot run."""


@dataclass(frozen=True)
class BackboneConfig:
    """The Qwen3 temporal transformer (``qwen3_config`` / ``language_config``)."""

    hidden_size: int = 2560
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    intermediate_size: int = 9728
    vocab_size: int = 151936
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    hidden_act: str = "silu"
    tie_word_embeddings: bool = True

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["model_type"] = "qwen3"
        return out


@dataclass(frozen=True)
class LocalConfig:
    """The frame-local GPT-2 style transformer (``gpt2_config``)."""

    n_embd: int = 2560
    n_layer: int = 1
    n_head: int = 32
    n_inner: int = 9728
    activation_function: str = "silu"
    layer_norm_epsilon: float = 1e-6
    rope_base: float = 1_000_000.0
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(model_type="gpt2", position_embedding_type="rope", hidden_size=self.n_embd)
        return out


@dataclass(frozen=True)
class MossTTSConfig:
    """Everything the model, prompt builder and sampler need from config.json."""

    backbone: BackboneConfig = field(default_factory=BackboneConfig)
    local: LocalConfig = field(default_factory=LocalConfig)
    n_vq: int = 12
    audio_vocab_size: int = 1024
    audio_pad_token_id: int = 1024
    pad_token_id: int = 151643
    im_start_token_id: int = 151644
    im_end_token_id: int = 151645
    audio_start_token_id: int = 151669
    audio_end_token_id: int = 151670
    audio_user_slot_token_id: int = 151654
    audio_assistant_slot_token_id: int = 151656
    local_text_head_mode: str = "binary"
    sampling_rate: int = 48000
    audio_tokenizer_name_or_path: str | None = None

    @property
    def hidden_size(self) -> int:
        return self.backbone.hidden_size

    @property
    def n_channels(self) -> int:
        """Channels of one prompt/generation row: text id + n_vq codes."""
        return self.n_vq + 1

    # ----------------------------------------------------------------- parsing
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> MossTTSConfig:
        if not isinstance(raw, dict):
            raise ConfigError("config.json must hold a JSON object")
        qwen = raw.get("qwen3_config")
        if qwen is None:
            qwen = raw.get("language_config")
        if qwen is None:
            qwen = {}
            logger.warning("config.json has neither qwen3_config nor language_config; using Qwen3 defaults")
        if not isinstance(qwen, dict):
            raise ConfigError("qwen3_config/language_config must be an object")
        backbone = _parse_backbone(qwen)

        gpt2 = raw.get("gpt2_config")
        local = _parse_local(gpt2, backbone, raw)

        n_vq = _int(raw, "n_vq", 12)
        audio_vocab_size = _int(raw, "audio_vocab_size", 1024)
        sizes = raw.get("audio_codebook_sizes")
        if sizes is not None:
            if not isinstance(sizes, list) or len(sizes) != n_vq:
                raise ConfigError(f"audio_codebook_sizes must be a list of n_vq={n_vq} sizes, got {sizes!r}")
            if any(int(s) != audio_vocab_size for s in sizes):
                raise ConfigError(
                    f"audio_codebook_sizes={sizes!r}: codebooks of different sizes are not supported "
                    f"(all must equal audio_vocab_size={audio_vocab_size})"
                )
        # Upstream lets audio_pad_code override audio_pad_token_id.
        pad_code = raw.get("audio_pad_code")
        audio_pad = int(pad_code) if pad_code is not None else _int(raw, "audio_pad_token_id", 1024)
        slot = raw.get("audio_assistant_gen_slot_token_id")
        if slot is None:
            slot = raw.get("audio_assistant_slot_token_id", 151656)
        # Upstream: a null/empty mode means "full_vocab"; a missing key means "binary".
        mode = raw.get("local_text_head_mode", "binary")
        mode = str(mode or "full_vocab").strip().lower()
        if mode in {"full", "full-vocab", "vocab"}:
            mode = "full_vocab"
        cfg = cls(
            backbone=backbone,
            local=local,
            n_vq=n_vq,
            audio_vocab_size=audio_vocab_size,
            audio_pad_token_id=audio_pad,
            pad_token_id=_int(raw, "pad_token_id", 151643),
            im_start_token_id=_int(raw, "im_start_token_id", 151644),
            im_end_token_id=_int(raw, "im_end_token_id", 151645),
            audio_start_token_id=_int(raw, "audio_start_token_id", 151669),
            audio_end_token_id=_int(raw, "audio_end_token_id", 151670),
            audio_user_slot_token_id=_int(raw, "audio_user_slot_token_id", 151654),
            audio_assistant_slot_token_id=int(slot),
            local_text_head_mode=mode,
            sampling_rate=_int(raw, "sampling_rate", 48000),
            audio_tokenizer_name_or_path=raw.get("audio_tokenizer_name_or_path"),
        )
        cfg.validate()
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> MossTTSConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise ConfigError(f"no config.json at {path}") from exc
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
        return cls.from_dict(raw)

    def validate(self) -> None:
        b, loc = self.backbone, self.local
        if self.n_vq <= 0:
            raise ConfigError(f"n_vq must be positive, got {self.n_vq}")
        if self.audio_vocab_size <= 0:
            raise ConfigError(f"audio_vocab_size must be positive, got {self.audio_vocab_size}")
        if self.audio_pad_token_id < self.audio_vocab_size:
            raise ConfigError(
                f"audio_pad_token_id={self.audio_pad_token_id} must be outside the audio vocab "
                f"(>= audio_vocab_size={self.audio_vocab_size})"
            )
        if loc.n_embd != b.hidden_size:
            raise ConfigError(
                f"gpt2_config.n_embd={loc.n_embd} must equal the backbone hidden_size={b.hidden_size} "
                "(audio embeddings and heads are shared between the two transformers)"
            )
        if b.num_attention_heads <= 0 or b.num_key_value_heads <= 0:
            raise ConfigError("num_attention_heads and num_key_value_heads must be positive")
        if b.num_attention_heads % b.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={b.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={b.num_key_value_heads}"
            )
        if b.head_dim <= 0 or b.head_dim % 2:
            raise ConfigError(f"backbone head_dim must be positive and even for RoPE, got {b.head_dim}")
        if b.hidden_act != "silu":
            raise ConfigError(f"qwen3_config.hidden_act={b.hidden_act!r} is not supported (only 'silu')")
        if loc.n_head <= 0 or loc.n_embd % loc.n_head:
            raise ConfigError(f"gpt2_config.n_embd={loc.n_embd} must be divisible by n_head={loc.n_head}")
        if loc.head_dim % 2:
            raise ConfigError(f"local head_dim={loc.head_dim} must be even for RoPE")
        if loc.n_layer <= 0:
            raise ConfigError(f"local transformer needs at least one layer, got {loc.n_layer}")
        if loc.activation_function not in SUPPORTED_LOCAL_ACTIVATIONS:
            raise ConfigError(
                f"gpt2_config.activation_function={loc.activation_function!r} is not supported "
                f"(one of {SUPPORTED_LOCAL_ACTIVATIONS})"
            )
        if self.local_text_head_mode not in {"binary", "full_vocab"}:
            raise ConfigError(
                f"local_text_head_mode={self.local_text_head_mode!r} is unknown ('binary' or 'full_vocab')"
            )
        for name in (
            "pad_token_id",
            "im_start_token_id",
            "im_end_token_id",
            "audio_start_token_id",
            "audio_end_token_id",
            "audio_user_slot_token_id",
            "audio_assistant_slot_token_id",
        ):
            value = getattr(self, name)
            if not 0 <= value < b.vocab_size:
                raise ConfigError(f"{name}={value} is outside the text vocab (vocab_size={b.vocab_size})")
        if self.audio_assistant_slot_token_id == self.audio_end_token_id:
            raise ConfigError("audio_assistant_slot_token_id and audio_end_token_id must differ (stop head classes)")

    # ----------------------------------------------------------------- writing
    def to_json(self) -> dict[str, Any]:
        """The config.json content in the real checkpoint's field names."""
        qwen = self.backbone.to_json()
        return {
            "model_type": "moss_tts_local",
            "architectures": ["MossTTSLocalModel"],
            "qwen3_config": qwen,
            "language_config": qwen,
            "gpt2_config": self.local.to_json(),
            "local_transformer_layers": self.local.n_layer,
            "n_vq": self.n_vq,
            "audio_vocab_size": self.audio_vocab_size,
            "audio_pad_token_id": self.audio_pad_token_id,
            "audio_pad_code": self.audio_pad_token_id,
            "pad_token_id": self.pad_token_id,
            "im_start_token_id": self.im_start_token_id,
            "im_end_token_id": self.im_end_token_id,
            "audio_start_token_id": self.audio_start_token_id,
            "audio_end_token_id": self.audio_end_token_id,
            "audio_user_slot_token_id": self.audio_user_slot_token_id,
            "audio_assistant_slot_token_id": self.audio_assistant_slot_token_id,
            "audio_assistant_gen_slot_token_id": self.audio_assistant_slot_token_id,
            "local_text_head_mode": self.local_text_head_mode,
            "sampling_rate": self.sampling_rate,
            "audio_tokenizer_name_or_path": self.audio_tokenizer_name_or_path,
            "tie_word_embeddings": self.backbone.tie_word_embeddings,
        }


def _int(raw: dict[str, Any], key: str, default: int) -> int:
    value = raw.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    return int(value)


def _float(raw: dict[str, Any], key: str, default: float) -> float:
    value = raw.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key} must be a number, got {value!r}")
    return float(value)


def _parse_backbone(qwen: dict[str, Any]) -> BackboneConfig:
    hidden = _int(qwen, "hidden_size", 4096)
    heads = _int(qwen, "num_attention_heads", 32)
    if heads <= 0:
        raise ConfigError(f"qwen3_config.num_attention_heads must be positive, got {heads}")
    kv_heads = _int(qwen, "num_key_value_heads", heads)
    head_dim = qwen.get("head_dim")
    head_dim = hidden // heads if head_dim is None else _int(qwen, "head_dim", 0)
    # The upstream decoder reads rope_theta, then rope_scaling["rope_theta"], then uses 1e6.
    # transformers 5 writes it under rope_parameters; accept that spelling too.
    theta = qwen.get("rope_theta")
    for nested in ("rope_parameters", "rope_scaling"):
        extra = qwen.get(nested)
        if theta is None and isinstance(extra, dict):
            theta = extra.get("rope_theta")
        if isinstance(extra, dict) and extra.get("rope_type", extra.get("type", "default")) not in (None, "default"):
            # Upstream ignores any scaling type, so we do too; say so because it is surprising.
            logger.warning("qwen3_config.%s=%r is ignored, as the upstream decoder does", nested, extra)
    theta = 1_000_000.0 if theta is None else float(theta)
    return BackboneConfig(
        hidden_size=hidden,
        num_hidden_layers=_int(qwen, "num_hidden_layers", 36),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=_int(qwen, "intermediate_size", 22016),
        vocab_size=_int(qwen, "vocab_size", 151936),
        rope_theta=theta,
        rms_norm_eps=_float(qwen, "rms_norm_eps", 1e-6),
        attention_bias=bool(qwen.get("attention_bias", False)),
        hidden_act=str(qwen.get("hidden_act", "silu")),
        tie_word_embeddings=bool(qwen.get("tie_word_embeddings", True)),
    )


def _parse_local(gpt2: Any, backbone: BackboneConfig, raw: dict[str, Any]) -> LocalConfig:
    if gpt2 is None:
        # Upstream builds this default when gpt2_config is absent (no rope_base: GPT2Config has none).
        gpt2 = {
            "n_embd": backbone.hidden_size,
            "n_layer": 1,
            "n_head": max(1, backbone.hidden_size // 80),
            "activation_function": "silu",
            "layer_norm_epsilon": 1e-6,
        }
        logger.warning("config.json has no gpt2_config; using the upstream default local transformer")
    if not isinstance(gpt2, dict):
        raise ConfigError("gpt2_config must be an object")
    pos_type = str(gpt2.get("position_embedding_type", "absolute")).lower()
    if pos_type != "rope":
        raise ConfigError(
            f"gpt2_config.position_embedding_type={pos_type!r} is not supported: MOSS-TTS-Local v1.5 uses 'rope'"
        )
    n_embd = gpt2.get("n_embd", gpt2.get("hidden_size"))
    n_embd = 768 if n_embd is None else int(n_embd)
    n_inner = gpt2.get("n_inner")
    n_layer = _int(gpt2, "n_layer", 12)
    if raw.get("local_transformer_layers") is not None:
        n_layer = _int(raw, "local_transformer_layers", n_layer)
    return LocalConfig(
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=_int(gpt2, "n_head", 12),
        n_inner=4 * n_embd if n_inner is None else int(n_inner),
        # transformers' GPT2Config defaults: gelu_new activation and LayerNorm eps 1e-5.
        activation_function=str(gpt2.get("activation_function", "gelu_new")),
        layer_norm_epsilon=_float(gpt2, "layer_norm_epsilon", 1e-5),
        # The upstream attention reads getattr(config, "rope_base", 10000.0).
        rope_base=_float(gpt2, "rope_base", 10000.0),
        scale_attn_weights=bool(gpt2.get("scale_attn_weights", True)),
        scale_attn_by_inverse_layer_idx=bool(gpt2.get("scale_attn_by_inverse_layer_idx", False)),
    )
