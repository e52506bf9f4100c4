"""YOLO output decoding and exact greedy NMS on the host (NumPy): the CPU path and the reference.

The GPU path (``kernels.nms_cuda``) computes bit-identical results; the arithmetic below is
the contract both follow:

- decode: per anchor the best class (first index on ties), kept when its score is strictly
  greater than ``float32(conf_threshold)``; ``x1 = cx - w * 0.5``, ``x2 = cx + w * 0.5``
  (likewise y), every step rounded to float32.
- IoU of boxes a and b: ``inter / ((area_a + area_b) - inter)`` in float32, with
  ``inter = max(min(ax2, bx2) - max(ax1, bx1), 0) * max(min(ay2, by2) - max(ay1, by1), 0)``
  and ``area = (x2 - x1) * (y2 - y1)``. A zero union gives NaN, which never suppresses,
  so zero-area boxes never suppress each other (torchvision behaves the same).
- greedy NMS with ``torchvision.ops.batched_nms`` semantics: candidates in order of score
  descending, equal scores by lower index first; a candidate is dropped when an earlier kept
  box of the same class (of any class when class-agnostic) has IoU strictly greater than
  ``float32(iou_threshold)``. The thresholds are compared in float32, as torchvision's CUDA
  kernel does.
"""

from __future__ import annotations

import numpy as np


