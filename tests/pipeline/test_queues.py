"""StageQueue: lanes, policies, round-robin, closing and stop."""

from __future__ import annotations

import threading
import time

import pytest

from pipeline.queues import CLOSED, StageQueue, Stopped
from pipeline.records import EndOfStream


def make(lanes: dict[str, tuple[int, str]]) -> tuple[StageQueue, threading.Event]:
    stop = threading.Event()
    queue = StageQueue("q", stop)
    for lane, (capacity, policy) in lanes.items():
        queue.add_lane(lane, capacity, policy)  # type: ignore[arg-type]
    return queue, stop


def test_round_robin_over_lanes() -> None:
    queue, _ = make({"a": (4, "block"), "b": (4, "block")})
    for i in range(3):
        queue.put("a", f"a{i}")
    queue.put("b", "b0")
    assert [queue.get() for _ in range(4)] == ["a0", "b0", "a1", "a2"]


def test_drop_oldest_keeps_newest_and_counts() -> None:
    queue, _ = make({"cam": (2, "drop_oldest")})
    for i in range(5):
        queue.put("cam", i)
    assert queue.dropped() == {"cam": 3}
    assert [queue.get(), queue.get()] == [3, 4]


def test_drop_oldest_never_drops_end_of_stream() -> None:
    queue, stop = make({"cam": (1, "drop_oldest")})
    queue.put("cam", EndOfStream("cam", 3))
    stop.set()
    with pytest.raises(Stopped):
        queue.put("cam", "late frame")


def test_block_waits_for_room() -> None:
    queue, _ = make({"file": (1, "block")})
    queue.put("file", 0)
    done = threading.Event()
    threading.Thread(target=lambda: (queue.put("file", 1), done.set()), daemon=True).start()
    assert not done.wait(0.2)
    assert queue.get() == 0
    assert done.wait(2)
    assert queue.get() == 1


def test_closed_after_all_lanes_closed_and_drained() -> None:
    queue, _ = make({"a": (2, "block"), "b": (2, "block")})
    queue.put("a", 1)
    queue.close("a")
    assert queue.get(timeout=0.05) == 1
    assert queue.get(timeout=0.05) is None  # b still open
    queue.close("b")
    assert queue.get() is CLOSED


def test_stop_wakes_blocked_getter() -> None:
    queue, stop = make({"a": (1, "block")})
    errors: list[BaseException] = []

    def getter() -> None:
        try:
            queue.get()
        except Stopped as error:
            errors.append(error)

    thread = threading.Thread(target=getter, daemon=True)
    thread.start()
    time.sleep(0.05)
    stop.set()
    thread.join(1)
    assert not thread.is_alive() and len(errors) == 1
