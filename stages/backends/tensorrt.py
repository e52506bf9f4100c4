"""TensorRT inference backend: ONNX to engine, an on-disk engine cache, and execution.

Works with TensorRT 10.x and 11.x (``import tensorrt``) and TensorRT-RTX (``import
tensorrt_rtx``); full TensorRT wins when both are installed, and the log says which is used.
Every network is strongly typed and the precision lives in the ONNX graph
(:mod:`stages.backends.precision` writes the FP16 and the Q/DQ INT8 graphs), because
TensorRT 11 removed the precision builder flags and the INT8 calibrators.

Engine cache: ``cache_dir`` holds ``<model>.<precision>.b<batch>.<key>.engine`` and a JSON
record beside it. The key hashes the ONNX file's sha256, the target GPU (name and compute
capability), the TensorRT flavour and version, the precision, the batch profile
(1..max_batch) and, for INT8, the calibration video's sha256, method and frame count. An
intact engine with the same key is reused; otherwise one is built and the log says why
(nothing cached yet, which key fields changed, or a corrupt file). Full TensorRT's timing
cache is kept beside the engines and reused by later builds for the same GPU (TensorRT-RTX
ignores timing caches, so none is written for it).

No GPU visible (``build_engine_cli`` on a build machine): TensorRT-RTX builds an
ahead-of-time engine that runs on every compute capability it supports (8.0, 8.6, 8.9, 12.x),
keyed ``gpu: "no-gpu"``; at run time TensorRT-RTX falls back to that portable engine when no
engine built on the GPU itself is cached. Full TensorRT needs the target GPU to build.

Execution has not been run by this project's tests (no machine here can execute a TensorRT
engine): the caller's CuPy input and a CuPy output preallocated at ``max_batch`` are bound with
``set_tensor_address``, ``execute_async_v3`` runs on the pipeline's compute stream, the
``input_consumed`` event fires once TensorRT has read the input (so its slot can be refilled
early), and the output goes to NMS as a view, without a copy.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from pipeline.config import install_hint
from stages.backends.base import InferenceBackend, read_model_info
from stages.backends.precision import CalibrationSettings, convert_fp16, quantize_int8

log = structlog.get_logger("tensorrt")

PRECISIONS = ("fp32", "fp16", "int8")
NO_GPU = "no-gpu"
WORKSPACE_BYTES = 4 << 30
DEFAULT_CALIBRATION_FRAMES = 64
_DEFAULT_STREAMS = (0, 1, 2)  # null, cudaStreamLegacy, cudaStreamPerThread


class EngineBuildError(RuntimeError):
    """TensorRT could not parse the model or build an engine; the message says why."""


@dataclass(frozen=True)
class TensorRt:
    """The TensorRT Python module in use.

    Attributes:
        module: the imported ``tensorrt`` or ``tensorrt_rtx`` module.
        flavour: the module's name.
        version: its version string.
    """

    module: Any
    flavour: str
    version: str

    @property
    def is_rtx(self) -> bool:
        return self.flavour == "tensorrt_rtx"


def import_tensorrt(names: tuple[str, ...] = ("tensorrt", "tensorrt_rtx")) -> TensorRt:
    """Import the first TensorRT flavour of ``names`` that loads, and log which.

    Raises:
        ImportError: none loads; the message says what to install.
    """
    errors = []
    for name in names:
        try:
            module = importlib.import_module(name)
        except Exception as error:  # ImportError, or an install whose libraries fail to load
            errors.append(f"{name}: {error}")
            continue
        if name == "tensorrt" and int(module.__version__.split(".")[0]) < 10:
            errors.append(f"tensorrt {module.__version__} is older than 10")
            continue
        log.info("using TensorRT", flavour=name, version=module.__version__)
        return TensorRt(module, name, module.__version__)
    raise ImportError("the tensorrt backend needs TensorRT 10/11 (pip install tensorrt) or "
                      f"TensorRT-RTX ({install_hint('tensorrt')}); " + "; ".join(errors))


def gpu_target(device_id: int = 0) -> str:
    """The GPU an engine is built for, ``"<name> sm_<major><minor>"``, or ``NO_GPU``."""
    try:
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(device_id)
    except Exception:  # no CuPy, no driver or no such device
        return NO_GPU
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    return f"{name} sm_{props['major']}{props['minor']}"


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@dataclass(frozen=True)
class EngineKey:
    """Everything an engine depends on: an engine is reused only for an equal key."""

    model_sha256: str
    gpu: str
    flavour: str
    version: str
    precision: str
    batch_profile: str
    calibration: str | None = None

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def _severity_logger(m: Any) -> Any:
    """A TensorRT ILogger that forwards to the log and keeps the error messages."""

    class Logger(m.ILogger):
        def __init__(self) -> None:
            m.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity: Any, msg: str) -> None:
            s = m.ILogger.Severity
            level = {s.INTERNAL_ERROR: logging.ERROR, s.ERROR: logging.ERROR,
                     s.WARNING: logging.WARNING}.get(severity, logging.DEBUG)
            if level == logging.ERROR:
                self.errors.append(msg)
            if severity != s.VERBOSE:
                log.log(level, "TensorRT says", message=msg)

    return Logger()


def _progress_monitor(m: Any) -> Any:
    """A TensorRT IProgressMonitor that logs the start and end of each top-level phase."""

    class Progress(m.IProgressMonitor):
        def __init__(self) -> None:
            m.IProgressMonitor.__init__(self)
            self.started: dict[str, float] = {}

        def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
            if not parent_phase:
                self.started[phase_name] = time.perf_counter()
                log.info("TensorRT phase started", phase=phase_name, steps=num_steps)

        def step_complete(self, phase_name: str, step: int) -> bool:
            return True  # never cancel the build

        def phase_finish(self, phase_name: str) -> None:
            if phase_name in self.started:
                seconds = time.perf_counter() - self.started.pop(phase_name)
                log.info("TensorRT phase done", phase=phase_name, seconds=round(seconds, 1))

    return Progress()


def _write_atomic(path: Path, data: bytes) -> None:
    part = path.with_name(path.name + ".part")
    part.write_bytes(data)
    os.replace(part, path)


def build_engine(trt: TensorRt, onnx_path: Path, max_batch: int, target: str = NO_GPU,
                 timing_cache: Path | None = None,
                 workspace_bytes: int = WORKSPACE_BYTES) -> tuple[bytes, list[dict[str, Any]]]:
    """Build a serialized engine from an ONNX file with a strongly typed network.

    Args:
        trt: the TensorRT flavour to build with.
        onnx_path: the ONNX model, already in the wanted precision.
        max_batch: the optimisation profile covers batches 1..max_batch (optimum max_batch).
        target: ``gpu_target()`` of the GPU in use, or ``NO_GPU`` for a portable
            TensorRT-RTX engine.
        timing_cache: file the timing cache is read from and written back to (full
            TensorRT only); None for none.
        workspace_bytes: limit of the builder's workspace memory pool.

    Returns:
        The serialized engine and its I/O tensors as the network declares them: dicts of
        name, mode ("input"/"output"), shape (-1 for the batch), dtype (NumPy name) and, for
        inputs, the profile's [min, opt, max] shapes.

    Raises:
        EngineBuildError: the parser rejected the model (the message lists each error with
            its node), the model's batch is fixed and differs from ``max_batch``, or the build
            failed (the message carries TensorRT's last errors).
    """
    m = trt.module
    logger = _severity_logger(m)
    builder = m.Builder(logger)
    network = builder.create_network(1 << int(m.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = m.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "\n".join(f"  {parser.get_error(i)}" for i in range(parser.num_errors))
        raise EngineBuildError(f"TensorRT's ONNX parser rejected {onnx_path}:\n{errors}")
    if not network.num_inputs or not network.num_outputs:
        raise EngineBuildError(f"TensorRT's ONNX parser rejected {onnx_path}: the graph has "
                               f"{network.num_inputs} inputs and {network.num_outputs} outputs")

    config = builder.create_builder_config()
    config.set_memory_pool_limit(m.MemoryPoolType.WORKSPACE, workspace_bytes)
    profile, profiles = builder.create_optimization_profile(), {}
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        shape = tuple(tensor.shape)
        if shape[0] == -1:
            low, high = (1, *shape[1:]), (max_batch, *shape[1:])
            profile.set_shape(tensor.name, low, high, high)
            profiles[tensor.name] = {"profile": [list(low), list(high), list(high)]}
        elif shape[0] != max_batch:
            raise EngineBuildError(
                f"{onnx_path}: input {tensor.name} has a fixed batch of {shape[0]}, so the "
                f"batch size must be {shape[0]}, not {max_batch} (or export a dynamic batch)")
    if profiles:
        config.add_optimization_profile(profile)
    if trt.is_rtx and target != NO_GPU:
        config.num_compute_capabilities = 1
        config.set_compute_capability(m.ComputeCapability.CURRENT, 0)
    if trt.is_rtx:
        timing_cache = None
    if timing_cache is not None:
        cache = None
        with contextlib.suppress(RuntimeError):  # an unreadable cache: start a new one
            cache = config.create_timing_cache(
                timing_cache.read_bytes() if timing_cache.exists() else b"")
        config.set_timing_cache(cache or config.create_timing_cache(b""), False)
    progress = _progress_monitor(m)
    config.progress_monitor = progress

    log.info("TensorRT is building an engine; this can take minutes", onnx=onnx_path.name,
             flavour=trt.flavour, version=trt.version, batch=f"1..{max_batch}", target=target)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise EngineBuildError(f"TensorRT could not build an engine from {onnx_path}: "
                               + " | ".join(logger.errors[-5:] or ["no error was logged"]))
    if timing_cache is not None:
        _write_atomic(timing_cache, bytes(config.get_timing_cache().serialize()))

    def describe(tensor: Any, mode: str) -> dict[str, Any]:
        dtype = np.dtype(m.nptype(tensor.dtype)).name
        return {"name": tensor.name, "mode": mode, "shape": list(tensor.shape), "dtype": dtype,
                **profiles.get(tensor.name, {})}

    io = [describe(network.get_input(i), "input") for i in range(network.num_inputs)]
    io += [describe(network.get_output(i), "output") for i in range(network.num_outputs)]
    return bytes(plan), io


def _check_cached(path: Path, key: EngineKey) -> str | None:
    """None when ``path`` holds an intact engine for ``key``; otherwise why not."""
    record = path.with_suffix(".json")
    if not path.exists() and not record.exists():
        return "missing"
    try:
        meta = json.loads(record.read_text())
        if meta["key"] != asdict(key):
            return "its record holds another key"
        if meta["engine_sha256"] != file_sha256(path):
            return "checksum mismatch"
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def _miss_reason(cache_dir: Path, model_path: Path, key: EngineKey) -> str:
    """Which key fields differ from the newest engine cached for the same model."""
    records = sorted(cache_dir.glob(f"{model_path.stem}.*.json"), key=lambda p: p.stat().st_mtime)
    for record in reversed(records):
        try:
            old = json.loads(record.read_text())["key"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        changed = [f"{k} {old.get(k)!r} -> {v!r}" for k, v in asdict(key).items() if old.get(k) != v]
        return "changed since the last build: " + ", ".join(changed)
    return f"no cached engine for {model_path.name} in {cache_dir} yet"


def ensure_engine(trt: TensorRt, model_path: Path, max_batch: int, precision: str,
                  cache_dir: Path, calibration: CalibrationSettings | None = None,
                  target: str = NO_GPU, rebuild: bool = False) -> Path:
    """Return a cached engine for these settings, building (and caching) it when needed.

    Args:
        trt: the TensorRT flavour.
        model_path: the FP32 ONNX model.
        max_batch: largest batch of the optimisation profile.
        precision: ``fp32``, ``fp16`` or ``int8``.
        cache_dir: engine cache folder (created when missing).
        calibration: INT8 calibration settings; required for ``int8``.
        target: ``gpu_target()``, or ``NO_GPU`` (TensorRT-RTX only).
        rebuild: build even when an intact engine is cached (e.g. it failed to load).

    Returns:
        Path of the serialized engine.

    Raises:
        ValueError: bad precision, or ``int8`` without calibration settings or video.
        EngineBuildError: see ``build_engine``; or full TensorRT without a GPU.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "int8" and calibration is None:
        raise ValueError("precision int8 needs calibration settings: a video of the scene")
    if precision == "int8" and not Path(calibration.video).is_file():
        raise ValueError(f"calibration video {calibration.video} does not exist")
    if target == NO_GPU and not trt.is_rtx:
        raise EngineBuildError(
            f"{trt.flavour} {trt.version} builds engines for the GPU it runs on and sees none: "
            "build on the deployment machine, or install TensorRT-RTX (tensorrt-rtx-cu13) for "
            "GPU-less ahead-of-time builds")
    model_path, cache_dir = Path(model_path), Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    calibration_id = None
    if precision == "int8":
        calibration_id = (f"{calibration.method}, {calibration.frames} frames of "
                          f"sha256:{file_sha256(calibration.video)}")
    key = EngineKey(file_sha256(model_path), target, trt.flavour, trt.version, precision,
                    f"1..{max_batch}", calibration_id)

    def path_of(k: EngineKey) -> Path:
        return cache_dir / f"{model_path.stem}.{precision}.b{max_batch}.{k.digest()}.engine"

    path = path_of(key)
    problem = "rebuild requested" if rebuild else _check_cached(path, key)
    if problem is None:
        log.info("using cached TensorRT engine", path=str(path))
        return path
    portable = replace(key, gpu=NO_GPU)
    if trt.is_rtx and target != NO_GPU and not rebuild and not _check_cached(path_of(portable),
                                                                               portable):
        log.info("using the portable TensorRT-RTX engine", path=str(path_of(portable)), gpu=target)
        return path_of(portable)
    if problem == "missing":
        log.info("no cached TensorRT engine matches", engine=path.name,
                 reason=_miss_reason(cache_dir, model_path, key))
    else:
        log.warning("cached TensorRT engine is corrupt; rebuilding it", path=str(path),
                    reason=problem)

    onnx_path = model_path
    if precision == "fp16":
        onnx_path = convert_fp16(model_path, path.with_suffix(".onnx"))
    elif precision == "int8":
        log.info("calibrating INT8", method=calibration.method, frames=calibration.frames,
                 video=str(calibration.video))
        onnx_path = quantize_int8(model_path, path.with_suffix(".onnx"), calibration)
    slug = "".join(c if c.isalnum() else "-" for c in f"{trt.flavour}-{trt.version}-{target}")
    started = time.perf_counter()
    plan, io = build_engine(trt, onnx_path, max_batch, target, cache_dir / f"{slug}.timing")
    _write_atomic(path, plan)
    record = {"key": asdict(key), "engine_sha256": hashlib.sha256(plan).hexdigest(), "io": io,
              "onnx": onnx_path.name, "build_seconds": round(time.perf_counter() - started, 2)}
    _write_atomic(path.with_suffix(".json"), json.dumps(record, indent=2).encode())
    log.info("wrote TensorRT engine", path=str(path), megabytes=round(len(plan) / 1e6, 1))
    return path


def build_engine_cli(model_path: Path, max_batch: int, precision: str, cache_dir: Path,
                     calibration_video: Path | None = None, calibration_method: str = "entropy",
                     calibration_frames: int = DEFAULT_CALIBRATION_FRAMES) -> Path:
    """Prebuild the engine ahead of deployment (``python run.py build-engine``).

    Builds for the visible GPU, or, with TensorRT-RTX and no GPU, a portable engine keyed
    ``no-gpu`` that the backend uses on any GPU TensorRT-RTX supports. TensorRT's progress
    (each build phase starting and ending) is logged at info level.

    Args:
        model_path: the FP32 ONNX model.
        max_batch: the pipeline's batch size.
        precision: ``fp32``, ``fp16`` or ``int8``.
        cache_dir: the engine cache folder of the pipeline's config.
        calibration_video: INT8 only: a video of the deployment scene.
        calibration_method: INT8 only: ``entropy``, ``minmax`` or ``percentile``.
        calibration_frames: INT8 only: frames to calibrate on.

    Returns:
        Path of the engine in the cache.
    """
    trt = import_tensorrt()
    target = gpu_target(0)
    if target == NO_GPU:
        log.info("no GPU visible: building a portable engine for any GPU TensorRT-RTX "
                 "supports", cache_key_gpu=NO_GPU)
    calibration = None
    if calibration_video is not None:
        calibration = CalibrationSettings(Path(calibration_video), calibration_method,
                                          calibration_frames)
    return ensure_engine(trt, Path(model_path), max_batch, precision, Path(cache_dir),
                         calibration, target)


class TensorRtBackend(InferenceBackend):
    """Runs a TensorRT engine on CuPy buffers on the pipeline's compute stream.

    Attributes:
        output: (max_batch, 4 + classes, anchors) CuPy array on ``gpu.device_id``, the engine's
            output dtype (float32); TensorRT writes it, ``infer`` returns views of it.
        input_consumed: CuPy event recorded once TensorRT has read the input of the latest
            ``infer``; a stream that refills that input buffer waits on it first.
    """

    name = "tensorrt"
    device = "cuda"

    def __init__(self, model_path: Path, max_batch: int, precision: str, cache_dir: Path,
                 gpu: Any, calibration: CalibrationSettings | None = None) -> None:
        import cupy

        info = read_model_info(model_path)
        super().__init__(info, max_batch)
        self._trt = import_tensorrt()
        m = self._trt.module
        self._gpu, self._device = gpu, cupy.cuda.Device(gpu.device_id)
        settings = (self._trt, Path(model_path), max_batch, precision, Path(cache_dir),
                    calibration, gpu_target(gpu.device_id))
        self._logger = _severity_logger(m)
        with self._device:
            path = ensure_engine(*settings)
            self._runtime = m.Runtime(self._logger)
            self._engine = self._runtime.deserialize_cuda_engine(path.read_bytes())
            if self._engine is None:
                log.warning("TensorRT could not load the engine; rebuilding it", path=str(path),
                            errors=" | ".join(self._logger.errors[-3:]))
                path = ensure_engine(*settings, rebuild=True)
                self._engine = self._runtime.deserialize_cuda_engine(path.read_bytes())
            if self._engine is None:
                raise EngineBuildError(f"TensorRT could not load the engine it built: {path}")
            self._context = self._engine.create_execution_context()
            engine = self._engine
            out_dtype = np.dtype(m.nptype(engine.get_tensor_dtype(info.output_name)))
            out_shape = tuple(engine.get_tensor_shape(info.output_name))[1:]
            self.output = cupy.empty((max_batch, *out_shape), out_dtype)
            self._context.set_tensor_address(info.output_name, self.output.data.ptr)
            self.input_consumed = cupy.cuda.Event(disable_timing=True)
            self._context.set_input_consumed_event(self.input_consumed.ptr)
        in_dtype = np.dtype(m.nptype(engine.get_tensor_dtype(info.input_name)))
        self.info = replace(info, input_dtype=in_dtype)

    def infer(self, images: Any, stream: Any = None) -> Any:
        """Enqueue the engine on ``stream``; returns a view of ``output``.

        Args:
            images: (B, 3, H, W) C-contiguous CuPy array of ``info.input_dtype`` on
                ``gpu.device_id``, 1 <= B <= max_batch, valid on ``stream``; bound in place.
            stream: the non-default CuPy stream to run on; None means ``gpu.compute_stream``.

        Returns:
            ``output[:B]``, (B, 4 + classes, anchors) CuPy array written by work queued on
            ``stream``, valid until the next call.
        """
        stream = self._gpu.compute_stream if stream is None else stream
        if stream.ptr in _DEFAULT_STREAMS:
            raise ValueError("TensorRT must run on a non-default stream (the compute stream)")
        shape = (self.max_batch, 3, self.info.input_height, self.info.input_width)
        batch = images.shape[0]
        if (not 1 <= batch <= self.max_batch or tuple(images.shape[1:]) != shape[1:]
                or images.dtype != self.info.input_dtype or not images.flags.c_contiguous):
            raise ValueError(f"images must be a C-contiguous (1..{shape[0]}, {shape[1]}, "
                             f"{shape[2]}, {shape[3]}) {self.info.input_dtype} array, got "
                             f"{tuple(images.shape)} {images.dtype}")
        with self._device:
            self._context.set_input_shape(self.info.input_name, tuple(images.shape))
            self._context.set_tensor_address(self.info.input_name, images.data.ptr)
            if not self._context.execute_async_v3(stream.ptr):
                raise RuntimeError("TensorRT execute_async_v3 failed: "
                                   + " | ".join(self._logger.errors[-3:]))
        return self.output[:batch]

    def warmup(self) -> Any:
        """Run one ``max_batch`` batch of CuPy dummies on the compute stream and wait for it.

        Returns:
            ``output``, (max_batch, 4 + classes, anchors) CuPy array, complete.
        """
        import cupy

        stream = self._gpu.compute_stream
        shape = (self.max_batch, 3, self.info.input_height, self.info.input_width)
        with self._device, stream:
            out = self.infer(cupy.full(shape, 0.5, dtype=self.info.input_dtype), stream)
            stream.synchronize()
        return out

    def close(self) -> None:
        """Release the execution context, engine and runtime, in that order."""
        self._context = self._engine = self._runtime = None
