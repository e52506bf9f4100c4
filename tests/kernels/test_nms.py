"""The NumPy decode and greedy NMS: hand-made cases, then random ones against a plain greedy NMS."""

from __future__ import annotations

import numpy as np
import pytest

from kernels.nms import decode_predictions, nms, postprocess_reference

UNIT = [0, 0, 10, 10]  # a 10 x 10 box at the origin


def far(k: int) -> list[int]:
    """A 10 x 10 box that overlaps no other box made by this function or ``UNIT``."""
    return [20 * k + 20, 0, 20 * k + 30, 10]


CASES = {
    # name: (boxes, scores, classes, iou_threshold, class_agnostic, max_detections, keep)
    "empty": ([], [], [], 0.5, False, 300, []),
    "one box": ([UNIT], [0.3], [0], 0.5, False, 300, [0]),
    "order by score": ([far(0), far(1), far(2)], [0.2, 0.9, 0.5], [0, 0, 0], 0.5, False, 300,
                       [1, 2, 0]),
    "equal scores: lower index first": ([far(0), far(1), far(2)], [0.5, 0.9, 0.5], [0, 0, 0],
                                        0.5, False, 300, [1, 0, 2]),
    "identical boxes": ([UNIT, UNIT], [0.8, 0.9], [0, 0], 0.5, False, 300, [1]),
    "identical boxes, equal scores": ([UNIT, UNIT, UNIT], [0.7, 0.7, 0.7], [0, 0, 0], 0.5,
                                      False, 300, [0]),
    "identical boxes, other class": ([UNIT, UNIT, UNIT], [0.9, 0.8, 0.7], [0, 1, 0], 0.5,
                                     False, 300, [0, 1]),
    "class-agnostic": ([UNIT, UNIT, UNIT], [0.9, 0.8, 0.7], [0, 1, 0], 0.5, True, 300, [0]),
    "zero-area duplicates": ([[5, 5, 5, 5], [5, 5, 5, 5], [0, 3, 10, 3]], [0.9, 0.9, 0.8],
                             [0, 0, 0], 0.1, False, 300, [0, 1, 2]),
    "zero-area box inside a box": ([UNIT, [2, 2, 2, 8]], [0.9, 0.8], [0, 0], 0.0, False, 300,
                                   [0, 1]),
    # [0,0,10,10] and [0,0,10,5]: intersection 50, union 100, IoU exactly 0.5.
    "IoU equal to the threshold keeps": ([UNIT, [0, 0, 10, 5]], [0.9, 0.8], [0, 0], 0.5, False,
                                         300, [0, 1]),
    # IoU 3/5 rounds to float32(0.6) > 0.6: thresholds compare in float32, as on the GPU.
    "IoU equal to the float32 threshold keeps": ([[0, 0, 5, 1], [0, 0, 3, 1]], [0.9, 0.8], [0, 0],
                                                 0.6, False, 300, [0, 1]),
    "IoU just above the threshold drops": ([UNIT, [0, 0, 10, 5]], [0.9, 0.8], [0, 0], 0.4999,
                                           False, 300, [0]),
    # A overlaps B (IoU 0.6), B overlaps C (0.6), A and C less (1/3): B goes, so C stays.
    "suppressed box suppresses nothing": ([[0, 0, 10, 10], [2.5, 0, 12.5, 10], [5, 0, 15, 10]],
                                          [0.9, 0.8, 0.7], [3, 3, 3], 0.5, False, 300, [0, 2]),
    "lower score never suppresses higher": ([UNIT, [1, 0, 11, 10]], [0.4, 0.6], [0, 0], 0.5,
                                            False, 300, [1]),
    "max_detections caps in keep order": ([far(k) for k in range(5)], [0.1, 0.5, 0.3, 0.9, 0.2],
                                          [0, 1, 2, 3, 4], 0.5, False, 3, [3, 1, 2]),
    "cap counts kept boxes only": ([UNIT, UNIT, far(0), far(1)], [0.9, 0.8, 0.7, 0.6],
                                   [0, 0, 0, 0], 0.5, False, 2, [0, 2]),
    "many classes, one suppression each": ([UNIT, UNIT, UNIT, UNIT], [0.9, 0.8, 0.7, 0.6],
                                           [0, 1, 1, 0], 0.5, False, 300, [0, 1]),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_nms_hand_made(case) -> None:
    boxes, scores, classes, iou, agnostic, max_det, expected = case
    keep = nms(np.array(boxes, np.float32).reshape(-1, 4), np.array(scores, np.float32),
               np.array(classes, np.int32), iou, agnostic, max_det)
    assert keep.dtype == np.int64
    assert keep.tolist() == expected


def iou_f32(a: np.ndarray, b: np.ndarray) -> np.float32:
    """IoU of two float32 boxes, one float32 rounding per operation; 0 for a zero union."""
    w = max(min(a[2], b[2]) - max(a[0], b[0]), np.float32(0))
    h = max(min(a[3], b[3]) - max(a[1], b[1]), np.float32(0))
    inter = w * h
    union = ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1])) - inter
    return inter / union if union > 0 else np.float32(0)


def brute_force_nms(boxes, scores, classes, iou_threshold, class_agnostic, max_detections):
    """Greedy NMS the slow, obvious way: visit by score, keep what no kept box overlaps."""
    keep: list[int] = []
    for i in sorted(range(len(scores)), key=lambda i: (-scores[i], i)):
        if len(keep) == max_detections:
            break
        if all((classes[k] != classes[i] and not class_agnostic)
               or not iou_f32(boxes[k], boxes[i]) > np.float32(iou_threshold) for k in keep):
            keep.append(i)
    return keep


