"""The preview hub: pictures kept only while watched, copied (the ring slot is reused),
at most preview_fps, encoded once per picture, boxes drawn when the frame was not
annotated; a GPU-decoded source's NV12 picture kept with the detections of its own frame."""

from __future__ import annotations

import time

import cv2
import numpy as np
import pytest

import pipeline.app.preview as preview
from pipeline.app.preview import PreviewHub, encode_jpeg, nv12_to_i420
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


def i420_to_nv12(picture: np.ndarray, width: int, height: int) -> np.ndarray:
    """The NV12 layout of an I420 picture, written independently of ``nv12_to_i420``."""
    plane = width * height // 4
    u = picture.reshape(-1)[width * height:width * height + plane]
    v = picture.reshape(-1)[width * height + plane:]
    uv = np.empty(2 * plane, np.uint8)
    uv[0::2], uv[1::2] = u, v
    return np.concatenate([picture[:height].reshape(-1), uv]).reshape(height * 3 // 2, width)


def natural(width: int, height: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A textured picture: (BGR (height, width, 3), its I420) uint8, every sample varying."""
    rng = np.random.default_rng(seed)
    bgr = cv2.GaussianBlur(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), (5, 5), 0)
    return bgr, cv2.cvtColor(bgr, cv2.COLOR_BGR2YUV_I420)


def gpu_part(indices: list[int], boxes: dict[int, list] | None = None):
    """A batch part of GPU-decoded frames of "cam" (no host images), ``boxes`` by index."""
    frames = [make_frame("cam", i, width=W, height=H) for i in indices]
    return batch_detections([(f, (boxes or {}).get(f.index, [])) for f in frames])


def test_nv12_to_i420_is_exact_against_opencv() -> None:
    bgr, i420 = natural(W, H)
    nv12 = i420_to_nv12(i420, W, H)
    assert not np.array_equal(nv12, i420)  # the chroma layouts differ
    assert np.array_equal(nv12_to_i420(nv12, W, H), i420)
    bgr_nv12 = cv2.cvtColor(nv12, cv2.COLOR_YUV2BGR_NV12)
    np.testing.assert_array_equal(bgr_nv12, cv2.cvtColor(nv12_to_i420(nv12, W, H),
                                                         cv2.COLOR_YUV2BGR_I420))
    np.testing.assert_array_equal(bgr_nv12, cv2.cvtColor(i420, cv2.COLOR_YUV2BGR_I420))
    assert not np.array_equal(bgr_nv12, cv2.cvtColor(nv12, cv2.COLOR_YUV2BGR_NV21))  # U, V apart
    assert bgr.shape == bgr_nv12.shape


def test_a_gpu_picture_is_kept_with_the_detections_of_its_own_frame() -> None:
    _, i420 = natural(W, H, seed=1)
    hub = PreviewHub(preview_fps=1000, class_names=["a"])
    hub.request("cam")
    hub.offer_picture("cam", 5, i420_to_nv12(i420, W, H), W, H)
    hub.offer_part(gpu_part([3, 4]), annotated=False)  # earlier frames: counted, not it
    assert hub.activity("cam").frames == 2 and hub.picture("cam") is None
    box = (8, 8, 40, 30, 0.9, 0)
    hub.offer_part(gpu_part([5, 6], {6: [box]}), annotated=False)  # frame 5: no boxes
    activity = hub.activity("cam")
    assert (activity.frames, activity.picture_seq, activity.width, activity.height) == (
        4, 1, W, H)
    picture, width, height = hub.picture("cam")
    assert (width, height) == (W, H) and np.array_equal(picture, i420)
    plain = decoded(hub.jpeg("cam")[1])
    assert np.array_equal(plain, decoded(encode_jpeg(i420, W, H, None, None)))
    hub.offer_picture("cam", 7, i420_to_nv12(i420, W, H), W, H)
    hub.offer_part(gpu_part([7], {7: [box]}), annotated=True)  # not drawn on ITS picture
    assert hub.activity("cam").picture_seq == 2
    boxed = decoded(hub.jpeg("cam")[1])
    boxes = Detections(np.array([box[:4]], np.float32), np.array([box[4]], np.float32),
                       np.array([box[5]], np.int32))
    assert np.array_equal(boxed, decoded(encode_jpeg(i420, W, H, boxes, ["a"])))
    assert np.abs(boxed[8, 10:38].astype(int) - plain[8, 10:38].astype(int)).max() > 40


def test_a_gpu_picture_whose_frame_never_comes_is_replaced() -> None:
    hub = PreviewHub(preview_fps=1000)
    hub.offer_picture("cam", 2, i420_to_nv12(grey(50), W, H), W, H)
    hub.offer_part(gpu_part([3, 4]), annotated=False)  # frame 2 was dropped
    assert hub.picture("cam") is None
    hub.offer_picture("cam", 6, i420_to_nv12(grey(90), W, H), W, H)
    hub.offer_part(gpu_part([5, 6, 7]), annotated=False)
    picture, _, _ = hub.picture("cam")
    assert np.array_equal(picture, grey(90)) and hub.activity("cam").frames == 5
    hub.offer_part(gpu_part([6]), annotated=False)  # taken once: no second picture
    assert hub.activity("cam").picture_seq == 1


def test_end_forgets_a_pending_gpu_picture() -> None:
    hub = PreviewHub(preview_fps=1000)
    hub.offer_picture("cam", 0, i420_to_nv12(grey(50), W, H), W, H)
    hub.end("cam")
    hub.offer_part(gpu_part([0]), annotated=False)  # the name added again counts from 0
    assert hub.picture("cam") is None


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
