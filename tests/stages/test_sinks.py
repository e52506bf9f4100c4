"""Sinks: batch parts become JSONL lines and MP4 frames; the outputs get their final names
only when complete, and play back; the parts' slots are released once each."""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import replace
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from structlog.testing import capture_logs

from pipeline.config import derived_output
from pipeline.records import AnalyticsEvent, BatchDetections, EndOfStream, Frame
from pipeline.resume import SETTINGS_ATTRIBUTE, RecordsSettings, read_origin, stamp_origin
from stages.sinks import (
    JsonlWriter,
    SinkStage,
    VideoPart,
    VideoWriter,
    detection_records,
    frame_ranges_text,
    frame_records,
    frames_without_video,
    older_video_path,
    partial_path,
    resumed_video_path,
    segment_path,
    video_span,
)
from tests.support import read_frames
from tests.support.batches import Box, batch_detections, grey_image, make_frame
from tests.support.ci import skip_unless_ci
from tests.support.harness import run_stage

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


def test_video_times_frames_by_their_number_so_a_live_source_s_drops_keep_real_time(
        tmp_path: Path, pictures: list[Frame]) -> None:
    numbers = [40, 41, 45, 46, 52]  # a live source's frames, 42-44 and 47-51 dropped
    frames = [replace(pictures[k], index=n) for k, n in enumerate(numbers)]
    writer = VideoWriter(tmp_path / "cam.mp4", crf=23)
    writer.write(batch_detections([(f, []) for f in frames]))
    writer.close(complete=True)
    decoded = read_frames(tmp_path / "cam.mp4")
    assert len(decoded) == 5  # each frame written once: no frame repeated into the gaps
    assert [round((f.time - decoded[0].time) * 25, 3) for f in decoded] == [0, 1, 5, 6, 12]


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
    assert run_stage(sink, [*parts(frames, part_size), *([end] if end else [])],
                     finish=end is not None) == []  # a sink passes nothing on
    return sink, released


OLDER = b"an older run's complete output"
CUT = {"cam.partial.mp4", "cam.partial.jsonl"}


@pytest.mark.parametrize(("count", "end", "left"), [
    (12, EndOfStream("cam", 12), {"cam.mp4", "cam.jsonl"}),  # ended: final names
    (12, EndOfStream("cam", 12, stopped=True, total=12), {"cam.mp4", "cam.jsonl"}),  # at its end
    (12, EndOfStream("cam", 12, error="lost"), CUT),
    (12, None, CUT),  # aborted: no end marker
    (12, EndOfStream("cam", 12, stopped=True, total=250), CUT),  # a file stopped before its end
    (12, EndOfStream("cam", 12, stopped=True), CUT),  # stopped, its length unknown
    (0, EndOfStream("cam", 0, error="cannot open"), set()),  # nothing written: nothing left
    (0, EndOfStream("cam", 0), set()),  # a complete run without a frame: no file either
])
def test_outputs_get_final_names_only_when_complete(tmp_path: Path, pictures: list[Frame],
                                                    count: int, end: EndOfStream | None,
                                                    left: set[str]) -> None:
    """A final name is only ever this run's complete file, or the older run's file untouched
    (only this run's rename replaces it)."""
    (tmp_path / "cam.mp4").write_bytes(OLDER)
    (tmp_path / "cam.partial.jsonl").write_text("older run\n")
    sink, _ = run_sink(tmp_path, pictures[:count], end)
    assert {p.name for p in tmp_path.iterdir()} == left | {"cam.mp4"}
    assert [w.frames for w in sink.writers] == [count, count]
    for name in left:
        if name.endswith(".mp4"):
            assert len(read_frames(tmp_path / name)) == count  # decoded with PyAV
        else:
            lines = (tmp_path / name).read_text().splitlines()
            assert [json.loads(line)["frame"] for line in lines] == list(range(count))
    if "cam.mp4" not in left:
        assert (tmp_path / "cam.mp4").read_bytes() == OLDER


