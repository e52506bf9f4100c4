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

    The backend is warmed up in ``open()``, so the first frame is not slow.
    """

    def __init__(self, name: str, backend: InferenceBackend, gpu: Any = None) -> None:
        super().__init__(name)
        self.backend = backend
        self.gpu = gpu

    def open(self) -> None:
        self.backend.warmup()

    def process(self, item: Batch) -> Iterable[Batch]:
        stream = self.gpu.compute_stream if self.gpu is not None else None
        item.outputs = self.backend.infer(item.images[: len(item.frames)], stream)
        return (item,)

    def close(self) -> None:
        self.backend.close()


def create_backend(config: InferenceConfig, model_path: Path, info: ModelInfo,
                   gpu: Any = None) -> InferenceBackend:
    """The backend named in the config; ``auto`` picks the best one available.

    ``auto`` prefers tensorrt, then torch, on a GPU and onnxruntime on the CPU, and logs
    which it took and why.
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
    from stages.backends.tensorrt import TensorRtBackend

    return TensorRtBackend(model_path, config.batch_size, config.precision,
                           Path(config.engine_cache), gpu, None)


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
