"""The slot ring: host memory for decoded frames, written once by the decoder, read in place.

```
decoder --copies the planes once--> slot k --> batcher (GPU: async H2D from slot k)
                                           --> annotate, video sink (host image = slot k)
        <-- release(slots of a batch) -- the last stage that reads the images
```

A decoder takes a free slot, copies the frame's I420 planes into it (stride-aware, straight
from the decoder's buffers: the frame's only host copy) and sends a small ``Frame`` record that
names the slot. Slots travel with their frames and are returned in one lock operation per
batch by the last stage that reads the host images: the postprocess stage when no video is
written (by then the batch's H2D copy has completed), else the source's sink. A live frame
dropped in a queue returns its slot at once.

On the GPU path the ring is page-locked (pinned), so the H2D copy of a slot is a true
asynchronous DMA; on the CPU path it is plain memory. Backpressure lives here: when every slot
is in flight, a file source waits in ``acquire`` (it loses no frame) and a live source drops
the frame it just decoded (``try_acquire``), so it never falls behind its camera.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

import numpy as np

WAIT_POLL_S = 0.1


def i420_bytes(width: int, height: int) -> int:
    """Bytes of a width x height I420 frame (both even)."""
    return width * height * 3 // 2


class SlotRing:
    """``slots`` host slots of ``slot_bytes`` bytes each (see the module docstring).

    Args:
        slots: number of slots (frames that can be in flight at once).
        slot_bytes: bytes per slot: the largest I420 frame it can hold.
        pinned: page-lock the memory (GPU path; needs CuPy and a CUDA device).

    Attributes:
        memory: (slots, slot_bytes) uint8 host array; pinned when ``pinned``.
        waited_s: total seconds callers of ``acquire`` spent waiting for a free slot.
    """

    def __init__(self, slots: int, slot_bytes: int, pinned: bool = False) -> None:
        if slots < 1 or slot_bytes < 1:
            raise ValueError(f"a slot ring needs slots >= 1 and slot_bytes >= 1, got {slots}, "
                             f"{slot_bytes}")
        self.slot_bytes = slot_bytes
        self.pinned = pinned
        if pinned:
            import cupy

            self._pinned = cupy.cuda.alloc_pinned_memory(slots * slot_bytes)
            self.memory = np.frombuffer(self._pinned, np.uint8, slots * slot_bytes).reshape(
                slots, slot_bytes)
        else:
            self.memory = np.empty((slots, slot_bytes), np.uint8)
        self._free: deque[int] = deque(range(slots))
        self._cond = threading.Condition()
        self.waited_s = 0.0

    @property
    def slots(self) -> int:
        return int(self.memory.shape[0])

    def free_slots(self) -> int:
        """Slots free now."""
        with self._cond:
            return len(self._free)

    def fits(self, width: int, height: int) -> bool:
        """True when a width x height I420 frame fits in a slot."""
        return i420_bytes(width, height) <= self.slot_bytes

    def acquire(self, *stop: threading.Event) -> int | None:
        """A free slot, waiting while none is; None once any of ``stop`` is set."""
        with self._cond:
            if self._free:
                return self._free.popleft()
            started = time.perf_counter()
            try:
                while not self._free:
                    if any(event.is_set() for event in stop):
                        return None
                    self._cond.wait(WAIT_POLL_S)
                return self._free.popleft()
            finally:
                self.waited_s += time.perf_counter() - started

    def try_acquire(self) -> int | None:
        """A free slot, or None at once when every slot is in flight (live sources: they
        drop the frame rather than fall behind the camera)."""
        with self._cond:
            return self._free.popleft() if self._free else None

    def release(self, slots: Iterable[int] | np.ndarray) -> None:
        """Return slots (one lock operation); entries of -1 (no slot) are ignored."""
        if isinstance(slots, np.ndarray):
            slots = slots.tolist()
        returned = [slot for slot in slots if slot >= 0]
        if not returned:
            return
        with self._cond:
            self._free.extend(returned)
            self._cond.notify(len(returned))

    def image(self, slot: int, width: int, height: int) -> np.ndarray:
        """The (height * 3 // 2, width) uint8 I420 view of ``slot``'s first bytes."""
        return self.memory[slot, : i420_bytes(width, height)].reshape(height * 3 // 2, width)

    def pointer(self, slot: int) -> int:
        """Host address of ``slot`` (for an asynchronous copy out of pinned memory)."""
        return int(self.memory.ctypes.data) + slot * self.slot_bytes


def copy_i420_planes(planes: Any, width: int, height: int, out: np.ndarray) -> None:
    """Copy a decoded picture's Y, U, V planes into an I420 array, stride-aware.

    Args:
        planes: the picture's three planes, each exposing the buffer protocol with a
            ``line_size`` (bytes per row, at least the plane's width): PyAV's
            ``VideoFrame.planes`` of a ``yuv420p`` frame.
        width, height: the picture size (both even).
        out: (height * 3 // 2, width) uint8 host array (a slot view); overwritten.
    """
    flat = out.reshape(-1)
    chroma_w, chroma_h = width // 2, height // 2
    offset = 0
    for plane, (w, h) in zip(planes, ((width, height), (chroma_w, chroma_h), (chroma_w, chroma_h))):
        # A strided view of the decoder's buffer: rows of line_size bytes, the first w used.
        source = np.ndarray((h, w), np.uint8, buffer=plane, strides=(plane.line_size, 1))
        flat[offset: offset + w * h].reshape(h, w)[:] = source
        offset += w * h
