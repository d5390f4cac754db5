"""Reading safetensors files in large pieces into existing tensors (moss_rt/safetensors_read.py), on the CPU: the
same values as safe_open bit for bit, whatever the piece size, thread count, dtypes and layouts; clear errors.
The CUDA path (pinned buffers, a copy stream) is tests/gpu/test_weights_gpu.py."""

from __future__ import annotations

import random
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moss_rt.safetensors_read import TensorFileError, plan_chunks, read_header, read_into


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(33, 17, generator=gen).to(torch.bfloat16),
        "b.bias": torch.randn(5, generator=gen),
        "c.table": torch.randn(4, 3, 2, generator=gen).to(torch.float16),
        "d.ids": torch.arange(11, dtype=torch.int64),
        "e.mask": torch.tensor([True, False, True]),
        "f.empty": torch.zeros(0, 4),
        "g.scalar": torch.tensor(2.5),
        "h.big": torch.randn(300, 40, generator=gen),
    }


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("st") / "model.safetensors"
    save_file(_tensors(), str(path))
    return path


def _reference(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as fh:
        return {name: fh.get_tensor(name) for name in fh.keys()}


def test_the_header_lists_every_tensor_where_safe_open_finds_it(checkpoint: Path) -> None:
    header = read_header(checkpoint)
    reference = _reference(checkpoint)
    assert set(header) == set(reference)
    raw = checkpoint.read_bytes()
    for name, entry in header.items():
        assert entry.dtype == reference[name].dtype and entry.shape == tuple(reference[name].shape)
        stored = reference[name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert raw[entry.start : entry.end] == stored, name


@pytest.mark.parametrize(("chunk_bytes", "workers"), [(7, 1), (64, 3), (1000, 2), (1 << 20, 4)])
def test_values_equal_safe_opens_bit_for_bit_whatever_the_pieces(
    checkpoint: Path, chunk_bytes: int, workers: int
) -> None:
    reference = _reference(checkpoint)
    targets = {name: torch.full_like(t, 7) if t.numel() else torch.empty_like(t) for name, t in reference.items()}
    read_into(checkpoint, targets.items(), chunk_bytes=chunk_bytes, workers=workers)
    for name, tensor in reference.items():
        assert targets[name].dtype == tensor.dtype
        assert torch.equal(targets[name], tensor), name


def test_other_dtypes_layouts_and_names_asked_twice(checkpoint: Path) -> None:
    reference = _reference(checkpoint)
    as_fp32 = torch.empty(33, 17)  # bf16 in the file: converted exactly as .to(float32) does
    as_bf16 = torch.empty(300, 40, dtype=torch.bfloat16)  # fp32 in the file: rounded as .to(bfloat16) does
    strided = torch.empty(17, 33, dtype=torch.bfloat16).t()  # not contiguous: filled through a staging copy
    again = torch.empty(33, 17, dtype=torch.bfloat16)
    read_into(
        checkpoint,
        [("a.weight", as_fp32), ("h.big", as_bf16), ("a.weight", strided), ("a.weight", again)],
        chunk_bytes=100,
        workers=2,
    )
    assert torch.equal(as_fp32, reference["a.weight"].float())
    assert torch.equal(as_bf16, reference["h.big"].to(torch.bfloat16))
    assert torch.equal(strided, reference["a.weight"]) and torch.equal(again, reference["a.weight"])


def test_plan_covers_every_requested_byte_once_and_skips_long_gaps() -> None:
    rng = random.Random(1)
    for _ in range(200):
        spans, at = [], 0
        for _ in range(rng.randint(1, 12)):
            at += rng.choice([0, 0, 3, 50, 5000])
            size = rng.choice([0, 1, 9, 100, 3000])
            spans.append((at, at + size))
            at += size
        if rng.random() < 0.3:
            spans.append(spans[rng.randrange(len(spans))])  # one range asked for twice
        rng.shuffle(spans)
        chunk_bytes, skip = rng.choice([1, 8, 64, 4096]), rng.choice([1, 60, 10_000])
        chunks = plan_chunks(spans, chunk_bytes, skip)
        covered: dict[int, list[int]] = {job: [] for job in range(len(spans))}
        for chunk in chunks:
            assert 0 < chunk.length <= chunk_bytes
            for piece in chunk.pieces:
                assert 0 <= piece.at and piece.at + piece.length <= chunk.length
                first = spans[piece.job][0] + piece.offset
                assert first == chunk.start + piece.at  # the piece is where its bytes are in the file
                covered[piece.job].extend(range(piece.offset, piece.offset + piece.length))
        for job, (s, e) in enumerate(spans):
            assert sorted(covered[job]) == list(range(e - s)), (spans, job)
        read = sum(c.length for c in chunks)
        wanted = len({b for s, e in spans for b in range(s, e)})
        assert read < wanted + skip * (len(spans) + 1)  # only gaps shorter than skip_bytes are read through
        starts = [c.start for c in chunks]
        assert starts == sorted(starts)


def test_missing_names_wrong_shapes_and_damaged_files_are_clear_errors(checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(TensorFileError, match="no tensor 'nope'"):
        read_into(checkpoint, [("nope", torch.empty(1))])
    with pytest.raises(TensorFileError, match=r"b.bias: file shape \(5,\) != destination shape \(6,\)"):
        read_into(checkpoint, [("b.bias", torch.empty(6))])

    raw = checkpoint.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(raw[:-100])
    with pytest.raises(TensorFileError, match="truncated"):
        read_header(cut)
    short = tmp_path / "short.safetensors"
    short.write_bytes(raw[:5])
    with pytest.raises(TensorFileError, match="too short"):
        read_header(short)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(struct.pack("<Q", 6) + b"{nope}" + b"\0" * 16)
    with pytest.raises(TensorFileError, match="not JSON"):
        read_header(garbage)
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(TensorFileError, match="does not fit the file"):
        read_header(huge)
    # A header that promises more bytes than the file holds, read past its end: the read says so.
    header = read_header(checkpoint)
    lying = tmp_path / "lying.safetensors"
    lying.write_bytes(raw)
    with lying.open("r+b") as fh:
        fh.truncate(header["h.big"].start + 10)
    with pytest.raises(TensorFileError, match="truncated"):
        read_into(lying, [("h.big", torch.empty(300, 40))], header=header, chunk_bytes=64, workers=2)


@torch.inference_mode()
def test_parameters_are_filled_from_inference_mode_on_reading_threads(checkpoint: Path) -> None:
    # The loaders run under inference mode; the pieces are copied on other threads, which must follow it.
    reference = _reference(checkpoint)
    weight = torch.nn.Parameter(torch.zeros(300, 40))  # requires grad, as a module's parameter before eval()
    read_into(checkpoint, [("h.big", weight)], chunk_bytes=1000, workers=3)
    assert torch.equal(weight.detach(), reference["h.big"])
