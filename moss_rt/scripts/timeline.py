"""Where each line sits in a script's mix, to the sample (sans-I/O), and the cue sheet that says so.

The mix is the lines in script order, mono, 48 kHz, with silence between them: ``gap_sec`` between two lines,
``scene_gap_sec`` instead across a scene break, and every ``[pause]`` where it is written (added to the gap;
pauses before the first line or after the last stay at the start or the end). Each silence is rounded to whole
samples on its own, so the mix equals the lines joined with those silences exactly. A line without audio (failed,
or not rendered yet in a partial export) is left out with no gap of its own.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from moss_rt.generation import SAMPLE_RATE
from moss_rt.scripts.format import Cue, Pause, SceneBreak, Script


@dataclass(frozen=True)
class LineAudio:
    """A rendered line: its take in the director's session and its length in samples (per channel)."""

    take_id: str
    seed: int
    samples: int


@dataclass(frozen=True)
class Silence:
    samples: int


@dataclass(frozen=True)
class Placed:
    """A line in the mix: samples ``[start, start + audio.samples)``."""

    cue: Cue
    scene: int
    start: int
    audio: LineAudio

    @property
    def end(self) -> int:
        return self.start + self.audio.samples


Segment = Silence | Placed


@dataclass(frozen=True)
class Timeline:
    script: Script
    segments: tuple[Segment, ...]
    missing: tuple[Cue, ...]  # lines left out (no audio)
    total_samples: int

    @property
    def placed(self) -> list[Placed]:
        return [s for s in self.segments if isinstance(s, Placed)]

    @property
    def duration_sec(self) -> float:
        return self.total_samples / SAMPLE_RATE


def seconds_to_samples(seconds: float) -> int:
    return int(round(seconds * SAMPLE_RATE))


def layout(script: Script, audio: Mapping[int, LineAudio]) -> Timeline:
    """The mix of ``script`` with ``audio`` by cue number (lines not in it are left out)."""
    scenes = script.scene_of()
    segments: list[Segment] = []
    missing: list[Cue] = []
    cursor = 0
    pending = 0  # silence owed before the next line (pauses, then the gap)
    spoken_before = False
    scene_break = False
    for item in script.items:
        if isinstance(item, Pause):
            pending += seconds_to_samples(item.seconds)
        elif isinstance(item, SceneBreak):
            scene_break = True
        else:
            line = audio.get(item.number)
            if line is None:
                missing.append(item)
                continue
            if spoken_before:
                pending += seconds_to_samples(script.scene_gap_sec if scene_break else script.gap_sec)
            if pending:
                segments.append(Silence(pending))
                cursor += pending
            segments.append(Placed(item, scenes[item.number], cursor, line))
            cursor += line.samples
            pending, spoken_before, scene_break = 0, True, False
    if pending:
        segments.append(Silence(pending))
        cursor += pending
    return Timeline(script, tuple(segments), tuple(missing), cursor)


# --------------------------------------------------------------------------- cue sheets

CUE_SHEET_COLUMNS = (
    "line", "scene", "character", "start", "end", "take", "seed", "start_sample", "end_sample", "file", "text",
)  # fmt: skip


def line_file_stem(cue: Cue) -> str:
    """``007-KEEPER``: the line's index and character, safe as a file name everywhere."""
    safe = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in cue.who).strip("_")[:40] or "line"
    return f"{cue.number:03d}-{safe}"


def cue_rows(timeline: Timeline, extension: str) -> Iterator[dict[str, object]]:
    """One row per line in the mix (seconds to the microsecond, and the samples they come from)."""
    for placed in timeline.placed:
        yield {
            "line": placed.cue.number,
            "scene": placed.scene,
            "character": placed.cue.who,
            "start": round(placed.start / SAMPLE_RATE, 6),
            "end": round(placed.end / SAMPLE_RATE, 6),
            "take": placed.audio.take_id,
            "seed": placed.audio.seed,
            "start_sample": placed.start,
            "end_sample": placed.end,
            "file": f"lines/{line_file_stem(placed.cue)}.{extension}",
            "text": placed.cue.text,
        }


def cue_sheet_csv(timeline: Timeline, extension: str) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CUE_SHEET_COLUMNS, lineterminator="\r\n")
    writer.writeheader()
    for row in cue_rows(timeline, extension):
        writer.writerow(row)
    return buf.getvalue()


def cue_sheet_json(timeline: Timeline, extension: str, *, mix_file: str) -> str:
    script = timeline.script
    body = {
        "title": script.title,
        "sample_rate": SAMPLE_RATE,
        "channels": 1,
        "duration": round(timeline.duration_sec, 6),
        "samples": timeline.total_samples,
        "gap_sec": script.gap_sec,
        "scene_gap_sec": script.scene_gap_sec,
        "mix": mix_file,
        "lines": list(cue_rows(timeline, extension)),
        "missing": [{"line": c.number, "character": c.who, "text": c.text} for c in timeline.missing],
    }
    return json.dumps(body, indent=1, ensure_ascii=False)
