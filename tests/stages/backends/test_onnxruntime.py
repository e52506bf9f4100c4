"""The onnxruntime backend against a direct onnxruntime run of the same frame."""

from __future__ import annotations

import av
import numpy as np
import onnxruntime

from kernels.preprocess import letterbox_geometry, preprocess_reference
from stages.backends.base import read_model_info
from stages.backends.onnxruntime import OnnxRuntimeBackend


def test_model_info_is_read_from_the_onnx(samples) -> None:
    info = read_model_info(samples.model)
    assert (info.input_name, info.output_name) == ("images", "output0")
    assert (info.input_height, info.input_width, info.num_classes) == (416, 416, 80)
    assert info.dynamic_batch and info.input_dtype == np.float32


def test_backend_matches_direct_onnxruntime_on_a_real_frame(samples) -> None:
    with av.open(str(samples.bikes)) as container:
        frames = [f.to_ndarray(format="yuv420p") for i, f in enumerate(container.decode(video=0))
                  if i in (33, 34, 35)]  # frame 34: a man in a suit, person 0.97
    letterbox = letterbox_geometry(640, 272, 416, 416)
    images = np.stack([preprocess_reference(f, 640, 272, letterbox) for f in frames])
    info = read_model_info(samples.model)
    backend = OnnxRuntimeBackend(samples.model, info, max_batch=3)
    ours = backend.infer(images)
    session = onnxruntime.InferenceSession(str(samples.model), providers=["CPUExecutionProvider"])
    direct = np.concatenate([session.run(None, {"images": images[i:i + 1]})[0] for i in range(3)])
    assert ours.shape == (3, 84, 2535) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, direct, rtol=1e-4, atol=1e-3)
    assert ours[:, 4:].max() > 0.9  # a real frame gives confident detections
