"""Files written whole: a reader (and a restart after a crash) sees the old file or the new one, never a part.

One place for the voices, the session store and the engine's records in the data dir (the kernel manifest, the
prefill cost): a temporary file beside the target, flushed to disk, renamed over it, the directory entry made durable.
Standard library only (a compile worker imports the kernel manifest without torch).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (the directory entry itself), where the OS allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``path`` so that readers (and a restart after a crash) see the old file or the new one; on an error the
    temporary file is removed and the error raised."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
