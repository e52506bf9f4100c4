"""The NumPy preprocessing reference: geometry, box unmapping, and pixels against OpenCV."""

from __future__ import annotations

from pathlib import Path

import av
import cv2
import numpy as np
import pytest

from kernels.preprocess import (
    PAD_VALUE,
    letterbox_geometry,
    preprocess_reference,
    sampling_tables,
)
from tests.support.clips import ClipFactory

BIKES = Path(__file__).resolve().parents[2] / "assets" / "video" / "bikes.mp4"
# Letterbox targets exercised on every clip: downscale (landscape pad), portrait-like
# (side pad), upscale, exact width.
TARGETS = [(416, 416), (320, 480), (1280, 1280), (640, 384)]


def decode_yuv(path: Path, every: int = 1) -> list[np.ndarray]:
    """Every ``every``-th frame of a video as (H*3//2, W) uint8 I420 arrays."""
    with av.open(str(path)) as container:
        frames = container.decode(video=0)
        return [f.to_ndarray(format="yuv420p") for i, f in enumerate(frames) if i % every == 0]


@pytest.fixture(scope="module")
def synthetic_clip(make_clip: ClipFactory) -> list[np.ndarray]:
    """Six decoded frames of an H.264 clip (640x360) of moving shapes."""
    return decode_yuv(make_clip("shapes", 6, (640, 360)))


@pytest.fixture(params=["synthetic", "bikes"])
def real_frames(request: pytest.FixtureRequest) -> list[np.ndarray]:
    if request.param == "bikes":
        if not BIKES.exists():
            pytest.skip(f"{BIKES} not present (samples fetch it)")
        return decode_yuv(BIKES, every=25)
    return request.getfixturevalue("synthetic_clip")


def i420_to_nv12(yuv: np.ndarray, height: int) -> np.ndarray:
    u, v = yuv[height:].reshape(2, -1)
    return np.concatenate([yuv[:height].ravel(), np.stack([u, v], 1).ravel()]).reshape(yuv.shape)


