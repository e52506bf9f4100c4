"""Records that flow between stages: frames, detections and batches.

Every record is a dataclass validated in ``__post_init__``. Arrays may be NumPy (host) or
CuPy (device) arrays; the records never import CuPy themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np


def _check_shape(name: str, array: Any, expected: tuple[int | None, ...]) -> None:
    """Raise ValueError unless ``array.shape`` matches ``expected`` (None matches any size)."""
    shape = tuple(array.shape)
    ok = len(shape) == len(expected) and all(e is None or e == s for s, e in zip(shape, expected))
    if not ok:
        want = "(" + ", ".join("n" if e is None else str(e) for e in expected) + ")"
        raise ValueError(f"{name} must have shape {want}, got {shape}")


@dataclass
class Detections:
    """Detections of one frame, in original-frame pixel coordinates.

    Attributes:
        xyxy: (n, 4) float32 boxes as x1, y1, x2, y2; host (NumPy) or device (CuPy).
        confidence: (n,) float32 scores in [0, 1], same device as ``xyxy``.
        class_id: (n,) int32 class indices, same device as ``xyxy``.

    The layout matches ``supervision.Detections``, so
    ``sv.Detections(xyxy=d.xyxy, confidence=d.confidence, class_id=d.class_id)`` copies nothing.
    """

    xyxy: Any
    confidence: Any
    class_id: Any

    def __post_init__(self) -> None:
        _check_shape("xyxy", self.xyxy, (None, 4))
        n = self.xyxy.shape[0]
        _check_shape("confidence", self.confidence, (n,))
        _check_shape("class_id", self.class_id, (n,))

    @classmethod
    def empty(cls) -> Detections:
        """No detections: host arrays of length 0."""
        return cls(
            xyxy=np.empty((0, 4), np.float32),
            confidence=np.empty((0,), np.float32),
            class_id=np.empty((0,), np.int32),
        )

    def __len__(self) -> int:
        return int(self.xyxy.shape[0])

    def __getitem__(self, index: Any) -> Detections:
        """Select detections with a boolean mask, an index array or a slice."""
        if isinstance(index, (int, np.integer)):
            index = slice(int(index), int(index) + 1)
        return Detections(self.xyxy[index], self.confidence[index], self.class_id[index])

    def to_records(self, class_names: list[str] | None = None) -> list[dict[str, Any]]:
        """Plain dicts for JSON output (host arrays only)."""
        out = []
        for box, score, cls in zip(self.xyxy.tolist(), self.confidence.tolist(), self.class_id.tolist()):
            record: dict[str, Any] = {
                "class_id": int(cls),
                "confidence": round(float(score), 4),
                "xyxy": [round(float(v), 2) for v in box],
            }
            if class_names is not None and 0 <= cls < len(class_names):
                record["class_name"] = class_names[cls]
            out.append(record)
        return out


@dataclass
class Frame:
    """One decoded video frame and everything learnt about it on its way through the graph.

    Attributes:
        source: name of the source (unique in the config).
        index: 0-based frame number within the source (counts every decoded frame).
        pts: presentation time in seconds from the stream, or None when the stream has none.
        capture_time: wall-clock ``time.time()`` when the decoder produced the frame.
        width, height: size of the decoded picture in pixels (both even).
        rate: the source's nominal frame rate in frames per second, or None when unknown.
        image: the picture as I420 (YUV 4:2:0 planar): (height * 3 // 2, width) uint8 host
            array, rows 0..height-1 the Y plane, then the U and the V plane, each
            (height // 2) x (width // 2) stored contiguously -- PyAV's ``yuv420p`` layout.
            Kept in YUV end to end: preprocessing converts colour on the fly, annotation
            draws on the planes and the encoder takes them as they are. None once released.
        device_slot: index of the GPU staging slot holding this frame, or None on the CPU path.
        pixel_format: layout of the frame's 4:2:0 samples, in ``image`` or in its staging
            slot: "i420" (planar U then V) or "nv12" (one interleaved UV plane, as GPU
            decoders write it); the preprocess kernel reads both.
        device_planes: a GPU-decoded frame's pictures before the upload stage packs them into
            a staging slot: (Y (height, width) uint8, UV (height // 2, width // 2, 2) uint8)
            CuPy views of the decoder's output surface (row pitch ``strides[0]``, usually
            more than ``width``), valid on the legacy default stream of the CUDA primary
            context (FFmpeg queues its copies there); they hold a reference to the surface,
            so the decoder cannot reuse it while they live. None otherwise.
        detections: filled in by the postprocess stage.
    """

    source: str
    index: int
    pts: float | None
    capture_time: float
    width: int
    height: int
    rate: Fraction | None = None
    image: Any = None
    device_slot: int | None = None
    detections: Detections | None = None
    pixel_format: str = "i420"
    device_planes: tuple[Any, Any] | None = None

    def __post_init__(self) -> None:
        if self.width <= 0 or self.height <= 0 or self.width % 2 or self.height % 2:
            raise ValueError(f"frame size must be positive and even, got {self.width}x{self.height}")
        if self.image is not None:
            _check_shape("image", self.image, (self.height * 3 // 2, self.width))
        if self.device_planes is not None:
            _check_shape("device_planes[0]", self.device_planes[0], (self.height, self.width))
            _check_shape("device_planes[1]", self.device_planes[1],
                         (self.height // 2, self.width // 2, 2))


@dataclass
class EndOfStream:
    """Marker that a source produced its last frame; flows through every stage after it.

    Attributes:
        source: name of the source that ended.
        frames: how many frames the source produced in total.
        error: a one-line reason when the source ended on an error, else None.
    """

    source: str
    frames: int
    error: str | None = None


@dataclass
class Batch:
    """Frames preprocessed together for one inference call.

    Attributes:
        frames: the frames, in the order of the batch dimension.
        letterboxes: for each frame, how its image was fitted into the model input.
        images: (len(frames), 3, H, W) model input, float32 or float16, host or device.
        outputs: (len(frames), 4 + classes, anchors) raw model output, same device as images;
            set by the infer stage.
        buffers: on the GPU path, the ``pipeline.gpu.BatchBuffers`` set holding ``images``
            and ``outputs``, returned to its ring by the postprocess stage; else None.
        timeline_token: the open 'compute' range of ``GpuTimeline`` when profiling, else None.
    """

    frames: list[Frame]
    letterboxes: list[Any]
    images: Any
    outputs: Any = None
    buffers: Any = None
    timeline_token: Any = None

    def __post_init__(self) -> None:
        if len(self.frames) != len(self.letterboxes):
            raise ValueError(
                f"batch has {len(self.frames)} frames but {len(self.letterboxes)} letterboxes"
            )
        if self.images is not None and self.images.shape[0] < len(self.frames):
            raise ValueError(
                f"images hold {self.images.shape[0]} slots for {len(self.frames)} frames"
            )
