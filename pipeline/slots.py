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

With decode worker processes (``pipeline.app.workers``) the ring lives in shared memory
(``multiprocessing.shared_memory``): each worker owns a fixed share of the slots, keeps its
own free list of them, and gets them back through its pipe when the pipeline releases them
(``release`` routes every slot to its owner). On the GPU path the ring is page-locked
(pinned: ``cudaHostRegister`` on the shared memory), so the H2D copy of a slot is a true
asynchronous DMA; on the CPU path it is plain memory. Backpressure lives here: when every slot
is in flight, a file source waits in ``acquire`` (it loses no frame) and a live source drops
the frame it just decoded (``try_acquire``), so it never falls behind its camera. A file's
``acquire`` leaves ``LIVE_RESERVE_SLOTS`` slots free for each live source decoding into the
same ring (``add_live_source``; at most half the slots this process owns): a file decodes as
fast as the slots come back, and without the reserve it took each one as it came, so a camera
beside it found none and dropped nearly every frame.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

WAIT_POLL_S = 0.1
LIVE_RESERVE_SLOTS = 4  # free slots a file's acquire leaves for each live source of the ring


def shared_name() -> str:
    """A name for a shared memory block this process creates: its pid in it, so that the
    next run removes it if this one is killed whole (``pipeline.app.leftovers``)."""
    return f"streamdet_{os.getpid()}_{secrets.token_hex(4)}"


def i420_bytes(width: int, height: int) -> int:
    """Bytes of a width x height I420 frame (both even)."""
    return width * height * 3 // 2


