"""AnalyticsStage: zone and line counting on synthetic trajectories whose events are known
by construction (crossings both ways, jitter on the line, a brief track, leaving and
re-entering a zone, a track lost inside a zone, tracks still inside when the source ends)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from fractions import Fraction

import numpy as np
import pytest
from structlog.testing import capture_logs

from pipeline.config import AnalyticsRegionConfig, ConfigError, SourceConfig
from pipeline.records import AnalyticsEvent, BatchDetections, EndOfStream
from stages.analytics import AnalyticsCounts, AnalyticsStage, Region, SourceAnalytics
from tests.support.batches import batch_detections, make_frame

NAMES = ["person", "bicycle", "car"]
PERSON, BICYCLE, CAR = 0, 1, 2
WIDTH, HEIGHT = 640, 360
RATE = 25  # frames/s: frame f has pts f / 25

# Per track: (class, anchor x, anchor y per frame from frame 0; None: not in that frame).
# The anchor is the bottom centre of the box (x - 10, y - 40, x + 10, y).
Track = tuple[int, float, list[float | None]]

# Line "gate": (0, 100) -> (200, 100), drawn left to right: moving down (y growing) is in.
# margin 3 px, 2 frames on the new side, tracks count from their 3rd frame.
GATE = AnalyticsRegionConfig("line", "gate", start=[0, 100], end=[200, 100])
# Zone "dock": the square x 300..400, y 0..100, persons only; same margin and frames.
DOCK = AnalyticsRegionConfig("zone", "dock", polygon=[[300, 0], [400, 0], [400, 100], [300, 100]],
                             classes=["person"])
FORGET_S = 0.5  # a track unseen longer than this is gone

TRACKS: dict[int, Track] = {
    # Down across the gate: seen above from frame 2 (its 3rd frame), below on 4 and 5.
    1: (PERSON, 50, [80, 85, 90, 95, 105, 110, 115]),
    # Up across the gate; frame 4 (y 102) is within the margin and tells nothing.
    2: (CAR, 100, [130, 125, 120, 110, 102, 96, 90]),
    # Down across on frames 3-4, then jitter: one frame at a time on the wrong side (5, 7,
    # 12), or within the margin (9, 10, 15-18, three frames in a row above the line).
    3: (BICYCLE, 150, [80, 85, 90, 108, 110, 95, 106, 94, 107, 101, 99, 104, 96, 110, 115,
                       99, 98, 99, 101, 120]),
    # Crosses in its 2nd and 3rd frames: counts from its 3rd only, so first seen below.
    4: (PERSON, 60, [None] * 10 + [80, 110, 120]),
    # Crosses the gate's line beyond its end (x 250 > 200).
    5: (CAR, 250, [80, 85, 90, 110, 115, 120, 125]),
    # Into the dock (frames 3, 4), out (8, 9; frame 7 is within the margin), in again
    # (10, 11), out again (13, 14), gone.
    10: (PERSON, 350, [130, 120, 110, 95, 90, 80, 70, 102, 110, 120, 95, 90, 85, 110, 115]),
    # First seen inside the dock; lost after frame 4: not seen on frames 5 and 6, it exits.
    11: (PERSON, 320, [50, 50, 50, 50, 50]),
    # A car through the dock: the dock counts persons only.
    12: (CAR, 380, [130, 120, 110, 90, 70, 50, 30]),
}
UNTRACKED = (PERSON, 120, [80, 90, 100, 110, 120, 130])  # tracker_id -1 across the gate
FRAMES = 20

# (frame, kind, region, track, class, dwell_s): derived from the trajectories above.
EXPECTED = [
    (3, "enter", "dock", 11, PERSON, None),        # inside on 2 and 3
    (4, "cross_in", "gate", 3, BICYCLE, None),     # below on 3 and 4
    (4, "enter", "dock", 10, PERSON, None),        # inside on 3 and 4
    (5, "cross_in", "gate", 1, PERSON, None),      # below on 4 and 5
    (6, "cross_out", "gate", 2, CAR, None),        # above on 5 and 6
    (6, "exit", "dock", 11, PERSON, (4 - 2) / RATE),  # lost: missing on 5 and 6
    (9, "exit", "dock", 10, PERSON, (7 - 3) / RATE),  # inside from frame 3 to 7 (margin)
    (11, "enter", "dock", 10, PERSON, None),
    (14, "exit", "dock", 10, PERSON, (12 - 10) / RATE),
]


def region(config: AnalyticsRegionConfig, key: str = "sources[0].analytics[0]") -> Region:
    config.check(key)
    return Region.from_config(key, config, SourceConfig("cam", "cam.mp4"), NAMES, len(NAMES))


def frame_rows(tracks: dict[int, Track], frames: int, source: str = "cam"
               ) -> list[tuple[str, int, list[tuple[int, int, float, float]]]]:
    """Per frame: (source, index, [(track id, class, anchor x, anchor y)])."""
    rows = []
    for index in range(frames):
        present = [(track_id, cls, x, ys[index]) for track_id, (cls, x, ys) in tracks.items()
                   if index < len(ys) and ys[index] is not None]
        rows.append((source, index, present))
    return rows


def batch_of(rows: list[tuple[str, int, list[tuple[int, int, float, float]]]]) -> BatchDetections:
    batch = batch_detections(
        [(make_frame(source, index, width=WIDTH, height=HEIGHT, pts=index / RATE,
                     rate=Fraction(RATE)),
          [(x - 10, y - 40, x + 10, y, 0.8, cls) for _, cls, x, y in present])
         for source, index, present in rows], ("cam", "other"))
    ids = [track_id for _, _, present in rows for track_id, *_ in present]
    return replace(batch, tracker_id=np.array(ids, np.int64))


def run(stage: AnalyticsStage, rows: list, size: int = 4) -> list[AnalyticsEvent]:
    events = []
    for start in range(0, len(rows), size):
        batch = batch_of(rows[start:start + size])
        (out,) = stage.process(batch)
        assert out.frames is batch.frames and out.tracker_id is batch.tracker_id
        assert [(e.source, e.frame) for e in out.events] == sorted(
            (e.source, e.frame) for e in out.events)  # in frame order
        events.extend(out.events)
    return events


def summary(events: list[AnalyticsEvent]) -> list[tuple]:
    return [(e.frame, e.kind, e.region, e.tracker_id, e.class_id,
             None if e.dwell_s is None else pytest.approx(e.dwell_s)) for e in events]


def test_events_of_known_trajectories() -> None:
    tracks = {**TRACKS, -1: UNTRACKED}
    stage = AnalyticsStage("analytics", {"cam": [region(GATE), region(DOCK)]}, NAMES,
                           {"cam": FORGET_S})
    # The same tracks on a source without analytics, interleaved: nothing for it.
    rows = [row for pair in zip(frame_rows(tracks, FRAMES), frame_rows(tracks, FRAMES, "other"))
            for row in pair]
    events = run(stage, rows, size=3)
    assert summary(events) == [(f, k, r, t, c, None if d is None else pytest.approx(d))
                               for f, k, r, t, c, d in EXPECTED]
    for event in events:
        assert event.source == "cam" and event.pts == pytest.approx(event.frame / RATE)
        assert event.class_name == NAMES[event.class_id] and event.confidence == pytest.approx(0.8)
    x = TRACKS[3][1]
    assert events[1].xyxy == pytest.approx((x - 10, 110 - 40, x + 10, 110))  # its box then
    assert stage.counts() == {"cam": {
        "zones": {"dock": {"inside": {"person": 0}, "entered": {"person": 3},
                           "exited": {"person": 3}}},
        "lines": {"gate": {"in": {"bicycle": 1, "car": 0, "person": 1},
                           "out": {"bicycle": 0, "car": 1, "person": 0}}}}}


def test_a_brief_track_counts_with_a_lower_minimum() -> None:
    """Track 4 crosses in its 2nd and 3rd frames: counted only when tracks count from their
    1st frame."""
    brief = {4: TRACKS[4]}
    for minimum, expected in ((3, []), (1, [(12, "cross_in", "gate", 4, PERSON, None)])):
        gate = region(replace(GATE, min_track_frames=minimum))
        stage = AnalyticsStage("analytics", {"cam": [gate]}, NAMES, {"cam": FORGET_S})
        assert summary(run(stage, frame_rows(brief, 14))) == expected


def test_jitter_counts_once_and_without_hysteresis_more_than_once() -> None:
    jitter = {3: TRACKS[3]}
    stage = AnalyticsStage("analytics", {"cam": [region(GATE)]}, NAMES, {"cam": FORGET_S})
    assert [e.kind for e in run(stage, frame_rows(jitter, FRAMES))] == ["cross_in"]
    bare = region(replace(GATE, margin_px=0.0, min_frames=1))
    stage = AnalyticsStage("analytics", {"cam": [bare]}, NAMES, {"cam": FORGET_S})
    assert len(run(stage, frame_rows(jitter, FRAMES))) > 3


@pytest.mark.parametrize(("start", "end", "path", "kind"), [
    ((0, 100), (200, 100), ("y", 100, 60, 140), "cross_in"),   # drawn rightwards, moving down
    ((200, 100), (0, 100), ("y", 100, 60, 140), "cross_out"),  # drawn leftwards, moving down
    ((100, 0), (100, 200), ("x", 100, 140, 60), "cross_in"),   # drawn downwards, moving left
    ((100, 0), (100, 200), ("x", 100, 60, 140), "cross_out"),  # drawn downwards, moving right
])
def test_line_direction(start: tuple, end: tuple, path: tuple, kind: str) -> None:
    """In: from the left of start -> end to its right, as the picture is shown (y down)."""
    axis, other, begin, finish = path
    steps = np.linspace(begin, finish, 9).tolist()
    ys = steps if axis == "y" else [150.0] * 9  # a vertical move keeps x; else x moves
    xs = [other] * 9 if axis == "y" else steps
    rows = [("cam", i, [(7, CAR, xs[i] if axis == "x" else 100.0, ys[i] if axis == "y"
                         else 150.0)]) for i in range(9)]
    line = region(AnalyticsRegionConfig("line", "l", start=list(start), end=list(end)))
    stage = AnalyticsStage("analytics", {"cam": [line]}, NAMES, {"cam": FORGET_S})
    assert [e.kind for e in run(stage, rows)] == [kind]


# Zones reaching the frame's border (640 x 360): "kerb", the band y 200..360 (its left,
# bottom and right edges on the border), and "east", the right half (x 320..640, top to bottom).
KERB = AnalyticsRegionConfig("zone", "kerb", polygon=[[0, 200], [WIDTH, 200], [WIDTH, HEIGHT],
                                                      [0, HEIGHT]])
EAST = AnalyticsRegionConfig("zone", "east", polygon=[[320, 0], [WIDTH, 0], [WIDTH, HEIGHT],
                                                      [320, HEIGHT]])
AT_THE_BORDER: dict[int, Track] = {
    30: (PERSON, 300, [HEIGHT] * 12),       # anchor on the bottom border (a box the frame cut)
    31: (CAR, 500, [HEIGHT - 1.5] * 12),    # 1.5 px from the border; in both zones
    32: (PERSON, 0, [300] * 12),            # on the left border
    33: (CAR, 100, [HEIGHT + 3] * 12),      # a box past the frame: its anchor taken on the border
    # On the bottom border but 1 px from east's inner edge (x 320): east's margin still holds.
    35: (PERSON, 321, [HEIGHT] * 12),
    # Across kerb's inner edge (y 200), jittering within its margin (frames 3-5, 8-9): in on
    # frames 6-7, out on 10-11.
    34: (BICYCLE, 100, [190, 190, 190, 202, 198, 201, 206, 208, 199, 197, 195, 194]),
}


def test_a_zone_reaching_the_frame_border_counts_objects_on_it() -> None:
    """Nothing crosses the frame's border: an anchor on or near a zone's edge that lies on the
    border, inside the polygon otherwise, is inside (with the margin there, a box cut off by
    the frame never entered); the margin still holds along the zone's other edges, up to the
    border."""
    stage = AnalyticsStage("analytics", {"cam": [region(KERB), region(EAST)]}, NAMES,
                           {"cam": FORGET_S})
    events = run(stage, frame_rows(AT_THE_BORDER, 12))
    assert summary(events) == [
        (3, "enter", "kerb", 30, PERSON, None),  # counted from its 3rd frame, 2 frames inside
        (3, "enter", "kerb", 31, CAR, None),
        (3, "enter", "kerb", 32, PERSON, None),
        (3, "enter", "kerb", 33, CAR, None),
        (3, "enter", "kerb", 35, PERSON, None),
        (3, "enter", "east", 31, CAR, None),
        (7, "enter", "kerb", 34, BICYCLE, None),
        (11, "exit", "kerb", 34, BICYCLE, pytest.approx((9 - 6) / RATE)),  # 8-9: the margin
    ]
    zones = stage.counts()["cam"]["zones"]
    assert zones["kerb"]["inside"] == {"bicycle": 0, "car": 2, "person": 3}
    assert zones["east"]["inside"] == {"car": 1}


@pytest.mark.parametrize(("end", "kinds"), [
    ((300, HEIGHT), ["cross_out"]),  # its end on the border: counted there too
    ((300, 300), []),                # its end inside the frame: beyond it, nothing counts
])
def test_a_line_ending_on_the_frame_border_counts_crossings_at_the_border(
        end: tuple, kinds: list[str]) -> None:
    """A slanted line from (200, 0): an object moving right along the bottom border crosses
    it, or the line beyond its end (x 320), at the border. Where the line ends on the border
    its band (crossings count between its ends, perpendicular to it) takes in the frame up
    to the border: without that, every place right of x 300 on the border lay outside it."""
    xs = np.linspace(260, 360, 11).tolist()
    rows = [("cam", i, [(8, PERSON, x, float(HEIGHT))]) for i, x in enumerate(xs)]
    line = region(AnalyticsRegionConfig("line", "slant", start=[200, 0], end=list(end)))
    stage = AnalyticsStage("analytics", {"cam": [line]}, NAMES, {"cam": FORGET_S})
    assert [e.kind for e in run(stage, rows)] == kinds


def test_a_zone_counts_frames_in_a_row_not_sightings_apart() -> None:
    """Seen inside the dock on frame 5, unseen on 6-9 (its track kept), inside again on 10
    and 11: it enters on 11, from 10 (a new user's car entered on two sightings 23 frames
    apart, its dwell counted from the first)."""
    person = {9: (PERSON, 350, [150, 150, 150, None, None, 50, None, None, None, None, 50, 50,
                                150, 150])}
    stage = AnalyticsStage("analytics", {"cam": [region(DOCK)]}, NAMES, {"cam": FORGET_S})
    assert summary(run(stage, frame_rows(person, 14))) == [
        (11, "enter", "dock", 9, PERSON, None),
        (13, "exit", "dock", 9, PERSON, pytest.approx((11 - 10) / RATE))]


def test_a_camera_region_outside_its_frame_is_left_out_with_an_error() -> None:
    """A camera's frame size is known at its first frame: a zone reaching beyond it is logged
    and left out; the source's other regions count on."""
    far = region(AnalyticsRegionConfig("zone", "far", polygon=[[600, 0], [700, 0], [700, 50]]),
                 "sources[0].analytics[1]")
    assert far.frame_error(640, 360) == ("sources[0].analytics[1].polygon: zone 'far' has the "
                                         "point [700, 0] outside the 640x360 frame")
    assert far.frame_error(700, 360) is None
    stage = AnalyticsStage("analytics", {"cam": [region(GATE), far]}, NAMES, {"cam": FORGET_S})
    with capture_logs() as logs:
        events = run(stage, frame_rows({1: TRACKS[1]}, 8))
    assert [e.kind for e in events] == ["cross_in"]
    assert [(entry["log_level"], entry["event"], entry["reason"]) for entry in logs] == [
        ("error", "analytics region disabled", far.frame_error(640, 360))]
    assert "far" in stage.counts()["cam"]["zones"]  # reported, at zero


