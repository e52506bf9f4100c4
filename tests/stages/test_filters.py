"""stages.filters: per-source classes and region of interest, exact on known boxes, and
through the pipeline on the real sample (CPU)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from pipeline.app.cli import main
from pipeline.config import ConfigError, SourceConfig
from pipeline.records import BatchDetections
from stages.filters import DetectionFilterStage, SourceFilter
from tests.e2e.conftest import pipeline_config
from tests.support.batches import frame_batch, make_frame


def test_classes_and_roi_per_source():
    # Two frames: source 0 then source 1, three detections each.
    boxes = np.array([[0, 0, 10, 10], [50, 50, 60, 60], [0, 0, 10, 90],
                      [0, 0, 10, 10], [50, 50, 60, 60], [0, 0, 10, 90]], np.float32)
    frames = frame_batch([make_frame("a", 0, width=100, height=100),
                          make_frame("b", 0, width=100, height=100)])
    batch = BatchDetections(frames, boxes,
                            np.full(6, 0.9, np.float32),
                            np.array([0, 1, 0, 0, 1, 0], np.int32), np.array([0, 3, 6]))
    names = ["person", "bicycle"]
    square = [[0, 0], [40, 0], [40, 40], [0, 40]]  # anchors (5, 10) in, (55, 60), (5, 90) out
    filters = {0: SourceFilter.from_config("sources[0]", SourceConfig(
                   name="a", uri="a.mp4", classes=["person"], roi=square), names, 2),
               }
    [kept] = DetectionFilterStage("filter", filters).process(batch)
    assert kept.offsets.tolist() == [0, 1, 4]  # source 1 has no filter: all three stay
    np.testing.assert_array_equal(kept.xyxy, boxes[[0, 3, 4, 5]])
    assert kept[0].class_id.tolist() == [0]


def test_unknown_class_is_a_config_error():
    with pytest.raises(ConfigError, match=r"sources\[2\].classes: the model has no class 'persn' "
                                          r"\(its classes: person, bicycle\)"):
        SourceFilter.from_config("sources[2]", SourceConfig(name="a", uri="a.mp4",
                                                           classes=["persn"]),
                                 ["person", "bicycle"], 2)


def run(samples, clip, tmp_path, name, **source_keys) -> list[dict]:
    out = tmp_path / name
    config = pipeline_config(samples, out, [{"name": "cam", "uri": str(clip), **source_keys}])
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["--config", str(path), "--no-progress"]) == 0
    return [json.loads(line) for line in (out / "cam.jsonl").read_text().splitlines()]


def test_filters_through_the_pipeline_keep_exactly_the_matching_detections(samples, make_clip,
                                                                          tmp_path):
    clip = make_clip("bikes", 60, (640, 272))  # the street's first 60 frames
    everything = run(samples, clip, tmp_path, "all")
    left = [[0, 0], [320, 0], [320, 272], [0, 272]]
    filtered = run(samples, clip, tmp_path, "filtered", classes=["person", 2], roi=left)
    assert len(filtered) == len(everything) == 60  # frames are never dropped
    expected = [[d for d in record["detections"] if d["class_name"] in ("person", "car")
                 and (d["xyxy"][0] + d["xyxy"][2]) / 2 <= 320]
                for record in everything]
    assert [r["detections"] for r in filtered] == expected
    assert sum(map(len, expected)) > 20 and sum(map(len, expected)) < sum(
        len(r["detections"]) for r in everything)
