"""Backend selection and the infer stage on the CPU (host preprocess + onnxruntime)."""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np
import onnxruntime
import pytest

from pipeline.config import InferenceConfig
from pipeline.records import ModelOutputs
from stages.backends.base import read_model_info
from stages.batcher import BatcherStage
from stages.infer import (
    BackendUnavailable,
    InferStage,
    best_gpu_backend,
    check_tensorrt_runs,
    create_backend,
    prepare_backend,
)
from stages.preprocess import HostPreprocess
from tests.support.batches import make_frame
from tests.support.harness import run_stage


def test_auto_without_gpu_picks_onnxruntime(samples) -> None:
    info = read_model_info(samples.model)
    backend = create_backend(InferenceConfig(backend="auto"), Path(samples.model), info, gpu=None)
    assert backend.name == "onnxruntime" and backend.device == "cpu"


@pytest.mark.parametrize(("backend", "on_gpu", "prepared"), [
    ("auto", True, True), ("torch", True, True),  # the model converted ahead (torch)
    ("tensorrt", True, False), ("onnxruntime", True, False),  # their starts read a file
    ("auto", False, False),  # the CPU path: onnxruntime
])
def test_a_standby_prepares_the_torch_model_only(samples, backend, on_gpu, prepared) -> None:
    if prepared:
        pytest.importorskip("onnx2torch", reason="onnx2torch is not installed (extra: torch)")
    got = prepare_backend(InferenceConfig(backend=backend), Path(samples.model), on_gpu)
    assert (got is not None) is prepared
    if prepared:
        import torch

        assert isinstance(got, torch.nn.Module) and not got.training


@pytest.mark.parametrize("name", ["torch", "tensorrt"])
def test_gpu_backends_need_a_gpu(samples, name: str) -> None:
    info = read_model_info(samples.model)
    with pytest.raises(BackendUnavailable, match=f"'{name}' needs a GPU"):
        create_backend(InferenceConfig(backend=name), Path(samples.model), info, gpu=None)


@pytest.mark.parametrize("count", [1, 3])
def test_cpu_infer_stage_is_onnxruntime_on_the_host_preprocess(samples, count: int) -> None:
    info = read_model_info(samples.model)
    size = (info.input_height, info.input_width)
    with av.open(str(samples.carphone)) as container:
        pictures = [p.to_ndarray(format="yuv420p")
                    for p, _ in zip(container.decode(video=0), range(count))]
    with av.open(str(samples.bikes)) as container:
        pictures.insert(0, next(container.decode(video=0)).to_ndarray(format="yuv420p"))
    frames = [make_frame(f"s{i % 2}", i, image) for i, image in enumerate(pictures[:count])]
    batch = BatcherStage("batch", size, 4, 1000.0, ("s0", "s1")).make_batch(frames)
    backend = create_backend(InferenceConfig(backend="onnxruntime", batch_size=4),
                             Path(samples.model), info)
    stage = InferStage("infer", backend, HostPreprocess(size, info.input_dtype, 4))
    (out,) = run_stage(stage, [batch])
    assert isinstance(out, ModelOutputs) and out.frames is batch and len(out) == count

    images = HostPreprocess(size, info.input_dtype, 4).run(batch)
    session = onnxruntime.InferenceSession(str(samples.model),
                                           providers=["CPUExecutionProvider"])
    expected = np.concatenate([session.run(None, {info.input_name: images[i:i + 1]})[0]
                               for i in range(count)])
    assert out.outputs.shape == (count, 4 + info.num_classes, expected.shape[2])
    np.testing.assert_allclose(out.outputs, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("installed, capability, backend, why", [
    ({"tensorrt", "torch", "onnx2torch"}, "9.0", "tensorrt", "tensorrt is installed"),
    ({"tensorrt_rtx", "torch", "onnx2torch"}, "8.6", "tensorrt", "runs on compute capability 8.6"),
    # make setup installs tensorrt_rtx: on an H100/H200 (9.0) auto must still take torch
    ({"tensorrt_rtx", "torch", "onnx2torch"}, "9.0", "torch",
     "tensorrt_rtx does not run on compute capability 9.0"),
    ({"torch", "onnx2torch"}, "9.0", "torch", "TensorRT is not installed"),
])
def test_auto_takes_tensorrt_rtx_only_where_it_runs(installed, capability, backend, why):
    chosen, reason = best_gpu_backend(capability, installed.__contains__)
    assert chosen == backend and why in reason


def test_auto_without_any_gpu_backend_says_what_to_install():
    with pytest.raises(BackendUnavailable, match="install torch and onnx2torch"):
        best_gpu_backend("9.0", {"tensorrt_rtx"}.__contains__)


def test_forced_tensorrt_on_a_gpu_tensorrt_rtx_refuses_is_one_line():
    only_rtx = {"tensorrt_rtx", "torch"}.__contains__
    with pytest.raises(BackendUnavailable, match=r"compute capability 9.0\): TensorRT-RTX "
                       r"supports 8.0, 8.6, 8.9, 12.0, 12.1; use backend: torch or auto"):
        check_tensorrt_runs("9.0", only_rtx)
    check_tensorrt_runs("8.9", only_rtx)  # supported: no error
    check_tensorrt_runs("9.0", {"tensorrt"}.__contains__)  # full TensorRT: no error