def decode_predictions(
    predictions: np.ndarray, conf_threshold: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Turn one image's raw YOLO output into candidate boxes above a confidence threshold.

    Args:
        predictions: (4 + K, A) float32 or float16, host: rows cx, cy, w, h (model-input
            pixels) then K class scores, one column per anchor.
        conf_threshold: keep an anchor when its best class score is strictly greater.

    Returns:
        ``(xyxy, scores, class_ids)``: (N, 4) float32 boxes x1, y1, x2, y2; (N,) float32 best
        class scores; (N,) int32 best class indices; host arrays, in anchor order.
    """
    if predictions.ndim != 2 or predictions.shape[0] < 5:
        raise ValueError(
            f"predictions must have shape (4 + classes, anchors), got {predictions.shape}"
        )
    p = np.asarray(predictions, dtype=np.float32)
    class_scores = p[4:]
    class_ids = np.argmax(class_scores, axis=0)
    scores = np.take_along_axis(class_scores, class_ids[None], axis=0)[0]
    keep = scores > np.float32(conf_threshold)
    cx, cy, w, h = p[:4, keep]
    half_w, half_h = w * np.float32(0.5), h * np.float32(0.5)
    xyxy = np.stack([cx - half_w, cy - half_h, cx + half_w, cy + half_h], axis=1)
    return xyxy, scores[keep], class_ids[keep].astype(np.int32)


def nms(
    xyxy: np.ndarray,
    scores: np.ndarray,
    class_ids: np.ndarray,
    iou_threshold: float,
    class_agnostic: bool = False,
    max_detections: int = 300,
) -> np.ndarray:
    """Exact greedy non-maximum suppression, per class (or across classes).

    Args:
        xyxy: (N, 4) float32 boxes x1, y1, x2, y2, host.
        scores: (N,) float32 scores, host.
        class_ids: (N,) integer class indices, host.
        iou_threshold: a box is suppressed by a kept box when their IoU is strictly greater.
        class_agnostic: let boxes of any class suppress each other.
        max_detections: stop after this many kept boxes.

    Returns:
        (M,) int64 indices into the inputs of the kept boxes, best score first (equal scores:
        lower index first), M <= max_detections.
    """
    order = np.argsort(-np.asarray(scores, dtype=np.float32), kind="stable")
    boxes = np.asarray(xyxy, dtype=np.float32)[order]
    classes = np.asarray(class_ids)[order]
    x1, y1, x2, y2 = boxes.T
    areas = (x2 - x1) * (y2 - y1)
    threshold, zero = np.float32(iou_threshold), np.float32(0)
    alive = np.arange(len(order))  # positions in `order` still in play, ascending
    keep: list[int] = []
    while alive.size and len(keep) < max_detections:
        i, rest = alive[0], alive[1:]
        keep.append(i)
        inter = np.maximum(np.minimum(x2[i], x2[rest]) - np.maximum(x1[i], x1[rest]), zero)
        inter *= np.maximum(np.minimum(y2[i], y2[rest]) - np.maximum(y1[i], y1[rest]), zero)
        with np.errstate(divide="ignore", invalid="ignore"):
            suppressed = inter / ((areas[i] + areas[rest]) - inter) > threshold
        if not class_agnostic:
            suppressed &= classes[rest] == classes[i]
        alive = rest[~suppressed]
    return order[np.asarray(keep, dtype=np.int64)]


def postprocess_reference(
    predictions: np.ndarray,
    conf_threshold: float,
    iou_threshold: float,
    class_agnostic: bool = False,
    max_detections: int = 300,
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Decode and NMS a batch of raw YOLO outputs on the host.

    Args:
        predictions: (B, 4 + K, A) float32 or float16, host (see ``decode_predictions``).
        conf_threshold: minimum best-class score, exclusive.
        iou_threshold: NMS IoU threshold, exclusive.
        class_agnostic: suppress across classes.
        max_detections: most detections kept per image.

    Returns:
        Per image ``(xyxy (M, 4) float32, scores (M,) float32, class_ids (M,) int32)``, host,
        in model-input pixels (the letterbox is not undone), best score first.
    """
    if predictions.ndim != 3:
        raise ValueError(
            f"predictions must have shape (B, 4 + classes, anchors), got {predictions.shape}"
        )
    results = []
    for image in predictions:
        xyxy, scores, class_ids = decode_predictions(image, conf_threshold)
        keep = nms(xyxy, scores, class_ids, iou_threshold, class_agnostic, max_detections)
        results.append((xyxy[keep], scores[keep], class_ids[keep]))
    return results


def yolov5_to_anchor_columns(predictions: np.ndarray) -> np.ndarray:
    """A (B, A, 5 + K) YOLOv5/YOLOv7 output as the (B, 4 + K, A) layout ``postprocess_reference``
    reads: box rows, then class scores = objectness x class probability.

    Args:
        predictions: (B, A, 5 + K) float32/float16 host array: cx, cy, w, h, objectness,
            K class probabilities per anchor row.

    Returns:
        (B, 4 + K, A) float32 host array.
    """
    p = np.asarray(predictions, dtype=np.float32)
    if p.ndim != 3 or p.shape[2] < 6:
        raise ValueError(f"predictions must have shape (B, anchors, 5 + classes), got {p.shape}")
    scores = p[:, :, 4:5] * p[:, :, 5:]
    return np.concatenate([p[:, :, :4], scores], axis=2).transpose(0, 2, 1)


def end2end_reference(
    predictions: np.ndarray, conf_threshold: float, max_detections: int = 300,
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Detections of an end-to-end model (NMS inside: YOLOv10, YOLO26, exports with NMS):
    only the threshold and the cap are applied.

    Args:
        predictions: (B, N, 6) float32/float16 host array: x1, y1, x2, y2 (model-input
            pixels), score, class per row; unused rows have a score of 0.
        conf_threshold: keep a row when its score is strictly greater.
        max_detections: most detections kept per image (best scores).

    Returns:
        Per image ``(xyxy (M, 4) float32, scores (M,) float32, class_ids (M,) int32)``, host,
        best score first (equal scores: the model's order).
    """
    p = np.asarray(predictions, dtype=np.float32)
    if p.ndim != 3 or p.shape[2] != 6:
        raise ValueError(f"predictions must have shape (B, detections, 6), got {p.shape}")
    results = []
    for image in p:
        kept = image[image[:, 4] > np.float32(conf_threshold)]
        kept = kept[np.argsort(-kept[:, 4], kind="stable")][:max_detections]
        results.append((np.ascontiguousarray(kept[:, :4]), np.ascontiguousarray(kept[:, 4]),
                        kept[:, 5].round().astype(np.int32)))
    return results
