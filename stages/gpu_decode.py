"""GPU decode: NVDEC through PyAV's hardware acceleration; the frames stay on the device.

``GpuDecodeStage`` reads a source like ``DecodeStage`` (same reconnection, timeouts, error
contract, pacing, catching up and looping: it inherits ``frames`` and ``_pictures``, so a
looped file seeks back to its start in the same container and NVDEC context) but decodes
with ``HWAccel(device_type="cuda", is_hw_owned=True)``: FFmpeg's CUDA decoder writes each
picture as NV12 into a surface of its frame pool, in device memory, and PyAV hands that
surface over without downloading it. Each ``Frame`` then carries
``device_planes`` (Y and interleaved UV CuPy views, imported through DLPack: no copy) and
``pixel_format="nv12"`` instead of a host image; the batcher (``stages.batcher``) packs them
into the batch's device frame rows, one kernel launch per batch (``kernels.pack_cuda``).

**Which CUDA context.** FFmpeg's CUDA device context creates its own context unless told
otherwise. Its ``primary_ctx`` option (PyAV sets it by default with ``is_hw_owned``) retains
the device's primary context -- the one CuPy, Numba and torch use -- but FFmpeg refuses an
already active primary context whose flags differ from ``CU_CTX_SCHED_BLOCKING_SYNC``
("Primary context already active with incompatible flags"), which is the case once CuPy or
torch ran anything with default flags, as the pipeline does before its sources start. So we
pass ``current_ctx=1`` (``AV_CUDA_USE_CURRENT_CONTEXT``, FFmpeg >= 6.1) instead, after making
the runtime's primary context current on the decoding thread: FFmpeg then allocates its
surfaces and runs NVDEC in the very context every other stage uses, whatever its flags.
The first frame of each session checks it (``cuPointerGetAttribute``): a surface in another
context would not be readable by our kernels, and a copy out of it is only documented
between contexts with ``cuMemcpyPeer``, so that is an error with the reason, not a guess.

**Ordering.** FFmpeg queues its decoder output copies on the context's legacy default
stream (its ``AVCUDADeviceContext.stream`` is NULL); the pipeline's streams are
non-blocking, so the consumer must order itself after that stream (an event; see
``stages.batcher.BatcherStage``).

**Lifetime.** The DLPack export holds its own reference to the FFmpeg frame, so a surface
returns to the decoder's pool only when the CuPy views are dropped; FFmpeg's CUDA frame pool
grows on demand, so holding frames in queues never stalls the decoder.

**Previews.** The live view needs host pictures, which GPU-decoded frames do not have. Given
a ``PictureTap`` (the app's preview hub), the stage asks ``tap.wanted(name)`` at most once
per ``tap.period_s`` and, only while a viewer wants the source, downloads that one frame's
NV12 planes (``download_nv12``: two pitched D2H copies on the legacy default stream, after
FFmpeg's output copies, waited for in this thread: about 3 MB at 1080p, a fraction of a
millisecond, ``preview_fps`` times a second) and hands them over keyed by the frame's index
before the frame goes on, so the hub can pair the picture with that frame's detections.
Synchronous on purpose: a stream and event of our own would save this thread well under a
millisecond a few times a second, and a picture still in flight could not be handed over
before its frame. Nobody watching costs a clock read per frame and one ``wanted`` call per
period; no tap (no live view) costs one ``is None`` test per frame.
"""

from __future__ import annotations

import ctypes
import functools
import threading
import time
from fractions import Fraction
from typing import Any, Protocol

import av
import numpy as np
import structlog

from pipeline.config import SourceConfig
from pipeline.records import Frame
from pipeline.slots import SlotRing
from stages.decode import DecodeStage, FrameTooLarge, SourceError, even_size, open_options

log = structlog.get_logger("gpu_decode")

HWACCEL_OPTIONS = {"primary_ctx": "0", "current_ctx": "1"}  # see the module docstring
CU_POINTER_ATTRIBUTE_CONTEXT = 1
CUDA_STREAM_LEGACY = 1  # cudaStreamLegacy: the stream FFmpeg's NULL stream is, in any thread
MEMCPY_DEVICE_TO_HOST = 2  # cudaMemcpyDeviceToHost


class PictureTap(Protocol):
    """Where a GPU decode stage hands host pictures for the live view
    (``pipeline.app.preview.PreviewHub`` implements it; stages never import it).

    Attributes:
        period_s: ask ``wanted`` (and so download) at most once per this many seconds.
    """

    period_s: float

    def wanted(self, source: str) -> bool:
        """Whether a viewer wants ``source``'s pictures now."""

    def offer_picture(self, source: str, index: int, nv12: np.ndarray, width: int,
                      height: int) -> None:
        """Frame ``index`` of ``source`` as a (height * 3 // 2, width) uint8 NV12 host array
        (the tap keeps it; the stage does not reuse it)."""


