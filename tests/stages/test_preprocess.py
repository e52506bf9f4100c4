"""Preprocess of a batch: the host path against the NumPy reference frame by frame, and on a
GPU the fused kernel over a real batch set (queued by the batcher) against the host path."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kernels.preprocess import letterbox_geometry, preprocess_reference
from pipeline.records import Frame
from stages.batcher import BatcherStage
from stages.preprocess import HostPreprocess
from tests.support.batches import frame_batch, make_frame

INPUT = (32, 48)  # model input (height, width)
SIZES = [(64, 48), (48, 64), (64, 48), (30, 30), (100, 20), (48, 32)]  # (width, height)


def picture(width: int, height: int, seed: int) -> np.ndarray:
    """A (height * 3 // 2, width) uint8 I420 picture of noise over a gradient."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 255, width * (height * 3 // 2)).reshape(height * 3 // 2, width)
    noise = rng.integers(-40, 40, ramp.shape)
    return np.clip(ramp + noise, 0, 255).astype(np.uint8)


def frames(sizes: list[tuple[int, int]] = SIZES) -> list[Frame]:
    return [make_frame("ab"[i % 2], i, picture(w, h, i)) for i, (w, h) in enumerate(sizes)]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_host_preprocess_is_the_reference_for_every_frame(dtype) -> None:
    pre = HostPreprocess(INPUT, dtype, max_batch=8)
    batch = frame_batch(frames())
    images = pre.run(batch)
    assert images.shape == (len(SIZES), 3, *INPUT) and images.dtype == dtype
    assert np.shares_memory(images, pre.images)  # the reused input, no per-batch allocation
    for image, frame in zip(images, frames()):
        letterbox = letterbox_geometry(frame.width, frame.height, INPUT[1], INPUT[0])
        expected = preprocess_reference(frame.image, frame.width, frame.height, letterbox,
                                        dtype=dtype)
        np.testing.assert_array_equal(image, expected)


def test_host_preprocess_writes_into_the_given_input_and_reuses_it() -> None:
    out = np.full((4, 3, *INPUT), -1.0, np.float32)
    pre = HostPreprocess(INPUT, np.float32, max_batch=4, out=out)
    first = pre.run(frame_batch(frames(SIZES[:3])))
    assert np.shares_memory(first, out)
    assert (out[3] == -1.0).all()  # rows past the batch are left alone
    second = pre.run(frame_batch(frames(SIZES[3:4])))
    assert second.shape == (1, 3, *INPUT) and np.shares_memory(second, out)
    frame = frames(SIZES[3:4])[0]
    expected = preprocess_reference(frame.image, frame.width, frame.height,
                                    letterbox_geometry(frame.width, frame.height, 48, 32))
    np.testing.assert_array_equal(out[0], expected)


def gpu_reason() -> str | None:
    from pipeline.gpu import gpu_unavailable_reason

    return gpu_unavailable_reason()


@pytest.mark.gpu
def test_device_preprocess_over_a_batch_set_is_the_host_preprocess() -> None:
    if reason := gpu_reason():
        pytest.skip(f"GPU path unavailable: {reason}")
    import cupy

    from pipeline.gpu import GpuContext
    from pipeline.slots import SlotRing, i420_bytes
    from stages.preprocess import DevicePreprocess

    max_batch = len(SIZES)
    slot_bytes = max(i420_bytes(w, h) for w, h in SIZES) + 32
    gpu = GpuContext(0)
    gpu.allocate(2, max_batch, slot_bytes, 10)
    ring = SlotRing(max_batch, slot_bytes, pinned=True)
    batcher = BatcherStage("batch", INPUT, max_batch, 1000.0, ("a", "b"), gpu, ring,
                           threading.Event())
    batcher.open()
    # The frames as the decoder leaves them: their images in pinned ring slots.
    in_slots = []
    for frame in frames():
        slot = ring.acquire()
        image = ring.image(slot, frame.width, frame.height)
        image[:] = frame.image
        in_slots.append(make_frame(frame.source, frame.index, image, slot=slot))
    batch = batcher.make_batch(in_slots)
    buffers = batch.buffers
    assert buffers is not None and len(buffers.groups) == len(set(SIZES))
    geometries = [(batcher.letterbox(w, h), "i420") for w, h in SIZES]
    device = DevicePreprocess(geometries)
    sentinel = -7.0
    stream = gpu.compute_stream
    for dtype in (np.float32, np.float16):
        with stream:  # CuPy's own work on the compute stream too: one order for everything
            out = cupy.full((max_batch + 1, 3, *INPUT), sentinel, dtype)
            device.warmup(buffers, out, stream)  # compiles; writes row 0
            out.fill(sentinel)
            stream.wait_event(buffers.copied)
            device.enqueue(buffers, out, stream)
        stream.synchronize()
        got = cupy.asnumpy(out)
        expected = HostPreprocess(INPUT, dtype, max_batch).run(batch)
        err = np.abs(got[:max_batch].astype(np.float32) - expected.astype(np.float32)).max()
        assert err <= 1 / 255, f"max abs error {err * 255:.3f}/255 ({np.dtype(dtype).name})"
        assert (got[max_batch] == sentinel).all()  # nothing written past the batch
    gpu.batches.release(buffers)
    ring.release(batch.slot)
