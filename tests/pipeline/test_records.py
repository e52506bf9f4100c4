"""The batch records: validation once per batch, per-frame views, the split by source and the
two ways the postprocess builds a ``BatchDetections`` (padded GPU rows, per-frame CPU lists)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from pipeline.records import AnalyticsEvent, BatchDetections, Detections, FrameBatch
from tests.support.batches import batch_detections, frame_batch, grey_image, make_frame


def three_frames() -> FrameBatch:
    return frame_batch([make_frame("a", 0, width=4, height=2), make_frame("b", 0, width=6, height=4),
                        make_frame("a", 1, width=4, height=2)], source_names=("a", "b"))


@pytest.mark.parametrize(("change", "message"), [
    ({"source": np.array([0, 1, 0], np.int64)}, "source must be int32, got int64"),
    ({"index": np.array([0, 0, 1], np.int32)}, "index must be int64, got int32"),
    ({"pts": np.zeros(3, np.float32)}, "pts must be float64, got float32"),
    ({"slot": np.full(3, -1, np.int64)}, "slot must be int32, got int64"),
    ({"width": np.array([4, 6], np.int32)}, r"width must have shape \(3\), got \(2,\)"),
    ({"capture_time": np.zeros((3, 1))}, r"capture_time must have shape \(3\), got \(3, 1\)"),
    ({"letterbox": np.zeros((3, 5), np.float32)},
     r"letterbox must have shape \(3, 6\), got \(3, 5\)"),
    ({"images": [None, None]}, "batch of 3 frames has 2 images and 3 rates"),
    ({"rates": [None] * 4}, "batch of 3 frames has 3 images and 4 rates"),
    ({"source": np.array([0, 2, 0], np.int32)}, "source ids must index 2 source names"),
    ({"source": np.array([0, -1, 0], np.int32)}, "source ids must index 2 source names"),
])
def test_frame_batch_validation(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        replace(three_frames(), **change)


def test_frame_batch_columns_and_helpers() -> None:
    frames = [make_frame("b", 7, width=4, height=2, pts=0.28, capture_time=5.0, slot=3),
              make_frame("a", 2, grey_image(6, 4), capture_time=6.0)]
    batch = frame_batch(frames, source_names=("a", "b"))
    assert len(batch) == 2
    assert batch.source.tolist() == [1, 0] and batch.index.tolist() == [7, 2]
    assert batch.width.tolist() == [4, 6] and batch.height.tolist() == [2, 4]
    assert batch.slot.tolist() == [3, -1] and batch.capture_time.tolist() == [5.0, 6.0]
    assert np.isnan(batch.pts[1]) and batch.pts_at(0) == 0.28 and batch.pts_at(1) is None
    assert [batch.source_name(0), batch.source_name(1)] == ["b", "a"]
    assert batch.images[0] is None and batch.images[1] is frames[1].image
    empty = frame_batch([], source_names=("a",))
    assert len(empty) == 0 and empty.letterbox.shape == (0, 6)


@pytest.mark.parametrize(("m", "offsets", "message"), [
    (2, [0, 1], r"offsets must have shape \(4\), got \(2,\)"),
    (2, [1, 1, 2, 2], r"offsets must rise from 0 to 2, got \[1, 1, 2, 2\]"),
    (2, [0, 1, 1, 3], r"offsets must rise from 0 to 2, got \[0, 1, 1, 3\]"),
    (2, [0, 2, 1, 2], r"offsets must rise from 0 to 2, got \[0, 2, 1, 2\]"),
])
def test_batch_detections_offsets_validation(m: int, offsets: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BatchDetections(three_frames(), np.zeros((m, 4), np.float32), np.zeros(m, np.float32),
                        np.zeros(m, np.int32), np.array(offsets, np.int64))


@pytest.mark.parametrize(("field", "value", "message"), [
    ("xyxy", np.zeros((2, 5), np.float32), r"xyxy must have shape \(2, 4\), got \(2, 5\)"),
    ("confidence", np.zeros(3, np.float32), r"confidence must have shape \(2\), got \(3,\)"),
    ("class_id", np.zeros(1, np.int32), r"class_id must have shape \(2\), got \(1,\)"),
])
def test_batch_detections_column_shapes(field: str, value: np.ndarray, message: str) -> None:
    columns = {"xyxy": np.zeros((2, 4), np.float32), "confidence": np.zeros(2, np.float32),
               "class_id": np.zeros(2, np.int32), field: value}
    with pytest.raises(ValueError, match=message):
        BatchDetections(three_frames(), offsets=np.array([0, 1, 1, 2]), **columns)


def box(i: float, score: float, cls: int) -> tuple[float, float, float, float, float, int]:
    return (i, i + 1, i + 2, i + 3, score, cls)


# A 3-source interleaved batch (source "d" is configured but absent; "c" has no detections).
NAMES = ("a", "b", "c", "d")
ROWS = [("a", 0, [box(0, 0.9, 1), box(1, 0.8, 2)]),
        ("b", 0, [box(2, 0.7, 3)]),
        ("c", 0, []),
        ("a", 1, []),
        ("b", 1, [box(3, 0.6, 4), box(4, 0.5, 5), box(5, 0.4, 6)]),
        ("a", 2, [box(6, 0.3, 7)]),
        ("c", 1, [])]


def interleaved() -> BatchDetections:
    return batch_detections([(make_frame(s, i, width=8, height=6, slot=k), boxes)
                             for k, (s, i, boxes) in enumerate(ROWS)], NAMES)


def test_batch_rows_are_views_of_the_flat_arrays() -> None:
    batch = interleaved()
    assert len(batch) == 7 and batch.offsets.tolist() == [0, 2, 3, 3, 3, 6, 7, 7]
    assert batch.counts.tolist() == [2, 1, 0, 0, 3, 1, 0]
    for row, (_, _, boxes) in enumerate(ROWS):
        detections = batch[row]
        assert isinstance(detections, Detections) and len(detections) == len(boxes)
        np.testing.assert_array_equal(detections.xyxy, np.array([b[:4] for b in boxes],
                                                                np.float32).reshape(-1, 4))
        np.testing.assert_array_equal(detections.confidence, np.float32([b[4] for b in boxes]))
        assert detections.class_id.tolist() == [b[5] for b in boxes]
        assert detections.class_id.dtype == np.int32
        if len(boxes):
            assert np.shares_memory(detections.xyxy, batch.xyxy)  # a view, not a copy
    batch[4].confidence[0] = 0.99  # writes through
    assert batch.confidence[3] == np.float32(0.99)


def expected_part(source: str) -> tuple[list[int], list[list[float]], list[float], list[int]]:
    """(frame indices, boxes, scores, class ids) of ``source``'s frames in batch order."""
    rows = [(i, boxes) for s, i, boxes in ROWS if s == source]
    boxes = [b for _, bs in rows for b in bs]
    return ([i for i, _ in rows], [list(b[:4]) for b in boxes],
            [np.float32(b[4]) for b in boxes], [b[5] for b in boxes])