def opencv_planes(yuv: np.ndarray, lb) -> np.ndarray:
    """Independent path: cv2.resize (INTER_LINEAR, float) of each plane, then BT.601."""
    w, h, size = lb.src_width, lb.src_height, (lb.resized_width, lb.resized_height)
    resize = lambda p: cv2.resize(p.astype(np.float32), size, interpolation=cv2.INTER_LINEAR)  # noqa: E731
    y = (resize(yuv[:h]) - 16) * (255 / 219)
    u, v = (resize(p) - 128 for p in yuv[h:].reshape(2, h // 2, w // 2))
    rgb = np.stack([y + 1.596027 * v, y - 0.391762 * u - 0.812968 * v, y + 2.017232 * u])
    out = np.full((3, lb.dst_height, lb.dst_width), 114 / 255, np.float32)
    out[:, lb.pad_top : lb.pad_top + size[1], lb.pad_left : lb.pad_left + size[0]] = rgb.clip(0, 255) / 255
    return out


def opencv_rgb(yuv: np.ndarray, lb) -> np.ndarray:
    """The usual OpenCV path: cvtColor I420 to RGB (uint8), resize, pad 114; CHW 0..1."""
    size = (lb.resized_width, lb.resized_height)
    rgb = cv2.resize(cv2.cvtColor(yuv, cv2.COLOR_YUV2RGB_I420), size, interpolation=cv2.INTER_LINEAR)
    out = np.full((lb.dst_height, lb.dst_width, 3), 114, np.uint8)
    out[lb.pad_top : lb.pad_top + size[1], lb.pad_left : lb.pad_left + size[0]] = rgb
    return out.transpose(2, 0, 1).astype(np.float32) / 255


@pytest.mark.parametrize(
    ("src", "dst", "resized", "pad"),
    [
        ((1920, 1080), (640, 640), (640, 360), (0, 140)),  # landscape
        ((1080, 1920), (640, 640), (360, 640), (140, 0)),  # portrait
        ((500, 500), (416, 416), (416, 416), (0, 0)),  # square
        ((416, 416), (416, 416), (416, 416), (0, 0)),  # exact fit
        ((320, 240), (640, 640), (640, 480), (0, 80)),  # upscaling
        ((640, 272), (416, 416), (416, 177), (0, 119)),  # rounding: 272 * 0.65 = 176.8
        ((1280, 720), (640, 384), (640, 360), (0, 12)),  # non-square input
        ((640, 480), (416, 415), (416, 312), (0, 51)),  # odd pad split
    ],
)
def test_letterbox_geometry(src, dst, resized, pad) -> None:
    lb = letterbox_geometry(*src, *dst)
    assert (lb.resized_width, lb.resized_height) == resized
    assert (lb.pad_left, lb.pad_top) == pad
    assert (lb.scale_x, lb.scale_y) == (resized[0] / src[0], resized[1] / src[1])
    t = sampling_tables(lb)
    inside_x = slice(pad[0], pad[0] + resized[0])
    assert (t.cols[:, inside_x] >= 0).all() and (t.cols[:, inside_x][:2] < src[0]).all()
    assert (t.cols[:, inside_x][2:] < src[0] // 2).all()
    assert (np.delete(t.cols, np.r_[inside_x], axis=1) == -1).all()
    assert ((t.row_weights >= 0) & (t.row_weights < 1)).all()


@pytest.mark.parametrize("sizes", [(0, 10, 10, 10), (10, 10, -1, 10), (10.5, 10, 10, 10)])
def test_letterbox_geometry_rejects_bad_sizes(sizes) -> None:
    with pytest.raises(ValueError, match="positive integers"):
        letterbox_geometry(*sizes)


@pytest.mark.parametrize("src", [(1920, 1080), (1080, 1920), (320, 240), (640, 272)])
def test_unmap_boxes_round_trip(src) -> None:
    lb = letterbox_geometry(*src, 640, 640)
    rng = np.random.default_rng(0)
    corners = np.sort(rng.uniform(0, 1, (50, 2, 2)), axis=1) * np.array(src)
    boxes = corners.reshape(50, 4).astype(np.float32)  # x1, y1, x2, y2 in source pixels
    scale = np.array([lb.scale_x, lb.scale_y] * 2)
    model = boxes * scale + np.array([lb.pad_left, lb.pad_top] * 2)
    back = lb.unmap_boxes(model)
    assert back.dtype == np.float32 and back.shape == (50, 4)
    np.testing.assert_allclose(back, boxes, atol=1e-3)


def test_unmap_boxes_clips_to_frame() -> None:
    lb = letterbox_geometry(1920, 1080, 640, 640)  # pad_top = 140
    boxes = np.array([[-5, 100, 700, 600], [10, 150, 20, 160]], np.float32)
    np.testing.assert_allclose(lb.unmap_boxes(boxes), [[0, 0, 1920, 1080], [30, 30, 60, 60]], atol=1e-3)
    assert lb.unmap_boxes(np.zeros((0, 4), np.float32)).shape == (0, 4)


@pytest.mark.parametrize("target", TARGETS)
def test_reference_matches_opencv_per_plane_resize(real_frames, target) -> None:
    """Same maths, independent code: OpenCV's bilinear resize of each plane, then BT.601."""
    h, w = real_frames[0].shape[0] * 2 // 3, real_frames[0].shape[1]
    lb = letterbox_geometry(w, h, *target)
    for yuv in real_frames:
        diff = np.abs(preprocess_reference(yuv, w, h, lb) - opencv_planes(yuv, lb))
        assert diff.max() <= 0.01 / 255


@pytest.mark.parametrize("target", [(416, 416), (320, 320), (640, 640)])
def test_reference_close_to_opencv_rgb_path(real_frames, target) -> None:
    """Against cvtColor(I420 -> RGB) then resize: close on average, not at colour edges.

    OpenCV replicates each chroma sample over its 2x2 luma block and clamps RGB to uint8
    before resizing; the reference interpolates chroma bilinearly and clamps after. Both
    use BT.601 limited range (test_colour_matches_opencv), and in flat areas they agree to
    within 1/255, but where a saturated colour meets another (a blue disc on a yellow
    line) a pixel gets its own luma with its neighbour's chroma, and the two paths differ
    by up to ~180/255 at single pixels (~30/255 on bikes.mp4). So this bounds the mean and
    the share of pixels off by more than 2/255; pixel-exact agreement is checked against
    opencv_planes above.
    """
    h, w = real_frames[0].shape[0] * 2 // 3, real_frames[0].shape[1]
    lb = letterbox_geometry(w, h, *target)
    for yuv in real_frames:
        diff = np.abs(preprocess_reference(yuv, w, h, lb) - opencv_rgb(yuv, lb)) * 255
        assert diff.mean() <= 0.75 and (diff > 2).mean() <= 0.05


@pytest.mark.parametrize("uv", [(128, 128), (16, 16), (240, 240), (90, 240), (240, 90), (60, 200), (128, 16)])
def test_colour_matches_opencv(uv) -> None:
    """BT.601 limited range: a luma ramp under flat chroma equals cvtColor's I420 (exact fit)."""
    w, h = 256, 4
    yuv = np.empty((h * 3 // 2, w), np.uint8)
    yuv[:h] = np.arange(256, dtype=np.uint8)
    yuv[:h, :16] = 16  # OpenCV clamps Y - 16 at 0 before the matrix; BT.601 does not
    yuv[h : h + h // 4], yuv[h + h // 4 :] = uv
    lb = letterbox_geometry(w, h, w, h)
    expected = cv2.cvtColor(yuv, cv2.COLOR_YUV2RGB_I420).transpose(2, 0, 1) / 255
    assert np.abs(preprocess_reference(yuv, w, h, lb) - expected).max() <= 1 / 255


@pytest.mark.parametrize("target", TARGETS)
def test_nv12_equals_i420(synthetic_clip, target) -> None:
    yuv = synthetic_clip[2]
    lb = letterbox_geometry(640, 360, *target)
    nv12 = i420_to_nv12(yuv, 360)
    assert not np.array_equal(nv12, yuv)
    np.testing.assert_array_equal(
        preprocess_reference(nv12, 640, 360, lb, pixel_format="nv12"),
        preprocess_reference(yuv, 640, 360, lb),
    )


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_pad_area_and_dtype(synthetic_clip, dtype) -> None:
    lb = letterbox_geometry(640, 360, 416, 416)  # resized 416x234, pad_top 91
    out = preprocess_reference(synthetic_clip[0], 640, 360, lb, dtype=dtype)
    assert out.dtype == dtype and out.shape == (3, 416, 416)
    pad = dtype(PAD_VALUE)
    assert (out[:, :91] == pad).all() and (out[:, 91 + 234 :] == pad).all()
    assert (out[:, 91] != pad).any() and (out[:, 91 + 233] != pad).any()
    assert out.min() >= 0 and out.max() <= 1


def test_float16_output_into_batch_slot(synthetic_clip) -> None:
    lb = letterbox_geometry(640, 360, 320, 320)
    batch = np.full((3, 3, 320, 320), -1, np.float16)
    result = preprocess_reference(synthetic_clip[1], 640, 360, lb, out=batch[1])
    assert result.base is batch
    assert (batch[0] == -1).all() and (batch[2] == -1).all()
    full = preprocess_reference(synthetic_clip[1], 640, 360, lb)
    np.testing.assert_allclose(batch[1], full, atol=1e-3, rtol=0)


@pytest.mark.parametrize(
    ("yuv_shape", "size", "lb_src", "pixel_format", "message"),
    [
        ((540, 640), (640, 360), (640, 360), "rgb", "pixel_format"),
        ((540, 640), (640, 360), (320, 180), "i420", "letterbox is for 320x180"),
        ((360, 640), (640, 360), (640, 360), "i420", r"\(540, 640\) uint8"),
        ((541, 641), (641, 361), (641, 361), "i420", "even size"),
    ],
)
def test_reference_rejects_bad_input(yuv_shape, size, lb_src, pixel_format, message) -> None:
    lb = letterbox_geometry(*lb_src, 64, 64)
    with pytest.raises(ValueError, match=message):
        preprocess_reference(np.zeros(yuv_shape, np.uint8), *size, lb, pixel_format=pixel_format)
