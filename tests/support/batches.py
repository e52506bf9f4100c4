"""Test records of the batch data plane: ``FrameBatch`` and ``BatchDetections`` from a few
frames and their boxes, as the batcher and the postprocess stage would make them."""

from __future__ import annotations

import time
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from pipeline.records import BatchDetections, Frame, FrameBatch

# One detection: x1, y1, x2, y2, confidence, class id (frame pixels).
Box = tuple[float, float, float, float, float, int]


def make_frame(source: str, index: int, image: np.ndarray | None = None, *,
               width: int | None = None, height: int | None = None,
               pts: float | None = None, capture_time: float | None = None, slot: int = -1,
               rate: Fraction | None = None) -> Frame:
    """A ``Frame``; its size is read from ``image`` ((height * 3 // 2, width) uint8 I420)
    unless given (it must be when ``image`` is None)."""
    if image is not None:
        height, width = image.shape[0] * 2 // 3, image.shape[1]
    assert width is not None and height is not None, "a frame without an image needs a size"
    return Frame(source=source, index=index, pts=pts,
                 capture_time=time.time() if capture_time is None else capture_time,
                 width=width, height=height, rate=rate, image=image, slot=slot)


def grey_image(width: int, height: int, value: int = 128) -> np.ndarray:
    """A flat I420 picture: (height * 3 // 2, width) uint8, every sample ``value``."""
    return np.full((height * 3 // 2, width), value, np.uint8)


def frame_batch(frames: Sequence[Frame], source_names: Sequence[str] | None = None) -> FrameBatch:
    """``FrameBatch.from_frames`` of ``frames`` with an identity letterbox (scale 1, no pad).
    ``source_names`` defaults to the frames' sources in order of first appearance."""
    names = tuple(source_names) if source_names is not None else tuple(
        dict.fromkeys(f.source for f in frames))
    letterbox = np.array([[1.0, 1.0, 0.0, 0.0, f.width, f.height] for f in frames],
                         np.float32).reshape(len(frames), 6)
    return FrameBatch.from_frames(list(frames), {name: i for i, name in enumerate(names)}, names,
                                  letterbox)


def batch_detections(rows: Sequence[tuple[Frame, Sequence[Box]]],
                     source_names: Sequence[str] | None = None) -> BatchDetections:
    """A ``BatchDetections`` of ``rows``: (frame, its boxes) in batch order."""
    per_frame = [(np.array([b[:4] for b in boxes], np.float32).reshape(-1, 4),
                  np.array([b[4] for b in boxes], np.float32),
                  np.array([b[5] for b in boxes], np.int32)) for _, boxes in rows]
    return BatchDetections.from_lists(frame_batch([frame for frame, _ in rows], source_names),
                                      per_frame)
