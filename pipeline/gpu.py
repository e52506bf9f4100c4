"""The GPU context: device, streams, events and every buffer of the hot path, allocated once.

```
host (pinned)          copy stream                 compute stream
staging slot i  --H2D async--> device slot i --event copied[i]--> preprocess kernel
                      ^                                    |
                      +---- waits on event consumed[i] <---+ (recorded after the kernel)
```

- ``FrameStaging``: a ring of pinned host slots and matching device slots, one frame each.
  The upload of frame N+1 into slot j runs on the copy stream while the compute stream works
  on frame N in slot i: that is the double buffering. A slot is rewritten on the host only
  after its previous copy completed, and on the device only after the kernel that read it.
- ``BatchRing``: a few sets of model input/output buffers. The preprocess stage fills the
  input of set k while inference runs on set k-1; the postprocess stage returns set k once
  the detections are back on the host.
- ``GpuTimeline``: optional CUDA-event ranges per stream, to measure overlap.

All device work of a frame is ordered on the compute stream; the stages' threads only
enqueue. CuPy is imported lazily: on a machine without a GPU nothing here is used.
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


class FrameStaging:
    """A ring of pinned host slots and device slots for uploading frames.

    Attributes:
        host: (slots, slot_bytes) uint8 pinned host array.
        device: (slots, slot_bytes) uint8 CuPy device array.
        copied: per slot, event recorded on the copy stream after its H2D copy.
        consumed: per slot, event recorded on the compute stream after the last kernel
            that read it.
    """

    def __init__(self, slots: int, slot_bytes: int) -> None:
        import cupy

        if slots < 1:
            raise ValueError(f"staging needs at least one slot, got {slots}")
        self.slot_bytes = slot_bytes
        memory = cupy.cuda.alloc_pinned_memory(slots * slot_bytes)
        self.host = np.frombuffer(memory, np.uint8, slots * slot_bytes).reshape(slots, slot_bytes)
        self.device = cupy.empty((slots, slot_bytes), np.uint8)
        self.copied = [cupy.cuda.Event() for _ in range(slots)]
        self.consumed = [cupy.cuda.Event() for _ in range(slots)]
        self._free: queue.Queue[int] = queue.Queue()
        for slot in range(slots):
            self._free.put(slot)

    @property
    def slots(self) -> int:
        return self.host.shape[0]

    def acquire(self, stop: threading.Event | None = None) -> int:
        """A free slot; waits while every slot is in flight (backpressure)."""
        return take(self._free, stop, "a staging slot")

    def upload(self, slot: int, image: np.ndarray, copy_stream: Any,
               timeline: GpuTimeline | None = None) -> None:
        """Copy a frame into ``slot``: host memcpy into pinned memory, then an async H2D copy.

        Args:
            image: C-contiguous uint8 host array of at most ``slot_bytes`` bytes (an I420 frame).
            copy_stream: the CuPy stream the H2D copy is queued on.
        """
        size = image.size
        if size > self.slot_bytes:
            raise ValueError(f"frame of {size} bytes exceeds the staging slot of "
                             f"{self.slot_bytes} bytes"
                             " (slots fit the largest file source, at least 1920x1080)")
        self.copied[slot].synchronize()  # the previous copy out of this pinned slot is done
        self.host[slot, :size] = image.reshape(-1)
        copy_stream.wait_event(self.consumed[slot])  # the device slot is no longer read
        token = timeline.begin("h2d", copy_stream) if timeline else None
        self.device[slot, :size].set(self.host[slot, :size], stream=copy_stream)
        if token is not None:
            timeline.end(token, copy_stream)
        self.copied[slot].record(copy_stream)

    def release(self, slots: list[int], compute_stream: Any) -> None:
        """Return slots whose last reader has been queued on ``compute_stream``."""
        for slot in slots:
            self.consumed[slot].record(compute_stream)
            self._free.put(slot)


@dataclass
class BatchBuffers:
    """One set of model input and output buffers (device).

    Attributes:
        index: position in the ring.
        images: (max_batch, 3, H, W) input array of the model's input dtype.
        outputs: (max_batch, 4 + classes, anchors) array of the model's output dtype.
        pairs_host: (max_batch, 2) int32 pinned host array of (staging slot, batch index).
        pairs: (max_batch, 2) int32 device copy of ``pairs_host``.
    """

    index: int
    images: Any
    outputs: Any
    pairs_host: np.ndarray
    pairs: Any


class BatchRing:
    """A few ``BatchBuffers`` handed out in turn; ``acquire`` waits while all are in use."""

    def __init__(self, count: int, input_shape: tuple[int, ...], input_dtype: Any,
                 output_shape: tuple[int, ...], output_dtype: Any) -> None:
        import cupy

        self.sets = []
        for index in range(count):
            memory = cupy.cuda.alloc_pinned_memory(input_shape[0] * 2 * 4)
            pairs_host = np.frombuffer(memory, np.int32, input_shape[0] * 2).reshape(-1, 2)
            self.sets.append(BatchBuffers(
                index, cupy.empty(input_shape, input_dtype), cupy.empty(output_shape, output_dtype),
                pairs_host, cupy.empty((input_shape[0], 2), np.int32)))
        self._free: queue.Queue[BatchBuffers] = queue.Queue()
        for buffers in self.sets:
            self._free.put(buffers)

    def acquire(self, stop: threading.Event | None = None) -> BatchBuffers:
        """A free set; waits while every set is in use (backpressure)."""
        return take(self._free, stop, "batch buffers")

    def release(self, buffers: BatchBuffers) -> None:
        """Return a set once every host read of it is done (after the D2H of detections)."""
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
        self.staging: FrameStaging | None = None
        self.batches: BatchRing | None = None
        properties = cupy.cuda.runtime.getDeviceProperties(device_id)
        self.name = properties["name"].decode()
        log.info("gpu ready", device=device_id, name=self.name,
                 compute_capability=f"{properties['major']}.{properties['minor']}")

    def allocate(self, staging_slots: int, slot_bytes: int, batch_sets: int,
                 input_shape: tuple[int, ...], input_dtype: Any,
                 output_shape: tuple[int, ...], output_dtype: Any) -> None:
        """Allocate every hot-path buffer once, before the first frame."""
        self.device.use()
        self.staging = FrameStaging(staging_slots, slot_bytes)
        self.batches = BatchRing(batch_sets, input_shape, input_dtype, output_shape, output_dtype)
        log.info("gpu buffers allocated", staging_slots=staging_slots,
                 staging_mb=round(staging_slots * slot_bytes / 2**20, 1), batch_sets=batch_sets)

    def activate(self) -> None:
        """Make this context's device current for the calling thread (CuPy is per thread)."""
        self.device.use()
