"""Infer: run the model on each batch, with its preprocess before it and, on the GPU, the NMS
after it.

On the GPU path this stage queues the whole device work of a batch on the compute stream,
from one thread, in this order: wait for the batch's copies (one event), the fused preprocess
into the backend's input binding, the model, the NMS reading the output binding in place,
one D2H of the detections, the batch's ``done`` event. It never waits for the GPU. Doing all
of it on one thread is what makes the model's single input and output bindings safe to use
without copies: batch N+1's preprocess is queued only after batch N's model and NMS.

On the CPU path it preprocesses on the host and runs the backend; the postprocess stage
runs the NMS.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from pipeline.config import InferenceConfig
from pipeline.gpu import GpuContext
from pipeline.records import FrameBatch, ModelOutputs
from pipeline.stage import Stage
from stages.backends.base import InferenceBackend, ModelInfo
from stages.postprocess import DeviceNms
from stages.preprocess import DevicePreprocess, HostPreprocess

log = structlog.get_logger("infer")


class InferStage(Stage[FrameBatch, ModelOutputs]):
    """``FrameBatch`` in, ``ModelOutputs`` out (see the module docstring).

    ``open`` warms the backend up (compiles, captures its graphs: the seconds of a start),
    then the preprocess and NMS kernels; the graph opens its stages before any source starts,
    so no frame waits for the model. ``ready`` is set once that is done.

    Args:
        name: stage name.
        backend: the inference backend (warmed up by ``open``).
        preprocess: ``HostPreprocess`` (CPU path) or ``DevicePreprocess`` (GPU path).
        gpu: the ``GpuContext`` (GPU path), else None.
        nms: the ``DeviceNms`` (GPU path), else None.
    """

    def __init__(self, name: str, backend: InferenceBackend,
                 preprocess: HostPreprocess | DevicePreprocess, gpu: GpuContext | None = None,
                 nms: DeviceNms | None = None) -> None:
        super().__init__(name)
        self.backend, self.preprocess, self.gpu, self.nms = backend, preprocess, gpu, nms
        self._input: Any = None

    def input_binding(self, batch: int) -> Any:
        """The (batch, 3, H, W) device array the model reads: the backend's own static input
        when it has one (torch), else one array allocated at ``open`` (TensorRT binds any
        address)."""
        if hasattr(self.backend, "input_buffer"):
            return self.backend.input_buffer(batch)
        return self._input[:batch]

    def open(self) -> None:
        outputs = self.backend.warmup()
        log.info("model loaded", backend=self.backend.name, device=self.backend.device,
                 input=f"{self.backend.info.input_width}x{self.backend.info.input_height}",
                 classes=self.backend.info.num_classes, batch=self.backend.max_batch)
        if self.gpu is None:
            return
        import cupy

        self.gpu.activate()
        info, stream = self.backend.info, self.gpu.compute_stream
        dtype = np.dtype(getattr(self.backend, "input_dtype", info.input_dtype))
        if not hasattr(self.backend, "input_buffer"):
            self._input = cupy.zeros((self.backend.max_batch, 3, info.input_height,
                                      info.input_width), dtype)
        buffers = self.gpu.batches.sets[0]
        images = self.input_binding(self.backend.max_batch)
        self.preprocess.warmup(buffers, images, stream)
        outputs = self.backend.infer(images, stream)
        self.nms.warmup(outputs, buffers, stream)

    def process(self, item: FrameBatch) -> Iterable[ModelOutputs]:
        """Run the model on the frames at ``item.detect_rows`` (all, unless a source skips
        frames: then only those, as a smaller batch)."""
        n = len(item) if item.detect is None else int(item.detect.sum())
        if self.gpu is None:
            if n == 0:
                return (ModelOutputs(item),)
            frames = item if item.detect is None else item.select(item.detect_rows)
            return (ModelOutputs(item, self.backend.infer(self.preprocess.run(frames))),)
        gpu, stream = self.gpu, self.gpu.compute_stream
        gpu.activate()
        buffers = item.buffers
        stream.wait_event(buffers.copied)  # the batch's frames and tables are on the device
        if n == 0:  # nothing to detect: the set is free once its copies are done
            buffers.done.record(stream)
            return (ModelOutputs(item),)
        token = gpu.timeline.begin("compute", stream)
        images = self.input_binding(n)
        self.preprocess.enqueue(buffers, images, stream)
        outputs = self.backend.infer(images, stream)
        self.nms.enqueue(outputs, buffers, stream)
        gpu.timeline.end(token, stream)
        return (ModelOutputs(item),)

    def close(self) -> None:
        self.backend.close()


def prepare_backend(config: InferenceConfig, model_path: Path, on_gpu: bool) -> Any:
    """What the backend ``create_backend`` will build can do before the GPU is touched, done
    ahead (a standby engine, ``pipeline.app.engine``): on the GPU path, with torch installed
    and the backend ``torch`` or ``auto``, the model converted on the host and dynamo
    imported (``stages.backends.torch.prepare_module``). Returns it for
    ``create_backend(prepared=...)``, or None where nothing is prepared (the CPU path,
    TensorRT: their starts read a file). ``auto`` may still pick TensorRT then: the
    prepared module is left unused."""
    if not on_gpu or config.backend not in ("auto", "torch") or not module_installed("torch") \
            or not module_installed("onnx2torch"):
        return None
    from stages.backends.torch import prepare_module

    return prepare_module(model_path, config.compile)


def create_backend(config: InferenceConfig, model_path: Path, info: ModelInfo,
                   gpu: GpuContext | None = None, calibration_video: str | None = None,
                   prepared: Any = None) -> InferenceBackend:
    """The backend named in the config; ``auto`` picks the best one available.

    ``auto`` prefers tensorrt (TensorRT-RTX only on the GPUs its runtime supports), then
    torch, on a GPU and onnxruntime on the CPU, and logs which it took and why.
    ``calibration_video`` is used for int8 when the config names none; ``prepared`` is what
    ``prepare_backend`` gave for this config and model (used by torch), or None.
    """
    name = config.backend
    if name == "auto":
        if gpu is None:
            name, why = "onnxruntime", "no GPU in use"
        else:
            name, why = best_gpu_backend(compute_capability(gpu.device_id))
        log.info("backend chosen", backend=name, reason=why)
    if name == "onnxruntime":
        from stages.backends.onnxruntime import OnnxRuntimeBackend

        return OnnxRuntimeBackend(model_path, info, config.batch_size)
    if gpu is None:
        raise BackendUnavailable(f"inference.backend: {name!r} needs a GPU (device: cuda)")
    if name == "torch":
        from stages.backends.torch import TorchBackend

        return TorchBackend(model_path, info, config.batch_size, config.precision, gpu,
                            compile=config.compile, cache_dir=Path(config.engine_cache),
                            buckets=config.buckets(), module=prepared)
    if config.backend == "tensorrt":  # forced: say so at once on a GPU it cannot run on
        check_tensorrt_runs(compute_capability(gpu.device_id))
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


# Compute capabilities TensorRT-RTX's runtime accepts (its own error message lists them; it
# refuses data-centre GPUs such as the H100/H200 at 9.0). Full TensorRT runs on all of them.
TENSORRT_RTX_CAPABILITIES = frozenset({"8.0", "8.6", "8.9", "12.0", "12.1"})


def compute_capability(device_id: int) -> str:
    """The device's compute capability as "major.minor" (CuPy)."""
    import cupy

    capability = cupy.cuda.Device(device_id).compute_capability  # "90"
    return f"{capability[:-1]}.{capability[-1]}"


