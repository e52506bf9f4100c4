"""The graph: source threads fan in to a chain of stages that fans out to per-source sinks.

```
source A ─┐                                                       ┌─> sink A
source B ─┼─> queue ─> stage 1 ─> queue ─> ... ─> stage n ─> route ┼─> sink B
source C ─┘  (one lane per source: block or drop_oldest)           └─> sink C
```

Each node runs on its own thread. The first exception in any node stops the graph: every
thread is woken, joined with a timeout, and ``run()`` raises ``PipelineError`` from it.
``request_stop()`` (first Ctrl-C) makes the sources stop reading and end their streams, so
everything queued drains and every sink finalises; ``abort()`` (second Ctrl-C) stops at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import structlog

from pipeline.metrics import SourceMetrics, StageMetrics
from pipeline.queues import CLOSED, StageQueue, Stopped
from pipeline.records import EndOfStream, Frame
from pipeline.stage import SourceStage, Stage, frames_in

log = structlog.get_logger("graph")

JOIN_TIMEOUT_S = 10.0
LATENCY_SAMPLES = 10_000


class PipelineError(RuntimeError):
    """A stage failed; the message names it and the cause is chained."""


class Graph:
    """Wires sources, a chain of stages and one sink per source, and runs them.

    Args:
        sources: one per configured source, names unique.
        chain: stages every frame passes through, in order (at least one).
        sinks: the last stage of each source, keyed by source name.
        queue_size: capacity of every queue lane.
        on_frame_done: called with each frame once its sink handled it (progress bars).
    """

    def __init__(
        self,
        sources: list[SourceStage],
        chain: list[Stage],
        sinks: dict[str, Stage],
        queue_size: int,
        on_frame_done: Callable[[Frame], None] | None = None,
    ) -> None:
        if not chain:
            raise ValueError("the graph needs at least one stage between sources and sinks")
        self.sources, self.chain, self.sinks = sources, chain, sinks
        self.stop_reading = threading.Event()
        self._stop = threading.Event()
        self._on_frame_done = on_frame_done
        self._error: tuple[str, BaseException] | None = None
        self._error_lock = threading.Lock()
        self.stage_metrics = {n.name: StageMetrics(n.name) for n in [*chain, *sinks.values()]}
        self.source_metrics = {s.name: SourceMetrics(s.name) for s in sources}

        self._inboxes = [StageQueue(stage.name, self._stop) for stage in chain]
        for source in sources:
            policy = "drop_oldest" if source.live else "block"
            self._inboxes[0].add_lane(source.name, queue_size, policy)
        for upstream, inbox in zip(chain, self._inboxes[1:]):
            inbox.add_lane(upstream.name, queue_size)
        self._sink_inboxes = {}
        for name, sink in sinks.items():
            inbox = StageQueue(sink.name, self._stop)
            inbox.add_lane(chain[-1].name, queue_size)
            self._sink_inboxes[name] = inbox
        self._threads: list[threading.Thread] = []

    # -- control -------------------------------------------------------------------------
    def request_stop(self) -> None:
        """Stop reading sources; what is queued still drains and outputs are finalised."""
        self.stop_reading.set()

    def abort(self) -> None:
        """Stop every thread as soon as possible."""
        self._stop.set()
        for queue in [*self._inboxes, *self._sink_inboxes.values()]:
            queue.wake()

    def _fail(self, node: str, error: BaseException) -> None:
        with self._error_lock:
            if self._error is None:
                self._error = (node, error)
                log.error("stage failed", stage=node, error=f"{type(error).__name__}: {error}")
        self.abort()

    # -- threads -------------------------------------------------------------------------
    def _run_source(self, source: SourceStage) -> None:
        inbox = self._inboxes[0]
        try:
            for item in source.frames(self.stop_reading):
                if isinstance(item, EndOfStream) and item.error:
                    self.source_metrics[source.name].error = item.error
                inbox.put(source.name, item)
        except Stopped:
            pass
        except BaseException as error:  # noqa: BLE001 - surfaces from run()
            self._fail(source.name, error)
        finally:
            inbox.close(source.name)
            self._close_quietly(source)

    def _run_stage(self, stage: Stage, inbox: StageQueue, emit: Callable[[Any], None],
                   close_outputs: Callable[[], None]) -> None:
        metrics = self.stage_metrics[stage.name]
        try:
            while True:
                item = inbox.get(timeout=stage.poll_interval_s)
                started = time.perf_counter()
                if item is CLOSED:
                    self._emit_all(stage.finish(), emit)
                    break
                if item is None:
                    outputs: Iterable[Any] = stage.on_idle()
                elif isinstance(item, EndOfStream):
                    outputs = stage.end_of_stream(item)
                else:
                    outputs = stage.process(item)
                self._emit_all(outputs, emit)
                if item is not None and not isinstance(item, EndOfStream):
                    metrics.record(frames_in(item), time.perf_counter() - started)
                    if stage.name in self._sink_names and isinstance(item, Frame):
                        self._frame_done(item)
        except Stopped:
            pass
        except BaseException as error:  # noqa: BLE001 - surfaces from run()
            self._fail(stage.name, error)
        finally:
            close_outputs()
            self._close_quietly(stage)

    @staticmethod
    def _emit_all(outputs: Iterable[Any], emit: Callable[[Any], None]) -> None:
        for output in outputs:
            emit(output)

    def _frame_done(self, frame: Frame) -> None:
        metrics = self.source_metrics[frame.source]
        metrics.frames_out += 1
        if len(metrics.latency_s) < LATENCY_SAMPLES:
            metrics.latency_s.append(time.time() - frame.capture_time)
        if self._on_frame_done is not None:
            self._on_frame_done(frame)

    def _route(self, item: Any) -> None:
        """Send the last chain stage's output to the sink of the item's source."""
        self._sink_inboxes[item.source].put(self.chain[-1].name, item)

    def _close_quietly(self, node: Stage | SourceStage) -> None:
        try:
            node.close()
        except BaseException as error:  # noqa: BLE001 - surfaces from run()
            self._fail(node.name, error)

    # -- run -----------------------------------------------------------------------------
    def run(self) -> None:
        """Open every stage, run all threads until the sources end, and join them.

        Raises:
            PipelineError: a stage or source failed; the first failure is the cause.
        """
        self._sink_names = {sink.name for sink in self.sinks.values()}
        opened: list[Stage] = []
        try:
            for stage in [*self.chain, *self.sinks.values()]:
                stage.open()
                opened.append(stage)
        except BaseException as error:
            failed = stage.name
            for started in opened:
                self._close_quietly(started)
            raise PipelineError(f"stage {failed} failed to start: {error}") from error

        for source in self.sources:
            self._threads.append(threading.Thread(
                target=self._run_source, args=(source,), name=f"source:{source.name}", daemon=True))
        for i, stage in enumerate(self.chain):
            if i + 1 < len(self.chain):
                queue = self._inboxes[i + 1]
                emit = (lambda item, q=queue, n=stage.name: q.put(n, item))
                close = (lambda q=queue, n=stage.name: q.close(n))
            else:
                emit = self._route
                close = (lambda n=stage.name: [q.close(n) for q in self._sink_inboxes.values()])
            self._threads.append(threading.Thread(
                target=self._run_stage, args=(stage, self._inboxes[i], emit, close),
                name=f"stage:{stage.name}", daemon=True))
        for name, sink in self.sinks.items():
            self._threads.append(threading.Thread(
                target=self._run_stage,
                args=(sink, self._sink_inboxes[name], lambda item: None, lambda: None),
                name=f"sink:{sink.name}", daemon=True))
        for thread in self._threads:
            thread.start()
        self._join()
        for source in self.sources:
            self.source_metrics[source.name].dropped = self._inboxes[0].dropped()[source.name]
        if self._error is not None:
            node, error = self._error
            raise PipelineError(f"{node}: {type(error).__name__}: {error}") from error

    def _join(self) -> None:
        # Join with short timeouts so the main thread keeps handling signals (Ctrl-C).
        while any(t.is_alive() for t in self._threads) and not self._stop.is_set():
            for thread in self._threads:
                thread.join(0.1)
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck:
            log.error("threads did not stop in time", threads=stuck, timeout_s=JOIN_TIMEOUT_S)
            if self._error is None:
                self._error = ("graph", TimeoutError(f"threads did not stop: {', '.join(stuck)}"))
