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
        output_name: name of the output tensor.
        num_classes: classes the model tells apart (an end-to-end model's output does not
            say: then the count of the names in its metadata, or 0 when unknown).
        dynamic_batch: True when the batch dimension of the model is symbolic.
        layout: the output's layout (``LAYOUTS``): ``yolov8`` (B, 4 + K, A) box rows then
            class scores per anchor column; ``yolov5`` (B, A, 5 + K) per anchor row: box,
            objectness, class probabilities (score = objectness x probability);
            ``end2end`` (B, N, 6) detections after NMS: x1, y1, x2, y2, score, class.
        names: class names from the model's metadata (Ultralytics writes ``names``), or
            None.
    """

    input_name: str
    input_height: int
    input_width: int
    input_dtype: np.dtype
    output_name: str
    num_classes: int
    dynamic_batch: bool
    layout: str = "yolov8"
    names: tuple[str, ...] | None = None


LAYOUTS = ("yolov8", "yolov5", "end2end")
SUPPORTED = ("supported: (batch, 4 + classes, anchors) yolov8/yolo11, (batch, anchors, "
             "5 + classes) yolov5/yolov7, (batch, detections, 6) end to end (yolov10, yolo26, "
             "NMS inside)")


def metadata_names(model: Any) -> tuple[str, ...] | None:
    """Class names from an Ultralytics export's metadata (``names``: "{0: 'person', ...}")."""
    import ast

    for prop in model.metadata_props:
        if prop.key == "names":
            try:
                names = ast.literal_eval(prop.value)
            except (ValueError, SyntaxError):
                return None
            if isinstance(names, dict) and sorted(names) == list(range(len(names))):
                return tuple(str(names[i]) for i in range(len(names)))
            if isinstance(names, list):
                return tuple(str(n) for n in names)
    return None


def detect_layout(out_dims: list[int | str], height: int, width: int,
                  forced: str = "auto") -> str:
    """The output layout (``LAYOUTS``) of a (batch, d1, d2) output, or ``forced``.

    Raises:
        ValueError: the shape fits no layout, or two (a (batch, n, 6) output whose n is a
            YOLO anchor count: set ``model.layout``), or not the forced one.
    """
    _, rows, columns = out_dims
    shape = f"(batch, {rows}, {columns})"
    if not isinstance(columns, int) or (not isinstance(rows, int) and forced == "auto"):
        if forced == "yolov8" and isinstance(rows, int) and rows > 4:
            return forced
        raise ValueError(f"output {shape} has a symbolic size: set model.layout; {SUPPORTED}")
    fits = set()
    anchors = yolo_anchor_counts(height, width)
    # A YOLO head has at least the cells of one grid: ceil(H / 64) x ceil(W / 64) or more.
    coarsest = -(-height // 64) * -(-width // 64)
    if isinstance(rows, int) and 4 < rows < columns and (columns >= coarsest or forced == "yolov8"):
        fits.add("yolov8")
    if 5 < columns < rows and rows in anchors:
        fits.add("yolov5")
    if columns == 6:
        fits.add("end2end")
    if forced != "auto":
        if forced not in fits:
            raise ValueError(f"output {shape} is not the {forced} layout; {SUPPORTED}")
        return forced
    if len(fits) > 1:  # (batch, n, 6) with n a grid's anchors: a one-class YOLOv5 too
        raise ValueError(f"output {shape} fits the {' and the '.join(sorted(fits))} layouts: "
                         "set model.layout")
    if not fits:
        raise ValueError(f"output {shape} fits no layout; {SUPPORTED}")
    return fits.pop()


def yolo_anchor_counts(height: int, width: int) -> set[int]:
    """Anchor counts of YOLO heads for a height x width input: one or three anchors per cell
    of two or more consecutive grids of strides 4, 8, 16, 32, 64 (YOLOv8 at 640: 8,400;
    YOLOv5 at 640: 25,200; YOLOv3-tiny at 416: 2,535)."""
    cells = [-(-height // stride) * -(-width // stride) for stride in (4, 8, 16, 32, 64)]
    return {per_cell * sum(cells[first:last])
            for first in range(len(cells)) for last in range(first + 2, len(cells) + 1)
            for per_cell in (1, 3)}


def read_model_info(model_path: str | Path, layout: str = "auto") -> ModelInfo:
    """Read the input and output description of a YOLO ONNX model, its output layout
    (``detect_layout``, or ``layout`` when not auto) and its metadata's class names.

    Raises:
        ValueError: not an ONNX file, or the model does not have one image input (B, 3, H, W)
            with fixed H, W and an output of one of the ``LAYOUTS``.
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
    if len(out_dims) != 3:
        raise ValueError(f"{model_path}: output {out_dims} has {len(out_dims)} dimensions, not 3; "
                         f"{SUPPORTED}")
    height, width = int(in_dims[2]), int(in_dims[3])
    try:
        layout = detect_layout(out_dims, height, width, layout)
    except ValueError as error:
        raise ValueError(f"{model_path}: {error}") from None
    names = metadata_names(model)
    if layout == "yolov8":
        classes = int(out_dims[1]) - 4
    elif layout == "yolov5":
        classes = int(out_dims[2]) - 5
    else:  # end to end: the output has no class dimension
        classes = len(names or ())
    elem_type = inputs[0].type.tensor_type.elem_type
    return ModelInfo(
        input_name=inputs[0].name,
        input_height=height,
        input_width=width,
        input_dtype=np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type)),
        output_name=graph.output[0].name,
        num_classes=classes,
        dynamic_batch=not isinstance(in_dims[0], int) or in_dims[0] <= 0,
        layout=layout,
        names=names,
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
