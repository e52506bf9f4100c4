"""Letterbox geometry and the NumPy reference of the fused preprocessing.

A decoded frame arrives as YUV 4:2:0 planes and leaves as one slot of the model input:
RGB, CHW, 0..1, letterboxed. This module defines that mapping once, in NumPy, for the CPU
path (which runs it on every frame) and as the reference the GPU kernel in
:mod:`kernels.preprocess_cuda` is tested against. Both read the same per-geometry sampling
tables (:func:`sampling_tables`), so they pick the same source pixels with the same weights.

The maths, for a frame of ``W x H`` luma pixels fitted into ``dst_w x dst_h``
(see :class:`Letterbox` for ``resized_*``, ``pad_*``):

1. **Geometry.** Output pixel ``(x, y)`` lies in the picture when
   ``0 <= x - pad_left < resized_w`` and ``0 <= y - pad_top < resized_h``; every other
   pixel is the pad colour ``114 / 255`` on all three channels.
2. **Source coordinate** (OpenCV ``INTER_LINEAR``, half-pixel centres), per axis, in float64:
   ``s = (x - pad_left + 0.5) * (W / resized_w) - 0.5``; ``x0 = floor(s)``,
   ``wx = float32(s - x0)``; the taps ``x0`` and ``x0 + 1`` are clamped to ``[0, W - 1]``
   (edge replication). Rows likewise with ``H``, ``resized_h``, ``pad_top``.
3. **Chroma coordinate.** The chroma planes are ``W/2 x H/2`` with samples centred on each
   2x2 luma block (centre siting, as OpenCV's and JPEG's 4:2:0 conversions assume), so the
   matching chroma coordinate is ``c = (s + 0.5) / 2 - 0.5``, tapped, weighted and clamped
   to ``[0, W/2 - 1]`` exactly as in step 2.
4. **Bilinear sampling**, in float32, of each plane ``P`` at its taps:
   ``top = P[y0, x0] + (P[y0, x1] - P[y0, x0]) * wx``,
   ``bot = P[y1, x0] + (P[y1, x1] - P[y1, x0]) * wx``, ``p = top + (bot - top) * wy``.
   This gives ``Y`` (luma plane, luma taps) and ``U``, ``V`` (chroma planes, chroma taps).
5. **BT.601 limited range to RGB** (ITU-R BT.601, Kr = 0.299, Kb = 0.114, Y in 16..235,
   U/V in 16..240; the same matrix as OpenCV's ``COLOR_YUV2RGB_I420``), in float32::

       R = 1.164383 * (Y - 16)                       + 1.596027 * (V - 128)
       G = 1.164383 * (Y - 16) - 0.391762 * (U - 128) - 0.812968 * (V - 128)
       B = 1.164383 * (Y - 16) + 2.017232 * (U - 128)

   (``255/219``, ``1.402 * 255/224``, ``0.344136 * 255/224``, ``0.714136 * 255/224``,
   ``1.772 * 255/224``.) Unlike OpenCV, ``Y - 16`` is not clamped at 0 before the matrix.
6. **Normalise:** ``clip(v, 0, 255) * (1 / 255)``, no rounding to integers; channels in
   R, G, B order, CHW; finally cast to the output dtype (round to nearest for float16).

Against OpenCV's ``cvtColor(COLOR_YUV2RGB_I420)`` then ``resize``: equal in flat areas, but
OpenCV replicates each chroma sample over its 2x2 block and clamps before resizing, so at
edges between saturated colours single pixels differ by up to ~30/255 on natural video
(tests/kernels/test_preprocess.py measures both comparisons).

Pixel formats: ``"i420"`` (PyAV ``yuv420p``: the U plane then the V plane, each
``H/2 x W/2`` packed row-contiguous after the Y plane) and ``"nv12"`` (one ``H/2 x W``
plane of interleaved U, V pairs after the Y plane). Both arrive as one ``(H*3//2, W)``
uint8 array.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

PIXEL_FORMATS = ("i420", "nv12")
PAD_VALUE = 114.0 / 255.0

# BT.601 limited range, YUV -> RGB (see the module docstring).
Y_GAIN = np.float32(255.0 / 219.0)
R_FROM_V = np.float32(1.402 * 255.0 / 224.0)
G_FROM_U = np.float32(0.344136 * 255.0 / 224.0)
G_FROM_V = np.float32(0.714136 * 255.0 / 224.0)
B_FROM_U = np.float32(1.772 * 255.0 / 224.0)


@dataclass(frozen=True)
class Letterbox:
    """How a ``src_width x src_height`` frame is fitted into a ``dst_width x dst_height`` input.

    The picture is scaled by ``scale = min(dst_w / src_w, dst_h / src_h)`` to
    ``resized = round(src * scale)`` pixels per axis, centred with ``pad = (dst - resized) // 2``
    pixels of pad before it; ``scale_x = resized_w / src_w`` and ``scale_y = resized_h / src_h``
    are the scales actually applied. Hashable, so it keys the per-geometry caches.
    """

    src_width: int
    src_height: int
    dst_width: int
    dst_height: int
    scale_x: float
    scale_y: float
    pad_left: int
    pad_top: int

    @property
    def resized_width(self) -> int:
        return round(self.src_width * self.scale_x)

    @property
    def resized_height(self) -> int:
        return round(self.src_height * self.scale_y)

    def unmap_boxes(self, xyxy: Any) -> Any:
        """Map boxes from model-input pixels back to source-frame pixels, clipped to the frame.

        Args:
            xyxy: (N, 4) float boxes x1, y1, x2, y2 in model-input pixels; host (NumPy) or
                device (CuPy) array, on the caller's current stream.

        Returns:
            (N, 4) float32 boxes in source pixels, clipped to ``[0, src_width] x [0,
            src_height]``; a new array on the same device as ``xyxy``.
        """
        out = xyxy.astype(np.float32, copy=True)
        out[:, 0::2] = ((out[:, 0::2] - self.pad_left) / self.scale_x).clip(0, self.src_width)
        out[:, 1::2] = ((out[:, 1::2] - self.pad_top) / self.scale_y).clip(0, self.src_height)
        return out


def letterbox_geometry(src_width: int, src_height: int, dst_width: int, dst_height: int) -> Letterbox:
    """The :class:`Letterbox` that fits a source frame into the model input, aspect kept."""
    sizes = (src_width, src_height, dst_width, dst_height)
    if any(int(v) != v or v <= 0 for v in sizes):
        raise ValueError(f"letterbox sizes must be positive integers, got {sizes}")
    src_width, src_height, dst_width, dst_height = map(int, sizes)
    scale = min(dst_width / src_width, dst_height / src_height)
    resized_w = min(dst_width, max(1, round(src_width * scale)))
    resized_h = min(dst_height, max(1, round(src_height * scale)))
    return Letterbox(
        src_width=src_width,
        src_height=src_height,
        dst_width=dst_width,
        dst_height=dst_height,
        scale_x=resized_w / src_width,
        scale_y=resized_h / src_height,
        pad_left=(dst_width - resized_w) // 2,
        pad_top=(dst_height - resized_h) // 2,
    )


class SamplingTables(NamedTuple):
    """Per-output-column and per-output-row taps and weights of one :class:`Letterbox`.

    Attributes:
        cols: (4, dst_width) int32 host array: luma taps x0, x1, chroma taps cx0, cx1 of each
            output column; all -1 in pad columns.
        col_weights: (2, dst_width) float32 host array: luma weight wx, chroma weight cwx
            (0 in pad columns).
        rows: (4, dst_height) int32 host array, as ``cols`` for output rows.
        row_weights: (2, dst_height) float32 host array, as ``col_weights`` for rows.
    """

    cols: np.ndarray
    col_weights: np.ndarray
    rows: np.ndarray
    row_weights: np.ndarray


def _axis_table(dst: int, resized: int, pad: int, src: int) -> tuple[np.ndarray, np.ndarray]:
    """Taps (4, dst) int32 and weights (2, dst) float32 along one axis (module docstring 2-3)."""
    taps = np.full((4, dst), -1, np.int32)
    weights = np.zeros((2, dst), np.float32)
    s = (np.arange(resized, dtype=np.float64) + 0.5) * (src / resized) - 0.5
    for i, (coord, size) in enumerate(((s, src), ((s + 0.5) / 2 - 0.5, src // 2))):
        x0 = np.floor(coord)
        taps[2 * i, pad : pad + resized] = np.clip(x0, 0, size - 1)
        taps[2 * i + 1, pad : pad + resized] = np.clip(x0 + 1, 0, size - 1)
        weights[i, pad : pad + resized] = coord - x0
    return taps, weights


@functools.lru_cache(maxsize=64)
def sampling_tables(letterbox: Letterbox) -> SamplingTables:
    """The sampling tables of ``letterbox``, computed once per geometry (cached, read-only)."""
    lb = letterbox
    cols, col_weights = _axis_table(lb.dst_width, lb.resized_width, lb.pad_left, lb.src_width)
    rows, row_weights = _axis_table(lb.dst_height, lb.resized_height, lb.pad_top, lb.src_height)
    tables = SamplingTables(cols, col_weights, rows, row_weights)
    for table in tables:
        table.flags.writeable = False
    return tables


def chroma_planes(yuv: np.ndarray, width: int, height: int, pixel_format: str) -> tuple[Any, Any]:
    """Views of the U and V planes of one frame.

    Args:
        yuv: (height*3//2, width) uint8 host array, ``pixel_format`` layout.
        width, height: luma size, both even.
        pixel_format: "i420" or "nv12".

    Returns:
        U and V, each (height/2, width/2) uint8 views into ``yuv`` (strided for nv12).
    """
    ch, cw = height // 2, width // 2
    if pixel_format == "nv12":
        uv = yuv[height:].reshape(ch, cw, 2)
        return uv[..., 0], uv[..., 1]
    chroma = np.ascontiguousarray(yuv[height:]).reshape(2, ch, cw)
    return chroma[0], chroma[1]


def check_geometry(width: int, height: int, letterbox: Letterbox, pixel_format: str) -> None:
    """Raise ValueError unless a ``width x height`` ``pixel_format`` frame fits ``letterbox``."""
    if pixel_format not in PIXEL_FORMATS:
        raise ValueError(f"pixel_format must be one of {PIXEL_FORMATS}, got {pixel_format!r}")
    if width % 2 or height % 2 or width <= 0 or height <= 0:
        raise ValueError(f"4:2:0 frames need a positive even size, got {width}x{height}")
    if (letterbox.src_width, letterbox.src_height) != (width, height):
        raise ValueError(
            f"letterbox is for {letterbox.src_width}x{letterbox.src_height} frames, "
            f"got a {width}x{height} frame"
        )


def _bilinear(plane: np.ndarray, rows: np.ndarray, cols: np.ndarray, wy: Any, wx: Any) -> Any:
    """Bilinear samples (len(rows[0]), len(cols[0])) float32 of ``plane`` (module docstring 4)."""
    # Whole rows first, then columns: two cheap gathers instead of one 2-D fancy index.
    top_rows, bottom_rows = plane[rows[0]], plane[rows[1]]
    a, b = top_rows[:, cols[0]].astype(np.float32), top_rows[:, cols[1]].astype(np.float32)
    c, d = bottom_rows[:, cols[0]].astype(np.float32), bottom_rows[:, cols[1]].astype(np.float32)
    b -= a
    b *= wx
    a += b  # top
    d -= c
    d *= wx
    c += d  # bottom
    c -= a
    c *= wy
    a += c
    return a


def preprocess_reference(
    yuv: np.ndarray,
    width: int,
    height: int,
    letterbox: Letterbox,
    out: np.ndarray | None = None,
    dtype: Any = np.float32,
    pixel_format: str = "i420",
) -> np.ndarray:
    """Letterbox, convert and normalise one YUV 4:2:0 frame into a model-input slot (NumPy).

    Implements exactly the maths of the module docstring (the GPU kernel implements the
    same, from the same :func:`sampling_tables`).

    Args:
        yuv: (height*3//2, width) uint8 host array: one frame, ``pixel_format`` layout
            (``frame.to_ndarray(format="yuv420p")`` from PyAV for "i420").
        width, height: the frame's luma size, both even, equal to the letterbox's source size.
        letterbox: the geometry, from :func:`letterbox_geometry`.
        out: optional (3, dst_height, dst_width) host array to write into (e.g. one slot of
            a preallocated batch array); its dtype wins over ``dtype``.
        dtype: output dtype when ``out`` is None (float32 or float16).
        pixel_format: "i420" or "nv12".

    Returns:
        (3, dst_height, dst_width) RGB in 0..1 host array: ``out`` when given.
    """
    check_geometry(width, height, letterbox, pixel_format)
    if yuv.dtype != np.uint8 or tuple(yuv.shape) != (height * 3 // 2, width):
        raise ValueError(
            f"yuv must be a ({height * 3 // 2}, {width}) uint8 {pixel_format} frame, "
            f"got {tuple(yuv.shape)} {yuv.dtype}"
        )
    lb = letterbox
    shape = (3, lb.dst_height, lb.dst_width)
    if out is None:
        out = np.empty(shape, dtype)
    elif tuple(out.shape) != shape:
        raise ValueError(f"out must have shape {shape}, got {tuple(out.shape)}")
    t = sampling_tables(lb)
    x_in = slice(lb.pad_left, lb.pad_left + lb.resized_width)
    y_in = slice(lb.pad_top, lb.pad_top + lb.resized_height)
    cols, rows = t.cols[:, x_in], t.rows[:, y_in]
    wx, cwx = t.col_weights[0, x_in], t.col_weights[1, x_in]
    wy, cwy = t.row_weights[0, y_in][:, None], t.row_weights[1, y_in][:, None]

    u_plane, v_plane = chroma_planes(yuv, width, height, pixel_format)
    luma = (_bilinear(yuv[:height], rows[:2], cols[:2], wy, wx) - 16) * Y_GAIN
    u = _bilinear(u_plane, rows[2:], cols[2:], cwy, cwx) - 128
    v = _bilinear(v_plane, rows[2:], cols[2:], cwy, cwx) - 128

    out[...] = PAD_VALUE
    scale = np.float32(1.0 / 255.0)
    for channel, value in enumerate(
        (luma + R_FROM_V * v, luma - G_FROM_U * u - G_FROM_V * v, luma + B_FROM_U * u)
    ):
        out[channel, y_in, x_in] = np.clip(value, 0, 255, out=value) * scale
    return out
