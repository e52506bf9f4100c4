"""The interface every inference backend implements (onnxruntime, torch, tensorrt)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class ModelInfo:
    """What the pipeline needs to know about a detection model's input and output.

    Attributes:
        input_name: name of the image input tensor.
        input_height, input_width: model input size in pixels, read from the model file.
        input_dtype: dtype the model wants for its image input (float32 or float16).
        output_name: name of the output tensor of layout (B, 4 + classes, anchors).
        num_classes: number of class score rows in the output.
        dynamic_batch: True when the batch dimension of the model is symbolic.
    """

    input_name: str
    input_height: int
    input_width: int
    input_dtype: np.dtype
    output_name: str
    num_classes: int
    dynamic_batch: bool


def read_model_info(model_path: str | Path) -> ModelInfo:
    """Read the input and output description of a YOLO-layout ONNX model.

    Raises:
        ValueError: not an ONNX file, or the model does not have one image input (B, 3, H, W)
            with fixed H, W and an output (B, 4 + classes, anchors) with more anchors than
            rows.
    """
    import onnx

    try:
        model = onnx.load(str(model_path), load_external_data=False)
    except Exception as error:  # noqa: BLE001 - protobuf raises its own DecodeError, and more
        raise ValueError(f"{str(model_path)!r} is not an ONNX model ({type(error).__name__})"
                         ) from None
    graph = model.graph
    initializers = {init.name for init in graph.initializer}
    inputs = [i for i in graph.input if i.name not in initializers]
    if len(inputs) != 1 or len(graph.output) < 1:
        raise ValueError(f"{model_path}: expected one input and an output, got {len(inputs)} inputs")

    def dims(value_info: Any) -> list[int | str]:
        return [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?")
                for d in value_info.type.tensor_type.shape.dim]

    in_dims, out_dims = dims(inputs[0]), dims(graph.output[0])
    if len(in_dims) != 4 or in_dims[1] != 3 or not all(isinstance(d, int) for d in in_dims[2:]):
        raise ValueError(f"{model_path}: input must be (batch, 3, H, W) with fixed H, W, got {in_dims}")
    if len(out_dims) != 3 or not isinstance(out_dims[1], int) or out_dims[1] <= 4:
        raise ValueError(f"{model_path}: output must be (batch, 4 + classes, anchors), got {out_dims}")
    anchors = out_dims[2]
    if isinstance(anchors, int) and anchors <= out_dims[1]:
        raise ValueError(
            f"{model_path}: output {out_dims} is not (batch, 4 + classes, anchors): a YOLO head "
            f"has more anchors than rows ({anchors} <= {out_dims[1]}); a (batch, anchors, "
            "5 + classes) export is not supported")
    elem_type = inputs[0].type.tensor_type.elem_type
    return ModelInfo(
        input_name=inputs[0].name,
        input_height=int(in_dims[2]),
        input_width=int(in_dims[3]),
        input_dtype=np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type)),
        output_name=graph.output[0].name,
        num_classes=int(out_dims[1]) - 4,
        dynamic_batch=not isinstance(in_dims[0], int) or in_dims[0] <= 0,
    )


class InferenceBackend(ABC):
    """Runs a YOLO-layout detection model on a batch of preprocessed images.

    A backend is created once per pipeline, warmed up by ``warmup()`` before the first frame,
    and called from one thread (the infer stage's).

    Attributes:
        name: backend name as written in the config (``onnxruntime``, ``torch``, ``tensorrt``).
        device: ``cpu`` when ``infer`` takes and returns NumPy arrays, ``cuda`` when it takes
            and returns CuPy arrays.
        info: the model's input and output description.
        max_batch: largest batch ``infer`` accepts.
    """

    name: str = ""
    device: str = "cpu"

    def __init__(self, info: ModelInfo, max_batch: int) -> None:
        self.info = info
        self.max_batch = max_batch

    @abstractmethod
    def infer(self, images: Any, stream: Any = None) -> Any:
        """Run the model.

        Args:
            images: (B, 3, H, W) array of ``info.input_dtype``, RGB scaled to 0..1, B at most
                ``max_batch``; NumPy on a ``cpu`` backend, CuPy on a ``cuda`` backend.
            stream: the CuPy stream the input is valid on and the work must run on
                (``cuda`` backends); None on the CPU.

        Returns:
            (B, 4 + classes, anchors) float32 or float16 array on the same device as
            ``images``. A ``cuda`` backend may return a view of a preallocated buffer that
            stays valid until the next call; work writing it is queued on ``stream``.
        """

    def warmup(self) -> Any:
        """Run once on a dummy batch of ``max_batch`` so the first real frame is not slow.

        Returns:
            The output of that run (its shape and dtype size the pipeline's buffers).
        """
        shape = (self.max_batch, 3, self.info.input_height, self.info.input_width)
        return self.infer(np.full(shape, 0.5, dtype=self.info.input_dtype))

    def close(self) -> None:
        """Release the backend's resources."""