@functools.cache
def gpu_decode_unavailable_reason() -> str | None:
    """Why GPU decode cannot run here, or None when CuPy, a CUDA device and PyAV's CUDA
    hardware acceleration are all present (cached: asked once per process)."""
    from pipeline.gpu import gpu_unavailable_reason

    reason = gpu_unavailable_reason()
    if reason is not None:
        return reason
    try:
        from av.codec.hwaccel import HWAccel, hwdevices_available
    except ImportError:
        return f"PyAV {av.__version__} has no hardware acceleration (av.codec.hwaccel)"
    if "cuda" not in hwdevices_available():
        return f"this PyAV build ({av.__version__}) has no CUDA hardware decoding"
    try:
        cuda_hwaccel(HWAccel, 0)
    except TypeError:
        return f"PyAV {av.__version__} cannot keep decoded frames on the GPU (is_hw_owned)"
    return None


def cuda_hwaccel(hwaccel_type: Any, device_id: int) -> Any:
    """A PyAV ``HWAccel`` for NVDEC that keeps frames on the device, in the current context.

    Args:
        hwaccel_type: ``av.codec.hwaccel.HWAccel``.
        device_id: CUDA device ordinal.
    """
    options = dict(HWACCEL_OPTIONS)
    try:
        return hwaccel_type("cuda", device=device_id, allow_software_fallback=False,
                            options=options, is_hw_owned=True)
    except TypeError:  # later PyAV spells it output_format="hw"
        return hwaccel_type("cuda", device=device_id, allow_software_fallback=False,
                            options=options, output_format="hw")


def activate_primary_context(device_id: int) -> int:
    """Make the CUDA runtime's primary context of ``device_id`` current on this thread.

    Returns:
        Its ``CUcontext`` handle.
    """
    import cupy

    cupy.cuda.runtime.setDevice(device_id)  # binds the primary context (CUDA >= 12)
    context = int(cupy.cuda.driver.ctxGetCurrent())
    if context:
        return context
    # Before CUDA 12 only a runtime call binds it. Not the first choice: CuPy holds the GIL
    # through it, and on a busy H200 cudaMemGetInfo took 0.5 s (a spare's first camera).
    cupy.cuda.runtime.memGetInfo()
    return int(cupy.cuda.driver.ctxGetCurrent())


@functools.cache
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def pointer_context(ptr: int) -> int:
    """The ``CUcontext`` that owns device pointer ``ptr`` (driver ``cuPointerGetAttribute``)."""
    context = ctypes.c_void_p()
    status = _driver().cuPointerGetAttribute(ctypes.byref(context), CU_POINTER_ATTRIBUTE_CONTEXT,
                                          ctypes.c_uint64(ptr))
    if status != 0:
        raise RuntimeError(f"cuPointerGetAttribute failed with CUresult {status}")
    return int(context.value or 0)


def device_planes(picture: av.VideoFrame) -> tuple[Any, Any]:
    """The NV12 planes of a CUDA frame as CuPy views through DLPack (zero copy).

    Returns:
        Y (height, width) uint8 and UV (height // 2, width // 2, 2) uint8 device arrays, row
        pitch ``strides[0]``; valid on the legacy default stream (module docstring). The
        capsules are taken with no stream: PyAV's export refuses the stream handshake that
        ``cupy.from_dlpack(plane)`` would start, and the caller orders its reads itself.
    """
    import cupy

    y = cupy.from_dlpack(picture.planes[0].__dlpack__())
    uv = cupy.from_dlpack(picture.planes[1].__dlpack__())
    return y, uv


