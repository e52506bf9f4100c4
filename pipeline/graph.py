"""The graph: source threads fan in to a chain of stages that fans out to per-source sinks.

```
source A ─┐                                                          ┌─> sink A
source B ─┼─> queue ─> batcher ─> queue ─> ... ─> stage n ─> split ──┼─> sink B
source C ─┘  (one lane per source: block or drop_oldest)   by source └─> sink C
```

Frames travel one by one only into the batcher; after it every item is a batch record, and
the last stage's ``BatchDetections`` is split by source once per batch (one queue put per
source present in the batch).

The graph checks the wiring when it is built, from the stages' ports (``Stage.consumes`` and
``Stage.produces``): the first stage must take the sources' ``Frame``, each stage what the
one before it produces, the sinks what the last produces, and the last must produce
``BatchDetections`` (the split needs it). A mis-wired chain is a ``ValueError`` naming both
stages and their types.

Each node runs on its own thread. The first exception in any node stops the graph: every
thread is woken, joined with a timeout, and ``run()`` raises ``PipelineError`` from it.
``request_stop()`` (first Ctrl-C) makes the sources stop reading and end their streams, so
everything queued drains and every sink finalises; ``abort()`` (second Ctrl-C) stops at once.

Live sources never hold the graph up: their lanes, in front of the first stage and of their
sink, drop the oldest waiting item when full (returning its frame slots to the ring), so a
frame's capture-to-sink latency stays below (frames the queues can hold) x (time per frame of
the slowest stage).

When the run ends by itself is ``stop_when`` (``runtime.stop_when``): ``all_ended`` once every
source ended, ``files_ended`` once every file source ended (the cameras are stopped then),
``never`` only on ``request_stop``. Until then sources can be added (``add_source``) and
removed (``remove_source``) while the others run: the first stage's queue has a ``control``
lane, closed only when the run ends, so the chain never sees its input close in between. The
name of a source that was removed or ended may be used again once its outputs are final: the
new source replaces it (its counters start afresh; ``pipeline.app.control`` gives it new output
names).
"""

from __future__ import annotations

import threading
import time
import types
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any, get_args

import numpy as np
import structlog

from pipeline.metrics import STALE_AFTER_S, SourceMetrics, StageMetrics, source_state
from pipeline.queues import CLOSED, StageQueue, Stopped
from pipeline.records import LETTERBOX_COLUMNS, BatchDetections, EndOfStream, Frame, FrameBatch
from pipeline.slots import SlotRing
from pipeline.stage import SourceStage, Stage, frames_in

log = structlog.get_logger("graph")

JOIN_TIMEOUT_S = 10.0
# After abort(), how long to wait for a source blocked in network I/O (it ends by itself
# within its read timeout; its thread is a daemon and holds no output open).
SOURCE_ABORT_WAIT_S = 1.0
REPORT_INTERVAL_S = 60.0  # a "source stats" log line per source this often
DROP_REPORT_S = 5.0  # a "live frames dropped" warning, with why, at most this often
# Why a live frame was dropped (``drop_frame``'s reasons, then the decoders' two)
QUEUE_FULL, SINK_BEHIND = "queue_full", "sink_behind"
DECODER_NO_SLOT, DECODER_BEHIND = "no_frame_slot", "behind_real_time"
CONTROL_LANE = "control"  # the first queue's lane that stays open until the run ends
STOP_WHEN = ("all_ended", "files_ended", "never")
SOURCE_RECORD = Frame  # what every source produces (``SourceStage.frames``)
SINK_RECORD = BatchDetections  # what the last stage produces: the graph splits it by source

Port = type | types.UnionType | None


def port_name(port: Port) -> str:
    """A port's record type as written in a class line: ``FrameBatch``,
    ``FrameBatch | BatchDetections``, ``nothing`` for None."""
    if port is None:
        return "nothing"
    members = get_args(port) if isinstance(port, types.UnionType) else (port,)
    return " | ".join(getattr(m, "__name__", repr(m)) for m in members)


def accepts(consumes: Port, produces: Port) -> bool:
    """Whether a stage that consumes ``consumes`` takes every record of type ``produces``
    (each member of a union)."""
    if consumes is None or produces is None:
        return False
    members = get_args(produces) if isinstance(produces, types.UnionType) else (produces,)
    return all(isinstance(m, type) and issubclass(m, consumes) for m in members)


