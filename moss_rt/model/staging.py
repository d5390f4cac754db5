"""Small host arrays onto the device in one copy, through pinned buffers that are kept (a round's staged writes).

A round's admissions reach the device as a few small arrays (block-table rows, per-slot scalars, presence rows:
ModelRunner.apply_staged). Pinning each on its own (``Tensor.pin_memory``) asks the caching host allocator for a
block per array and call: on an H200 during a script render those writes took ~8 ms of the engine thread's CPU
a round and twice that in wall time (bench/RESULTS.md, session 12; bench/staged_copy.py times both ways). Here
they are packed into one pinned buffer, written through numpy (no torch call), and copied with one
``copy_(non_blocking=True)`` into a device buffer that is kept too.

A pinned buffer may be written again only once the copy out of it ran: each records an event after its copy, and
the ring takes the next buffer whose event is done, adding one (up to ``MAX_BUFFERS``) rather than waiting for the
device. The device buffer is reused on the same stream, so the kernels that read the previous call's views run
before the next copy overwrites them: the views are valid until the next ``copy`` (read them at once).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

ALIGN = 16  # bytes: every array starts at a multiple, so any dtype's view of the buffer is aligned
MAX_BUFFERS = 8  # pinned buffers in the ring: beyond, a call waits for the oldest copy (the device is that far behind)
MIN_BYTES = 1 << 16


class _Pinned:
    def __init__(self, nbytes: int) -> None:
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.array: np.ndarray = self.tensor.numpy()
        self.event = torch.cuda.Event()
        self.used = False  # its event was recorded at least once

    def free(self) -> bool:
        return not self.used or self.event.query()


class PinnedStaging:
    """``copy(arrays)`` -> device tensors of the same shapes and dtypes, in one host-to-device copy (CUDA); on other
    devices plain tensors of copies of the arrays."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._ring: list[_Pinned] = []
        self._next = 0
        self._dev: torch.Tensor | None = None
        self._dev_views: dict[torch.dtype, torch.Tensor] = {}

    @staticmethod
    def _layout(arrays: Sequence[np.ndarray]) -> tuple[list[int], int]:
        offsets, end = [], 0
        for a in arrays:
            offsets.append(end)
            end += -(-a.nbytes // ALIGN) * ALIGN
        return offsets, end

    def copy(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        if self.device.type != "cuda":
            return [torch.from_numpy(np.array(a, copy=True)) for a in arrays]
        offsets, total = self._layout(arrays)
        buf = self._buffer(max(total, 1))
        host = buf.array
        for a, at in zip(arrays, offsets, strict=True):
            host[at : at + a.nbytes].view(a.dtype).reshape(a.shape)[...] = a
        dev = self._device_buffer(total)
        dev[:total].copy_(buf.tensor[:total], non_blocking=True)
        buf.event.record()
        buf.used = True
        out = []
        for a, at in zip(arrays, offsets, strict=True):
            dtype = _TORCH_DTYPE[a.dtype.str]
            view = self._dev_views[dtype]
            size = int(np.prod(a.shape, dtype=np.int64))
            start = at // view.element_size()
            out.append(view[start : start + size].view(a.shape))
        return out

    def _buffer(self, nbytes: int) -> _Pinned:
        """The ring's next buffer whose last copy ran, at least ``nbytes`` long."""
        for k in range(len(self._ring)):
            i = (self._next + k) % len(self._ring)
            if self._ring[i].free():
                return self._take(i, nbytes)
        if len(self._ring) < MAX_BUFFERS:
            self._ring.append(_Pinned(max(MIN_BYTES, _grown(nbytes))))
            return self._take(len(self._ring) - 1, nbytes)
        i = self._next % len(self._ring)
        self._ring[i].event.synchronize()  # the device is MAX_BUFFERS calls behind: wait for the oldest
        return self._take(i, nbytes)

    def _take(self, i: int, nbytes: int) -> _Pinned:
        if self._ring[i].array.nbytes < nbytes:
            self._ring[i] = _Pinned(_grown(nbytes))  # the old one's copy ran (free): dropping it is safe
        self._next = i + 1
        return self._ring[i]

    def _device_buffer(self, nbytes: int) -> torch.Tensor:
        if self._dev is None or self._dev.numel() < nbytes:
            # Freed while kernels queued on this stream may still read it: the caching allocator reuses its memory
            # only for work ordered after them on the same stream.
            self._dev = torch.empty(max(MIN_BYTES, _grown(nbytes)), dtype=torch.uint8, device=self.device)
            self._dev_views = {dt: self._dev.view(dt) for dt in _TORCH_DTYPE.values()}
        return self._dev


def _grown(nbytes: int) -> int:
    """A buffer size for ``nbytes``: the next power of two (a ring that grows rarely)."""
    return 1 << max(0, int(nbytes - 1).bit_length())


_TORCH_DTYPE = {
    np.dtype(np.int64).str: torch.int64,
    np.dtype(np.int32).str: torch.int32,
    np.dtype(np.float32).str: torch.float32,
    np.dtype(np.bool_).str: torch.bool,
    np.dtype(np.uint8).str: torch.uint8,
}
