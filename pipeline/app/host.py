"""A pipeline host: the process (also in a Ray unit, or for one pipeline the supervisor's own
process) that runs ONE graph for its whole life; its supervisor adds sources to it and
removes them, one at a time.

```
supervisor ──add(SourceRequest)──>  PipelineHost: one graph (pipeline.app.build, started empty,
           ──remove(name)────────>    stop_when never), its sources added through graph.control,
           ──want(names)─────────>    the same path a source POSTed to the live view takes
           <──HostReport (poll)────   replies, sources ended, frames, metrics, live-view report
```

The graph is built (the model loaded and warmed up) once, when the host starts; sources the
supervisor adds meanwhile wait and start with it. Adding or removing a source never touches
the others: a source moved here from a host that died, or moved away to even the load, is
one ``add`` (``resume``: after its last written record) or one ``remove`` (its reading stops,
what it queued drains, its outputs are finalised; a file cut short keeps its ``.partial``
names for the next host to resume from).

The supervisor reads the host through ``poll()``; ``host_main`` serves a host in a spawned
process over a pipe (``pipeline.app.supervisor.LocalExecutor``, also inside a Ray unit:
``pipeline.app.ray_cluster``), and ``pipeline.app.supervisor.InProcessExecutor`` calls it
directly.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import structlog

from pipeline.config import ConfigError, PipelineConfig, SourceConfig
from pipeline.records import BatchDetections

log = structlog.get_logger("host")

POLL_S = 0.05  # host_main: how often it looks at its pipe and reports news
METRICS_EVERY_S = 1.0  # a metrics snapshot this often (``due_report``), when asked for
VIEW_EVERY_S = 0.1  # a live-view report this often (``due_report``), with runtime.http


@dataclass(frozen=True)
class SourceRequest:
    """Start one source on a host.

    Attributes:
        id: unique within the run (the reply carries it).
        source: a ``SourceConfig`` of the validated configuration, or a ``sources[]`` entry
            (a mapping, POSTed to the live view) that the host validates.
        key: the source's name in messages (``sources[N]``).
        resume: start after its last written record, appending (it ran before).
        output_number: write the numbered outputs ``NAME.N.*``; None: its own.
        renumber: its name was used before in this run: take the next free numbered outputs.
    """

    id: int
    source: SourceConfig | dict
    key: str
    resume: bool = False
    output_number: int | None = None
    renumber: bool = False


@dataclass(frozen=True)
class Reply:
    """What became of a ``SourceRequest``.

    Attributes:
        id: the request's.
        source: the source as validated and started, or None when refused.
        error: why it was refused (one line), or None.
        conflict: the refusal is a conflict (a name in use, the run ending), not a bad entry.
        output_number: the number of its outputs (None: its own).
    """

    id: int
    source: SourceConfig | None = None
    error: str | None = None
    conflict: bool = False
    output_number: int | None = None


@dataclass(frozen=True)
class SourceEnded:
    """A source's sink has finished: what it left.

    Attributes:
        name: the source.
        error: why it failed, or None.
        complete: its outputs are final (it ended, or a camera was stopped).
        cut_short: where a file stopped before its end (``stopped at frame N of M``: its
            outputs keep their ``.partial`` names), or None.
        frames: frames its sink finished here, or, where more, the frames its records file
            holds from here (``recorded_frames``: what its source summary reports).
        summary: its ``SourceMetrics.summary`` (frames, fps, dropped, latency, ...).
        outputs: the files it left (final or ``.partial`` names).
    """

    name: str
    error: str | None
    complete: bool
    cut_short: str | None
    frames: int
    summary: dict[str, Any]
    outputs: tuple[str, ...] = ()


@dataclass(frozen=True)
class HostReport:
    """One ``poll()``: news since the last one.

    Attributes:
        replies: answers to ``add`` requests.
        ended: sources whose sinks finished.
        frames: frames done so far per running source.
        ready: the graph has opened its stages (the model is warm).
        failure: the graph failed (its build, or a stage): every source on it is lost.
        usage: that failure is what was asked for (a configuration that cannot run here).
        finished: the graph's run returned (after ``stop``, or a failure) and this report
            carries the last of its sources' ends.
        metrics: the graph's metrics snapshot (``FamilySnapshot`` records), when asked for.
        view: the live view's ``ViewReport``, when asked for.
    """

    replies: tuple[Reply, ...] = ()
    ended: tuple[SourceEnded, ...] = ()
    frames: dict[str, int] = field(default_factory=dict)
    ready: bool = False
    failure: str | None = None
    usage: bool = False
    finished: bool = False
    metrics: tuple[Any, ...] | None = None
    view: Any = None


class PipelineHost:
    """One long-lived graph and the sources its supervisor gives it (module docstring).

    Args:
        config: the whole validated configuration: the graph has the stages every configured
            source needs; which sources run here is the supervisor's choice.
        name: this host's name in logs and metrics (``worker0``, ``gpu0.worker1``, ``unit1.worker0``).
        expected_sources: how many sources the graph is sized for (its share).
        cores: the cores its decode workers are sized for (its share of the supervisor's;
            default: the cores this process may use).
        on_batch_done: called from a sink thread per batch part (the Python API, in-process).
        metrics: read the graph's Prometheus metrics for ``poll(metrics=True)``.
        engine: (``EngineLink``, worker number): a source worker whose frames its GPU's
            engine process detects (``build_graph``); None: the whole pipeline here.
        frames: "bgr" or "i420": the parts ``on_batch_done`` sees carry their frames'
            pictures (``build_graph``); None: they do not.
    """

    def __init__(self, config: PipelineConfig, name: str, expected_sources: int | None = None,
                 on_batch_done: Callable[[str, BatchDetections], None] | None = None,
                 metrics: bool = False, cores: int | None = None,
                 engine: tuple[Any, int] | None = None, frames: str | None = None) -> None:
        self.config = config
        self.frames = frames
        self.engine = engine
        self.name = name
        self.expected_sources = expected_sources
        self.cores = cores
        self._on_batch_done = on_batch_done
        self._metrics = metrics
        self.graph: Any = None
        self.view: Any = None  # the live view's HostView (runtime.http), once built
        self._collector: Any = None
        self._latency: Any = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._waiting: list[SourceRequest] = []  # adds before the graph was built
        self._replies: list[Reply] = []
        self._ended: list[SourceEnded] = []
        self._running: dict[str, float] = {}  # sources added and not yet ended -> added at
        self._failure: tuple[str, bool] | None = None
        self._finished = threading.Event()
        self._stopping = threading.Event()
        self._aborting = threading.Event()
        self._wanted: list[str] = []
        self._started_at = time.monotonic()
        self._next_metrics = self._next_view = 0.0

    # -- commands --------------------------------------------------------------------------
    def start(self) -> None:
        """Build the graph and run it on a thread of its own (returns at once)."""
        self._thread = threading.Thread(target=self._run_or_fail, name=f"host:{self.name}",
                                        daemon=True)
        self._thread.start()

    def add(self, request: SourceRequest) -> None:
        """Start a source (its reply comes with the next ``poll``)."""
        with self._lock:
            if self.graph is None and self._failure is None:
                self._waiting.append(request)
                return
        self._add(request)

    def remove(self, name: str) -> None:
        """Stop reading source ``name``: what it queued drains, its outputs are finalised
        (a file stopped before its end keeps its ``.partial`` names); its end is reported."""
        from pipeline.graph import SourceConflict

        with self._lock:  # one not started yet ends here, having done nothing
            waiting = [r for r in self._waiting if _name_of(r.source) == name]
            self._waiting = [r for r in self._waiting if _name_of(r.source) != name]
            self._replies += [Reply(r.id, error=f"source {name!r} was removed", conflict=True)
                              for r in waiting]
            graph = self.graph
        if graph is None:
            return
        if self.view is not None:
            self.view.mark_removing(name)
        try:
            graph.control.remove(name)
        except SourceConflict as error:
            log.warning("remove: no such source here", host=self.name, source=name,
                        reason=str(error))

    def want(self, names: Collection[str]) -> None:
        """The live view's viewers watch ``names`` now (their previews are sent)."""
        self._wanted = list(names)

    def stop(self) -> None:
        """Graceful: every source stops reading, drains and finalises; then the graph ends."""
        self._stopping.set()
        with self._lock:
            graph, waiting, self._waiting = self.graph, self._waiting, []
            self._replies += [Reply(r.id, error="the run is ending", conflict=True)
                              for r in waiting]
        if graph is not None:
            graph.request_stop()

    def abort_all(self) -> None:
        """Stop at once (outputs stay ``.partial``)."""
        self._aborting.set()
        self.stop()
        if self.graph is not None:
            self.graph.abort()

    def join(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the graph's run to return (after ``stop``)."""
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def finished(self) -> bool:
        """The graph's run has returned (or it never started) and every end was reported."""
        with self._lock:
            return self._finished.is_set() and not self._running and not self._ended

    def due_report(self) -> HostReport:
        """``poll`` with the metrics snapshot when one is due (every ``METRICS_EVERY_S``, a
        host made with ``metrics``) and the live-view report when one is due (every
        ``VIEW_EVERY_S``, with ``runtime.http``): what every executor sends its supervisor."""
        now = time.monotonic()
        metrics = self._metrics and now >= self._next_metrics
        view = self.view is not None and now >= self._next_view
        if metrics:
            self._next_metrics = now + METRICS_EVERY_S
        if view:
            self._next_view = now + VIEW_EVERY_S
        return self.poll(metrics=metrics, view=view)

    def poll(self, metrics: bool = False, view: bool = False) -> HostReport:
        """News since the last call (``HostReport``)."""
        # Read first: a source may end between its check below and this read, and a report
        # saying "finished" before it carries that source's end would let the supervisor
        # close the run without it (it was then reported cut short, its records complete).
        returned = self._finished.is_set()
        graph = self.graph
        ended: list[SourceEnded] = []
        frames: dict[str, int] = {}
        if graph is not None:
            with self._lock:
                running = list(self._running.items())
            for name, added_at in running:
                metrics_of = graph.source_metrics.get(name)
                if metrics_of is not None:
                    frames[name] = metrics_of.frames_out
                if graph.source_done(name):
                    ended.append(self._source_ended(name, added_at))
            with self._lock:
                for item in ended:
                    self._running.pop(item.name, None)
        with self._lock:
            replies, self._replies = tuple(self._replies), []
            ended, self._ended = [*self._ended, *ended], []
            failure = self._failure
            finished = returned and (not self._running or graph is None or failure is not None)
        families = None
        if metrics and self._collector is not None:
            families = self._snapshot()
        view_report = None
        if view and self.view is not None:
            try:
                view_report = self.view.report(self._wanted)
            except Exception as error:  # noqa: BLE001 - the view never stops a pipeline
                log.warning("reading the live view failed", error=f"{type(error).__name__}: {error}")
        return HostReport(replies, tuple(ended), frames,
                          ready=graph is not None and graph.ready.is_set(),
                          failure=None if failure is None else failure[0],
                          usage=failure is not None and failure[1],
                          finished=finished, metrics=families, view=view_report)

    # -- internals -------------------------------------------------------------------------
    def _run_or_fail(self) -> None:
        """``_run``, and a failure of the host when it raises before the graph's run returned
        (an import that fails, say): the supervisor is told, instead of waiting for ever."""
        try:
            self._run()
        except BaseException as error:  # noqa: BLE001 - the thread's end, reported
            if not self._finished.is_set():
                self._fail(f"failed to start: {type(error).__name__}: {error}", usage=False)
            else:
                log.error("host thread failed after its run", host=self.name,
                          error=f"{type(error).__name__}: {error}")

    def _run(self) -> None:
        from pipeline.app.build import build_graph
        from pipeline.app.prometheus import GraphCollector, LatencyHistogram
        from pipeline.graph import PipelineError
        from stages.infer import BackendUnavailable

        latency = LatencyHistogram() if self._metrics else None

        def batch_done(source: str, part: BatchDetections) -> None:
            if latency is not None:
                latency.observe(source, time.time() - np.asarray(part.frames.capture_time))
            if self._on_batch_done is not None:
                self._on_batch_done(source, part)

        try:
            graph = build_graph(self.config, on_batch_done=batch_done, start_sources=False,
                                expected_sources=self.expected_sources, stop_when="never",
                                cores=self.cores, engine=self.engine, frames=self.frames)
        except (ConfigError, BackendUnavailable) as error:
            self._fail(str(error), usage=True)
            return
        except Exception as error:  # noqa: BLE001 - reported to the supervisor
            self._fail(f"failed to start: {type(error).__name__}: {error}", usage=False)
            return
        graph.host = self.name
        if self._metrics:
            self._collector = GraphCollector(graph, latency)
        if self.config.runtime.http is not None:
            from pipeline.app.view import HostView

            # it shows the sources as they are added here, not the configured ones
            self.view = HostView(self.name, graph, graph.preview,
                                 dataclasses.replace(self.config, sources=[]))
        with self._lock:
            self.graph = graph
            waiting, self._waiting = self._waiting, []
        for request in waiting:
            self._add(request)
        if self._stopping.is_set():
            graph.request_stop()
        if self._aborting.is_set():
            graph.abort()
        if self.view is not None:
            self.view.start()
        self._started_at = time.monotonic()
        try:
            graph.run()
        except PipelineError as error:
            self._fail(str(error), usage=False)
        finally:
            if self.view is not None:
                self.view.close()
            for metrics in graph.stage_metrics.values():
                summary = metrics.summary()
                if summary["frames"] or summary["work_s"] or summary["blocked_s"]:
                    # (a stage that did nothing, a spare's say, has nothing to tell)
                    log.info("stage summary", host=self.name, **summary)
            self._finished.set()

    def _fail(self, reason: str, usage: bool) -> None:
        log.error("pipeline failed", host=self.name, reason=reason)
        with self._lock:
            self._failure = (reason, usage)
            waiting, self._waiting = self._waiting, []
            self._replies += [Reply(r.id, error=f"pipeline failed: {reason}") for r in waiting]
        self._finished.set()

    def _add(self, request: SourceRequest) -> None:
        from pipeline.graph import SourceConflict

        name = _name_of(request.source)
        try:
            source = self.graph.control.add(request.source, resume=request.resume,
                                            output_number=request.output_number,
                                            renumber=request.renumber, key=request.key)
        except (ConfigError, ValueError) as error:
            reply = Reply(request.id, error=str(error))
        except SourceConflict as error:
            reply = Reply(request.id, error=str(error), conflict=True)
        except Exception as error:  # noqa: BLE001 - one source's fault, told to the supervisor
            reply = Reply(request.id, error=f"{type(error).__name__}: {error}")
        else:
            with self._lock:
                self._running[name] = time.monotonic()
            if self.view is not None:
                self.view.add(source)
            reply = Reply(request.id, source, output_number=self.graph.control.output_number(name))
        with self._lock:
            self._replies.append(reply)

    def _source_ended(self, name: str, added_at: float) -> SourceEnded:
        from stages.sinks import stopped_text

        graph = self.graph
        graph.refresh_source_metrics()
        metrics = graph.source_metrics[name]
        sink = graph.sinks[name]
        stopped = getattr(sink, "stopped_at", None)
        outputs = tuple(graph.control.outputs_left(name))
        summary = metrics.summary(time.monotonic() - max(added_at, self._started_at))
        complete = bool(getattr(sink, "complete", False))
        error = metrics.error
        if error is None and not complete and (failure := graph.failure()) is not None:
            # cut by its pipeline's failure (a full disk in its sink, say): failed with it,
            # not cut short to be placed again (the supervisor would try this host again)
            error = f"pipeline failed: {failure}"
        return SourceEnded(name, error, complete,
                           None if stopped is None else stopped_text(*stopped),
                           max(metrics.frames_out, recorded_frames(sink)), summary, outputs)

    def _snapshot(self) -> tuple[Any, ...]:
        from pipeline.app.cluster_metrics import snapshot

        try:
            return tuple(snapshot(self._collector, {"pipeline": self.name}))
        except Exception as error:  # noqa: BLE001 - metrics never stop a pipeline
            log.warning("reading metrics failed", error=f"{type(error).__name__}: {error}")
            return ()


def recorded_frames(sink: Any) -> int:
    """The records (one per frame) ``sink`` wrote to its records file in this run (a segmented
    sink's: its open segment's), 0 without one.

    A sink writes a batch part's records before its video: when the video's write fails (a
    full disk), the records hold the frames of that part, which its source's count of frames
    done (``SourceMetrics.frames_out``) lacks; the records are what the run kept (a rerun
    resumes after them), and ``output incomplete`` reports them beside the source summary.
    """
    from stages.sinks import JsonlWriter

    return next((writer.frames for writer in getattr(sink, "writers", ())
                 if type(writer) is JsonlWriter), 0)


def _name_of(source: SourceConfig | dict) -> str | None:
    return source.get("name") if isinstance(source, dict) else source.name


def host_main(name: str, device: int | None, config: PipelineConfig, conn: Connection,
              metrics: bool, cpus: list[int] | None = None,
              expected_sources: int | None = None, cores: int | None = None,
              engine: tuple[Any, int] | None = None) -> None:
    """A host in a spawned process: build and run its graph, serve the supervisor's calls
    from ``conn`` and send it a ``HostReport`` whenever there is news (``due_report``).

    Calls are tuples ``(method, *args)`` of ``PipelineHost``: ``("add", SourceRequest)``,
    ``("remove", name)``, ``("want", names)``, ``("stop",)``, ``("abort_all",)``, and
    ``("exit",)`` to end once the graph has finished. The supervisor's end of the pipe
    closing ends the process (its graph aborted): a killed supervisor leaves no host behind.

    Args:
        device: the GPU this host uses (seen as device 0: ``CUDA_VISIBLE_DEVICES``), or None.
        cpus: the cores this host runs on (its threads and the processes it starts), or
            None for all: hosts on the CPU path share the cores out, else each would size
            its inference threads for every core and they would fight over them.
        expected_sources: its share of the sources (sizes its ring and decode workers).
        cores: its share of the supervisor's cores (sizes its decode workers) when ``cpus``
            does not pin it to them.
        engine: (``EngineLink``, worker number): a source worker of that engine.
    """
    from pipeline.app.workers import name_this_process
    from pipeline.logging import configure_logging, register_stack_dump

    if cpus:  # before onnxruntime sizes its thread pool from the cores it may use
        os.sched_setaffinity(0, cpus)
    if device is not None:  # before anything touches CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = str(device)
        config.inference.gpu_id = 0
    name_this_process(name)
    register_stack_dump()  # kill -USR1: every thread's stack
    # Ctrl-C, or a SIGTERM to the whole group, reaches the supervisor, which stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(config.runtime.log_format, config.runtime.log_level)
    host = PipelineHost(config, name, expected_sources, metrics=metrics,
                        cores=None if cpus else cores, engine=engine)
    host.start()
    ready = exiting = False
    try:
        while not (exiting and host.finished):
            if conn.poll(POLL_S):
                method, *args = conn.recv()
                if method == "exit":
                    exiting = True
                else:
                    getattr(host, method)(*args)
            report = host.due_report()
            if (report.replies or report.ended or report.frames or report.failure
                    or report.finished or report.ready != ready or report.metrics is not None
                    or report.view is not None):
                conn.send(("report", report))
            ready = report.ready
    except (EOFError, BrokenPipeError, ConnectionResetError):
        log.warning("supervisor gone: aborting", host=name)
        host.abort_all()
