"""AnnotateStage: boxes drawn on the I420 planes of a batch's images, in the class colour."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

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
