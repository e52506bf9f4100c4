"""Preprocess: gather frames from any sources into a batch and fit each into the model input.

Batching lives here (like DeepStream's stream muxer) because the fused preprocess writes
each frame straight into its slot of the batch input tensor: a batch closes when it holds
``batch_size`` frames or when its first frame has waited ``batch_timeout_ms``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from kernels.preprocess import Letterbox, letterbox_geometry, preprocess_reference
from pipeline.records import Batch, EndOfStream, Frame
from pipeline.stage import Stage


class PreprocessStage(Stage):
    """Letterbox, colour-convert and normalise frames on the host (the CPU path).

    Emits ``Batch`` records whose ``images`` is a (B, 3, H, W) host array of the model's
    input dtype, RGB scaled to 0..1, letterboxed with grey 114 padding.

    Args:
        name: stage name.
        input_size: model input (height, width) in pixels.
        dtype: model input dtype.
        batch_size: most frames per batch.
        batch_timeout_ms: longest time a partial batch waits for more frames.
    """

    def __init__(self, name: str, input_size: tuple[int, int], dtype: np.dtype,
                 batch_size: int, batch_timeout_ms: float) -> None:
        super().__init__(name)
        self.input_height, self.input_width = input_size
        self.dtype = np.dtype(dtype)
        self.batch_size = batch_size
        self.batch_timeout_s = batch_timeout_ms / 1000
        self._pending: list[Frame] = []
        self._first_arrival = 0.0
        self._letterboxes: dict[tuple[int, int], Letterbox] = {}

    @property
    def poll_interval_s(self) -> float | None:  # type: ignore[override]
        """Time left before the pending partial batch must run, or None when empty."""
        if not self._pending:
            return None
        return max(0.0, self._first_arrival + self.batch_timeout_s - time.monotonic())

    def letterbox(self, width: int, height: int) -> Letterbox:
        """The (cached) geometry fitting a width x height frame into the model input."""
        key = (width, height)
        if key not in self._letterboxes:
            self._letterboxes[key] = letterbox_geometry(
                width, height, self.input_width, self.input_height)
        return self._letterboxes[key]

    def process(self, item: Frame) -> Iterable[Batch]:
        if not self._pending:
            self._first_arrival = time.monotonic()
        self._pending.append(item)
        if len(self._pending) >= self.batch_size or self.poll_interval_s == 0.0:
            return self._flush()
        return ()

    def end_of_stream(self, eos: EndOfStream) -> Iterable[Any]:
        # The source's frames must leave before its end marker.
        return [*self._flush(), eos]

    def on_idle(self) -> Iterable[Batch]:
        return self._flush()

    def finish(self) -> Iterable[Batch]:
        return self._flush()

    def _flush(self) -> list[Batch]:
        if not self._pending:
            return []
        frames, self._pending = self._pending, []
        return [self.make_batch(frames)]

    def make_batch(self, frames: list[Frame]) -> Batch:
        """Preprocess ``frames`` into one batch."""
        images = np.empty((len(frames), 3, self.input_height, self.input_width), self.dtype)
        letterboxes = []
        for slot, frame in enumerate(frames):
            letterbox = self.letterbox(frame.width, frame.height)
            preprocess_reference(frame.image, frame.width, frame.height, letterbox,
                                 out=images[slot], dtype=self.dtype)
            letterboxes.append(letterbox)
        return Batch(frames=frames, letterboxes=letterboxes, images=images)


class GpuPreprocessStage(PreprocessStage):
    """The fused preprocess on the GPU: one kernel launch per frame geometry in the batch.

    Reads the frames from their staging slots (waiting on each slot's copy event, so no host
    synchronisation), writes the model input of a ``BatchBuffers`` set in place, and returns
    the slots once the kernels are queued. Everything runs on the compute stream.

    Args:
        gpu: the ``GpuContext`` whose staging and batch ring are allocated.
        warm_sizes: (width, height) of the frames expected, compiled for at ``open()``.
        stop: the graph's stop event (ends a wait for free buffers).
        pixel_formats: the staging slots' layouts expected ("i420" uploads, "nv12" GPU
            decode), whose sampling tables are uploaded at ``open()``.
    """

    def __init__(self, name: str, input_size: tuple[int, int], dtype: np.dtype,
                 batch_size: int, batch_timeout_ms: float, gpu: Any,
                 warm_sizes: list[tuple[int, int]], stop: Any = None,
                 pixel_formats: tuple[str, ...] = ("i420",)) -> None:
        super().__init__(name, input_size, dtype, batch_size, batch_timeout_ms)
        self.gpu = gpu
        self.warm_sizes = warm_sizes
        self.stop = stop
        self.pixel_formats = pixel_formats

    def open(self) -> None:
        from kernels.preprocess_cuda import warmup_preprocess

        self.gpu.activate()
        for width, height in self.warm_sizes:
            for pixel_format in self.pixel_formats:
                warmup_preprocess(self.letterbox(width, height), self.dtype, pixel_format)

    def make_batch(self, frames: list[Frame]) -> Batch:
        from kernels.preprocess_cuda import launch_preprocess

        gpu, stream = self.gpu, self.gpu.compute_stream
        gpu.activate()
        buffers = gpu.batches.acquire(self.stop)
        by_size: dict[tuple[int, int, str], list[int]] = {}
        for index, frame in enumerate(frames):
            stream.wait_event(gpu.staging.copied[frame.device_slot])
            by_size.setdefault((frame.width, frame.height, frame.pixel_format), []).append(index)
        token = gpu.timeline.begin("compute", stream)  # after the waits: copies are not compute
        row = 0
        groups = []
        for (width, height, pixel_format), indices in by_size.items():
            for index in indices:
                buffers.pairs_host[row] = (frames[index].device_slot, index)
                row += 1
            groups.append((self.letterbox(width, height), pixel_format, row - len(indices), row))
        buffers.pairs[:row].set(buffers.pairs_host[:row], stream=stream)
        for letterbox, pixel_format, start, end in groups:
            launch_preprocess(gpu.staging.device, buffers.pairs[start:end], letterbox,
                              buffers.images, stream, pixel_format=pixel_format)
        gpu.staging.release([frame.device_slot for frame in frames], stream)
        for frame in frames:
            frame.device_slot = None
        return Batch(frames=frames, letterboxes=[self.letterbox(f.width, f.height) for f in frames],
                     images=buffers.images[: len(frames)], buffers=buffers, timeline_token=token)
