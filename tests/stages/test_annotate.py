"""AnnotateStage: boxes drawn on the I420 planes of a batch's images, in the class colour."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from pipeline.records import BatchDetections
from stages.analytics import AnalyticsCounts
from stages.annotate import AnnotateStage, class_colour_yuv, i420_planes
from tests.support.batches import Box, batch_detections, grey_image, make_frame

WIDTH, HEIGHT = 320, 240
NAMES = ["person", "bicycle", "car", "dog"]


def test_box_is_drawn_in_the_class_colour_and_the_rest_is_untouched() -> None:
    image = grey_image(WIDTH, HEIGHT)
    batch = batch_detections([(make_frame("a", 0, image), [(100, 80, 220, 200, 0.9, 2)])])
    (out,) = AnnotateStage("ann", NAMES[:3]).process(batch)
    assert out is batch and out.frames.images[0] is image  # drawn in place
    y, u, v = i420_planes(image, WIDTH, HEIGHT)
    colour = class_colour_yuv(2)
    assert y[140, 100] == colour[0] and y[140, 220] == colour[0]   # left and right edges
    assert u[70, 50] == colour[1] and v[70, 50] == colour[2]
    assert y[140, 160] == 128 and y[10, 10] == 128                  # inside and outside
    bgr = cv2.cvtColor(image, cv2.COLOR_YUV2BGR_I420)
    assert abs(int(bgr[140, 100].astype(int).sum()) - 3 * 128) > 60  # visibly coloured


# Frames of one batch, each: (has an image, its boxes). Every box lies in rows 40..100, and
# labels are drawn above their box, so rows from 110 down must stay untouched.
FRAMES: list[tuple[bool, list[Box]]] = [
    (True, [(20, 40, 100, 100, 0.9, 2)]),                                   # one box
    (True, []),                                                             # no detections
    (False, [(20, 40, 100, 100, 0.8, 1)]),                                  # no host image
    (True, [(10, 60, 60, 100, 0.8, 0), (200, 50, 300, 90, 0.7, 3)]),        # two boxes
    (True, []),                                                             # none again
]
FAR_ROW = 110


@pytest.mark.parametrize("row", range(len(FRAMES)))
def test_a_batch_draws_only_where_its_frames_have_boxes(row: int) -> None:
    frames = [make_frame("a" if i % 2 else "b", i, grey_image(WIDTH, HEIGHT) if has else None,
                         width=WIDTH, height=HEIGHT)
              for i, (has, _) in enumerate(FRAMES)]
    batch = batch_detections([(frame, boxes) for frame, (_, boxes) in zip(frames, FRAMES)])
    (out,) = AnnotateStage("ann", NAMES).process(batch)
    assert out is batch
    has_image, boxes = FRAMES[row]
    image = batch.frames.images[row]
    if not has_image:
        assert image is None
        return
    untouched = grey_image(WIDTH, HEIGHT)
    if not boxes:
        np.testing.assert_array_equal(image, untouched)
        return
    y, u, v = i420_planes(image, WIDTH, HEIGHT)
    for x1, y1, x2, y2, _, cls in boxes:
        colour = class_colour_yuv(int(cls))
        middle = int((y1 + y2) // 2)
        assert y[middle, int(x1)] == colour[0] and y[middle, int(x2)] == colour[0]  # its edges
        assert u[middle // 2, int(x1) // 2] == colour[1]
        assert y[middle, int((x1 + x2) // 2)] == 128                               # its inside
    assert (y[FAR_ROW:] == 128).all()                                               # far away
    assert (u[FAR_ROW // 2:] == 128).all() and (v[FAR_ROW // 2:] == 128).all()


def test_a_batch_without_detections_is_passed_on_untouched() -> None:
    frames = [make_frame("a", i, grey_image(WIDTH, HEIGHT)) for i in range(3)]
    batch = batch_detections([(frame, []) for frame in frames])
    (out,) = AnnotateStage("ann", NAMES).process(batch)
    assert out is batch
    for image in batch.frames.images:
        np.testing.assert_array_equal(image, grey_image(WIDTH, HEIGHT))


def test_class_colours_differ() -> None:
    assert len({class_colour_yuv(c) for c in range(80)}) > 60


def test_a_tracked_detection_is_labelled_with_its_track_id() -> None:
    from dataclasses import replace

    plain, tracked, untracked = (batch_detections([(make_frame("a", 0, grey_image(WIDTH, HEIGHT)),
                                                    [(100, 80, 220, 200, 0.9, 2)])])
                                 for _ in range(3))
    tracked = replace(tracked, tracker_id=np.array([17], np.int64))
    untracked = replace(untracked, tracker_id=np.array([-1], np.int64))
    for batch in (plain, tracked, untracked):
        AnnotateStage("ann", NAMES).process(batch)
    images = [i420_planes(b.frames.images[0], WIDTH, HEIGHT)[0] for b in (plain, tracked,
                                                                         untracked)]
    np.testing.assert_array_equal(images[0], images[2])  # -1: no id shown
    changed = np.argwhere(images[0] != images[1])
    assert len(changed) and changed[:, 0].max() < 80  # only the label above the box differs


def test_zones_and_lines_are_drawn_with_their_counts() -> None:
    from dataclasses import replace

    from pipeline.config import AnalyticsRegionConfig, SourceConfig
    from pipeline.records import AnalyticsEvent
    from stages.analytics import Region
    from stages.annotate import LINE_BGR, ZONE_BGR, yuv_of_bgr

    source = SourceConfig("a", "a.mp4")
    regions = [Region.from_config("z", AnalyticsRegionConfig(
                   "zone", "dock", polygon=[[40, 120], [140, 120], [140, 220], [40, 220]]),
                   source, NAMES, 4),
               Region.from_config("l", AnalyticsRegionConfig(
                   "line", "gate", start=[180, 160], end=[300, 160]), source, NAMES, 4),
               Region.from_config("o", AnalyticsRegionConfig(
                   "line", "off", start=[0, 10], end=[900, 10]), source, NAMES, 4)]
    batch = batch_detections([(make_frame("a", i, grey_image(WIDTH, HEIGHT)), []) for i in range(3)])
    crossing = AnalyticsEvent("a", "cross_in", "gate", 1, None, 0.0, 5, 2, "car", 0.5,
                              (0.0, 0.0, 1.0, 1.0))
    batch = replace(batch, events=(crossing,))
    AnnotateStage("ann", NAMES, {"a": regions}).process(batch)
    first, second, third = (i420_planes(image, WIDTH, HEIGHT) for image in batch.frames.images)
    assert first[0][170, 40] == yuv_of_bgr(ZONE_BGR)[0]   # the zone's left edge
    assert first[1][85, 20] == yuv_of_bgr(ZONE_BGR)[1]
    assert first[0][160, 240] == yuv_of_bgr(LINE_BGR)[0]  # the line, and its arrow downwards
    assert first[0][170, 240] == yuv_of_bgr(LINE_BGR)[0] and first[0][170, 200] == 128
    assert (first[0][10, 160:] == 128).all()  # "off" reaches beyond the frame: not drawn
    label = np.s_[130:161, 180:320]  # the line's label, above its start
    assert (first[0][label] != second[0][label]).any()  # "in 0" became "in 1" on frame 1
    np.testing.assert_array_equal(second[0], third[0])  # and stays


def tracked_batch(index: int, boxes: list[Box], ids: list[int], source: str = "a"
                  ) -> BatchDetections:
    from dataclasses import replace

    batch = batch_detections([(make_frame(source, index, grey_image(WIDTH, HEIGHT)), boxes)])
    return replace(batch, tracker_id=np.array(ids, np.int64))


def moving(index: int) -> Box:
    """A car's box, 40 px square, moving right 10 px a frame: centre (40 + 10 * index, 120)."""
    return (20 + 10 * index, 100, 60 + 10 * index, 140, 0.9, 2)


