"""Wires the graph of stages from a validated configuration."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import av
import numpy as np
import structlog

from pipeline.config import PipelineConfig, is_stream_url
from pipeline.gpu import GpuContext, gpu_unavailable_reason
from pipeline.graph import Graph
from pipeline.records import Frame
from pipeline.stage import SourceStage, Stage
from stages.annotate import AnnotateStage
from stages.backends.base import InferenceBackend, read_model_info
from stages.decode import DecodeStage
from stages.device_upload import DeviceUploadStage
from stages.gpu_decode import GpuDecodeStage, gpu_decode_unavailable_reason
from stages.infer import InferStage, create_backend
from stages.postprocess import GpuPostprocessStage, PostprocessStage
from stages.preprocess import GpuPreprocessStage, PreprocessStage
from stages.sinks import SinkStage

log = structlog.get_logger("build")

DEFAULT_FRAME_SIZE = (1920, 1080)  # staging slot size when no source announces a larger one
BATCH_SETS = 3  # batch buffers: one filling, one in inference, one in postprocess


class DeviceUnavailable(RuntimeError):
    """``inference.device: cuda`` was asked for and the GPU path cannot run."""


def read_class_names(path: str | None) -> list[str] | None:
    """Class names, one per line, or None when no file is configured."""
    if path is None:
        return None
    return [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]


def create_gpu_context(config: PipelineConfig, profile: bool = False) -> GpuContext | None:
    """The GPU context when ``inference.device`` resolves to cuda, else None."""
    device = config.inference.device
    if device == "cpu":
        return None
    reason = gpu_unavailable_reason()
    if reason is not None:
        if device == "cuda":
            raise DeviceUnavailable(f"inference.device: 'cuda' cannot be used: {reason}")
        log.info("using the CPU path", reason=reason)
        return None
    return GpuContext(config.inference.gpu_id, profile=profile)


def first_file_source(config: PipelineConfig) -> str | None:
    """The first source that is a file (INT8 calibration's default video), or None."""
    return next((s.uri for s in config.sources if not is_stream_url(s.uri)), None)


def probe_frame_size(uri: str) -> tuple[int, int] | None:
    """(width, height) of a file's first video stream, rounded down to even, or None."""
    try:
        with av.open(uri) as container:
            stream = container.streams.video[0]
            return stream.width & ~1, stream.height & ~1
    except (av.FFmpegError, OSError, IndexError):
        return None


def build_graph(config: PipelineConfig, on_frame_done: Callable[[Frame], None] | None = None,
                profile_gpu: bool = False) -> Graph:
    """Create every stage the configuration asks for and connect them.

    CPU path: decode -> preprocess (batching) -> infer -> postprocess -> annotate -> sinks.
    GPU path: decode -> upload -> preprocess (fused kernel) -> infer -> postprocess (Numba
    NMS) -> annotate -> sinks, with every buffer allocated here, before the first frame.
    """
    info = read_model_info(config.model.path)
    class_names = read_class_names(config.model.class_names)
    if class_names is not None and len(class_names) != info.num_classes:
        log.warning("class names do not match the model", names=len(class_names),
                    model_classes=info.num_classes)
    gpu = create_gpu_context(config, profile_gpu)
    backend = create_backend(config.inference, Path(config.model.path), info, gpu,
                             first_file_source(config))
    probe_output = backend.warmup()
    log.info("model loaded", path=config.model.path, backend=backend.name, device=backend.device,
             input=f"{info.input_width}x{info.input_height}", classes=info.num_classes,
             batch=config.inference.batch_size)

    stop = threading.Event()
    sources = [create_source(config, index, gpu) for index in range(len(config.sources))]
    inference = config.inference
    size = (info.input_height, info.input_width)
    chain: list[Stage]
    if gpu is None:
        chain = [
            PreprocessStage("preprocess", size, np.dtype(np.float32), inference.batch_size,
                            inference.batch_timeout_ms),
            InferStage("infer", backend),
            PostprocessStage("postprocess", config.nms),
        ]
    else:
        nv12 = any(isinstance(source, GpuDecodeStage) for source in sources)
        chain = gpu_chain(config, gpu, backend, probe_output, stop,
                          ("i420", "nv12") if nv12 else ("i420",))
    if config.output.video is not None:
        chain.append(AnnotateStage("annotate", class_names))
    sinks = {
        source.name: SinkStage(
            f"sink:{source.name}",
            config.output_path(config.output.video, source.name) if config.output.video else None,
            config.output_path(config.output.jsonl, source.name) if config.output.jsonl else None,
            class_names,
            config.output.video_crf,
        )
        for source in config.sources
    }
    graph = Graph(sources, chain, sinks, config.runtime.queue_size, on_frame_done, stop=stop)
    graph.gpu = gpu
    return graph


def create_source(config: PipelineConfig, index: int, gpu: GpuContext | None) -> SourceStage:
    """The source stage of ``config.sources[index]``: GPU decode or CPU decode (its ``decode``).

    Raises:
        DeviceUnavailable: ``decode: gpu`` was asked for and cannot run (the message says why).
    """
    source = config.sources[index]
    if source.decode == "cpu":
        return DecodeStage(source)
    reason = ("inference does not run on the GPU" if gpu is None else
              "output.video needs the frames on the host" if config.output.video else
              gpu_decode_unavailable_reason())
    if reason is None:
        return GpuDecodeStage(source, gpu.device_id)
    if source.decode == "gpu":
        raise DeviceUnavailable(f"sources[{index}].decode: 'gpu' cannot be used: {reason}")
    return DecodeStage(source)


def gpu_chain(config: PipelineConfig, gpu: GpuContext, backend: InferenceBackend,
              probe_output: object, stop: threading.Event,
              pixel_formats: tuple[str, ...] = ("i420",)) -> list[Stage]:
    """Allocate the GPU buffers and create the GPU stages."""
    inference, info = config.inference, backend.info
    sizes = [s for s in (probe_frame_size(src.uri) for src in config.sources
                         if not src.is_live) if s is not None]
    largest = max([DEFAULT_FRAME_SIZE, *sizes], key=lambda wh: wh[0] * wh[1])
    slots = config.runtime.staging_slots or (2 * inference.batch_size + config.runtime.queue_size)
    input_dtype = np.dtype(getattr(backend, "input_dtype", info.input_dtype))
    output_shape = (inference.batch_size, *probe_output.shape[1:])  # type: ignore[attr-defined]
    output_dtype = probe_output.dtype  # type: ignore[attr-defined]
    gpu.allocate(slots, largest[0] * largest[1] * 3 // 2, BATCH_SETS,
                 (inference.batch_size, 3, info.input_height, info.input_width), input_dtype,
                 output_shape, output_dtype)
    return [
        DeviceUploadStage("upload", gpu, stop),
        GpuPreprocessStage("preprocess", (info.input_height, info.input_width), input_dtype,
                           inference.batch_size, inference.batch_timeout_ms, gpu,
                           sorted(set(sizes)), stop, pixel_formats),
        InferStage("infer", backend, gpu),
        GpuPostprocessStage("postprocess", config.nms, gpu, inference.batch_size,
                            output_shape[2], output_shape[1] - 4, output_dtype),
    ]
