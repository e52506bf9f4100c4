"""Wires the graph of stages from a validated configuration."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import structlog

from pipeline.config import PipelineConfig
from pipeline.graph import Graph
from pipeline.records import Frame
from stages.annotate import AnnotateStage
from stages.backends.base import read_model_info
from stages.decode import DecodeStage
from stages.infer import InferStage, create_backend
from stages.postprocess import PostprocessStage
from stages.preprocess import PreprocessStage
from stages.sinks import SinkStage

log = structlog.get_logger("build")


def read_class_names(path: str | None) -> list[str] | None:
    """Class names, one per line, or None when no file is configured."""
    if path is None:
        return None
    return [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]


def build_graph(config: PipelineConfig,
                on_frame_done: Callable[[Frame], None] | None = None) -> Graph:
    """Create every stage the configuration asks for and connect them.

    CPU path: decode -> preprocess (batching) -> infer -> postprocess -> annotate -> sinks.
    """
    info = read_model_info(config.model.path)
    class_names = read_class_names(config.model.class_names)
    if class_names is not None and len(class_names) != info.num_classes:
        log.warning("class names do not match the model", names=len(class_names),
                    model_classes=info.num_classes)
    backend = create_backend(config.inference, Path(config.model.path), info)
    log.info("model loaded", path=config.model.path, backend=backend.name, device=backend.device,
             input=f"{info.input_width}x{info.input_height}", classes=info.num_classes,
             batch=config.inference.batch_size)

    sources = [DecodeStage(source) for source in config.sources]
    chain = [
        PreprocessStage("preprocess", (info.input_height, info.input_width),
                        np.dtype(np.float32) if backend.device == "cpu" else info.input_dtype,
                        config.inference.batch_size, config.inference.batch_timeout_ms),
        InferStage("infer", backend),
        PostprocessStage("postprocess", config.nms),
    ]
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
    return Graph(sources, chain, sinks, config.runtime.queue_size, on_frame_done)