def check_port(upstream: str, produces: Port, stage: Stage) -> None:
    """Raise ValueError unless ``stage`` consumes what ``upstream`` (a phrase naming it)
    produces."""
    if not accepts(stage.consumes, produces):
        raise ValueError(f"stage {stage.name!r} ({type(stage).__name__}) consumes "
                         f"{port_name(stage.consumes)}, but {upstream} produces "
                         f"{port_name(produces)}")


def check_chain(chain: list[Stage]) -> None:
    """Raise ValueError unless the chain is wired right: the first stage takes ``Frame``,
    each stage what the one before it produces, and the last produces ``BatchDetections``."""
    check_port("every source", SOURCE_RECORD, chain[0])
    for upstream, stage in zip(chain, chain[1:]):
        check_port(f"stage {upstream.name!r} ({type(upstream).__name__}) before it",
                   upstream.produces, stage)
    last = chain[-1]
    if not accepts(SINK_RECORD, last.produces):
        raise ValueError(f"the last stage {last.name!r} ({type(last).__name__}) produces "
                         f"{port_name(last.produces)}, but the graph splits "
                         f"{SINK_RECORD.__name__} by source for the sinks")


def end_part(eos: EndOfStream) -> BatchDetections:
    """A part of no frames of ``eos.source`` that carries ``eos.events`` (the exits the
    analytics stage made when the source ended), for ``on_batch_done``."""
    frames = FrameBatch.from_frames([], {}, (eos.source,),
                                    np.zeros((0, len(LETTERBOX_COLUMNS)), np.float32))
    return replace(BatchDetections.from_lists(frames, [], tracker_ids=[]), events=eos.events)


class PipelineError(RuntimeError):
    """A stage failed; the message names it and the cause is chained."""


class SourceConflict(RuntimeError):
    """A source cannot be added or removed now (a name in use, an unknown name, the run
    ending); the message says why."""


