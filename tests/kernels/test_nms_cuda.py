"""The Numba CUDA decode + NMS against the NumPy reference and torchvision.

Small batches run everywhere: on a GPU, or under Numba's CUDA simulator (tests/kernels/
conftest.py turns it on where there is no GPU). The @pytest.mark.gpu tests need a real GPU,
CuPy, and torch + torchvision with CUDA: more than a thousand images, up to 8400 candidates.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from kernels.nms import decode_predictions, postprocess_reference
from kernels.nms_cuda import SIMULATOR, CudaNms, stream_from_cupy, to_host
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
