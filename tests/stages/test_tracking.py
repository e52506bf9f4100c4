"""TrackerStage: ByteTrack ids per source on synthetic trajectories with known truth, and
the tracks' predicted boxes on the frames the detector skipped."""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction

import numpy as np
import pytest

from pipeline.records import BatchDetections, EndOfStream
from stages.sinks import frame_records
from stages.tracking import TrackerSettings, TrackerStage
from tests.support.batches import Box, batch_detections, make_frame

WIDTH, HEIGHT = 640, 360
SETTINGS = TrackerSettings(new_track_confidence=0.5, lost_s=1.0)


def moving_box(index: int, x0: float, vx: float, y: float = 100.0, score: float = 0.9,
               cls: int = 0, size: float = 40.0) -> Box:
    """The box of an object at x0 + vx * index (its left edge), ``size`` pixels square."""
    x = x0 + vx * index
    return (x, y, x + size, y + size, score, cls)


def batches(rows: list[tuple[str, int, list[Box], bool]], size: int = 4
            ) -> list[BatchDetections]:
    """Batches of ``size`` frames of (source, index, boxes, detected) rows, in order."""
    out = []
    for start in range(0, len(rows), size):
        chunk = rows[start:start + size]
        batch = batch_detections([(make_frame(s, i, width=WIDTH, height=HEIGHT, rate=Fraction(25),
                                              pts=i / 25), boxes) for s, i, boxes, _ in chunk],
                                 ("a", "b"))
        detect = np.array([d for *_, d in chunk], bool)
        out.append(replace(batch, frames=replace(batch.frames, detect=None if detect.all()
                                                 else detect)))
    return out


def run(stage: TrackerStage, rows: list[tuple[str, int, list[Box], bool]], size: int = 4
        ) -> list[tuple[str, int, np.ndarray, np.ndarray]]:
    """(source, index, boxes (k, 4), track ids (k,)) per frame, through ``stage``."""
    out = []
    for batch in batches(rows, size):
        (result,) = stage.process(batch)
        assert result.frames is batch.frames and result.tracker_id.dtype == np.int64
        for row in range(len(result)):
            frame = result[row]
            out.append((result.frames.source_name(row), int(result.frames.index[row]),
                        frame.xyxy.copy(), frame.tracker_id.copy()))
    return out


def test_two_objects_keep_one_id_each_and_their_boxes_are_untouched() -> None:
    rows = [("a", i, [moving_box(i, 20, 6), moving_box(i, 400, -5, y=200, score=0.8, cls=2)], True)
            for i in range(16)]
    stage = TrackerStage("track", {"a": SETTINGS})
    frames = run(stage, rows)
    assert frames[0][3].tolist() == [-1, -1]  # a new track is confirmed on its second frame
    ids = {tuple(track_ids.tolist()) for _, _, _, track_ids in frames[1:]}
    assert len(ids) == 1
    (first, second), = ids
    assert first >= 0 and second >= 0 and first != second
    for (*_, xyxy, _), (_, _, boxes, _) in zip(frames, rows):
        np.testing.assert_array_equal(xyxy, np.float32([b[:4] for b in boxes]))


def test_skipped_frames_show_the_predicted_boxes_and_do_not_age_the_tracks() -> None:
    """An object moving 8 px a frame, detected on every third frame: on the frames between,
    its track is shown where it is (within a few pixels once the filter knows its speed),
    with its id; the tracker itself is untouched: the detected frames get the ids a run
    without the skipped frames gives."""
    every = 3
    rows = [("a", i, [moving_box(i, 10, 8)] if i % every == 0 else [], i % every == 0)
            for i in range(60)]
    frames = run(TrackerStage("track", {"a": SETTINGS}), rows)
    track_ids = {int(ids[0]) for _, i, _, ids in frames if i >= every and len(ids)}
    assert len(track_ids) == 1 and track_ids.pop() >= 0
    for _, index, xyxy, ids in frames[every:]:
        assert len(ids) == 1, index  # predicted on every skipped frame, kept on every detected
        truth = np.array(moving_box(index, 10, 8)[:4])
        if index >= 5 * every and index % every:
            np.testing.assert_allclose(xyxy[0], truth, atol=3.0, err_msg=str(index))
    detected_only = run(TrackerStage("track", {"a": SETTINGS}), [r for r in rows if r[3]])
    assert [ids.tolist() for _, _, _, ids in detected_only] == \
        [ids.tolist() for _, i, _, ids in frames if i % every == 0]


