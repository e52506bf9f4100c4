"""Annotate: draw each frame's detections (box, class name, score) onto its I420 planes.

The stage gets one ``BatchDetections`` per batch and draws on the batch's host images in
place (the images are views of the pipeline's slot ring; the video sink encodes them later).
Drawing on the Y, U and V planes directly (boxes in the class colour, converted to YUV)
avoids two colour conversions per frame: the encoder takes I420 as it is.
"""

from __future__ import annotations

from collections.abc import Iterable

import cv2
import numpy as np

from pipeline.records import BatchDetections, Detections
from pipeline.stage import Stage

FONT = cv2.FONT_HERSHEY_SIMPLEX


def class_colour_yuv(class_id: int) -> tuple[int, int, int]:
    """A distinct, stable colour per class as limited-range BT.601 (Y, U, V)."""
    hue = (class_id * 47) % 180
    bgr = cv2.cvtColor(np.uint8([[[hue, 220, 255]]]), cv2.COLOR_HSV2BGR)[0, 0] / 255.0
    b, g, r = (float(v) for v in bgr)
    y = 16 + 65.481 * r + 128.553 * g + 24.966 * b
    u = 128 - 37.797 * r - 74.203 * g + 112.0 * b
    v = 128 + 112.0 * r - 93.786 * g - 18.214 * b
    return round(y), round(u), round(v)


def i420_planes(image: np.ndarray, width: int, height: int) -> tuple[np.ndarray, ...]:
    """Views of the Y (h, w), U and V (h/2, w/2) planes of an I420 (h*3/2, w) uint8 array."""
    flat = image.reshape(-1)
    chroma = (height // 2) * (width // 2)
    y = flat[: width * height].reshape(height, width)
    u = flat[width * height: width * height + chroma].reshape(height // 2, width // 2)
    v = flat[width * height + chroma: width * height + 2 * chroma].reshape(height // 2, width // 2)
    return y, u, v


def draw_detections(image: np.ndarray, width: int, height: int, detections: Detections,
                    class_names: list[str] | None = None) -> None:
    """Draw boxes and labels in place.

    Args:
        image: (height * 3 // 2, width) uint8 I420 host array, C-contiguous; modified.
        detections: host arrays in frame pixel coordinates.
        class_names: names indexed by class id, or None to print ids.
    """
    y_plane, u_plane, v_plane = i420_planes(image, width, height)
    thickness = max(2, round(min(width, height) / 360)) & ~1  # even: chroma has half the pixels
    scale = max(0.4, min(width, height) / 900)
    for box, score, cls in zip(detections.xyxy, detections.confidence, detections.class_id):
        x1, y1, x2, y2 = (int(round(float(c))) for c in box)
        y, u, v = class_colour_yuv(int(cls))
        cv2.rectangle(y_plane, (x1, y1), (x2, y2), y, thickness)
        for plane, value in ((u_plane, u), (v_plane, v)):
            cv2.rectangle(plane, (x1 // 2, y1 // 2), (x2 // 2, y2 // 2), value, thickness // 2)
        name = class_names[cls] if class_names and 0 <= cls < len(class_names) else str(int(cls))
        label = f"{name} {float(score):.2f}"
        (text_w, text_h), baseline = cv2.getTextSize(label, FONT, scale, 1)
        top = max(0, y1 - text_h - baseline - 2)
        cv2.rectangle(y_plane, (x1, top), (x1 + text_w + 2, top + text_h + baseline + 2), y, -1)
        for plane, value in ((u_plane, u), (v_plane, v)):
            cv2.rectangle(plane, (x1 // 2, top // 2),
                          ((x1 + text_w + 2) // 2, (top + text_h + baseline + 2) // 2), value, -1)
        text_luma = 16 if y > 120 else 235
        cv2.putText(y_plane, label, (x1 + 1, top + text_h + 1), FONT, scale, text_luma, 1,
                    cv2.LINE_AA)


class AnnotateStage(Stage):
    """Draws every frame's detections onto its own image (in place) and passes the batch on.

    Args:
        name: stage name.
        class_names: names indexed by class id (printed in the labels), or None to print ids.
    """

    def __init__(self, name: str, class_names: list[str] | None) -> None:
        super().__init__(name)
        self.class_names = class_names

    def process(self, item: BatchDetections) -> Iterable[BatchDetections]:
        """Draw frame ``row``'s detections (``item[row]``) on ``item.frames.images[row]``
        ((height * 3 // 2, width) uint8 I420 host array, modified in place) for every frame
        that has detections and an image; frames without an image (None: decoded on the GPU)
        are skipped. Returns ``(item,)``, the same batch."""
        if not len(item.xyxy):
            return (item,)
        frames = item.frames
        counts = item.counts.tolist()
        widths, heights = frames.width.tolist(), frames.height.tolist()
        for row, image in enumerate(frames.images):
            if image is None or not counts[row]:
                continue
            draw_detections(image, widths[row], heights[row], item[row], self.class_names)
        return (item,)