def random_boxes(rng: np.random.Generator, n: int, num_classes: int, on_grid: bool):
    """n boxes in a 640 x 640 image with repeated scores, duplicate and zero-area boxes."""
    xy = rng.uniform(0, 600, (n, 2))
    wh = rng.uniform(0, 120, (n, 2)) * (rng.random((n, 1)) > 0.05)  # 5% zero-area
    boxes = np.concatenate([xy, xy + wh], axis=1)
    if on_grid:
        boxes = np.round(boxes)  # exact IoU ties at the threshold happen on a grid
    scores = rng.integers(1, 20, n) / 20 if rng.random() < 0.5 else rng.random(n)
    classes = rng.integers(0, num_classes, n)
    dup = rng.random(n) < 0.1  # duplicates of random boxes, some with their score too
    src = rng.integers(0, n, n)
    boxes[dup] = boxes[src[dup]]
    scores = np.where(dup & (rng.random(n) < 0.5), scores[src], scores)
    return boxes.astype(np.float32), scores.astype(np.float32), classes.astype(np.int32)


SIZES = [0, 1, 2, 5, 30, 100, 300] * 4 + [1000, 2000]


@pytest.mark.parametrize("seed,n", list(enumerate(SIZES)))
@pytest.mark.parametrize("num_classes", [1, 80])
def test_nms_matches_brute_force(seed: int, n: int, num_classes: int) -> None:
    rng = np.random.default_rng(seed)
    boxes, scores, classes = random_boxes(rng, n, num_classes, on_grid=seed % 2 == 0)
    iou = float(rng.choice([0.3, 0.45, 0.5, 0.7]))
    agnostic = bool(seed % 3 == 0)
    max_det = int(rng.choice([1, 10, 300, 5000]))
    expected = brute_force_nms(boxes, scores, classes, iou, agnostic, max_det)
    assert nms(boxes, scores, classes, iou, agnostic, max_det).tolist() == expected


@pytest.mark.parametrize("seed", range(20))
def test_nms_matches_torchvision_cpu(seed: int) -> None:
    """The keep set of ``torchvision.ops.batched_nms`` (CPU), on boxes where it is exact.

    torchvision's batched_nms shifts boxes by class offsets and compares in double; on a
    grid of whole pixels and at threshold 0.5 neither changes any IoU comparison.
    """
    torch = pytest.importorskip("torch")
    ops = pytest.importorskip("torchvision.ops")
    rng = np.random.default_rng(1000 + seed)
    n = int(rng.choice([10, 200, 1500]))
    boxes, scores, classes = random_boxes(rng, n, int(rng.choice([1, 3, 80])), on_grid=True)
    keep = ops.batched_nms(torch.from_numpy(boxes), torch.from_numpy(scores),
                           torch.from_numpy(classes), 0.5).numpy()
    assert sorted(nms(boxes, scores, classes, 0.5, max_detections=n).tolist()) == sorted(keep)


def hand_predictions(dtype=np.float32) -> np.ndarray:
    """(4 + 3, 5) predictions of five anchors, their expected decode written beside."""
    columns = [
        # cx, cy, w, h, class scores        expected
        [10, 20, 4, 6, 0.1, 0.75, 0.75],  # class 1 (first of a tie), box 8,17,12,23
        [50, 50, 10, 10, 0.5, 0.25, 0.125],  # 0.5 is not > 0.5: dropped
        [100, 200, 50, 20, 0.25, 0.375, 0.875],  # class 2, box 75,190,125,210
        [0, 0, 0, 0, 0, 0, 0],  # nothing
        [3, 5, 0, 1, 0.625, 0.0, 0.5],  # class 0, a zero-width box 3,4.5,3,5.5
    ]
    return np.array(columns, dtype=dtype).T


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_decode_predictions(dtype) -> None:
    xyxy, scores, class_ids = decode_predictions(hand_predictions(dtype), 0.5)
    assert (xyxy.dtype, scores.dtype, class_ids.dtype) == (np.float32, np.float32, np.int32)
    assert xyxy.tolist() == [[8, 17, 12, 23], [75, 190, 125, 210], [3, 4.5, 3, 5.5]]
    assert scores.tolist() == [0.75, 0.875, 0.625]
    assert class_ids.tolist() == [1, 2, 0]


def test_decode_predictions_nothing_above_threshold() -> None:
    xyxy, scores, class_ids = decode_predictions(hand_predictions(), 0.9)
    assert xyxy.shape == (0, 4) and scores.shape == (0,) and class_ids.shape == (0,)


def test_postprocess_reference_per_image() -> None:
    one = hand_predictions()
    two = one.copy()
    two[:4, 2] = two[:4, 0]  # anchor 2 becomes anchor 0's box: class 2 vs 1, both stay
    result = postprocess_reference(np.stack([one, two]), 0.5, 0.5, False, 300)
    assert [r[1].tolist() for r in result] == [[0.875, 0.75, 0.625], [0.875, 0.75, 0.625]]
    agnostic = postprocess_reference(np.stack([one, two]), 0.5, 0.5, True, 300)
    assert [r[2].tolist() for r in agnostic] == [[2, 1, 0], [2, 0]]
    assert agnostic[1][0].tolist() == [[8, 17, 12, 23], [3, 4.5, 3, 5.5]]


@pytest.mark.parametrize("shape", [(84,), (2, 84, 10, 1)])
def test_postprocess_reference_rejects_bad_shape(shape) -> None:
    with pytest.raises(ValueError, match="must have shape"):
        postprocess_reference(np.zeros(shape, np.float32), 0.5, 0.5)
