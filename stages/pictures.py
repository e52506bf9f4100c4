"""Pictures: host copies of each frame's picture for the Python API (``Pipeline(...,
frames="bgr" | "i420")``), put on the batch record (``BatchDetections.pictures``).

```
... -> [track] -> [analytics] -> pictures -> [annotate] -> sinks -> the API's callback
```

It runs after analytics and before annotate, so a picture is the decoded frame as the model
saw it, never drawn on (annotate draws on the ring's images in place). The frames' images
are views of the pipeline's slot ring, which the sinks give back once written: the copy
made here is the caller's to keep. One copy per frame, only when asked for: ``bgr`` converts
the I420 planes with OpenCV (``cv2.COLOR_YUV2BGR_I420``, BT.601 as FFmpeg's ``yuv420p``
sws default), ``i420`` copies them as they are.

Host path only: a frame decoded by NVDEC has no host image (``FrameBatch.images`` holds
None); the pipeline decodes on the CPU when pictures are asked for
(``pipeline.app.build.decoder_kind``), and this stage raises if a frame comes without one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import cv2
import numpy as np

from pipeline.records import BatchDetections
from pipeline.stage import Stage

FORMATS = ("bgr", "i420")


def picture_of(image: np.ndarray, width: int, height: int, fmt: str) -> np.ndarray:
    """A copy of one frame's picture.

    Args:
        image: (height * 3 // 2, width) uint8 host I420 array (a ring slot's view).
        fmt: "bgr": (height, width, 3) uint8; "i420": (height * 3 // 2, width) uint8.
    """
    planes = np.asarray(image).reshape(height * 3 // 2, width)
    if fmt == "i420":
        return planes.copy()
    return cv2.cvtColor(planes, cv2.COLOR_YUV2BGR_I420)


class PictureStage(Stage[BatchDetections, BatchDetections]):
    """``BatchDetections`` in, the same batch with ``pictures`` (one copy per frame) out.

    Args:
        name: stage name.
        fmt: "bgr" or "i420" (module docstring).

    Raises:
        ValueError: an unknown ``fmt``.
    """

    def __init__(self, name: str, fmt: str) -> None:
        super().__init__(name)
        if fmt not in FORMATS:
            raise ValueError(f"frames: expected one of {', '.join(FORMATS)} or None, got {fmt!r}")
        self.fmt = fmt

    def process(self, item: BatchDetections) -> Iterable[BatchDetections]:
        frames = item.frames
        pictures = []
        for row, image in enumerate(frames.images):
            if image is None:
                raise RuntimeError(f"frame {int(frames.index[row])} of source "
                                   f"{frames.source_name(row)!r} has no host picture (decoded "
                                   "on the GPU): the API's frames need decode: cpu")
            pictures.append(picture_of(image, int(frames.width[row]), int(frames.height[row]),
                                       self.fmt))
        return (dataclasses.replace(item, pictures=tuple(pictures)),)
