"""Model output layouts: the real YOLOv3-tiny wrapped into a YOLOv5-layout model and into an
end-to-end model (NMS inside the graph) gives the plain model's detections through the
pipeline (CPU), and every layout is told from its shape."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from pipeline.app.cli import main
from stages.backends.base import detect_layout, metadata_names, read_model_info
from tests.e2e.conftest import pipeline_config
from tests.support.clips import ClipFactory
from tests.support.layouts import to_end2end, to_yolov5_layout

CLIP_FRAMES = 40  # of the street: every frame's detections compared in each layout
CONF, IOU = 0.25, 0.45  # the configuration's defaults, also inside the end-to-end graph


@pytest.fixture(scope="module")
def clip(make_clip: ClipFactory) -> Path:
    return make_clip("bikes", CLIP_FRAMES, (640, 272))


def detections(samples, tmp_path: Path, clip: Path, model: Path, inference: dict | None = None,
               **model_keys) -> list[list]:
    out = tmp_path / model.stem
    config = pipeline_config(samples, out, [{"name": "cam", "uri": str(clip)}],
                             model={"path": str(model), **model_keys},
                             inference={"batch_size": 1, **(inference or {})})
    path = tmp_path / f"{model.stem}.yaml"
    import yaml

    path.write_text(yaml.safe_dump(config))
    assert main(["--config", str(path), "--no-progress"]) == 0
    return [json.loads(line)["detections"] for line in (out / "cam.jsonl").read_text().splitlines()]


def same(plain: list[list], other: list[list], score_tolerance: float = 1e-4) -> None:
    """The same detections per frame: classes, boxes within 0.05 px, scores within the
    tolerance (1e-4: the records' rounding; on the GPU, torch runs fp32 convolutions in TF32
    and picks its kernels per graph, so a wrapped graph's scores differ by up to 1e-3)."""
    assert len(plain) == len(other) == CLIP_FRAMES
    for frame, (want, got) in enumerate(zip(plain, other)):
        assert len(want) == len(got), (frame, want, got)
        for a, b in zip(sorted(want, key=lambda d: -d["confidence"]),
                        sorted(got, key=lambda d: -d["confidence"])):
            assert a["class_name"] == b["class_name"], frame
            np.testing.assert_allclose(a["xyxy"], b["xyxy"], atol=0.05)
            assert abs(a["confidence"] - b["confidence"]) <= score_tolerance


def test_yolov5_and_end2end_give_the_plain_model_s_detections(samples, tmp_path, clip):
    v5 = to_yolov5_layout(samples.model, tmp_path / "yolov5.onnx")
    e2e = to_end2end(samples.model, tmp_path / "end2end.onnx", CONF, IOU)
    assert (read_model_info(v5).layout, read_model_info(e2e).layout) == ("yolov5", "end2end")
    plain = detections(samples, tmp_path, clip, samples.model)
    assert sum(map(len, plain)) > 50  # people, bicycles, cars
    same(plain, detections(samples, tmp_path, clip, v5))
    same(plain, detections(samples, tmp_path, clip, e2e))


@pytest.mark.gpu
def test_every_layout_on_the_gpu_path(samples, tmp_path, clip):
    """The GPU postprocess reads each layout in place (yolov5 rows in the NMS filter kernel,
    end2end in its own kernel): the plain model's GPU detections, each layout."""
    from pipeline.gpu import gpu_unavailable_reason

    if (reason := gpu_unavailable_reason()) is not None:
        pytest.skip(f"GPU path unavailable: {reason}")
    gpu = {"device": "cuda", "backend": "torch", "precision": "fp32", "compile": False,
           "engine_cache": str(tmp_path / "engines")}
    v5 = to_yolov5_layout(samples.model, tmp_path / "yolov5.onnx")
    e2e = to_end2end(samples.model, tmp_path / "end2end.onnx", CONF, IOU)
    plain = detections(samples, tmp_path, clip, samples.model, gpu)
    assert sum(map(len, plain)) > 50
    same(plain, detections(samples, tmp_path, clip, v5, gpu), score_tolerance=5e-3)
    same(plain, detections(samples, tmp_path, clip, e2e, gpu), score_tolerance=5e-3)


@pytest.mark.parametrize("dims, size, layout", [
    ([1, 84, 8400], (640, 640), "yolov8"),
    (["batch", 84, 2535], (416, 416), "yolov8"),
    ([1, 25200, 85], (640, 640), "yolov5"),
    ([1, 300, 6], (640, 640), "end2end"),
    ([1, 84, 34000], (640, 640), "yolov8"),  # a P2 head: 160² + 80² + 40² + 20² cells
])
def test_layout_from_the_shape(dims, size, layout):
    assert detect_layout(dims, *size) == layout


@pytest.mark.parametrize("dims, forced, message", [
    ([1, 84, 10], "auto", "fits no layout"),
    # Not "1 class, 7 anchors": a 640 x 640 YOLO head has at least 10 x 10 anchors.
    ([1, 5, 7], "auto", r"output \(batch, 5, 7\) fits no layout"),
    ([1, 25200, 6], "auto", "fits the end2end and the yolov5 layouts: set model.layout"),
    ([1, 84, 8400], "end2end", "is not the end2end layout"),
])
def test_a_shape_that_fits_no_layout_or_two_is_an_error(dims, forced, message):
    with pytest.raises(ValueError, match=message):
        detect_layout(dims, 640, 640, forced)


def test_a_forced_yolov8_layout_takes_any_anchor_count():
    assert detect_layout([1, 5, 7], 640, 640, "yolov8") == "yolov8"
    assert detect_layout([1, 25200, 6], 640, 640, "yolov5") == "yolov5"


def test_class_names_from_ultralytics_metadata(samples, tmp_path):
    model = onnx.load(str(samples.model))
    onnx.helper.set_model_props(model, {"names": "{0: 'person', 1: 'bicycle'}", "stride": "32"})
    assert metadata_names(model) == ("person", "bicycle")
