"""The fused preprocessing kernel (Numba CUDA): YUV 4:2:0 frames to letterboxed RGB CHW.

One pass per output pixel does what :func:`kernels.preprocess.preprocess_reference` does on
the host, with the same maths (its module docstring) and the same per-geometry sampling
tables: bilinear letterbox resize of the Y and chroma planes, BT.601 limited-range YUV to
RGB, clamp, scale to 0..1, pad 114/255, CHW, cast to the output dtype. It reads the frames
from device memory and writes straight into batch slots of the model input, so a frame
crosses no other buffer between upload and inference.

One launch handles any number of frames of one source geometry (grid z = frame). Batch
them: Numba's dispatch costs ~70 us of host time per launch, while the kernel takes ~3 us
per 1080p frame on an H200 (64 frames to 640x640 fp16 in ~190 us, 45% of a device copy's
bandwidth; see benchmarks/preprocess_benchmark.py).

Arrays may be Numba device arrays or any object exporting ``__cuda_array_interface__``
(CuPy); the latter are viewed without synchronising on their exported stream (as
``cuda.as_cuda_array(x, sync=False)`` would, but cached): ordering is the caller's, through
the ``stream`` argument, which may be a Numba stream, a CuPy stream, a raw ``cudaStream_t``
int, or None/0 (the default stream). As with any asynchronous launch, the caller keeps the
arrays alive until the kernel has run.

Nothing touches the GPU at import; the first launch per (output dtype, array layouts)
compiles (~3 s), so call :func:`warmup_preprocess` at start.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from numba import cuda

from kernels.preprocess import (
    B_FROM_U,
    G_FROM_U,
    G_FROM_V,
    PAD_VALUE,
    R_FROM_V,
    Y_GAIN,
    Letterbox,
    check_geometry,
    sampling_tables,
)

BLOCK = (32, 8, 1)
OUT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32))

# float32 constants: a bare Python literal would promote the kernel's arithmetic to float64.
_PAD = np.float32(PAD_VALUE)
_ZERO = np.float32(0.0)
_LUMA_BLACK = np.float32(16.0)
_CHROMA_ZERO = np.float32(128.0)
_MAX = np.float32(255.0)
_INV_255 = np.float32(1.0 / 255.0)


@cuda.jit(device=True)
def _sample(frame, row0, row1, col0, col1, wy, wx):
    """Bilinear sample of one plane of a frame (preprocess module docstring, step 4)."""
    a = np.float32(frame[row0 + col0])
    b = np.float32(frame[row0 + col1])
    c = np.float32(frame[row1 + col0])
    d = np.float32(frame[row1 + col1])
    top = a + (b - a) * wx
    return top + ((c + (d - c) * wx) - top) * wy


# cache=True: compiled at the first start on a machine, loaded from __pycache__ after that.
@cuda.jit(cache=True)
def preprocess_kernel(frames, pairs, batch_offset, taps, weights, v_delta, out):
    """Output pixel (x, y) = cuda.grid(2) of frame ``pairs[blockIdx.z]``; see the launcher.

    ``taps``/``weights`` are :func:`device_tables`: byte offsets and weights, output columns
    first, then output rows (at ``width + y``). Indices are cast to unsigned once known to be
    in range: Numba wraps negative signed indices, which cost more than the sampling itself.
    """
    x, y = cuda.grid(2)
    height, width = out.shape[2], out.shape[3]
    slot = pairs[cuda.blockIdx.z, 0]
    b = batch_offset + pairs[cuda.blockIdx.z, 1]
    if x >= width or y >= height or slot < 0 or slot >= frames.shape[0] or b < 0 or b >= out.shape[0]:
        return  # outside the picture, or a bad pair: never write outside the buffers
    frame, dst = frames[np.uint64(slot)], out[np.uint64(b)]
    xu, yu, row = np.uint64(x), np.uint64(y), np.uint64(width + y)
    if taps[xu, 0] < 0 or taps[row, 0] < 0:
        dst[0, yu, xu] = _PAD
        dst[1, yu, xu] = _PAD
        dst[2, yu, xu] = _PAD
        return
    x0, x1 = np.uint64(taps[xu, 0]), np.uint64(taps[xu, 1])
    cx0, cx1 = np.uint64(taps[xu, 2]), np.uint64(taps[xu, 3])
    y0, y1 = np.uint64(taps[row, 0]), np.uint64(taps[row, 1])
    cy0, cy1 = np.uint64(taps[row, 2]), np.uint64(taps[row, 3])
    luma = _sample(frame, y0, y1, x0, x1, weights[row, 0], weights[xu, 0])
    u = _sample(frame, cy0, cy1, cx0, cx1, weights[row, 1], weights[xu, 1])
    v = _sample(frame, cy0 + v_delta, cy1 + v_delta, cx0, cx1, weights[row, 1], weights[xu, 1])
    luma = (luma - _LUMA_BLACK) * Y_GAIN
    u -= _CHROMA_ZERO
    v -= _CHROMA_ZERO
    r = luma + R_FROM_V * v
    g = luma - G_FROM_U * u - G_FROM_V * v
    bl = luma + B_FROM_U * u
    dst[0, yu, xu] = min(max(r, _ZERO), _MAX) * _INV_255
    dst[1, yu, xu] = min(max(g, _ZERO), _MAX) * _INV_255
    dst[2, yu, xu] = min(max(bl, _ZERO), _MAX) * _INV_255


def _device(array: Any) -> Any:
    """A Numba device array viewing ``array`` (no copy, no synchronisation).

    Views of ``__cuda_array_interface__`` arrays are cached by (pointer, shape, strides,
    dtype), which fully determine them, and own nothing: building one costs tens of
    microseconds, and the pipeline launches on the same few buffers every batch.
    """
    if getattr(array, "__cuda_ndarray__", False):
        return array
    cai = array.__cuda_array_interface__
    strides = cai.get("strides")
    return _view(cai["data"][0], tuple(cai["shape"]), strides and tuple(strides), cai["typestr"])


@functools.lru_cache(maxsize=256)
def _view(ptr: int, shape: tuple, strides: tuple | None, typestr: str) -> Any:
    desc = {"data": (ptr, False), "shape": shape, "strides": strides, "typestr": typestr, "version": 3}
    return cuda.from_cuda_array_interface(desc, owner=None, sync=False)


@functools.lru_cache(maxsize=32)
def _external_stream(ptr: int) -> Any:
    return cuda.external_stream(ptr)


def _stream(stream: Any) -> Any:
    """A Numba stream (or 0) for a Numba stream, a CuPy stream, a raw handle or None."""
    if stream is None:
        return 0
    if isinstance(stream, int):
        return _external_stream(stream) if stream else 0
    if type(stream).__module__.startswith("cupy"):
        return _external_stream(stream.ptr) if stream.ptr else 0
    return stream


@functools.lru_cache(maxsize=64)
def device_tables(letterbox: Letterbox, pixel_format: str) -> tuple[Any, Any]:
    """The :func:`~kernels.preprocess.sampling_tables` of a geometry, as the kernel reads them.

    The taps become byte offsets into a frame of ``pixel_format``: per output column
    (x0, x1, cx0 * step, cx1 * step) and per output row (y0 * W, y1 * W, U + cy0 * pitch,
    U + cy1 * pitch) with U the offset of the U samples; x0 and y0 * W are negative in the
    pad. Uploaded once per geometry (synchronously, on the default stream: do it at warm-up)
    and cached.

    Returns:
        taps: (dst_w + dst_h, 4) int32 device array, columns then rows.
        weights: (dst_w + dst_h, 2) float32 device array (wx, cwx), then (wy, cwy).
    """
    t = sampling_tables(letterbox)
    width = letterbox.src_width
    pitch, step = (width, 2) if pixel_format == "nv12" else (width // 2, 1)
    u_base = width * letterbox.src_height
    rows = t.rows.T * [width, width, pitch, pitch] + [0, 0, u_base, u_base]
    taps = np.concatenate([t.cols.T * [1, 1, step, step], rows])
    weights = np.concatenate([t.col_weights.T, t.row_weights.T])
    return cuda.to_device(taps.astype(np.int32)), cuda.to_device(weights.astype(np.float32))


@functools.lru_cache(maxsize=1)
def _first_slot_pair() -> Any:
    return cuda.to_device(np.zeros((1, 2), np.int32))


def launch_preprocess(
    frames: Any,
    pairs: Any,
    letterbox: Letterbox,
    out: Any,
    stream: Any = None,
    *,
    batch_offset: int = 0,
    pixel_format: str = "i420",
) -> None:
    """Preprocess several frames of one source geometry into batch slots, in one launch.

    For each row i of ``pairs``, frame ``frames[pairs[i, 0]]`` is letterboxed into
    ``out[batch_offset + pairs[i, 1]]``. Asynchronous: returns once the kernel is queued
    on ``stream``; the caller orders the frames' upload before it and the readers of
    ``out`` after it on that stream. Rows naming a slot or batch index out of range are
    skipped on the device (no error is raised).

    Args:
        frames: (num_slots, bytes_per_slot) uint8 device array, one packed frame per row
            (``height*3//2*width`` bytes, ``pixel_format`` layout, then any unused tail);
            a C-contiguous (num_slots, height*3//2, width) array is accepted too. Numba
            device array or CuPy/``__cuda_array_interface__`` array, valid on ``stream``.
        pairs: (n, 2) int32 device array of (slot, batch index) rows; ``n`` frames are
            processed. Valid on ``stream``.
        letterbox: the common geometry of these frames (its source size is the frames').
        out: (batch, 3, dst_height, dst_width) float16 or float32 device array, the model
            input; only the addressed slots are written. Valid on ``stream``.
        stream: Numba stream, CuPy stream, raw ``cudaStream_t`` int, or None (default stream).
        batch_offset: added to every batch index in ``pairs``.
        pixel_format: "i420" or "nv12".
    """
    width, height = letterbox.src_width, letterbox.src_height
    frame_bytes = height * 3 // 2 * width
    check_geometry(width, height, letterbox, pixel_format)
    if frames.ndim == 3:
        frames = frames.reshape(frames.shape[0], frames.shape[1] * frames.shape[2])
    frames, pairs, out = _device(frames), _device(pairs), _device(out)
    if frames.ndim != 2 or frames.dtype != np.uint8 or frames.shape[1] < frame_bytes:
        raise ValueError(
            f"frames must be (num_slots, >= {frame_bytes}) uint8, got {tuple(frames.shape)} {frames.dtype}"
        )
    if pairs.ndim != 2 or pairs.shape[1] != 2 or pairs.dtype != np.int32:
        raise ValueError(f"pairs must be (n, 2) int32, got {tuple(pairs.shape)} {pairs.dtype}")
    want = (3, letterbox.dst_height, letterbox.dst_width)
    if out.ndim != 4 or tuple(out.shape[1:]) != want or out.dtype not in OUT_DTYPES:
        raise ValueError(
            f"out must be (batch, {', '.join(map(str, want))}) float16 or float32, "
            f"got {tuple(out.shape)} {out.dtype}"
        )
    if pairs.shape[0] == 0:
        return
    v_delta = np.uint64(1 if pixel_format == "nv12" else height * width // 4)  # V - U offset
    grid = (
        -(-letterbox.dst_width // BLOCK[0]),
        -(-letterbox.dst_height // BLOCK[1]),
        pairs.shape[0],
    )
    taps, weights = device_tables(letterbox, pixel_format)
    preprocess_kernel[grid, BLOCK, _stream(stream)](frames, pairs, batch_offset, taps, weights, v_delta, out)


def launch_preprocess_frame(
    frame: Any,
    letterbox: Letterbox,
    out: Any,
    batch_index: int,
    stream: Any = None,
    *,
    pixel_format: str = "i420",
) -> None:
    """Preprocess one frame into ``out[batch_index]`` (see :func:`launch_preprocess`).

    Args:
        frame: (height*3//2, width) or (height*3//2*width,) uint8 C-contiguous device array,
            ``pixel_format`` layout, valid on ``stream``.
        letterbox: the frame's geometry.
        out: (batch, 3, dst_height, dst_width) float16 or float32 device array, valid on
            ``stream``.
        batch_index: the slot of ``out`` to write.
        stream: as for :func:`launch_preprocess`.
        pixel_format: "i420" or "nv12".
    """
    frame = _device(frame.reshape(1, frame.size))
    launch_preprocess(
        frame, _first_slot_pair(), letterbox, out, stream,
        batch_offset=batch_index, pixel_format=pixel_format,
    )  # fmt: skip


def warmup_preprocess(letterbox: Letterbox, dtype: Any = np.float16, pixel_format: str = "i420") -> None:
    """Compile the kernel for ``dtype`` outputs and upload ``letterbox``'s tables (synchronous).

    Call once per geometry and dtype at start, so no frame pays for compilation.
    """
    frame = cuda.to_device(np.zeros(letterbox.src_height * 3 // 2 * letterbox.src_width, np.uint8))
    out = cuda.device_array((1, 3, letterbox.dst_height, letterbox.dst_width), dtype)
    launch_preprocess_frame(frame, letterbox, out, 0, pixel_format=pixel_format)
    cuda.synchronize()