@pytest.mark.parametrize("trails", [0, 8])
def test_trails_fade_behind_a_moving_track(trails: int) -> None:
    """On frame 11, the car's trail runs through its centres of frames 4..11 (the last 8),
    its segments fading with age; older centres, an untracked box and trails: 0 leave the
    picture as it was."""
    stage = AnnotateStage("ann", NAMES, trails=trails)
    for index in range(12):
        batch = tracked_batch(index, [moving(index), (200 + 5 * index, 20, 250 + 5 * index, 60,
                                                      0.8, 0)], [5, -1])
        (out,) = stage.process(batch)
    y, u, v = i420_planes(out.frames.images[0], WIDTH, HEIGHT)
    # Between the centres of ages a and a + 1 (x = 145 - 10 a), the segment's opacity is
    # 1 - (a + 1) / 8; age 7 to 8 (x = 75) and beyond are not drawn.
    midpoints = [145 - 10 * age for age in range(7)]
    luma = [int(y[120, x]) for x in midpoints]
    colour = class_colour_yuv(2)
    if not trails:
        assert luma == [128] * 7
        return
    assert abs(luma[0] - colour[0]) <= 20  # the newest segment: nearly the class colour
    change = [abs(value - 128) for value in luma]
    assert change == sorted(change, reverse=True) and change[-1] < change[0] / 4, luma
    assert change[-1] > 0
    assert u[60, 72] != 128 or v[60, 72] != 128  # coloured in chroma too
    assert y[120, 75] == 128 and y[120, 30] == 128  # older than 8 frames: gone
    assert (y[36:45, 200:253] == 128).all()  # the untracked box came along y 40: no trail


def test_a_trail_ends_with_its_track() -> None:
    """A track not seen for 8 frames (trails: 8) has no trail when its id comes back."""
    stage = AnnotateStage("ann", NAMES, trails=8)
    for index in range(5):
        stage.process(tracked_batch(index, [moving(index)], [5]))
    for index in range(5, 14):
        stage.process(tracked_batch(index, [], []))
    (out,) = stage.process(tracked_batch(14, [moving(14)], [5]))
    y, _, _ = i420_planes(out.frames.images[0], WIDTH, HEIGHT)
    assert (y[115:126, :150] == 128).all()  # left of the box: nothing


