"""Decode worker processes: sources decoded outside the pipeline's interpreter, into shared memory.

```
worker process k (owns some sources, one thread each: DecodeStage as in-process)
   decode -> copy the planes once into one of ITS slots of the shared SlotRing
   -> pipe: ("frame", source, slot, index, pts, capture time, size, rate)   (a few numbers)
   -> pipe: ("link", source, reconnects, state, attempt, retry in s, error)  (as it changes:
            each failed attempt, each connection, before any first frame too)
   -> pipe: ("stats", source, reconnects, dropped)  (as they change: with a frame, or
            within POLL_S while none is sent: a starved live source's drops)
pipeline process: one receiver thread -> per-source inbox -> WorkerSource (the graph's source)
   ... batch, infer, ... the last reader of the images: ring.release(slots)
   -> pipe: ("free", slots) back to the worker that owns them
```

Only small fixed-size tuples cross the pipes, never pixels. Each worker owns a fixed share
of the ring's slots (in proportion to its sources) and keeps its own free list of them: a
file source waits for one of its worker's slots (no frame lost), a live source drops the
frame it just decoded when none is free (counted), and a live lane in front of the batcher
drops its oldest frame and hands its slot back, so a live camera's frames stay fresh.

**Isolation.** A worker that dies (a decoder crash, an OOM kill, ``kill -9``) is seen at once
(its process sentinel is in the receiver's wait list); its sources are logged and restarted
in a new worker process with the same slots, after a backoff with jitter. A file source
resumes at the first frame not yet delivered (no frame twice, none lost); a live one (a looped
file too: from the file's start) numbers its frames on. The other workers' sources never wait
for it.

**Shutdown.** A graceful stop sends every worker ``("stop",)``: each ends its sources (an
``EndOfStream`` each) and exits. ``close()`` joins them, killing any that hang. Workers
ignore SIGINT and SIGTERM (a Ctrl-C, or a stop sent to the whole process group as systemd and
``kill -TERM -PGID`` do, reaches the pipeline, which stops them) and exit when the pipeline's
end of their pipe closes, so a killed pipeline leaves no worker behind; the shared block is
unlinked by the pipeline at the end, or by Python's resource tracker when the pipeline was
killed.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import queue
import random
import signal
import string
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from fractions import Fraction
from multiprocessing.connection import Connection, wait
from typing import Any

import numpy as np
import structlog

from pipeline.config import PipelineConfig, SourceConfig
from pipeline.metrics import LinkStatus
from pipeline.records import EndOfStream, Frame
from pipeline.slots import SlotRing
from pipeline.stage import SourceStage

log = structlog.get_logger("workers")

FRAME, END, STATS, LINK = "frame", "end", "stats", "link"
RESTART_INITIAL_S, RESTART_MAX_S = 0.5, 10.0
MAX_FAILED_STARTS = 5  # a worker that dies this often before its first frame is given up
JOIN_TIMEOUT_S = 5.0
POLL_S = 0.2


def default_worker_count(sources: int, cores: int | None = None) -> int:
    """Decode workers when ``runtime.decode_workers`` is null: one per source, at most the
    core count less two (the pipeline's own threads need cores too), at least one
    (``cores``: default the cores this process may use, ``stages.decode.usable_cores``)."""
    from stages.decode import usable_cores

    cores = cores or usable_cores()
    return max(1, min(sources, cores - 2))


# ---------------------------------------------------------------------------------------------
# The worker process


def exit_text(code: int) -> str:
    """A process's exit status in words: ``killed by SIGKILL``, ``exited with status 1``."""
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"


def start_shielded(process: multiprocessing.process.BaseProcess) -> None:
    """Start ``process`` ignoring SIGINT from its first instruction: a terminal's Ctrl-C goes
    to the whole process group, and a child still importing (before its main ignores SIGINT
    itself) printed a ``KeyboardInterrupt`` traceback and died, taken for a crash (the run's
    processes stop on the supervisor's word, not on SIGINT). An ignored signal stays ignored
    in a spawned child, and Python then installs no handler of its own. This process's
    handler is put back at once (a Ctrl-C in those milliseconds is lost). Elsewhere than in
    the main thread, where Python cannot change a handler, SIGINT is blocked instead: a
    weaker shield (a thread of the child's libraries may still take it)."""
    if threading.current_thread() is threading.main_thread():
        handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            process.start()
        finally:
            signal.signal(signal.SIGINT, handler)
        return
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        process.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def name_this_process(role: str) -> None:
    """Name this process ``process_title(role)`` where ``ps``, ``top`` and ``pgrep`` show it
    (elsewhere than Linux nothing happens): a process is otherwise just ``python -c
    ...spawn_main``."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, process_title(role).encode(), 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def process_title(role: str) -> str:
    """``sd.ROLE`` within the 15 bytes Linux keeps of a process's name: ``sd.engine``,
    ``sd.standby``, ``sd.worker3``, ``sd.gpu1.worker2``, ``sd.decode0``; where that is longer,
    the group word before the first dot is cut to its letter, so each worker keeps its number:
    ``sd.u1.worker2`` (a Ray unit's ``unit1.worker2``), ``sd.g10.worker0``."""
    title = f"sd.{role}"
    group, dot, rest = role.partition(".")
    if len(title.encode()) > 15 and dot:
        title = f"sd.{group[0]}{group.lstrip(string.ascii_letters)}.{rest}"
    return title.encode()[:15].decode(errors="ignore")


def worker_main(worker: int, sources: list[tuple[int, SourceConfig, int]], shm_name: str,
                slots: int, slot_bytes: int, free: list[int], conn: Connection,
                log_format: str, log_level: str, threads_per_source: int, nice: int = 0) -> None:
    """A decode worker's process: decode its sources into its slots until they end or it is
    told to stop (or the pipeline's end of the pipe closes).

    Args:
        worker: its number (logs).
        sources: (source id, config, first frame index) of each source it decodes.
        shm_name, slots, slot_bytes: the shared ring.
        free: its slots that are free now.
        conn: its end of the pipe to the pipeline.
        threads_per_source: FFmpeg decoding threads per source (``decoder_threads``).
        nice: added to its scheduling niceness (FFmpeg's threads inherit it): > 0 lets it
            use only the CPU time the processes beside it leave.
    """
    from pipeline.logging import configure_logging
    from stages.decode import DecodeStage

    name_this_process(f"decode{worker}")
    if nice:
        os.nice(nice)
    # Ctrl-C, or a SIGTERM sent to the whole group, reaches the pipeline, which stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(log_format, log_level)
    ring = SlotRing.attach(shm_name, slots, slot_bytes, free)
    stop = threading.Event()  # the whole worker stops
    stops = {source_id: threading.Event() for source_id, _, _ in sources}  # one source stops
    send_lock = threading.Lock()

    def send(message: tuple) -> None:
        with send_lock:
            conn.send(message)

    decoders: dict[int, DecodeStage] = {}  # the running ones
    reported: dict[int, tuple[int, int]] = {}  # source id -> (reconnects, dropped) last sent

    def send_stats(source_id: int, decoder: DecodeStage) -> None:
        """Send ``decoder``'s counts if they changed (read and sent under the lock: the
        pipeline gets them in the order they grew)."""
        with send_lock:
            counts = (decoder.reconnects, decoder.dropped)
            if counts != reported.get(source_id, (0, 0)):
                reported[source_id] = counts
                conn.send((STATS, source_id, *counts))

    def decode(source_id: int, config: SourceConfig, first_index: int) -> None:
        decoder = DecodeStage(config, ring, stop, first_index, threads_per_source)
        # Each failed attempt is told at once, not with the next frame (there may be none).
        decoder.on_link = lambda link: send((LINK, source_id, decoder.reconnects, link.state,
                                             link.attempt, link.retry_in_s(), link.error))
        decoders[source_id] = decoder
        try:
            for item in decoder.frames(stops[source_id]):
                if isinstance(item, EndOfStream):
                    send_stats(source_id, decoder)
                    send((END, source_id, item.frames, item.error))
                    break
                rate = item.rate
                send((FRAME, source_id, item.slot, item.index,
                      np.nan if item.pts is None else item.pts, item.capture_time,
                      item.width, item.height,
                      rate.numerator if rate else 0, rate.denominator if rate else 1))
                send_stats(source_id, decoder)
        except (BrokenPipeError, EOFError, OSError):
            stop.set()  # the pipeline is gone
        finally:
            decoders.pop(source_id, None)
            decoder.close()

    threads: list[threading.Thread] = []

    def start(source: tuple[int, SourceConfig, int]) -> None:
        stops.setdefault(source[0], threading.Event())
        if stop.is_set():
            stops[source[0]].set()
        thread = threading.Thread(target=decode, args=source, name=f"decode:{source[1].name}",
                                  daemon=True)
        threads.append(thread)
        thread.start()

    def stop_all() -> None:
        stop.set()
        for event in list(stops.values()):
            event.set()

    for source in sources:
        start(source)
    try:
        while any(t.is_alive() for t in threads) or conn.poll():
            # A starved live source drops frames and sends none: its counts go from here
            # (every POLL_S at most), not with its next frame, seconds later.
            for source_id, decoder in list(decoders.items()):
                send_stats(source_id, decoder)
            if not conn.poll(POLL_S):
                continue
            message = conn.recv()
            if message[0] == "free":
                ring.release(message[1])
            elif message[0] == "stop":
                stop_all()
            elif message[0] == "add":  # a source added while the pipeline runs
                start(message[1:])
            elif message[0] == "stop_source":  # a source removed while the pipeline runs
                stops.setdefault(message[1], threading.Event()).set()
    except (EOFError, OSError):
        stop_all()  # the pipeline died: stop decoding and exit
    for thread in threads:
        thread.join(JOIN_TIMEOUT_S)
    ring.close_view()


# ---------------------------------------------------------------------------------------------
# The pipeline's side


class WorkerSource(SourceStage):
    """The graph's source for a source decoded in a worker: yields what the receiver thread
    put in its inbox (frames whose images are views of the shared ring), then its end marker.

    Attributes:
        reconnects: the worker's reconnection attempts, plus restarts after a worker died.
        dropped: frames the worker dropped for want of a free slot or skipped to catch up
            with real time (live).
        link: the connection as the worker last reported it (live), or ``reconnecting``
            while its dead worker is restarted.
    """

    def __init__(self, source_id: int, config: SourceConfig, pool: DecodeWorkerPool,
                 expected_frames: int | None) -> None:
        super().__init__(config.name)
        self.source_id = source_id
        self.config = config
        self.live = config.is_live
        self.expected_frames = expected_frames
        self.pool = pool
        self.inbox: queue.SimpleQueue[Frame | EndOfStream] = queue.SimpleQueue()
        self.restarts = 0
        self.worker_reconnects = 0
        self.link = LinkStatus() if self.live else None

    @property
    def reconnects(self) -> int:  # type: ignore[override]
        return self.worker_reconnects + self.restarts

    def frames(self, stop_reading: threading.Event) -> Iterator[Frame | EndOfStream]:
        """The frames the worker decoded, then the end marker; ``stop_reading`` (a graceful
        stop, or this source removed) asks its worker to end it (what the worker already
        sent still comes)."""
        while True:
            if stop_reading.is_set():  # checked before every item: a busy inbox is never empty
                self.pool.stop_source(self.source_id)
            try:
                item = self.inbox.get(timeout=POLL_S)
            except queue.Empty:
                if stop_reading.is_set():
                    self.pool.stop_source(self.source_id)
                    if not self.pool.running:  # never started, or gone: nothing will come
                        yield EndOfStream(self.name, self.pool.next_index[self.source_id])
                        return
                if self.pool.aborted.is_set():
                    return
                continue
            yield item
            if isinstance(item, EndOfStream):
                return


@dataclass
class _Worker:
    """The pipeline's record of one worker process."""

    number: int
    sources: list[int]  # source ids
    slots: list[int]
    process: Any = None
    conn: Connection | None = None
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    in_pipeline: set[int] = field(default_factory=set)  # its slots holding frames we received
    restarts: int = 0
    frames_since_start: int = 0  # frames received from the current process
    failed_starts: int = 0  # processes in a row that died before delivering a frame
    restart_at: float | None = None
    added: set[int] = field(default_factory=set)  # source ids sent to the running process
    spawned_with: set[int] = field(default_factory=set)  # source ids it was started with


class DecodeWorkerPool:
    """Starts, feeds, watches and stops the decode worker processes (module docstring).

    Args:
        config: the pipeline configuration (log settings).
        ring: the shared ``SlotRing`` (``shared=True``); all its free slots are shared out
            evenly among the workers.
        workers: how many worker processes.
        threads_per_source: FFmpeg decoding threads per source (``decoder_threads``).
        sources: (source id, config) of sources to decode from the start (more come with
            ``add_source``, before or after ``start``); source ``i`` of them goes to worker
            ``i % workers``.
        nice: the workers' added niceness (``worker_main``; 0: as this process).
    """

    def __init__(self, config: PipelineConfig, ring: SlotRing, workers: int,
                 threads_per_source: int = 1,
                 sources: list[tuple[int, SourceConfig]] = (),  # type: ignore[assignment]
                 nice: int = 0) -> None:
        from stages.decode import probe_frame_count

        if workers < 1:
            raise ValueError(f"DecodeWorkerPool: expected at least one worker, got {workers}")
        self.threads_per_source, self.nice = threads_per_source, nice
        self.config, self.ring = config, ring
        self.names = {source_id: cfg.name for source_id, cfg in sources}
        self.configs = dict(sources)
        self.stages = {source_id: WorkerSource(source_id, cfg, self, probe_frame_count(cfg))
                       for source_id, cfg in sources}
        self.next_index = {source_id: 0 for source_id, _ in sources}
        self.last_pts: dict[int, float] = {}  # a source's latest frame's pts (a restart's)
        self.ended: set[int] = set()
        self._ending: set[int] = set()  # asked to stop (``stop_source``)
        self.aborted = threading.Event()
        self._stopping = threading.Event()
        self._started = False
        self._lock = threading.Lock()
        self._context = multiprocessing.get_context("spawn")
        owned = [[sid for i, (sid, _) in enumerate(sources) if i % workers == k]
                 for k in range(workers)]
        free = ring.free_slots()
        counts = [free // workers + (k < free % workers) for k in range(workers)]
        shares = ring.give_to_workers(counts, self._free_slots)
        self.workers = [_Worker(k, owned[k], shares[k]) for k in range(workers)]
        self._receiver = threading.Thread(target=self._receive, name="decode-workers",
                                          daemon=True)

    @property
    def running(self) -> bool:
        """True while the receiver thread runs (between ``start`` and the workers' end)."""
        return self._receiver.is_alive()

    @property
    def sources(self) -> list[WorkerSource]:
        """The graph's source stages, in source id order."""
        return [self.stages[source_id] for source_id in sorted(self.stages)]

    def start(self) -> None:
        """Start every worker process (each with the sources added to it so far) and the
        receiver thread."""
        with self._lock:
            self._started = True
        for worker in self.workers:
            self._spawn(worker)
        log.info("decode workers started", workers=len(self.workers),
                 sources=len(self.stages), slots=[len(w.slots) for w in self.workers])
        self._receiver.start()

    def request_stop(self) -> None:
        """Ask every worker to end its sources (graceful; idempotent)."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        for worker in self.workers:
            self._send(worker, ("stop",))

    def close(self) -> None:
        """Stop the workers (graceful, then kill: they ignore SIGTERM) and the receiver thread."""
        self.request_stop()
        self.aborted.set()
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for worker in self.workers:
            if worker.process is not None:
                worker.process.join(max(0.0, deadline - time.monotonic()))
        for worker in self.workers:
            process = worker.process
            if process is not None and process.is_alive():
                log.warning("decode worker did not stop: killing it", worker=worker.number)
                process.kill()
                process.join(1.0)
        if self._receiver.is_alive():
            self._receiver.join(JOIN_TIMEOUT_S)
        for worker in self.workers:
            if worker.conn is not None:
                worker.conn.close()

    def add_source(self, source_id: int, config: SourceConfig, first_index: int = 0
                   ) -> WorkerSource:
        """One more source for the worker with the fewest sources still running; it shares
        that worker's slots. Returns its graph source; decoding starts with ``start_source``
        (any thread), or with the workers when they have not started yet."""
        from stages.decode import probe_frame_count

        stage = WorkerSource(source_id, config, self, probe_frame_count(config))
        with self._lock:
            worker = min(self.workers, key=lambda w: (
                sum(sid not in self.ended for sid in w.sources), w.number))
            self.names = {**self.names, source_id: config.name}
            self.configs = {**self.configs, source_id: config}
            self.stages = {**self.stages, source_id: stage}
            self.next_index[source_id] = first_index
            worker.sources = [*worker.sources, source_id]
        log.info("source decoded by worker", source=config.name, worker=worker.number)
        return stage

    def start_source(self, source_id: int) -> None:
        """Start decoding a source given by ``add_source``: in its worker's process, or in a
        new process when that one had ended."""
        worker = next(w for w in self.workers if source_id in w.sources)
        config, first_index = self.configs[source_id], self.next_index[source_id]
        with self._lock:
            if not self._started:
                return  # the workers start with it (``start``)
        with worker.send_lock:
            if source_id in worker.spawned_with:
                pass  # the workers started just now, with it
            elif worker.restart_at is not None:
                pass  # restarting: the new process gets it
            elif worker.conn is None:  # its process ended (and was seen to): start another
                worker.restart_at = time.monotonic()
            else:  # (if it is exiting just now, _exited starts it again at once)
                worker.added.add(source_id)
                self._send_locked(worker, ("add", source_id, config, first_index))

    def stop_source(self, source_id: int) -> None:
        """Ask the worker of ``source_id`` to end it (a graceful stop, or the source was
        removed; idempotent, any thread)."""
        with self._lock:
            if source_id in self._ending or source_id in self.ended:
                return
            self._ending.add(source_id)
        worker = next(w for w in self.workers if source_id in w.sources)
        self._send(worker, ("stop_source", source_id))

    def kill_worker(self, number: int) -> int:
        """SIGKILL one worker (tests: a crash). Returns its pid."""
        pid = self.workers[number].process.pid
        os.kill(pid, signal.SIGKILL)
        return pid

    # -- internals ---------------------------------------------------------------------------
    def _spawn(self, worker: _Worker) -> None:
        # Under the worker's send lock: a slot released meanwhile is either counted free
        # here or sent to the new process, never lost between the two.
        with worker.send_lock:
            with self._lock:
                free = [slot for slot in worker.slots if slot not in worker.in_pipeline]
                sources = [(sid, self._restart_config(sid), self.next_index[sid])
                           for sid in worker.sources
                           if sid not in self.ended and sid not in self._ending]
                worker.added = set()
                worker.spawned_with = {sid for sid, _, _ in sources}
            ours, theirs = self._context.Pipe()
            runtime = self.config.runtime
            process = self._context.Process(
                target=worker_main, name=f"streamdet-decode-{worker.number}", daemon=True,
                args=(worker.number, sources, self.ring.shm_name, self.ring.slots,
                      self.ring.slot_bytes, free, theirs, runtime.log_format,
                      runtime.log_level, self.threads_per_source, self.nice))
            start_shielded(process)
            theirs.close()
            worker.process, worker.conn, worker.restart_at = process, ours, None

    def _send(self, worker: _Worker, message: tuple) -> None:
        with worker.send_lock:
            self._send_locked(worker, message)

    @staticmethod
    def _send_locked(worker: _Worker, message: tuple) -> None:
        # The receiver thread clears conn and process when the worker exits: read them once.
        conn, process = worker.conn, worker.process
        if conn is None or process is None or not process.is_alive():
            return  # a dead worker's slots are recounted when it is restarted
        try:
            conn.send(message)
        except (BrokenPipeError, OSError):
            pass  # it died (or its pipe was just closed): the receiver restarts it

    def _free_slots(self, number: int, slots: list[int]) -> None:
        """``ring.release`` of slots owned by worker ``number``: send them back to it."""
        worker = self.workers[number]
        with worker.send_lock:
            with self._lock:
                worker.in_pipeline.difference_update(slots)
            self._send_locked(worker, ("free", slots))

    def _receive(self) -> None:
        """The receiver thread: messages of every worker, deaths and restarts."""
        while not self.aborted.is_set():
            live = {w.conn: w for w in self.workers if w.conn is not None and w.restart_at is None}
            sentinels = {w.process.sentinel: w for w in self.workers
                         if w.process is not None and w.conn is not None
                         and w.restart_at is None}
            if not live and not any(w.restart_at for w in self.workers):
                if self._stopping.is_set():
                    return  # every worker ended
                time.sleep(POLL_S)  # a source may still be added (``add_source``)
                continue
            if not live and not sentinels:  # only restarts pending
                time.sleep(POLL_S)
            for ready in wait([*live, *sentinels], timeout=POLL_S) if live or sentinels else ():
                worker = live.get(ready)
                if worker is not None:
                    self._drain(worker)
                elif ready in sentinels:
                    self._drain(sentinels[ready])  # what it sent before it exited
                    self._exited(sentinels[ready])
            now = time.monotonic()
            for worker in self.workers:
                if worker.restart_at is not None and now >= worker.restart_at:
                    with self._lock:
                        wanted = [sid for sid in worker.sources
                                  if sid not in self.ended and sid not in self._ending]
                    self._end_stopped(worker)
                    if self._stopping.is_set() or not wanted:
                        self._end_sources(worker, "stopped while its decode worker restarted")
                        worker.restart_at, worker.conn = None, None
                    else:
                        self._spawn(worker)

    def _restart_config(self, source_id: int) -> SourceConfig:
        """Source ``source_id``'s configuration for its (re)start in a worker process: a live
        source's pts go on after its latest frame's (``SourceConfig.start_pts``; a restarted
        worker's looped camera once wrote pts from 0.0 again). The caller holds the lock."""
        config = self.configs[source_id]
        last = self.last_pts.get(source_id)
        if not config.is_live or last is None:
            return config
        return dataclasses.replace(config, start_pts=last)

    def _drain(self, worker: _Worker) -> None:
        conn = worker.conn
        try:
            while conn is not None and conn.poll():
                self._handle(worker, conn.recv())
        except (EOFError, OSError):
            pass

    def _handle(self, worker: _Worker, message: tuple) -> None:
        kind, source_id = message[0], message[1]
        stage = self.stages[source_id]
        if kind == FRAME:
            _, _, slot, index, pts, capture_time, width, height, num, den = message
            worker.frames_since_start += 1
            if worker.failed_starts:
                worker.failed_starts = 0
            with self._lock:
                worker.in_pipeline.add(slot)
                self.next_index[source_id] = index + 1
                if pts == pts:  # not NaN
                    self.last_pts[source_id] = pts
            if stage.link is not None and stage.link.state != "connected":
                stage.link = LinkStatus("connected", error=stage.link.error)  # after a restart
            stage.inbox.put(Frame(
                source=stage.name, index=index, pts=None if pts != pts else pts,
                capture_time=capture_time, width=width, height=height,
                rate=Fraction(num, den) if num else None,
                image=self.ring.image(slot, width, height), slot=slot))
        elif kind == STATS:
            stage.worker_reconnects, stage.dropped = message[2], message[3]
        elif kind == LINK:
            _, _, reconnects, state, attempt, retry_in_s, error = message
            stage.worker_reconnects = reconnects
            stage.link = LinkStatus(state, attempt, None if retry_in_s is None
                                    else time.monotonic() + retry_in_s, error)
        elif kind == END:
            with self._lock:
                self.ended.add(source_id)
            stage.inbox.put(EndOfStream(stage.name, message[2], message[3]))

    def _exited(self, worker: _Worker) -> None:
        # Its sentinel is ready once its fds are closed, which can be a moment before it can
        # be reaped: join (that moment) so that the exit code is known, not None.
        worker.process.join(1.0)
        code = worker.process.exitcode
        with self._lock:
            pending = [sid for sid in worker.sources if sid not in self.ended]
        with worker.send_lock:  # not while a stage thread sends it freed slots
            if worker.conn is not None:
                worker.conn.close()
            worker.conn = None
        self._end_stopped(worker)  # asked to stop: ended, not restarted
        pending = [sid for sid in pending if sid not in self._ending]
        if not pending:
            worker.restart_at = None
            return
        if code == 0 and set(pending) <= worker.added:
            # It ended its sources and exited as a source was being added: start it again.
            worker.restart_at = time.monotonic()
            return
        if self._stopping.is_set():
            self._end_sources(worker, f"its decode worker exited (code {code}) while stopping")
            return
        if worker.frames_since_start == 0:
            worker.failed_starts += 1
        worker.frames_since_start = 0
        if worker.failed_starts >= MAX_FAILED_STARTS:
            reason = (f"its decode worker died {worker.failed_starts} times in a row before "
                      f"delivering a frame (exit code {code}; from a script, is the pipeline "
                      "started under if __name__ == '__main__'? the workers import it)")
            log.error("decode worker keeps dying: giving up its sources", worker=worker.number,
                      exit_code=code, sources=[self.names[sid] for sid in pending])
            self._end_sources(worker, reason, failed=True)
            return
        nominal = min(RESTART_MAX_S, RESTART_INITIAL_S * 2 ** worker.restarts)
        delay = nominal / 2 + nominal / 2 * random.random()
        worker.restarts += 1
        worker.restart_at = time.monotonic() + delay
        for sid in pending:
            stage = self.stages[sid]
            stage.restarts += 1
            previous = stage.link or LinkStatus()
            stage.link = LinkStatus("reconnecting", max(previous.attempt, 0) + 1,
                                    worker.restart_at,
                                    f"its decode worker died (exit code {code})")
        log.error("decode worker died: restarting its sources", worker=worker.number,
                  exit_code=code, sources=[self.names[sid] for sid in pending],
                  retry_in_s=round(delay, 2), restarts=worker.restarts)

    def _end_stopped(self, worker: _Worker) -> None:
        """End (without error) the sources of ``worker`` that were asked to stop and have
        not ended: its process is gone, nothing more of them will come."""
        with self._lock:
            stopped = [sid for sid in worker.sources
                       if sid in self._ending and sid not in self.ended]
            self.ended.update(stopped)
        for sid in stopped:
            self.stages[sid].inbox.put(EndOfStream(self.names[sid], self.next_index[sid]))

    def _end_sources(self, worker: _Worker, reason: str, failed: bool = False) -> None:
        """End the sources of ``worker`` that have not ended: with ``reason`` as their error
        when ``failed``, or for a file cut short outside a stop."""
        with self._lock:
            pending = [sid for sid in worker.sources if sid not in self.ended]
            self.ended.update(pending)
        for sid in pending:
            stage = self.stages[sid]
            error = reason if failed else (
                None if stage.live or self._stopping.is_set() or sid in self._ending
                else reason)
            stage.inbox.put(EndOfStream(stage.name, self.next_index[sid], error))
