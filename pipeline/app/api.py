"""The Python API: run the pipeline from your own code, with the configuration of ``run.py``.

```python
from pipeline.app.api import Pipeline

# Iterate over results, frame by frame (like Ultralytics' ``predict(stream=True)``):
with Pipeline("configs/file.yaml") as pipeline:
    for result in pipeline.results():
        print(result.source, result.index, result.class_names, result.detections.xyxy)

# Or a callback per batch part (like Roboflow's ``on_prediction``), blocking until the end:
summary = Pipeline(config_dict, on_batch=lambda source, part: ...).run()
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.config import PipelineConfig, load_config, parse_config, substitute_env
from pipeline.records import BatchDetections, Detections


class SourceFailed(RuntimeError):
    """``results()`` ended and some sources had failed; the message names each and why."""


RESULTS_QUEUE_PARTS = 8  # batch parts waiting for the consumer of results()
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
    """

    source: str
    index: int
    pts: float | None
    capture_time: float
    width: int
    height: int
    detections: Detections
    class_names: tuple[str, ...]


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


def frame_results(part: BatchDetections, names: list[str] | None) -> list[FrameResult]:
    """The per-frame results of one source's batch part (host copies of its arrays)."""
    frames = part.frames
    results = []
    for i in range(len(part)):
        found = part[i]
        class_id = np.asarray(found.class_id)
        pts = float(frames.pts[i])
        results.append(FrameResult(
            source=frames.source_name(i), index=int(frames.index[i]),
            pts=None if pts != pts else pts, capture_time=float(frames.capture_time[i]),
            width=int(frames.width[i]), height=int(frames.height[i]),
            detections=Detections(np.asarray(found.xyxy), np.asarray(found.confidence),
                                  class_id, None if found.tracker_id is None
                                  else np.asarray(found.tracker_id)),
            class_names=tuple(names[c] if names and 0 <= c < len(names) else ""
                              for c in class_id.tolist())))
    return results


class Pipeline:
    """One pipeline run (module docstring).

    Args:
        config: a YAML path, a dict in the YAML's shape, or a ``PipelineConfig``.
        on_batch: called from a sink thread with (source name, that source's part of a batch:
            ``BatchDetections``) after its outputs were written; keep it quick.

    Raises:
        ConfigError: the configuration is invalid (also: the model, the files and the
            outputs, checked before anything starts).
    """

    def __init__(self, config: str | Path | dict | PipelineConfig,
                 on_batch: Callable[[str, BatchDetections], None] | None = None) -> None:
        self.config = as_config(config)
        self._on_batch = on_batch
        self._supervisor: Any = None
        self._results: dict[str, str | None] = {}
        self._listeners: list[Callable[[str, BatchDetections], None]] = []
        self._lock = threading.Lock()

    def _batch_done(self, source: str, part: BatchDetections) -> None:
        if self._on_batch is not None:
            self._on_batch(source, part)
        for listener in self._listeners:
            listener(source, part)

    def _start(self, per_batch: bool) -> Any:
        import structlog

        from pipeline.app.run import make_executor, prepare
        from pipeline.app.supervisor import Supervisor
        from pipeline.logging import configure_logging

        if not structlog.is_configured():  # structlog's default prints to stdout
            runtime = self.config.runtime
            configure_logging(runtime.log_format, runtime.log_level)
        with self._lock:
            if self._supervisor is not None:
                raise RuntimeError("a Pipeline runs once; make a new one to run again")
            resume = prepare(self.config)
            executor = make_executor(self.config, on_batch_done=self._batch_done
                                     if per_batch or self._on_batch is not None else None)
            self._supervisor = Supervisor(self.config, executor,
                                          self.config.runtime.max_restarts, resume=resume)
            return self._supervisor

    def _run(self, supervisor: Any) -> None:
        from pipeline.graph import PipelineError

        self._results = supervisor.run()
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
        order within each source. Leaving the loop early stops the run (outputs finalised).

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
                    parts.put(part, timeout=0.1)
                    return
                except queue.Full:
                    continue

        self._listeners.append(hand_over)
        supervisor = self._start(per_batch=True)
        names = model_setup(self.config).class_names  # the names the sinks write

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
        try:
            while (part := parts.get()) is not _DONE:
                yield from frame_results(part, names)
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
