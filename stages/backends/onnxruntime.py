"""The onnxruntime backend: CPU everywhere (CUDA where onnxruntime-gpu is installed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime

from stages.backends.base import InferenceBackend, ModelInfo


class OnnxRuntimeBackend(InferenceBackend):
    """Runs the ONNX model with onnxruntime on host arrays.

    A model with a fixed batch of 1 is run one image at a time.

    Args:
        model_path: the ONNX file.
        info: its input/output description.
        max_batch: largest batch passed to ``infer``.
        threads: intra-op threads; 0 lets onnxruntime decide.
    """

    name = "onnxruntime"
    device = "cpu"

    def __init__(self, model_path: str | Path, info: ModelInfo, max_batch: int,
                 threads: int = 0) -> None:
        super().__init__(info, max_batch)
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.log_severity_level = 3
        self.session = onnxruntime.InferenceSession(
            str(model_path), options, providers=["CPUExecutionProvider"])

    def infer(self, images: Any, stream: Any = None) -> np.ndarray:
        """Args: images (B, 3, H, W) host array of the model's input dtype.
        Returns: (B, 4 + classes, anchors) float32 host array."""
        if self.info.dynamic_batch:
            return self.session.run([self.info.output_name], {self.info.input_name: images})[0]
        return np.concatenate([
            self.session.run([self.info.output_name], {self.info.input_name: images[i:i + 1]})[0]
            for i in range(images.shape[0])
        ])