def test_by_source_splits_once_keeping_batch_order() -> None:
    batch = interleaved()
    parts = batch.by_source()
    assert [name for name, _ in parts] == ["a", "b", "c"]  # "d" has no frame in the batch
    for name, part in parts:
        indices, boxes, scores, classes = expected_part(name)
        assert part.frames.source_names == NAMES
        assert [part.frames.source_name(r) for r in range(len(part))] == [name] * len(indices)
        assert part.frames.index.tolist() == indices
        assert part.xyxy.reshape(-1, 4).tolist() == boxes
        assert part.confidence.tolist() == scores and part.class_id.tolist() == classes
        assert part.frames.buffers is None
    a, b, c = (part for _, part in parts)
    assert a.offsets.tolist() == [0, 2, 2, 3] and a.frames.slot.tolist() == [0, 3, 5]
    assert b.offsets.tolist() == [0, 1, 4] and b.frames.slot.tolist() == [1, 4]
    assert c.offsets.tolist() == [0, 0, 0] and c.xyxy.shape == (0, 4)  # frames, no detections
    assert c.frames.slot.tolist() == [2, 6]
    # Detections follow their frames: frame b1's are the three boxes of ROWS[4].
    np.testing.assert_array_equal(b[1].xyxy, interleaved()[4].xyxy)


def test_by_source_of_a_single_source_batch_is_the_batch_itself() -> None:
    batch = batch_detections([(make_frame("b", i, width=4, height=2), [box(i, 0.5, 0)])
                              for i in range(3)], NAMES)
    [(name, part)] = batch.by_source()
    assert name == "b" and part is batch


