"""Upload for a mix of host and GPU-decoded frames: H2D for the former, one D2D pack for the latter.

A GPU-decoded frame (``stages.gpu_decode``) is already on the device, but in the decoder's
surface: Y and interleaved UV planes with a row pitch wider than the picture, in two places.
The fused preprocess kernel reads packed frames from the staging ring, so the frame is
packed into a staging slot by two pitched device-to-device copies (``cudaMemcpy2DAsync``,
Y then UV) on the copy stream: 3.1 MB for 1080p, about 1.5 us of HBM time at ~4 TB/s,
and no PCIe. That is one device copy, honestly, not zero copy; what it buys is that
everything after it (slots, events, the kernel's packed NV12 layout, batching across
sources of both kinds) is the same as for uploaded frames. Feeding the strided surfaces
straight to the kernel would need per-frame pointers and pitches in its tables (one launch
per frame, or an array of pointers), and would keep every decoder surface alive until its
batch ran; the copy is cheaper than either.

Live sources drop frames in the queue before this stage, which is why the packing happens
here and not in the source thread: a dropped frame holds no staging slot.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from typing import Any

import numpy as np

from pipeline.gpu import FrameStaging, GpuContext, GpuTimeline
from pipeline.records import Frame
from stages.upload import UploadStage

CUDA_STREAM_LEGACY = 1  # cudaStreamLegacy: the stream FFmpeg's NULL stream is, in any thread
MEMCPY_DEVICE_TO_DEVICE = 3  # cudaMemcpyDeviceToDevice


def pack_nv12(y: np.ndarray, uv: np.ndarray, out: np.ndarray) -> np.ndarray:
    """The packed NV12 frame ``stage_device_frame`` writes, in NumPy (the reference).

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


def stage_device_frame(staging: FrameStaging, slot: int, frame: Frame, copy_stream: Any,
                       decoded: Any = None, timeline: GpuTimeline | None = None) -> None:
    """Pack a GPU-decoded frame's planes into ``slot`` with two pitched D2D copies.

    Queued on ``copy_stream`` after the last kernel that read the slot (its ``consumed``
    event) and after everything FFmpeg queued so far on the legacy default stream (the
    decoder's output copies); records the slot's ``copied`` event. Returns at once: the
    caller keeps ``frame.device_planes`` alive until ``staging.copied[slot]`` completes.

    Args:
        staging: the ring; ``staging.device[slot]`` receives ``height * 3 // 2 * width``
            bytes in the layout of :func:`pack_nv12`.
        slot: a slot acquired from ``staging``.
        frame: with ``device_planes`` (Y (H, W), UV (H/2, W/2, 2) uint8 CuPy arrays, valid on
            the legacy default stream) and ``pixel_format == "nv12"``.
        copy_stream: the CuPy stream the copies are queued on.
        decoded: a CuPy event to reuse for the legacy-stream ordering (one per caller is
            enough: a wait takes the event's state when it is queued); None makes one.
        timeline: records a "d2d" range when profiling.
    """
    import cupy

    y, uv = frame.device_planes
    width, height = frame.width, frame.height
    if height * 3 // 2 * width > staging.slot_bytes:
        raise ValueError(f"frame of {height * 3 // 2 * width} bytes exceeds the staging slot of "
                         f"{staging.slot_bytes} bytes"
                         " (slots fit the largest file source, at least 1920x1080)")
    decoded = decoded or cupy.cuda.Event(disable_timing=True)
    decoded.record(cupy.cuda.ExternalStream(CUDA_STREAM_LEGACY))
    copy_stream.wait_event(decoded)
    copy_stream.wait_event(staging.consumed[slot])  # the kernel that last read the slot is done
    token = timeline.begin("d2d", copy_stream) if timeline else None
    base = staging.device.data.ptr + slot * staging.slot_bytes
    for offset, plane, rows in ((0, y, height), (width * height, uv, height // 2)):
        cupy.cuda.runtime.memcpy2DAsync(base + offset, width, plane.data.ptr, plane.strides[0],
                                        width, rows, MEMCPY_DEVICE_TO_DEVICE, copy_stream.ptr)
    if token is not None:
        timeline.end(token, copy_stream)
    staging.copied[slot].record(copy_stream)


class DeviceUploadStage(UploadStage):
    """``UploadStage`` for sources of both kinds: H2D for host frames, a D2D pack for frames
    that carry ``device_planes`` (which it then drops from the record, so the decoder gets
    its surface back as soon as the copy has run).

    Sets ``frame.device_slot``; the preprocess stage returns the slot, as for uploads.
    """

    def __init__(self, name: str, gpu: GpuContext, stop: threading.Event | None = None) -> None:
        super().__init__(name, gpu, stop)
        self._decoded: Any = None
        self._in_flight: deque[tuple[Any, tuple[Any, Any]]] = deque()  # (copied event, planes)

    def open(self) -> None:
        import cupy

        self.gpu.activate()
        self._decoded = cupy.cuda.Event(disable_timing=True)

    def process(self, item: Frame) -> Iterable[Frame]:
        if item.device_planes is None:
            return super().process(item)
        staging = self.gpu.staging
        assert staging is not None, "GpuContext.allocate() must run before the graph starts"
        self.gpu.activate()
        slot = staging.acquire(self.stop)
        stage_device_frame(staging, slot, item, self.gpu.copy_stream, self._decoded,
                           self.gpu.timeline)
        # Copies complete in queue order on the one copy stream: release surfaces in order.
        while self._in_flight and self._in_flight[0][0].done:
            self._in_flight.popleft()
        self._in_flight.append((staging.copied[slot], item.device_planes))
        item.device_planes, item.device_slot = None, slot
        return (item,)

    def close(self) -> None:
        if self._in_flight:
            self.gpu.copy_stream.synchronize()
            self._in_flight.clear()
