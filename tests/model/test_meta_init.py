"""Building the networks on the meta device skips nn.Embedding's random init (moss_rt/meta_init.py): there it ran
through a Python reference importing torch._dynamo, about 1.5 s of the engine's start; elsewhere nothing changes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

from moss_rt.meta_init import embedding

ROOT = Path(__file__).resolve().parents[2]


def test_loading_the_model_and_codec_never_imports_dynamo() -> None:
    code = (
        "import sys, torch\n"
        "from moss_rt.model.loader import load_model\n"
        "from moss_rt.codec import load_codec\n"
        "load_model('tests/fixtures/model/tiny')\n"
        "load_codec('tests/fixtures/codec/tiny')\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_off_the_meta_device_an_embedding_is_initialised_as_torch_does() -> None:
    torch.manual_seed(7)
    ours = embedding(50, 8)
    torch.manual_seed(7)
    theirs = nn.Embedding(50, 8)
    assert torch.equal(ours.weight, theirs.weight)
    with torch.device("meta"):
        lazy = embedding(50, 8)
    assert lazy.weight.is_meta and tuple(lazy.weight.shape) == (50, 8) and lazy.weight.requires_grad