def test_an_unknown_class_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"^sources\[0\].analytics\[0\].classes: the model has "
                                          r"no class 'unicorn' \(its classes: person, bicycle, "
                                          r"car\)$"):
        region(replace(GATE, classes=["car", "unicorn"]))
    assert region(replace(GATE, classes=["car", 1])).class_ids == frozenset({CAR, BICYCLE})


def test_counts_are_a_running_sum_of_events() -> None:
    counts = AnalyticsCounts([region(GATE), region(DOCK)], NAMES)
    assert counts.to_json() == {
        "zones": {"dock": {"inside": {"person": 0}, "entered": {"person": 0},
                           "exited": {"person": 0}}},
        "lines": {"gate": {"in": {}, "out": {}}}}
    for kind, name, cls in (("cross_in", "gate", CAR), ("cross_in", "gate", CAR),
                            ("cross_out", "gate", PERSON), ("enter", "dock", PERSON),
                            ("enter", "dock", PERSON), ("exit", "dock", PERSON)):
        counts.apply(AnalyticsEvent("cam", kind, name, 1, None, 0.0, 1, cls, NAMES[cls], 0.5,
                                    (0.0, 0.0, 1.0, 1.0), 0.0 if kind == "exit" else None))
    assert counts.to_json() == {
        "zones": {"dock": {"inside": {"person": 1}, "entered": {"person": 2},
                           "exited": {"person": 1}}},
        "lines": {"gate": {"in": {"car": 2, "person": 0}, "out": {"car": 0, "person": 1}}}}


