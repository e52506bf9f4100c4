"""A pipeline host: the process (or Ray actor) of one GPU, running the pipelines of the
sources the supervisor gave it.

Each ``Assignment`` (a group of sources the supervisor placed here together) runs as one
ordinary pipeline, ``pipeline.app.build.build_graph`` and ``Graph.run``, on a thread of its own:
its own decode workers, batcher, model and sinks. A source moved here from a pipeline that
died arrives as a new assignment beside the ones already running, which go on untouched; the
sources named in ``Assignment.resume`` start after their last written record
(``pipeline.resume``). ``abort`` cuts an assignment short (the supervisor moving its
sources): its records stay under their ``.partial`` names, complete line by line, for the
next pipeline to resume from.

The supervisor reads the host through ``poll()``: the assignments that ended since, each
with what became of its sources (ended by themselves, cut short, failed), and the metrics
of its running pipelines (``pipeline.app.cluster_metrics``). ``host_main`` serves a host in a
spawned process over a pipe (``runtime.gpus``, ``runtime.pipelines``); the Ray actor of
``pipeline.app.ray_cluster`` wraps the same class.
"""

from __future__ import annotations

import copy
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import structlog

from pipeline.config import PipelineConfig
from pipeline.records import BatchDetections

log = structlog.get_logger("host")

POLL_S = 0.2  # host_main: how often it looks at its pipe and reports
METRICS_EVERY_S = 1.0  # host_main: a metrics snapshot this often, when asked for


@dataclass(frozen=True)
class Assignment:
    """Sources to run together as one pipeline on one host.

    Attributes:
        id: unique within the run (metrics label ``run``).
        sources: the sources' names (as in the configuration).
        resume: those of ``sources`` that ran before: they resume after their last written
            record instead of starting over.
    """

    id: int
    sources: tuple[str, ...]
    resume: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.sources:
            raise ValueError(f"Assignment {self.id}: expected at least one source")
        if len(set(self.sources)) != len(self.sources):
            raise ValueError(f"Assignment {self.id}: a source named twice in {self.sources}")
        if not set(self.resume) <= set(self.sources):
            raise ValueError(f"Assignment {self.id}: resume {self.resume} not all in "
                             f"sources {self.sources}")


@dataclass(frozen=True)
class AssignmentEnded:
    """What became of an assignment's sources when its pipeline returned.

    Attributes:
        id: the assignment.
        ended: sources whose stream ended (by itself, or by a graceful stop): done, their
            outputs final; with their error (None: fine).
        cut: sources cut short (``abort``, or the pipeline could not start for a reason that
            is not theirs): to be started again, resuming.
        failure: the pipeline's own failure (a stage, or the build), or None.
        frames: frames of each source that reached its sink in this pipeline.
    """

    id: int
    ended: dict[str, str | None] = field(default_factory=dict)
    cut: tuple[str, ...] = ()
    failure: str | None = None
    frames: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class HostReport:
    """One ``poll()``: assignments ended since the last one, frames done per source (by
    the running pipelines) and, when asked for, the metrics snapshot of the running ones."""

    ended: tuple[AssignmentEnded, ...] = ()
    frames: dict[str, int] = field(default_factory=dict)
    metrics: tuple[Any, ...] | None = None  # FamilySnapshot records


def assignment_config(config: PipelineConfig, assignment: Assignment) -> PipelineConfig:
    """The configuration of one assignment's pipeline: ``config`` with only its sources
    (resumed ones from their records), run in this process (no progress bar, live view or
    metrics server of its own: the supervisor serves the metrics)."""
    from pipeline.resume import resumed_sources

    sub = copy.deepcopy(config)
    by_name = {source.name: source for source in config.sources}
    resumed = {source.name: source
               for source in resumed_sources(config, list(assignment.resume))}
    sub.sources = [resumed.get(name) or copy.deepcopy(by_name[name])
                   for name in assignment.sources]
    runtime = sub.runtime
    runtime.progress, runtime.metrics_port, runtime.http = False, None, None
    runtime.gpus, runtime.pipelines = None, None
    return sub


