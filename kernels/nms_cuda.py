"""YOLO output decoding and exact greedy NMS on the GPU (Numba CUDA), batched over images.

Same results as ``kernels.nms.postprocess_reference`` (same keep sets, same order, bit-equal
boxes and scores), computed in four steps per batch, all on one stream:

1. ``filter_kernel``: one thread per anchor picks the best class and, when its score passes
   the threshold, appends the decoded candidate to its image's list with an atomic counter.
   The list has room for every anchor, so nothing is ever dropped (the price: the IoU mask
   below takes ``B * A * ceil(A / 64) * 8`` bytes, 282 MB for B=32, A=8400).
2. ``rank_kernel``: the atomics leave the candidates in arbitrary order, so each candidate
   counts the candidates that precede it in the order (score descending, anchor ascending)
   and moves itself to that rank: an exact, deterministic sort (O(N^2) work, fully parallel).
3. ``mask_kernel``: in 64 x 64 tiles, bit j of ``mask[b, i, j // 64]`` is set when sorted
   candidate j > i has the same class (unless class-agnostic) and IoU > threshold.
4. ``reduce_kernel``: one block per image sweeps the sorted list 64 candidates at a time,
   keeps candidate i unless a kept one removed it, ORs the kept rows into a shared-memory
   bitset (threads split the words), stops at ``max_detections`` and writes the results:
   into ``CudaNms``'s own buffers, or straight into the caller's ``out`` arrays (e.g. views
   of one device allocation, so that one copy brings a whole batch to the host). With a
   per-image ``letterbox`` the same write undoes the letterbox (no extra kernel): the
   boxes land in source-frame pixels, bit-equal to ``kernels.preprocess.Letterbox.unmap_boxes``.

Floating point: the IoU and box arithmetic use libdevice's round-to-nearest intrinsics
(``fmul_rn`` ...) so the compiler cannot fuse a multiply and an add into an FMA, which
would round differently from the NumPy reference. The class scores are read as float32
(float16 predictions are converted on read), thresholds are float32. Undoing the letterbox
is ``clip((x - pad) / scale, 0, size)`` per coordinate, every step in float32 with the
letterbox numbers rounded to float32 first: what NumPy 2 computes in ``unmap_boxes`` (a
Python int or float meeting a float32 array is converted to float32, NEP 50), NaN kept.

Numba compiles each kernel once per combination of argument types (dtype, number of
dimensions, layout C/F/A of every array). ``CudaNms.warmup`` with the very arrays the
pipeline passes (CuPy views, model output) compiles exactly what the first batch needs.

The buffers of one ``CudaNms`` are reused by every call: calls must be ordered on one
stream (one instance per stream).

Output layouts (``stages.backends.base.LAYOUTS``), each read in place from the model's
output binding:

- ``yolov8`` (B, 4 + K, A): the steps above.
- ``yolov5`` (B, A, 5 + K): the same steps; ``filter_kernel`` reads anchor rows instead of
  anchor columns and scores a class as objectness x class probability (one float32 multiply,
  as ``kernels.nms.yolov5_to_anchor_columns``).
- ``end2end`` (B, N, 6) (NMS inside the model): ``CudaEnd2End``, one kernel that keeps the
  rows above the threshold, best first, up to the cap, and undoes the letterbox, as
  ``kernels.nms.end2end_reference`` followed by ``unmap_boxes``.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
from numba import cuda
from numba.cuda.core import config

SIMULATOR = bool(config.ENABLE_CUDASIM)
TILE = 64  # candidates per mask word and per mask tile side
MAX_WORDS = 512  # shared-memory bitset size of the reduction: at most 32768 anchors
MAX_ANCHORS = MAX_WORDS * TILE
# Block size of the filter, rank and reduce kernels (at least TILE). The simulator runs one
# Python thread per CUDA thread, so there 64 keeps the tests fast and gives the rank kernel
# several tiles to walk even for small anchor counts.
_THREADS = TILE if SIMULATOR else 256
_MASK_BLOCKS = 4096  # mask-kernel blocks per launch, over all images (they loop over tiles)
_ZERO, _HALF = np.float32(0.0), np.float32(0.5)

if SIMULATOR:  # the simulator computes with NumPy float32 scalars, which never fuse

    def _add(x, y):
        return x + y

    def _sub(x, y):
        return x - y

    def _mul(x, y):
        return x * y

    def _div(x, y):
        with np.errstate(invalid="ignore", divide="ignore"):
            return x / y

    def _round_even(x):
        return np.rint(x)

else:
    from numba.cuda import libdevice

    _add, _sub = libdevice.fadd_rn, libdevice.fsub_rn
    _mul, _div = libdevice.fmul_rn, libdevice.fdiv_rn
    _round_even = libdevice.rintf  # halves to even, like np.round

# The grids follow the batch (the reduction: one block per image); numba warns below 128 blocks.
warnings.filterwarnings("ignore", message=r".*Grid size \d+ will likely result in GPU under-util")


@cuda.jit(device=True)
def _iou_exceeds(ax1, ay1, ax2, ay2, area_a, bx1, by1, bx2, by2, area_b, threshold):
    """IoU(a, b) > threshold, in the float32 arithmetic of ``kernels.nms.nms``."""
    w = max(_sub(min(ax2, bx2), max(ax1, bx1)), _ZERO)
    h = max(_sub(min(ay2, by2), max(ay1, by1)), _ZERO)
    inter = _mul(w, h)
    return _div(inter, _sub(_add(area_a, area_b), inter)) > threshold  # NaN (0/0) is False


@cuda.jit(device=True)
def _unmap(v, pad, scale, limit):
    """``clip((v - pad) / scale, 0, limit)`` as NumPy's float32 ``unmap_boxes``; NaN stays NaN
    and -0.0 stays -0.0 (NumPy's clip keeps both)."""
    v = _div(_sub(v, pad), scale)
    if v < _ZERO:
        v = _ZERO
    elif v > limit:
        v = limit
    return v


@cuda.jit(device=True)
def _box_value(predictions, b, a, i, anchor_rows):
    """Box value i (cx, cy, w, h) of anchor a: a row (yolov5) or a column (yolov8) entry."""
    if anchor_rows:
        return np.float32(predictions[b, a, i])
    return np.float32(predictions[b, i, a])


@cuda.jit(device=True)
def _class_score(predictions, b, a, k, anchor_rows):
    """Score of class k at anchor a: objectness x probability (yolov5) or the score (yolov8)."""
    if anchor_rows:
        return _mul(np.float32(predictions[b, a, 4]), np.float32(predictions[b, a, 5 + k]))
    return np.float32(predictions[b, 4 + k, a])


# cache=True: compiled at the first start on a machine, loaded from __pycache__ after that.
@cuda.jit(cache=True)
def filter_kernel(predictions, conf_threshold, cand_count, cand_anchor, cand_score, cand_class,
                  cand_box, anchor_rows):
    """Grid (ceil(A / T), B) x T threads (T = _THREADS): one thread per anchor; see the module
    doc. ``anchor_rows``: the yolov5 layout (B, A, 5 + K), else yolov8 (B, 4 + K, A)."""
    a = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    b = cuda.blockIdx.y
    if anchor_rows:
        num_anchors, num_classes = predictions.shape[1], predictions.shape[2] - 5
    else:
        num_anchors, num_classes = predictions.shape[2], predictions.shape[1] - 4
    if a >= num_anchors:
        return
    best = _class_score(predictions, b, a, 0, anchor_rows)
    best_class = 0
    for k in range(1, num_classes):
        s = _class_score(predictions, b, a, k, anchor_rows)
        if s > best or (s != s and best == best):  # the first NaN wins, like np.argmax
            best = s
            best_class = k
    if best > conf_threshold:
        slot = cuda.atomic.add(cand_count, b, 1)
        cx = _box_value(predictions, b, a, 0, anchor_rows)
        cy = _box_value(predictions, b, a, 1, anchor_rows)
        half_w = _mul(_box_value(predictions, b, a, 2, anchor_rows), _HALF)
        half_h = _mul(_box_value(predictions, b, a, 3, anchor_rows), _HALF)
        cand_box[b, slot, 0] = _sub(cx, half_w)
        cand_box[b, slot, 1] = _sub(cy, half_h)
        cand_box[b, slot, 2] = _add(cx, half_w)
        cand_box[b, slot, 3] = _add(cy, half_h)
        cand_anchor[b, slot] = a
        cand_score[b, slot] = best
        cand_class[b, slot] = best_class


@cuda.jit(cache=True)
def rank_kernel(cand_count, cand_anchor, cand_score, cand_class, cand_box, sorted_score,
                sorted_class, sorted_box):
    """Grid (ceil(A / T), B) x T threads (T = _THREADS): candidate i moves to its rank."""
    b = cuda.blockIdx.y
    n = cand_count[b]
    first = cuda.blockIdx.x * cuda.blockDim.x
    if first >= n:  # the whole block leaves, so the barriers below stay uniform
        return
    t = cuda.threadIdx.x
    i = first + t
    score, anchor = _ZERO, 0
    if i < n:
        score, anchor = cand_score[b, i], cand_anchor[b, i]
    tile_score = cuda.shared.array(_THREADS, np.float32)
    tile_anchor = cuda.shared.array(_THREADS, np.int32)
    rank = 0
    for start in range(0, n, _THREADS):
        if start + t < n:
            tile_score[t] = cand_score[b, start + t]
            tile_anchor[t] = cand_anchor[b, start + t]
        cuda.syncthreads()
        for j in range(min(_THREADS, n - start)):
            s = tile_score[j]
            if s > score or (s == score and tile_anchor[j] < anchor):
                rank += 1
        cuda.syncthreads()
    if i < n:
        sorted_score[b, rank] = score
        sorted_class[b, rank] = cand_class[b, i]
        for c in range(4):
            sorted_box[b, rank, c] = cand_box[b, i, c]


@cuda.jit(cache=True)
def mask_kernel(cand_count, sorted_class, sorted_box, iou_threshold, class_agnostic, mask):
    """Grid (G, B) x 64 threads: each block loops over the 64 x 64 tiles of the upper triangle."""
    b = cuda.blockIdx.y
    n = cand_count[b]
    t = cuda.threadIdx.x
    num_tiles = (n + TILE - 1) // TILE
    col_box = cuda.shared.array((TILE, 4), np.float32)
    col_area = cuda.shared.array(TILE, np.float32)
    col_class = cuda.shared.array(TILE, np.int32)
    for tile in range(cuda.blockIdx.x, num_tiles * num_tiles, cuda.gridDim.x):
        row_tile, col_tile = tile // num_tiles, tile % num_tiles
        if col_tile < row_tile:  # only j > i matters; the same for the whole block
            continue
        j = col_tile * TILE + t
        if j < n:
            for c in range(4):
                col_box[t, c] = sorted_box[b, j, c]
            col_area[t] = _mul(_sub(col_box[t, 2], col_box[t, 0]),
                               _sub(col_box[t, 3], col_box[t, 1]))
            col_class[t] = sorted_class[b, j]
        cuda.syncthreads()
        i = row_tile * TILE + t
        if i < n:
            x1, y1 = sorted_box[b, i, 0], sorted_box[b, i, 1]
            x2, y2 = sorted_box[b, i, 2], sorted_box[b, i, 3]
            area = _mul(_sub(x2, x1), _sub(y2, y1))
            cls = sorted_class[b, i]
            bits = np.uint64(0)
            first = t + 1 if row_tile == col_tile else 0
            for jj in range(first, min(TILE, n - col_tile * TILE)):
                if (class_agnostic or col_class[jj] == cls) and _iou_exceeds(
                    x1, y1, x2, y2, area, col_box[jj, 0], col_box[jj, 1], col_box[jj, 2],
                    col_box[jj, 3], col_area[jj], iou_threshold,
                ):
                    bits |= np.uint64(1) << np.uint64(jj)
            mask[b, i, col_tile] = bits
        cuda.syncthreads()


@cuda.jit(cache=True)
def reduce_kernel(cand_count, sorted_score, sorted_class, sorted_box, mask, max_detections,
                  out_box, out_score, out_class, out_count, letterbox, unmap):
    """Grid B x _THREADS: the greedy sweep of one image per block; resets its counter.

    Kept row k of image b goes to ``out_*[b, k]``; when ``unmap``, its box is mapped back to
    source pixels with ``letterbox[b]`` on the way (``letterbox`` is not read otherwise).
    """
    b = cuda.blockIdx.x
    t = cuda.threadIdx.x
    n = cand_count[b]
    num_words = (n + TILE - 1) // TILE
    removed = cuda.shared.array(MAX_WORDS, np.uint64)
    diagonal = cuda.shared.array(TILE, np.uint64)  # the mask words of this word's own rows
    new_rows = cuda.shared.array(TILE, np.int32)  # rows kept in this word
    for w in range(t, num_words, cuda.blockDim.x):
        removed[w] = np.uint64(0)
    kept = 0
    for word in range(num_words):
        row0 = word * TILE
        if t < TILE and row0 + t < n:
            diagonal[t] = mask[b, row0 + t, word]
        cuda.syncthreads()
        # Every thread runs the same sweep on the same shared data, so `kept` and the
        # loop exits are uniform across the block.
        removed_bits = removed[word]
        num_new = 0
        for bit in range(min(TILE, n - row0)):
            if kept + num_new >= max_detections:
                break
            if ((removed_bits >> np.uint64(bit)) & np.uint64(1)) == np.uint64(0):
                removed_bits |= diagonal[bit]
                if t == 0:
                    new_rows[num_new] = row0 + bit
                num_new += 1
        cuda.syncthreads()
        for r in range(t, num_new, cuda.blockDim.x):
            row = new_rows[r]
            out_score[b, kept + r] = sorted_score[b, row]
            out_class[b, kept + r] = sorted_class[b, row]
            if unmap:
                for c in range(4):  # x1 y1 x2 y2: even c is x, odd c is y
                    axis = c % 2
                    out_box[b, kept + r, c] = _unmap(
                        sorted_box[b, row, c], letterbox[b, 2 + axis], letterbox[b, axis],
                        letterbox[b, 4 + axis])
            else:
                for c in range(4):
                    out_box[b, kept + r, c] = sorted_box[b, row, c]
        for w in range(word + 1 + t, num_words, cuda.blockDim.x):
            bits = removed[w]
            for r in range(num_new):
                bits |= mask[b, new_rows[r], w]
            removed[w] = bits
        kept += num_new
        if kept >= max_detections:
            break
    if t == 0:
        out_count[b] = kept
        cand_count[b] = 0  # ready for the next call; every thread read it before a barrier


@cuda.jit(cache=True)
def end2end_kernel(predictions, conf_threshold, max_detections, out_box, out_score, out_class,
                   out_count, letterbox, unmap):
    """Grid B x _THREADS: image b's rows (x1, y1, x2, y2, score, class) scoring above the
    threshold, ranked by (score descending, row ascending), the first ``max_detections`` written
    to ``out_*[b, rank]``; the letterbox is undone on the way when ``unmap``."""
    b = cuda.blockIdx.x
    t = cuda.threadIdx.x
    rows = predictions.shape[1]
    kept = cuda.shared.array(1, np.int32)
    if t == 0:
        kept[0] = 0
    cuda.syncthreads()
    for i in range(t, rows, cuda.blockDim.x):
        score = np.float32(predictions[b, i, 4])
        if not score > conf_threshold:  # NaN is not kept, like the NumPy comparison
            continue
        cuda.atomic.add(kept, 0, 1)
        rank = 0
        for j in range(rows):
            other = np.float32(predictions[b, j, 4])
            if other > conf_threshold and (other > score or (other == score and j < i)):
                rank += 1
        if rank >= max_detections:
            continue
        out_score[b, rank] = score
        out_class[b, rank] = np.int32(_round_even(np.float32(predictions[b, i, 5])))
        for c in range(4):  # x1 y1 x2 y2: even c is x, odd c is y
            v = np.float32(predictions[b, i, c])
            if unmap:
                axis = c % 2
                v = _unmap(v, letterbox[b, 2 + axis], letterbox[b, axis], letterbox[b, 4 + axis])
            out_box[b, rank, c] = v
    cuda.syncthreads()
    if t == 0:
        out_count[b] = min(kept[0], max_detections)


def launch_filter(predictions, conf_threshold, cand_count, cand_anchor, cand_score, cand_class,
                  cand_box, stream: Any = 0, anchor_rows: bool = False) -> None:
    """Find and decode each image's candidates (appended in arbitrary order).

    Args:
        predictions: (B, 4 + K, A) (yolov8) or, with ``anchor_rows``, (B, A, 5 + K) (yolov5)
            float32 or float16 device array, valid on ``stream``.
        conf_threshold: float32 threshold, exclusive.
        cand_count: (>= B,) int32 device, zero on entry; gets the candidate count per image.
        cand_anchor, cand_score, cand_class: (>= B, A) int32 / float32 / int32 device outputs.
        cand_box: (>= B, A, 4) float32 device output, x1 y1 x2 y2.
        stream: numba stream (or 0, the default stream) all arrays are valid on.
        anchor_rows: the predictions are in the yolov5 layout.
    """
    batch = predictions.shape[0]
    anchors = predictions.shape[1 if anchor_rows else 2]
    grid = (math.ceil(anchors / _THREADS), batch)
    filter_kernel[grid, _THREADS, stream](predictions, np.float32(conf_threshold), cand_count,
                                          cand_anchor, cand_score, cand_class, cand_box,
                                          bool(anchor_rows))


def launch_rank(batch: int, cand_count, cand_anchor, cand_score, cand_class, cand_box,
                sorted_score, sorted_class, sorted_box, stream: Any = 0) -> None:
    """Sort each image's candidates by (score descending, anchor ascending).

    Args:
        batch: number of images B.
        cand_count, cand_anchor, cand_score, cand_class, cand_box: ``launch_filter``'s outputs.
        sorted_score, sorted_class: (>= B, A) float32 / int32 device outputs, by rank.
        sorted_box: (>= B, A, 4) float32 device output, by rank.
        stream: numba stream (or 0) all arrays are valid on.
    """
    grid = (math.ceil(cand_score.shape[1] / _THREADS), batch)
    rank_kernel[grid, _THREADS, stream](cand_count, cand_anchor, cand_score, cand_class, cand_box,
                                        sorted_score, sorted_class, sorted_box)


def launch_mask(batch: int, cand_count, sorted_class, sorted_box, iou_threshold: float,
                class_agnostic: bool, mask, stream: Any = 0) -> None:
    """Fill the upper triangle of each image's suppression bitmask.

    Args:
        batch: number of images B.
        cand_count: (>= B,) int32 device, candidates per image.
        sorted_class, sorted_box: ``launch_rank``'s outputs.
        iou_threshold: IoU threshold, exclusive (compared in float32).
        class_agnostic: let any class suppress any other.
        mask: (>= B, A, ceil(A / 64)) uint64 device output; words left of the diagonal tile
            are not written (the reduction never reads them).
        stream: numba stream (or 0) all arrays are valid on.
    """
    words = mask.shape[2]
    grid = (max(1, min(words * words, _MASK_BLOCKS // batch)), batch)
    mask_kernel[grid, TILE, stream](cand_count, sorted_class, sorted_box,
                                    np.float32(iou_threshold), bool(class_agnostic), mask)


def launch_reduce(batch: int, cand_count, sorted_score, sorted_class, sorted_box, mask,
                  max_detections: int, out_box, out_score, out_class, out_count,
                  stream: Any = 0, letterbox: Any = None) -> None:
    """Greedy sweep: write each image's kept detections and count; zero ``cand_count``.

    Grid: B blocks (one per image) x ``_THREADS`` (256); the letterbox is undone in the same
    kernel, by the threads that write the kept rows.

    Args:
        batch: number of images B.
        cand_count, sorted_score, sorted_class, sorted_box, mask: the previous steps' arrays.
        max_detections: most detections kept per image (<= out_box.shape[1]).
        out_box: (>= B, max_detections, 4) float32 device output, x1 y1 x2 y2; rows past the
            count and images past B are not written.
        out_score, out_class: (>= B, max_detections) float32 / int32 device outputs.
        out_count: (>= B,) int32 device output, kept detections per image.
        stream: numba stream (or 0) all arrays are valid on.
        letterbox: None (boxes stay in model-input pixels) or a (>= B, 6) float32 device array,
            per image scale_x, scale_y, pad_left, pad_top, src_width, src_height: boxes are
            written in source-frame pixels. When None, ``out_score`` (also 2-D float32) is
            passed in its place and never read, so both cases share one compiled kernel when
            the two arrays have the same layout.
    """
    unmap = letterbox is not None
    reduce_kernel[batch, _THREADS, stream](cand_count, sorted_score, sorted_class, sorted_box,
                                           mask, max_detections, out_box, out_score, out_class,
                                           out_count, letterbox if unmap else out_score, unmap)


def stream_from_cupy(cupy_stream: Any) -> Any:
    """Wrap a CuPy stream (``cupy.cuda.Stream``) as a numba stream, without copying it."""
    return cuda.external_stream(cupy_stream.ptr)


class CudaNms:
    """Batched decode + exact greedy NMS on the GPU with buffers allocated once.

    Args:
        batch_capacity: most images per call.
        num_anchors: A, anchors of the model output (2535 for YOLOv3-tiny at 416, 8400 for
            YOLOv8 at 640); at most ``MAX_ANCHORS``.
        num_classes: K, classes of the model output.
        conf_threshold: minimum best-class score, exclusive.
        iou_threshold: IoU above which a kept box suppresses another, exclusive.
        class_agnostic: suppress across classes.
        max_detections: most detections kept per image.
        layout: "yolov8", predictions (B, 4 + K, A), or "yolov5", predictions (B, A, 5 + K).
    """

    def __init__(self, batch_capacity: int, num_anchors: int, num_classes: int,
                 conf_threshold: float = 0.25, iou_threshold: float = 0.45,
                 class_agnostic: bool = False, max_detections: int = 300,
                 layout: str = "yolov8") -> None:
        if layout not in ("yolov8", "yolov5"):
            raise ValueError(f"layout must be yolov8 or yolov5 (end2end: CudaEnd2End), got {layout!r}")
        self.layout = layout
        if not 1 <= num_anchors <= MAX_ANCHORS:
            raise ValueError(f"num_anchors must be in 1..{MAX_ANCHORS}, got {num_anchors}")
        if batch_capacity < 1 or num_classes < 1 or max_detections < 1:
            raise ValueError(
                "batch_capacity, num_classes and max_detections must be >= 1, got "
                f"{batch_capacity}, {num_classes}, {max_detections}"
            )
        self.batch_capacity, self.num_anchors = batch_capacity, num_anchors
        self.num_classes = num_classes
        self.conf_threshold, self.iou_threshold = conf_threshold, iou_threshold
        self.class_agnostic, self.max_detections = class_agnostic, max_detections
        bc, a = batch_capacity, num_anchors
        self._cand_count = cuda.to_device(np.zeros(bc, np.int32))  # kept at zero between calls
        self._cand_anchor = cuda.device_array((bc, a), np.int32)
        self._cand_score = cuda.device_array((bc, a), np.float32)
        self._cand_class = cuda.device_array((bc, a), np.int32)
        self._cand_box = cuda.device_array((bc, a, 4), np.float32)
        self._sorted_score = cuda.device_array((bc, a), np.float32)
        self._sorted_class = cuda.device_array((bc, a), np.int32)
        self._sorted_box = cuda.device_array((bc, a, 4), np.float32)
        self._mask = cuda.device_array((bc, a, math.ceil(a / TILE)), np.uint64)
        self._out_box = cuda.device_array((bc, max_detections, 4), np.float32)
        self._out_score = cuda.device_array((bc, max_detections), np.float32)
        self._out_class = cuda.device_array((bc, max_detections), np.int32)
        self._out_count = cuda.to_device(np.zeros(bc, np.int32))

    def run(self, predictions: Any, stream: Any = 0, out: tuple[Any, Any, Any, Any] | None = None,
            letterbox: Any = None) -> tuple[Any, Any, Any, Any]:
        """Decode and NMS a batch; everything stays on the device, nothing synchronises.

        Four kernels on ``stream`` (see the module doc); the last one writes the results, into
        ``out`` when given, undoing the letterbox on the way when ``letterbox`` is given.

        Args:
            predictions: (B, 4 + K, A) (yolov8) or (B, A, 5 + K) (yolov5) float32 or float16
                device array (any object with ``__cuda_array_interface__``, e.g. a CuPy
                array, read in place), B <= batch_capacity, valid on ``stream``.
            stream: numba stream to run on (``stream_from_cupy`` wraps a CuPy one), or 0.
            out: None (results go to this instance's buffers), or ``(boxes, scores, class_ids,
                counts)`` device arrays with ``__cuda_array_interface__`` (CuPy arrays or views,
                numba device arrays), valid on ``stream``: (B', max_detections, 4) float32,
                (B', max_detections) float32, (B', max_detections) int32, (B',) int32 with
                B' >= B. They may be views of one allocation (they must not overlap); only
                rows ``[b, :counts[b]]`` of images b < B and ``counts[:B]`` are written, the
                rest of the arrays is left untouched.
            letterbox: None (boxes in model-input pixels), or a (B', 6) float32 device array
                with ``__cuda_array_interface__``, B' >= B, valid on ``stream``: per image
                scale_x, scale_y, pad_left, pad_top, src_width, src_height (the
                ``kernels.preprocess.Letterbox`` numbers rounded to float32; ``letterbox_rows``
                makes them). Then the boxes are in source-frame pixels, bit-equal to
                ``Letterbox.unmap_boxes`` of the model-input boxes on the host.

        Returns:
            ``(boxes, scores, class_ids, counts)`` valid on ``stream``: ``out`` itself when
            given; otherwise views of this instance's numba buffers, (B, max_detections, 4)
            float32, (B, max_detections) float32, (B, max_detections) int32, (B,) int32,
            overwritten by the next call. Image b's detections are the first ``counts[b]``
            rows, best score first; later rows are stale (whatever was there before).
        """
        anchor_rows = self.layout == "yolov5"
        rows = (self.num_anchors, 5 + self.num_classes) if anchor_rows else \
            (4 + self.num_classes, self.num_anchors)
        preds = _check_predictions(predictions, self.batch_capacity, rows)
        batch = preds.shape[0]
        if out is None:
            targets = (self._out_box, self._out_score, self._out_class, self._out_count)
        else:
            targets = _check_out(out, batch, self.max_detections)
        lb = _check_letterbox(letterbox, batch)
        launch_filter(preds, self.conf_threshold, self._cand_count, self._cand_anchor,
                      self._cand_score, self._cand_class, self._cand_box, stream, anchor_rows)
        launch_rank(batch, self._cand_count, self._cand_anchor, self._cand_score,
                    self._cand_class, self._cand_box, self._sorted_score, self._sorted_class,
                    self._sorted_box, stream)
        launch_mask(batch, self._cand_count, self._sorted_class, self._sorted_box,
                    self.iou_threshold, self.class_agnostic, self._mask, stream)
        launch_reduce(batch, self._cand_count, self._sorted_score, self._sorted_class,
                      self._sorted_box, self._mask, self.max_detections, *targets, stream,
                      letterbox=lb)
        if out is not None:
            return out
        return (self._out_box[:batch], self._out_score[:batch], self._out_class[:batch],
                self._out_count[:batch])

    def warmup(self, predictions: Any = None, out: tuple[Any, Any, Any, Any] | None = None,
               letterbox: Any = None, stream: Any = 0, dtype: Any = np.float32) -> None:
        """Compile the kernels now, not on the first batch, by running them once; synchronises.

        Numba compiles per argument types (dtype, dimensions, layout of every array): pass the
        very arrays the pipeline will pass to ``run`` (e.g. the model's CuPy output binding and
        the CuPy ``out`` / ``letterbox`` views), and the first real call compiles nothing.
        Their contents are read and ``out`` is written like in ``run`` (any values are safe).
        The batch size is not part of the types, but the layout can follow it: ``[:n]`` views
        of C-contiguous arrays are typed C for every n, while a non-contiguous view is typed
        A for n > 1 and C for n = 1 (numba ignores the strides of size-1 dimensions), so
        such a view would compile twice. Keep every array C-contiguous.

        Args:
            predictions: an example of ``run``'s ``predictions``, of its real type, dtype and
                layout (its values are used as they are). Or None, or a dtype (the old
                ``warmup(dtype)`` form): one image of zeros of that dtype in a numba device
                array is used instead.
            out, letterbox, stream: as in ``run``; the stream is synchronised at the end.
            dtype: the dtype of the zero image when ``predictions`` is None.
        """
        if predictions is None or isinstance(predictions, (type, np.dtype, str)):
            shape = (1, self.num_anchors, 5 + self.num_classes) if self.layout == "yolov5" \
                else (1, 4 + self.num_classes, self.num_anchors)
            zeros = np.zeros(shape, np.dtype(dtype if predictions is None else predictions))
            predictions = cuda.to_device(zeros)
        self.run(predictions, stream, out=out, letterbox=letterbox)
        _synchronize(stream)


class CudaEnd2End:
    """The GPU postprocess of an end-to-end model's output (NMS inside the model): threshold,
    best first, cap, letterbox undo; the same results as ``kernels.nms.end2end_reference``
    followed by ``unmap_boxes`` (bit-equal boxes and scores).

    Args:
        batch_capacity: most images per call.
        num_rows: N, detection rows per image of the model output (300 for YOLOv10/YOLO26).
        conf_threshold: minimum score, exclusive.
        max_detections: most detections kept per image.
    """

    def __init__(self, batch_capacity: int, num_rows: int, conf_threshold: float = 0.25,
                 max_detections: int = 300) -> None:
        if batch_capacity < 1 or num_rows < 1 or max_detections < 1:
            raise ValueError("batch_capacity, num_rows and max_detections must be >= 1, got "
                             f"{batch_capacity}, {num_rows}, {max_detections}")
        self.batch_capacity, self.num_rows = batch_capacity, num_rows
        self.conf_threshold, self.max_detections = conf_threshold, max_detections

    def run(self, predictions: Any, stream: Any = 0, out: tuple[Any, Any, Any, Any] | None = None,
            letterbox: Any = None) -> tuple[Any, Any, Any, Any]:
        """Keep each image's rows above the threshold; one kernel on ``stream``, no sync.

        Args:
            predictions: (B, N, 6) float32 or float16 device array (x1, y1, x2, y2 in
                model-input pixels, score, class), read in place, valid on ``stream``.
            stream, letterbox: as in ``CudaNms.run``.
            out: as in ``CudaNms.run``, or None: new numba device arrays are allocated.

        Returns:
            ``(boxes, scores, class_ids, counts)`` as in ``CudaNms.run``.
        """
        preds = _check_predictions(predictions, self.batch_capacity, (self.num_rows, 6))
        batch = preds.shape[0]
        if out is None:
            d = self.max_detections
            out = (cuda.device_array((batch, d, 4), np.float32),
                   cuda.device_array((batch, d), np.float32),
                   cuda.device_array((batch, d), np.int32), cuda.device_array(batch, np.int32))
        targets = _check_out(out, batch, self.max_detections)
        lb = _check_letterbox(letterbox, batch)
        end2end_kernel[batch, _THREADS, stream](preds, np.float32(self.conf_threshold),
                                                self.max_detections, *targets,
                                                targets[1] if lb is None else lb, lb is not None)
        return out

    def warmup(self, predictions: Any, out: tuple[Any, Any, Any, Any] | None = None,
               letterbox: Any = None, stream: Any = 0) -> None:
        """Compile the kernel for the very arrays ``run`` will get (see ``CudaNms.warmup``)."""
        self.run(predictions, stream, out=out, letterbox=letterbox)
        _synchronize(stream)


def _synchronize(stream: Any) -> None:
    if stream:
        stream.synchronize()
    else:
        cuda.synchronize()


def _device(array: Any) -> Any:
    """A numba view of a ``__cuda_array_interface__`` array (no copy, no sync)."""
    return array if SIMULATOR else cuda.as_cuda_array(array, sync=False)


def _check_predictions(predictions: Any, batch_capacity: int, rows: tuple[int, int]) -> Any:
    """``predictions`` as a numba view after checking it is (1..capacity, *rows) float32/16."""
    preds = _device(predictions)
    if preds.ndim != 3 or tuple(preds.shape[1:]) != rows or not (
            1 <= preds.shape[0] <= batch_capacity):
        raise ValueError(f"predictions must have shape (1..{batch_capacity}, {rows[0]}, "
                         f"{rows[1]}), got {tuple(preds.shape)}")
    if preds.dtype not in (np.float32, np.float16):
        raise ValueError(f"predictions must be float32 or float16, got {preds.dtype}")
    return preds


def _check_letterbox(letterbox: Any, batch: int) -> Any:
    """None, or ``letterbox`` as a numba view after checking it is (>= batch, 6) float32."""
    if letterbox is None:
        return None
    lb = _device(letterbox)
    if lb.ndim != 2 or lb.shape[1] != 6 or lb.shape[0] < batch or lb.dtype != np.float32:
        raise ValueError(f"letterbox must be ({batch}.., 6) float32, got {tuple(lb.shape)} "
                         f"{lb.dtype}")
    return lb


def _check_out(out: tuple[Any, Any, Any, Any], batch: int, max_detections: int) -> tuple[Any, ...]:
    """``out`` as numba views, after checking the shapes and dtypes ``CudaNms.run`` documents."""
    if len(out) != 4:
        raise ValueError(f"out must be (boxes, scores, class_ids, counts), got {len(out)} arrays")
    views = tuple(_device(a) for a in out)
    d = max_detections
    wanted = (((d, 4), np.float32), ((d,), np.float32), ((d,), np.int32), ((), np.int32))
    for name, view, (tail, dtype) in zip(("boxes", "scores", "class_ids", "counts"), views,
                                         wanted):
        shape = tuple(view.shape)
        if shape[1:] != tail or shape[0] < batch or view.dtype != dtype:
            wanted_shape = ", ".join([f"{batch}.."] + [str(v) for v in tail])
            raise ValueError(f"out {name} must be ({wanted_shape}) {np.dtype(dtype).name}, "
                             f"got {shape} {view.dtype}")
    return views


def letterbox_rows(letterboxes: Any) -> np.ndarray:
    """The ``letterbox`` rows of ``CudaNms.run`` for some ``kernels.preprocess.Letterbox``es.

    Returns:
        (n, 6) float32 host array: scale_x, scale_y, pad_left, pad_top, src_width,
        src_height, each rounded to float32 as NumPy 2 rounds them in ``unmap_boxes``.
    """
    return np.array([(lb.scale_x, lb.scale_y, lb.pad_left, lb.pad_top, lb.src_width,
                      lb.src_height) for lb in letterboxes], np.float32).reshape(-1, 6)


def split_detections(boxes: np.ndarray, scores: np.ndarray, class_ids: np.ndarray,
                     counts: np.ndarray, batch: int | None = None
                     ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per-image copies of the kept rows of ``CudaNms.run``'s results, once on the host.

    Args:
        boxes, scores, class_ids, counts: host arrays (e.g. the pinned mirror that one D2H of
            the ``out`` allocation filled): (B', D, 4) float32, (B', D) float32, (B', D)
            int32, (B',) int32.
        batch: images to take (default B').

    Returns:
        Per image ``(xyxy (M, 4) float32, scores (M,) float32, class_ids (M,) int32)``, host
        copies (the buffers may be reused), like ``kernels.nms.postprocess_reference``.
    """
    n = len(counts) if batch is None else batch
    return [(boxes[b, :m].copy(), scores[b, :m].copy(), class_ids[b, :m].copy())
            for b, m in enumerate(np.asarray(counts[:n]).tolist())]


def to_host(xyxy: Any, scores: Any, class_ids: Any, counts: Any,
            stream: Any = 0) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Copy ``CudaNms.run``'s kept detections to the host: the counts, then only the kept rows.

    A convenience for tests and benchmarks (1 + 3 per image small copies and two
    synchronisations); the pipeline copies a whole ``out`` allocation back in one copy instead.

    Args:
        xyxy, scores, class_ids, counts: ``CudaNms.run``'s numba device outputs (``out=None``),
            valid on ``stream``.
        stream: the numba stream (or 0) they are valid on; synchronised here.

    Returns:
        Per image ``(xyxy (M, 4) float32, scores (M,) float32, class_ids (M,) int32)``, host,
        like ``kernels.nms.postprocess_reference``.
    """
    host_counts = counts.copy_to_host(stream=stream)
    if stream:
        stream.synchronize()
    results = []
    for b, m in enumerate(host_counts.tolist()):
        arrays = (xyxy[b, :m], scores[b, :m], class_ids[b, :m]) if m else ()
        results.append(tuple(a.copy_to_host(stream=stream) for a in arrays) or _empty())
    if stream:
        stream.synchronize()
    return results


def _empty() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return np.empty((0, 4), np.float32), np.empty(0, np.float32), np.empty(0, np.int32)


__all__ = ["CudaEnd2End", "CudaNms", "end2end_kernel", "launch_filter", "launch_mask",
           "launch_rank", "launch_reduce", "letterbox_rows", "split_detections",
           "stream_from_cupy", "to_host"]
