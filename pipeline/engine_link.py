"""What an engine and its source workers share: the link's settings, the frame rings, and
the two message layouts that cross between them (DESIGN.md v3).

```
source worker k                                     engine (one per GPU: the model)
  decode (CPU) -> its slots of the HOST ring   \
  decode (NVDEC) -> copy NV12 into its slots    >-- one SUBMIT message per flush -->  batcher
              of the DEVICE ring (CUDA IPC)    /    (rows of SUBMIT_DTYPE)            -> model
  <-- one RESULTS message per engine batch (its frames' detections, NumPy columns) -- -> NMS
```

- The host ring is ``pipeline.slots.SlotRing`` in shared memory, created by the supervisor
  (it outlives an engine that dies); the engine page-locks it, each worker attaches to it
  with a fixed share of its slots (``EngineLink.host_slots``) and keeps its own free list.
- The device ring (``DeviceRing``) is allocated by the engine and exported with a CUDA IPC
  memory handle; worker k owns device slots ``k * device_share .. (k + 1) * device_share``.
  A worker copies a decoded frame's NV12 planes into one of its slots (packed: the Y rows,
  then the UV rows, no padding), waits for the copies, then submits the slot.
- A slot of either ring is the worker's again once that frame's results came back: the
  engine read it before the model ran.
- A worker says ``BYE`` before it closes its connection; a connection that ends without it
  is a worker that died, and the engine tells the supervisor at once.

Nothing here is pickled per frame: a submit is one bytes message of fixed-size rows, a
result one tuple of NumPy arrays per batch and worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# One frame a worker asks the engine to detect on.
SUBMIT_DTYPE = np.dtype([
    ("token", np.int64),        # the worker's number for the frame (results name it)
    ("host_slot", np.int32),    # its slot of the host ring (I420), or -1
    ("device_slot", np.int32),  # its slot of the device ring (packed NV12), or -1
    ("width", np.int32),
    ("height", np.int32),
])

HELLO, READY = "hello", "ready"  # (HELLO, worker number, pid) -> (READY, device ring handle)
BYE = b""  # a worker's last message, its graph finished: a connection that ends without it died


@dataclass(frozen=True)
class EngineLink:
    """How a source worker reaches its engine (picklable: given to every worker at spawn).

    Attributes:
        address: the engine's ``multiprocessing.connection.Listener`` address (a Unix
            socket path).
        authkey: the listener's key (random per run).
        device: the engine's GPU (as the worker sees it), or None on the CPU path.
        host_ring: the shared host ring's ``SharedMemory`` name.
        host_slots: slots of the host ring.
        slot_bytes: bytes per slot of either ring (the largest I420/NV12 frame).
        host_shares: per worker, the host slots it owns.
        device_share: device slots per worker (0: no device ring, the CPU path).
    """

    address: str
    authkey: bytes
    device: int | None
    host_ring: str
    host_slots: int
    slot_bytes: int
    host_shares: tuple[tuple[int, ...], ...]
    device_share: int

    def __post_init__(self) -> None:
        if self.slot_bytes < 1 or self.host_slots < 1 or self.device_share < 0:
            raise ValueError("an engine link needs slot_bytes >= 1, host_slots >= 1 and "
                             f"device_share >= 0, got {self.slot_bytes}, {self.host_slots}, "
                             f"{self.device_share}")

    @property
    def workers(self) -> int:
        return len(self.host_shares)

    def device_slots(self, worker: int) -> range:
        """The device-ring slots worker ``worker`` owns."""
        return range(worker * self.device_share, (worker + 1) * self.device_share)


@dataclass
class EngineResults:
    """The detections of one worker's frames in one engine batch (a RESULTS message).

    Attributes:
        tokens: (k,) int64 host array, the frames (their SUBMIT tokens), in submit order.
        offsets: (k + 1,) int64 host array; frame i's detections are rows
            ``offsets[i]:offsets[i + 1]``.
        xyxy: (m, 4) float32 host array, boxes in frame pixels.
        confidence: (m,) float32 host array.
        class_id: (m,) int32 host array.
    """

    tokens: np.ndarray
    offsets: np.ndarray
    xyxy: np.ndarray
    confidence: np.ndarray
    class_id: np.ndarray

    def __post_init__(self) -> None:
        k, m = self.tokens.shape[0], self.xyxy.shape[0]
        if (self.offsets.shape != (k + 1,) or self.xyxy.shape != (m, 4)
                or self.confidence.shape != (m,) or self.class_id.shape != (m,)
                or (k and int(self.offsets[-1]) != m)):
            raise ValueError(f"engine results of {k} frames with {m} detections have "
                             f"offsets {self.offsets.shape}, boxes {self.xyxy.shape}")


class DeviceRing:
    """``slots`` device slots of ``slot_bytes`` bytes, shared between processes (CUDA IPC).

    The engine makes it (``allocate``) and gives ``handle`` to its workers; a worker opens
    it (``open``). Memory comes from ``cudaMalloc`` directly (not CuPy's pool: an IPC handle
    names a whole allocation).

    Attributes:
        base: device address of slot 0.
        handle: the ``cudaIpcMemHandle_t`` bytes (the engine's ring).
    """

    def __init__(self, base: int, slots: int, slot_bytes: int, handle: bytes | None,
                 owned: bool) -> None:
        self.base, self.slots, self.slot_bytes = base, slots, slot_bytes
        self.handle, self._owned, self._open = handle, owned, True

    @classmethod
    def allocate(cls, slots: int, slot_bytes: int) -> DeviceRing:
        """A new ring on the current device, exported (the engine)."""
        import cupy

        base = cupy.cuda.runtime.malloc(slots * slot_bytes)
        return cls(base, slots, slot_bytes, bytes(cupy.cuda.runtime.ipcGetMemHandle(base)),
                   owned=True)

    @classmethod
    def open(cls, handle: bytes, slots: int, slot_bytes: int) -> DeviceRing:
        """The engine's ring mapped into this process (a worker)."""
        import cupy

        base = cupy.cuda.runtime.ipcOpenMemHandle(handle)
        return cls(base, slots, slot_bytes, handle, owned=False)

    def pointer(self, slot: int) -> int:
        return self.base + slot * self.slot_bytes

    def planes(self, slot: int, width: int, height: int) -> tuple[Any, Any]:
        """CuPy views of the packed NV12 frame in ``slot``: Y (height, width) uint8 and UV
        (height // 2, width // 2, 2) uint8 (the shapes ``Frame.device_planes`` has)."""
        import cupy

        memory = cupy.cuda.UnownedMemory(self.pointer(slot), width * height * 3 // 2, self)
        flat = cupy.ndarray((width * height * 3 // 2,), np.uint8,
                            cupy.cuda.MemoryPointer(memory, 0))
        return (flat[:width * height].reshape(height, width),
                flat[width * height:].reshape(height // 2, width // 2, 2))

    def copy_nv12_in(self, slot: int, y: Any, uv: Any, stream_ptr: int) -> None:
        """Queue the two copies packing a decoded frame's planes into ``slot`` on the
        stream ``stream_ptr``.

        Args:
            y: (height, width) uint8 CuPy array, any row pitch (an NVDEC surface's Y).
            uv: (height // 2, width // 2, 2) uint8 CuPy array, any row pitch.
        """
        import cupy

        height, width = y.shape
        copy = cupy.cuda.runtime.memcpy2DAsync
        device_to_device = cupy.cuda.runtime.memcpyDeviceToDevice
        dst = self.pointer(slot)
        copy(dst, width, y.data.ptr, y.strides[0], width, height, device_to_device, stream_ptr)
        copy(dst + width * height, width, uv.data.ptr, uv.strides[0], width, height // 2,
             device_to_device, stream_ptr)

    def close(self) -> None:
        """Free (the engine) or unmap (a worker) the ring; idempotent."""
        if not self._open:
            return
        self._open = False
        import cupy

        try:
            if self._owned:
                cupy.cuda.runtime.free(self.base)
            else:
                cupy.cuda.runtime.ipcCloseMemHandle(self.base)
        except cupy.cuda.runtime.CUDARuntimeError:
            pass  # the context is going away
