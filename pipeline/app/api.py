"""The Python API: run the pipeline from your own code, with the configuration of ``run.py``.

```python
from pipeline.app.api import Pipeline

# Iterate over results, frame by frame (like Ultralytics' ``predict(stream=True)``):
with Pipeline("configs/file.yaml") as pipeline:
    for result in pipeline.results():
        print(result.source, result.index, result.class_names, result.detections.xyxy)

# Or a callback per batch part (like Roboflow's ``on_prediction``), blocking until the end:
summary = Pipeline(config_dict, on_batch=lambda source, part: ...).run()

# With the frames (BGR NumPy arrays) and, for sources with zones or lines, the events and
# the running counts:
with Pipeline("configs/analytics.yaml", frames="bgr") as pipeline:
    for result in pipeline.results():
        result.frame, result.events, result.counts
```

A script must run this under ``if __name__ == "__main__":``: decode workers are spawned
processes that import the main module (as with any ``multiprocessing`` code).

It runs the way ``run.py`` does, through the supervisor (``pipeline.app.supervisor``): with
``runtime.pipelines`` (or several ``runtime.gpus``) the pipelines are processes of their own
and ``run()`` and the outputs work as with ``run.py``; the per-frame results (``results()``,
``on_batch``) need the one pipeline in this process, and ask for it (a ``ConfigError``
otherwise).

The configuration is a YAML path, a dict in the YAML's shape, or a ``PipelineConfig``; it is
validated exactly as ``run.py`` validates it (``ConfigError`` with the one-line message). The
outputs the configuration asks for (video, JSONL) are written as with ``run.py``; set
``output.video`` and ``output.jsonl`` to null to only receive the results.

Frames (``frames="bgr"`` or ``"i420"``; None, the default, copies none): each result's
``frame`` and each callback part's ``part.pictures[i]`` is a host NumPy array of its own
(the caller's to keep; one copy per frame, made by ``stages.pictures`` before annotate
draws): BGR (height, width, 3) uint8, or I420 (height * 3 // 2, width) uint8 (the Y plane,
then U, then V, each (height // 2, width // 2)). Host path only: the sources then decode on
the CPU (``decode: auto`` never picks NVDEC; ``decode: gpu`` is a ``ConfigError``), so no
device-to-host copy is made.

Analytics: ``result.events`` holds the frame's ``AnalyticsEvent`` records (zone entries and
exits, line crossings; ``part.events`` a part's), and ``result.counts`` its source's counts
after that frame (``{"zones": ..., "lines": ...}`` as ``AnalyticsCounts.to_json``: running
sums of the events handed over), None for a source without zones or lines;
``Pipeline.counts()`` gives the same after the parts handed over so far (call it from a
callback for the counts after its part). When a source ends, the objects still inside a zone
exit (events stamped on its last frame, as in its events file): ``results()`` gives those
exits with the source's last result (after that frame's own events; its ``counts`` then have
nobody inside), so for a source with zones each batch part's last result is handed over when
the source's next part comes or the source ends; ``on_batch`` gets them after the source's
last part, as a part of no frames (``len(part) == 0``) whose ``events`` they are.

``results()`` runs the pipeline on a background thread and hands over each frame's result
through a bounded queue: a consumer slower than the pipeline holds file sources back (no
frame lost) and makes live sources drop their oldest frames, as a slow sink would. Leaving the
loop early (``break``) or ``stop()`` stops reading, drains and finalises every output. Signals
are left to the caller: no handler is installed. The pipeline's log lines go to stderr in
``runtime.log_format`` at ``runtime.log_level``, as with ``run.py`` (never into your program's
stdout), unless your program configured structlog itself.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.config import ConfigError, PipelineConfig, load_config, parse_config, substitute_env
from pipeline.records import AnalyticsEvent, BatchDetections, Detections


class SourceFailed(RuntimeError):
    """``results()`` ended and some sources had failed; the message names each and why."""


RESULTS_QUEUE_PARTS = 8  # batch parts waiting for the consumer of results()
# results(), with a source's last result held back (``with_closing_exits``): how often it
# asks whether that source ended, while no part comes.
ENDED_CHECK_S = 0.1
FRAME_FORMATS = ("bgr", "i420")
_DONE = object()


@dataclass(frozen=True)
class FrameResult:
    """One frame's detections.

    Attributes:
        source: the source's name.
        index: the frame's number within its source (0-based).
        pts: presentation time in seconds, or None when unknown.
        capture_time: wall-clock time the frame was decoded (or was due, for a paced file).
        width, height: the frame's size in pixels (the coordinates of the boxes).
        detections: host arrays: ``xyxy`` (n, 4) float32, ``confidence`` (n,) float32,
            ``class_id`` (n,) int32.
        class_names: (n,) names of the detections' classes ("" where the model's class names
            are unknown).
        frame: with ``Pipeline(frames=...)``, the frame's picture, a host NumPy array of its
            own: BGR (height, width, 3) uint8, or I420 (height * 3 // 2, width) uint8; else
            None.
        events: the analytics events confirmed on this frame (``AnalyticsEvent``: zone
            entries and exits, line crossings), in order; empty without zones or lines. A
            source's last result also has the exits made when it ended (of the objects
            still inside a zone), last.
        counts: its source's counts after this frame (``{"zones": {name: {"inside",
            "entered", "exited"}}, "lines": {name: {"in", "out"}}}``, each by class name),
            or None for a source without zones or lines.
    """

    source: str
    index: int
    pts: float | None
    capture_time: float
    width: int
    height: int
    detections: Detections
    class_names: tuple[str, ...]
    frame: np.ndarray | None = None
    events: tuple[AnalyticsEvent, ...] = ()
    counts: dict[str, Any] | None = None


@dataclass(frozen=True)
class RunSummary:
    """How a run ended: per source, frames done, frames dropped and the error (None: ok)."""

    frames: dict[str, int]
    dropped: dict[str, int]
    errors: dict[str, str | None]

    @property
    def ok(self) -> bool:
        return not any(self.errors.values())


def as_config(config: str | Path | dict | PipelineConfig) -> PipelineConfig:
    """A validated configuration from a YAML path, a dict (``${VAR}`` references filled in
    from the environment, as in a file) or a ``PipelineConfig``."""
    if isinstance(config, PipelineConfig):
        return config
    if isinstance(config, dict):
        return parse_config(substitute_env(config, os.environ))
    return load_config(config)


class CountsTally:
    """Running counts of the analytics events handed over, per source with zones or lines
    (``stages.analytics.AnalyticsCounts``: the sums the analytics stage keeps, as of the
    parts seen here rather than of the batches it has done since).

    Args:
        config: the run's configuration (its sources' zones and lines).
        class_names: the model's class names, or None; num_classes: its class count.
    """

    def __init__(self, config: PipelineConfig, class_names: list[str] | None,
                 num_classes: int) -> None:
        from stages.analytics import AnalyticsCounts, Region

        self._counts = {
            source.name: AnalyticsCounts(
                [Region.from_config(f"sources[{i}].analytics[{k}]", region, source,
                                    class_names, num_classes)
                 for k, region in enumerate(source.analytics)], class_names)
            for i, source in enumerate(config.sources) if source.analytics}
        self._lock = threading.Lock()

    def has(self, source: str) -> bool:
        """Whether ``source`` has zones or lines (it has counts)."""
        return source in self._counts

    def apply(self, events: tuple[AnalyticsEvent, ...] | list[AnalyticsEvent]) -> None:
        """Count ``events`` (of sources with counts; others are left out)."""
        with self._lock:
            for event in events:
                if (counts := self._counts.get(event.source)) is not None:
                    counts.apply(event)

    def get(self, source: str) -> dict[str, Any] | None:
        """``source``'s counts now (a fresh dict), or None when it has none."""
        with self._lock:
            counts = self._counts.get(source)
            return None if counts is None else counts.to_json()

    def all(self) -> dict[str, dict[str, Any]]:
        """Every counted source's counts now."""
        with self._lock:
            return {source: counts.to_json() for source, counts in self._counts.items()}


