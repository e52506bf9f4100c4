"""StageQueue: lanes, policies, round-robin, closing, stop and who wakes whom, on real threads."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from pipeline import queues
from pipeline.queues import CLOSED, Backlog, StageQueue, Stopped
from pipeline.records import EndOfStream


def make(lanes: dict[str, tuple[int, str]],
         on_drop: Callable[[Any], None] | None = None) -> tuple[StageQueue, threading.Event]:
    stop = threading.Event()
    queue = StageQueue("q", stop)
    for lane, (capacity, policy) in lanes.items():
        queue.add_lane(lane, capacity, policy, on_drop=on_drop)  # type: ignore[arg-type]
    return queue, stop


class Runner:
    """Runs ``call`` in a daemon thread; keeps its result, its exception and when it returned."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.finished_at: float | None = None
        self.done = threading.Event()

        def body() -> None:
            try:
                self.result = call()
            except BaseException as error:  # noqa: BLE001 - the test inspects it
                self.error = error
            self.finished_at = time.monotonic()
            self.done.set()

        self.thread = threading.Thread(target=body, daemon=True)
        self.thread.start()


@pytest.fixture
def slow_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bounded waits of 30 s: a thread woken within a second was woken by a notification."""
    monkeypatch.setattr(queues, "POLL_S", 30.0)


# ---------------------------------------------------------------------------------------------
# Order and round-robin (single thread)

@pytest.mark.parametrize(("lanes", "puts", "expected"), [
    pytest.param({"a": (4, "block")}, [("a", 1), ("a", 2), ("a", 3)], [1, 2, 3], id="fifo"),
    pytest.param({"a": (4, "block"), "b": (4, "block")},
                 [("a", "a0"), ("a", "a1"), ("a", "a2"), ("b", "b0")],
                 ["a0", "b0", "a1", "a2"], id="round-robin"),
    pytest.param({"a": (4, "block"), "b": (4, "block"), "c": (4, "block")},
                 [("c", "c0"), ("c", "c1"), ("b", "b0"), ("a", "a0"), ("a", "a1")],
                 ["a0", "b0", "c0", "a1", "c1"], id="three-lanes"),
    pytest.param({"a": (2, "drop_oldest"), "b": (4, "block")},
                 [("a", 0), ("a", 1), ("a", 2), ("b", "b0")], [1, "b0", 2], id="drop-then-rr"),
])
def test_order_and_round_robin(lanes: dict, puts: list, expected: list) -> None:
    queue, _ = make(lanes)
    for lane, item in puts:
        assert queue.put(lane, item) == 0.0  # never waited
    assert queue.depth() == len(expected)
    assert [queue.get() for _ in expected] == expected
    assert queue.get(timeout=0.01) is None
    assert queue.depth() == 0


@pytest.mark.parametrize(("capacity", "policy"), [(0, "block"), (-1, "drop_oldest"), (1, "lifo")])
def test_bad_lane(capacity: int, policy: str) -> None:
    queue, _ = make({})
    with pytest.raises(ValueError, match="queue q"):
        queue.add_lane("a", capacity, policy)  # type: ignore[arg-type]


def test_closed_after_all_lanes_closed_and_drained() -> None:
    queue, _ = make({"a": (2, "block"), "b": (2, "block")})
    queue.put("a", 1)
    queue.close("a")
    assert queue.get(timeout=0.05) == 1
    assert queue.get(timeout=0.05) is None  # b still open
    queue.close("b")
    assert queue.get() is CLOSED


def test_close_wakes_a_waiting_consumer(slow_poll: None) -> None:
    queue, _ = make({"a": (2, "block"), "b": (2, "block")})
    getter = Runner(queue.get)
    time.sleep(0.05)
    queue.close("a")
    assert not getter.done.wait(0.1)  # b is still open
    queue.close("b")
    assert getter.done.wait(1) and getter.result is CLOSED


# ---------------------------------------------------------------------------------------------
# Policies

@pytest.mark.parametrize("hold_s", [0.05, 0.2])
def test_block_waits_for_room_and_returns_the_time_waited(hold_s: float) -> None:
    queue, _ = make({"file": (1, "block")})
    assert queue.put("file", 0) == 0.0
    producer = Runner(lambda: queue.put("file", 1))
    time.sleep(hold_s)
    assert not producer.done.is_set()
    assert queue.get() == 0
    assert producer.done.wait(2) and producer.error is None
    assert hold_s - 0.02 <= producer.result < hold_s + 1.0  # less only the thread's start
    assert queue.get() == 1


@pytest.mark.parametrize(("capacity", "count", "kept"), [
    (1, 3, [2]),
    (2, 5, [3, 4]),
    (3, 3, [0, 1, 2]),  # never full: nothing dropped
    (4, 10, [6, 7, 8, 9]),
])
def test_drop_oldest_keeps_newest_counts_and_hands_back(capacity: int, count: int,
                                                        kept: list[int]) -> None:
    handed_back: list[Any] = []
    queue, _ = make({"cam": (capacity, "drop_oldest"), "file": (1, "block")},
                    on_drop=handed_back.append)
    for i in range(count):
        assert queue.put("cam", i) == 0.0  # dropping is not waiting
    dropped = [i for i in range(count) if i not in kept]
    assert queue.dropped() == {"cam": len(dropped), "file": 0}
    assert handed_back == dropped
    assert [queue.get() for _ in kept] == kept


def test_on_drop_runs_outside_the_lock() -> None:
    """on_drop may use the queue itself (it runs after the put released the lock)."""
    queue, _ = make({})
    depths: list[int] = []
    queue.add_lane("cam", 1, "drop_oldest", on_drop=lambda item: depths.append(queue.depth()))
    queue.put("cam", 0)
    producer = Runner(lambda: queue.put("cam", 1))
    assert producer.done.wait(2), "on_drop deadlocked on the queue's lock"
    assert producer.error is None and depths == [1]  # called once, after the new item was queued


@pytest.mark.parametrize(("capacity", "puts", "expected_items", "expected_dropped"), [
    # The end of stream waits at the head; the frames after it are dropped instead.
    pytest.param(2, ["eos", 1, 2, 3], ["eos", 3], [1, 2], id="eos-first"),
    pytest.param(2, [0, "eos"], [0, "eos"], [], id="eos-fits"),
    pytest.param(2, [0, 1, "eos"], [1, "eos"], [0], id="eos-drops-a-frame"),
    pytest.param(1, [0, "eos"], ["eos"], [0], id="eos-replaces-a-frame"),
])
def test_end_of_stream_is_never_dropped(capacity: int, puts: list, expected_items: list,
                                        expected_dropped: list) -> None:
    eos = EndOfStream("cam", 3)
    handed_back: list[Any] = []
    queue, _ = make({"cam": (capacity, "drop_oldest")}, on_drop=handed_back.append)
    for item in puts:
        queue.put("cam", eos if item == "eos" else item)
    assert [queue.get() for _ in expected_items] == [eos if i == "eos" else i for i in expected_items]
    assert handed_back == expected_dropped
    assert queue.dropped() == {"cam": len(expected_dropped)}


def test_a_lane_full_of_end_of_stream_waits_like_block() -> None:
    queue, stop = make({"cam": (1, "drop_oldest")})
    eos = EndOfStream("cam", 3)
    queue.put("cam", eos)
    producer = Runner(lambda: queue.put("cam", "late frame"))
    assert not producer.done.wait(0.1)
    assert queue.get() is eos
    assert producer.done.wait(1) and producer.result > 0.05
    assert queue.get() == "late frame"


def test_a_stopped_queue_raises_instead_of_waiting() -> None:
    queue, stop = make({"cam": (1, "drop_oldest"), "file": (1, "block")})
    queue.put("cam", EndOfStream("cam", 3))
    queue.put("file", 0)
    stop.set()
    for lane in ("cam", "file"):
        with pytest.raises(Stopped):
            queue.put(lane, "late frame")
    assert queue.get() == EndOfStream("cam", 3)  # items still queued are still handed out
    assert queue.get() == 0
    with pytest.raises(Stopped):
        queue.get()


# ---------------------------------------------------------------------------------------------
# Stop and wake

def blocked_producer(queue: StageQueue) -> Runner:
    queue.put("a", "fills the lane")
    return Runner(lambda: queue.put("a", "waits"))


def blocked_consumer(queue: StageQueue) -> Runner:
    return Runner(queue.get)


@pytest.mark.parametrize("start", [blocked_producer, blocked_consumer], ids=["producer", "consumer"])
@pytest.mark.parametrize("call_wake", [True, False], ids=["wake", "stop-only"])
def test_stop_wakes_blocked_threads_with_stopped(start: Callable[[StageQueue], Runner],
                                                 call_wake: bool) -> None:
    queue, stop = make({"a": (1, "block")})
    runner = start(queue)
    time.sleep(0.05)
    assert not runner.done.is_set()
    stopped_at = time.monotonic()
    stop.set()
    if call_wake:
        queue.wake()
    assert runner.done.wait(1)
    assert isinstance(runner.error, Stopped)
    assert runner.finished_at - stopped_at < 0.2  # type: ignore[operator]


@pytest.mark.parametrize("start", [blocked_producer, blocked_consumer], ids=["producer", "consumer"])
def test_wake_reaches_every_waiter_at_once(slow_poll: None,
                                           start: Callable[[StageQueue], Runner]) -> None:
    queue, stop = make({"a": (1, "block")})
    runner = start(queue)
    time.sleep(0.05)
    stop.set()
    queue.wake()
    assert runner.done.wait(1) and isinstance(runner.error, Stopped)


# ---------------------------------------------------------------------------------------------
# Who wakes whom. With waits bounded at 30 s, a thread that finishes within a second was woken
# by a notification, not by the poll.

def test_get_from_a_lane_wakes_that_lanes_producer(slow_poll: None) -> None:
    queue, _ = make({"b": (2, "block"), "a": (1, "block")})
    queue.put("a", "a0")
    queue.put("b", "b0")
    producer = Runner(lambda: queue.put("a", "a1"))
    time.sleep(0.05)
    assert queue.get() == "b0"  # lane b first: lane a is still full
    assert not producer.done.wait(0.2)
    got_at = time.monotonic()
    assert queue.get() == "a0"
    assert producer.done.wait(1) and producer.error is None
    assert producer.finished_at - got_at < 0.5  # type: ignore[operator]
    assert producer.result >= 0.2
    assert queue.get() == "a1"


def test_each_get_wakes_its_own_lanes_producer(slow_poll: None) -> None:
    lanes = [f"cam{i}" for i in range(6)]
    queue, _ = make({lane: (1, "block") for lane in lanes})
    for lane in lanes:
        queue.put(lane, (lane, 0))
    producers = {lane: Runner(lambda lane=lane: queue.put(lane, (lane, 1))) for lane in lanes}
    time.sleep(0.05)
    for lane in lanes:  # round-robin: one get per lane, in lane order
        assert queue.get() == (lane, 0)
        assert producers[lane].done.wait(1)
        assert all(not producers[other].done.is_set() for other in lanes[lanes.index(lane) + 1:])
    assert sorted(queue.get() for _ in lanes) == sorted((lane, 1) for lane in lanes)


def test_put_wakes_the_waiting_consumer(slow_poll: None) -> None:
    queue, _ = make({"a": (1, "block"), "b": (1, "block")})
    consumer = Runner(queue.get)
    time.sleep(0.05)
    put_at = time.monotonic()
    queue.put("b", "b0")
    assert consumer.done.wait(1) and consumer.result == "b0"
    assert consumer.finished_at - put_at < 0.5  # type: ignore[operator]


def test_get_timeout_returns_none_in_time(slow_poll: None) -> None:
    queue, _ = make({"a": (1, "block")})
    began = time.monotonic()
    assert queue.get(timeout=0.1) is None
    assert 0.09 <= time.monotonic() - began < 1.0


# ---------------------------------------------------------------------------------------------
# Many producers, one consumer

@pytest.mark.parametrize(("lanes", "producers_per_lane", "items"), [
    pytest.param(8, 1, 2000, id="8-lanes"),
    pytest.param(32, 1, 300, id="32-lanes"),
    pytest.param(4, 3, 500, id="3-producers-per-lane"),
])
@pytest.mark.parametrize("capacity", [1, 4])
def test_many_producers_deliver_every_item_once_in_order(lanes: int, producers_per_lane: int,
                                                         items: int, capacity: int) -> None:
    stop = threading.Event()
    queue = StageQueue("q", stop)
    names = [f"lane{i}" for i in range(lanes)]
    for name in names:
        queue.add_lane(name, capacity)
    remaining = {name: producers_per_lane for name in names}
    remaining_lock = threading.Lock()
    waited: list[float] = []

    def produce(lane: str, producer: int) -> None:
        total = 0.0
        for i in range(items):
            total += queue.put(lane, (lane, producer, i))
        waited.append(total)
        with remaining_lock:
            remaining[lane] -= 1
            last = remaining[lane] == 0
        if last:
            queue.close(lane)

    threads = [threading.Thread(target=produce, args=(lane, p), daemon=True)
               for lane in names for p in range(producers_per_lane)]
    for thread in threads:
        thread.start()
    received: list[tuple[str, int, int]] = []
    deadline = time.monotonic() + 60
    while (item := queue.get(timeout=5)) is not CLOSED:
        assert item is not None and time.monotonic() < deadline, "consumer starved"
        received.append(item)
    for thread in threads:
        thread.join(5)
    assert not any(t.is_alive() for t in threads)
    assert len(received) == len(set(received)) == lanes * producers_per_lane * items
    for name in names:
        for producer in range(producers_per_lane):
            sequence = [i for lane, p, i in received if lane == name and p == producer]
            assert sequence == list(range(items))
    assert len(waited) == len(threads) and all(w >= 0.0 for w in waited)
    assert queue.depth() == 0 and set(queue.dropped().values()) == {0}


def test_drop_oldest_under_load_accounts_for_every_item() -> None:
    """Live lanes and a slow consumer: every item is either delivered or handed back, once."""
    stop = threading.Event()
    queue = StageQueue("q", stop)
    handed_back: list[tuple[str, int]] = []
    back_lock = threading.Lock()

    def on_drop(item: tuple[str, int]) -> None:
        with back_lock:
            handed_back.append(item)

    names = [f"cam{i}" for i in range(6)]
    for name in names:
        queue.add_lane(name, 2, "drop_oldest", on_drop=on_drop)
    items = 500

    def produce(lane: str) -> None:
        for i in range(items):
            queue.put(lane, (lane, i))
            if i % 50 == 0:
                time.sleep(0.001)
        queue.put(lane, EndOfStream(lane, items))
        queue.close(lane)

    threads = [threading.Thread(target=produce, args=(name,), daemon=True) for name in names]
    for thread in threads:
        thread.start()
    received: list[Any] = []
    while (item := queue.get(timeout=5)) is not CLOSED:
        assert item is not None
        received.append(item)
        if len(received) % 10 == 0:
            time.sleep(0.0005)
    for thread in threads:
        thread.join(5)
    ends = [item for item in received if isinstance(item, EndOfStream)]
    frames = [item for item in received if not isinstance(item, EndOfStream)]
    assert sorted(e.source for e in ends) == names  # every end of stream arrived
    assert sorted(frames + handed_back) == sorted((n, i) for n in names for i in range(items))
    dropped = queue.dropped()
    for name in names:
        delivered = [i for lane, i in frames if lane == name]
        assert delivered == sorted(delivered)
        assert dropped[name] == sum(1 for lane, _ in handed_back if lane == name)
        end = next(j for j, item in enumerate(received)
                   if isinstance(item, EndOfStream) and item.source == name)
        assert not any(isinstance(x, tuple) and x[0] == name for x in received[end + 1:])


def test_a_full_backlog_drops_its_oldest_and_tells_the_first_drop_of_each_outage():
    backlog = Backlog(3)
    assert [backlog.append(i) for i in range(3)] == [False] * 3 and backlog.dropped == 0
    assert backlog.append(3) is True  # full: 0 dropped, told once
    assert backlog.append(4) is False and backlog.dropped == 2
    assert [backlog.popleft() for _ in range(len(backlog))] == [2, 3, 4]  # the newest kept
    assert backlog.caught_up() == 0
    for i in range(4):
        told = backlog.append(i)
    assert told is True and backlog.dropped == 3  # a new outage is told again

