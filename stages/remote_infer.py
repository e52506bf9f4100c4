"""Remote inference: a source worker's frames go to its GPU's engine and come back detected.

In a source worker (DESIGN.md v3) this stage stands where the batcher, infer and
postprocess stages stand in a whole pipeline: ``Frame`` in, ``BatchDetections`` out, in
the order the frames came, so the stages after it (filter, track, analytics, annotate,
sinks) run as in any pipeline.

```
frames --process--> an entry each, kept in submit order until it leaves
        --flush (at FLUSH_ROWS frames, or when the inbox is empty)--> NVDEC frames' planes
          copied into our device-ring slots (one wait), one SUBMIT message of rows
engine --RESULTS (one message per engine batch)--> receiver thread: results into their
          entries, device slots freed
on_idle / process --> the done prefix of the entries as one BatchDetections (and the
          EndOfStream markers in their place); their host slots freed unless a later stage
          reads the images (the sinks free them then)
```

A frame the detector skips (``detect_every``/``detect_fps``) is not sent: it waits in order
and leaves with no detections of its own. Backpressure: when no device slot is free, the
frames ready so far are sent first (their results free slots), then a file frame waits for
one (its host slot was taken by the decoder, which waits too) and a live frame is dropped
(counted), so a camera's frames stay fresh.

**The engine going away** (it died; the supervisor restarts it): the receiver reconnects
with backoff. Meanwhile live frames are dropped (counted) and file sources wait. Once the
engine is back, the frames it never answered go again: a file's frames all reach the sinks,
each once (an NVDEC frame keeps its decoder surface until its results come, so it can be
copied again); a live source's unanswered frames are dropped (counted), they are stale.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection
from typing import Any

import numpy as np
import structlog

from kernels.preprocess import letterbox_geometry
from pipeline.engine_link import (
    BYE,
    HELLO,
    READY,
    SUBMIT_DTYPE,
    DeviceRing,
    EngineLink,
    EngineResults,
)
from pipeline.records import BatchDetections, EndOfStream, Frame, FrameBatch
from pipeline.slots import SlotRing
from pipeline.stage import Stage
from stages.batcher import DetectionSchedule, letterbox_row

log = structlog.get_logger("remote_infer")

FLUSH_ROWS = 16  # a submit message goes once this many frames wait (else when idle)
RESULT_POLL_S = 0.002  # how often finished frames are looked for while some are out
RECONNECT_INITIAL_S, RECONNECT_MAX_S = 0.2, 2.0
CUDA_STREAM_LEGACY = 1  # FFmpeg queues its output copies on the legacy default stream
# Why a live frame was dropped here (``on_drop``'s reason; ``Graph.report_drops`` logs them):
NO_ENGINE_SLOT = "no_engine_slot"  # its worker's share of the engine's device ring is in use
ENGINE_AWAY = "engine_away"  # the engine is restarting
ENGINE_LOST = "engine_lost"  # sent, unanswered, when the engine died
RECEIVER_JOIN_S = 2.0  # close(): how long the receiver may take to read its connection's end


@dataclass
class _Entry:
    """A frame (or an end marker) in submit order, until it leaves the stage."""

    item: Frame | EndOfStream
    live: bool = False
    detect: bool = True
    done: bool = False
    device_slot: int = -1
    detections: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None


@dataclass
class _Link:
    """One connection to the engine (a new one after the engine restarted)."""

    conn: Connection
    device_ring: DeviceRing | None
    epoch: int
    free_device: deque[int] = field(default_factory=deque)


def wake_readers(conn: Any) -> None:
    """Shut down the socket under ``conn`` (a ``multiprocessing`` connection): a thread
    blocked in its ``recv()`` reads an end (``EOFError``) instead of waiting on; closing the
    connection alone neither wakes it nor is safe under it."""
    try:
        with socket.socket(fileno=os.dup(conn.fileno())) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except (OSError, ValueError, AttributeError):
        pass  # closed already, or not a socket (a test's fake)


class RemoteInferStage(Stage[Frame, BatchDetections]):
    """``Frame`` in, ``BatchDetections`` out, through the engine (module docstring).

    Args:
        name: stage name.
        link: the engine's address, rings and this worker's shares.
        worker: this worker's number (its slot shares).
        ring: this worker's view of the shared host ring (``SlotRing.attach``).
        input_size: the model's input (height, width) (the letterbox rows of the batches).
        keep_images: a later stage reads the frames' images (video, previews): the sinks
            free the host slots; else they are freed once the results are in.
        stop: the graph's abort event (ends every wait).
        on_drop: called with each live frame dropped here and why (``NO_ENGINE_SLOT``,
            ``ENGINE_AWAY``, ``ENGINE_LOST``; the graph counts it, frees its host slot).
        keep_device_pictures: the GPU-decoded frames' pictures go on with their batch
            (``FrameBatch.device_pictures``, for the event snapshots); else the decoder's
            surface is let go once the results are in.
    """

    def __init__(self, name: str, link: EngineLink, worker: int, ring: SlotRing,
                 input_size: tuple[int, int], keep_images: bool, stop: threading.Event,
                 on_drop: Callable[[Frame, str], None], keep_device_pictures: bool = False) -> None:
        super().__init__(name)
        self.link, self.worker, self.ring = link, worker, ring
        self.input_height, self.input_width = input_size
        self.keep_images, self.stop, self.on_drop = keep_images, stop, on_drop
        self._closed = False  # ``close`` was called: the graph is done with it
        self.keep_device_pictures = keep_device_pictures
        self.schedule = DetectionSchedule([], [])
        self.source_names: tuple[str, ...] = ()
        self.source_ids: dict[str, int] = {}
        self.sources_live: list[bool] = []
        self._tokens = itertools.count()
        self._entries: dict[int, _Entry] = {}  # every entry not yet taken, by token
        self._order: deque[int] = deque()  # their tokens in submit order (markers too)
        self._unsent: list[int] = []  # tokens of frames to send, in order
        self._cond = threading.Condition()  # guards the above and _link
        self._send_lock = threading.Lock()  # one sender at a time (stage thread, receiver)
        self._link: _Link | None = None
        self._epochs = itertools.count()
        self._receiver: threading.Thread | None = None
        self._copied: Any = None  # a cupy.cuda.Event, once a device ring is in use
        self.engine_losses = 0

    # -- sources ---------------------------------------------------------------------------
    def add_source(self, name: str, detect_every: int = 1, detect_fps: float | None = None,
                   live: bool = False) -> int:
        """Take frames of one more source (any thread, before its first frame). Returns its
        source id (its position in ``source_names``)."""
        with self._cond:
            self.schedule.add(detect_every, detect_fps)
            self.sources_live.append(live)
            self.source_names = (*self.source_names, name)
            self.source_ids = {**self.source_ids, name: len(self.source_names) - 1}
            return len(self.source_names) - 1

    # -- stage hooks -------------------------------------------------------------------------
    @property
    def poll_interval_s(self) -> float | None:  # type: ignore[override]
        if self._unsent and self._link is not None:
            return 0.0  # send them as soon as the inbox is empty
        return RESULT_POLL_S if self._order else None

    def open(self) -> None:
        self._link = self._connect()
        if self._link is None:
            return  # stopped before the engine answered
        self._receiver = threading.Thread(target=self._receive, name=f"{self.name}:results",
                                          daemon=True)
        self._receiver.start()

    def process(self, item: Frame) -> Iterable[BatchDetections | EndOfStream]:
        source = self.source_ids[item.source]
        detect = self.schedule.wanted(source, item.index,
                                      item.capture_time if item.pts is None else item.pts)
        live = self.sources_live[source]
        if detect and live and self._link is None:  # the engine is away: stay fresh
            self.on_drop(item, ENGINE_AWAY)
            return self._take_done()
        token = next(self._tokens)
        with self._cond:
            self._entries[token] = _Entry(item, live=live, detect=detect, done=not detect)
            self._order.append(token)
            if detect:
                self._unsent.append(token)
        if len(self._unsent) >= FLUSH_ROWS:
            self._flush()
        return self._take_done()

    def end_of_stream(self, eos: EndOfStream) -> Iterable[BatchDetections | EndOfStream]:
        token = next(self._tokens)
        with self._cond:
            self._entries[token] = _Entry(eos, done=True)
            self._order.append(token)
        self._flush()
        return self._take_done()

    def on_idle(self) -> Iterable[BatchDetections | EndOfStream]:
        self._flush()
        return self._take_done()

    def finish(self) -> Iterable[BatchDetections | EndOfStream]:
        """Every source ended: wait for the frames still out (or the graph's abort)."""
        self._flush()
        with self._cond:
            while not self.stop.is_set() and any(not self._entries[t].done for t in self._order):
                self._cond.wait(0.1)
        return self._take_done()

    def close(self) -> None:
        with self._cond:
            self._closed = True  # the receiver does not reconnect: its connection ends here
            link, self._link = self._link, None
            self._cond.notify_all()
        if link is not None:
            with self._send_lock:
                try:
                    link.conn.send_bytes(BYE)  # not a death: the engine tells no one
                except OSError:
                    pass  # the engine is gone
                # The receiver, maybe inside recv(), must end before the connection closes:
                # closed under it, it raised (an abort on a new user's run printed its
                # traceback). Shut down, the socket gives it an end to read.
                wake_readers(link.conn)
                if self._receiver is not None and self._receiver is not threading.current_thread():
                    self._receiver.join(RECEIVER_JOIN_S)
                link.conn.close()
            if link.device_ring is not None:
                link.device_ring.close()

    # -- internals -------------------------------------------------------------------------
    def _connect(self) -> _Link | None:
        """Connect to the engine and wait until it is ready (its model loaded and warm);
        retries with backoff while it is not there. None once ``stop`` is set."""
        delay = RECONNECT_INITIAL_S
        while not self.stop.is_set():
            try:
                conn = Client(self.link.address, authkey=self.link.authkey)
                conn.send((HELLO, self.worker, os.getpid()))
                while not conn.poll(0.2):
                    if self.stop.is_set():
                        conn.close()
                        return None
                kind, handle = conn.recv()
            except (OSError, EOFError) as error:
                log.debug("engine not reachable yet", worker=self.worker, error=str(error))
                self.stop.wait(delay)
                delay = min(RECONNECT_MAX_S, delay * 2)
                continue
            if kind != READY:
                raise RuntimeError(f"the engine answered {kind!r} to hello")
            ring = None
            if handle is not None:
                import cupy

                cupy.cuda.Device(self.link.device).use()
                ring = DeviceRing.open(handle, self.link.device_share * self.link.workers,
                                       self.link.slot_bytes)
                if self._copied is None:
                    self._copied = cupy.cuda.Event(disable_timing=True)
            link = _Link(conn, ring, next(self._epochs),
                         deque(self.link.device_slots(self.worker)))
            log.info("engine connected", worker=self.worker, epoch=link.epoch,
                     device_ring=ring is not None)
            return link
        return None

    def _flush(self) -> None:
        """Send the frames waiting to go, in order: NVDEC frames get a device slot each and
        are copied in (one wait per message). When no device slot is free, what is ready
        goes first (its results free slots), then a file frame waits for one and a live
        frame is dropped. While the engine is away the frames wait."""
        with self._send_lock:
            with self._cond:
                link = self._link
                if link is None or not self._unsent:
                    return
                tokens, self._unsent = self._unsent, []
            rows: list[tuple[int, int, int, int, int]] = []
            copies: list[_Entry] = []
            dropped: list[int] = []
            for k, token in enumerate(tokens):
                entry = self._entries[token]
                frame = entry.item
                if frame.device_planes is not None:
                    slot = self._device_slot(link, wait=False)
                    if slot == -1 and rows:  # none free: what is ready goes first
                        if not self._send(link, rows, copies):
                            slot = None  # the engine went away
                        rows, copies = [], []
                    if slot == -1:
                        slot = self._device_slot(link, wait=not entry.live)
                    if slot is None:  # these wait for the next engine
                        with self._cond:
                            self._unsent[:0] = tokens[k:]
                        rows = []
                        break
                    if slot < 0:
                        dropped.append(token)
                        continue
                    entry.device_slot = slot
                    copies.append(entry)
                rows.append((token, frame.slot if frame.device_planes is None else -1,
                             entry.device_slot, frame.width, frame.height))
            if dropped:
                self._drop(dropped, NO_ENGINE_SLOT)
            if rows:
                self._send(link, rows, copies)

    def _send(self, link: _Link, rows: list[tuple[int, int, int, int, int]],
              copies: list[_Entry]) -> bool:
        """Copy ``copies`` in and send ``rows`` as one message; False: the engine is gone
        (the receiver sends them again once it is back)."""
        try:
            self._copy_in(link, copies)
            link.conn.send_bytes(np.array(rows, SUBMIT_DTYPE).tobytes())
            return True
        except (OSError, ValueError):
            return False

    def _device_slot(self, link: _Link, wait: bool) -> int | None:
        """A free device slot of ``link``; with ``wait`` it waits for one, else it gives -1
        at once when none is free (also on ``stop``). None: ``link`` was lost meanwhile."""
        with self._cond:
            started = time.perf_counter()
            while not link.free_device:
                if self._link is not link:
                    return None
                if not wait or self.stop.is_set():
                    return -1
                self._cond.wait(0.1)
            self.blocked_s += time.perf_counter() - started
            return link.free_device.popleft()

    def _drop(self, tokens: list[int], reason: str) -> None:
        """Drop these live frames (counted by ``on_drop``, with ``reason``)."""
        with self._cond:
            entries = [self._entries.pop(token) for token in tokens]
            gone = set(tokens)
            self._order = deque(t for t in self._order if t not in gone)
        for entry in entries:
            entry.item.device_planes = None
            self.on_drop(entry.item, reason)

    def _copy_in(self, link: _Link, entries: list[_Entry]) -> None:
        if not entries:
            return
        import cupy

        started = time.perf_counter()
        ring = link.device_ring
        for entry in entries:
            ring.copy_nv12_in(entry.device_slot, *entry.item.device_planes, CUDA_STREAM_LEGACY)
        self._copied.record(cupy.cuda.ExternalStream(CUDA_STREAM_LEGACY))
        self._copied.synchronize()
        self.blocked_s += time.perf_counter() - started

    def _receive(self) -> None:
        """The receiver thread: results into their entries; reconnect when the engine goes."""
        while not self.stop.is_set():
            with self._cond:
                link = self._link
            if link is None:
                return
            try:
                results = EngineResults(*link.conn.recv())
            except (EOFError, OSError):
                if self.stop.is_set() or self._closed or not self._reconnect(link):
                    return
                continue
            self._take_results(link, results)

    def _take_results(self, link: _Link, results: EngineResults) -> None:
        with self._cond:
            offsets = results.offsets
            for i, token in enumerate(results.tokens.tolist()):
                entry = self._entries.get(token)
                if entry is None or entry.done:
                    continue
                start, end = int(offsets[i]), int(offsets[i + 1])
                entry.detections = (results.xyxy[start:end], results.confidence[start:end],
                                    results.class_id[start:end])
                entry.done = True
                if entry.device_slot >= 0:
                    link.free_device.append(entry.device_slot)
                    if not self.keep_device_pictures:
                        entry.item.device_planes = None  # the decoder may reuse its surface
                    entry.device_slot = -1
            self._cond.notify_all()

    def _reconnect(self, lost: _Link) -> bool:
        """The engine went away: drop the live frames it held, reconnect, and queue every
        unanswered file frame to go again (before anything newer). False once ``stop`` is
        set. The stage thread sends them (``poll_interval_s`` is 0 while frames wait): this,
        the receiver thread, must never wait for a device slot, as only it frees them (on
        the H200 a restarted worker's files outnumbered its slots, and hung for good)."""
        self.engine_losses += 1
        log.warning("engine lost: reconnecting", worker=self.worker)
        with self._cond:
            self._link = None
            self._cond.notify_all()  # a file frame waiting for a device slot of it
        # Under the send lock: no flush is copying into the lost ring or reading the frames
        # dropped here (on the H200 one did, and the worker failed: a copy into a closed
        # mapping, and a dropped frame's planes gone under it).
        with self._send_lock:
            lost.conn.close()
            if lost.device_ring is not None:
                lost.device_ring.close()
            with self._cond:
                stale = [t for t in self._order
                         if not self._entries[t].done and self._entries[t].live]
            self._drop(stale, ENGINE_LOST)
            with self._cond:
                self._unsent = [t for t in self._order if not self._entries[t].done]
        new = self._connect()
        if new is None:
            return False
        with self._send_lock:
            with self._cond:
                for token in self._order:
                    self._entries[token].device_slot = -1
                self._unsent = [t for t in self._order if not self._entries[t].done]
                self._link = new
                self._cond.notify_all()
        return True

    def _take_done(self) -> list[BatchDetections | EndOfStream]:
        """The done prefix of the frames in submit order: one ``BatchDetections`` per run
        of frames, each end marker in its place."""
        with self._cond:
            taken = []
            while self._order and self._entries[self._order[0]].done:
                taken.append(self._entries.pop(self._order.popleft()))
        outputs: list[BatchDetections | EndOfStream] = []
        run: list[_Entry] = []
        for entry in taken:
            if isinstance(entry.item, EndOfStream):
                if run:
                    outputs.append(self._batch(run))
                    run = []
                outputs.append(entry.item)
            else:
                run.append(entry)
        if run:
            outputs.append(self._batch(run))
        if not self.keep_images:  # the engine has read them: nothing after us reads them
            self.ring.release([e.item.slot for e in taken if isinstance(e.item, Frame)])
        return outputs

    def _batch(self, entries: list[_Entry]) -> BatchDetections:
        frames = [e.item for e in entries]
        letterbox = np.array([letterbox_row(letterbox_geometry(
            f.width, f.height, self.input_width, self.input_height)) for f in frames],
            np.float32).reshape(-1, 6)
        detect = np.fromiter((e.detect for e in entries), np.bool_, len(entries))
        batch = FrameBatch.from_frames(frames, self.source_ids, self.source_names, letterbox,
                                       detect=detect, device_pictures=self.keep_device_pictures)
        empty = (np.empty((0, 4), np.float32), np.empty(0, np.float32), np.empty(0, np.int32))
        return BatchDetections.from_lists(batch, [e.detections or empty for e in entries])
