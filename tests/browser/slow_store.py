"""The service with a session store that is slow to keep short takes, as on an overloaded disk (a test launcher).

    python -m tests.browser.slow_store serve --engine scripted ...   (the arguments of `moss_rt serve`)

A take of fewer than ``SLOW_BELOW_FRAMES`` frames (one replaced early by a new Speak) takes ``DELAY_SEC`` to store.
The service stores an ended take before it sends its ``end`` and answers new requests meanwhile, so such a take's
``end`` reaches the page after the next takes' ``start`` (and even their ``end``): the order the studio must cope
with (tests/browser/test_studio_defects.py). Nothing else changes.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from moss_rt import session_store
from moss_rt.cli import main

SLOW_BELOW_FRAMES = 10
DELAY_SEC = 2.5

_put_take = session_store.SessionStore.put_take


def _slow_put_take(self: Any, session_id: str, take: Any, *args: Any, **kwargs: Any) -> Any:
    if take.n_frames < SLOW_BELOW_FRAMES:
        time.sleep(DELAY_SEC)  # a worker thread of the service: the event loop goes on
    return _put_take(self, session_id, take, *args, **kwargs)


session_store.SessionStore.put_take = _slow_put_take  # type: ignore[method-assign]

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:], prog="python -m tests.browser.slow_store"))