def test_select_gathers_frames_and_their_detections_in_the_given_order() -> None:
    batch = interleaved()
    part = batch.select(np.array([4, 0, 3]))
    assert part.frames.index.tolist() == [1, 0, 1] and part.frames.source.tolist() == [1, 0, 0]
    assert part.offsets.tolist() == [0, 3, 5, 5]
    assert part.confidence.tolist() == [np.float32(s) for s in (0.6, 0.5, 0.4, 0.9, 0.8)]
    assert part.class_id.tolist() == [4, 5, 6, 1, 2]
    empty = batch.select(np.array([], np.int64))
    assert len(empty) == 0 and empty.offsets.tolist() == [0] and empty.xyxy.shape == (0, 4)


def test_device_pictures_are_kept_only_when_asked_and_follow_select() -> None:
    """``FrameBatch.device_pictures``: the frames' ``device_planes`` (stand-in objects here)
    when asked for and some frame has them; ``select`` takes them along."""
    frames = [make_frame("a", i, width=8, height=4) for i in range(3)]
    frames[0].device_planes, frames[2].device_planes = ("y0", "uv0"), ("y2", "uv2")
    letterbox = np.zeros((3, 6), np.float32)
    assert FrameBatch.from_frames(frames, {"a": 0}, ("a",), letterbox).device_pictures is None
    batch = FrameBatch.from_frames(frames, {"a": 0}, ("a",), letterbox, device_pictures=True)
    assert batch.device_pictures == [("y0", "uv0"), None, ("y2", "uv2")]
    assert batch.select(np.array([2, 1])).device_pictures == [("y2", "uv2"), None]
    for frame in frames:
        frame.device_planes = None
    assert FrameBatch.from_frames(frames, {"a": 0}, ("a",), letterbox,
                                  device_pictures=True).device_pictures is None


def test_from_padded_keeps_each_images_first_count_rows() -> None:
    frames = three_frames()
    d = 4
    # Rows past n (a larger max_batch) and past each image's count hold garbage.
    boxes = np.arange(4 * d * 4, dtype=np.float32).reshape(4, d, 4)
    scores = np.arange(4 * d, dtype=np.float32).reshape(4, d) / 100
    class_ids = np.arange(4 * d, dtype=np.int32).reshape(4, d)
    counts = np.array([0, d, 2, 3], np.int32)
    batch = BatchDetections.from_padded(frames, boxes, scores, class_ids, counts)
    assert batch.offsets.tolist() == [0, 0, 4, 6]
    assert len(batch[0]) == 0
    np.testing.assert_array_equal(batch[1].xyxy, boxes[1])
    np.testing.assert_array_equal(batch[2].xyxy, boxes[2, :2])
    np.testing.assert_array_equal(batch.confidence, np.concatenate([scores[1], scores[2, :2]]))
    assert batch.class_id.dtype == np.int32
    assert batch.class_id.tolist() == [*class_ids[1].tolist(), *class_ids[2, :2].tolist()]


def test_from_padded_with_no_detections() -> None:
    batch = BatchDetections.from_padded(three_frames(), np.ones((3, 5, 4), np.float32),
                                        np.ones((3, 5), np.float32), np.ones((3, 5), np.int32),
                                        np.zeros(3, np.int32))
    assert batch.offsets.tolist() == [0, 0, 0, 0] and batch.xyxy.shape == (0, 4)


def test_from_lists_concatenates_and_casts() -> None:
    frames = three_frames()
    per_frame = [
        (np.array([[1, 2, 3, 4]], np.float64), np.array([0.5]), np.array([7], np.int64)),
        (np.empty((0, 4), np.float32), np.empty(0, np.float32), np.empty(0, np.int32)),
        (np.array([[5, 6, 7, 8], [9, 10, 11, 12]], np.float32), np.float32([0.4, 0.3]),
         np.int32([1, 2])),
    ]
    batch = BatchDetections.from_lists(frames, per_frame)
    assert batch.offsets.tolist() == [0, 1, 1, 3]
    assert (batch.xyxy.dtype, batch.confidence.dtype, batch.class_id.dtype) == (
        np.float32, np.float32, np.int32)
    assert batch.xyxy.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    assert batch[2].class_id.tolist() == [1, 2] and len(batch[1]) == 0


