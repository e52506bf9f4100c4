"""GpuDecodeStage: the source contract where no GPU decoder exists (CPU), and on a GPU the
whole pipeline with GPU decode against CPU decode (the same pictures, the same detections)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from pipeline.config import SourceConfig
from pipeline.records import EndOfStream
from stages.gpu_decode import HWACCEL_OPTIONS, cuda_hwaccel, gpu_decode_unavailable_reason


def test_hwaccel_keeps_frames_on_the_device_in_the_current_context():
    from av.codec.hwaccel import HWAccel

    accel = cuda_hwaccel(HWAccel, 0)
    assert accel.options == HWACCEL_OPTIONS == {"primary_ctx": "0", "current_ctx": "1"}
    assert accel.allow_software_fallback is False
    assert getattr(accel, "is_hw_owned", True)


def test_without_a_gpu_decoder_the_source_ends_with_the_reason(samples):
    reason = gpu_decode_unavailable_reason()
    if reason is None:
        pytest.skip("a GPU decoder is usable here")
    from stages.gpu_decode import GpuDecodeStage

    stage = GpuDecodeStage(SourceConfig(name="bikes", uri=str(samples.bikes)))
    assert stage.expected_frames == 250  # probed like any file source
    items = list(stage.frames(threading.Event()))
    assert items == [EndOfStream("bikes", 0, error=items[0].error)]
    assert "GPU decode unavailable" in items[0].error and reason in items[0].error
    assert str(samples.bikes) in items[0].error


ON_GPU = SimpleNamespace(device_id=0)  # create_source reads only whether there is a GPU context


@pytest.mark.parametrize("decode, video, gpu, expected", [
    ("auto", None, None, "DecodeStage"),
    ("cpu", None, ON_GPU, "DecodeStage"),
    ("auto", "{source}.mp4", ON_GPU, "DecodeStage"),
    ("gpu", None, None, "cannot be used: inference does not run on the GPU"),
    ("gpu", "{source}.mp4", ON_GPU, "cannot be used: output.video needs the frames on the host"),
])
def test_the_source_kind_follows_the_config(samples, decode, video, gpu, expected):
    from pipeline.build import DeviceUnavailable, create_source
    from pipeline.config import parse_config

    config = parse_config({"sources": [{"name": "b", "uri": str(samples.bikes), "decode": decode}],
                           "model": {"path": str(samples.model)}, "output": {"video": video}})
    if expected.startswith("cannot"):
        with pytest.raises(DeviceUnavailable, match=r"sources\[0\]\.decode: 'gpu' " + expected):
            create_source(config, 0, gpu)
    else:
        assert type(create_source(config, 0, gpu)).__name__ == expected