def region_setup() -> tuple[list, AnalyticsCounts]:
    """The zones and line of configs/analytics.yaml, scaled to the 320 x 240 test frame: a
    line down the middle, a zone over the lower part, a second zone at the top left."""
    from pipeline.config import AnalyticsRegionConfig, SourceConfig
    from stages.analytics import Region

    source = SourceConfig("a", "a.mp4")
    regions = [Region.from_config(key, config, source, NAMES, 4) for key, config in (
        ("l", AnalyticsRegionConfig("line", "middle", start=[160, 0], end=[160, HEIGHT])),
        ("k", AnalyticsRegionConfig("zone", "kerb", polygon=[[0, 130], [WIDTH, 130],
                                                               [WIDTH, HEIGHT], [0, HEIGHT]])),
        ("d", AnalyticsRegionConfig("zone", "door", polygon=[[0, 0], [60, 0], [60, 60], [0, 60]])),
    )]
    return regions, AnalyticsCounts(regions, NAMES)


# Boxes whose usual label place (above the top-left corner) covers a zone or line label, as
# on frames 36 and 130 of the analytics demo; and boxes with no room around them.
CROWDING: list[list[Box]] = [
    [(150, 20, 260, 120, 0.9, 2)],                    # its label over the line's
    [(0, 140, 120, 230, 0.8, 1)],                     # over the kerb zone's
    [(2, 4, 100, 100, 0.7, 0), (0, 10, 40, 50, 0.6, 3)],  # over the door zone's, twice
    [(0, 0, WIDTH, HEIGHT, 0.9, 2)],                  # the whole frame
    [(155 + 3 * k, 2 * k, 200, 20 + 2 * k, 0.5, 0) for k in range(12)],  # a pile at the top
]


@pytest.mark.parametrize("boxes", CROWDING)
def test_box_labels_never_cover_a_zone_or_line_label(boxes: list[Box]) -> None:
    from stages.annotate import draw_detections, overlaps, region_labels

    regions, counts = region_setup()
    labels = region_labels(regions, counts, WIDTH, HEIGHT)
    assert len(labels) == 3
    clear = [rect for _, rect, _ in labels]
    for a, b in zip(clear, clear[1:]):
        assert not overlaps(a, b, 0)  # zone and line labels do not cover each other
    batch = batch_detections([(make_frame("a", 0, grey_image(WIDTH, HEIGHT)), boxes)])
    placed = draw_detections(batch.frames.images[0], WIDTH, HEIGHT, batch[0], NAMES, clear)
    assert placed  # labels are drawn
    for rect in placed:
        assert 0 <= rect[0] < rect[2] < WIDTH and 0 <= rect[1] < rect[3] < HEIGHT
        for other in clear:
            assert not overlaps(rect, other, 0), (rect, other)
    # Through the stage: the zone and line labels' pixels are those of a frame without boxes.
    plain = batch_detections([(make_frame("a", 0, grey_image(WIDTH, HEIGHT)), [])])
    crowded = batch_detections([(make_frame("a", 0, grey_image(WIDTH, HEIGHT)), boxes)])
    AnnotateStage("ann", NAMES, {"a": regions}).process(plain)
    AnnotateStage("ann", NAMES, {"a": regions}).process(crowded)
    planes = [i420_planes(b.frames.images[0], WIDTH, HEIGHT) for b in (plain, crowded)]
    for _, (x1, y1, x2, y2), _ in labels:
        np.testing.assert_array_equal(planes[0][0][y1:y2 + 1, x1:x2 + 1],
                                      planes[1][0][y1:y2 + 1, x1:x2 + 1])


@pytest.mark.parametrize(("events", "texts"), [
    ([], ["middle: 0 in / 0 out", "kerb: 0 inside, 0 in / 0 out", "door: 0 inside, 0 in / 0 out"]),
    ([("cross_in", "middle"), ("cross_out", "middle"), ("cross_out", "middle"),
      ("enter", "kerb"), ("enter", "kerb"), ("enter", "kerb"), ("exit", "kerb")],
     ["middle: 1 in / 2 out", "kerb: 2 inside, 3 in / 1 out", "door: 0 inside, 0 in / 0 out"]),
])
def test_zone_and_line_labels_say_what_the_numbers_are(events: list, texts: list[str]) -> None:
    from pipeline.records import AnalyticsEvent
    from stages.annotate import region_labels

    regions, counts = region_setup()
    for kind, name in events:
        counts.apply(AnalyticsEvent("a", kind, name, 1, None, 0.0, 1, 2, "car", 0.5,
                                    (0.0, 0.0, 1.0, 1.0), 0.0 if kind == "exit" else None))
    assert [text for text, _, _ in region_labels(regions, counts, WIDTH, HEIGHT)] == texts
