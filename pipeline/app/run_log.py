"""The engine's own numbers, read from a run's log: the engine process (``pipeline.app.engine``)
reports no Prometheus metrics; every ``SUMMARY_EVERY_S`` (and once as it stops) it logs one
"engine stages" line with each stage's counters since it started (frames, work_s, blocked_s),
as console text or JSON (``runtime.log_format``, ``pipeline.logging``).

    run.log (``measurement.launch``: each line prefixed with its second since the launch)
      "   14.28 2026-...T21:07:31 [info ] engine ready   batch_size=4 pid=11548 ..."
      "   24.28 2026-...T21:07:41 [info ] engine stages  batch={'stage': 'batch', ...} ..."
      "   24.28 {"pid": 11548, "batch": {...}, "event": "engine stages", ...}"
        │ engine_lines: (second, event, fields) of each "engine ready"/"engine stages" line
        └ engine_windows(lines, t0, t1): per engine (pid) the counters' differences between
          its last point at or before t0 (its "engine ready" line counts as all zeros) and
          its last at or before t1 (else its first after t1): EngineWindow

An engine's counters cover a span between two of its lines, which is the window only to
within ``SUMMARY_EVERY_S``; the span is reported with the numbers. A restarted engine has a
new pid, so its counters starting again from zero are never subtracted from the old ones.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EVENTS = ("engine stages", "engine ready")
DROPS = "live frames dropped"  # a process's drops since its last such line, by why (Graph)
NOT_REASONS = ("frames", "seconds", "sources", "pid")  # the numbers of such a line not a why
_FIELD = re.compile(r"(\w+)=(\{[^{}]*\}|\S+)")


@dataclass(frozen=True)
class LogLine:
    """One log line of interest: ``second`` since the launch, its ``event``, its fields."""

    second: float
    event: str
    fields: dict[str, Any]


def parse_line(text: str, events: tuple[str, ...] = EVENTS) -> LogLine | None:
    """The line of one of ``events`` in ``text`` (a line of ``run.log``: its second since the
    launch, then a console or JSON log line), or None for any other line (one that two
    processes' output interleaved into is skipped too)."""
    head, _, rest = text.strip().partition(" ")
    try:
        second = float(head)
    except ValueError:
        return None
    rest = rest.strip()
    if rest.startswith("{"):
        try:
            found = json.loads(rest)
        except ValueError:
            return None
        event = found.pop("event", None) if isinstance(found, dict) else None
        return LogLine(second, event, found) if event in events else None
    for event in events:
        at = rest.find(f"] {event} ")
        if at >= 0:
            break
    else:
        return None
    fields: dict[str, Any] = {}
    for key, value in _FIELD.findall(rest[at + len(event) + 2:]):
        try:
            fields[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            fields[key] = value
    return LogLine(second, event, fields)


def engine_lines(log: Path | Iterable[str]) -> list[LogLine]:
    """Every "engine stages" and "engine ready" line of ``log`` (a file or its lines)."""
    lines = log.read_text(errors="replace").splitlines() if isinstance(log, Path) else log
    return [found for found in map(parse_line, lines) if found is not None]


def model_loaded(log: Path) -> dict[str, Any]:
    """The fields of the first "model loaded" line of ``log`` (``stages.infer``: the backend
    and device an ``auto`` of the configuration chose), or {} when it has none (yet)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return {}
    for text in lines:
        found = parse_line(text, ("model loaded",))
        if found is not None:
            return found.fields
    return {}


def drop_reasons(log: Path | Iterable[str], start_s: float, end_s: float) -> dict[str, int]:
    """Frames dropped by why (``pipeline.graph.Graph.report_drops``' counts, summed over the
    processes) in the "live frames dropped" lines of ``log`` whose interval (their
    ``seconds`` before them) overlaps the window [``start_s``, ``end_s``]: a line covers up
    to ``DROP_REPORT_S``, so a line across a window's end counts whole."""
    lines = log.read_text(errors="replace").splitlines() if isinstance(log, Path) else log
    found: dict[str, int] = {}
    for line in (parse_line(text, (DROPS,)) for text in lines):
        if line is None or not (line.second > start_s
                                and line.second - float(line.fields.get("seconds", 0)) < end_s):
            continue
        for reason, count in line.fields.items():
            if reason not in NOT_REASONS and isinstance(count, int):
                found[reason] = found.get(reason, 0) + count
    return found


@dataclass
class EngineWindow:
    """One engine's stages between two of its log lines.

    Attributes:
        pid: its process id.
        start_s, end_s: the two lines' seconds since the launch (start: its "engine ready"
            line when it had logged no stages before the window).
        stages: stage -> (work s, blocked s, frames) between them.
    """

    pid: int | None
    start_s: float
    end_s: float
    stages: dict[str, tuple[float, float, int]] = field(default_factory=dict)

    @property
    def span_s(self) -> float:
        return self.end_s - self.start_s

    def share(self, stage: str) -> float:
        """``stage``'s work in % of the span (100: one thread busy all of it)."""
        return 100 * self.stages[stage][0] / self.span_s if self.span_s > 0 else 0.0


def _counters(line: LogLine) -> dict[str, tuple[float, float, int]]:
    if line.event == "engine ready":
        return {}
    return {name: (float(value.get("work_s", 0.0)), float(value.get("blocked_s", 0.0)),
                   int(value.get("frames", 0)))
            for name, value in line.fields.items() if isinstance(value, dict)}


def engine_windows(lines: list[LogLine], start_s: float, end_s: float
                   ) -> dict[int | None, EngineWindow]:
    """Per engine (pid; None for lines without one), its stages over the window
    [``start_s``, ``end_s``] (seconds since the launch) as its lines give them (module
    docstring). An engine with no line after its first point is left out."""
    by_pid: dict[int | None, list[LogLine]] = {}
    for line in sorted(lines, key=lambda item: item.second):
        by_pid.setdefault(line.fields.get("pid"), []).append(line)
    found = {}
    for pid, points in by_pid.items():
        before = [p for p in points if p.second <= start_s]
        first = before[-1] if before else points[0]
        inside = [p for p in points if first.second < p.second <= end_s]
        after = [p for p in points if p.second > max(end_s, first.second)]
        last = inside[-1] if inside else (after[0] if after else None)
        if last is None or last.event != "engine stages":
            continue
        had, has = _counters(first), _counters(last)
        found[pid] = EngineWindow(pid, first.second, last.second, {
            name: (work - had.get(name, (0.0, 0.0, 0))[0],
                   blocked - had.get(name, (0.0, 0.0, 0))[1],
                   frames - had.get(name, (0.0, 0.0, 0))[2])
            for name, (work, blocked, frames) in has.items()})
    return found
