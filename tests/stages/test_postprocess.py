"""Postprocess on the CPU: the vectorised letterbox undo against ``Letterbox.unmap_boxes``, and
the stage on a real model output against the per-frame reference."""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np
import pytest

from kernels.nms import postprocess_reference
from kernels.preprocess import letterbox_geometry
from pipeline.config import InferenceConfig, NmsConfig
from pipeline.records import FrameBatch, ModelOutputs
from stages.backends.base import read_model_info
from stages.batcher import BatcherStage, letterbox_row
from stages.infer import create_backend
from stages.postprocess import PostprocessStage, unletterbox
from stages.preprocess import HostPreprocess
from tests.support.batches import make_frame

GEOMETRIES = [  # (frame width, height, model input width, height)
    (640, 272, 416, 416), (1920, 1080, 640, 640), (1080, 1920, 640, 640), (176, 144, 416, 416),
    (416, 416, 416, 416), (640, 480, 320, 192), (30, 1000, 64, 64), (1282, 722, 640, 384),
]


def random_boxes(rng: np.random.Generator, count: int, width: int, height: int) -> np.ndarray:
    """(count, 4) float32 boxes in model-input pixels, some reaching past the input."""
    corner = rng.uniform(-20, [width, height], (count, 2))
    size = rng.uniform(0, [width / 2 + 30, height / 2 + 30], (count, 2))
    return np.concatenate([corner, corner + size], 1).astype(np.float32)


def test_unletterbox_is_unmap_boxes_bit_for_bit() -> None:
    rng = np.random.default_rng(0)
    boxes_per_frame, letterboxes = [], []
    for k, (w, h, dw, dh) in enumerate(GEOMETRIES):
        letterbox = letterbox_geometry(w, h, dw, dh)
        letterboxes.append(letterbox)
        boxes_per_frame.append(random_boxes(rng, k % 4 * 7, dw, dh))  # 0, 7, 14, 21 boxes
    xyxy = np.concatenate(boxes_per_frame)
    table = np.array([letterbox_row(b) for b in letterboxes], np.float32)
    counts = [len(b) for b in boxes_per_frame]
    out = unletterbox(xyxy, table[np.repeat(np.arange(len(GEOMETRIES)), counts)])
    assert out.dtype == np.float32 and out.shape == xyxy.shape
    for got, boxes, letterbox in zip(np.split(out, np.cumsum(counts)[:-1]), boxes_per_frame,
                                     letterboxes):
        expected = letterbox.unmap_boxes(boxes)
        assert np.array_equal(got, expected), letterbox
        assert got.min(initial=0) >= 0 and (got[:, 0::2] <= letterbox.src_width).all()
        assert (got[:, 1::2] <= letterbox.src_height).all()


def test_unletterbox_of_no_boxes() -> None:
    out = unletterbox(np.empty((0, 4), np.float32), np.empty((0, 6), np.float32))
    assert out.shape == (0, 4) and out.dtype == np.float32


def one_frame_batch(width: int, height: int, input_size: tuple[int, int],
                    slot: int = -1) -> FrameBatch:
    batcher = BatcherStage("batch", input_size, 1, 1000.0, ("a",))
    return batcher.make_batch([make_frame("a", 0, width=width, height=height, slot=slot)])


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
    batch = one_frame_batch(640, 272, (416, 416), slot=4)
    released: list[list[int]] = []
    stage = PostprocessStage("post", NmsConfig(conf_threshold=0.25),
                             release_slots=lambda slots: released.append(slots.tolist()))
    (out,) = stage.process(ModelOutputs(batch, outputs))
    assert out.frames is batch and released == [[4]]
    d = out[0]
    assert len(d) == 1 and d.class_id.tolist() == [2]
    assert d.confidence.tolist() == [np.float32(0.9)]
    sx, sy = letterbox.scale_x, letterbox.scale_y
    expected = [(156 - letterbox.pad_left) / sx, (182 - letterbox.pad_top) / sy,
                (260 - letterbox.pad_left) / sx, (234 - letterbox.pad_top) / sy]
    np.testing.assert_allclose(d.xyxy[0], expected, rtol=1e-5)
    np.testing.assert_allclose(d.xyxy[0], [240, 96.8, 400, 176.7], atol=0.1)


@pytest.fixture(scope="module")
def bikes_outputs(samples) -> tuple[FrameBatch, np.ndarray, tuple[int, int]]:
    """Frames 0, 60 and 120 of bikes.mp4 (the second one shrunk to another geometry) as a
    batch of two sources, and the sample model's raw output for them (onnxruntime)."""
    with av.open(str(samples.bikes)) as container:
        pictures = [p for i, p in enumerate(container.decode(video=0)) if i in (0, 60, 120)]
    pictures[1] = pictures[1].reformat(width=320, height=240)
    info = read_model_info(samples.model)
    size = (info.input_height, info.input_width)
    frames = [make_frame(source, i, p.to_ndarray(format="yuv420p"), slot=i * 2)
              for i, (source, p) in enumerate(zip(["bikes", "small", "bikes"], pictures))]
    batch = BatcherStage("batch", size, 3, 1000.0, ("small", "bikes")).make_batch(frames)
    backend = create_backend(InferenceConfig(backend="onnxruntime", batch_size=3),
                             Path(samples.model), info)
    outputs = backend.infer(HostPreprocess(size, info.input_dtype, 3).run(batch))
    backend.close()
    return batch, outputs, size


@pytest.mark.parametrize("nms", [NmsConfig(), NmsConfig(conf_threshold=0.1, iou_threshold=0.3,
                                                        class_agnostic=True, max_detections=5)],
                         ids=["default", "agnostic-capped"])
def test_stage_gives_the_reference_per_frame_on_real_outputs(bikes_outputs, nms) -> None:
    batch, outputs, (input_height, input_width) = bikes_outputs
    released: list[np.ndarray] = []
    (out,) = PostprocessStage("post", nms, release_slots=released.append).process(
        ModelOutputs(batch, outputs))
    assert len(released) == 1 and released[0].tolist() == [0, 2, 4]
    assert len(out) == 3 and out.frames is batch
    assert out.counts.sum() > 0  # the sample has people and bicycles
    for row in range(3):
        (xyxy, scores, class_ids), = postprocess_reference(
            outputs[row:row + 1], nms.conf_threshold, nms.iou_threshold, nms.class_agnostic,
            nms.max_detections)
        letterbox = letterbox_geometry(int(batch.width[row]), int(batch.height[row]),
                                       input_width, input_height)
        got = out[row]
        assert np.array_equal(got.xyxy, letterbox.unmap_boxes(xyxy))
        assert np.array_equal(got.confidence, scores)
        assert np.array_equal(got.class_id, class_ids)
        assert len(got) <= nms.max_detections


def test_stage_without_release_keeps_the_slots(bikes_outputs) -> None:
    batch, outputs, _ = bikes_outputs
    (out,) = PostprocessStage("post", NmsConfig()).process(ModelOutputs(batch, outputs))
    assert len(out) == 3
