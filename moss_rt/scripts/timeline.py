"""Where each line sits in a script's mix, to the sample (sans-I/O), and the cue sheet that says so.

The mix is the lines in script order, mono, 48 kHz, with silence between them: ``gap_sec`` between two lines,
``scene_gap_sec`` instead across a scene break, and every ``[pause]`` where it is written (added to the gap;
pauses before the first line or after the last stay at the start or the end). Each silence is rounded to whole
samples on its own, so the mix equals the lines joined with those silences exactly. A line without audio (failed,
or not rendered yet in a partial export) is left out with no gap of its own.

The mix's captions are placed the same way (:func:`line_captions`, :func:`word_captions`); the cues and the files
are the project's one caption writer's (:mod:`moss_rt.captions`).
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from moss_rt.align.base import WordTime
from moss_rt.captions import Cue as CaptionCue
from moss_rt.captions import group_cues, line_cue
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


# --------------------------------------------------------------------------- captions


def line_captions(timeline: Timeline) -> list[CaptionCue]:
    """One caption per line, spanning its audio in the mix, the speaker named."""
    return [line_cue(p.start / SAMPLE_RATE, p.end / SAMPLE_RATE, p.cue.text, p.cue.who) for p in timeline.placed]


def word_captions(timeline: Timeline, words: Mapping[int, Sequence[WordTime]]) -> list[CaptionCue]:
    """Captions by word: each line's words (by line number, timed from its take's sample 0, as the session store
    keeps them) grouped into readable cues and moved to where the line's take sits in the mix; a line without
    words is one cue of its own. Words past the end of the line's audio are left out (and one running past it is
    cut there), and a line's last cue may stay up into the silence after it, never into the next line."""
    out: list[CaptionCue] = []
    placed = timeline.placed
    for i, line in enumerate(placed):
        offset, length = line.start / SAMPLE_RATE, line.audio.samples / SAMPLE_RATE
        said = [
            WordTime(w.word, w.start, min(w.end, length), w.flags, w.text, w.chars)
            for w in words.get(line.cue.number, ())
            if 0 <= w.start < length
        ]
        if not said:
            out.append(line_cue(offset, line.end / SAMPLE_RATE, line.cue.text, line.cue.who))
            continue
        until = placed[i + 1].start if i + 1 < len(placed) else timeline.total_samples
        out += group_cues([w.shifted(offset) for w in said], speaker=line.cue.who, hold_until=until / SAMPLE_RATE)
    return out
