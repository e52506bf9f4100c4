"""Postprocess: decode the model output, run NMS, map boxes back to frame pixels."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kernels.nms import postprocess_reference
from pipeline.config import NmsConfig
from pipeline.records import Batch, Detections, Frame
from pipeline.stage import Stage


class PostprocessStage(Stage):
    """Turns a batch's raw output into per-frame ``Detections`` (host arrays) and emits the
    frames one by one, in batch order (the CPU path: NumPy decode and reference NMS).
    """

    def __init__(self, name: str, nms: NmsConfig) -> None:
        super().__init__(name)
        self.nms = nms

    def process(self, item: Batch) -> Iterable[Frame]:
        results = postprocess_reference(
            item.outputs, self.nms.conf_threshold, self.nms.iou_threshold,
            self.nms.class_agnostic, self.nms.max_detections)
        return attach_detections(item, results)


def attach_detections(batch: Batch, results: list[tuple[Any, Any, Any]]) -> list[Frame]:
    """Give each frame of ``batch`` its detections, mapped back to frame pixels.

    Args:
        results: per frame (xyxy (n, 4) float32, scores (n,) float32, class_ids (n,) int32),
            host arrays in model-input pixels.
    """
    for frame, letterbox, (xyxy, scores, class_ids) in zip(batch.frames, batch.letterboxes, results):
        frame.detections = Detections(letterbox.unmap_boxes(xyxy), scores, class_ids)
    return batch.frames


class GpuPostprocessStage(Stage):
    """Decode + exact greedy NMS on the GPU (Numba kernels), reading the model output in
    place through ``__cuda_array_interface__`` on the compute stream; only the kept
    detections are copied to the host. Then returns the batch's buffers to the ring.

    Args:
        nms: thresholds.
        gpu: the ``GpuContext``.
        batch_capacity, num_anchors, num_classes: the model output's size.
        output_dtype: the model output's dtype (kernels are compiled for it at ``open()``).
    """

    def __init__(self, name: str, nms: NmsConfig, gpu: Any, batch_capacity: int,
                 num_anchors: int, num_classes: int, output_dtype: Any) -> None:
        super().__init__(name)
        self.nms, self.gpu = nms, gpu
        self.shape = (batch_capacity, num_anchors, num_classes)
        self.output_dtype = output_dtype
        self.cuda_nms: Any = None

    def open(self) -> None:
        from kernels.nms_cuda import CudaNms, stream_from_cupy

        self.gpu.activate()
        capacity, anchors, classes = self.shape
        self.cuda_nms = CudaNms(capacity, anchors, classes, self.nms.conf_threshold,
                                self.nms.iou_threshold, self.nms.class_agnostic,
                                self.nms.max_detections)
        self.cuda_nms.warmup(self.output_dtype)
        self.stream = stream_from_cupy(self.gpu.compute_stream)

    def process(self, item: Batch) -> Iterable[Frame]:
        from kernels.nms_cuda import to_host

        self.gpu.activate()
        kept = self.cuda_nms.run(item.outputs, self.stream)
        self.gpu.timeline.end(item.timeline_token, self.gpu.compute_stream)
        results = to_host(*kept, stream=self.stream)
        self.gpu.batches.release(item.buffers)  # every read of the set is done (synchronised)
        return attach_detections(item, results)