class Graph:
    """Wires sources, a chain of stages and one sink per source, and runs them.

    Args:
        sources: one per configured source, names unique.
        chain: stages every frame passes through, in order (at least one).
        sinks: the last stage of each source, keyed by source name.
        queue_size: capacity of every queue lane.
        on_batch_done: called from a sink's thread with (source name, that source's part of
            a batch) once the sink handled it (progress bars, Prometheus); and once more
            after the source's last part when its end marker carries events (the exits of
            the objects still inside a zone: ``EndOfStream.events``), with a part of no
            frames that carries them (``end_part``).
        stop: the event that aborts the graph, when stages created before it need it.
        ring: the ``SlotRing`` the sources' frames live in: frames and batch parts dropped
            from a live lane give their slots back to it. None when frames own their images.
        release_at_sink: the sinks return their parts' slots (they are the last readers of
            the host images); dropped sink-lane parts then return theirs here.
        stop_when: ``all_ended``, ``files_ended`` or ``never`` (module docstring).

    Raises:
        ValueError: an empty chain, a mis-wired chain or sink (their ports do not fit: the
            message names both stages and their types), or an unknown ``stop_when``.
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
        stop_when: str = "all_ended",
    ) -> None:
        if not chain:
            raise ValueError("the graph needs at least one stage between sources and sinks")
        if stop_when not in STOP_WHEN:
            raise ValueError(f"stop_when: expected one of {STOP_WHEN}, got {stop_when!r}")
        check_chain(chain)
        for sink in sinks.values():
            self._check_sink(chain, sink)
        self.sources, self.chain, self.sinks = list(sources), chain, dict(sinks)
        self.stop_when = stop_when
        self.queue_size = queue_size
        # Sources come and go while the run goes on: these change under _sources_lock, and
        # the dicts other threads read are replaced, never changed in place.
        # Re-entrant: request_stop may run in a signal handler on the thread holding it.
        self._sources_lock = threading.RLock()
        self._accepting = True  # sources may still be added
        self._running = False
        self._source_threads: dict[str, threading.Thread] = {}
        self._sink_threads: dict[str, threading.Thread] = {}
        self._source_stops = {source.name: threading.Event() for source in sources}
        self._lanes = {source.name: source.name for source in sources}  # name -> first lane
        self._lane_serial = 0
        self.removed: frozenset[str] = frozenset()  # asked to stop (``remove_source``)
        self.stop_reading = threading.Event()
        self.ready = threading.Event()  # every stage opened (the model warmed up), sources start
        self._stop = stop or threading.Event()  # shared with stages that wait on GPU buffers
        self.gpu: Any = None  # the GpuContext on the GPU path (for profiling), else None
        self.preview: Any = None  # the live view's PreviewHub (runtime.http), else None
        self.control: Any = None  # the pipeline.app.control.SourceControl, when built from a config
        self.ring = ring
        self._on_batch_done = on_batch_done
        self._error: tuple[str, BaseException] | None = None
        self._error_lock = threading.Lock()
        self.stage_metrics = {n.name: StageMetrics(n.name) for n in [*chain, *sinks.values()]}
        self.source_metrics = {s.name: SourceMetrics(s.name) for s in sources}

        self._dropped = {source.name: 0 for source in sources}  # frames, per source
        self._drop_reasons: Counter[str] = Counter()  # frames dropped after decoding, by why
        self._decoder_drops_told: dict[str, tuple[int, int]] = {}  # source: (no slot, behind)
        self._drop_reasons_told: Counter[str] = Counter()
        self._source_drops_told: dict[str, int] = {}  # source: its drops at the last report
        self.host: str | None = None  # its process's name in the run, in its drop warnings
        self._dropped_lock = threading.Lock()
        self._inboxes = [StageQueue(stage.name, self._stop) for stage in chain]
        self._inboxes[0].add_lane(CONTROL_LANE, 1)
        for source in sources:
            self._add_source_lane(source)
        for upstream, inbox in zip(chain, self._inboxes[1:]):
            inbox.add_lane(upstream.name, queue_size)
        self._sink_inboxes: dict[str, StageQueue] = {}
        self._release_at_sink = release_at_sink
        for source in sources:
            self._sink_inboxes[source.name] = self._make_sink_inbox(source)
        self._sink_of = {sink.name: name for name, sink in self.sinks.items()}
        self._threads: list[threading.Thread] = []
        self._services: list[tuple[Callable[[], None], Callable[[], None], bool]] = []

    @property
    def services(self) -> list[tuple[Callable[[], None], Callable[[], None]]]:
        """The (start, close) pairs added with ``add_service``, in order."""
        return [(start, close) for start, close, _ in self._services]

    @property
    def abort_event(self) -> threading.Event:
        """The event that aborts the run (stages and sources built before the graph wait
        on it)."""
        return self._stop

    def add_service(self, start: Callable[[], None], close: Callable[[], None],
                    with_sources: bool = False) -> None:
        """Something the run needs besides the threads (decode worker processes, the shared
        frame ring): ``start()`` is called when the run begins, or with ``with_sources`` once
        the stages opened (the model is ready: decode worker processes, so that no frame is
        decoded before), right before the threads start; ``close()`` once they have ended
        (also after a failure), in reverse order of starting."""
        self._services.append((start, close, with_sources))

    @staticmethod
    def _check_sink(chain: list[Stage], sink: Stage) -> None:
        """Raise ValueError unless ``sink`` consumes what the chain's last stage produces."""
        last = chain[-1]
        check_port(f"the last stage {last.name!r} ({type(last).__name__})", last.produces, sink)

    def _add_source_lane(self, source: SourceStage, lane: str | None = None) -> None:
        lane = lane or source.name
        if source.live:
            self._inboxes[0].add_lane(lane, self.queue_size, "drop_oldest",
                                      on_drop=lambda frame: self.drop_frame(frame, QUEUE_FULL))
        else:
            self._inboxes[0].add_lane(lane, self.queue_size, "block")

    def _make_sink_inbox(self, source: SourceStage) -> StageQueue:
        inbox = StageQueue(self.sinks[source.name].name, self._stop)
        # A slow sink of a live source drops its oldest part rather than stall the chain.
        if source.live:
            inbox.add_lane(self.chain[-1].name, self.queue_size, "drop_oldest",
                           on_drop=self._drop_part)
        else:
            inbox.add_lane(self.chain[-1].name, self.queue_size, "block")
        return inbox

    # -- control -------------------------------------------------------------------------
    def request_stop(self) -> None:
        """Stop reading sources; what is queued still drains and outputs are finalised."""
        self.stop_reading.set()
        with self._sources_lock:
            stops = list(self._source_stops.values())
        for stop in stops:
            stop.set()
        self._close_control()

    def _close_control(self) -> None:
        """No source can be added any more: the chain ends once the sources' lanes end."""
        with self._sources_lock:
            if not self._accepting:
                return
            self._accepting = False
        self._inboxes[0].close(CONTROL_LANE)

    def add_source(self, source: SourceStage, sink: Stage) -> None:
        """Add a source and its sink (any thread, before or during the run). Before the run
        has started its threads (the stages may still be opening: the model warming up),
        the source waits: its sink is opened and both threads start with the others, once
        the stages are open. During the run, the sink is opened and both threads start now.
        The stages in the chain must know the source already (``pipeline.app.control``).

        The name of a source that was removed or ended may be used again once its outputs
        are final (``reusable``): the new one replaces it (the caller gives it other outputs).

        Raises:
            SourceConflict: its name is in use (a source running, or one whose outputs are
                being finalised), or the run is ending.
            ValueError: the sink does not consume what the chain's last stage produces.
        """
        self._check_sink(self.chain, sink)
        with self._sources_lock:
            if not self._accepting:
                raise SourceConflict("the run is ending: no source can be added")
            lane = source.name
            if source.name in self._source_stops:
                if not self.reusable(source.name):
                    raise SourceConflict(f"source name {source.name!r} is in use in this run "
                                         "(running, or its outputs are being finalised)")
                self.sources = [s for s in self.sources if s.name != source.name]
                self.removed = self.removed - {source.name}
                # its threads have ended: the new source's are not started yet
                self._source_threads = {n: t for n, t in self._source_threads.items()
                                        if n != source.name}
                self._sink_threads = {n: t for n, t in self._sink_threads.items()
                                      if n != source.name}
                self._lane_serial += 1  # the old lane is closed: a lane of its own
                lane = f"{source.name}#{self._lane_serial}"
            self._lanes = {**self._lanes, source.name: lane}
            self.sinks = {**self.sinks, source.name: sink}
            self._source_stops[source.name] = threading.Event()
            self.stage_metrics = {**self.stage_metrics, sink.name: StageMetrics(sink.name)}
            self.source_metrics = {**self.source_metrics,
                                   source.name: SourceMetrics(source.name)}
            with self._dropped_lock:
                self._dropped[source.name] = 0
            self._sink_of = {**self._sink_of, sink.name: source.name}
            self._sink_inboxes = {**self._sink_inboxes, source.name: self._make_sink_inbox(source)}
            self._add_source_lane(source, lane)
            self.sources = [*self.sources, source]
            if self._running:
                try:
                    sink.open()
                except BaseException:
                    self._inboxes[0].close(lane)
                    raise
                self._start_sink(source.name, sink)
                self._start_source(source)
        log.debug("source lane added", source=source.name, live=source.live,
                  started=self._running)

    def remove_source(self, name: str) -> None:
        """Stop reading source ``name`` (any thread): what it queued still drains, then its
        outputs are finalised, as for a file that ended. Returns at once. A source added
        before the run started ends as soon as it starts.

        Raises:
            SourceConflict: no running (or waiting) source has that name.
        """
        with self._sources_lock:
            stop = self._source_stops.get(name)
            thread = self._source_threads.get(name)
            waiting = thread is None and any(s.name == name for s in self.sources)
            if stop is None or not (waiting or (thread is not None and thread.is_alive())):
                raise SourceConflict(f"no running source named {name!r}")
            self.removed = self.removed | {name}
        stop.set()
        log.info("source removed: its outputs are being finalised", source=name)

    def source_done(self, name: str) -> bool:
        """Whether source ``name``'s sink thread has ended (its outputs are final)."""
        thread = self._sink_threads.get(name)
        # Shown once started (``_start_sink``): a thread starting has its ident before it is
        # alive, and was taken for one that ended (a flaky CI failure: its source placed
        # again while it ran).
        return thread is not None and not thread.is_alive()

    def reusable(self, name: str) -> bool:
        """Whether ``name`` was a source's that has ended or was removed, its reading
        stopped and its outputs final: a new source may take the name."""
        reader = self._source_threads.get(name)
        return self.source_done(name) and (reader is None or not reader.is_alive())

    def source_state(self, name: str, shown_since: float,
                     stale_after_s: float = STALE_AFTER_S) -> str:
        """Source ``name``'s state (``pipeline.metrics.SOURCE_STATES``); call
        ``refresh_source_metrics`` first for the latest connection news."""
        done = self.source_done(name)
        if name in self.removed and done:
            return "removed"
        live = next((s.live for s in self.sources if s.name == name), False)
        return source_state(self.source_metrics[name], live, done, name in self.removed,
                            shown_since, stale_after_s)

    def abort(self) -> None:
        """Stop every thread as soon as possible."""
        self._stop.set()
        for queue in [*self._inboxes, *self._sink_inboxes.values()]:
            queue.wake()

    def drop_frame(self, frame: Frame, reason: str) -> None:
        """A live frame was dropped before the batcher (its lane: ``QUEUE_FULL``, or a source
        worker's remote inference stage, which names its reason): count it, free its slot."""
        with self._dropped_lock:
            self._dropped[frame.source] += 1
            self._drop_reasons[reason] += 1
        if self.ring is not None and frame.slot >= 0:
            self.ring.release([frame.slot])

    def _drop_part(self, part: BatchDetections) -> None:
        """A live sink lane dropped a batch part: count its frames, free their slots."""
        name = part.frames.source_name(0)
        with self._dropped_lock:
            self._dropped[name] += len(part)
            self._drop_reasons[SINK_BEHIND] += len(part)
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
        inbox, lane = self._inboxes[0], self._lanes[source.name]
        try:
            stop = self._source_stops[source.name]
            for item in source.frames(stop):
                if isinstance(item, EndOfStream) and item.error:
                    self.source_metrics[source.name].error = item.error
                elif isinstance(item, EndOfStream) and stop.is_set():  # the sink tells cut short
                    item = replace(item, stopped=True,
                                   total=getattr(source, "expected_frames", None))
                inbox.put(lane, item)
        except Stopped:
            pass
        except BaseException as error:  # noqa: BLE001 - surfaces from run()
            self._fail(source.name, error)
        finally:
            inbox.close(lane)
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
                    if sink_source is not None:  # its source's last item: finalise now
                        self._emit_all(outputs, emit)
                        self._emit_all(stage.finish(), emit)
                        if item.events and self._on_batch_done is not None:
                            self._on_batch_done(sink_source, end_part(item))
                        break
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
        """Start the services, open every stage (the infer stage warms the model up), start
        the services that go with the sources (decode worker processes: no frame is decoded
        before the model is ready), run all threads until the sources end, and join them.

        Raises:
            PipelineError: a stage or source failed; the first failure is the cause.
        """
        started: list[Callable[[], None]] = []
        try:
            for start, close, with_sources in self._services:
                if not with_sources:
                    start()
                    started.append(close)
            opened = self._open_stages()
            with self._sources_lock:  # a source added meanwhile waits for its threads
                try:
                    opened += self._open_sinks()
                    for start, close, with_sources in self._services:
                        if with_sources:
                            start()
                            started.append(close)
                except BaseException:
                    self._accepting = False
                    for stage in opened:
                        self._close_quietly(stage)
                    raise
                self._start_threads()
            self._join_all()
        finally:
            for close in reversed(started):
                try:
                    close()
                except Exception as error:  # noqa: BLE001 - the run's own error matters more
                    log.error("closing a service failed", error=f"{type(error).__name__}: {error}")

    def _open_stages(self) -> list[Stage]:
        """Open the chain's stages, in order; on a failure close those opened (the sinks
        open when the threads start: ``_start_threads``).

        Raises:
            PipelineError: naming the stage that failed to open.
        """
        opened: list[Stage] = []
        try:
            for stage in self.chain:
                stage.open()
                opened.append(stage)
        except BaseException as error:
            failed = stage.name
            self._accepting = False  # add_source stops waiting for the start
            for started in opened:
                self._close_quietly(started)
            raise PipelineError(f"stage {failed} failed to start: {error}") from error
        return opened

    def _open_sinks(self) -> list[Stage]:
        """Open the sinks of the sources added before the run (the caller holds the sources
        lock); on a failure close those opened.

        Raises:
            PipelineError: naming the sink that failed to open.
        """
        opened: list[Stage] = []
        for source in self.sources:
            sink = self.sinks[source.name]
            try:
                sink.open()
            except BaseException as error:
                for started in opened:
                    self._close_quietly(started)
                raise PipelineError(f"stage {sink.name} failed to start: {error}") from error
            opened.append(sink)
        return opened

    def _start_threads(self) -> None:
        """Start the chain's threads, then every source's sink and source thread (the caller
        holds the sources lock)."""
        for i, stage in enumerate(self.chain):
            if i + 1 < len(self.chain):
                queue = self._inboxes[i + 1]
                emit = (lambda item, q=queue, n=stage.name: q.put(n, item))
                close = (lambda q=queue, n=stage.name: q.close(n))
            else:
                emit = self._route
                close = (lambda n=stage.name: [q.close(n) for q in self._sink_inboxes_final()])
            self._threads.append(threading.Thread(
                target=self._run_stage, args=(stage, self._inboxes[i], emit, close),
                name=f"stage:{stage.name}", daemon=True))
        for thread in self._threads:
            thread.start()
        self._running = True
        self.ready.set()
        for source in self.sources:
            self._start_sink(source.name, self.sinks[source.name])
        for source in self.sources:
            self._start_source(source)

    def _join_all(self) -> None:
        """Wait for every thread (the run's end), then raise the first failure."""
        self._join()
        self.refresh_source_metrics()
        if self._error is not None:
            raise PipelineError(self.failure()) from self._error[1]

    def failure(self) -> str | None:
        """The first stage failure, in the words ``run`` raises it with (``"sink:cam:
        OSError: [Errno 28] No space left on device: ..."``), or None while none failed."""
        with self._error_lock:
            if self._error is None:
                return None
            node, error = self._error
        return f"{node}: {type(error).__name__}: {error}"

    def _start_sink(self, name: str, sink: Stage) -> None:
        thread = threading.Thread(
            target=self._run_stage,
            args=(sink, self._sink_inboxes[name], lambda item: 0.0, lambda: None),
            name=f"sink:{sink.name}", daemon=True)
        thread.start()  # then shown: a thread seen there is alive until it ends (``source_done``)
        self._sink_threads = {**self._sink_threads, name: thread}

    def _start_source(self, source: SourceStage) -> None:
        thread = threading.Thread(target=self._run_source, args=(source,),
                                  name=f"source:{source.name}", daemon=True)
        thread.start()  # then shown, as the sinks' (``_start_sink``)
        self._source_threads = {**self._source_threads, source.name: thread}

    def _sink_inboxes_final(self) -> list[StageQueue]:
        """Every sink's queue, once no source can be added any more (the last chain stage
        closes them when it ends, which is only after the control lane closed)."""
        with self._sources_lock:
            return list(self._sink_inboxes.values())

    def refresh_source_metrics(self) -> None:
        """Bring ``source_metrics``' drop and reconnection counters up to date (any thread)."""
        with self._dropped_lock:
            dropped = dict(self._dropped)
        metrics_of = self.source_metrics
        for source in list(self.sources):
            metrics = metrics_of[source.name]
            metrics.dropped = dropped[source.name] + source.dropped
            metrics.reconnects = source.reconnects
            metrics.link = source.link

    def report_drops(self, seconds: float) -> None:
        """Log one warning when live frames were dropped since the last call (``seconds``
        ago), counted by why: ``queue_full`` (a source's lane), ``sink_behind`` (its sink's
        lane), the remote inference stage's reasons (``no_engine_slot``: its worker's share
        of the engine's ring in use; ``engine_away``, ``engine_lost``), and the decoders'
        ``no_frame_slot`` (every host frame slot in flight) and ``behind_real_time``
        (skipped to a keyframe); with how many sources dropped, the one that dropped most, and
        ``host`` where set. Called every ``DROP_REPORT_S`` while the graph runs, and once
        as it ends."""
        with self._dropped_lock:
            reasons = self._drop_reasons - self._drop_reasons_told
            self._drop_reasons_told = Counter(self._drop_reasons)
            in_graph = dict(self._dropped)
        by_source: dict[str, int] = {}
        for source in list(self.sources):
            now = (source.dropped - source.skipped, source.skipped)
            told = self._decoder_drops_told.get(source.name, (0, 0))
            if now[0] < told[0] or now[1] < told[1]:
                told = (0, 0)  # a new source of that name
            self._decoder_drops_told[source.name] = now
            for reason, new in ((DECODER_NO_SLOT, now[0] - told[0]),
                                (DECODER_BEHIND, now[1] - told[1])):
                if new:
                    reasons[reason] += new
            total = in_graph.get(source.name, 0) + source.dropped
            before = self._source_drops_told.get(source.name, 0)
            self._source_drops_told[source.name] = total
            new = total - before if total >= before else total  # (a new source of that name)
            if new:
                by_source[source.name] = new
        if reasons:
            most = max(by_source, key=by_source.__getitem__, default=None)
            log.warning("live frames dropped", seconds=round(seconds, 1),
                        frames=sum(reasons.values()), **dict(sorted(reasons.items())),
                        sources=len(by_source),
                        **({"most": f"{most} ({by_source[most]})"} if most else {}),
                        **({"host": self.host} if self.host else {}))

    def queue_depths(self) -> dict[str, int]:
        """Items waiting now in front of each stage and sink, by its name."""
        return {queue.name: queue.depth()
                for queue in [*self._inboxes, *list(self._sink_inboxes.values())]}

    def _join(self) -> None:
        # Join with short timeouts so the main thread keeps handling signals (Ctrl-C).
        started = time.monotonic()
        next_report = started + REPORT_INTERVAL_S
        drops_told_at = started
        while not self._stop.is_set():
            threads = self._all_threads()
            alive = [t for t in threads if t.is_alive()]
            if not alive:
                break
            alive[0].join(0.1)
            self._check_stop_when()
            if time.monotonic() >= drops_told_at + DROP_REPORT_S:
                self.report_drops(time.monotonic() - drops_told_at)
                drops_told_at = time.monotonic()
            if time.monotonic() >= next_report:
                next_report += REPORT_INTERVAL_S
                self.refresh_source_metrics()
                for metrics in list(self.source_metrics.values()):
                    log.info("source stats", **metrics.summary(time.monotonic() - started))
        self._close_control()
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        sources = list(self._source_threads.values())
        for thread in self._all_threads():
            wait = deadline - time.monotonic()
            if thread in sources and self._stop.is_set():
                wait = min(wait, SOURCE_ABORT_WAIT_S)
            thread.join(max(0.0, wait))
        blocked = [t.name for t in sources if t.is_alive()]
        if blocked:
            log.warning("sources still blocked reading: left behind", threads=blocked)
        stuck = [t.name for t in self._all_threads() if t.is_alive() and t not in sources]
        if stuck:
            log.error("threads did not stop in time", threads=stuck, timeout_s=JOIN_TIMEOUT_S)
            if self._error is None:
                self._error = ("graph", TimeoutError(f"threads did not stop: {', '.join(stuck)}"))
        self.report_drops(time.monotonic() - drops_told_at)  # those since the last report

    def _all_threads(self) -> list[threading.Thread]:
        with self._sources_lock:
            return [*self._source_threads.values(), *self._threads,
                    *self._sink_threads.values()]

    def _check_stop_when(self) -> None:
        """End the run by itself when ``stop_when`` says so (the join loop, ten times a
        second)."""
        if self.stop_when == "never" or not self._accepting:
            return
        with self._sources_lock:
            reading = {source.name: (source.live, self._source_threads[source.name].is_alive())
                       for source in self.sources}
        if self.stop_when == "all_ended":
            if not any(alive for _, alive in reading.values()):
                self._close_control()
        elif any(not live for live, _ in reading.values()):  # files_ended
            if not any(alive for live, alive in reading.values() if not live):
                if any(alive for live, alive in reading.values() if live):
                    log.info("every file source is done: stopping the live sources "
                             "(runtime.stop_when: files_ended)")
                self.request_stop()
        elif not any(alive for _, alive in reading.values()):  # no file source: as all_ended
            self._close_control()
