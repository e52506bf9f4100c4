"""The graph: source threads fan in to a chain of stages that fans out to per-source sinks.

```
source A ─┐                                                          ┌─> sink A
source B ─┼─> queue ─> batcher ─> queue ─> ... ─> stage n ─> split ──┼─> sink B
source C ─┘  (one lane per source: block or drop_oldest)   by source └─> sink C
```

Frames travel one by one only into the batcher; after it every item is a batch record, and
the last stage's ``BatchDetections`` is split by source once per batch (one queue put per
source present in the batch).

Each node runs on its own thread. The first exception in any node stops the graph: every
thread is woken, joined with a timeout, and ``run()`` raises ``PipelineError`` from it.
``request_stop()`` (first Ctrl-C) makes the sources stop reading and end their streams, so
everything queued drains and every sink finalises; ``abort()`` (second Ctrl-C) stops at once.

Live sources never hold the graph up: their lanes, in front of the first stage and of their
sink, drop the oldest waiting item when full (returning its frame slots to the ring), so a
frame's capture-to-sink latency stays below (frames the queues can hold) x (time per frame of
the slowest stage). The run ends when every source ended; when all file sources are done, the
live ones are stopped too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import structlog

from pipeline.metrics import SourceMetrics, StageMetrics
from pipeline.queues import CLOSED, StageQueue, Stopped
from pipeline.records import BatchDetections, EndOfStream, Frame
from pipeline.slots import SlotRing
from pipeline.stage import SourceStage, Stage, frames_in

log = structlog.get_logger("graph")

JOIN_TIMEOUT_S = 10.0
# After abort(), how long to wait for a source blocked in network I/O (it ends by itself
# within its read timeout; its thread is a daemon and holds no output open).
SOURCE_ABORT_WAIT_S = 1.0
REPORT_INTERVAL_S = 60.0  # a "source stats" log line per source this often


class PipelineError(RuntimeError):
    """A stage failed; the message names it and the cause is chained."""


class Graph:
    """Wires sources, a chain of stages and one sink per source, and runs them.

    Args:
        sources: one per configured source, names unique.
        chain: stages every frame passes through, in order (at least one).
        sinks: the last stage of each source, keyed by source name.
        queue_size: capacity of every queue lane.
        on_batch_done: called from a sink's thread with (source name, that source's part of
            a batch) once the sink handled it (progress bars, Prometheus).
        stop: the event that aborts the graph, when stages created before it need it.
        ring: the ``SlotRing`` the sources' frames live in: frames and batch parts dropped
            from a live lane give their slots back to it. None when frames own their images.
        release_at_sink: the sinks return their parts' slots (they are the last readers of
            the host images); dropped sink-lane parts then return theirs here.
    """

    def __init__(
        self,
        sources: list[SourceStage],
        chain: list[Stage],
        sinks: dict[str, Stage],
        queue_size: int,
        on_batch_done: Callable[[str, BatchDetections], None] | None = None,
        stop: threading.Event | None = None,
        ring: SlotRing | None = None,
        release_at_sink: bool = False,
    ) -> None:
        if not chain:
            raise ValueError("the graph needs at least one stage between sources and sinks")
        self.sources, self.chain, self.sinks = sources, chain, sinks
        self.stop_reading = threading.Event()
        self._stop = stop or threading.Event()  # shared with stages that wait on GPU buffers
        self.gpu: Any = None  # the GpuContext on the GPU path (for profiling), else None
        self.preview: Any = None  # the live view's PreviewHub (runtime.http), else None
        self.ring = ring
        self._on_batch_done = on_batch_done
        self._error: tuple[str, BaseException] | None = None
        self._error_lock = threading.Lock()
        self.stage_metrics = {n.name: StageMetrics(n.name) for n in [*chain, *sinks.values()]}
        self.source_metrics = {s.name: SourceMetrics(s.name) for s in sources}

        self._dropped = {source.name: 0 for source in sources}  # frames, per source
        self._dropped_lock = threading.Lock()
        self._inboxes = [StageQueue(stage.name, self._stop) for stage in chain]
        for source in sources:
            if source.live:
                self._inboxes[0].add_lane(source.name, queue_size, "drop_oldest",
                                          on_drop=self._drop_frame)
            else:
                self._inboxes[0].add_lane(source.name, queue_size, "block")
        for upstream, inbox in zip(chain, self._inboxes[1:]):
            inbox.add_lane(upstream.name, queue_size)
        self._sink_inboxes = {}
        live = {source.name: source.live for source in sources}
        self._release_at_sink = release_at_sink
        for name, sink in sinks.items():
            inbox = StageQueue(sink.name, self._stop)
            # A slow sink of a live source drops its oldest part rather than stall the chain.
            if live.get(name):
                inbox.add_lane(chain[-1].name, queue_size, "drop_oldest", on_drop=self._drop_part)
            else:
                inbox.add_lane(chain[-1].name, queue_size, "block")
            self._sink_inboxes[name] = inbox
        self._threads: list[threading.Thread] = []
        self._services: list[tuple[Callable[[], None], Callable[[], None]]] = []

    @property
    def services(self) -> list[tuple[Callable[[], None], Callable[[], None]]]:
        """The (start, close) pairs added with ``add_service``, in order."""
        return list(self._services)

    @property
    def abort_event(self) -> threading.Event:
        """The event that aborts the run (stages and sources built before the graph wait
        on it)."""
        return self._stop

    def add_service(self, start: Callable[[], None], close: Callable[[], None]) -> None:
        """Something the run needs besides the threads (decode worker processes, the shared
        frame ring): ``start()`` is called right before the threads start, ``close()`` once
        they have ended (also after a failure), in reverse order of adding."""
        self._services.append((start, close))

    # -- control -------------------------------------------------------------------------
    def request_stop(self) -> None:
        """Stop reading sources; what is queued still drains and outputs are finalised."""
        self.stop_reading.set()

    def abort(self) -> None:
        """Stop every thread as soon as possible."""
        self._stop.set()
        for queue in [*self._inboxes, *self._sink_inboxes.values()]:
            queue.wake()

    def _drop_frame(self, frame: Frame) -> None:
        """A live lane in front of the batcher dropped ``frame``: count it, free its slot."""
        with self._dropped_lock:
            self._dropped[frame.source] += 1
        if self.ring is not None and frame.slot >= 0:
            self.ring.release([frame.slot])

    def _drop_part(self, part: BatchDetections) -> None:
        """A live sink lane dropped a batch part: count its frames, free their slots."""
        name = part.frames.source_name(0)
        with self._dropped_lock:
            self._dropped[name] += len(part)
        if self.ring is not None and self._release_at_sink:
            self.ring.release(part.frames.slot)

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

    def _run_stage(self, stage: Stage, inbox: StageQueue, emit: Callable[[Any], float],
                   close_outputs: Callable[[], None]) -> None:
        """One stage's thread. Time inside its hooks is split into work and blocked time:
        blocked is what ``emit`` waited for room downstream plus what the stage itself
        reported waiting (``stage.blocked_s``: free buffers, the GPU)."""
        metrics = self.stage_metrics[stage.name]
        sink_source = self._sink_of.get(stage.name)
        try:
            while True:
                item = inbox.get(timeout=stage.poll_interval_s)
                started = time.perf_counter()
                stage_blocked = stage.blocked_s
                if item is CLOSED:
                    self._emit_all(stage.finish(), emit)
                    break
                if item is None:
                    outputs: Iterable[Any] = stage.on_idle()
                elif isinstance(item, EndOfStream):
                    outputs = stage.end_of_stream(item)
                else:
                    outputs = stage.process(item)
                waited = self._emit_all(outputs, emit)
                if item is not None and not isinstance(item, EndOfStream):
                    blocked = waited + stage.blocked_s - stage_blocked
                    metrics.record(frames_in(item), time.perf_counter() - started - blocked,
                                   blocked)
                    if sink_source is not None:
                        self._part_done(sink_source, item)
        except Stopped:
            pass
        except BaseException as error:  # noqa: BLE001 - surfaces from run()
            self._fail(stage.name, error)
        finally:
            close_outputs()
            self._close_quietly(stage)

    @staticmethod
    def _emit_all(outputs: Iterable[Any], emit: Callable[[Any], float]) -> float:
        """Emit every output; returns the seconds spent waiting for room downstream."""
        waited = 0.0
        for output in outputs:
            waited += emit(output)
        return waited

    def _part_done(self, source: str, part: BatchDetections) -> None:
        """A sink handled ``part`` (frames of ``source``): latencies, counters, hooks."""
        latencies = time.time() - part.frames.capture_time
        self.source_metrics[source].frames_done(latencies)
        if self._on_batch_done is not None:
            self._on_batch_done(source, part)

    def _route(self, item: Any) -> float:
        """Send the last chain stage's output to the sinks: an end marker to its source's
        sink, a batch split by source (once per batch), each part to its source's sink."""
        upstream = self.chain[-1].name
        if isinstance(item, EndOfStream):
            return self._sink_inboxes[item.source].put(upstream, item)
        waited = 0.0
        for source, part in item.by_source():
            waited += self._sink_inboxes[source].put(upstream, part)
        return waited

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
        started: list[Callable[[], None]] = []
        try:
            for start, close in self._services:
                start()
                started.append(close)
            self._run()
        finally:
            for close in reversed(started):
                try:
                    close()
                except Exception as error:  # noqa: BLE001 - the run's own error matters more
                    log.error("closing a service failed", error=f"{type(error).__name__}: {error}")

    def _run(self) -> None:
        self._sink_of = {sink.name: name for name, sink in self.sinks.items()}
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
                args=(sink, self._sink_inboxes[name], lambda item: 0.0, lambda: None),
                name=f"sink:{sink.name}", daemon=True))
        for thread in self._threads:
            thread.start()
        self._join()
        self.refresh_source_metrics()
        if self._error is not None:
            node, error = self._error
            raise PipelineError(f"{node}: {type(error).__name__}: {error}") from error

    def refresh_source_metrics(self) -> None:
        """Bring ``source_metrics``' drop and reconnection counters up to date (any thread)."""
        with self._dropped_lock:
            dropped = dict(self._dropped)
        for source in self.sources:
            metrics = self.source_metrics[source.name]
            metrics.dropped = dropped[source.name] + source.dropped
            metrics.reconnects = source.reconnects

    def queue_depths(self) -> dict[str, int]:
        """Items waiting now in front of each stage and sink, by its name."""
        return {queue.name: queue.depth()
                for queue in [*self._inboxes, *self._sink_inboxes.values()]}

    def _join(self) -> None:
        # Join with short timeouts so the main thread keeps handling signals (Ctrl-C).
        started = time.monotonic()
        next_report = started + REPORT_INTERVAL_S
        file_threads = [t for t, s in zip(self._threads, self.sources) if not s.live]
        mixed = bool(file_threads) and any(s.live for s in self.sources)
        while not self._stop.is_set():
            alive = [t for t in self._threads if t.is_alive()]
            if not alive:
                break
            alive[0].join(0.1)
            if (mixed and not self.stop_reading.is_set()
                    and not any(t.is_alive() for t in file_threads)):
                log.info("every file source is done: stopping the live sources")
                self.request_stop()
            if time.monotonic() >= next_report:
                next_report += REPORT_INTERVAL_S
                self.refresh_source_metrics()
                for metrics in self.source_metrics.values():
                    log.info("source stats", **metrics.summary(time.monotonic() - started))
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        sources = self._threads[:len(self.sources)]
        for thread in self._threads:
            wait = deadline - time.monotonic()
            if thread in sources and self._stop.is_set():
                wait = min(wait, SOURCE_ABORT_WAIT_S)
            thread.join(max(0.0, wait))
        blocked = [t.name for t in sources if t.is_alive()]
        if blocked:
            log.warning("sources still blocked reading: left behind", threads=blocked)
        stuck = [t.name for t in self._threads if t.is_alive() and t not in sources]
        if stuck:
            log.error("threads did not stop in time", threads=stuck, timeout_s=JOIN_TIMEOUT_S)
            if self._error is None:
                self._error = ("graph", TimeoutError(f"threads did not stop: {', '.join(stuck)}"))
