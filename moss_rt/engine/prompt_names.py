"""A take's prompt block keys, computed where the model is not loaded (a cluster's front end).

The prompt cache keeps a prompt's blocks under a chain of digests of its rows (prompt_cache.prompt_keys), and
rows come from the text through the tokenizer (model/prompt.py). Building them needs the tokenizer and a few
token ids of the model's config, never the weights: a replica hands its front ends a :class:`PromptRecipe`
(the tokenizer as its JSON, the config, the block size), and :class:`PromptNamer` then names any take's
prompt blocks exactly as that replica's engine will, through the same functions.

Every prompt opens with rows that do not depend on the voice, direction or line (the user turn's header and,
without a reference, the "None" fields). Every replica soon keeps those; a match on them says nothing about
where a take belongs, so :attr:`NamedPrompt.generic_blocks` counts them and routing looks past them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from moss_rt.engine.base import TakeSpec
from moss_rt.engine.prompt_cache import PromptKeys, prompt_keys
from moss_rt.engine.prompts import prompt_rows
from moss_rt.model.config import MossTTSConfig
from moss_rt.model.prompt import build_prompt_rows


@dataclass(frozen=True)
class PromptRecipe:
    """What naming prompt blocks needs: small and picklable (a real tokenizer's JSON is ~10 MB, sent once)."""

    tokenizer_json: str
    config: MossTTSConfig
    block_size: int

    @staticmethod
    def of(tokenizer: Any, config: MossTTSConfig, block_size: int) -> PromptRecipe | None:
        """None for a tokenizer that cannot be written as JSON (only ``tokenizers.Tokenizer`` can)."""
        to_str = getattr(tokenizer, "to_str", None)
        if to_str is None:
            return None
        return PromptRecipe(to_str(), config, int(block_size))


@dataclass(frozen=True)
class NamedPrompt:
    keys: PromptKeys
    generic_blocks: int  # leading full blocks every prompt without voice and direction shares
    block_size: int


class PromptNamer:
    """Prompt rows and block keys of takes, as the engine that made the recipe computes them (thread-safe)."""

    def __init__(self, recipe: PromptRecipe) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_str(recipe.tokenizer_json)
        self.config = recipe.config
        self.block_size = recipe.block_size
        self._generic = prompt_keys(self.build_prompt(text=""), self.block_size)

    def build_prompt(
        self,
        *,
        text: str,
        instruction: str = "",
        language: str = "",
        tokens: int | None = None,
        reference_codes: np.ndarray | None = None,
    ) -> np.ndarray:
        """The same rows as ``ModelRunner.build_prompt`` (so :func:`prompt_rows` takes either)."""
        return build_prompt_rows(
            self.tokenizer,
            self.config,
            text=text,
            instruction=instruction,
            language=language,
            tokens=tokens,
            reference_codes=reference_codes,
        )

    def name(self, spec: TakeSpec) -> NamedPrompt:
        """The keys of the take's prompt rows (its kept frames, for a retake, are not part of them)."""
        keys = prompt_keys(prompt_rows(self, spec), self.block_size)
        return NamedPrompt(keys, keys.common_blocks(self._generic), self.block_size)
