"""Backend selection and the infer stage on the CPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pipeline.config import InferenceConfig
from pipeline.records import Batch
from stages.backends.base import read_model_info
from stages.infer import BackendUnavailable, InferStage, create_backend


def test_auto_without_gpu_picks_onnxruntime(samples) -> None:
    info = read_model_info(samples.model)
    backend = create_backend(InferenceConfig(backend="auto"), Path(samples.model), info, gpu=None)
    assert backend.name == "onnxruntime" and backend.device == "cpu"


@pytest.mark.parametrize("name", ["torch", "tensorrt"])
def test_gpu_backends_need_a_gpu(samples, name: str) -> None:
    info = read_model_info(samples.model)
    with pytest.raises(BackendUnavailable, match=f"'{name}' needs a GPU"):
        create_backend(InferenceConfig(backend=name), Path(samples.model), info, gpu=None)


def test_infer_stage_fills_outputs_for_the_frames_only(samples) -> None:
    info = read_model_info(samples.model)
    backend = create_backend(InferenceConfig(backend="onnxruntime", batch_size=4),
                             Path(samples.model), info)
    images = np.full((4, 3, 416, 416), 0.5, np.float32)
    batch = Batch(frames=[object(), object()], letterboxes=[None, None], images=images)  # type: ignore[list-item]
    (out,) = InferStage("infer", backend).process(batch)
    assert out.outputs.shape == (2, 84, 2535)
