"""A front end without the model names takes' prompt blocks exactly as the engine keeps them (cluster routing):
the engine's recipe (tokenizer, config, block size) crosses a process boundary, and the names it gives equal the
engine's own keys, which the engine's journal then reports as kept."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

from moss_rt.engine.prompt_names import PromptNamer, PromptRecipe
from moss_rt.engine.prompts import prompt_rows
from moss_rt.engine.scheduler import Scheduler
from tests.engine.harness import drive, engine_settings, loaded_engine, spec

DIRECTION = {"instruction": "Warm, unhurried, a little amused.", "language": "en"}
LINES = ("The rain had stopped an hour ago, and the street was quiet.", "Nobody answered, so she knocked again.")


def test_names_equal_the_engines_keys_and_the_journal_reports_them_kept(tiny_data_dir: Path) -> None:
    with loaded_engine(engine_settings(tiny_data_dir, overlap=False)) as engine:
        sched: Scheduler = engine._scheduler  # type: ignore[assignment]
        recipe = engine.prompt_recipe()
        assert recipe is not None
        namer = PromptNamer(pickle.loads(pickle.dumps(recipe)))  # as it reaches a front end through Ray
        specs = [spec(f"t{i}", i, 6, 3, text=line, **DIRECTION) for i, line in enumerate(LINES)]
        for s in specs:
            assert namer.name(s).keys == sched.prompts.keys(prompt_rows(engine._runner, s))  # type: ignore[arg-type]
        drive(engine, specs)
        kept = set(engine.kept_prompts.since().added)
        for s in specs:
            assert set(namer.name(s).keys.full) <= kept

        # Lines of one direction share blocks beyond the opening every prompt has; lines without one share only it.
        a, b = (namer.name(s) for s in specs)
        assert a.keys.common_blocks(b.keys) > a.generic_blocks >= 1
        plain = [namer.name(spec(f"p{i}", i, 6, 3, text=line)) for i, line in enumerate(LINES)]
        assert plain[0].keys.common_blocks(plain[1].keys) == plain[0].generic_blocks

    with loaded_engine(engine_settings(tiny_data_dir, overlap=False, prompt_cache=False)) as engine:
        assert engine.prompt_recipe() is None  # nothing kept: nothing to route by


def test_naming_prompts_needs_no_torch(tiny_data_dir: Path) -> None:
    """A front end builds names from a recipe without importing torch (it never loads the model)."""
    with loaded_engine(engine_settings(tiny_data_dir, overlap=False)) as engine:
        recipe = engine.prompt_recipe()
    path = tiny_data_dir / "recipe.pickle"
    path.write_bytes(pickle.dumps(recipe))
    code = (
        "import pickle, sys\n"
        "from moss_rt.engine.base import TakeSpec\n"
        "from moss_rt.engine.prompt_names import PromptNamer\n"
        f"namer = PromptNamer(pickle.loads(open({str(path)!r}, 'rb').read()))\n"
        "print(len(namer.name(TakeSpec('x', text='Hello there.')).keys.full), 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    blocks, torch_loaded = out.stdout.split()
    assert int(blocks) >= 1 and torch_loaded == "False"
    assert isinstance(recipe, PromptRecipe)
