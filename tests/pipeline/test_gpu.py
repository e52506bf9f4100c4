"""The host-side logic of pipeline/gpu.py (runs without a GPU)."""

from __future__ import annotations

import queue
import threading

import pytest

from pipeline.gpu import hidden_fraction, take


@pytest.mark.parametrize(("copies", "compute", "expected"), [
    ([(0, 1)], [(0, 1)], 1.0),                      # fully under compute
    ([(0, 1)], [(2, 3)], 0.0),                      # GPU idle during the copy
    ([(0, 2)], [(1, 3)], 0.5),                      # half
    ([(0, 2)], [(0, 1), (0.5, 1.5)], 0.75),         # overlapping compute ranges count once
    ([(0, 1), (2, 3)], [(0.5, 2.5)], 0.5),          # several copies
    ([], [(0, 1)], 0.0),
])
def test_hidden_fraction(copies, compute, expected) -> None:
    assert hidden_fraction(copies, compute) == pytest.approx(expected)


def test_take_returns_an_item_and_stops_on_the_stop_event() -> None:
    free: queue.Queue[int] = queue.Queue()
    free.put(7)
    stop = threading.Event()
    assert take(free, stop, "a slot") == 7
    stop.set()
    with pytest.raises(InterruptedError, match="stopped while waiting for a slot"):
        take(free, stop, "a slot")