def test_a_track_missed_on_a_detected_frame_is_not_predicted() -> None:
    """The object is last detected on frame 6; frames 7 and 8 are skipped, frame 9 detected
    without it, 10 and 11 skipped: only 7 and 8 show its predicted box."""
    rows = [("a", i, [moving_box(i, 10, 4)] if i % 3 == 0 and i <= 6 else [], i % 3 == 0)
            for i in range(12)]
    frames = run(TrackerStage("track", {"a": SETTINGS}), rows)
    assert [len(ids) for *_, ids in frames] == [1, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0]


def test_predicted_boxes_are_clipped_to_the_frame_or_left_out() -> None:
    """A 100-px object leaving through the right edge at 30 px a frame, detected on the even
    frames up to frame 8 (540..640): its prediction on frame 9 (~570..670) is clipped to the
    frame, the one on frame 13 (~690..790) is wholly outside and left out."""
    rows = [("a", i, [moving_box(i, 300, 30, size=100)] if i % 2 == 0 and i <= 8 else [],
             i % 2 == 0 and i <= 8) for i in range(14)]
    frames = run(TrackerStage("track", {"a": SETTINGS}), rows)
    for _, index, xyxy, _ in frames:
        assert ((xyxy >= 0) & (xyxy <= [WIDTH, HEIGHT, WIDTH, HEIGHT])).all(), index
    assert len(frames[9][3]) == 1 and frames[9][2][0][2] == WIDTH
    assert frames[9][2][0][0] > 540
    assert len(frames[13][3]) == 0


def test_sources_are_tracked_apart_and_untracked_ones_get_minus_one() -> None:
    alone = [("a", i, [moving_box(i, 20, 6)], True) for i in range(8)]
    other = [("b", i, [moving_box(i, 20, 6)], True) for i in range(8)]
    mixed = [row for pair in zip(alone, other) for row in pair]
    frames = run(TrackerStage("track", {"a": SETTINGS}), mixed, size=3)
    expected = [ids.tolist() for *_, ids in run(TrackerStage("track", {"a": SETTINGS}), alone)]
    assert [ids.tolist() for s, *_, ids in frames if s == "a"] == expected
    assert [ids.tolist() for s, *_, ids in frames if s == "b"] == [[-1]] * 8
    both = run(TrackerStage("track", {"a": SETTINGS, "b": SETTINGS}), mixed, size=3)
    assert [ids.tolist() for s, *_, ids in both if s == "b"] == expected  # a tracker each


def test_a_low_score_detection_continues_a_track_but_starts_none() -> None:
    weak = [("a", i, [moving_box(i, 20, 6, score=0.4)], True) for i in range(6)]
    assert all(ids.tolist() == [-1] for *_, ids in run(TrackerStage("track", {"a": SETTINGS}),
                                                        weak))
    fading = [("a", i, [moving_box(i, 20, 6, score=0.9 if i < 3 else 0.4)], True)
              for i in range(8)]
    ids = [ids.tolist() for *_, ids in run(TrackerStage("track", {"a": SETTINGS}), fading)]
    assert ids[0] == [-1] and len({tuple(i) for i in ids[1:]}) == 1 and ids[-1][0] >= 0


def test_end_of_stream_forgets_the_source() -> None:
    stage = TrackerStage("track", {"a": SETTINGS})
    rows = [("a", i, [moving_box(i, 20, 6)], True) for i in range(4)]
    first = run(stage, rows)
    assert stage.end_of_stream(EndOfStream("a", 4)) == (EndOfStream("a", 4),)
    again = run(stage, rows)
    assert [ids.tolist() for *_, ids in again] == [ids.tolist() for *_, ids in first]


