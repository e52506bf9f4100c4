"""The D2D pack of GPU-decoded frames: its NV12 layout against the preprocess reference (CPU),
and on a GPU the packed slot against the CPU decoder's picture, byte for byte."""

from __future__ import annotations

import threading

import av
import numpy as np
import pytest

from kernels.preprocess import letterbox_geometry, preprocess_reference
from pipeline.config import SourceConfig
from pipeline.records import EndOfStream, Frame
from stages.decode import DecodeStage
from stages.device_upload import pack_nv12
from stages.gpu_decode import gpu_decode_unavailable_reason


def cpu_pictures(path, count: int) -> list[av.VideoFrame]:
    with av.open(str(path)) as container:
        return [p for p, _ in zip(container.decode(video=0), range(count))]


def pitched_planes(picture: av.VideoFrame, pitch: int) -> tuple[np.ndarray, np.ndarray]:
    """The NV12 planes as a decoder surface holds them: rows ``pitch`` bytes apart, UV
    interleaved, (H, W) and (H/2, W/2, 2) views -- the shapes and strides of the DLPack export."""
    nv12 = picture.to_ndarray(format="nv12")
    height, width = picture.height, picture.width
    surface = np.full((height * 3 // 2, pitch), 77, np.uint8)  # padding the pack must skip
    surface[:, :width] = nv12
    uv = surface[height:, :width].reshape(height // 2, width // 2, 2)
    return surface[:height, :width], uv


@pytest.mark.parametrize("pitch", [640, 768, 1024])
def test_packed_nv12_is_the_frame_the_kernel_reads(samples, pitch):
    picture = cpu_pictures(samples.bikes, 1)[0]
    width, height = picture.width, picture.height
    y, uv = pitched_planes(picture, pitch)
    assert y.strides == (pitch, 1) and uv.strides == (pitch, 2, 1)
    slot = np.zeros(width * height * 2, np.uint8)  # a staging slot larger than the frame
    packed = pack_nv12(y, uv, slot)
    np.testing.assert_array_equal(packed, picture.to_ndarray(format="nv12"))
    assert not slot[packed.size:].any()
    # The same picture as NV12 (GPU decode) and as I420 (upload) gives the same model input.
    letterbox = letterbox_geometry(width, height, 416, 416)
    from_nv12 = preprocess_reference(packed, width, height, letterbox, pixel_format="nv12")
    from_i420 = preprocess_reference(picture.to_ndarray(format="yuv420p"), width, height,
                                     letterbox)
    np.testing.assert_array_equal(from_nv12, from_i420)


def gpu_reason() -> str | None:
    import importlib.util

    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed"
    return gpu_decode_unavailable_reason()


@pytest.mark.gpu
def test_gpu_decoded_frames_pack_to_the_cpu_decoded_pictures(samples):
    if reason := gpu_reason():
        pytest.skip(f"GPU decode unavailable: {reason}")
    from pipeline.gpu import GpuContext
    from stages.device_upload import DeviceUploadStage
    from stages.gpu_decode import GpuDecodeStage

    source = SourceConfig(name="bikes", uri=str(samples.bikes))
    gpu = GpuContext(0)
    gpu.allocate(4, 640 * 272 * 3 // 2, 1, (1, 3, 32, 32), np.float16, (1, 6, 10), np.float16)
    upload = DeviceUploadStage("upload", gpu)
    upload.open()
    cpu = cpu_pictures(samples.bikes, 12)
    stop = threading.Event()
    host = DecodeStage(source).frames(stop)
    for index, item in enumerate(GpuDecodeStage(source).frames(stop)):
        if index == len(cpu):
            break
        assert isinstance(item, Frame), item
        assert (item.index, item.pixel_format, item.image) == (index, "nv12", None)
        assert item.device_planes[0].strides[0] >= item.width  # the surface's pitch
        host_frame = next(host)
        assert item.pts == host_frame.pts
        [packed] = upload.process(item)
        assert packed.device_planes is None and packed.device_slot is not None
        gpu.copy_stream.synchronize()
        got = gpu.staging.device[packed.device_slot, :item.width * item.height * 3 // 2].get()
        want = cpu[index].to_ndarray(format="nv12").reshape(-1)
        np.testing.assert_array_equal(got, want)  # H.264 decoding is bit-exact
        [uploaded] = upload.process(host_frame)  # a host frame in the same stage: H2D, I420
        gpu.copy_stream.synchronize()
        got = gpu.staging.device[uploaded.device_slot, :want.size].get()
        np.testing.assert_array_equal(got, cpu[index].to_ndarray(format="yuv420p").reshape(-1))
        gpu.staging.release([packed.device_slot, uploaded.device_slot], gpu.compute_stream)
    upload.close()


@pytest.mark.gpu
def test_gpu_decode_reads_a_whole_file_and_reports_a_missing_one(samples, tmp_path):
    if reason := gpu_reason():
        pytest.skip(f"GPU decode unavailable: {reason}")
    from stages.gpu_decode import GpuDecodeStage

    items = list(GpuDecodeStage(SourceConfig(name="bikes", uri=str(samples.bikes)))
                 .frames(threading.Event()))
    assert [f.index for f in items[:-1]] == list(range(250))
    assert items[-1] == EndOfStream("bikes", 250)
    missing = str(tmp_path / "missing.mp4")
    [end] = GpuDecodeStage(SourceConfig(name="gone", uri=missing)).frames(threading.Event())
    assert end.frames == 0 and "missing.mp4" in end.error