def frame_results(part: BatchDetections, names: list[str] | None,
                  tally: CountsTally | None = None) -> list[FrameResult]:
    """The per-frame results of one source's batch part (host copies of its arrays), with
    each frame's picture (``part.pictures``) and events; ``tally`` (when given) counts the
    events frame by frame and gives each result its source's counts after it."""
    frames = part.frames
    results = []
    for i in range(len(part)):
        found = part[i]
        class_id = np.asarray(found.class_id)
        pts = float(frames.pts[i])
        source, index = frames.source_name(i), int(frames.index[i])
        events = tuple(e for e in part.events if e.frame == index and e.source == source)
        counts = None
        if tally is not None and tally.has(source):
            tally.apply(events)
            counts = tally.get(source)
        results.append(FrameResult(
            source=source, index=index,
            pts=None if pts != pts else pts, capture_time=float(frames.capture_time[i]),
            width=int(frames.width[i]), height=int(frames.height[i]),
            detections=Detections(np.asarray(found.xyxy), np.asarray(found.confidence),
                                  class_id, None if found.tracker_id is None
                                  else np.asarray(found.tracker_id)),
            class_names=tuple(names[c] if names and 0 <= c < len(names) else ""
                              for c in class_id.tolist()),
            frame=None if part.pictures is None else part.pictures[i],
            events=events, counts=counts))
    return results


