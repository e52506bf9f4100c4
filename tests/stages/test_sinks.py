"""Sinks: batch parts become JSONL lines and MP4 frames; the outputs get their final names
only when complete, and play back; the parts' slots are released once each."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipeline.records import AnalyticsEvent, BatchDetections, EndOfStream, Frame
from stages.sinks import (
    JsonlWriter,
    SinkStage,
    VideoWriter,
    detection_records,
    frame_records,
    partial_path,
)
from tests.support import read_frames
from tests.support.batches import Box, batch_detections, grey_image, make_frame

CAPTURE = 1_700_000_000.1234567


@pytest.fixture(scope="module")
def pictures(samples) -> list[Frame]:
    """12 real frames in slots 100..111: 6 at 176x144 (carphone), then 6 at 320x136 (bikes
    scaled)."""
    small = [p.reformat(format="yuv420p") for p in read_frames(samples.carphone, 6)]
    wide = [p.reformat(width=320, height=136, format="yuv420p")
            for p in read_frames(samples.bikes, 6)]
    return [make_frame("cam", i, p.to_ndarray(), pts=i / 25, capture_time=CAPTURE + i,
                       slot=100 + i, rate=Fraction(25))
            for i, p in enumerate(small + wide)]


def parts(frames: list[Frame], size: int) -> list[BatchDetections]:
    """``frames`` without detections, as batch parts of at most ``size`` frames."""
    return [batch_detections([(f, []) for f in frames[start:start + size]])
            for start in range(0, len(frames), size)]


def test_video_keeps_the_first_size_across_a_size_change(tmp_path: Path,
                                                         pictures: list[Frame]) -> None:
    writer = VideoWriter(tmp_path / "cam.mp4", crf=23)
    for part in parts(pictures, 4):
        writer.write(part)
    writer.close(complete=True)
    decoded = read_frames(tmp_path / "cam.mp4")
    assert len(decoded) == 12 and {(f.width, f.height) for f in decoded} == {(176, 144)}
    # The wide frames were scaled, not garbled: their luma stays close to the original's.
    original = pictures[8].image[:136].astype(float).mean()
    assert abs(decoded[8].to_ndarray()[:144].astype(float).mean() - original) < 8


def test_video_skips_frames_without_a_host_image(tmp_path: Path, pictures: list[Frame]) -> None:
    frames = [*pictures[:2], make_frame("cam", 2, None, width=176, height=144), pictures[3]]
    writer = VideoWriter(tmp_path / "cam.mp4", crf=23)
    writer.write(batch_detections([(f, []) for f in frames]))
    writer.close(complete=True)
    assert (writer.frames, writer.skipped) == (3, 1)
    assert len(read_frames(tmp_path / "cam.mp4")) == 3


def run_sink(tmp_path: Path, frames: list[Frame], end: EndOfStream | None,
             part_size: int = 5) -> tuple[SinkStage, list[list[int]]]:
    """Run a sink over ``frames`` in parts of ``part_size``; also returns the slots it released,
    one list per call."""
    released: list[list[int]] = []

    def release(slots: np.ndarray) -> None:
        assert slots.dtype == np.int32 and slots.ndim == 1
        released.append(slots.tolist())

    sink = SinkStage("sink:cam", tmp_path / "cam.mp4", tmp_path / "cam.jsonl", ["person"],
                     release_slots=release)
    sink.open()
    for part in parts(frames, part_size):
        assert sink.process(part) == ()
    if end is not None:
        sink.end_of_stream(end)
    sink.close()
    return sink, released


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
    sink, _ = run_sink(tmp_path, pictures[:count], end)
    assert {p.name for p in tmp_path.iterdir()} == left
    assert [w.frames for w in sink.writers] == [count, count]
    for name in left:
        if name.endswith(".mp4"):
            assert len(read_frames(tmp_path / name)) == count  # decoded with PyAV
        else:
            lines = (tmp_path / name).read_text().splitlines()
            assert [json.loads(line)["frame"] for line in lines] == list(range(count))


@pytest.mark.parametrize(("count", "part_size", "released"), [
    (12, 5, [[100, 101, 102, 103, 104], [105, 106, 107, 108, 109], [110, 111]]),
    (3, 3, [[100, 101, 102]]),
    (2, 1, [[100], [101]]),
])
def test_release_slots_is_called_once_per_part_with_its_slots(
        tmp_path: Path, pictures: list[Frame], count: int, part_size: int,
        released: list[list[int]]) -> None:
    _, calls = run_sink(tmp_path, pictures[:count], EndOfStream("cam", count), part_size)
    assert calls == released


def test_release_slots_passes_on_frames_without_a_slot(tmp_path: Path) -> None:
    calls: list[list[int]] = []
    sink = SinkStage("sink:cam", None, tmp_path / "cam.jsonl", None,
                     release_slots=lambda slots: calls.append(slots.tolist()))
    sink.open()
    sink.process(batch_detections([(make_frame("cam", 0, grey_image(16, 16), slot=7), []),
                                   (make_frame("cam", 1, grey_image(16, 16)), [])]))
    sink.close()
    assert calls == [[7, -1]]


class CountingFile:
    """A file that counts its ``write`` and ``flush`` calls."""

    def __init__(self, file: Any) -> None:
        self.file, self.writes, self.flushes = file, 0, 0

    def write(self, text: str) -> int:
        self.writes += 1
        return self.file.write(text)

    def flush(self) -> None:
        self.flushes += 1
        self.file.flush()

    def close(self) -> None:
        self.file.close()


# A part of 3 frames: (pts, boxes) each; class 0 is named, class 5 is past the names.
PART: list[tuple[float | None, list[Box]]] = [
    (None, []),
    (0.04, [(1, 2, 30, 40, 0.9, 0), (10.25, 33.333, 50.5, 60.126, 0.12345, 5)]),
    (0.08, [(0, 0, 175.999, 143, 0.5, 0)]),
]
EXPECTED = [
    {"source": "cam", "frame": 10, "pts": None, "capture_time": 1_700_000_000.123457,
     "detections": []},
    {"source": "cam", "frame": 11, "pts": 0.04, "capture_time": 1_700_000_001.123457,
     "detections": [
         {"class_id": 0, "class_name": "person", "confidence": 0.9, "xyxy": [1.0, 2.0, 30.0, 40.0]},
         {"class_id": 5, "confidence": 0.1235, "xyxy": [10.25, 33.33, 50.5, 60.13]}]},
    {"source": "cam", "frame": 12, "pts": 0.08, "capture_time": 1_700_000_002.123457,
     "detections": [
         {"class_id": 0, "class_name": "person", "confidence": 0.5, "xyxy": [0.0, 0.0, 176.0, 143.0]}]},
]


def test_jsonl_writes_a_part_in_one_write_with_one_record_per_frame(tmp_path: Path) -> None:
    part = batch_detections([
        (make_frame("cam", 10 + i, grey_image(176, 144), pts=pts, capture_time=CAPTURE + i), boxes)
        for i, (pts, boxes) in enumerate(PART)])
    assert math.isnan(part.frames.pts[0])
    sink = SinkStage("sink:cam", None, tmp_path / "cam.jsonl", ["person"])
    sink.open()
    (writer,) = sink.writers
    assert isinstance(writer, JsonlWriter)
    writer._file = counting = CountingFile(writer._file)
    sink.process(part)
    assert (counting.writes, counting.flushes) == (1, 1)
    # Flushed: the lines are on disk before the sink closes.
    lines = partial_path(tmp_path / "cam.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == EXPECTED
    sink.end_of_stream(EndOfStream("cam", 3))
    sink.close()
    lines = (tmp_path / "cam.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == EXPECTED
    assert not partial_path(tmp_path / "cam.jsonl").exists()


def test_frame_records_match_the_json_lines() -> None:
    part = batch_detections([
        (make_frame("cam", 10 + i, None, width=176, height=144, pts=pts,
                    capture_time=CAPTURE + i), boxes)
        for i, (pts, boxes) in enumerate(PART)])
    assert frame_records(part, ["person"]) == EXPECTED


BOX = np.array([[1.006, 2, 3, 4]], np.float32)


@pytest.mark.parametrize(("class_id", "names", "expected"), [
    (0, ["person"], {"class_id": 0, "class_name": "person"}),
    (1, ["person"], {"class_id": 1}),                 # past the names
    (0, None, {"class_id": 0}),                       # no names
    (0, [], {"class_id": 0}),                         # empty names
])
def test_detection_records_name_classes_only_when_known(class_id: int, names: list[str] | None,
                                                        expected: dict[str, Any]) -> None:
    (record,) = detection_records(BOX, np.array([0.77777], np.float32),
                                  np.array([class_id], np.int32), names)
    assert record == {**expected, "confidence": 0.7778, "xyxy": [1.01, 2.0, 3.0, 4.0]}
    assert all(type(v) is float for v in record["xyxy"]) and type(record["class_id"]) is int


def test_detection_records_of_no_detections() -> None:
    assert detection_records(np.empty((0, 4), np.float32), np.empty(0, np.float32),
                             np.empty(0, np.int32), ["person"]) == []


def crossing(frame: int, track: int) -> AnalyticsEvent:
    return AnalyticsEvent("cam", "cross_in", "gate", frame, frame / 25, CAPTURE + frame, track, 0,
                          "person", 0.75, (1.0, 2.0, 3.0, 4.0))


@pytest.mark.parametrize(("end", "left"), [
    (EndOfStream("cam", 6), {"cam.events.jsonl"}),
    (EndOfStream("cam", 6, error="lost"), {"cam.events.partial.jsonl"}),
])
def test_events_are_written_one_per_line_and_renamed_when_complete(
        tmp_path: Path, end: EndOfStream, left: set[str]) -> None:
    (tmp_path / "cam.events.jsonl").write_text("older run\n")
    path = tmp_path / "cam.events.jsonl"
    sink = SinkStage("sink:cam", None, None, ["person"], events_path=path)
    sink.open()
    frames = [make_frame("cam", i, grey_image(16, 16)) for i in range(6)]
    first = replace(batch_detections([(f, []) for f in frames[:3]]),
                    events=(crossing(1, 4), crossing(2, 5)))
    second = batch_detections([(f, []) for f in frames[3:]])  # no events: nothing written
    third = replace(batch_detections([(frames[5], [])]), events=(crossing(5, 6),))
    for part in (first, second, third):
        sink.process(part)
    sink.end_of_stream(end)
    sink.close()
    assert {p.name for p in tmp_path.iterdir()} == left
    lines = (tmp_path / left.pop()).read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        crossing(1, 4).to_json(), crossing(2, 5).to_json(), crossing(5, 6).to_json()]
    assert json.loads(lines[0])["line"] == "gate"
