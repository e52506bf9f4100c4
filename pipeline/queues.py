"""Bounded queues between stages, with one lane per producer and a policy per lane.

A ``StageQueue`` has one lane per producer (one per source in front of the first stage, one
in front of every later stage). Each lane is bounded and has its policy:

- ``block``: ``put`` waits while the lane is full (file sources: no frame is ever lost) and
  returns how long it waited, so the graph can report time blocked downstream apart from work;
- ``drop_oldest``: ``put`` on a full lane discards the oldest waiting item, counts it and hands
  it to the lane's ``on_drop`` callback (live sources: latency stays bounded instead of
  growing, and the dropped item's resources, such as its frame slot, go back to their owner).

An ``EndOfStream`` is never dropped: a ``drop_oldest`` lane discards the oldest item that is not
one, and waits like a ``block`` lane when it holds nothing else.

``get`` takes from the lanes round-robin, so one busy source cannot starve the others. When
every lane is closed and empty, ``get`` returns ``CLOSED``. Every wait also wakes on the
graph's stop event, so no thread can hang on a full or empty queue during shutdown.

Waking: one lock, a ``not_empty`` condition the consumer waits on and one ``not_full``
condition per lane its producer waits on. A ``put`` notifies one consumer; a ``get`` from lane
L notifies one producer of lane L, and nobody else. Only ``close`` (the consumer must see
``CLOSED``) and ``wake`` (shutdown) notify every waiter. So the wake-ups per item stay constant
however many cameras feed the queue. Waits are bounded (``POLL_S``): a stop that races with a
notification is still seen within ``POLL_S`` seconds.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pipeline.records import EndOfStream

QueuePolicy = Literal["block", "drop_oldest"]

# Longest single wait on a condition before the stop event is checked again, seconds.
POLL_S = 0.1


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
    not_full: threading.Condition
    on_drop: Callable[[Any], None] | None = None
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
        self._order: list[_Lane] = []
        self._next = 0
        self._lock = threading.Lock()
        self._not_empty = threading.Condition(self._lock)

    def add_lane(self, lane: str, capacity: int, policy: QueuePolicy = "block",
                 on_drop: Callable[[Any], None] | None = None) -> None:
        """Declare a producer's lane; done while the graph is wired, before threads start.

        Args:
            lane: the lane's name (unique in this queue).
            capacity: most items the lane holds, >= 1.
            policy: ``block`` or ``drop_oldest`` (see the module docstring).
            on_drop: called with every item a ``drop_oldest`` lane discards, in the producer's
                thread, by the ``put`` that discarded it, *outside* the queue's lock (so it may
                take other locks, such as a slot ring's, or even use this queue), after the new
                item was enqueued. An exception it raises propagates out of that ``put``.

        Raises:
            ValueError: capacity < 1, an unknown policy, or a lane of that name exists.
        """
        if capacity < 1:
            raise ValueError(f"queue {self.name}: capacity must be >= 1, got {capacity}")
        if policy not in ("block", "drop_oldest"):
            raise ValueError(f"queue {self.name}: policy must be block or drop_oldest, got {policy!r}")
        if lane in self._lanes:
            raise ValueError(f"queue {self.name}: lane {lane!r} declared twice")
        state = _Lane(capacity, policy, threading.Condition(self._lock), on_drop)
        with self._lock:
            self._lanes[lane] = state
            self._order.append(state)

    def put(self, lane: str, item: Any) -> float:
        """Append ``item`` to ``lane`` following the lane's policy.

        Returns:
            Seconds spent waiting for room (0.0 when the lane had room or dropped its oldest
            item instead).

        Raises:
            Stopped: the graph was stopped while waiting for room.
        """
        state = self._lanes[lane]
        dropped: list[Any] = []
        waited = 0.0
        with self._lock:
            while len(state.items) >= state.capacity:
                if state.policy == "drop_oldest":
                    victim = self._drop_oldest(state)
                    if victim is not _NOTHING:
                        dropped.append(victim)
                        continue
                began = time.monotonic()
                self._wait(state.not_full)
                waited += time.monotonic() - began
            state.items.append(item)
            self._not_empty.notify()
        if state.on_drop is not None:
            for victim in dropped:
                state.on_drop(victim)
        return waited

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
        with self._lock:
            while True:
                count = len(self._order)
                for _ in range(count):
                    state = self._order[self._next]
                    self._next = (self._next + 1) % count
                    if state.items:
                        item = state.items.popleft()
                        state.not_full.notify()
                        return item
                if all(s.closed for s in self._order):
                    return CLOSED
                if deadline is None:
                    self._wait(self._not_empty)
                else:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return None
                    self._wait(self._not_empty, left)

    def close(self, lane: str) -> None:
        """The producer of ``lane`` will put nothing more."""
        with self._lock:
            self._lanes[lane].closed = True
            self._not_empty.notify_all()

    def depth(self) -> int:
        """Items waiting in all lanes."""
        with self._lock:
            return sum(len(s.items) for s in self._order)

    def dropped(self) -> dict[str, int]:
        """Items discarded so far, per lane."""
        with self._lock:
            return {name: s.dropped for name, s in self._lanes.items()}

    def wake(self) -> None:
        """Wake every waiting thread (called after the stop event is set)."""
        with self._lock:
            self._not_empty.notify_all()
            for state in self._order:
                state.not_full.notify_all()

    def _drop_oldest(self, state: _Lane) -> Any:
        """Remove and count the oldest item that is not an EndOfStream; ``_NOTHING`` if none.

        Called with the lock held.
        """
        for index, candidate in enumerate(state.items):
            if not isinstance(candidate, EndOfStream):
                del state.items[index]
                state.dropped += 1
                return candidate
        return _NOTHING

    def _wait(self, condition: threading.Condition, timeout: float | None = None) -> None:
        """Wait on ``condition`` (lock held) at most ``POLL_S``; raise ``Stopped`` if stopping."""
        if self._stop.is_set():
            raise Stopped(self.name)
        condition.wait(POLL_S if timeout is None else max(0.0, min(timeout, POLL_S)))
        if self._stop.is_set():
            raise Stopped(self.name)


_NOTHING = object()


class Backlog:
    """What waits for a slow consumer (an MQTT broker, a webhook endpoint): at most ``size``
    items, in order; a full backlog drops its oldest item to take a new one and counts it in
    ``dropped``, so the newest are kept. Not locked: its owner guards it.

    ``append`` says when a drop is the first since the consumer last caught up
    (``caught_up``), so that an overflow is logged once per outage, not once per item.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.dropped = 0
        self._items: deque[Any] = deque()
        self._overflowing = False  # dropped since the consumer last caught up

    def __len__(self) -> int:
        return len(self._items)

    def append(self, item: Any) -> bool:
        """Add ``item`` (dropping the oldest when full); True on an outage's first drop."""
        full = len(self._items) >= self.size
        if full:
            self._items.popleft()
            self.dropped += 1
        self._items.append(item)
        first = full and not self._overflowing
        self._overflowing = self._overflowing or full
        return first

    def popleft(self) -> Any:
        """The oldest item (IndexError when empty)."""
        return self._items.popleft()

    def caught_up(self) -> int:
        """The consumer takes items again: the next drop is an outage's first. Returns how
        many wait."""
        self._overflowing = False
        return len(self._items)
