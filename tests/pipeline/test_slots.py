"""The slot ring on the host (CPU path): acquire and release, the wait for a free slot and
how it ends, and the stride-aware copy of decoded planes into a slot."""

from __future__ import annotations

import threading
import time

import av
import numpy as np
import pytest

from pipeline.slots import LIVE_RESERVE_SLOTS, SlotRing, copy_i420_planes, i420_bytes


def test_acquire_hands_out_every_slot_once_and_release_returns_them() -> None:
    ring = SlotRing(3, i420_bytes(4, 2))
    assert (ring.slots, ring.slot_bytes, ring.pinned) == (3, 12, False)
    assert ring.memory.shape == (3, 12) and ring.memory.dtype == np.uint8
    taken = [ring.acquire() for _ in range(3)]
    assert sorted(taken) == [0, 1, 2] and ring.free_slots() == 0
    ring.release(np.array([taken[1], -1, taken[0]], np.int32))  # -1: a frame without a slot
    assert ring.free_slots() == 2
    assert {ring.acquire(), ring.acquire()} == {taken[0], taken[1]}
    ring.release([-1, -1])
    ring.release([])
    assert ring.free_slots() == 0 and ring.waited_s == 0.0


@pytest.mark.parametrize(("slots", "slot_bytes"), [(0, 10), (2, 0)])
def test_a_ring_needs_a_slot_and_a_byte(slots: int, slot_bytes: int) -> None:
    with pytest.raises(ValueError, match="slots >= 1 and slot_bytes >= 1"):
        SlotRing(slots, slot_bytes)


@pytest.mark.parametrize(("size", "fits"), [((4, 2), True), ((6, 2), False), ((2, 4), True),
                                            ((4, 4), False)])
def test_fits_compares_the_i420_size_with_the_slot(size: tuple[int, int], fits: bool) -> None:
    assert SlotRing(1, i420_bytes(4, 2)).fits(*size) is fits


def test_image_and_pointer_address_the_slot() -> None:
    ring = SlotRing(2, 40)
    image = ring.image(1, 4, 2)
    assert image.shape == (3, 4) and np.shares_memory(image, ring.memory[1])
    image[:] = 9
    assert ring.memory[1, :12].tolist() == [9] * 12 and not (ring.memory[1, 12:] == 9).all()
    assert ring.pointer(1) == ring.memory.ctypes.data + 40 == image.ctypes.data


def test_acquire_waits_for_a_release_and_counts_the_wait() -> None:
    ring = SlotRing(1, 8)
    slot = ring.acquire()
    threading.Timer(0.2, ring.release, args=([slot],)).start()
    started = time.perf_counter()
    assert ring.acquire() == slot
    waited = time.perf_counter() - started
    assert 0.15 < ring.waited_s <= waited + 0.01


@pytest.mark.parametrize("which", [0, 1])
def test_acquire_returns_none_once_a_stop_event_is_set(which: int) -> None:
    ring = SlotRing(1, 8)
    ring.acquire()
    events = [threading.Event(), threading.Event()]
    threading.Timer(0.15, events[which].set).start()
    started = time.perf_counter()
    assert ring.acquire(*events) is None
    assert time.perf_counter() - started < 1.0
    assert ring.waited_s >= 0.1 and ring.free_slots() == 0


def test_a_file_leaves_free_slots_for_each_live_source_of_the_ring() -> None:
    """A file's acquire keeps LIVE_RESERVE_SLOTS free per live source (at most half the
    ring), so a camera beside a file that decodes as fast as it can still finds a slot."""
    ring = SlotRing(12, 8)
    stop = threading.Event()
    stop.set()  # an acquire that would wait gives None at once

    def file_takes() -> list[int]:
        return [slot for slot in (ring.acquire(stop) for _ in range(12)) if slot is not None]

    ring.add_live_source()
    held = file_takes()
    assert len(held) == 12 - LIVE_RESERVE_SLOTS == 8
    assert ring.try_acquire() is not None  # the camera's frame finds one (3 left)
    ring.release(held)  # 11 free
    ring.add_live_source()  # two cameras: 8 kept, capped at half the ring, 6
    held = file_takes()
    assert len(held) == 11 - 6 and ring.free_slots() == 6
    ring.add_live_source(-1)
    ring.add_live_source(-1)  # no camera left: a file takes every free slot
    assert len(file_takes()) == 6 and ring.free_slots() == 0


def test_an_already_set_stop_does_not_take_a_free_slot_away() -> None:
    stop = threading.Event()
    stop.set()
    ring = SlotRing(1, 8)
    assert ring.acquire(stop) == 0  # a free slot is handed out without waiting


@pytest.mark.parametrize(("width", "height"), [(642, 36), (320, 240), (2, 2), (1282, 6)])
def test_copy_i420_planes_skips_the_decoders_row_padding(width: int, height: int) -> None:
    pixels = np.random.default_rng(width).integers(0, 256, (height * 3 // 2, width), np.uint8)
    picture = av.VideoFrame.from_ndarray(pixels, format="yuv420p")
    if width == 642:  # the case this is about: rows are wider than the picture
        assert picture.planes[0].line_size > width and picture.planes[1].line_size > width // 2
    ring = SlotRing(2, i420_bytes(width, height) + 64)
    ring.memory[:] = 77  # what a previous, larger frame left in the slot
    out = ring.image(1, width, height)
    copy_i420_planes(picture.planes, width, height, out)
    np.testing.assert_array_equal(out, picture.to_ndarray())
    np.testing.assert_array_equal(out, pixels)
    assert (ring.memory[1, i420_bytes(width, height):] == 77).all()  # nothing past the frame
    assert (ring.memory[0] == 77).all()


def test_copy_i420_planes_of_a_decoded_picture(samples) -> None:
    with av.open(str(samples.bikes)) as container:
        picture = next(container.decode(video=0))
    width, height = picture.width, picture.height
    out = np.empty((height * 3 // 2, width), np.uint8)
    copy_i420_planes(picture.planes, width, height, out)
    np.testing.assert_array_equal(out, picture.to_ndarray(format="yuv420p"))