class _Run:
    """One assignment's pipeline on its thread."""

    def __init__(self, assignment: Assignment) -> None:
        self.assignment = assignment
        self.graph: Any = None
        self.collector: Any = None
        self.aborted = threading.Event()
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None


class PipelineHost:
    """Runs assignments, each as its own pipeline on a thread (module docstring).

    Args:
        config: the whole validated configuration (every source; each assignment takes its).
        name: this host's name in logs and metrics (``gpu0``, ``actor1``).
    """

    def __init__(self, config: PipelineConfig, name: str) -> None:
        self.config = config
        self.name = name
        self._runs: dict[int, _Run] = {}
        self._ended: list[AssignmentEnded] = []
        self._lock = threading.Lock()

    def start(self, assignment: Assignment) -> None:
        """Start the pipeline of ``assignment`` on a thread (building it is part of the
        thread's work: loading the model may take a while)."""
        run = _Run(assignment)
        with self._lock:
            if assignment.id in self._runs:
                raise ValueError(f"assignment {assignment.id} is already running")
            self._runs[assignment.id] = run
        run.thread = threading.Thread(target=self._run, args=(run,),
                                      name=f"run:{assignment.id}", daemon=True)
        run.thread.start()

    def abort(self, assignment_id: int) -> None:
        """Cut an assignment short: its sources stop at once, their records stay partial."""
        with self._lock:
            run = self._runs.get(assignment_id)
        if run is not None:
            run.aborted.set()
            if run.graph is not None:
                run.graph.abort()

    def stop(self) -> None:
        """Graceful stop of every assignment: stop reading, drain, finalise the outputs."""
        with self._lock:
            runs = list(self._runs.values())
        for run in runs:
            run.stopping.set()
            if run.graph is not None:
                run.graph.request_stop()

    def abort_all(self) -> None:
        with self._lock:
            ids = list(self._runs)
        for assignment_id in ids:
            self.abort(assignment_id)

    @property
    def idle(self) -> bool:
        """No assignment is running and every end was reported."""
        with self._lock:
            return not self._runs and not self._ended

    def poll(self, metrics: bool = False) -> HostReport:
        """Assignments ended since the last call, frames per source, and (``metrics``) the
        running pipelines' metrics."""
        with self._lock:
            ended, self._ended = tuple(self._ended), []
            runs = [run for run in self._runs.values() if run.graph is not None]
        frames: dict[str, int] = {}
        families: list[Any] = []
        for run in runs:
            for name, source in list(run.graph.source_metrics.items()):
                frames[name] = source.frames_out
            if metrics and run.collector is not None:
                from pipeline.app.cluster_metrics import snapshot

                try:
                    families.extend(snapshot(run.collector, {
                        "pipeline": self.name, "run": str(run.assignment.id)}))
                except Exception as error:  # noqa: BLE001 - metrics never stop a pipeline
                    log.warning("reading metrics failed", error=f"{type(error).__name__}: {error}")
        return HostReport(ended, frames, tuple(families) if metrics else None)

    def _run(self, run: _Run) -> None:
        from pipeline.app.build import build_graph
        from pipeline.app.prometheus import GraphCollector, LatencyHistogram

        assignment = run.assignment
        latency = LatencyHistogram()

        def batch_done(source: str, part: BatchDetections) -> None:
            latency.observe(source, time.time() - np.asarray(part.frames.capture_time))

        outcome: AssignmentEnded
        try:
            config = assignment_config(self.config, assignment)
            log.info("starting sources", host=self.name, run=assignment.id,
                     sources=list(assignment.sources),
                     resumed={s.name: s.start_frame for s in config.sources
                              if s.name in assignment.resume})
            graph = build_graph(config, on_batch_done=batch_done)
            for source in config.sources:  # resumed: append to the records (see SinkStage)
                sink = graph.sinks[source.name]
                if source.name in assignment.resume and source.start_frame > 0 \
                        and getattr(sink, "resume_from", None) is None:
                    sink.resume_from = source.start_frame
            run.collector = GraphCollector(graph, latency)
            run.graph = graph
            if run.aborted.is_set():
                graph.abort()
            if run.stopping.is_set():
                graph.request_stop()
            outcome = self._outcome(run, self._run_graph(graph))
        except Exception as error:  # noqa: BLE001 - reported to the supervisor
            reason = f"{type(error).__name__}: {error}"
            log.error("pipeline could not start", host=self.name, run=assignment.id,
                      reason=reason)
            outcome = AssignmentEnded(assignment.id, {name: f"pipeline failed to start: {reason}"
                                                      for name in assignment.sources},
                                      failure=reason)
        with self._lock:
            del self._runs[assignment.id]
            self._ended.append(outcome)

    @staticmethod
    def _run_graph(graph: Any) -> str | None:
        from pipeline.graph import PipelineError

        try:
            graph.run()
            return None
        except PipelineError as error:
            return str(error)

    def _outcome(self, run: _Run, failure: str | None) -> AssignmentEnded:
        """Each source: ended (its sink finalised its outputs: complete) or cut short."""
        graph = run.graph
        ended: dict[str, str | None] = {}
        cut = []
        for name in run.assignment.sources:
            error = graph.source_metrics[name].error
            if getattr(graph.sinks[name], "complete", False) or (error and not run.aborted.is_set()):
                ended[name] = error
            elif failure is not None and not run.aborted.is_set():
                ended[name] = f"pipeline failed: {failure}"
            else:
                cut.append(name)
        log.info("sources stopped", host=self.name, run=run.assignment.id,
                 ended=sorted(ended), cut=cut, failure=failure)
        frames = {name: graph.source_metrics[name].frames_out for name in run.assignment.sources}
        return AssignmentEnded(run.assignment.id, ended, tuple(cut), failure, frames)


