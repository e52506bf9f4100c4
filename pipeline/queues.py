"""Bounded queues between stages, with one lane per producer and a policy per lane.

A ``StageQueue`` has one lane per producer (one per source in front of the first stage, one
in front of every later stage). Each lane is bounded and has its policy:

- ``block``: ``put`` waits while the lane is full (file sources: no frame is ever lost);
- ``drop_oldest``: ``put`` on a full lane discards the oldest waiting frame and counts it
  (live sources: latency stays bounded instead of growing).

``get`` takes from the lanes round-robin, so one busy source cannot starve the others. When
every lane is closed and empty, ``get`` returns ``CLOSED``. Every wait also wakes on the
graph's stop event, so no thread can hang on a full or empty queue during shutdown.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

from pipeline.records import EndOfStream

QueuePolicy = Literal["block", "drop_oldest"]


class Closed:
    """Returned by ``get`` once every lane is closed and drained."""

    def __repr__(self) -> str:
        return "CLOSED"


CLOSED = Closed()


class Stopped(Exception):
    """The graph was stopped while a thread waited on a queue."""


@dataclass
class _Lane:
    capacity: int
    policy: QueuePolicy
    items: deque = field(default_factory=deque)
    closed: bool = False
    dropped: int = 0


class StageQueue:
    """A bounded multi-lane queue (see the module docstring).

    Args:
        name: used in metrics (queue depth) and errors.
        stop: the graph's stop event; set, it makes every waiting call raise ``Stopped``.
    """

    def __init__(self, name: str, stop: threading.Event) -> None:
        self.name = name
        self._stop = stop
        self._lanes: dict[str, _Lane] = {}
        self._order: list[str] = []
        self._next = 0
        self._cond = threading.Condition()

    def add_lane(self, lane: str, capacity: int, policy: QueuePolicy = "block") -> None:
        """Declare a producer's lane; done while the graph is wired, before threads start."""
        if capacity < 1:
            raise ValueError(f"queue {self.name}: capacity must be >= 1, got {capacity}")
        self._lanes[lane] = _Lane(capacity, policy)
        self._order.append(lane)

    def put(self, lane: str, item: Any) -> None:
        """Append ``item`` to ``lane`` following the lane's policy.

        Raises:
            Stopped: the graph was stopped while waiting for room.
        """
        state = self._lanes[lane]
        with self._cond:
            while len(state.items) >= state.capacity:
                if state.policy == "drop_oldest" and not isinstance(state.items[0], EndOfStream):
                    state.items.popleft()
                    state.dropped += 1
                    break
                self._wait()
            state.items.append(item)
            self._cond.notify_all()

    def get(self, timeout: float | None = None) -> Any:
        """Take the next item round-robin over the lanes.

        Args:
            timeout: seconds to wait for an item; None waits until one arrives.

        Returns:
            The item, ``CLOSED`` when every lane is closed and empty, or None on timeout.

        Raises:
            Stopped: the graph was stopped while waiting.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                for _ in range(len(self._order)):
                    state = self._lanes[self._order[self._next]]
                    self._next = (self._next + 1) % len(self._order)
                    if state.items:
                        item = state.items.popleft()
                        self._cond.notify_all()
                        return item
                if all(s.closed for s in self._lanes.values()):
                    return CLOSED
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                self._wait(None if deadline is None else deadline - time.monotonic())

    def close(self, lane: str) -> None:
        """The producer of ``lane`` will put nothing more."""
        with self._cond:
            self._lanes[lane].closed = True
            self._cond.notify_all()

    def depth(self) -> int:
        """Items waiting in all lanes."""
        with self._cond:
            return sum(len(s.items) for s in self._lanes.values())

    def dropped(self) -> dict[str, int]:
        """Frames discarded so far, per lane."""
        with self._cond:
            return {name: s.dropped for name, s in self._lanes.items()}

    def wake(self) -> None:
        """Wake every waiting thread (called after the stop event is set)."""
        with self._cond:
            self._cond.notify_all()

    def _wait(self, timeout: float | None = None) -> None:
        if self._stop.is_set():
            raise Stopped(self.name)
        # A bounded wait: a stop that raced with notify_all is still seen within 0.1 s.
        self._cond.wait(0.1 if timeout is None else max(0.0, min(timeout, 0.1)))
        if self._stop.is_set():
            raise Stopped(self.name)