def with_closing_exits(last: FrameResult, events: tuple[AnalyticsEvent, ...],
                       tally: CountsTally | None) -> FrameResult:
    """``last``, its source's last result, with the exits made when the source ended (of the
    objects still inside a zone, stamped on that frame: ``EndOfStream.events``) after its own
    events, and (``tally`` counting them) the counts after them: nobody left inside."""
    counts = last.counts
    if tally is not None and tally.has(last.source):
        tally.apply(events)
        counts = tally.get(last.source)
    return replace(last, events=(*last.events, *events), counts=counts)


class Pipeline:
    """One pipeline run (module docstring).

    Args:
        config: a YAML path, a dict in the YAML's shape, or a ``PipelineConfig``.
        on_batch: called from a sink thread with (source name, that source's part of a batch:
            ``BatchDetections``) after its outputs were written; keep it quick. The part's
            ``events`` are its analytics events, ``pictures`` its frames' pictures (with
            ``frames``); ``counts()`` then includes its events. A source that ended with
            objects inside a zone gets one more part after its last: no frames, its
            ``events`` the exits made at the end.
        frames: "bgr" or "i420": results and callback parts carry each frame's picture, a
            host NumPy array (module docstring); None: no pictures (no copies made).

    Raises:
        ConfigError: the configuration is invalid (also: the model, the files and the
            outputs, checked before anything starts); ``frames`` is not one of the formats,
            or is asked with a source that decodes on the GPU (``decode: gpu``).
    """

    def __init__(self, config: str | Path | dict | PipelineConfig,
                 on_batch: Callable[[str, BatchDetections], None] | None = None,
                 frames: str | None = None) -> None:
        self.config = as_config(config)
        if frames is not None and frames not in FRAME_FORMATS:
            raise ConfigError(f"frames: expected 'bgr', 'i420' or None, got {frames!r}")
        for i, source in enumerate(self.config.sources):
            if frames is not None and source.decode == "gpu":
                raise ConfigError(f"sources[{i}].decode: 'gpu' cannot be used with "
                                  f"frames={frames!r}: the frames are handed over from host "
                                  "memory (use decode: cpu or auto)")
        self.frames = frames
        self._tally: CountsTally | None = None
        self._on_batch = on_batch
        self._supervisor: Any = None
        self._results: dict[str, str | None] = {}
        self._listeners: list[Callable[[str, BatchDetections], None]] = []
        self._lock = threading.Lock()

    def _batch_done(self, source: str, part: BatchDetections) -> None:
        if self.frames is not None and part.pictures is None:  # a source's end: no frames
            part = replace(part, pictures=())
        if self._tally is not None and part.events:
            self._tally.apply(part.events)
        if self._on_batch is not None:
            self._on_batch(source, part)
        for listener in self._listeners:
            listener(source, part)

    def _start(self, per_batch: bool) -> Any:
        import structlog

        from pipeline.app.build import model_setup
        from pipeline.app.output_lock import lock_outputs
        from pipeline.app.run import make_executor, prepare
        from pipeline.app.supervisor import Supervisor
        from pipeline.logging import configure_logging

        if not structlog.is_configured():  # structlog's default prints to stdout
            runtime = self.config.runtime
            configure_logging(runtime.log_format, runtime.log_level)
        with self._lock:
            if self._supervisor is not None:
                raise RuntimeError("a Pipeline runs once; make a new one to run again")
            # its output folders held for the run, as run.py holds them (output_lock)
            self._output_lock = lock_outputs(self.config)
            try:
                resume = prepare(self.config)
                per_batch = per_batch or self._on_batch is not None
                if per_batch and any(source.analytics for source in self.config.sources):
                    model = model_setup(self.config)
                    self._tally = CountsTally(self.config, model.class_names,
                                              model.info.num_classes)
                executor = make_executor(self.config,
                                         on_batch_done=self._batch_done if per_batch else None,
                                         frames=self.frames if per_batch else None)
            except BaseException:
                self._output_lock.release()
                raise
            self._supervisor = Supervisor(self.config, executor,
                                          self.config.runtime.max_restarts, resume=resume)
            return self._supervisor

    def _run(self, supervisor: Any) -> None:
        from pipeline.graph import PipelineError

        try:
            self._results = supervisor.run()
        finally:
            self._output_lock.release()
        if supervisor.failure is not None:
            raise PipelineError(supervisor.failure[0])

    def run(self) -> RunSummary:
        """Run until every source ended (or ``stop()``); returns the summary.

        Raises:
            PipelineError: a stage failed (a source that fails does not raise: it is in the
                summary's ``errors``).
        """
        self._run(self._start(per_batch=False))
        return self.summary()

    def results(self) -> Iterator[FrameResult]:
        """Run on a background thread and yield every frame's result as it is done, in frame
        order within each source; a source's last result carries the exits made when it
        ended (module docstring). Leaving the loop early stops the run (outputs finalised).

        Raises:
            PipelineError: a stage failed (after the results done before it).
            SourceFailed: at the end, when a source failed (its reason; the other sources'
                results all came).
        """
        from pipeline.app.build import model_setup

        parts: queue.Queue[Any] = queue.Queue(RESULTS_QUEUE_PARTS)
        failure: list[BaseException] = []
        stopped = threading.Event()

        def hand_over(source: str, part: BatchDetections) -> None:
            while not stopped.is_set():
                try:
                    parts.put((source, part), timeout=0.1)
                    return
                except queue.Full:
                    continue

        model = model_setup(self.config)  # before _start holds the output folders
        self._listeners.append(hand_over)
        supervisor = self._start(per_batch=True)
        names = model.class_names  # the names the sinks write
        tally = (CountsTally(self.config, names, model.info.num_classes)
                 if self._tally is not None else None)  # frame by frame, in this thread

        def run() -> None:
            try:
                self._run(supervisor)
            except BaseException as error:  # noqa: BLE001 - raised in the consumer's thread
                failure.append(error)
            finally:
                while True:  # the end marker must get in even past a full queue
                    try:
                        parts.put(_DONE, timeout=0.1)
                        break
                    except queue.Full:
                        if stopped.is_set():
                            break
        runner = threading.Thread(target=run, name="pipeline-api", daemon=True)
        runner.start()
        # Per source with zones, its latest result: handed over with the source's next part,
        # or with the exits its end makes (a part of no frames), or once it has ended.
        zoned = {source.name for source in self.config.sources
                 if any(region.type == "zone" for region in source.analytics or ())}
        held: dict[str, FrameResult] = {}
        try:
            while True:
                try:
                    item = parts.get(timeout=ENDED_CHECK_S if held else None)
                except queue.Empty:  # an end that made no exits sends no part
                    for source in [s for s in held if supervisor.source_done(s)]:
                        yield held.pop(source)
                    continue
                if item is _DONE:
                    break
                source, part = item
                if not len(part):  # the source ended: the exits of the objects inside a zone
                    if source in held:
                        yield with_closing_exits(held.pop(source), part.events, tally)
                    continue
                results = frame_results(part, names, tally)
                if source in zoned:
                    if source in held:
                        yield held.pop(source)
                    held[source] = results.pop()
                yield from results
            yield from held.values()
        finally:
            if runner.is_alive():  # left early: stop, and stop handing over
                supervisor.request_stop()
                stopped.set()
                while runner.is_alive():
                    try:
                        parts.get(timeout=0.1)
                    except queue.Empty:
                        pass
            runner.join()
        if failure:
            raise failure[0]
        failed = {name: error for name, error in self.summary().errors.items() if error}
        if failed:
            raise SourceFailed("; ".join(f"source {name}: {error}" for name, error in failed.items()))

    def counts(self) -> dict[str, dict[str, Any]]:
        """Each source with zones or lines: its counts after the batch parts handed over so
        far (``results()`` or ``on_batch``; ``{"zones": ..., "lines": ...}``, as
        ``FrameResult.counts``). Empty before the run, or without per-frame results."""
        return {} if self._tally is None else self._tally.all()

    def stop(self) -> None:
        """Stop reading the sources; what is queued drains and outputs are finalised."""
        if self._supervisor is not None:
            self._supervisor.request_stop()

    def summary(self) -> RunSummary:
        """Frames done, dropped and errors per source so far."""
        supervisor = self._supervisor
        if supervisor is None:
            return RunSummary({}, {}, {})
        frames = supervisor.frames
        dropped = {name: int((run.ended.summary.get("dropped") or 0) if run.ended else 0)
                   for name, run in supervisor.sources.items()}
        errors = {name: self._results.get(name, supervisor.results.get(name))
                  for name in supervisor.sources}
        return RunSummary(frames, dropped, errors)

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
