"""Read tensors out of ``.safetensors`` files into tensors that already exist, on any device, fast.

Why not ``safe_open``: read tensor by tensor straight to a GPU it loaded the 9 GB MOSS-TTS-Local checkpoint at about
1.2 GB/s on an H200 (7.6 s of a 33 s start), page cache warm: one small synchronous copy from pageable memory after
another. Here the file is read in large sequential pieces (``CHUNK_BYTES``) by a few threads at once, each piece into
one of a few reused page-locked (pinned) host buffers, and copied to the device asynchronously on a CUDA stream of
its own while the next pieces are read; a buffer is reused once the copies out of it are done. Host memory stays
bounded by those buffers (``workers`` x 2 x ``CHUNK_BYTES``), never a second copy of the checkpoint.

A piece may hold the tails and heads of several tensors, and a tensor larger than a piece spans several; bytes land
where they belong in the destination, which is filled in place: a contiguous destination of the file's dtype takes
the bytes as they are (no host conversion), any other gets them in a staging tensor on its device and is converted
there once all of its bytes have arrived (the same ``copy_`` a tensor read whole would get: bit for bit the same
values). Runs of unrequested tensors longer than ``SKIP_BYTES`` are not read (tied copies, an encoder not loaded).

The same code runs for CPU destinations (the tiny model, the tests) with plain buffers and synchronous copies, so the
CPU suite covers the planning, threading and conversions; only the pinned buffers and the stream are CUDA's own.
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import os
import queue
import struct
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

CHUNK_BYTES = 32 << 20  # one read: large enough for the disk and the copy engine, small enough to pin a few
SKIP_BYTES = 1 << 20  # a run of unrequested bytes at least this long is skipped, not read through
MAX_WORKERS = 4  # reading threads: the page cache copies at several GB/s each, a host-to-device copy at tens
MAX_HEADER_BYTES = 100 << 20  # the format's own bound on the JSON header

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        DTYPES[_name] = getattr(torch, _attr)


class TensorFileError(ValueError):
    """A safetensors file that cannot be read as asked: malformed, truncated, or not holding what was asked for."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a file's header: where its bytes are (absolute offsets in the file)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_header(path: str | os.PathLike[str]) -> dict[str, TensorEntry]:
    """The tensors of a ``.safetensors`` file by name, checked against the file's size (no tensor data is read)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            raw_len = fh.read(8)
            if len(raw_len) != 8:
                raise TensorFileError(f"{path.name}: too short for a safetensors file ({size} bytes)")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
                raise TensorFileError(f"{path.name}: header length {header_len} does not fit the file ({size} bytes)")
            header = json.loads(fh.read(header_len).decode("utf-8"))
    except OSError as exc:
        raise TensorFileError(f"cannot read {path}: {exc}") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TensorFileError(f"{path.name}: the header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise TensorFileError(f"{path.name}: the header is not a JSON object")
    base = 8 + header_len
    data_len = size - base
    out: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except KeyError as exc:
            raise TensorFileError(f"{path.name}: tensor {name!r}: unsupported or missing field {exc}") from None
        except (TypeError, ValueError):
            raise TensorFileError(f"{path.name}: tensor {name!r}: malformed entry {info!r}") from None
        expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if any(d < 0 for d in shape) or not 0 <= begin <= end <= data_len or end - begin != expected:
            raise TensorFileError(
                f"{path.name}: tensor {name!r} ({info['dtype']} {list(shape)}) at bytes [{begin}, {end}) does not fit "
                f"its shape or the file's {data_len} data bytes (truncated?)"
            )
        out[name] = TensorEntry(name, dtype, shape, base + begin, base + end)
    return out


# --------------------------------------------------------------------------- the plan: which bytes go where


@dataclass(frozen=True)
class Piece:
    """``length`` bytes at ``at`` in a chunk's buffer are bytes ``offset``.. of request ``job``'s tensor."""

    job: int
    offset: int
    at: int
    length: int


@dataclass(frozen=True)
class Chunk:
    """One read: ``length`` bytes from ``start`` in the file, and the pieces of tensors they hold."""

    start: int
    length: int
    pieces: tuple[Piece, ...]


def plan_chunks(
    spans: Sequence[tuple[int, int]], chunk_bytes: int = CHUNK_BYTES, skip_bytes: int = SKIP_BYTES
) -> list[Chunk]:
    """Reads covering byte ranges ``spans[job] = (start, end)`` of a file, in file order, each at most ``chunk_bytes``
    long: ranges less than ``skip_bytes`` apart are read as one run (the gap read through), a run is cut into chunks,
    and each range gets a piece in every chunk it overlaps. Ranges may overlap each other."""
    if chunk_bytes < 1:
        raise ValueError("chunk_bytes must be >= 1")
    runs: list[list[int]] = []
    for s, e in sorted((s, e) for s, e in spans if e > s):
        if runs and s - runs[-1][1] < skip_bytes:
            runs[-1][1] = max(runs[-1][1], e)
        else:
            runs.append([s, e])
    bounds = [(a, min(a + chunk_bytes, e)) for s, e in runs for a in range(s, e, chunk_bytes)]
    starts = [a for a, _ in bounds]
    pieces: list[list[Piece]] = [[] for _ in bounds]
    for job, (s, e) in enumerate(spans):
        k = bisect.bisect_right(starts, s) - 1
        while e > s and k < len(bounds) and bounds[k][0] < e:
            a, b = bounds[k]
            lo, hi = max(s, a), min(e, b)
            if hi > lo:
                pieces[k].append(Piece(job, lo - s, lo - a, hi - lo))
            k += 1
    return [Chunk(a, b - a, tuple(p)) for (a, b), p in zip(bounds, pieces, strict=True) if p]


# --------------------------------------------------------------------------- reading


@dataclass
class _Job:
    entry: TensorEntry
    targets: list[torch.Tensor]  # where the values go (one tensor, or several asking for the same name)
    direct: torch.Tensor | None  # the first target's bytes, when they can take the file's bytes as they are
    staging: torch.Tensor | None = None  # bytes of the tensor on the first target's device, converted at the end
    remaining: int = 0  # bytes not yet copied
    lock: threading.Lock = field(default_factory=threading.Lock)


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).view(torch.uint8)


@dataclass
class _Buffer:
    host: torch.Tensor  # uint8, pinned when the copies go to a GPU
    array: np.ndarray[Any, Any]  # the same memory, for the reads
    event: Any = None  # the last copies out of it (CUDA), waited for before it is filled again


class _Reader:
    """Reads one file's chunks on up to ``workers`` threads and scatters their bytes to the jobs' targets."""

    def __init__(self, path: Path, jobs: list[_Job], chunks: list[Chunk], workers: int) -> None:
        self.path, self.jobs, self.chunks = path, jobs, chunks
        # The caller's inference mode, in the reading threads too: byte views made under it are written under it.
        self.inference = torch.is_inference_mode_enabled()
        cuda = {t.device for job in jobs for t in job.targets if t.device.type == "cuda"}
        if len(cuda) > 1:
            raise ValueError(f"destinations on several GPUs ({sorted(map(str, cuda))}): read each device's apart")
        self.device = cuda.pop() if cuda else None
        self.stream = torch.cuda.Stream(self.device) if self.device is not None else None
        self.workers = max(1, min(workers, len(chunks)))
        size = max((c.length for c in chunks), default=1)
        pinned = self.device is not None
        self.free: queue.Queue[_Buffer] = queue.Queue()
        for _ in range(min(len(chunks), 2 * self.workers)):
            host = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
            self.free.put(_Buffer(host, host.numpy()))

    def run(self) -> None:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # larger read-ahead from a cold disk
            if self.stream is not None:
                # Targets made on this thread's stream (allocated, maybe zeroed) are ready before the copies start.
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
            if self.workers == 1:
                for chunk in self.chunks:
                    self._chunk(fd, chunk)
            else:
                with ThreadPoolExecutor(self.workers, thread_name_prefix="moss-rt-read") as pool:
                    futures = [pool.submit(self._chunk, fd, chunk) for chunk in self.chunks]
                    try:
                        for done in futures:
                            done.result()
                    except BaseException:
                        for future in futures:
                            future.cancel()  # a bad file: the chunks not started yet are not read
                        raise
        finally:
            if self.stream is not None:
                self.stream.synchronize()  # every byte and conversion landed before the targets are used
            os.close(fd)

    def _chunk(self, fd: int, chunk: Chunk) -> None:
        buf = self.free.get()
        try:
            if buf.event is not None:
                buf.event.synchronize()  # the copies out of its previous chunk are done
            _read_exactly(fd, buf.array, chunk.start, chunk.length, self.path)
            with torch.inference_mode(self.inference), torch.no_grad():
                if self.stream is not None:
                    with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                        self._scatter(buf.host, chunk)
                    buf.event = torch.cuda.Event()
                    buf.event.record(self.stream)
                else:
                    self._scatter(buf.host, chunk)
        finally:
            self.free.put(buf)

    def _scatter(self, host: torch.Tensor, chunk: Chunk) -> None:
        for piece in chunk.pieces:
            job = self.jobs[piece.job]
            src = host[piece.at : piece.at + piece.length]
            if job.direct is not None:
                dst = job.direct
            else:
                with job.lock:
                    if job.staging is None:  # made on the copy stream: freed there, in order, once converted
                        job.staging = torch.empty(job.entry.nbytes, dtype=torch.uint8, device=job.targets[0].device)
                dst = job.staging
            dst[piece.offset : piece.offset + piece.length].copy_(src, non_blocking=dst.is_cuda)
            with job.lock:
                job.remaining -= piece.length
                last = job.remaining == 0
            if last:  # every other piece of it was copied before its thread counted it: convert after them
                self._finish(job)

    @staticmethod
    def _finish(job: _Job) -> None:
        first = job.targets[0]
        if job.staging is not None:
            first.detach().copy_(job.staging.view(job.entry.dtype).view(job.entry.shape))
            job.staging = None
        for other in job.targets[1:]:
            if other.data_ptr() != first.data_ptr():
                other.detach().copy_(first)


def _read_exactly(fd: int, array: np.ndarray[Any, Any], offset: int, length: int, path: Path) -> None:
    view = memoryview(array)[:length]  # type: ignore[arg-type]
    done = 0
    while done < length:
        if hasattr(os, "preadv"):
            n = os.preadv(fd, [view[done:]], offset + done)
        else:  # pragma: no cover - platforms without preadv
            data = os.pread(fd, length - done, offset + done)
            n = len(data)
            view[done : done + n] = data
        if n <= 0:
            raise TensorFileError(f"{path.name}: ends at byte {offset + done}, expected {offset + length} (truncated)")
        done += n


def read_into(
    path: str | os.PathLike[str],
    requests: Iterable[tuple[str, torch.Tensor]],
    *,
    header: dict[str, TensorEntry] | None = None,
    workers: int = MAX_WORKERS,
    chunk_bytes: int = CHUNK_BYTES,
) -> None:
    """Fill each tensor of ``requests`` (name in the file, tensor of that exact shape on any device and of any dtype)
    with the file's tensor of that name, converted to the tensor's dtype on the tensor's device. A name may be asked
    for by several tensors. Raises :class:`TensorFileError` for a missing name, a shape mismatch or a bad file."""
    path = Path(path)
    entries = header if header is not None else read_header(path)
    by_name: dict[str, _Job] = {}
    for name, target in requests:
        entry = entries.get(name)
        if entry is None:
            raise TensorFileError(f"{path.name} has no tensor {name!r}")
        if tuple(target.shape) != entry.shape:
            raise TensorFileError(f"{name}: file shape {entry.shape} != destination shape {tuple(target.shape)}")
        job = by_name.get(name)
        if job is not None:
            job.targets.append(target)
            continue
        same = target.dtype == entry.dtype and target.is_contiguous()
        by_name[name] = _Job(entry, [target], _byte_view(target) if same else None, remaining=entry.nbytes)
    jobs = [job for job in by_name.values()]
    for job in jobs:
        if job.entry.nbytes == 0:
            _Reader._finish(job)  # nothing to read (an empty tensor), but every target is filled
    jobs = [job for job in jobs if job.entry.nbytes]
    if not jobs:
        return
    chunks = plan_chunks([(job.entry.start, job.entry.end) for job in jobs], chunk_bytes)
    _Reader(path, jobs, chunks, workers).run()


def free_pinned_cache() -> None:
    """Give the page-locked buffers cached by PyTorch's host allocator back to the system (best effort)."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None and torch.cuda.is_available():
        try:
            empty()
        except Exception:  # noqa: BLE001 - best effort: the buffers stay cached, nothing else changes
            log.debug("could not empty the pinned host cache", exc_info=True)
