"""Preprocess: fit each frame of a batch into the model input (letterbox, YUV to RGB, 0..1, CHW).

Two implementations of one step, called by the infer stage on its thread right before the
model (so the model's single input binding is written and read in order):

- ``HostPreprocess`` (CPU path): the NumPy reference, frame by frame, into a host input array;
- ``DevicePreprocess`` (GPU path): the fused Numba kernel, one launch per frame geometry in
  the batch, reading the batch set's device frame rows and writing straight into the
  backend's input binding -- no copy of the model input.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernels.preprocess import Letterbox, letterbox_geometry, preprocess_reference
from pipeline.gpu import BatchBuffers
from pipeline.records import FrameBatch


class HostPreprocess:
    """The CPU path's preprocess into one reused host input.

    Args:
        input_size: model input (height, width) in pixels.
        dtype: model input dtype.
        max_batch: most frames per batch.
        out: the (max_batch, 3, H, W) host array to write (the backend's own input buffer
            when it has one); None allocates one.
    """

    def __init__(self, input_size: tuple[int, int], dtype: Any, max_batch: int,
                 out: np.ndarray | None = None) -> None:
        self.input_height, self.input_width = input_size
        self.dtype = np.dtype(dtype)
        self.images = out if out is not None else np.empty(
            (max_batch, 3, self.input_height, self.input_width), self.dtype)
        self._letterboxes: dict[tuple[int, int], Letterbox] = {}

    def run(self, batch: FrameBatch) -> np.ndarray:
        """Preprocess every frame of ``batch`` (its host ``images``).

        Returns:
            (n, 3, H, W) view of the reused input array, RGB in 0..1, grey 114 padding.
        """
        n = len(batch)
        for i in range(n):
            width, height = int(batch.width[i]), int(batch.height[i])
            letterbox = self._letterboxes.get((width, height))
            if letterbox is None:
                letterbox = self._letterboxes[(width, height)] = letterbox_geometry(
                    width, height, self.input_width, self.input_height)
            preprocess_reference(batch.images[i], width, height, letterbox,
                                 out=self.images[i], dtype=self.dtype)
        return self.images[:n]


class DevicePreprocess:
    """The fused preprocess kernel over a batch set (see ``pipeline.gpu.BatchBuffers``).

    Args:
        warm_geometries: (letterbox, pixel_format) pairs expected, compiled and their sampling
            tables uploaded at ``warmup``.
    """

    def __init__(self, warm_geometries: list[tuple[Letterbox, str]]) -> None:
        self.warm_geometries = warm_geometries

    def enqueue(self, buffers: BatchBuffers, out: Any, stream: Any) -> None:
        """Queue one kernel launch per frame geometry of the batch in ``buffers``.

        Args:
            buffers: the batch's ``BatchBuffers`` (its ``frames`` rows, ``groups`` and
                device ``table``), whose copies the caller made ``stream`` wait for.
            out: (>= n, 3, H, W) float16/float32 device array, the model's input binding.
            stream: the CuPy compute stream.
        """
        from kernels.preprocess_cuda import launch_preprocess

        pairs = buffers.table.device["pairs"]
        for letterbox, pixel_format, start, end in buffers.groups:
            launch_preprocess(buffers.frames, pairs[start:end], letterbox, out, stream,
                              pixel_format=pixel_format)

    def warmup(self, buffers: BatchBuffers, out: Any, stream: Any) -> None:
        """Compile the kernel for the very arrays the pipeline passes and upload every warm
        geometry's tables, so no batch pays for either (writes ``out[0]``; synchronises)."""
        from kernels.preprocess_cuda import launch_preprocess

        pairs = buffers.table.host["pairs"]
        pairs[0] = (0, 0)
        buffers.table.to_device(stream)
        for letterbox, pixel_format in self.warm_geometries:
            launch_preprocess(buffers.frames, buffers.table.device["pairs"][:1], letterbox, out,
                              stream, pixel_format=pixel_format)
        stream.synchronize()
