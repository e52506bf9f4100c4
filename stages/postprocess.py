"""Postprocess: from the model's raw output to one ``BatchDetections`` per batch.

- CPU path: ``PostprocessStage`` decodes the host output, runs the reference NMS
  (``kernels.nms``) and undoes the letterbox for the whole batch at once.
- GPU path: the device work was queued by the infer stage (``DeviceNms.enqueue``: the NMS
  kernels read the model's output binding in place, write boxes already mapped back to frame
  pixels into the batch set, and one D2H copies the batch's detections into pinned memory).
  ``PostprocessStage`` waits once for the set's ``done`` event, flattens the pinned results
  into a ``BatchDetections`` and returns the set.

Either way, when no later stage reads the host images (no video is written), the batch's
ring slots are returned here, in one operation per batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from kernels.nms import end2end_reference, postprocess_reference, yolov5_to_anchor_columns
from pipeline.config import NmsConfig
from pipeline.gpu import BatchBuffers, GpuContext
from pipeline.records import BatchDetections, FrameBatch, ModelOutputs
from pipeline.stage import Stage


def unletterbox(xyxy: np.ndarray, letterbox: np.ndarray) -> np.ndarray:
    """Map boxes from model-input pixels back to their frames' pixels, clipped to the frame.

    The same float32 arithmetic as ``kernels.preprocess.Letterbox.unmap_boxes`` (and the
    GPU's), vectorised over a batch.

    Args:
        xyxy: (m, 4) float32 host boxes in model-input pixels.
        letterbox: (m, 6) float32 host array: each box's frame's ``LETTERBOX_COLUMNS`` row.

    Returns:
        (m, 4) float32 host boxes in frame pixels.
    """
    out = np.empty_like(xyxy, dtype=np.float32)
    scale = letterbox[:, [0, 1, 0, 1]]
    pad = letterbox[:, [2, 3, 2, 3]]
    size = letterbox[:, [4, 5, 4, 5]]
    np.divide(xyxy.astype(np.float32, copy=False) - pad, scale, out=out)
    np.clip(out, 0, size, out=out)
    return out


class DeviceNms:
    """Queues a batch's NMS, letterbox undo and one D2H of its detections (GPU path).

    Args:
        nms: thresholds and the per-frame cap.
        max_batch: most frames per batch.
        layout: the model output's layout (``stages.backends.base.LAYOUTS``).

    The kernels are sized by one image's output shape, known once the model has run:
    ``warmup`` (the infer stage's open, after the model's warm-up) sizes and compiles them.
    """

    def __init__(self, nms: NmsConfig, max_batch: int, layout: str) -> None:
        self.nms, self.max_batch, self.layout = nms, max_batch, layout
        self.cuda_nms: Any = None  # set by warmup()
        self._streams: dict[int, Any] = {}  # CuPy stream pointer -> its Numba wrapper

    def _kernels(self, output_shape: tuple[int, int]) -> Any:
        """The NMS kernels for one image's output shape: (4 + K, A) yolov8, (A, 5 + K) yolov5,
        (N, 6) end2end (no NMS is run, only the threshold, the cap and the letterbox undo)."""
        from kernels.nms_cuda import CudaEnd2End, CudaNms

        nms, rows, columns = self.nms, *output_shape
        if self.layout == "end2end":
            return CudaEnd2End(self.max_batch, rows, nms.conf_threshold, nms.max_detections)
        anchors, classes = ((rows, columns - 5) if self.layout == "yolov5"
                            else (columns, rows - 4))
        return CudaNms(self.max_batch, anchors, classes, nms.conf_threshold, nms.iou_threshold,
                       nms.class_agnostic, nms.max_detections, self.layout)

    def _numba_stream(self, stream: Any) -> Any:
        from kernels.nms_cuda import stream_from_cupy

        if stream.ptr not in self._streams:
            self._streams[stream.ptr] = stream_from_cupy(stream)
        return self._streams[stream.ptr]

    @staticmethod
    def _outputs(buffers: BatchBuffers, n: int) -> tuple[Any, Any, Any, Any]:
        views = buffers.detections.device
        return views["boxes"][:n], views["scores"][:n], views["class_ids"][:n], views["counts"][:n]

    def enqueue(self, outputs: Any, buffers: BatchBuffers, stream: Any) -> None:
        """Queue the NMS of a batch, then the D2H of its detections and ``buffers.done``.

        Args:
            outputs: (n, *output_shape) float16/float32 CuPy array, the model's output
                binding, valid on ``stream``; read in place.
            buffers: the batch's ``BatchBuffers`` (its device letterbox table is read, its
                detections written and copied to its pinned mirror).
            stream: the CuPy compute stream.
        """
        n = outputs.shape[0]
        self.cuda_nms.run(outputs, self._numba_stream(stream), out=self._outputs(buffers, n),
                          letterbox=buffers.table.device["letterbox"][:n])
        buffers.detections.to_host(stream)
        buffers.done.record(stream)

    def warmup(self, outputs: Any, buffers: BatchBuffers, stream: Any) -> None:
        """Size the kernels by ``outputs`` (the model's output binding at the largest batch)
        and compile them for the very arrays ``enqueue`` will pass (synchronises)."""
        self.cuda_nms = self._kernels(tuple(outputs.shape[1:]))
        n = outputs.shape[0]
        self.cuda_nms.warmup(outputs, out=self._outputs(buffers, n),
                             letterbox=buffers.table.device["letterbox"][:n],
                             stream=self._numba_stream(stream))
        stream.synchronize()


class PostprocessStage(Stage[ModelOutputs, BatchDetections]):
    """``ModelOutputs`` in, ``BatchDetections`` (host arrays, frame pixels) out.

    Args:
        name: stage name.
        nms: thresholds (CPU path).
        gpu: the ``GpuContext`` (GPU path: the results come from the batch set), or None.
        release_slots: when set, called once per batch with the batch's ring slots
            ((n,) int32, -1 = none): this stage is the last reader of the host images.
        layout: the model output's layout (``stages.backends.base.LAYOUTS``; on the GPU path
            ``DeviceNms`` reads it).
    """

    def __init__(self, name: str, nms: NmsConfig, gpu: GpuContext | None = None,
                 release_slots: Callable[[np.ndarray], None] | None = None,
                 layout: str = "yolov8") -> None:
        super().__init__(name)
        self.nms, self.gpu, self.layout = nms, gpu, layout
        self.release_slots = release_slots

    def process(self, item: ModelOutputs) -> Iterable[BatchDetections]:
        frames = item.frames
        detections = self._from_host(item) if self.gpu is None else self._from_device(frames)
        if self.release_slots is not None:
            self.release_slots(frames.slot)
        return (detections,)

    def _from_host(self, item: ModelOutputs) -> BatchDetections:
        nms, outputs, rows = self.nms, item.outputs, item.frames.detect_rows
        frames = item.frames if item.frames.detect is None else item.frames.select(rows)
        if outputs is None:  # the detector skipped every frame of the batch
            results = [_EMPTY] * len(frames)
        elif self.layout == "end2end":
            results = end2end_reference(outputs, nms.conf_threshold, nms.max_detections)
        else:
            if self.layout == "yolov5":
                outputs = yolov5_to_anchor_columns(outputs)
            results = postprocess_reference(outputs, nms.conf_threshold, nms.iou_threshold,
                                            nms.class_agnostic, nms.max_detections)
        batch = BatchDetections.from_lists(frames, results)
        owners = np.repeat(np.arange(len(frames)), batch.counts)
        batch.xyxy = unletterbox(batch.xyxy, frames.letterbox[owners])
        return batch if item.frames.detect is None else batch.spread(item.frames, rows)

    def _from_device(self, frames: FrameBatch) -> BatchDetections:
        buffers = frames.buffers
        started = time.perf_counter()
        buffers.done.synchronize()  # the batch's D2H has landed (waiting for the GPU)
        self.blocked_s += time.perf_counter() - started
        host = buffers.detections.host
        rows = frames.detect_rows
        detected = frames if frames.detect is None else frames.select(rows)
        if len(rows):
            # Boolean indexing copies the kept rows out of the pinned buffer before it is reused.
            detections = BatchDetections.from_padded(detected, host["boxes"], host["scores"],
                                                     host["class_ids"], host["counts"])
        else:
            detections = BatchDetections.from_lists(detected, [])
        frames.buffers = None
        self.gpu.batches.release(buffers)
        return detections if frames.detect is None else detections.spread(frames, rows)


_EMPTY = (np.empty((0, 4), np.float32), np.empty(0, np.float32), np.empty(0, np.int32))
