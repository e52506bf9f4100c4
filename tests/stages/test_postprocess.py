"""PostprocessStage: raw model output to detections in frame pixels."""

from __future__ import annotations

import time

import numpy as np

from kernels.preprocess import letterbox_geometry
from pipeline.config import NmsConfig
from pipeline.records import Batch, Frame
from stages.postprocess import PostprocessStage


def test_boxes_are_mapped_back_to_frame_pixels() -> None:
    # One 640x272 frame letterboxed into 416x416: scale 0.65, 177 rows tall, padded 119 on top.
    letterbox = letterbox_geometry(640, 272, 416, 416)
    outputs = np.zeros((1, 4 + 3, 5), np.float32)
    # anchor 0: class 2 box centred at (208, 208) 104x52 in model pixels; anchor 1: weaker copy
    outputs[0, :4, 0] = [208, 208, 104, 52]
    outputs[0, 4 + 2, 0] = 0.9
    outputs[0, :4, 1] = [210, 208, 104, 52]
    outputs[0, 4 + 2, 1] = 0.8
    outputs[0, 4 + 0, 2] = 0.1  # below the threshold
    frame = Frame("a", 0, 0.0, time.time(), 640, 272)
    batch = Batch([frame], [letterbox], images=np.zeros((1, 3, 416, 416), np.float32),
                  outputs=outputs)
    (out,) = PostprocessStage("post", NmsConfig(conf_threshold=0.25)).process(batch)
    d = out.detections
    assert len(d) == 1 and d.class_id.tolist() == [2]
    assert d.confidence.tolist() == [np.float32(0.9)]
    sx, sy = letterbox.scale_x, letterbox.scale_y
    expected = [(156 - letterbox.pad_left) / sx, (182 - letterbox.pad_top) / sy,
                (260 - letterbox.pad_left) / sx, (234 - letterbox.pad_top) / sy]
    np.testing.assert_allclose(d.xyxy[0], expected, rtol=1e-5)
    np.testing.assert_allclose(d.xyxy[0], [240, 96.8, 400, 176.7], atol=0.1)