def test_a_live_source_stopped_is_complete_and_one_without_frames_leaves_nothing(
        tmp_path: Path, pictures: list[Frame]) -> None:
    """A camera has no end: stopped (or removed), its outputs are final. Removed before its
    first frame, it leaves no file at all (not an empty ``cam.jsonl``)."""
    for count, left in ((4, {"cam.jsonl", "cam.mp4"}), (0, set())):
        folder = tmp_path / str(count)
        folder.mkdir()
        sink = SinkStage("sink:cam", folder / "cam.mp4", folder / "cam.jsonl", None, live=True)
        run_stage(sink, [*parts(pictures[:count], 2), EndOfStream("cam", count, stopped=True)])
        assert {p.name for p in folder.iterdir()} == left


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
    (5.305299999999999, [(0, 0, 175.999, 143, 0.5, 0)]),  # a looped pass's sum: rounded
]
EXPECTED = [
    {"source": "cam", "frame": 10, "pts": None, "capture_time": 1_700_000_000.123457,
     "detections": []},
    {"source": "cam", "frame": 11, "pts": 0.04, "capture_time": 1_700_000_001.123457,
     "detections": [
         {"class_id": 0, "class_name": "person", "confidence": 0.9, "xyxy": [1.0, 2.0, 30.0, 40.0]},
         {"class_id": 5, "confidence": 0.1235, "xyxy": [10.25, 33.33, 50.5, 60.13]}]},
    {"source": "cam", "frame": 12, "pts": 5.3053, "capture_time": 1_700_000_002.123457,
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
    (EndOfStream("cam", 6, error="lost"), {"cam.events.partial.jsonl", "cam.events.jsonl"}),
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
    # The end marker carries the exits of the objects still inside a zone: written last.
    closing = AnalyticsEvent("cam", "exit", "dock", 5, 0.2, CAPTURE + 5, 7, 0, "person", 0.5,
                             (1.0, 2.0, 3.0, 4.0), 0.12)
    sink.end_of_stream(replace(end, events=(closing,)))
    sink.close()
    assert {p.name for p in tmp_path.iterdir()} == left
    written = "cam.events.partial.jsonl" if end.error else "cam.events.jsonl"
    if end.error:  # the older run's file is left as it was
        assert (tmp_path / "cam.events.jsonl").read_text() == "older run\n"
    lines = (tmp_path / written).read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        crossing(1, 4).to_json(), crossing(2, 5).to_json(), crossing(5, 6).to_json(),
        closing.to_json()]
    assert json.loads(lines[0])["line"] == "gate"


# Segments: the pictures' capture times are CAPTURE + i (1 s apart) from 2023-11-14 22:13:20.12
# UTC, a multiple of 4 s: with segment_s 4, frames 0-3, 4-7 and 8-11 make three segments.
SEGMENT_S = 4.0
STAMPS = ["20231114T221320Z", "20231114T221324Z", "20231114T221328Z"]


def segmented_sink(folder: Path, clock: Any = None, keep_hours: float | None = None,
                   live: bool = True, segment_s: float | None = SEGMENT_S) -> SinkStage:
    """A sink of live source ``cam`` writing video, detections and events into ``folder``."""
    extra = {} if clock is None else {"clock": clock}
    return SinkStage("sink:cam", folder / "cam.mp4", folder / "cam.jsonl", ["person"],
                     live=live, events_path=folder / "cam.events.jsonl", segment_s=segment_s,
                     keep_hours=keep_hours, **extra)


def with_events(part: BatchDetections) -> BatchDetections:
    """``part`` with one line crossing on each of its frames."""
    return replace(part, events=tuple(crossing(i, i) for i in part.frames.index.tolist()))


def names(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


def test_segment_path_inserts_the_utc_time_of_the_first_frame() -> None:
    assert segment_path(Path("out/cam.mp4"), CAPTURE) == Path("out/cam.20231114T221320Z.mp4")
    assert segment_path(Path("cam.events.jsonl"), CAPTURE + 59.8) == \
        Path("cam.events.20231114T221419Z.jsonl")
    assert partial_path(segment_path(Path("cam.mp4"), CAPTURE)).name == \
        "cam.20231114T221320Z.partial.mp4"


def test_every_name_a_sink_makes_beside_its_output_is_one_the_config_keeps_for_it() -> None:
    """The config refuses another source's output under these names
    (``pipeline.config.derived_output``): a sink renames and deletes them as its own."""
    path = Path("out/cam.events.mp4")
    for made, kind in [(resumed_video_path(path, 1200), "part"),
                       (partial_path(resumed_video_path(path, 0)), "part"),
                       (older_video_path(path), "older"),
                       (segment_path(path, CAPTURE), "segment"),
                       (partial_path(segment_path(path, CAPTURE)), "segment")]:
        assert derived_output(made) == (path, kind), made
    assert derived_output(path) is None and derived_output(partial_path(path)) is None


def test_a_live_source_s_outputs_rotate_together_and_each_finished_segment_is_complete(
        tmp_path: Path, pictures: list[Frame]) -> None:
    sink = segmented_sink(tmp_path)
    sink.open()
    assert names(tmp_path) == set()  # a segment's files appear with its first frame
    for part in parts(pictures, 5):  # parts cut across the segment ends (4 and 8)
        sink.process(with_events(part))
    # The first two segments got their final names when the next one started.
    finished = {f"{stem}.{s}.{ext}" for s in STAMPS[:2]
                for stem, ext in (("cam", "mp4"), ("cam", "jsonl"), ("cam.events", "jsonl"))}
    # The open segment's MP4 appears with the encoder's first packet (x264 holds ~10 frames).
    running = {f"cam.{STAMPS[2]}.partial.jsonl", f"cam.events.{STAMPS[2]}.partial.jsonl"}
    assert names(tmp_path) == finished | running
    sink.end_of_stream(EndOfStream("cam", 12))
    sink.close()
    for k, stamp in enumerate(STAMPS):
        frames = list(range(4 * k, 4 * k + 4))
        assert [r["frame"] for r in map(json.loads, (tmp_path / f"cam.{stamp}.jsonl")
                                        .read_text().splitlines())] == frames
        assert [r["frame"] for r in map(json.loads, (tmp_path / f"cam.events.{stamp}.jsonl")
                                        .read_text().splitlines())] == frames
        decoded = read_frames(tmp_path / f"cam.{stamp}.mp4")
        assert len(decoded) == 4
        # Each segment is a video of its own: the last one has the wide frames' size.
        assert (decoded[0].width, decoded[0].height) == ((320, 136) if k == 2 else (176, 144))
    assert not any(".partial" in n for n in names(tmp_path))


@pytest.mark.parametrize(("live", "segment_s"), [(False, SEGMENT_S), (True, None)])
def test_a_file_source_or_no_segment_s_writes_one_file_per_output(
        tmp_path: Path, pictures: list[Frame], live: bool, segment_s: float | None) -> None:
    run_stage(segmented_sink(tmp_path, live=live, segment_s=segment_s),
              [*map(with_events, parts(pictures, 5)), EndOfStream("cam", 12)])
    assert names(tmp_path) == {"cam.mp4", "cam.jsonl", "cam.events.jsonl"}
    assert len(read_frames(tmp_path / "cam.mp4")) == 12


def test_a_cut_short_segmented_run_leaves_only_its_last_segment_partial(
        tmp_path: Path, pictures: list[Frame]) -> None:
    run_stage(segmented_sink(tmp_path),
              [*parts(pictures[:10], 3), EndOfStream("cam", 10, error="lost")])
    assert {n for n in names(tmp_path) if n.endswith(".mp4")} == {
        f"cam.{STAMPS[0]}.mp4", f"cam.{STAMPS[1]}.mp4", f"cam.{STAMPS[2]}.partial.mp4"}
    assert len(read_frames(tmp_path / f"cam.{STAMPS[2]}.partial.mp4")) == 2


def test_a_segment_name_an_earlier_run_took_moves_on_a_second(
        tmp_path: Path, pictures: list[Frame]) -> None:
    taken = tmp_path / f"cam.{STAMPS[0]}.partial.jsonl"  # a killed run's, same second
    taken.write_text("older run\n")
    run_stage(segmented_sink(tmp_path), [*parts(pictures[:2], 2), EndOfStream("cam", 2)])
    assert taken.read_text() == "older run\n"
    assert {"cam.20231114T221321Z.jsonl", "cam.20231114T221321Z.mp4"} <= names(tmp_path)


def test_retention_deletes_only_this_source_s_old_segments(
        tmp_path: Path, pictures: list[Frame]) -> None:
    now = [time.time()]
    old = now[0] - 3 * 3600
    keep = [  # not this source's segments, or not old: never deleted
        "cam.mp4", "cam.jsonl", "cam.partial.jsonl", "door.20231114T221320Z.mp4",
        "cam.20231114T221320Z.txt", "cam.2023-11-14.mp4", "notes.txt", "xcam.20231101T000000Z.mp4",
        "cam.events.20231101T000000Z.mp4", "cam.20231101T00000Z.jsonl"]
    recent = ["cam.20231101T020000Z.mp4"]  # one hour old: kept with keep_hours 2
    gone = ["cam.20231101T000000Z.mp4", "cam.20231101T000000Z.jsonl",
            "cam.events.20231101T000000Z.jsonl", "cam.20231101T001500Z.partial.mp4"]
    for name in keep + recent + gone:
        (tmp_path / name).write_text("x")
        mtime = now[0] - 3600 if name in recent else old
        os.utime(tmp_path / name, (mtime, mtime))
    sink = segmented_sink(tmp_path, clock=lambda: now[0], keep_hours=2)
    with capture_logs() as logs:
        sink.open()  # deletes at start
        assert names(tmp_path) == set(keep + recent)
        # Parts of frames 0-2 (first segment), 3-5 (the second starts at 4), 6-8 (the third
        # at 8), 1.5 h apart by the clock.
        for k, part in enumerate(parts(pictures[:9], 3)):
            sink.process(part)
            if k == 1:  # the second segment started 1.5 h on: "recent" was 2.5 h old
                assert recent[0] not in names(tmp_path)
                assert f"cam.{STAMPS[0]}.mp4" in names(tmp_path)  # 1.5 h old: kept
            now[0] += 1.5 * 3600
    sink.end_of_stream(EndOfStream("cam", 9))
    sink.close()
    # At the third segment's start, 3 h on, the first two (written "3 h ago") went too; the
    # open one never goes.
    ours = [f"{stem}.{s}.{ext}" for s in STAMPS[:2]
            for stem, ext in (("cam", "mp4"), ("cam", "jsonl"), ("cam.events", "jsonl"))]
    deleted = [Path(e["path"]).name for e in logs if e["event"] == "old segment deleted"]
    assert all(e["log_level"] == "info" for e in logs if e["event"] == "old segment deleted")
    assert sorted(deleted) == sorted(gone + recent + ours)
    assert names(tmp_path) == set(keep) | {
        f"cam.{STAMPS[2]}.mp4", f"cam.{STAMPS[2]}.jsonl", f"cam.events.{STAMPS[2]}.jsonl"}


# A resumed file's video, in parts: what the parts do not hold is said, an earlier run's video
# under the final name is moved aside, and every file a completing run deletes is logged.


def grey_frames(indexes: range | list[int]) -> list[Frame]:
    return [make_frame("cam", i, grey_image(64, 48), capture_time=CAPTURE + i,
                       rate=Fraction(25)) for i in indexes]


def cam_sink(folder: Path, video: bool = True, resume_from: int | None = None) -> SinkStage:
    return SinkStage("sink:cam", folder / "cam.mp4" if video else None, folder / "cam.jsonl",
                     None, resume_from=resume_from)


def events(logs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == name]


def warnings(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if e["log_level"] == "warning"]


@pytest.mark.parametrize(("killed_video", "older", "missing"), [
    (12, True, "12-29"),   # the killed run's part lost its tail (its open fragment)
    (0, False, "0-29"),    # it held no frame: deleted, its frames have records only
    (30, True, None),      # every frame has video; the earlier run's cam.mp4 is still wrong
    (30, False, None),     # nothing to warn of
])
def test_a_resumed_file_that_completes_says_which_frames_have_no_video_and_moves_the_older_aside(
        tmp_path: Path, killed_video: int, older: bool, missing: str | None) -> None:
    """A new user's run: complete, then killed at frame 30 (its MP4 holding the frames before
    its last fragment), then resumed to the end. ``cam.mp4`` of the first run stayed beside
    the new ``cam.jsonl``, and frames 0-29 had no video: nothing said so."""
    if older:
        (tmp_path / "cam.mp4").write_bytes(OLDER)  # the first, complete run's
    (tmp_path / "cam.jsonl").write_text("older run\n")
    (tmp_path / "cam.from-3.mp4").write_bytes(b"an older finished run's part")
    run_stage(cam_sink(tmp_path, video=False), parts(grey_frames(range(30)), 4),
              finish=False)  # killed: 30 records
    writer = VideoWriter(tmp_path / "cam.mp4", crf=23)  # ... and what its MP4 kept
    if killed_video:
        writer.write(parts(grey_frames(range(killed_video)), 100)[0])
        writer.close(complete=False)
    else:
        partial_path(tmp_path / "cam.mp4").write_bytes(b"")
    with capture_logs() as logs:
        run_stage(cam_sink(tmp_path, resume_from=30),
                  [*parts(grey_frames(range(30, 40)), 4), EndOfStream("cam", 40)])
    first = {"cam.from-0.mp4"} if killed_video else set()
    assert names(tmp_path) == {"cam.jsonl", "cam.from-30.mp4"} | first | (
        {"cam.older.mp4"} if older else set())
    assert [json.loads(line)["frame"] for line in
            (tmp_path / "cam.jsonl").read_text().splitlines()] == list(range(40))
    if older:  # moved, not lost
        assert (tmp_path / "cam.older.mp4").read_bytes() == OLDER
    if killed_video:
        assert len(read_frames(tmp_path / "cam.from-0.mp4")) == killed_video
        (named,) = [e for e in events(logs, "output written")
                    if e["path"] == str(tmp_path / "cam.from-0.mp4")]
        assert named["frames"] == killed_video and named["log_level"] == "info"
    # every file deleted is named
    (deleted,) = events(logs, "older video deleted: replaced by this run's")
    assert deleted["path"] == str(tmp_path / "cam.from-3.mp4")
    (records_written,) = [e for e in events(logs, "output written")
                          if e["path"] == str(tmp_path / "cam.jsonl")]
    assert records_written["replaced"] is True
    said = warnings(logs)
    if missing is None and not older:
        assert said == []
        return
    (warning,) = said
    assert warning["frames_without_video"] == missing
    assert warning["parts"] == [str(tmp_path / n) for n in sorted(first) + ["cam.from-30.mp4"]]
    assert warning["records"] == str(tmp_path / "cam.jsonl")
    text = warning["event"]
    assert text.startswith("the video of this resumed source is in parts (")
    assert (f"frames {missing} have records but no video" in text) == (missing is not None)
    if older:
        assert warning["earlier_video"] == str(tmp_path / "cam.older.mp4")
        assert text.endswith("cam.mp4 is an earlier run's video, which does not match these "
                             "records: moved to cam.older.mp4")
    else:
        assert warning["earlier_video"] is None and "earlier run" not in text


def test_a_resumed_file_that_completes_again_replaces_the_video_set_aside_before(
        tmp_path: Path) -> None:
    """Killed and resumed twice after a complete run: the second resume's ``cam.mp4`` (there
    from a complete run in between) replaces the first's ``cam.older.mp4``, and says so."""
    (tmp_path / "cam.mp4").write_bytes(OLDER)
    (tmp_path / "cam.older.mp4").write_bytes(b"an even older run's video")
    run_stage(cam_sink(tmp_path), parts(grey_frames(range(8)), 4), finish=False)  # killed
    with capture_logs() as logs:
        run_stage(cam_sink(tmp_path, resume_from=8),
                  [*parts(grey_frames(range(8, 12)), 4), EndOfStream("cam", 12)])
    assert names(tmp_path) == {"cam.jsonl", "cam.from-0.mp4", "cam.from-8.mp4", "cam.older.mp4"}
    assert (tmp_path / "cam.older.mp4").read_bytes() == OLDER
    (warning,) = warnings(logs)
    assert warning["frames_without_video"] is None
    assert warning["event"].endswith("moved to cam.older.mp4 (replacing the cam.older.mp4 there)")


@pytest.mark.parametrize("count", [6, 0])
def test_a_whole_run_deletes_the_parts_and_the_older_video_it_replaces_naming_each(
        tmp_path: Path, count: int) -> None:
    """A run that was not resumed and wrote the whole video replaces the final parts of
    resumed runs and the video set aside: each deletion is logged. One that completed
    without a frame wrote no video to replace them with: it deletes none of them. A part cut
    short goes at the start in both (``_delete_cut_parts``), logged."""
    earlier = ["cam.from-0.mp4", "cam.from-30.mp4", "cam.older.mp4"]
    (tmp_path / "cam.from-40.partial.mp4").write_bytes(b"x")
    others = ["cam.from-x.mp4", "cam.from-3.txt", "door.from-0.mp4", "cam.older.jsonl"]
    for name in earlier + others:
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "cam.mp4").write_bytes(OLDER)
    with capture_logs() as logs:
        run_stage(cam_sink(tmp_path), [*parts(grey_frames(range(count)), 4),
                                       EndOfStream("cam", count)])
    deleted = events(logs, "older video deleted: replaced by this run's")
    assert [e["path"] for e in events(logs, "an earlier run's unfinished output deleted: this "
                                            "run writes it anew")] == [
        str(tmp_path / "cam.from-40.partial.mp4")]
    if count:
        assert names(tmp_path) == {"cam.mp4", "cam.jsonl", *others}
        assert sorted(Path(e["path"]).name for e in deleted) == sorted(earlier)
        assert {(e["log_level"], tuple(e["replaced_by"])) for e in deleted} == {
            ("info", (str(tmp_path / "cam.mp4"),))}
        (video,) = [e for e in events(logs, "output written")
                    if e["path"] == str(tmp_path / "cam.mp4")]
        assert video["replaced"] is True and video["frames"] == count
    else:  # the older run's files stay, and no "output written" names them
        assert names(tmp_path) == {"cam.mp4", *earlier, *others}
        assert (tmp_path / "cam.mp4").read_bytes() == OLDER
        assert deleted == [] and events(logs, "output written") == []
        assert [e["path"] for e in events(logs, "no output written: no frame came")] == [
            str(tmp_path / "cam.jsonl"), str(tmp_path / "cam.mp4")]


def span(first: int, last: int | None) -> VideoPart:
    return VideoPart(Path(f"cam.from-{first}.mp4"), first, last, None)


@pytest.mark.parametrize(("first", "last", "spans", "missing"), [
    (0, 39, [(0, 11), (30, 39)], [(12, 29)]),
    (0, 39, [(30, 39)], [(0, 29)]),                        # the first part deleted
    (0, 39, [], [(0, 39)]),
    (0, 39, [(0, 29), (30, 39)], []),
    (0, 39, [(30, 39), (0, 11)], [(12, 29)]),              # in any order
    (0, 39, [(0, None), (30, 39)], []),                    # unreadable: not judged
    (0, 39, [(0, 11), (20, None), (30, 35)], [(12, 19), (36, 39)]),
    (5, 20, [(5, 9), (12, 20)], [(10, 11)]),               # records from start_frame 5
    (0, 9, [(0, 3), (20, 25)], [(4, 9)]),                  # a part past the records
])
def test_frames_without_video_are_the_records_no_part_spans(
        first: int, last: int, spans: list[tuple[int, int | None]],
        missing: list[tuple[int, int]]) -> None:
    assert frames_without_video(first, last, [span(*s) for s in spans]) == missing


def test_frame_ranges_text_and_video_part_checks() -> None:
    assert frame_ranges_text([(0, 37), (90, 90)]) == "0-37, 90"
    assert frame_ranges_text([]) == ""
    for bad in ((5, 4, 1), (-1, 3, 1), (0, 3, 0)):
        with pytest.raises(ValueError):
            VideoPart(Path("cam.from-0.mp4"), *bad)


def test_a_torn_last_fragment_is_cut_and_not_counted(tmp_path: Path) -> None:
    """A full disk tore a part's last fragment: PyAV's decode loop then failed on it
    (InvalidDataError) and the part's frames were counted with it (93 for 92 playable)."""
    from stages.sinks import cut_torn_fragment

    writer = VideoWriter(tmp_path / "cam.mp4", crf=23)
    for part in parts(grey_frames(range(150)), 10):  # 25 fps: a fragment every 50 frames
        writer.write(part)
    writer.close(complete=True)
    whole = (tmp_path / "cam.mp4").read_bytes()
    assert not cut_torn_fragment(tmp_path / "cam.mp4")  # whole: untouched
    assert (tmp_path / "cam.mp4").read_bytes() == whole
    assert len(read_frames(tmp_path / "cam.mp4")) == 150
    mdats = [i - 4 for i in range(len(whole)) if whole[i:i + 4] == b"mdat"]
    torn = tmp_path / "torn.mp4"
    torn.write_bytes(whole[:mdats[-1] + 100])  # the last fragment's data cut short
    assert cut_torn_fragment(torn)
    assert torn.read_bytes() == whole[:whole.rindex(b"moof") - 4]  # up to its header's start
    span = video_span(torn)
    assert span is not None and span[0] == len(read_frames(torn)) == 100  # each plays


def test_video_span_counts_frames_and_reads_the_last_one_s_number_past_drops(
        tmp_path: Path) -> None:
    writer = VideoWriter(tmp_path / "cam.mp4", crf=23)
    writer.write(parts(grey_frames([40, 41, 45, 46, 52]), 10)[0])  # a live source's drops
    writer.close(complete=True)
    assert (writer.first_index, writer.last_index) == (40, 52)
    assert video_span(tmp_path / "cam.mp4") == (5, 12)
    (tmp_path / "empty.mp4").write_bytes(b"")
    assert video_span(tmp_path / "empty.mp4") == (0, -1)
    (tmp_path / "junk.mp4").write_bytes(b"not an mp4 at all" * 100)
    assert video_span(tmp_path / "junk.mp4") is None  # kept, not judged


def test_a_records_write_that_fails_names_its_file(tmp_path: Path) -> None:
    """A full disk said only 'OSError: [Errno 28] No space left on device' (which file?)."""
    writer = JsonlWriter(tmp_path / "cam.jsonl", None)
    writer._file.close()
    writer._file = open("/dev/full", "w")  # every write fails: no space left
    with pytest.raises(OSError) as info:
        writer.write(parts(grey_frames(range(2)), 2)[0])
    assert str(info.value) == "[Errno 28] No space left on device: '/dev/full'"


def test_a_new_records_file_is_stamped_with_what_made_it_and_a_resumed_one_keeps_its_stamp(
        tmp_path: Path) -> None:
    """The settings stamped when a file source's records begin are the ones a resume is
    checked against (``pipeline.resume.check_settings``): a run that appends to them (whatever
    its settings) does not stamp them again, or the stamp would no longer say what made the
    first records."""
    then = RecordsSettings({"nms.conf_threshold": 0.25})
    origin = {"path": "/videos/cam.mp4", "size": 10, "mtime_ns": 1}
    sink = SinkStage("sink:cam", None, tmp_path / "cam.jsonl", None, origin=origin,
                     settings=then)
    (tmp_path / "probe").touch()
    if not stamp_origin(tmp_path / "probe", {}):  # this file system keeps none
        skip_unless_ci(f"{tmp_path}'s file system keeps no extended attributes",
                       "resume settings")
    run_stage(sink, parts(grey_frames(range(4)), 2), finish=False)  # killed
    partial = partial_path(tmp_path / "cam.jsonl")
    assert RecordsSettings.from_bytes(os.getxattr(partial, SETTINGS_ATTRIBUTE)) == then
    sink = SinkStage("sink:cam", None, tmp_path / "cam.jsonl", None, resume_from=4,
                     origin={**origin, "size": 11},
                     settings=RecordsSettings({"nms.conf_threshold": 0.4}))
    run_stage(sink, [*parts(grey_frames(range(4, 6)), 2), EndOfStream("cam", 6)])
    final = tmp_path / "cam.jsonl"
    assert len(final.read_text().splitlines()) == 6
    # renamed with the file: still the first run's
    assert RecordsSettings.from_bytes(os.getxattr(final, SETTINGS_ATTRIBUTE)) == then
    assert read_origin(final) == origin


def test_an_earlier_runs_unfinished_output_that_a_run_starts_anew_is_deleted_with_a_line(
        tmp_path):
    (tmp_path / "cam.partial.mp4").write_bytes(b"earlier video")
    (tmp_path / "cam.partial.jsonl").write_text('{"frame": 0}\n')
    sink = SinkStage("sink:cam", tmp_path / "cam.mp4", tmp_path / "cam.jsonl", ["person"])
    with capture_logs() as logs:
        sink.open()
    deleted = sorted(e["path"] for e in logs
                     if e["event"].startswith("an earlier run's unfinished output deleted"))
    assert deleted == [str(tmp_path / "cam.partial.jsonl"), str(tmp_path / "cam.partial.mp4")]
    sink.close()


def test_a_killed_runs_camera_output_gets_its_final_name_when_the_next_run_starts(
        tmp_path: Path) -> None:
    """A new user's camera: a run killed with kill -9 left cam.partial.jsonl and
    cam.partial.mp4 (a camera's output is complete whenever it stops); the next run deleted
    both, unlogged. Now they get their final names at the next start (torn tail cut), and
    that run's own output replaces them when it ends, as after a run that stopped."""
    live = SinkStage("sink:cam", tmp_path / "cam.mp4", tmp_path / "cam.jsonl", None, live=True)
    run_stage(live, parts(grey_frames(range(30)), 4), finish=False)  # killed: 30 records
    writer = VideoWriter(tmp_path / "cam.mp4", crf=23)  # ... and what its MP4 kept
    writer.write(parts(grey_frames(range(12)), 100)[0])
    writer.close(complete=False)
    with open(partial_path(tmp_path / "cam.jsonl"), "a") as records:
        records.write('{"frame": 30, "detecti')  # a line written halfway by the kill
    (tmp_path / "cam.mp4").write_bytes(OLDER)  # the run before it, which stopped
    with capture_logs() as logs:
        after = SinkStage("sink:cam", tmp_path / "cam.mp4", tmp_path / "cam.jsonl", None,
                          live=True)
        after.open()
        after.close()  # stopped before its first frame: the kept outputs stay
    assert names(tmp_path) == {"cam.jsonl", "cam.mp4"}
    assert [json.loads(line)["frame"] for line in
            (tmp_path / "cam.jsonl").read_text().splitlines()] == list(range(30))
    assert len(read_frames(tmp_path / "cam.mp4")) == 12  # the killed run's, not OLDER
    kept = events(logs, "an earlier run's unfinished output given its final name (that run "
                        "ended without it); this run's own replaces it when it ends")
    assert sorted((e["path"], e.get("replaced", False)) for e in kept) == [
        (str(tmp_path / "cam.jsonl"), False), (str(tmp_path / "cam.mp4"), True)]


def test_an_empty_unfinished_camera_output_is_deleted_not_kept(tmp_path: Path) -> None:
    (tmp_path / "cam.jsonl").write_text('{"frame": 0}\n')  # a stopped run's: stays
    partial_path(tmp_path / "cam.jsonl").write_text('{"frame": 0, "detec')  # torn, no line
    with capture_logs() as logs:
        after = SinkStage("sink:cam", None, tmp_path / "cam.jsonl", None, live=True)
        after.open()
        after.close()
    assert names(tmp_path) == {"cam.jsonl"}
    assert (tmp_path / "cam.jsonl").read_text() == '{"frame": 0}\n'
    (deleted,) = events(logs, "an earlier run's empty unfinished output deleted")
    assert deleted["path"] == str(partial_path(tmp_path / "cam.jsonl"))


def test_a_file_started_over_deletes_the_parts_earlier_resumed_runs_cut_short(
        tmp_path: Path) -> None:
    """A new user's --restart left bikes.from-127.partial.mp4 of an earlier resumed run; the
    restarted run, stopped and resumed, took that part for its own: frames 127-214 twice, the
    older run's video under the new records' name."""
    writer = VideoWriter(tmp_path / "cam.from-12.mp4", crf=23)  # a resumed run's part, cut
    writer.write(parts(grey_frames(range(12, 20)), 100)[0])
    writer.close(complete=False)
    (tmp_path / "cam.from-3.mp4").write_bytes(b"a finished run's part")  # final: stays
    with capture_logs() as logs:
        run_stage(cam_sink(tmp_path), parts(grey_frames(range(6)), 3), finish=False)
    assert "cam.from-12.partial.mp4" not in names(tmp_path)
    assert "cam.from-3.mp4" in names(tmp_path)  # until this run completes
    deleted = [e["path"] for e in events(logs, "an earlier run's unfinished output deleted: "
                                               "this run writes it anew")]
    assert deleted == [str(tmp_path / "cam.from-12.partial.mp4")]


def test_a_close_that_fails_leaves_the_sink_incomplete_and_says_so(tmp_path: Path) -> None:
    """A camera's outputs are complete when it stops, but their rename failed (a new user
    deleted the output folder mid-run): the sink is not complete (its source fails with the
    error; its summary once said error=None beside the run's error) and the error is told."""
    out = tmp_path / "out"
    sink = SinkStage("sink:cam", None, out / "cam.jsonl", ["person"], live=True)
    sink.open()
    sink.process(batch_detections([(make_frame("cam", 0, grey_image(176, 144)), [])]))
    sink.end_of_stream(EndOfStream("cam", 1))
    assert sink.complete
    for path in out.iterdir():
        path.unlink()
    out.rmdir()
    with capture_logs() as logs, pytest.raises(FileNotFoundError):
        sink.close()
    assert not sink.complete
    (told,) = [e for e in logs if e["event"] == "output incomplete"]
    assert told["error"].startswith("closing it failed: FileNotFoundError")
