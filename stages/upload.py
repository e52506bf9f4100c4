"""Upload: copy each decoded frame's I420 planes to the GPU, asynchronously (the GPU path).

I420 is half the bytes of BGR and needs no CPU colour conversion: the fused preprocess
kernel converts on the device. The copy runs on the copy stream, so the upload of frame
N+1 overlaps the compute stream's work on frame N (see pipeline/gpu.py).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from pipeline.gpu import GpuContext
from pipeline.records import Frame
from pipeline.stage import Stage


class UploadStage(Stage):
    """Puts every frame in a free staging slot and queues its H2D copy on the copy stream.

    Sets ``frame.device_slot``; the slot is returned by the preprocess stage once the kernel
    reading it is queued. Waits (backpressure) while every slot is in flight.
    """

    def __init__(self, name: str, gpu: GpuContext, stop: threading.Event | None = None) -> None:
        super().__init__(name)
        self.gpu = gpu
        self.stop = stop

    def process(self, item: Frame) -> Iterable[Frame]:
        staging = self.gpu.staging
        assert staging is not None, "GpuContext.allocate() must run before the graph starts"
        self.gpu.activate()
        slot = staging.acquire(self.stop)
        staging.upload(slot, item.image, self.gpu.copy_stream, self.gpu.timeline)
        item.device_slot = slot
        return (item,)
