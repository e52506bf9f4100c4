"""The Numba CUDA decode + NMS against the NumPy reference and torchvision.

Small batches run everywhere: on a GPU, or under Numba's CUDA simulator (tests/kernels/
conftest.py turns it on where there is no GPU). The @pytest.mark.gpu tests need a real GPU,
CuPy, and torch + torchvision with CUDA: more than a thousand images, up to 8400 candidates.

``out`` and ``letterbox``: results are written into views of ONE device allocation filled
with 0xFF bytes first (NaN floats, -1 ints), which is copied back in one copy; the rows past
each image's count and the images past the batch must still hold 0xFF (``run`` documents
them as untouched). Boxes with a letterbox are compared bit for bit with
``Letterbox.unmap_boxes`` of the plain run's boxes.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from kernels.nms import (
    decode_predictions,
    end2end_reference,
    postprocess_reference,
    yolov5_to_anchor_columns,
)
from kernels.nms_cuda import (
    SIMULATOR,
    CudaEnd2End,
    CudaNms,
    letterbox_rows,
    reduce_kernel,
    split_detections,
    stream_from_cupy,
    to_host,
)
from kernels.preprocess import letterbox_geometry
from tests.kernels.test_nms import CASES

pytestmark = pytest.mark.skipif(not cuda.is_available(), reason="no CUDA GPU and no simulator")


def random_predictions(rng: np.random.Generator, batch: int, num_classes: int, anchors: int,
                       on_grid: bool = True, ties: bool = True) -> np.ndarray:
    """(batch, 4 + K, anchors) float32 raw outputs in a 640 x 640 input, made to be hard.

    Each anchor scores one random class (and, half the time, a second class with an equal or
    lower score); boxes are on a half-pixel grid when ``on_grid`` (then every implementation
    computes the same IoUs exactly, torchvision's class-offset trick included), 3% have zero
    width or height, 10% duplicate another anchor's box, scores and classes.
    """
    p = np.zeros((batch, 4 + num_classes, anchors), np.float32)
    centre = rng.uniform(0, 640, (batch, 2, anchors))
    size = rng.uniform(1, 160, (batch, 2, anchors)) * (rng.random((batch, 2, anchors)) > 0.03)
    if on_grid:
        centre, size = np.round(centre * 2) / 2, np.round(size)
    p[:, :2], p[:, 2:4] = centre, size
    score = rng.integers(1, 16, (batch, anchors)) / 16 if ties else rng.random((batch, anchors))
    b, a = np.indices((batch, anchors))
    p[b, 4 + rng.integers(0, num_classes, (batch, anchors)), a] = score
    second = rng.random((batch, anchors)) < 0.5
    p[b[second], 4 + rng.integers(0, num_classes, second.sum()), a[second]] = (
        score[second] * rng.choice([1.0, 0.5], second.sum()))
    dup = rng.random(anchors) < 0.1
    p[:, :, dup] = p[:, :, rng.integers(0, anchors, dup.sum())]
    return p


def assert_same(results, expected) -> None:
    """Per image: the same boxes, scores and classes in the same order."""
    assert len(results) == len(expected)
    for image, (got, want) in enumerate(zip(results, expected)):
        for name, g, w in zip(("xyxy", "scores", "class_ids"), got, want):
            assert g.dtype == w.dtype and g.shape == w.shape, (image, name, g.shape, w.shape)
            np.testing.assert_array_equal(g, w, err_msg=f"image {image}: {name}")


def run_on_device(nms: CudaNms, predictions: np.ndarray):
    return to_host(*nms.run(cuda.to_device(predictions)))


# (seed, batch, classes, anchors, conf, iou, class_agnostic, max_detections, dtype)
SMALL_CASES = {
    "80 classes, ties": (0, 2, 80, 300, 0.3, 0.45, False, 300, np.float32),
    "1 class, cap hit": (1, 2, 1, 200, 0.2, 0.5, False, 10, np.float32),
    "class-agnostic": (2, 1, 3, 130, 0.0, 0.3, True, 300, np.float32),
    "float16": (3, 2, 3, 150, 0.25, 0.6, False, 50, np.float16),
    "off the grid": (4, 1, 2, 200, 0.5, 0.45, False, 300, np.float32),
}


@pytest.mark.parametrize("case", SMALL_CASES.values(), ids=SMALL_CASES.keys())
def test_matches_reference_small(case) -> None:
    seed, batch, classes, anchors, conf, iou, agnostic, max_det, dtype = case
    rng = np.random.default_rng(seed)
    p = random_predictions(rng, batch, classes, anchors, on_grid=seed != 4, ties=seed != 4)
    p = p.astype(dtype)
    nms = CudaNms(batch, anchors, classes, conf, iou, agnostic, max_det)
    results = run_on_device(nms, p)
    assert_same(results, postprocess_reference(p, conf, iou, agnostic, max_det))
    assert any(len(r[0]) for r in results)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_hand_made_nms_cases(case) -> None:
    """test_nms.py's hand-made NMS table, each box an anchor scoring its class only."""
    boxes, scores, classes, iou, agnostic, max_det, keep = case
    boxes = np.array(boxes, np.float32).reshape(-1, 4)
    num_classes, anchors = max(classes, default=0) + 1, max(len(scores), 1)
    p = np.zeros((1, 4 + num_classes, anchors), np.float32)
    p[0, :2, : len(boxes)] = ((boxes[:, :2] + boxes[:, 2:]) / 2).T
    p[0, 2:4, : len(boxes)] = (boxes[:, 2:] - boxes[:, :2]).T
    p[0, 4 + np.array(classes, int), np.arange(len(scores))] = scores
    nms = CudaNms(1, anchors, num_classes, 0.0, iou, agnostic, max_det)
    expected = (boxes[keep], np.array(scores, np.float32)[keep], np.array(classes, np.int32)[keep])
    assert_same(run_on_device(nms, p), [expected])


def test_buffers_reused_across_calls_and_batch_sizes() -> None:
    """A second call (fewer images, no candidates in one) starts from clean counters."""
    rng = np.random.default_rng(5)
    nms = CudaNms(2, 100, 4, 0.25, 0.5, False, 20)
    first = random_predictions(rng, 2, 4, 100)
    second = random_predictions(rng, 1, 4, 100)
    empty = np.zeros((1, 8, 100), np.float32)
    for p in (first, second, empty, first):
        assert_same(run_on_device(nms, p), postprocess_reference(p, 0.25, 0.5, False, 20))
    assert [len(r[0]) for r in run_on_device(nms, empty)] == [0]


@pytest.mark.parametrize("shape,dtype,match", [
    ((3, 8, 100), np.float32, "must have shape"),  # more images than the capacity
    ((1, 9, 100), np.float32, "must have shape"),
    ((1, 8, 101), np.float32, "must have shape"),
    ((1, 8, 100), np.float64, "float32 or float16"),
])
def test_run_rejects_bad_input(shape, dtype, match) -> None:
    nms = CudaNms(2, 100, 4)
    with pytest.raises(ValueError, match=match):
        nms.run(cuda.to_device(np.zeros(shape, dtype)))


def test_constructor_rejects_too_many_anchors() -> None:
    with pytest.raises(ValueError, match="num_anchors"):
        CudaNms(1, 40000, 80)


# --- real GPU: CuPy inputs and streams, torchvision as the judge ----------------------------


def gpu_modules():
    """(cupy, torch, torchvision.ops), or skip with the reason."""
    if SIMULATOR:
        pytest.skip("needs a real GPU, not the CUDA simulator")
    cupy = pytest.importorskip("cupy")
    torch = pytest.importorskip("torch")
    ops = pytest.importorskip("torchvision.ops")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    return cupy, torch, ops


def torchvision_keep(torch, ops, predictions: np.ndarray, conf: float, iou: float,
                     agnostic: bool):
    """torchvision's batched_nms (on the GPU) of the reference decode, per image, ordered
    by (score descending, candidate index ascending) so that it compares row for row."""
    results = []
    for image in predictions:
        xyxy, scores, class_ids = decode_predictions(image, conf)
        classes = np.zeros_like(class_ids) if agnostic else class_ids
        keep = ops.batched_nms(*(torch.from_numpy(a).cuda() for a in (xyxy, scores, classes)),
                               iou).cpu().numpy()
        keep = keep[np.lexsort((keep, -scores[keep]))]
        results.append((xyxy[keep], scores[keep], class_ids[keep]))
    return results


# (classes, anchors, conf, iou, class_agnostic, on_grid, ties): 1200 images in all
GPU_CONFIGS = [
    (80, 8400, 0.0, 0.45, False, True, True),  # every anchor is a candidate
    (80, 8400, 0.5, 0.5, False, True, True),
    (1, 8400, 0.0, 0.5, False, True, True),
    (1, 8400, 0.6, 0.7, False, True, False),
    (80, 8400, 0.3, 0.45, True, True, True),
    (80, 2535, 0.25, 0.45, False, True, False),
    (3, 1000, 0.0, 0.3, False, True, True),
    (80, 300, 0.1, 0.5, False, True, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("config", GPU_CONFIGS)
def test_matches_torchvision_and_reference_gpu(config) -> None:
    """150 images per config: uncapped keep sets equal torchvision's, capped results (300)
    equal the NumPy reference's, with predictions read zero-copy from CuPy on a CuPy stream."""
    cupy, torch, ops = gpu_modules()
    classes, anchors, conf, iou, agnostic, on_grid, ties = config
    batch = 10
    uncapped = CudaNms(batch, anchors, classes, conf, iou, agnostic, max_detections=anchors)
    capped = CudaNms(batch, anchors, classes, conf, iou, agnostic, max_detections=300)
    rng = np.random.default_rng(anchors + classes)
    cupy_stream = cupy.cuda.Stream(non_blocking=True)
    stream = stream_from_cupy(cupy_stream)
    for _ in range(15):
        p = random_predictions(rng, batch, classes, anchors, on_grid, ties)
        with cupy_stream:
            p_device = cupy.asarray(p)
        assert_same(to_host(*uncapped.run(p_device, stream), stream=stream),
                    torchvision_keep(torch, ops, p, conf, iou, agnostic))
        assert_same(to_host(*capped.run(p_device, stream), stream=stream),
                    postprocess_reference(p, conf, iou, agnostic, 300))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_off_grid_matches_reference_gpu(dtype) -> None:
    """Arbitrary float32 boxes: the device arithmetic is bit-equal to NumPy's, FMA-free."""
    cupy, _, _ = gpu_modules()
    nms = CudaNms(8, 8400, 80, 0.2, 0.45, False, 300)
    nms.warmup(dtype)
    rng = np.random.default_rng(7)
    for _ in range(10):
        p = random_predictions(rng, 8, 80, 8400, on_grid=False, ties=False).astype(dtype)
        results = to_host(*nms.run(cupy.asarray(p)))
        assert_same(results, postprocess_reference(p, 0.2, 0.45, False, 300))


# --- out= (one allocation, one copy back) and letterbox= (boxes in frame pixels) ------------

_SENTINEL = 0xFF  # every byte of the out allocation before a run: NaN floats, -1 ints


def carve(buffer, capacity: int, max_det: int):
    """(boxes, scores, class_ids, counts) views of a 1-D uint8 array (device or host), laid
    out counts, boxes, scores, class_ids, as the pipeline's detections mirror is."""
    views, offset = [], 0
    for shape, dtype in (((capacity,), np.int32), ((capacity, max_det, 4), np.float32),
                         ((capacity, max_det), np.float32), ((capacity, max_det), np.int32)):
        nbytes = int(np.prod(shape)) * 4
        views.append(buffer[offset:offset + nbytes].view(dtype).reshape(shape))
        offset += nbytes
    counts, boxes, scores, class_ids = views
    return boxes, scores, class_ids, counts


def out_allocation(capacity: int, max_det: int):
    """A device uint8 allocation full of 0xFF and the four ``out`` views carved from it."""
    nbytes = 4 * capacity * (1 + max_det * 6)
    buffer = cuda.to_device(np.full(nbytes, _SENTINEL, np.uint8))
    return buffer, carve(buffer, capacity, max_det)


def read_back(buffer, capacity: int, max_det: int, batch: int):
    """One copy of the whole allocation; per-image results; asserts the untouched rows."""
    host = buffer.copy_to_host()
    boxes, scores, class_ids, counts = carve(host, capacity, max_det)
    for b in range(capacity):
        first = int(counts[b]) if b < batch else 0
        if b >= batch:
            assert counts[b] == -1, f"image {b} is past the batch: its count was written"
        for name, array in (("boxes", boxes), ("scores", scores), ("class_ids", class_ids)):
            rest = array[b, first:].view(np.uint8)
            assert (rest == _SENTINEL).all(), f"image {b}: {name} rows past {first} written"
    return split_detections(boxes, scores, class_ids, counts, batch)


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


# (seed, batch, capacity, classes, anchors, conf, iou, max_det, dtype)
OUT_CASES = {
    "batch fills the capacity": (10, 2, 2, 3, 96, 0.25, 0.45, 300, np.float32),
    "capacity above the batch": (11, 1, 3, 2, 80, 0.3, 0.5, 20, np.float32),
    "cap hit, float16": (12, 2, 3, 3, 96, 0.0, 0.5, 4, np.float16),
}


@pytest.mark.parametrize("case", OUT_CASES.values(), ids=OUT_CASES.keys())
def test_out_views_of_one_allocation_equal_plain_run(case) -> None:
    seed, batch, capacity, classes, anchors, conf, iou, max_det, dtype = case
    p = random_predictions(np.random.default_rng(seed), batch, classes, anchors).astype(dtype)
    nms = CudaNms(capacity, anchors, classes, conf, iou, False, max_det)
    plain = run_on_device(nms, p)
    buffer, out = out_allocation(capacity, max_det)
    assert nms.run(cuda.to_device(p), out=out) is out
    assert_same(read_back(buffer, capacity, max_det, batch), plain)
    assert_same(plain, postprocess_reference(p, conf, iou, False, max_det))


# name: (per-image source (width, height), model input (width, height), max_det, conf,
#        images given no candidates, boxes placed at -0.0)
LETTERBOX_CASES = {
    "wide 1920x1080": ([(1920, 1080)], (640, 640), 300, 0.2, (), False),
    "tall 1080x1920": ([(1080, 1920)], (640, 640), 300, 0.2, (), False),
    "odd 641x479": ([(641, 479)], (640, 640), 300, 0.2, (), False),
    "odd rounded to even 640x478": ([(640, 478)], (640, 640), 300, 0.2, (), False),
    "1x scale, no pad, -0.0 corner": ([(640, 640)], (640, 640), 300, 0.2, (), True),
    "upscale 320x240": ([(320, 240)], (640, 640), 300, 0.2, (), False),
    "non-square input 1280x720 -> 640x384": ([(1280, 720)], (640, 384), 300, 0.2, (), False),
    "mixed batch": ([(1920, 1080), (1080, 1920), (641, 479)], (640, 640), 300, 0.2, (), False),
    "count 0 beside max": ([(1280, 720), (352, 288)], (640, 640), 5, 0.0, (1,), False),
    "every count 0": ([(1920, 1080), (640, 478)], (640, 640), 300, 0.2, (0, 1), False),
}


@pytest.mark.parametrize("case", LETTERBOX_CASES.values(), ids=LETTERBOX_CASES.keys())
def test_letterbox_undone_on_device_bit_equal_to_unmap_boxes(case) -> None:
    sources, (dst_w, dst_h), max_det, conf, empty, negative_zero = case
    batch, classes, anchors, capacity = len(sources), 3, 64, len(sources) + 1
    rng = np.random.default_rng(len(sources) * 1000 + dst_h + max_det)
    p = random_predictions(rng, batch, classes, anchors, on_grid=False, ties=False)
    p[:, [0, 2]] *= dst_w / 640  # random_predictions draws boxes in a 640 x 640 input,
    p[:, [1, 3]] *= dst_h / 640  # reaching past its borders (clipped after the unmap)
    if negative_zero:  # x1 = -0.0 - 0 = -0.0: unmap_boxes keeps the sign through the clip
        p[0, :4, 0], p[0, 4:, 0], p[0, 4, 0] = (-0.0, -0.0, 0.0, 0.0), 0.0, 0.99
    p[list(empty)] = 0.0
    letterboxes = [letterbox_geometry(w, h, dst_w, dst_h) for w, h in sources]
    rows = np.zeros((capacity, 6), np.float32)
    rows[:batch] = letterbox_rows(letterboxes)

    nms = CudaNms(capacity, anchors, classes, conf, 0.45, False, max_det)
    plain = run_on_device(nms, p)
    buffer, out = out_allocation(capacity, max_det)
    nms.run(cuda.to_device(p), out=out, letterbox=cuda.to_device(rows))
    got = read_back(buffer, capacity, max_det, batch)

    counts = [len(r[1]) for r in got]
    assert [counts[b] for b in empty] == [0] * len(empty)
    if max_det < anchors:
        assert max(counts) == max_det, counts
    assert any(counts) or len(empty) == batch
    for b, (lb, (xyxy, scores, class_ids), (want_xyxy, want_scores, want_classes)) in enumerate(
            zip(letterboxes, got, plain, strict=True)):
        expected = lb.unmap_boxes(want_xyxy)
        assert np.array_equal(xyxy, expected), f"image {b}"
        np.testing.assert_array_equal(bits(xyxy), bits(expected), err_msg=f"image {b}")
        assert_same([(scores, class_ids)], [(want_scores, want_classes)])
        if len(xyxy):  # the unmap matters: boxes leave the model input's space
            assert (xyxy[:, 0::2] <= lb.src_width).all() and (xyxy[:, 1::2] <= lb.src_height).all()
    if negative_zero:
        assert np.signbit(got[0][0][:, 0]).any(), "the -0.0 box was not kept"


def test_letterbox_rows_round_like_numpy() -> None:
    lb = letterbox_geometry(641, 479, 640, 640)
    row = letterbox_rows([lb])
    assert row.shape == (1, 6) and row.dtype == np.float32
    assert row[0, 0] == np.float32(lb.scale_x) and row[0, 2] == lb.pad_left
    assert letterbox_rows([]).shape == (0, 6)


def test_warmup_forms_then_run_on_the_warmed_arrays() -> None:
    """warmup(dtype) (old form), warmup() and warmup(real arrays); then run on those arrays
    overwrites whatever warmup wrote."""
    rng = np.random.default_rng(20)
    nms = CudaNms(2, 64, 2, 0.25, 0.5, False, 10)
    nms.warmup(np.float16)
    nms.warmup(np.dtype(np.float32))
    nms.warmup()
    p = random_predictions(rng, 1, 2, 64)
    buffer, out = out_allocation(2, 10)
    letterbox = cuda.to_device(letterbox_rows([letterbox_geometry(1920, 1080, 640, 640)] * 2))
    nms.warmup(cuda.to_device(random_predictions(rng, 2, 2, 64)), out=out, letterbox=letterbox)
    nms.run(cuda.to_device(p), out=out)
    got = split_detections(*carve(buffer.copy_to_host(), 2, 10), batch=1)
    assert_same(got, postprocess_reference(p, 0.25, 0.5, False, 10))


def _out_arrays(capacity: int, max_det: int, change: str):
    arrays = [cuda.device_array((capacity, max_det, 4), np.float32),
              cuda.device_array((capacity, max_det), np.float32),
              cuda.device_array((capacity, max_det), np.int32),
              cuda.device_array((capacity,), np.int32)]
    if change == "boxes D":
        arrays[0] = cuda.device_array((capacity, max_det + 1, 4), np.float32)
    elif change == "scores dtype":
        arrays[1] = cuda.device_array((capacity, max_det), np.float64)
    elif change == "class_ids dtype":
        arrays[2] = cuda.device_array((capacity, max_det), np.int64)
    elif change == "counts too few":
        arrays[3] = cuda.device_array((1,), np.int32)
    elif change == "three arrays":
        arrays.pop()
    return tuple(arrays)


@pytest.mark.parametrize("change,letterbox_shape,letterbox_dtype,match", [
    ("boxes D", (2, 6), np.float32, "out boxes"),
    ("scores dtype", (2, 6), np.float32, "out scores"),
    ("class_ids dtype", (2, 6), np.float32, "out class_ids"),
    ("counts too few", (2, 6), np.float32, "out counts"),
    ("three arrays", (2, 6), np.float32, "boxes, scores, class_ids, counts"),
    ("", (1, 6), np.float32, "letterbox"),
    ("", (2, 4), np.float32, "letterbox"),
    ("", (2, 6), np.float64, "letterbox"),
])
def test_run_rejects_bad_out_and_letterbox(change, letterbox_shape, letterbox_dtype,
                                           match) -> None:
    nms = CudaNms(2, 100, 4, max_detections=7)
    p = cuda.to_device(np.zeros((2, 8, 100), np.float32))
    letterbox = cuda.to_device(np.ones(letterbox_shape, letterbox_dtype))
    with pytest.raises(ValueError, match=match):
        nms.run(p, out=_out_arrays(2, 7, change), letterbox=letterbox)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_cupy_out_and_letterbox_one_copy_no_recompile_gpu(dtype) -> None:
    """The pipeline's calls: CuPy model output, CuPy views of one allocation, a CuPy letterbox
    table, a CuPy stream; warmed up on them at one batch size, then run at others: no kernel
    compiles again, and one copy of the allocation gives the reference's detections with
    boxes bit-equal to ``unmap_boxes``."""
    cupy, _, _ = gpu_modules()
    from kernels.nms_cuda import filter_kernel, mask_kernel, rank_kernel

    capacity, anchors, classes, max_det = 8, 8400, 80, 300
    nms = CudaNms(capacity, anchors, classes, 0.2, 0.45, False, max_det)
    nbytes = 4 * capacity * (1 + max_det * 6)
    cupy_stream = cupy.cuda.Stream(non_blocking=True)
    stream = stream_from_cupy(cupy_stream)
    rng = np.random.default_rng(30)
    sources = [(1920, 1080), (1080, 1920), (641, 479), (640, 640), (1280, 720), (352, 288),
               (640, 478), (3840, 2160)]
    letterboxes = [letterbox_geometry(w, h, 640, 640) for w, h in sources]
    with cupy_stream:
        buffer = cupy.full(nbytes, _SENTINEL, cupy.uint8)
        out_full = carve(buffer, capacity, max_det)
        table = cupy.asarray(letterbox_rows(letterboxes))
        model_output = cupy.empty((capacity, 4 + classes, anchors), dtype)
    kernels = (filter_kernel, rank_kernel, mask_kernel, reduce_kernel)

    def views(n):
        return tuple(v[:n] for v in out_full), table[:n]

    out, letterbox = views(capacity)
    with cupy_stream:
        model_output[:] = 0
    nms.warmup(model_output, out=out, letterbox=letterbox, stream=stream)
    compiled = [len(k.overloads) for k in kernels]
    for n in (capacity, 3, 1):
        p = random_predictions(rng, n, classes, anchors, on_grid=False, ties=False).astype(dtype)
        with cupy_stream:
            buffer.fill(_SENTINEL)
            model_output[:n] = cupy.asarray(p)
        out, letterbox = views(n)
        nms.run(model_output[:n], stream, out=out, letterbox=letterbox)
        host = cupy.asnumpy(buffer, stream=cupy_stream)  # the one copy back
        cupy_stream.synchronize()
        assert [len(k.overloads) for k in kernels] == compiled, f"recompiled at batch {n}"
        got = split_detections(*carve(host, capacity, max_det), batch=n)
        want = postprocess_reference(p, 0.2, 0.45, False, max_det)
        want = [(lb.unmap_boxes(x), s, c) for lb, (x, s, c) in zip(letterboxes, want)]
        assert_same(got, want)
        for (xyxy, _, _), (want_xyxy, _, _) in zip(got, want):
            np.testing.assert_array_equal(bits(xyxy), bits(want_xyxy))


def yolov5_rows(p: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A (B, 4 + K, A) output as (B, A, 5 + K) rows: box, objectness, class probabilities
    whose products with the objectness are near (not always equal to) the original scores."""
    scores = p[:, 4:].transpose(0, 2, 1)
    objectness = np.maximum(scores.max(axis=2, keepdims=True), rng.uniform(0.5, 1.0, (1,)))
    rows = np.concatenate([p[:, :4].transpose(0, 2, 1), objectness, scores / objectness], axis=2)
    return np.ascontiguousarray(rows, np.float32)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_yolov5_rows_read_in_place_match_the_reference(dtype) -> None:
    """yolov5 (B, A, 5 + K): the same keep sets, bit for bit, as the CPU path (convert to
    anchor columns, then the reference NMS), also with the letterbox undone on the device."""
    rng = np.random.default_rng(30)
    batch, classes, anchors, max_det = 2, 5, 160, 40
    p = yolov5_rows(random_predictions(rng, batch, classes, anchors), rng).astype(dtype)
    nms = CudaNms(batch, anchors, classes, 0.2, 0.45, False, max_det, layout="yolov5")
    expected = postprocess_reference(yolov5_to_anchor_columns(p), 0.2, 0.45, False, max_det)
    results = run_on_device(nms, p)
    assert_same(results, expected)
    assert all(len(r[0]) for r in results)
    lb = letterbox_geometry(1920, 1080, 640, 640)
    buffer, out = out_allocation(batch, max_det)
    nms.run(cuda.to_device(p), out=out, letterbox=cuda.to_device(letterbox_rows([lb] * batch)))
    for got, want in zip(read_back(buffer, batch, max_det, batch), expected, strict=True):
        np.testing.assert_array_equal(bits(got[0]), bits(lb.unmap_boxes(want[0])))
        assert_same([got[1:]], [want[1:]])
    with pytest.raises(ValueError, match=r"must have shape \(1..2, 160, 10\)"):
        nms.run(cuda.to_device(np.zeros((1, 9, 160), np.float32)))


def end2end_rows(rng: np.random.Generator, batch: int, rows: int) -> np.ndarray:
    """(B, N, 6) end-to-end outputs made to be hard: tied scores, zero rows, a NaN score,
    class values to round (2.5 rounds to 2, 3.5 to 4), boxes past the input's borders."""
    p = np.zeros((batch, rows, 6), np.float32)
    live = rng.random((batch, rows)) < 0.7
    xy = rng.uniform(-20, 660, (batch, rows, 2))
    p[..., :2], p[..., 2:4] = xy, xy + rng.uniform(1, 120, (batch, rows, 2))
    p[..., 4] = np.where(live, rng.integers(1, 9, (batch, rows)) / 8, 0.0)
    p[..., 5] = rng.choice([0.0, 1.0, 2.5, 3.5, 7.0], (batch, rows))
    p[0, 3, 4] = np.nan
    return p


@pytest.mark.parametrize("dtype, max_det", [(np.float32, 300), (np.float16, 7)])
def test_end2end_matches_the_reference_and_unmaps(dtype, max_det) -> None:
    """end2end (B, N, 6): threshold, best first (ties in row order), cap, class rounded half
    to even, letterbox undone bit-equal to ``unmap_boxes``; untouched rows stay untouched."""
    rng = np.random.default_rng(31)
    batch, capacity, rows = 2, 3, 150
    p = end2end_rows(rng, batch, rows).astype(dtype)
    p[1] = 0  # an image with nothing above the threshold
    post = CudaEnd2End(capacity, rows, 0.25, max_det)
    letterboxes = [letterbox_geometry(1280, 720, 640, 640), letterbox_geometry(641, 479, 640, 640)]
    buffer, out = out_allocation(capacity, max_det)
    post.warmup(cuda.to_device(p), out=out, letterbox=cuda.to_device(letterbox_rows(letterboxes)))
    buffer, out = out_allocation(capacity, max_det)
    post.run(cuda.to_device(p), out=out, letterbox=cuda.to_device(letterbox_rows(letterboxes)))
    got = read_back(buffer, capacity, max_det, batch)
    expected = end2end_reference(p, 0.25, max_det)
    above = len(end2end_reference(p, 0.25, rows)[0][1])
    assert above > 7 and [len(r[1]) for r in got] == [min(max_det, above), 0]
    for lb, (xyxy, scores, class_ids), (want_xyxy, want_scores, want_classes) in zip(
            letterboxes, got, expected, strict=True):
        np.testing.assert_array_equal(bits(xyxy), bits(lb.unmap_boxes(want_xyxy)))
        np.testing.assert_array_equal(scores, want_scores)
        np.testing.assert_array_equal(class_ids, want_classes)
    plain = to_host(*post.run(cuda.to_device(p)))
    assert_same(plain, expected)