class Recorder:
    """A publisher that keeps what it is given."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []
        self.counts: list[tuple[str, dict]] = []

    def publish_event(self, source: str, event: dict) -> None:
        self.events.append((source, event))

    def publish_counts(self, source: str, counts: dict) -> None:
        self.counts.append((source, counts))


def test_the_publisher_gets_every_event_and_the_counts_after_each_change() -> None:
    recorder = Recorder()
    stage = AnalyticsStage("analytics", {"cam": [region(GATE), region(DOCK)]}, NAMES,
                           {"cam": FORGET_S}, [recorder])
    events = run(stage, frame_rows(TRACKS, FRAMES), size=4)
    assert recorder.events == [("cam", e.to_json()) for e in events]
    # Batches of frames 0-3 (the first counts, and an entry), 4-7, 8-11, 12-15.
    assert [source for source, _ in recorder.counts] == ["cam"] * 4
    assert recorder.counts[-1][1] == stage.counts()["cam"]
    assert recorder.counts[0][1]["zones"]["dock"]["entered"] == {"person": 1}
    quiet = Recorder()
    stage = AnalyticsStage("analytics", {"cam": [region(GATE)]}, NAMES, {"cam": FORGET_S}, [quiet])
    run(stage, frame_rows({12: TRACKS[12]}, 8))  # a car nowhere near the gate
    assert quiet.events == [] and len(quiet.counts) == 1  # the first (zero) counts only


def test_stream_time_keeps_rising_when_a_cameras_pts_restart() -> None:
    source = SourceAnalytics("cam", [], NAMES, FORGET_S)
    times = [source.stream_time(pts, index, RATE) for index, pts in
             enumerate([100.0, 100.04, 100.08, 0.0, 0.04, 0.04])]
    assert times == pytest.approx([100.0, 100.04, 100.08, 100.12, 100.16, 100.16])
    without_pts = SourceAnalytics("cam", [], NAMES, FORGET_S)
    assert [without_pts.stream_time(None, index, RATE) for index in (0, 1, 5)] == \
        pytest.approx([0.0, 0.04, 0.2])


# A person standing in the dock (anchor 350, 50) from frame 0, with gaps in its detections.
@pytest.mark.parametrize(("seen", "inside", "kinds"), [
    # Seen on every frame: counted from its 3rd frame, inside from frame 3 (2 frames inside).
    (range(12), [0, 0, 0] + [1] * 9, ["enter"]),
    # One frame missed (5): too short to tell (min_frames 2), it stays inside.
    ([f for f in range(12) if f != 5], [0, 0, 0] + [1] * 9, ["enter"]),
    # Lost after frame 4: out on frame 6 (missing on 5 and 6, not tracker_lost_s later),
    # found again on 9: in again on 10.
    ([0, 1, 2, 3, 4, 9, 10, 11], [0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 1, 1],
     ["enter", "exit", "enter"]),
])
def test_occupancy_falls_when_a_track_is_lost(seen: Iterable[int], inside: list[int],
                                              kinds: list[str]) -> None:
    shown = set(seen)
    standing = {7: (PERSON, 350, [50.0 if f in shown else None for f in range(12)])}
    stage = AnalyticsStage("analytics", {"cam": [region(DOCK)]}, NAMES, {"cam": 10.0})
    occupancy, events = [], []
    for row in frame_rows(standing, 12):  # a frame per batch: the counts after each frame
        (out,) = stage.process(batch_of([row]))
        events.extend(out.events)
        occupancy.append(stage.counts()["cam"]["zones"]["dock"]["inside"]["person"])
    assert occupancy == inside
    assert [e.kind for e in events] == kinds
    if len(kinds) > 1:
        assert events[1].frame == 6 and events[1].dwell_s == pytest.approx((4 - 2) / RATE)


def test_a_source_counted_from_its_resume_point_says_so_in_its_final_counts() -> None:
    stage = AnalyticsStage("analytics", {}, NAMES, {})
    stage.add_source("cam", [region(GATE), region(DOCK)], NAMES, 10.0, first_frame=120)
    stage.add_source("other", [region(GATE)], NAMES, 10.0)
    with capture_logs() as logs:
        stage.end_of_stream(EndOfStream("cam", 0))
        stage.end_of_stream(EndOfStream("other", 0))
    told = {e["source"]: e for e in logs if e["event"] == "analytics counts"}
    assert told["cam"]["counted_from_frame"] == 120
    assert "counted_from_frame" not in told["other"]


@pytest.mark.parametrize("stopped", [False, True])
def test_end_of_stream_closes_the_tracks_still_inside(stopped: bool) -> None:
    """Tracks 20 and 21 stand in the dock when the source ends (21 has not been inside for
    min_frames yet: it never entered); the stage's end marker carries 20's exit, on the last
    frame, the publisher gets it with the final counts, and nobody is left inside."""
    recorder = Recorder()
    stage = AnalyticsStage("analytics", {"cam": [region(GATE), region(DOCK)]}, NAMES,
                           {"cam": 10.0}, [recorder])
    standing = {20: (PERSON, 350, [50.0] * 8), 21: (PERSON, 360, [None] * 7 + [60.0])}
    events = run(stage, frame_rows(standing, 8))
    assert [e.kind for e in events] == ["enter"]
    assert stage.counts()["cam"]["zones"]["dock"]["inside"] == {"person": 1}
    with capture_logs() as logs:
        (eos,) = stage.end_of_stream(EndOfStream("cam", 8, stopped=stopped))
    assert summary(eos.events) == [(7, "exit", "dock", 20, PERSON, pytest.approx((7 - 2) / RATE))]
    assert eos.events[0].xyxy == pytest.approx((340, 10, 360, 50))  # its last box
    final = stage.counts()["cam"]["zones"]["dock"]
    assert final == {"inside": {"person": 0}, "entered": {"person": 1}, "exited": {"person": 1}}
    assert recorder.events[-1] == ("cam", eos.events[0].to_json())
    assert recorder.counts[-1] == ("cam", stage.counts()["cam"])
    assert [e["counts"] for e in logs if e["event"] == "analytics counts"] == [
        stage.counts()["cam"]]
    (again,) = stage.end_of_stream(EndOfStream("cam", 8))  # nothing open any more
    assert again.events == ()
    other = EndOfStream("other", 3)
    assert stage.end_of_stream(other) == (other,)  # a source without analytics
