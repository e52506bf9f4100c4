"""Batcher: gather frames from any sources into one ``FrameBatch`` per inference call.

Like DeepStream's stream muxer, it closes a batch when it holds ``batch_size`` frames or when
its first frame has waited ``batch_timeout_ms``, with one exception on the GPU path: while
every batch set is in use (the GPU has batches queued), a partial batch past its timeout
stays open and keeps taking frames until a set is free or the batch is full. Closing it
then would only make it wait for a set with fewer frames than it could hold. So under load
batches fill up, and the model runs fewer, fuller graphs (on an H200, YOLOv8s at batch 64
ran 7,158-7,284 images/s, 37 frames padded to 40 6,330-6,344: ``benchmarks/results-h200.md``,
"Bucketed graphs"); without load nothing changes. From here on the unit is the batch: the frames
become columns (``FrameBatch``), and on the GPU path the batch's whole way onto the device is
queued here, once per batch:

- a free ``BatchBuffers`` set is taken (waiting while all are in use: backpressure);
- each host frame is copied from its pinned ring slot into the set's device row ``i`` with one
  asynchronous H2D (``cudaMemcpyAsync``) on the copy stream;
- the per-frame tables (preprocess pairs grouped by geometry, letterbox parameters, and for
  GPU-decoded frames the addresses and pitches of their NVDEC planes) are written into the
  set's pinned table and copied with one more H2D;
- the GPU-decoded frames are packed from their NVDEC surfaces into their rows by one kernel
  launch for the whole batch (``kernels.pack_cuda``: no driver call per frame);
- one event (``set.copied``) is recorded; the infer stage waits on it once per batch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from kernels.preprocess import Letterbox, letterbox_geometry
from pipeline.gpu import BatchBuffers, GpuContext
from pipeline.records import EndOfStream, Frame, FrameBatch
from pipeline.slots import SlotRing
from pipeline.stage import Stage

SET_WAIT_POLL_S = 0.001  # a timed-out batch waiting for a free set: look again this often
CUDA_STREAM_LEGACY = 1  # cudaStreamLegacy: the stream FFmpeg's NULL stream is, in any thread
MEMCPY_HOST_TO_DEVICE = 1  # cudaMemcpyHostToDevice


def letterbox_row(letterbox: Letterbox) -> tuple[float, ...]:
    """A letterbox as a row of ``FrameBatch.letterbox`` (``LETTERBOX_COLUMNS``)."""
    return (letterbox.scale_x, letterbox.scale_y, letterbox.pad_left, letterbox.pad_top,
            letterbox.src_width, letterbox.src_height)


def pack_nv12(y: np.ndarray, uv: np.ndarray, out: np.ndarray) -> np.ndarray:
    """The packed NV12 frame the batcher writes into a device row for a GPU-decoded frame
    (``kernels.pack_cuda``), in NumPy (the reference).

    Args:
        y: (height, width) uint8 host array, any row pitch.
        uv: (height // 2, width // 2, 2) uint8 host array of interleaved U, V; any row pitch.
        out: (>= height * 3 // 2 * width,) uint8 host array; its head receives the frame.

    Returns:
        (height * 3 // 2, width) uint8 view of ``out``: Y rows, then UV rows, no padding --
        the "nv12" layout of ``kernels.preprocess``.
    """
    height, width = y.shape
    frame = out[: height * 3 // 2 * width].reshape(height * 3 // 2, width)
    frame[:height] = y
    frame[height:] = uv.reshape(height // 2, width)
    return frame


class DetectionSchedule:
    """Which frames of each source go to the detector: every ``detect_every``-th frame (by
    frame index), or at most ``detect_fps`` frames per second of the source's timestamps
    (pts, else capture time), evenly: a frame is detected when its time reaches the next due
    time, which then advances by one period (so 25 frames/s at detect_fps 10 detects 10 of
    every 25 frames, not one in three). A time that jumps back (a stream that reconnected)
    restarts the schedule.

    Args:
        every: per source id, ``detect_every`` (1: every frame).
        fps: per source id, ``detect_fps`` or None.
    """

    def __init__(self, every: list[int], fps: list[float | None]) -> None:
        self.every, self.period = every, [None if f is None else 1.0 / f for f in fps]
        self._due: list[float | None] = [None] * len(every)

    def add(self, every: int, fps: float | None) -> None:
        """Schedule one more source (the next source id; added while the pipeline runs, before
        its first frame)."""
        self._due.append(None)
        self.period.append(None if fps is None else 1.0 / fps)
        self.every.append(every)

    @property
    def skips_frames(self) -> bool:
        """Whether any source skips frames."""
        return any(e > 1 for e in self.every) or any(p is not None for p in self.period)

    def wanted(self, source_id: int, index: int, time_s: float) -> bool:
        """Whether the frame ``index`` of source ``source_id``, at ``time_s``, is detected
        (call once per frame, in the source's order)."""
        period = self.period[source_id]
        if period is None:
            return index % self.every[source_id] == 0
        due = self._due[source_id]
        tolerance = period * 1e-3
        if due is not None and due - 2 * period <= time_s < due - tolerance:
            return False
        if due is None or time_s > due + period or time_s < due - 2 * period:
            due = time_s  # the first frame, a gap or a jump back: start again from here
        self._due[source_id] = due + period
        return True


class BatcherStage(Stage[Frame, FrameBatch]):
    """Frames in, ``FrameBatch`` records out (see the module docstring).

    Args:
        name: stage name.
        input_size: model input (height, width) in pixels.
        batch_size: most frames per batch.
        batch_timeout_ms: longest time a partial batch waits for more frames.
        source_names: every source's name, in config order (``FrameBatch.source_names``).
        gpu: the ``GpuContext`` whose batch sets are allocated (GPU path), or None.
        ring: the ``SlotRing`` holding the host frames (its pinned memory is copied from).
        stop: the graph's abort event (ends a wait for a free batch set).
        schedule: which frames the detector skips (``FrameBatch.detect``); None: none.
            On the GPU path a skipped frame is not copied to the device.
        keep_device_pictures: the GPU-decoded frames' pictures go on with their batch
            (``FrameBatch.device_pictures``, for the event snapshots); else the decoder's
            surfaces are let go with the batch's device set.
    """

    def __init__(self, name: str, input_size: tuple[int, int], batch_size: int,
                 batch_timeout_ms: float, source_names: tuple[str, ...],
                 gpu: GpuContext | None = None, ring: SlotRing | None = None,
                 stop: threading.Event | None = None,
                 schedule: DetectionSchedule | None = None,
                 keep_device_pictures: bool = False) -> None:
        super().__init__(name)
        self.keep_device_pictures = keep_device_pictures
        self._schedule = schedule or DetectionSchedule([1] * len(source_names),
                                                       [None] * len(source_names))
        self.schedule = self._schedule if self._schedule.skips_frames else None
        self.input_height, self.input_width = input_size
        self.batch_size = batch_size
        self.batch_timeout_s = batch_timeout_ms / 1000
        self.source_names = tuple(source_names)
        self.source_ids = {name: index for index, name in enumerate(self.source_names)}
        self.gpu, self.ring, self.stop = gpu, ring, stop
        self._pending: list[Frame] = []
        self._first_arrival = 0.0
        self._letterboxes: dict[tuple[int, int], Letterbox] = {}
        self._legacy_done: Any = None  # a cupy.cuda.Event (GPU path)

    def add_source(self, name: str, detect_every: int = 1, detect_fps: float | None = None,
                   live: bool = False) -> int:
        """Take frames of one more source (added while the pipeline runs, before its first
        frame; any thread). Returns its source id. (``live``: unused here; the interface
        ``stages.remote_infer.RemoteInferStage`` shares.)"""
        self._schedule.add(detect_every, detect_fps)
        if self._schedule.skips_frames:
            self.schedule = self._schedule
        names = (*self.source_names, name)
        self.source_ids = {**self.source_ids, name: len(names) - 1}
        self.source_names = names
        return len(names) - 1

    @property
    def poll_interval_s(self) -> float | None:  # type: ignore[override]
        """Time left before the pending partial batch must run (0.0: now;
        ``SET_WAIT_POLL_S`` past its timeout while no batch set is free), or None when
        empty."""
        if not self._pending:
            return None
        left = self._first_arrival + self.batch_timeout_s - time.monotonic()
        if left > 0.0:
            return left
        return 0.0 if self._set_free() else SET_WAIT_POLL_S

    def _set_free(self) -> bool:
        """Whether a batch set is free (always on the CPU path: there are none)."""
        return self.gpu is None or self.gpu.batches.has_free()

    def letterbox(self, width: int, height: int) -> Letterbox:
        """The (cached) geometry fitting a width x height frame into the model input."""
        key = (width, height)
        if key not in self._letterboxes:
            self._letterboxes[key] = letterbox_geometry(
                width, height, self.input_width, self.input_height)
        return self._letterboxes[key]

    def open(self) -> None:
        if self.gpu is not None:
            import cupy

            from kernels.pack_cuda import compile_pack

            self.gpu.activate()
            self._legacy_done = cupy.cuda.Event(disable_timing=True)
            compile_pack()

    def process(self, item: Frame) -> Iterable[FrameBatch]:
        if not self._pending:
            self._first_arrival = time.monotonic()
        self._pending.append(item)
        if len(self._pending) >= self.batch_size or self.poll_interval_s == 0.0:
            return self._flush()
        return ()

    def end_of_stream(self, eos: EndOfStream) -> Iterable[FrameBatch | EndOfStream]:
        # The source's frames must leave before its end marker.
        return [*self._flush(), eos]

    def on_idle(self) -> Iterable[FrameBatch]:
        return self._flush() if self._set_free() else ()

    def finish(self) -> Iterable[FrameBatch]:
        return self._flush()

    def _flush(self) -> list[FrameBatch]:
        if not self._pending:
            return []
        frames, self._pending = self._pending, []
        return [self.make_batch(frames)]

    def make_batch(self, frames: list[Frame]) -> FrameBatch:
        """The batch of ``frames``; on the GPU path, with its copies onto the device queued."""
        boxes = [self.letterbox(f.width, f.height) for f in frames]
        letterbox = np.array([letterbox_row(b) for b in boxes], np.float32).reshape(-1, 6)
        detect = None
        if self.schedule is not None:
            wanted, ids = self.schedule.wanted, self.source_ids
            detect = np.fromiter((wanted(ids[f.source], f.index,
                                         f.capture_time if f.pts is None else f.pts)
                                  for f in frames), np.bool_, len(frames))
        if self.gpu is None:
            return FrameBatch.from_frames(frames, self.source_ids, self.source_names, letterbox,
                                          detect=detect)
        buffers = self._take_buffers()
        self._queue_copies(frames, boxes, letterbox, buffers, detect)
        return FrameBatch.from_frames(frames, self.source_ids, self.source_names, letterbox,
                                      buffers, detect, self.keep_device_pictures)

    def _take_buffers(self) -> BatchBuffers:
        started = time.perf_counter()
        buffers = self.gpu.batches.acquire(self.stop)
        self.blocked_s += time.perf_counter() - started
        return buffers

    def _queue_copies(self, frames: list[Frame], boxes: list[Letterbox], letterbox: np.ndarray,
                      buffers: BatchBuffers, detect: np.ndarray | None = None) -> None:
        """Queue the copies of the detected frames (all when ``detect`` is None) into device
        rows; the k-th detected frame's model input and results are row k (compact)."""
        import cupy

        from kernels.pack_cuda import launch_pack, nv12_copies

        gpu = self.gpu
        gpu.activate()
        stream = gpu.copy_stream
        token = gpu.timeline.begin("h2d", stream)
        row_bytes = buffers.frames.shape[1]
        base = buffers.frames.data.ptr
        groups: dict[tuple[Letterbox, str], list[int]] = {}
        copies = buffers.table.host["copies"]
        planes = 0
        for i, frame in enumerate(frames):
            if frame.device_planes is not None:
                buffers.surfaces.append(frame.device_planes)  # released with the set
            if detect is not None and not detect[i]:
                continue
            groups.setdefault((boxes[i], frame.pixel_format), []).append(i)
            if frame.device_planes is not None:
                copies[planes:planes + 2] = nv12_copies(*frame.device_planes, i * row_bytes)
                planes += 2
            else:
                nbytes = frame.width * frame.height * 3 // 2
                cupy.cuda.runtime.memcpyAsync(base + i * row_bytes, self.ring.pointer(frame.slot),
                                              nbytes, MEMCPY_HOST_TO_DEVICE, stream.ptr)
        pairs = buffers.table.host["pairs"]
        rows = np.arange(len(frames)) if detect is None else np.flatnonzero(detect)
        output_row = np.empty(len(frames), np.int64)
        output_row[rows] = np.arange(len(rows))  # frame i's row in the model input
        row = 0
        for (box, pixel_format), indices in groups.items():
            pairs[row:row + len(indices), 0] = indices
            pairs[row:row + len(indices), 1] = output_row[indices]
            buffers.groups.append((box, pixel_format, row, row + len(indices)))
            row += len(indices)
        buffers.table.host["letterbox"][: len(rows)] = letterbox[rows]
        buffers.table.to_device(stream)
        if planes:  # after FFmpeg's output copies, queued on the legacy default stream
            self._legacy_done.record(cupy.cuda.ExternalStream(CUDA_STREAM_LEGACY))
            stream.wait_event(self._legacy_done)
            launch_pack(buffers.table.device["copies"], planes, buffers.frames, stream)
        gpu.timeline.end(token, stream)
        buffers.copied.record(stream)
