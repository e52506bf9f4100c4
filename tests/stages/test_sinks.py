"""Sinks: the MP4 and JSONL get their final names only when complete, and play back."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from pipeline.records import Detections, EndOfStream, Frame
from stages.sinks import SinkStage, VideoWriter, partial_path
from tests.support import read_frames


@pytest.fixture(scope="module")
def pictures(samples) -> list[Frame]:
    """12 real frames: 6 at 176x144 (carphone), then 6 at 320x136 (bikes scaled)."""
    small = [p.reformat(format="yuv420p") for p in read_frames(samples.carphone, 6)]
    wide = [p.reformat(width=320, height=136, format="yuv420p")
            for p in read_frames(samples.bikes, 6)]
    return [Frame(source="cam", index=i, pts=i / 25, capture_time=time.time(), width=p.width,
                  height=p.height, image=p.to_ndarray()) for i, p in enumerate(small + wide)]


def test_video_keeps_the_first_size_across_a_size_change(tmp_path: Path,
                                                         pictures: list[Frame]) -> None:
    writer = VideoWriter(tmp_path / "cam.mp4", crf=23)
    for frame in pictures:
        writer.write(frame)
    writer.close(complete=True)
    decoded = read_frames(tmp_path / "cam.mp4")
    assert len(decoded) == 12 and {(f.width, f.height) for f in decoded} == {(176, 144)}
    # The wide frames were scaled, not garbled: their luma stays close to the original's.
    original = pictures[8].image[:136].astype(float).mean()
    assert abs(decoded[8].to_ndarray()[:144].astype(float).mean() - original) < 8


def run_sink(tmp_path: Path, frames: list[Frame], end: EndOfStream | None) -> SinkStage:
    sink = SinkStage("sink:cam", tmp_path / "cam.mp4", tmp_path / "cam.jsonl", ["person"])
    sink.open()
    for frame in frames:
        sink.process(frame)
    if end is not None:
        sink.end_of_stream(end)
    sink.close()
    return sink


@pytest.mark.parametrize(("count", "end", "left"), [
    (12, EndOfStream("cam", 12), {"cam.mp4", "cam.jsonl"}),  # ended (or stopped): final names
    (12, EndOfStream("cam", 12, error="lost"), {"cam.partial.mp4", "cam.partial.jsonl"}),
    (12, None, {"cam.partial.mp4", "cam.partial.jsonl"}),  # aborted: no end marker
    (0, EndOfStream("cam", 0, error="cannot open"), set()),  # nothing written: nothing left
    (0, EndOfStream("cam", 0), {"cam.jsonl"}),  # a complete, empty run
])
def test_outputs_get_final_names_only_when_complete(tmp_path: Path, pictures: list[Frame],
                                                    count: int, end: EndOfStream | None,
                                                    left: set[str]) -> None:
    (tmp_path / "cam.mp4").write_bytes(b"older run")  # must never pass for this run's output
    (tmp_path / "cam.partial.jsonl").write_text("older run\n")
    run_sink(tmp_path, pictures[:count], end)
    assert {p.name for p in tmp_path.iterdir()} == left
    for name in left:
        if name.endswith(".mp4"):
            assert len(read_frames(tmp_path / name)) == count
        else:
            assert len((tmp_path / name).read_text().splitlines()) == count


def test_jsonl_has_one_record_per_frame_with_named_detections(tmp_path: Path,
                                                              pictures: list[Frame]) -> None:
    frames = pictures[:3]
    frames[1].detections = Detections(np.array([[1, 2, 30, 40]], np.float32),
                                      np.array([0.9], np.float32), np.array([0], np.int32))
    sink = SinkStage("sink:cam", None, tmp_path / "cam.jsonl", ["person"])
    sink.open()
    for frame in frames:
        sink.process(frame)
    sink.end_of_stream(EndOfStream("cam", 3))
    sink.close()
    records = [json.loads(line) for line in (tmp_path / "cam.jsonl").read_text().splitlines()]
    assert [r["frame"] for r in records] == [0, 1, 2]
    assert records[1]["detections"] == [
        {"class_id": 0, "confidence": 0.9, "xyxy": [1.0, 2.0, 30.0, 40.0], "class_name": "person"}]
    assert not partial_path(tmp_path / "cam.jsonl").exists()