def test_from_lists_of_an_empty_batch() -> None:
    batch = BatchDetections.from_lists(frame_batch([], source_names=("a",)), [])
    assert len(batch) == 0 and batch.offsets.tolist() == [0] and batch.xyxy.shape == (0, 4)


# -- track ids and analytics events -------------------------------------------------------

def tracked(batch: BatchDetections) -> BatchDetections:
    """``batch`` with track id 100 + row for every detection."""
    return replace(batch, tracker_id=100 + np.arange(len(batch.xyxy), dtype=np.int64))


def event(source: str, frame: int, kind: str = "cross_in", track: int = 1) -> AnalyticsEvent:
    return AnalyticsEvent(source, kind, "gate", frame, frame / 25, 1000.0 + frame, track, 2,
                          "car", 0.5, (1.0, 2.0, 3.0, 4.0))


@pytest.mark.parametrize(("value", "message"), [
    (np.zeros(6, np.int64), r"tracker_id must have shape \(7\), got \(6,\)"),
    (np.zeros(7, np.int32), "tracker_id must be int64, got int32"),
])
def test_tracker_id_is_validated(value: np.ndarray, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        replace(interleaved(), tracker_id=value)


def test_tracker_ids_follow_their_detections_through_views_select_keep_and_split() -> None:
    batch = tracked(interleaved())
    assert batch[4].tracker_id.tolist() == [103, 104, 105]
    assert batch[4][1:].tracker_id.tolist() == [104, 105] and interleaved()[4].tracker_id is None
    assert batch.select(np.array([4, 0])).tracker_id.tolist() == [103, 104, 105, 100, 101]
    kept = batch.keep(batch.confidence > 0.45)
    assert kept.tracker_id.tolist() == [100, 101, 102, 103, 104]
    parts = dict(batch.by_source())
    assert parts["a"].tracker_id.tolist() == [100, 101, 106]
    assert parts["b"].tracker_id.tolist() == [102, 103, 104, 105]
    assert parts["c"].tracker_id.tolist() == []
    assert interleaved().select(np.array([0])).tracker_id is None


def test_events_follow_their_frames_through_select_and_split() -> None:
    events = (event("a", 0), event("b", 1, "cross_out"), event("a", 2, track=7),
              event("a", 5))  # frame a5 is not in the batch
    batch = replace(interleaved(), events=events)
    parts = dict(batch.by_source())
    assert parts["a"].events == (events[0], events[2])
    assert parts["b"].events == (events[1],) and parts["c"].events == ()
    assert batch.select(np.array([5, 4])).events == (events[1], events[2])
    assert batch.keep(np.zeros(7, bool)).events == events  # the same frames


def test_analytics_event_json_and_validation() -> None:
    exit_event = AnalyticsEvent("cam", "exit", "dock", 12, None, 1000.1234567, 4, 0, None,
                                0.876543, (1.234, 2.0, 3.0, 4.0), 1.5)
    assert exit_event.region_type == "zone"
    assert exit_event.to_json() == {
        "source": "cam", "capture_time": 1000.123457, "pts": None, "frame": 12, "kind": "exit",
        "zone": "dock", "tracker_id": 4, "class_id": 0, "class_name": None,
        "confidence": 0.8765, "xyxy": [1.23, 2.0, 3.0, 4.0], "dwell_s": 1.5}
    assert replace(exit_event, pts=5.305299999999999).to_json()["pts"] == 5.3053  # rounded
    crossing = event("cam", 3).to_json()
    assert crossing["line"] == "gate" and "zone" not in crossing and "dwell_s" not in crossing
    for change, message in [({"kind": "entered"}, "kind must be one of enter, exit"),
                            ({"dwell_s": 1.0}, "dwell_s is set on exits only"),
                            ({"kind": "exit"}, "dwell_s is set on exits only"),
                            ({"kind": "exit", "dwell_s": -1.0}, "dwell_s must be a finite"),
                            ({"tracker_id": -1}, "tracker_id and frame must be >= 0"),
                            ({"xyxy": (1.0, 2.0)}, "xyxy must have 4 values")]:
        with pytest.raises(ValueError, match=message):
            replace(event("cam", 3), **change)