def module_installed(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def check_tensorrt_runs(capability: str,
                       installed: Callable[[str], bool] = module_installed) -> None:
    """Raise ``BackendUnavailable`` when ``backend: tensorrt`` cannot run on a GPU of
    compute ``capability``: only TensorRT-RTX is installed and it does not support it."""
    if installed("tensorrt") or not installed("tensorrt_rtx"):
        return  # full TensorRT runs everywhere; without either, the backend says so itself
    if capability not in TENSORRT_RTX_CAPABILITIES:
        supported = ", ".join(sorted(TENSORRT_RTX_CAPABILITIES, key=float))
        raise BackendUnavailable(
            f"inference.backend: 'tensorrt' cannot run on this GPU (compute capability "
            f"{capability}): TensorRT-RTX supports {supported}; use backend: torch or auto")


def best_gpu_backend(capability: str, installed: Callable[[str], bool] = module_installed
                     ) -> tuple[str, str]:
    """(backend, reason) for ``backend: auto`` on a GPU of compute ``capability``: full
    TensorRT when installed; TensorRT-RTX when installed and this GPU is one it runs on; else
    torch with onnx2torch.

    Raises:
        BackendUnavailable: none of them can run here.
    """
    if installed("tensorrt"):
        return "tensorrt", "tensorrt is installed"
    rtx = installed("tensorrt_rtx")
    if rtx and capability in TENSORRT_RTX_CAPABILITIES:
        return "tensorrt", f"tensorrt_rtx is installed and runs on compute capability {capability}"
    if installed("torch") and installed("onnx2torch"):
        why = (f"tensorrt_rtx does not run on compute capability {capability}" if rtx
               else "TensorRT is not installed")
        return "torch", f"{why}; torch and onnx2torch are installed"
    raise BackendUnavailable("no GPU backend installed for this GPU: install torch and "
                             "onnx2torch (or TensorRT)")
