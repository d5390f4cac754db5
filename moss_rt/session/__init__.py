"""A client's directing of takes, sans-I/O: it touches no socket and no tensor (codes are small numpy arrays).

Turns client intents (start, seek, cancel, text for a take fed with text) into actions for the transport, and
records what the engine produced (codes per frame) so that any take can be replayed, branched from, or downloaded.

- :mod:`~moss_rt.session.records`: a take's record (:class:`TakeRecord`), its status and ids;
- :mod:`~moss_rt.session.recent_takes`: the service's recent takes by id, shared by every connection, bounded per
  client (:class:`RecentTakes`);
- :mod:`~moss_rt.session.history`: one client's takes and the plans for its starts and seeks (:class:`TakeHistory`);
- :mod:`~moss_rt.session.actions`: what the transport is asked to do (:data:`Action`);
- :mod:`~moss_rt.session.lifecycle`: the take lifecycle as a state machine (:class:`TakeLifecycle`).

Words, one meaning each: a *take lifecycle* lives as long as its connection (or one HTTP take); a *session* is a
director's stored work (``s_…`` ids, :mod:`moss_rt.session_store`), which a connection may be bound to
(``resume``): its ended takes are then kept there. Take caps: ``RecentTakes.capacity`` (all clients, in memory),
``max_takes_kept`` (one connection's history without a session, ``Limits``), ``max_session_takes`` (one stored
session, ``Limits``).
"""

from moss_rt.session.actions import (
    Action,
    Admit,
    FinishAudio,
    FinishWords,
    Go,
    Keep,
    Replay,
    SendAudio,
    SendMessage,
    Stop,
    WordsCheckpoint,
)
from moss_rt.session.history import SeekPlan, StartPlan, TakeHistory
from moss_rt.session.lifecycle import Phase, RunKind, TakeLifecycle, continuation_id, resolve_model
from moss_rt.session.recent_takes import RecentTakes
from moss_rt.session.records import TakeRecord, TakeStatus, bytes_per_frame, new_take_id, random_seed, word_frame

__all__ = [
    "Action",
    "Admit",
    "FinishAudio",
    "FinishWords",
    "Go",
    "Keep",
    "Phase",
    "RecentTakes",
    "Replay",
    "RunKind",
    "SeekPlan",
    "SendAudio",
    "SendMessage",
    "StartPlan",
    "Stop",
    "TakeHistory",
    "TakeLifecycle",
    "TakeRecord",
    "TakeStatus",
    "WordsCheckpoint",
    "bytes_per_frame",
    "continuation_id",
    "new_take_id",
    "random_seed",
    "resolve_model",
    "word_frame",
]
