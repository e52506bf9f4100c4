"""Postprocess: decode the model output, run NMS, map boxes back to frame pixels."""

from __future__ import annotations

from collections.abc import Iterable

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
        for frame, letterbox, (xyxy, scores, class_ids) in zip(
                item.frames, item.letterboxes, results):
            frame.detections = Detections(letterbox.unmap_boxes(xyxy), scores, class_ids)
        return item.frames
