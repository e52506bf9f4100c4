"""Infer: run the model on each batch with the configured backend."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import structlog

from pipeline.config import InferenceConfig
from pipeline.records import Batch
from pipeline.stage import Stage
from stages.backends.base import InferenceBackend, ModelInfo

log = structlog.get_logger("infer")


class InferStage(Stage):
    """Runs ``backend.infer`` on a batch's images and stores the raw output in the batch.

    On the GPU path the work is queued on the compute stream, and the output lands in the
    batch's ``BatchBuffers.outputs`` (copied device to device when the backend returns its
    own static buffer, e.g. a CUDA graph's output), so the next batch cannot overwrite it
    before the postprocess stage has read it. The backend is warmed up before the graph
    starts (``pipeline.build``).
    """

    def __init__(self, name: str, backend: InferenceBackend, gpu: Any = None) -> None:
        super().__init__(name)
        self.backend = backend
        self.gpu = gpu

    def process(self, item: Batch) -> Iterable[Batch]:
        count = len(item.frames)
        if self.gpu is None:
            item.outputs = self.backend.infer(item.images[:count])
            return (item,)
        self.gpu.activate()
        stream = self.gpu.compute_stream
        outputs = self.backend.infer(item.images[:count], stream)
        target = item.buffers.outputs[:count]
        if outputs.data.ptr != target.data.ptr:
            with stream:
                target[...] = outputs
        item.outputs = target
        return (item,)

    def close(self) -> None:
        self.backend.close()


def create_backend(config: InferenceConfig, model_path: Path, info: ModelInfo,
                   gpu: Any = None, calibration_video: str | None = None) -> InferenceBackend:
    """The backend named in the config; ``auto`` picks the best one available.

    ``auto`` prefers tensorrt, then torch, on a GPU and onnxruntime on the CPU, and logs
    which it took and why. ``calibration_video`` is used for int8 when the config names none.
    """
    name = config.backend
    if name == "auto":
        if gpu is None:
            name, why = "onnxruntime", "no GPU in use"
        else:
            name, why = _best_gpu_backend()
        log.info("backend chosen", backend=name, reason=why)
    if name == "onnxruntime":
        from stages.backends.onnxruntime import OnnxRuntimeBackend

        return OnnxRuntimeBackend(model_path, info, config.batch_size)
    if gpu is None:
        raise BackendUnavailable(f"inference.backend: {name!r} needs a GPU (device: cuda)")
    if name == "torch":
        from stages.backends.torch import TorchBackend

        return TorchBackend(model_path, info, config.batch_size, config.precision, gpu)
    from stages.backends.precision import CalibrationSettings
    from stages.backends.tensorrt import TensorRtBackend

    video = config.calibration_video or calibration_video
    calibration = None
    if config.precision == "int8" and video is not None:
        calibration = CalibrationSettings(Path(video), config.calibration_method,
                                          config.calibration_frames)
    return TensorRtBackend(model_path, config.batch_size, config.precision,
                           Path(config.engine_cache), gpu, calibration)


class BackendUnavailable(RuntimeError):
    """The configured backend cannot run here; the message says why."""


def _best_gpu_backend() -> tuple[str, str]:
    import importlib.util

    for module in ("tensorrt", "tensorrt_rtx"):
        if importlib.util.find_spec(module) is not None:
            return "tensorrt", f"{module} is installed"
    if importlib.util.find_spec("torch") and importlib.util.find_spec("onnx2torch"):
        return "torch", "TensorRT is not installed; torch and onnx2torch are"
    raise BackendUnavailable("no GPU backend installed: install tensorrt or torch + onnx2torch")
