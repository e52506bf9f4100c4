"""AnnotateStage: boxes drawn on the I420 planes in the class colour."""

from __future__ import annotations

import time

import cv2
import numpy as np

from pipeline.records import Detections, Frame
from stages.annotate import AnnotateStage, class_colour_yuv, i420_planes


def test_box_is_drawn_in_the_class_colour_and_the_rest_is_untouched() -> None:
    width, height = 320, 240
    image = np.full((height * 3 // 2, width), 128, np.uint8)
    detections = Detections(np.array([[100, 80, 220, 200]], np.float32),
                            np.array([0.9], np.float32), np.array([2], np.int32))
    frame = Frame("a", 0, None, time.time(), width, height, image=image, detections=detections)
    (out,) = AnnotateStage("ann", ["person", "bicycle", "car"]).process(frame)
    y, u, v = i420_planes(out.image, width, height)
    colour = class_colour_yuv(2)
    assert y[140, 100] == colour[0] and y[140, 220] == colour[0]   # left and right edges
    assert u[70, 50] == colour[1] and v[70, 50] == colour[2]
    assert y[140, 160] == 128 and y[10, 10] == 128                  # inside and outside
    bgr = cv2.cvtColor(out.image, cv2.COLOR_YUV2BGR_I420)
    assert abs(int(bgr[140, 100].astype(int).sum()) - 3 * 128) > 60  # visibly coloured


def test_class_colours_differ() -> None:
    assert len({class_colour_yuv(c) for c in range(80)}) > 60