@pytest.mark.parametrize("class_aware", [False, True])
def test_a_resumed_source_numbers_its_tracks_on_from_its_first_id(class_aware: bool) -> None:
    """A source resumed after its records (``pipeline.resume.next_tracker_id``) gets the ids
    a fresh one gets, offset by its first id: on detected frames and on the predicted boxes
    of skipped ones, whatever the class; the other sources, and the same name added again
    without one, count from 0."""
    settings = replace(SETTINGS, class_aware=class_aware)
    rows = [("a", i, [moving_box(i, 20, 6), moving_box(i, 500, -6, y=250, score=0.8, cls=CAR)]
             if i % 3 != 2 else [], i % 3 != 2) for i in range(12)]
    fresh = [ids.tolist() for *_, ids in run(TrackerStage("track", {"a": settings}), rows)]
    assert sorted({i for ids in fresh for i in ids}) == [-1, 0, 1]
    shifted = [[i + 27 if i >= 0 else -1 for i in ids] for ids in fresh]
    stage = TrackerStage("track", {})
    stage.add_source("a", settings, first_id=27)  # as ``SourceControl.add(resume=True)``
    assert [ids.tolist() for *_, ids in run(stage, rows)] == shifted
    stage.end_of_stream(EndOfStream("a", 12))
    stage.add_source("a", settings)  # the name used again, not resumed: from 0
    assert [ids.tolist() for *_, ids in run(stage, rows)] == fresh
    both = TrackerStage("track", {"b": settings})
    both.add_source("a", settings, first_id=27)
    mixed = [row for pair in zip(rows, [("b", *rest) for _, *rest in rows]) for row in pair]
    frames = run(both, mixed)
    assert [ids.tolist() for s, *_, ids in frames if s == "a"] == shifted
    assert [ids.tolist() for s, *_, ids in frames if s == "b"] == fresh


@pytest.mark.parametrize("tracked", [True, False])
def test_json_records_carry_track_ids_of_tracked_sources(tracked: bool) -> None:
    rows = [("a", i, [moving_box(i, 20, 6)] if i != 2 else [], i != 2) for i in range(4)]
    (result,) = TrackerStage("track", {"a": SETTINGS}).process(batches(rows)[0])
    records = frame_records(result, ["person"], tracked=tracked)
    ids = [[d.get("tracker_id") for d in r["detections"]] for r in records]
    if tracked:
        assert ids[0] == [-1] and ids[1] == ids[2] == ids[3] and ids[1][0] >= 0
        assert ids[1] == result.tracker_id[1:2].tolist()
    else:
        assert ids == [[None]] * 4
    assert [r.get("detected", True) for r in records] == [True, True, False, True]


CAR, BUS, PERSON = 2, 5, 0


def classes_of_ids(frames: list[tuple[str, int, np.ndarray, np.ndarray]],
                   rows: list[tuple[str, int, list[Box], bool]]) -> dict[int, set[int]]:
    """Track id -> the classes of the detections it was given (detected frames only)."""
    seen: dict[int, set[int]] = {}
    for (_, _, _, ids), (_, _, boxes, detected) in zip(frames, rows):
        if detected:
            for track_id, box in zip(ids.tolist(), boxes):
                if track_id >= 0:
                    seen.setdefault(track_id, set()).add(int(box[5]))
    return seen


@pytest.mark.parametrize(("class_aware", "classes_per_id"), [
    (False, [{CAR, BUS, PERSON}, {CAR}]),  # one tracker: the flickering object's id changes class
    (True, [{CAR}, {CAR}, {BUS}, {PERSON}]),  # per class: each id keeps one class
])
def test_class_aware_ids_never_change_class(class_aware: bool,
                                            classes_per_id: list[set[int]]) -> None:
    """Object 1 is called a car (frames 0-7), a bus (8-15), then a person (16-23), where it
    is; object 2, a car, drives past it. Class aware, every id has one class and ids stay
    unique across the classes' trackers; ids of a class-aware tracker on its frames skipped
    by the detector keep their class too."""
    def label(i: int) -> int:
        return CAR if i < 8 else BUS if i < 16 else PERSON
    rows = [("a", i, [moving_box(i, 20, 6, cls=label(i)),
                      moving_box(i, 500, -6, y=250, score=0.8, cls=CAR)], True)
            for i in range(24)]
    settings = replace(SETTINGS, class_aware=class_aware)
    frames = run(TrackerStage("track", {"a": settings}), rows)
    seen = classes_of_ids(frames, rows)
    assert sorted(seen.values(), key=lambda c: (len(c), sorted(c))) == sorted(
        classes_per_id, key=lambda c: (len(c), sorted(c)))
    if class_aware:  # on the frames the detector skips, predictions keep their class too
        skipping = [(s, i, boxes if i % 2 == 0 else [], i % 2 == 0) for s, i, boxes, _ in rows]
        stage, classes = TrackerStage("track", {"a": settings}), {}
        for batch in batches(skipping):
            (out,) = stage.process(batch)
            for track_id, cls in zip(out.tracker_id.tolist(), out.class_id.tolist()):
                if track_id >= 0:
                    classes.setdefault(track_id, set()).add(cls)
        assert len(classes) == 4 and all(len(c) == 1 for c in classes.values()), classes
