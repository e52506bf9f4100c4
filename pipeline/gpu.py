"""The GPU context: device, streams, events and the per-batch buffer sets, allocated once.

```
slot ring (pinned host)     copy stream                         compute stream
frame slots of a batch --n async H2D + 1 table H2D--> set.frames --event set.copied-->
   wait copied -> preprocess kernels (into the model's input binding) -> model -> NMS
   (reads the output binding in place, undoes the letterbox) -> 1 D2H of the detections
   --event set.done--> postprocess stage (host) reads the pinned detections, frees the set
```

- ``BatchRing``: a few ``BatchBuffers`` sets, each with device rows for a batch's frames, its
  small tables and its detections (device + pinned mirror). The batcher copies batch N+1 into
  set k+1 on the copy stream while the compute stream works on batch N in set k: that is the
  double buffering, with one event per batch each way.
- ``GpuTimeline``: optional CUDA-event ranges per stream, to measure overlap.

All device work of a batch is ordered on the compute stream by one thread (the infer stage);
the batcher's thread only queues copies. CuPy is imported lazily: on a machine without a GPU
nothing here is used.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog

log = structlog.get_logger("gpu")

ACQUIRE_POLL_S = 0.1


def gpu_unavailable_reason() -> str | None:
    """Why the GPU path cannot run here, or None when CuPy, Numba and a CUDA device work."""
    try:
        import cupy
        from numba import cuda
    except ImportError as error:
        return f"{error.name or 'a GPU package'} is not installed"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as error:  # noqa: BLE001 - CUDA raises several types for "no driver"
        return f"CUDA is not usable: {' '.join(str(error).split())}"
    if not cuda.is_available():
        return "Numba cannot use the CUDA device"
    return None


def take(free: queue.Queue, stop: threading.Event | None, what: str) -> Any:
    """The next item of ``free``, waiting for one; raises InterruptedError once ``stop`` is set."""
    while True:
        try:
            return free.get(timeout=ACQUIRE_POLL_S)
        except queue.Empty:
            if stop is not None and stop.is_set():
                raise InterruptedError(f"stopped while waiting for {what}") from None


class PinnedMirror:
    """One device allocation and one pinned host allocation of the same size, both carved into
    the same typed views, so a single copy moves every view at once.

    Args:
        fields: (name, shape, dtype) of each view, laid out in order, each 16-byte aligned.

    Attributes:
        host: name -> NumPy view of the pinned host buffer.
        device: name -> CuPy view of the device buffer.
        nbytes: bytes of each buffer.
    """

    def __init__(self, fields: list[tuple[str, tuple[int, ...], Any]]) -> None:
        import cupy

        offsets, offset = [], 0
        for _, shape, dtype in fields:
            offsets.append(offset)
            offset += -(-int(np.prod(shape)) * np.dtype(dtype).itemsize // 16) * 16
        self.nbytes = max(offset, 16)
        self._pinned = cupy.cuda.alloc_pinned_memory(self.nbytes)
        host_bytes = np.frombuffer(self._pinned, np.uint8, self.nbytes)
        self._device_bytes = cupy.empty(self.nbytes, np.uint8)
        self.host: dict[str, np.ndarray] = {}
        self.device: dict[str, Any] = {}
        for (name, shape, dtype), start in zip(fields, offsets):
            size = int(np.prod(shape)) * np.dtype(dtype).itemsize
            self.host[name] = host_bytes[start:start + size].view(dtype).reshape(shape)
            self.device[name] = self._device_bytes[start:start + size].view(dtype).reshape(shape)

    def to_device(self, stream: Any) -> None:
        """Queue one H2D copy of the whole host buffer on ``stream``."""
        import cupy

        cupy.cuda.runtime.memcpyAsync(self._device_bytes.data.ptr, self._pinned.ptr, self.nbytes,
                                      cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)

    def to_host(self, stream: Any) -> None:
        """Queue one D2H copy of the whole device buffer on ``stream``."""
        import cupy

        cupy.cuda.runtime.memcpyAsync(self._pinned.ptr, self._device_bytes.data.ptr, self.nbytes,
                                      cupy.cuda.runtime.memcpyDeviceToHost, stream.ptr)


@dataclass
class BatchBuffers:
    """Everything one batch needs on its way through the device, allocated once.

    A set is taken by the batcher, filled (frames and table copied in on the copy stream, then
    ``copied`` recorded), processed by the infer stage on the compute stream (which waits on
    ``copied``, writes the detections and records ``done``) and given back by the postprocess
    stage once ``done`` completed and the detections were read. So nothing in a set is
    rewritten while a stream may still read it, and no per-frame event is needed.

    Attributes:
        index: position in the ring.
        frames: (max_batch, slot_bytes) uint8 device array: row i holds batch frame i,
            packed I420 or NV12 (``kernels.preprocess``), written on the copy stream.
        table: ``PinnedMirror`` of the batch's small per-frame tables, copied in with one H2D:
            ``pairs`` (max_batch, 2) int32 (frame row, batch index) grouped by geometry, as the
            preprocess kernel reads them; ``letterbox`` (max_batch, 6) float32 (columns of
            ``pipeline.records.LETTERBOX_COLUMNS``), which the NMS uses to undo the letterbox;
            ``copies`` (2 * max_batch, 5) int64, the NVDEC planes of GPU-decoded frames to
            pack into their rows (``kernels.pack_cuda.COPY_COLUMNS``).
        detections: ``PinnedMirror`` of the batch's results, copied out with one D2H:
            ``boxes`` (max_batch, max_detections, 4) float32 in frame pixels, ``scores``
            (max_batch, max_detections) float32, ``class_ids`` (max_batch, max_detections)
            int32, ``counts`` (max_batch,) int32; image b's first ``counts[b]`` rows count.
        copied: event recorded on the copy stream after the batch's copies in.
        done: event recorded on the compute stream after the D2H of the detections.
        groups: set by the batcher: per frame geometry, (letterbox, pixel_format, start, end)
            rows of ``table.host["pairs"]``, one preprocess launch each.
        surfaces: GPU-decoded frames' planes, kept alive until ``done`` (their packing ran).
    """

    index: int
    frames: Any
    table: PinnedMirror
    detections: PinnedMirror
    copied: Any
    done: Any
    groups: list[tuple[Any, str, int, int]] = field(default_factory=list)
    surfaces: list[Any] = field(default_factory=list)


class BatchRing:
    """A few ``BatchBuffers`` handed out in turn; ``acquire`` waits while all are in use.

    Args:
        count: sets (one being filled, one on the GPU, one being read back is 3).
        max_batch: frames per set.
        slot_bytes: bytes of a frame row (the slot ring's slot size).
        max_detections: detection rows per frame.
    """

    def __init__(self, count: int, max_batch: int, slot_bytes: int, max_detections: int) -> None:
        import cupy

        self.sets = []
        for index in range(count):
            table = PinnedMirror([("pairs", (max_batch, 2), np.int32),
                                  ("letterbox", (max_batch, 6), np.float32),
                                  ("copies", (2 * max_batch, 5), np.int64)])
            detections = PinnedMirror([
                ("counts", (max_batch,), np.int32),
                ("boxes", (max_batch, max_detections, 4), np.float32),
                ("scores", (max_batch, max_detections), np.float32),
                ("class_ids", (max_batch, max_detections), np.int32)])
            self.sets.append(BatchBuffers(
                index, cupy.empty((max_batch, slot_bytes), np.uint8), table, detections,
                cupy.cuda.Event(disable_timing=True), cupy.cuda.Event(disable_timing=True)))
        self._free: queue.Queue[BatchBuffers] = queue.Queue()
        for buffers in self.sets:
            self._free.put(buffers)

    def acquire(self, stop: threading.Event | None = None) -> BatchBuffers:
        """A free set; waits while every set is in use (backpressure)."""
        return take(self._free, stop, "batch buffers")

    def has_free(self) -> bool:
        """Whether ``acquire`` would return at once (a set is free now)."""
        return not self._free.empty()

    def release(self, buffers: BatchBuffers) -> None:
        """Return a set once its ``done`` event completed and its results were read."""
        buffers.groups, buffers.surfaces = [], []
        self._free.put(buffers)


@dataclass
class GpuTimeline:
    """Start/end CUDA events of ranges of work, per kind ('h2d', 'compute'), for profiling.

    Disabled (the default), ``begin`` returns None and nothing is recorded.
    """

    enabled: bool = False
    ranges: list[tuple[str, Any, Any]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _origin: Any = None

    def begin(self, kind: str, stream: Any) -> tuple[str, Any] | None:
        if not self.enabled:
            return None
        import cupy

        start = cupy.cuda.Event()
        start.record(stream)
        with self._lock:
            if self._origin is None:
                self._origin = start
        return kind, start

    def end(self, token: tuple[str, Any] | None, stream: Any) -> None:
        if token is None:
            return
        import cupy

        stop = cupy.cuda.Event()
        stop.record(stream)
        with self._lock:
            self.ranges.append((token[0], token[1], stop))

    def intervals(self) -> dict[str, list[tuple[float, float]]]:
        """Milliseconds since the first range, per kind (synchronises on every event)."""
        import cupy

        out: dict[str, list[tuple[float, float]]] = {}
        for kind, start, stop in self.ranges:
            stop.synchronize()
            out.setdefault(kind, []).append((cupy.cuda.get_elapsed_time(self._origin, start),
                                             cupy.cuda.get_elapsed_time(self._origin, stop)))
        return out


def hidden_fraction(copies: list[tuple[float, float]], compute: list[tuple[float, float]]) -> float:
    """Share of the total copy time during which the compute stream was also busy.

    Args:
        copies, compute: (start, end) intervals in milliseconds.
    """
    merged: list[list[float]] = []
    for start, end in sorted(compute):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    total = sum(end - start for start, end in copies)
    hidden = 0.0
    for c_start, c_end in copies:
        for m_start, m_end in merged:
            hidden += max(0.0, min(c_end, m_end) - max(c_start, m_start))
    return hidden / total if total > 0 else 0.0


class GpuContext:
    """Owns the device, a copy stream, a compute stream and the hot-path buffers.

    Args:
        device_id: CUDA device ordinal.
        profile: record a ``GpuTimeline`` of copies and compute.
    """

    def __init__(self, device_id: int = 0, profile: bool = False) -> None:
        import cupy

        self.device_id = device_id
        self.device = cupy.cuda.Device(device_id)
        self.device.use()
        self.copy_stream = cupy.cuda.Stream(non_blocking=True)
        self.compute_stream = cupy.cuda.Stream(non_blocking=True)
        self.timeline = GpuTimeline(enabled=profile)
        self.batches: BatchRing | None = None
        properties = cupy.cuda.runtime.getDeviceProperties(device_id)
        self.name = properties["name"].decode()
        log.info("gpu ready", device=device_id, name=self.name,
                 compute_capability=f"{properties['major']}.{properties['minor']}")

    def allocate(self, batch_sets: int, max_batch: int, slot_bytes: int,
                 max_detections: int) -> None:
        """Allocate the batch sets once, before the first frame."""
        self.device.use()
        self.batches = BatchRing(batch_sets, max_batch, slot_bytes, max_detections)
        log.info("gpu buffers allocated", batch_sets=batch_sets,
                 frame_rows_mb=round(batch_sets * max_batch * slot_bytes / 2**20, 1))

    def activate(self) -> None:
        """Make this context's device current for the calling thread (CuPy is per thread)."""
        self.device.use()
