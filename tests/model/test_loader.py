"""Checkpoint loading: real layout, tied copies, dtypes, errors, hub/offline resolution."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moss_rt.model import ModelSourceError, MossTTSConfig, load_model, resolve_model_source
from moss_rt.model.tiny import checkpoint_specs, full_config
from tests.model.conftest import TINY


def test_full_layout_has_the_438_real_tensor_names():
    specs = dict(checkpoint_specs(full_config()))
    assert len(specs) == 438
    assert sum(math.prod(s) for s in specs.values()) == 4_550_403_584
    assert specs["transformer.embed_tokens.weight"] == (151936, 2560)
    assert specs["transformer.layers.35.self_attn.q_proj.weight"] == (4096, 2560)
    assert specs["transformer.layers.0.self_attn.k_norm.weight"] == (128,)
    assert specs["transformer.layers.0.mlp.down_proj.weight"] == (2560, 9728)
    assert specs["local_transformer.h.0.attn.c_attn.weight"] == (7680, 2560)
    assert specs["local_transformer.h.0.mlp.fc_in.bias"] == (9728,)
    assert specs["local_transformer.ln_f.bias"] == (2560,)
    assert specs["audio_lm_heads.11.weight"] == (1024, 2560)
    assert specs["local_text_lm_head.weight"] == (2, 2560)
    assert specs["text_lm_head.weight"] == (151936, 2560)


def test_tiny_fixture_is_in_the_real_layout_with_tied_copies():
    with safe_open(str(TINY / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert keys == {name for name, _ in checkpoint_specs(MossTTSConfig.from_file(TINY))}
        assert torch.equal(f.get_tensor("text_lm_head.weight"), f.get_tensor("transformer.embed_tokens.weight"))
        assert torch.equal(f.get_tensor("audio_lm_heads.3.weight"), f.get_tensor("audio_embeddings.3.weight"))
        assert f.get_tensor("transformer.norm.weight").dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_values_dtype_and_ties(dtype):
    loaded = load_model(TINY, dtype=dtype)
    model = loaded.model
    file = load_file(str(TINY / "model.safetensors"))
    for name, tensor in model.state_dict().items():
        assert tensor.dtype == dtype
        assert torch.equal(tensor, file[name].to(dtype)), name
    assert model.text_lm_head.weight is model.transformer.embed_tokens.weight
    assert model.audio_lm_heads[5].weight is model.audio_embeddings[5].weight
    assert loaded.source.demo and loaded.source.kind == "local"


def _copy(tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(TINY, dst)
    return dst


def test_checkpoint_without_tied_copies_or_with_only_the_head_copy(tmp_path):
    dst = _copy(tmp_path)
    tensors = load_file(str(dst / "model.safetensors"))
    tensors.pop("text_lm_head.weight")
    # audio table 2 stored only under its tied head name
    tensors["audio_lm_heads.2.weight"] = tensors.pop("audio_embeddings.2.weight")
    save_file(tensors, str(dst / "model.safetensors"))
    model = load_model(dst).model
    assert torch.equal(model.audio_embeddings[2].weight, tensors["audio_lm_heads.2.weight"].float())
    assert torch.equal(model.text_lm_head.weight, tensors["transformer.embed_tokens.weight"].float())


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.pop("transformer.layers.1.mlp.up_proj.weight"), "lacks tensor 'transformer.layers.1.mlp.up_proj"),
        (lambda t: t.__setitem__("extra.weight", torch.zeros(2)), "tensors the model does not"),
        (lambda t: t.__setitem__("local_text_lm_head.weight", torch.zeros(3, 64)), "checkpoint shape \\(3, 64\\)"),
    ],
)
def test_broken_checkpoints_fail_clearly(tmp_path, edit, message):
    dst = _copy(tmp_path)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(ModelSourceError, match=message):
        load_model(dst)


def test_folder_without_weights_is_not_a_checkpoint(tmp_path):
    dst = _copy(tmp_path)
    (dst / "model.safetensors").unlink()
    with pytest.raises(ModelSourceError, match="not a checkpoint folder"):
        resolve_model_source(str(dst))


def test_hub_id_offline_and_not_cached_gives_a_clear_error(tmp_path, monkeypatch):
    with pytest.raises(ModelSourceError, match="offline mode"):
        resolve_model_source("nobody/no-such-model", cache_dir=tmp_path, offline=True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelSourceError, match="nobody/no-such-model"):
        load_model("nobody/no-such-model", cache_dir=tmp_path)


def test_unknown_spec_and_tiny_source(tmp_path):
    with pytest.raises(ModelSourceError, match="neither a folder"):
        resolve_model_source("./does/not/exist")
    source = resolve_model_source("tiny", tiny_dir=tmp_path / "t")
    assert source.demo and source.kind == "tiny"
    assert json.loads((source.path / "config.json").read_text())["n_vq"] == 12


def test_full_vocab_stop_head_uses_text_lm_head_rows(tmp_path):
    dst = _copy(tmp_path)
    raw = json.loads((dst / "config.json").read_text())
    raw["local_text_head_mode"] = "full_vocab"
    (dst / "config.json").write_text(json.dumps(raw))
    tensors = load_file(str(dst / "model.safetensors"))
    tensors.pop("local_text_lm_head.weight")
    save_file(tensors, str(dst / "model.safetensors"))
    model = load_model(dst).model
    assert model.local_text_lm_head is None
    z = torch.randn(3, 64)
    cfg = model.config
    rows = model.text_lm_head.weight[[cfg.audio_assistant_slot_token_id, cfg.audio_end_token_id]]
    assert torch.allclose(model.stop_logits(z), z @ rows.T)


def test_hub_download_fetches_sharded_weights(tmp_path, monkeypatch):
    """A hub repo with model.safetensors.index.json + shards (no model.safetensors) downloads and loads."""
    import fnmatch

    import huggingface_hub

    repo = tmp_path / "repo"
    repo.mkdir()
    for f in TINY.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, repo / f.name)
    tensors = load_file(str(TINY / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        shard = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, str(repo / shard), metadata={"format": "pt"})
        weight_map.update({k: shard for k in part})
    (repo / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    def fake_snapshot_download(repo_id, *, allow_patterns, cache_dir=None, local_files_only=False, **_):
        out = tmp_path / "snapshot"
        out.mkdir(exist_ok=True)
        for f in repo.iterdir():
            if any(fnmatch.fnmatch(f.name, p) for p in allow_patterns):  # what the hub would send
                shutil.copy(f, out / f.name)
        return str(out)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    loaded = load_model("org/sharded-model")
    reference = load_model(TINY)
    assert sorted(p.name for p in (tmp_path / "snapshot").glob("model-*.safetensors")) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    for (name, a), (_, b) in zip(loaded.model.state_dict().items(), reference.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
