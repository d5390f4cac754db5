"""OpenAI's voice and model names, mapped to ours for ``/v1/audio/speech`` (sans-I/O).

Tools built for OpenAI's speech API hard-code its names (``voice="alloy"``, ``model="tts-1"``); without
a map they got a 400 and a 404 here (issue 23, finding 14). The maps are settings
(``openai_voice_aliases``, ``openai_model_aliases``: ``name=target`` pairs), on by default: every OpenAI
voice speaks with ``none`` (the model's own voice, chosen by the seed) until the operator maps it to a
built-in or uploaded voice, and every OpenAI model name is the default model. An empty map turns aliases
off. A name that is also one of our own voices or models means ours.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

# OpenAI's built-in TTS voices and its speech model names (as its API reference lists them).
OPENAI_VOICES = (
    "alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin", "nova", "onyx", "sage", "shimmer", "verse",
)  # fmt: skip
OPENAI_MODELS = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")
DEFAULT_MODEL_TARGET = "default"  # an alias target: whatever the engine's default model is
DEFAULT_VOICE_ALIASES: tuple[str, ...] = tuple(f"{voice}=none" for voice in OPENAI_VOICES)
DEFAULT_MODEL_ALIASES: tuple[str, ...] = tuple(f"{model}={DEFAULT_MODEL_TARGET}" for model in OPENAI_MODELS)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$")


def parse_pairs(pairs: Iterable[str], setting: str) -> dict[str, str]:
    """``("alloy=narrator", ...)`` → ``{"alloy": "narrator"}``; ValueError naming ``setting`` for a bad entry."""
    out: dict[str, str] = {}
    for pair in pairs:
        name, sep, target = (part.strip() for part in pair.partition("="))
        if not sep or not _NAME.match(name) or not _NAME.match(target):
            raise ValueError(f"{setting}: {pair!r} is not NAME=TARGET (letters, digits, _ . : -)")
        if name in out:
            raise ValueError(f"{setting}: {name!r} is mapped twice")
        out[name] = target
    return out


@dataclass(frozen=True)
class OpenAIAliases:
    voices: Mapping[str, str] = field(default_factory=dict)
    models: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, voice_pairs: Iterable[str], model_pairs: Iterable[str]) -> OpenAIAliases:
        return cls(
            parse_pairs(voice_pairs, "openai_voice_aliases"), parse_pairs(model_pairs, "openai_model_aliases")
        )

    def voice(self, name: str) -> str | None:
        """Our voice for an OpenAI voice name (None: not an alias)."""
        return self.voices.get(name)

    def model(self, name: str, default_model: str) -> str | None:
        """Our model for an OpenAI model name (None: not an alias)."""
        target = self.models.get(name)
        return default_model if target == DEFAULT_MODEL_TARGET else target
