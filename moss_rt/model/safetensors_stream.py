"""Write a .safetensors file one tensor at a time (the header is known up front).

``safetensors.torch.save_file`` needs every tensor in memory at once; a 4.55B-parameter
random checkpoint would then need ~9 GB of host memory. Here only one tensor is alive.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

_DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def write_streaming(
    path: str | Path,
    specs: Iterable[tuple[str, tuple[int, ...]]],
    dtype: torch.dtype,
    make: Callable[[str, tuple[int, ...]], torch.Tensor],
    metadata: dict[str, str] | None = None,
) -> int:
    """Write tensors named/shaped by ``specs`` (in that order), each produced by ``make``.

    Returns the number of bytes written.
    """
    specs = list(specs)
    item = torch.empty((), dtype=dtype).element_size()
    header: dict[str, object] = {}
    offset = 0
    for name, shape in specs:
        size = item
        for dim in shape:
            size *= int(dim)
        header[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = dict(metadata)
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the format aligns the data section to 8 bytes
    path = Path(path)
    with path.open("wb") as handle:
        handle.write(struct.pack("<Q", len(raw)))
        handle.write(raw)
        for name, shape in specs:
            # Convert where the tensor was made (e.g. on the GPU), then copy the smaller result to the host.
            tensor = make(name, tuple(shape)).detach().to(dtype).to("cpu").contiguous()
            if tuple(tensor.shape) != tuple(shape):
                raise ValueError(f"{name}: produced shape {tuple(tensor.shape)}, expected {tuple(shape)}")
            handle.write(tensor.view(torch.uint8).numpy().data)
    return 8 + len(raw) + offset
