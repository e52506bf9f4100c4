"""The preview hub: pictures kept only while watched, copied (the ring slot is reused),
at most preview_fps, encoded once per picture, boxes drawn when the frame was not
annotated."""

from __future__ import annotations

import time

import cv2
import numpy as np
import pytest

import pipeline.app.preview as preview
from pipeline.app.preview import PreviewHub, encode_jpeg
from pipeline.records import Detections
from tests.support.batches import batch_detections, make_frame

W, H = 64, 48


def grey(y: int) -> np.ndarray:
    """A grey I420 picture: (H * 3 // 2, W) uint8, luma ``y``, neutral chroma."""
    image = np.full((H * 3 // 2, W), 128, np.uint8)
    image[:H] = y
    return image


def decoded(data: bytes) -> np.ndarray:
    picture = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    assert picture is not None, "not a JPEG"
    return picture


def test_unwatched_frames_are_counted_not_kept() -> None:
    hub = PreviewHub(preview_fps=1000)
    for _ in range(3):
        hub.offer("cam", grey(128), W, H, capture_time=123.0, frames=2)
    activity = hub.activity("cam")
    assert (activity.frames, activity.last_capture_time, activity.picture_seq) == (6, 123.0, 0)
    assert hub.jpeg("cam") is None and hub.jpeg("unknown") is None


def test_a_snapshot_request_keeps_a_copy_of_the_next_frame() -> None:
    hub = PreviewHub(preview_fps=1000)
    hub.request("cam")
    image = grey(200)
    hub.offer("cam", image, W, H, capture_time=time.time())
    image[:] = 16  # the ring slot is reused: the kept picture must not change
    seq, data = hub.jpeg("cam")
    assert seq == 1 and decoded(data).shape == (H, W, 3)
    assert np.abs(decoded(data).astype(int) - 215).max() < 6  # Y 200, limited range: ~215
    assert hub.jpeg("cam")[1] is data  # encoded once per picture


def test_pictures_are_kept_at_most_preview_fps() -> None:
    hub = PreviewHub(preview_fps=5)
    with hub.watching("cam"):
        assert hub.viewers("cam") == 1 and hub.wanted("cam")
        for _ in range(10):
            hub.offer("cam", grey(128), W, H, capture_time=time.time())
        assert hub.activity("cam").picture_seq == 1
        time.sleep(0.21)
        hub.offer("cam", grey(128), W, H, capture_time=time.time())
        assert hub.activity("cam").picture_seq == 2
    assert hub.viewers("cam") == 0 and not hub.wanted("cam")


def test_a_request_is_wanted_for_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    hub = PreviewHub()
    now = [1000.0]
    monkeypatch.setattr(preview.time, "monotonic", lambda: now[0])
    hub.request("cam")
    now[0] += preview.WANT_WINDOW_S - 0.1
    assert hub.wanted("cam")
    now[0] += 0.2
    assert not hub.wanted("cam")


def test_offer_part_keeps_the_last_frame_and_draws_boxes_when_not_annotated() -> None:
    frames = [make_frame("cam", i, grey(60 + 40 * i)) for i in range(3)]
    part = batch_detections([(frames[0], []), (frames[1], []),
                             (frames[2], [(8, 8, 40, 30, 0.9, 0)])])
    plain, drawn = PreviewHub(preview_fps=1000), PreviewHub(preview_fps=1000, class_names=["a"])
    for hub, annotated in ((plain, True), (drawn, False)):
        hub.request("cam")
        hub.offer_part(part, annotated=annotated)
        activity = hub.activity("cam")
        assert (activity.frames, activity.picture_seq, activity.width, activity.height) == (
            3, 1, W, H)
        assert activity.last_capture_time == frames[2].capture_time
    flat, boxed = decoded(plain.jpeg("cam")[1]), decoded(drawn.jpeg("cam")[1])
    assert np.abs(flat.astype(int) - 144).max() < 6  # the last frame (Y 140), as it was
    outline = boxed[8, 10:38].astype(int) - flat[8, 10:38].astype(int)
    assert np.abs(outline).max() > 40, "the box's top edge is drawn"
    assert np.abs(boxed[44:, :].astype(int) - flat[44:, :].astype(int)).max() < 12  # below: not


def test_a_frame_without_host_image_counts_but_has_no_picture() -> None:
    hub = PreviewHub(preview_fps=1000)
    hub.request("cam")
    hub.offer("cam", None, W, H, capture_time=time.time())
    assert hub.activity("cam").frames == 1 and hub.jpeg("cam") is None


def test_end_is_reported() -> None:
    hub = PreviewHub()
    hub.end("cam", "reading rtsp://***@host/x failed: refused")
    activity = hub.activity("cam")
    assert activity.ended and activity.error == "reading rtsp://***@host/x failed: refused"


def test_encode_jpeg_leaves_the_picture_alone() -> None:
    picture = grey(100)
    before = picture.copy()
    boxes = Detections(np.array([[4, 4, 30, 20]], np.float32), np.array([0.5], np.float32),
                       np.array([1], np.int32))
    assert decoded(encode_jpeg(picture, W, H, boxes, None)).shape == (H, W, 3)
    assert np.array_equal(picture, before)


def test_preview_fps_must_be_positive() -> None:
    with pytest.raises(ValueError, match="preview_fps must be > 0, got 0"):
        PreviewHub(preview_fps=0)