class SlotRing:
    """``slots`` host slots of ``slot_bytes`` bytes each (see the module docstring).

    Args:
        slots: number of slots (frames that can be in flight at once).
        slot_bytes: bytes per slot: the largest I420 frame it can hold.
        pinned: page-lock the memory (GPU path; needs CuPy and a CUDA device).
        shared: allocate it in shared memory, for decode worker processes (``shm_name``).

    Attributes:
        memory: (slots, slot_bytes) uint8 host array; pinned when ``pinned``.
        shm_name: the shared memory block's name (``shared``), else None.
        owner: (slots,) int32 host array: the worker that owns each slot, -1 for this
            process's own free list.
        waited_s: total seconds callers of ``acquire`` spent waiting for a free slot.
        owned: the slots this process's free list can hold (all of them, less those given
            to workers; a worker's view: its share).
        live_sources: the live sources decoding into this process's slots now.
    """

    def __init__(self, slots: int, slot_bytes: int, pinned: bool = False,
                 shared: bool = False) -> None:
        if slots < 1 or slot_bytes < 1:
            raise ValueError(f"a slot ring needs slots >= 1 and slot_bytes >= 1, got {slots}, "
                             f"{slot_bytes}")
        self.slot_bytes = slot_bytes
        self.pinned = pinned
        self._shm: Any = None
        self._registered = False
        self.shm_name: str | None = None
        if shared:
            from multiprocessing import shared_memory

            self._shm = shared_memory.SharedMemory(create=True, size=slots * slot_bytes,
                                                   name=shared_name())
            self.shm_name = self._shm.name
            self.memory = np.ndarray((slots, slot_bytes), np.uint8, buffer=self._shm.buf)
            if pinned:
                import cupy

                cupy.cuda.runtime.hostRegister(self.memory.ctypes.data, self.memory.nbytes, 0)
                self._registered = True
        elif pinned:
            import cupy

            self._pinned = cupy.cuda.alloc_pinned_memory(slots * slot_bytes)
            self.memory = np.frombuffer(self._pinned, np.uint8, slots * slot_bytes).reshape(
                slots, slot_bytes)
        else:
            self.memory = np.empty((slots, slot_bytes), np.uint8)
        self.owner = np.full(slots, -1, np.int32)
        self._free: deque[int] = deque(range(slots))
        self._cond = threading.Condition()
        self._to_worker: Callable[[int, list[int]], None] | None = None
        self.waited_s = 0.0
        self.owned, self.live_sources = slots, 0

    def give_to_workers(self, shares: list[int],
                        to_worker: Callable[[int, list[int]], None]) -> list[list[int]]:
        """Hand fixed shares of the slots to worker processes (before any is taken here).

        Args:
            shares: how many slots each worker gets, in worker order.
            to_worker: called as ``to_worker(worker, slots)`` by ``release`` with the
                released slots that worker owns (it sends them back to the worker).

        Returns:
            Each worker's slots; the rest stay on this process's free list.
        """
        with self._cond:
            if sum(shares) > len(self._free):
                raise ValueError(f"{sum(shares)} slots asked for workers, {len(self._free)} free")
            given = []
            for worker, count in enumerate(shares):
                slots = [self._free.pop() for _ in range(count)]
                self.owner[slots] = worker
                given.append(sorted(slots))
            self.owned -= sum(shares)
            self._to_worker = to_worker
            return given

    @classmethod
    def attach(cls, shm_name: str, slots: int, slot_bytes: int, free: list[int]) -> SlotRing:
        """The view a decode worker process has of the pipeline's shared ring: the same
        memory, and a free list of only the slots it owns (``free``), which ``release`` (fed
        by the pipeline's messages) refills. Detaching is ``close_view``."""
        from multiprocessing import shared_memory

        ring = cls.__new__(cls)
        ring.slot_bytes, ring.pinned, ring.shm_name = slot_bytes, False, shm_name
        # A spawned worker shares the pipeline's resource tracker: attaching registers the
        # name again (a no-op there), and the pipeline's unlink unregisters it once.
        ring._shm = shared_memory.SharedMemory(name=shm_name)
        ring._registered = False
        ring.memory = np.ndarray((slots, slot_bytes), np.uint8, buffer=ring._shm.buf)
        ring.owner = np.full(slots, -1, np.int32)
        ring._free = deque(free)
        ring._cond = threading.Condition()
        ring._to_worker = None
        ring.waited_s = 0.0
        ring.owned, ring.live_sources = len(free), 0
        return ring

    def pin(self) -> None:
        """Page-lock an attached view (the engine: its H2D copies read the workers' slots)."""
        import cupy

        if not self._registered:
            cupy.cuda.runtime.hostRegister(self.memory.ctypes.data, self.memory.nbytes, 0)
            self._registered = self.pinned = True

    def unpin(self) -> None:
        """Undo ``pin`` (idempotent)."""
        if self._registered:
            import cupy

            cupy.cuda.runtime.hostUnregister(self.memory.ctypes.data)
            self._registered = self.pinned = False

    def close_view(self) -> None:
        """Detach from the shared block without unlinking it (a worker's ``attach``)."""
        if self._shm is not None:
            shm, self._shm = self._shm, None
            self.memory = np.empty((0, self.slot_bytes), np.uint8)
            try:
                shm.close()
            except BufferError:
                pass

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
        """A free slot for a file source, waiting while none is beyond the live sources'
        reserve (module docstring); None once any of ``stop`` is set."""
        with self._cond:
            if len(self._free) > self._reserve():
                return self._free.popleft()
            started = time.perf_counter()
            try:
                while len(self._free) <= self._reserve():
                    if any(event.is_set() for event in stop):
                        return None
                    self._cond.wait(WAIT_POLL_S)
                return self._free.popleft()
            finally:
                self.waited_s += time.perf_counter() - started

    def _reserve(self) -> int:
        """The free slots ``acquire`` leaves to the live sources (the caller holds the lock)."""
        return min(LIVE_RESERVE_SLOTS * self.live_sources, self.owned // 2)

    def add_live_source(self, count: int = 1) -> None:
        """A live source starts (``count`` 1) or stops (-1) decoding into this process's
        slots: the reserve a file's ``acquire`` leaves grows or shrinks."""
        with self._cond:
            self.live_sources = max(0, self.live_sources + count)
            self._cond.notify_all()

    def try_acquire(self) -> int | None:
        """A free slot, or None at once when every slot is in flight (live sources: they
        drop the frame rather than fall behind the camera)."""
        with self._cond:
            return self._free.popleft() if self._free else None

    def release(self, slots: Iterable[int] | np.ndarray) -> None:
        """Return slots (one lock operation, and one message per owning worker); entries of
        -1 (no slot) are ignored."""
        slots = np.asarray(slots if isinstance(slots, np.ndarray) else list(slots), np.int64)
        slots = slots[slots >= 0]
        if not len(slots):
            return
        owners = self.owner[slots]
        local = slots[owners < 0].tolist()
        if local:
            with self._cond:
                self._free.extend(local)
                self._cond.notify(len(local))
        if len(local) < len(slots) and self._to_worker is not None:
            for worker in np.unique(owners[owners >= 0]).tolist():
                self._to_worker(worker, slots[owners == worker].tolist())

    def close(self) -> None:
        """Unregister and free the shared memory block (when ``shared``); idempotent."""
        if self._registered:
            import cupy

            cupy.cuda.runtime.hostUnregister(self.memory.ctypes.data)
            self._registered = False
        if self._shm is not None:
            shm, self._shm = self._shm, None
            self.memory = np.empty((0, self.slot_bytes), np.uint8)  # drop the buffer's view
            try:
                shm.close()
            except BufferError:  # a view is still alive somewhere: unlink all the same
                pass
            shm.unlink()

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