def download_nv12(y: Any, uv: Any) -> np.ndarray:
    """A host copy of a GPU-decoded frame's NV12 planes, packed (no row padding).

    Two pitched D2H copies on the legacy default stream (ordered after FFmpeg's output
    copies, see the module docstring), waited for before returning.

    Args:
        y: (height, width) uint8 CuPy device array, any row pitch; valid on the legacy
            default stream.
        uv: (height // 2, width // 2, 2) uint8 CuPy device array of interleaved U, V, any
            row pitch; valid on the legacy default stream.

    Returns:
        (height * 3 // 2, width) uint8 host array: Y rows, then interleaved UV rows.
    """
    import cupy

    height, width = y.shape
    out = np.empty((height * 3 // 2, width), np.uint8)
    runtime = cupy.cuda.runtime
    base = out.ctypes.data
    with y.device:  # the planes' GPU (any thread: the event snapshots download in analytics')
        runtime.memcpy2DAsync(base, width, y.data.ptr, y.strides[0], width, height,
                              MEMCPY_DEVICE_TO_HOST, CUDA_STREAM_LEGACY)
        runtime.memcpy2DAsync(base + width * height, width, uv.data.ptr, uv.strides[0], width,
                              height // 2, MEMCPY_DEVICE_TO_HOST, CUDA_STREAM_LEGACY)
        runtime.streamSynchronize(CUDA_STREAM_LEGACY)
    return out


class GpuDecodeStage(DecodeStage):
    """Decodes one source on the GPU (NVDEC) and yields frames whose pictures stay there.

    Same contract as ``DecodeStage``: frames, then one ``EndOfStream``; a source that cannot
    be opened (also: no usable GPU decoder) ends with ``EndOfStream(error=...)``.

    Args:
        source: the source's configuration.
        device_id: the CUDA device the pipeline runs on.
        ring: the pipeline's slot ring, only to check that frames fit its slots (the
            batch's device rows have the same size); GPU-decoded frames take no slot.
        preview: where host pictures go while a viewer wants them (module docstring), or
            None (no live view: nothing is ever downloaded).
    """

    def __init__(self, source: SourceConfig, device_id: int = 0, ring: SlotRing | None = None,
                 preview: PictureTap | None = None) -> None:
        super().__init__(source, ring)
        self.device_id = device_id
        self.thread_type = "SLICE"  # NVDEC decodes; FFmpeg's frame threads would only add delay
        self.preview = preview
        self._context: int | None = None
        self._checked = False
        self._preview_due = float("-inf")  # time.monotonic() of the next ``wanted`` question

    def open_container(self) -> av.container.InputContainer:
        reason = gpu_decode_unavailable_reason()
        if reason is not None:
            raise SourceError(f"GPU decode unavailable: {reason}")
        from av.codec.hwaccel import HWAccel

        self._context = activate_primary_context(self.device_id)
        self._checked = False
        source = self.source
        return av.open(source.uri, options=open_options(source),
                       hwaccel=cuda_hwaccel(HWAccel, self.device_id),
                       timeout=(source.open_timeout_s, source.read_timeout_s))

    def make_frame(self, picture: av.VideoFrame, index: int, rate: Fraction | None,
                   stop_reading: threading.Event | None = None,
                   capture_time: float | None = None) -> Frame:
        """The record of one decoded picture: views of its NVDEC surface (no host copy, no
        ring slot; the batcher packs it into the batch's device rows).

        Raises:
            SourceError: not a CUDA frame, another CUDA context, or larger than a frame slot.
        """
        if picture.format.name != "cuda":
            raise SourceError(f"{self.display_uri}: the decoder returned {picture.format.name} "
                              "frames, not CUDA frames (no GPU decoder for this stream?)")
        y, uv = device_planes(picture)
        if not self._checked:
            owner = pointer_context(y.data.ptr)
            if owner != self._context:
                raise SourceError("FFmpeg decoded into another CUDA context than the pipeline's "
                                  "(its CUDA device context ignored current_ctx: FFmpeg < 6.1?)")
            self._checked = True
        width, height = even_size(picture.width, picture.height)  # a crop, as on the CPU
        if self.ring is not None and not self.ring.fits(width, height):
            raise FrameTooLarge(f"a {width}x{height} frame does not fit the frame slots of "
                              f"{self.ring.slot_bytes} bytes (sized for the largest file source, "
                              "at least 1920x1080)")
        frame = Frame(source=self.name, index=index,
                      pts=self.timestamp(float(picture.time) if picture.time is not None
                                         else None, rate),
                      capture_time=time.time() if capture_time is None else capture_time,
                      width=width, height=height, rate=rate, pixel_format="nv12",
                      device_planes=(y[:height, :width], uv[:height // 2, :width // 2]))
        if self.preview is not None and time.monotonic() >= self._preview_due:
            self._offer_picture(frame)
        return frame

    def _offer_picture(self, frame: Frame) -> None:
        """Once per ``preview.period_s``: when a viewer wants this source, download the
        frame's picture and hand it to the preview (before the frame goes on)."""
        preview = self.preview
        self._preview_due = time.monotonic() + preview.period_s
        if preview.wanted(self.name):
            preview.offer_picture(self.name, frame.index, download_nv12(*frame.device_planes),
                                  frame.width, frame.height)