def host_main(name: str, device: int | None, config: PipelineConfig, conn: Connection,
              metrics: bool, cpus: list[int] | None = None) -> None:
    """A host in a spawned process (``runtime.gpus``, ``runtime.pipelines``): serve the
    supervisor's calls from ``conn`` and send it a ``HostReport`` whenever there is news
    (and a metrics snapshot every ``METRICS_EVERY_S`` when ``metrics``).

    Calls are tuples ``(method, *args)`` of ``PipelineHost``: ``("start", Assignment)``,
    ``("abort", id)``, ``("stop",)``, ``("abort_all",)``, and ``("exit",)`` to end once
    idle. The supervisor's end of the pipe closing ends the process (its pipelines aborted):
    a killed supervisor leaves no host behind.

    Args:
        device: the GPU this host uses (seen as device 0: ``CUDA_VISIBLE_DEVICES``), or None.
        cpus: the cores this host runs on (its threads and the processes it starts), or
            None for all: pipelines on the CPU path share the cores out, else each would
            size its inference threads for every core and they would fight over them.
    """
    from pipeline.app.workers import name_this_process
    from pipeline.logging import configure_logging

    if cpus:  # before onnxruntime sizes its thread pool from the cores it may use
        os.sched_setaffinity(0, cpus)
    if device is not None:  # before anything touches CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = str(device)
        config.inference.gpu_id = 0
    name_this_process(f"streamdet-{name}")
    # Ctrl-C, or a SIGTERM to the whole group, reaches the supervisor, which stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(config.runtime.log_format, config.runtime.log_level)
    host = PipelineHost(config, name)
    exiting = False
    next_metrics = 0.0
    try:
        while not (exiting and host.idle):
            if conn.poll(POLL_S):
                method, *args = conn.recv()
                if method == "exit":
                    exiting = True
                else:
                    getattr(host, method)(*args)
            now = time.monotonic()
            want_metrics = metrics and now >= next_metrics
            report = host.poll(metrics=want_metrics)
            if want_metrics:
                next_metrics = now + METRICS_EVERY_S
            if report.ended or report.frames or want_metrics:
                conn.send(("report", report))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        log.warning("supervisor gone: aborting", host=name)
        host.abort_all()
