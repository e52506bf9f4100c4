"""The fused preprocessing kernel against the NumPy reference.

Small frames run everywhere: on a GPU, or under Numba's CUDA simulator on a machine without
one. The @pytest.mark.gpu tests use CuPy arrays and streams at 1080p on a real GPU.
"""

from __future__ import annotations

import os
import shutil

# The simulator must be chosen before numba.cuda is first imported (tests/kernels/conftest.py
# does the same once it exists).
if "NUMBA_ENABLE_CUDASIM" not in os.environ and shutil.which("nvidia-smi") is None:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import cv2  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from numba import cuda  # noqa: E402

from kernels.preprocess import letterbox_geometry, preprocess_reference  # noqa: E402
from kernels.preprocess_cuda import (  # noqa: E402
    launch_preprocess,
    launch_preprocess_frame,
    warmup_preprocess,
)

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
pytestmark = [
    pytest.mark.skipif(not cuda.is_available(), reason="no CUDA GPU and no simulator"),
    pytest.mark.filterwarnings("ignore:.*Grid size"),  # small test frames under-fill a GPU
]
SENTINEL = -7.0


def picture_yuv(width: int, height: int, seed: int = 0, pixel_format: str = "i420") -> np.ndarray:
    """A (height*3//2, width) uint8 frame of gradients and saturated shapes, varied by seed."""
    rng = np.random.default_rng(seed)
    x = np.linspace(0, 255, width, dtype=np.float32)[None, :]
    y = np.linspace(0, 255, height, dtype=np.float32)[:, None]
    img = np.stack([x + 0 * y, y + 0 * x, 255 - (x + y) / 2], axis=-1).astype(np.uint8)
    for _ in range(4):
        centre = (int(rng.integers(width)), int(rng.integers(height)))
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        cv2.circle(img, centre, int(rng.integers(2, max(3, min(width, height) // 3))), colour, -1)
    yuv = cv2.cvtColor(img, cv2.COLOR_RGB2YUV_I420)
    if pixel_format == "nv12":
        u, v = yuv[height:].reshape(2, -1)
        yuv[height:] = np.stack([u, v], 1).reshape(-1, width)
    return yuv


def assert_close(actual: np.ndarray, expected: np.ndarray) -> None:
    err = np.abs(actual.astype(np.float32) - expected.astype(np.float32)).max()
    assert err <= 1 / 255, f"max abs error {err * 255:.3f}/255"


@pytest.mark.parametrize("pixel_format", ["i420", "nv12"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize(("src", "dst"), [((64, 48), (32, 32)), ((48, 64), (40, 24))])
def test_single_frame_matches_reference(src, dst, dtype, pixel_format) -> None:
    lb = letterbox_geometry(*src, *dst)
    yuv = picture_yuv(*src, pixel_format=pixel_format)
    out = cuda.to_device(np.full((3, 3, dst[1], dst[0]), SENTINEL, dtype))
    launch_preprocess_frame(cuda.to_device(yuv), lb, out, 1, pixel_format=pixel_format)
    host = out.copy_to_host()
    expected = preprocess_reference(yuv, *src, lb, dtype=dtype, pixel_format=pixel_format)
    assert_close(host[1], expected)
    assert (host[0] == SENTINEL).all() and (host[2] == SENTINEL).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_batched_launch_with_offset(dtype) -> None:
    src, dst = (64, 48), (32, 32)
    lb = letterbox_geometry(*src, *dst)
    frames = [picture_yuv(*src, seed=s) for s in range(5)]
    frame_bytes = frames[0].size
    packed = np.zeros((5, frame_bytes + 100), np.uint8)  # slots may be longer than a frame
    packed[:, :frame_bytes] = np.stack([f.ravel() for f in frames])
    pairs = np.array([[3, 0], [0, 2], [4, 1], [99, 0], [1, -9]], np.int32)  # last two: bad
    out = cuda.to_device(np.full((6, 3, dst[1], dst[0]), SENTINEL, dtype))
    launch_preprocess(cuda.to_device(packed), cuda.to_device(pairs), lb, out, batch_offset=2)
    host = out.copy_to_host()
    for slot, index in pairs[:3]:
        assert_close(host[2 + index], preprocess_reference(frames[slot], *src, lb, dtype=dtype))
    for index in (0, 1, 5):
        assert (host[index] == SENTINEL).all()


def test_frames_as_three_dimensional_array() -> None:
    src, dst = (64, 48), (32, 32)
    lb = letterbox_geometry(*src, *dst)
    frames = np.stack([picture_yuv(*src, seed=s) for s in range(2)])  # (2, 72, 64)
    out = cuda.device_array((2, 3, dst[1], dst[0]), np.float32)
    launch_preprocess(cuda.to_device(frames), cuda.to_device(np.array([[1, 0], [0, 1]], np.int32)), lb, out)
    host = out.copy_to_host()
    assert_close(host[0], preprocess_reference(frames[1], *src, lb))
    assert_close(host[1], preprocess_reference(frames[0], *src, lb))


@pytest.mark.parametrize(
    ("frames_shape", "pairs_dtype", "out_shape", "out_dtype", "pixel_format", "message"),
    [
        ((2, 4608), np.int32, (1, 3, 32, 32), np.float32, "yuv", "pixel_format"),
        ((2, 4000), np.int32, (1, 3, 32, 32), np.float32, "i420", "frames must be"),
        ((2, 4608), np.int64, (1, 3, 32, 32), np.float32, "i420", "pairs must be"),
        ((2, 4608), np.int32, (1, 3, 32, 30), np.float32, "i420", "out must be"),
        ((2, 4608), np.int32, (1, 3, 32, 32), np.float64, "i420", "out must be"),
    ],
)
def test_launch_rejects_bad_arguments(
    frames_shape, pairs_dtype, out_shape, out_dtype, pixel_format, message
) -> None:
    lb = letterbox_geometry(64, 48, 32, 32)
    with pytest.raises(ValueError, match=message):
        launch_preprocess(
            cuda.device_array(frames_shape, np.uint8),
            cuda.device_array((1, 2), pairs_dtype),
            lb,
            cuda.device_array(out_shape, out_dtype),
            pixel_format=pixel_format,
        )


# --- real GPU, CuPy arrays and streams -------------------------------------------------


@pytest.fixture(scope="module")
def cupy():
    if SIMULATOR:
        pytest.skip("the CUDA simulator is active: no real GPU")
    cp = pytest.importorskip("cupy", reason="CuPy is not installed")
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except cp.cuda.runtime.CUDARuntimeError as exc:
        pytest.skip(f"CUDA unavailable: {exc}")
    return cp


@pytest.mark.gpu
@pytest.mark.parametrize("pixel_format", ["i420", "nv12"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_gpu_1080p_single_frame(cupy, dtype, pixel_format) -> None:
    lb = letterbox_geometry(1920, 1080, 640, 640)
    warmup_preprocess(lb, dtype, pixel_format)
    yuv = picture_yuv(1920, 1080, pixel_format=pixel_format)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        frame = cupy.asarray(yuv)
        out = cupy.full((2, 3, 640, 640), SENTINEL, dtype)
        launch_preprocess_frame(frame, lb, out, 1, stream, pixel_format=pixel_format)
        host = cupy.asnumpy(out, stream=stream)
        stream.synchronize()
    expected = preprocess_reference(yuv, 1920, 1080, lb, dtype=dtype, pixel_format=pixel_format)
    assert_close(host[1], expected)
    assert (host[0] == SENTINEL).all()


@pytest.mark.gpu
@pytest.mark.parametrize(("src", "dst"), [((1920, 1080), (640, 640)), ((720, 1280), (416, 416))])
def test_gpu_batched_launch(cupy, src, dst) -> None:
    lb = letterbox_geometry(*src, *dst)
    frames = [picture_yuv(*src, seed=s) for s in range(8)]
    pairs = np.array([[s, 7 - s] for s in range(8)], np.int32)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        packed = cupy.asarray(np.stack([f.ravel() for f in frames]))
        out = cupy.full((12, 3, dst[1], dst[0]), SENTINEL, np.float16)
        launch_preprocess(packed, cupy.asarray(pairs), lb, out, stream.ptr, batch_offset=3)
        host = cupy.asnumpy(out, stream=stream)
        stream.synchronize()
    for slot, index in pairs:
        expected = preprocess_reference(frames[slot], *src, lb, dtype=np.float16)
        assert_close(host[3 + index], expected)
    assert (host[:3] == SENTINEL).all() and (host[11] == SENTINEL).all()
