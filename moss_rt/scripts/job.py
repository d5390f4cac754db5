"""A script render job in memory: its lines' state, the renders running, its event log, and what clients see.

The rows in :mod:`moss_rt.scripts.store` are the record; a :class:`Job` mirrors them while the script is in use
and adds what only lives in this process (the tasks rendering lines, the listeners). Its views (:meth:`Job.view`,
:meth:`Job.line_view`, :meth:`Job.progress`) are the bodies of ``GET /api/scripts/{id}`` and of the events.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from moss_rt.generation import FRAME_RATE, FRAME_SAMPLES
from moss_rt.protocol import Limits
from moss_rt.scripts.events import EventLog
from moss_rt.scripts.format import Cue, Script, parse_json_script
from moss_rt.scripts.store import DONE, FAILED, PENDING, LineRow, ScriptRow, short_script_id
from moss_rt.scripts.timeline import LineAudio

# Stored scripts are read back without today's limits: a script accepted once stays renderable if they tighten.
_UNBOUNDED = Limits(
    max_text_chars=10**9, max_instruction_chars=10**9, max_new_tokens=10**9, max_script_lines=10**9,
    max_pause_sec=1e12, max_gap_sec=1e12,
)  # fmt: skip

RENDERING = "rendering"
QUEUED = "queued"


def script_from_source(source: dict[str, Any]) -> Script:
    return parse_json_script(source, _UNBOUNDED)


@dataclass
class LineState:
    cue: Cue
    row: LineRow

    @property
    def done(self) -> bool:
        return self.row.status == DONE

    @property
    def needs_render(self) -> bool:
        return self.row.status == PENDING or self.row.render is not None


@dataclass
class Job:
    script_id: str
    session_id: str
    client: str  # the address that posted it: its renders' fair share is this client's
    script: Script
    created: float
    lines: dict[int, LineState]
    failure: str | None = None
    log: EventLog = field(default_factory=EventLog)
    tasks: dict[int, asyncio.Task[None]] = field(default_factory=dict)  # a render running per line
    runner: asyncio.Task[None] | None = None  # the batch render of the lines that need one
    announced_done: bool = False
    elsewhere: bool = False  # another front end renders it now (its events are not seen here)
    no_room: str | None = None  # why the batch render's takes cannot be kept (storage spent): its later lines fail
    _last_progress: dict[str, Any] | None = None
    _scenes: dict[int, int] = field(default_factory=dict)  # line → scene (the script never changes)

    def __post_init__(self) -> None:
        self._scenes = self.script.scene_of()

    @classmethod
    def of_row(cls, row: ScriptRow) -> Job:
        script = script_from_source(row.source)
        cues = {cue.number: cue for cue in script.cues}
        lines = {r.line: LineState(cues[r.line], r) for r in row.lines if r.line in cues}
        return cls(row.script_id, row.session_id, row.client, script, row.created, lines, failure=row.failure)

    def refresh(self, row: ScriptRow) -> None:
        """Take the rows as the database has them now (another front end renders the script)."""
        self.failure = row.failure
        for r in row.lines:
            if r.line in self.lines:
                self.lines[r.line].row = r

    # -- state ------------------------------------------------------------------------------

    @property
    def log_id(self) -> str:
        """The script's id as log lines show it (never whole)."""
        return short_script_id(self.script_id)

    @property
    def pending_work(self) -> bool:
        return any(line.needs_render for line in self.lines.values())

    @property
    def busy(self) -> bool:
        """In use by this process: rendering, waiting to, or being listened to."""
        return bool(self.tasks) or self.runner is not None or self.pending_work or self.log.listeners > 0

    @property
    def state(self) -> str:
        if self.failure is not None:
            return FAILED
        if self.tasks:
            return RENDERING
        if self.pending_work:
            return QUEUED
        return DONE

    def status_of(self, number: int) -> str:
        return RENDERING if number in self.tasks else self.lines[number].row.status

    def text_of(self, number: int) -> str:
        line = self.lines[number]
        return line.row.text if line.row.text is not None else line.cue.text

    def instruction_of(self, number: int) -> str:
        line = self.lines[number]
        return line.row.instruction if line.row.instruction is not None else self.script.instruction_for(line.cue)

    def audio(self) -> dict[int, LineAudio]:
        """The accepted take of every line that has one (what an export joins)."""
        return {
            n: LineAudio(line.row.take_id, line.row.seed, line.row.n_frames * FRAME_SAMPLES)
            for n, line in self.lines.items()
            if line.row.take_id is not None
        }

    def spoken_script(self) -> Script:
        """The script with each line's words as its accepted take speaks them (a retake may change the text)."""
        items = tuple(
            dataclasses.replace(item, text=self.text_of(item.number)) if isinstance(item, Cue) else item
            for item in self.script.items
        )
        return dataclasses.replace(self.script, items=items)

    # -- views ------------------------------------------------------------------------------

    def line_view(self, number: int) -> dict[str, Any]:
        line = self.lines[number]
        row = line.row
        return {
            "line": number,
            "scene": self._scenes.get(number, 1),
            "who": line.cue.who,
            "text": self.text_of(number),
            "instruction": self.instruction_of(number),
            "status": self.status_of(number),
            "take": row.take_id,
            "seed": row.seed,
            "duration_sec": round(row.n_frames / FRAME_RATE, 3) if row.take_id else None,
            "attempts": row.attempts,
            "error": row.error,
        }

    def progress(self) -> dict[str, Any]:
        statuses = [self.status_of(n) for n in self.lines]
        return {
            "script": self.script_id,
            "state": self.state,
            "lines_total": len(self.lines),
            "lines_done": statuses.count(DONE),
            "lines_failed": statuses.count(FAILED),
            "lines_rendering": statuses.count(RENDERING),
            "lines_pending": statuses.count(PENDING),
            "audio_sec": round(
                sum(line.row.n_frames for line in self.lines.values() if line.row.take_id) / FRAME_RATE, 3
            ),
        }

    def emit_progress(self) -> None:
        """A ``progress`` event, unless nothing changed since the last one."""
        progress = self.progress()
        if progress != self._last_progress:
            self._last_progress = progress
            self.log.emit("progress", progress)

    def view(self) -> dict[str, Any]:
        return {
            **self.progress(),
            "session": self.session_id,
            "title": self.script.title,
            "created": self.created,
            "error": self.failure,
            "gap_sec": self.script.gap_sec,
            "scene_gap_sec": self.script.scene_gap_sec,
            "cast": {name: member.to_dict() for name, member in self.script.cast.items()},
            "lines": [self.line_view(n) for n in sorted(self.lines)],
            "source": self.script.to_dict(),
        }
