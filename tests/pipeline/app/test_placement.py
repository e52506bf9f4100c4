"""pipeline.app.placement: sources shared out over pipelines by load, and placed again after a
change (a source added or removed, a pipeline dead)."""

from __future__ import annotations

import pytest

from pipeline.app.placement import (
    CAMERA_FPS,
    CAMERA_SIZE,
    SourceLoad,
    assign,
    host_loads,
    probe_load,
    rebalance,
)
from pipeline.config import SourceConfig


def load(name: str, megapixels_per_s: float) -> SourceLoad:
    """A source of ``megapixels_per_s`` (1000 x 1000 pixels at that many frames/s)."""
    return SourceLoad(name, 1000, 1000, megapixels_per_s)


@pytest.mark.parametrize("loads, hosts, expected", [
    # LPT: heaviest first, each onto the least loaded host (ties: the lower number).
    ([load("a", 8), load("b", 4), load("c", 4), load("d", 2), load("e", 2)], [0, 1],
     {"a": 0, "b": 1, "c": 1, "d": 0, "e": 1}),
    ([load("a", 1), load("b", 1), load("c", 1), load("d", 1)], [0, 1],
     {"a": 0, "b": 1, "c": 0, "d": 1}),
    ([load("a", 1), load("b", 1), load("c", 1)], [3, 7, 5], {"a": 3, "b": 5, "c": 7}),
    ([load("only", 1)], [0, 1, 2], {"only": 0}),
    # Resolution counts: one 1080p camera weighs as much as several small ones.
    ([SourceLoad("hd", 1920, 1080, 30), *(SourceLoad(f"s{i}", 640, 360, 15) for i in range(8))],
     [0, 1], {"hd": 0, **{f"s{i}": 1 for i in range(8)}}),
])
def test_assign_shares_out_by_load(loads, hosts, expected):
    assert assign(loads, hosts) == expected


def test_assign_is_balanced_and_the_same_on_every_run():
    loads = [load(f"cam{i:02d}", (i * 7) % 5 + 1) for i in range(40)]
    first = assign(loads, [0, 1, 2, 3])
    assert assign(list(reversed(loads)), [3, 2, 1, 0]) == first
    totals = host_loads(first, loads, [0, 1, 2, 3])
    assert max(totals.values()) - min(totals.values()) <= 5e6  # at most one source apart


@pytest.mark.parametrize("loads, hosts, match", [
    ([load("a", 1)], [], "no pipeline"),
    ([load("a", 1)], [0, 0], "listed twice"),
    ([load("a", 1), load("a", 2)], [0], "named twice"),
])
def test_assign_rejects(loads, hosts, match):
    with pytest.raises(ValueError, match=match):
        assign(loads, hosts)


@pytest.mark.parametrize("kwargs, match", [
    ({"name": "", "width": 1, "height": 1, "fps": 1}, "expected a source name"),
    ({"name": "a", "width": 0, "height": 1, "fps": 1}, "positive size"),
    ({"name": "a", "width": 1, "height": 1, "fps": 0}, "fps > 0"),
])
def test_a_load_is_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SourceLoad(**kwargs)


def test_the_sources_of_a_dead_host_go_to_the_live_ones_and_the_others_stay():
    loads = [load(n, w) for n, w in [("a", 4), ("b", 3), ("c", 2), ("d", 1), ("e", 1), ("f", 1)]]
    before = assign(loads, [0, 1, 2])
    after = rebalance(before, loads, [0, 2])  # host 1 died
    assert all(after[n] == h for n, h in before.items() if h != 1)  # nobody else moved
    moved = sorted(n for n, h in before.items() if h == 1)
    assert moved and all(after[n] in (0, 2) for n in moved)
    totals = host_loads(after, loads, [0, 2])
    assert abs(totals[0] - totals[2]) <= 2e6


def test_an_added_source_goes_to_the_least_loaded_host_and_a_removed_one_is_forgotten():
    loads = [load("a", 4), load("b", 1), load("c", 1)]
    before = assign(loads, [0, 1])
    assert before == {"a": 0, "b": 1, "c": 1}
    after = rebalance(before, [*loads, load("new", 3)], [0, 1])
    assert after == {"a": 0, "b": 1, "c": 1, "new": 1}
    assert rebalance(after, [load("a", 4), load("new", 3)], [0, 1]) == {"a": 0, "new": 1}


def test_moves_even_the_loads_only_when_allowed_and_only_while_they_help():
    loads = [load("a", 2), load("b", 2), load("c", 2), load("d", 2)]
    lopsided = {"a": 0, "b": 0, "c": 0, "d": 0}
    assert rebalance(lopsided, loads, [0, 1]) == lopsided  # max_moves=0: no move
    one = rebalance(lopsided, loads, [0, 1], max_moves=1)
    assert sorted(one.values()) == [0, 0, 0, 1]
    even = rebalance(lopsided, loads, [0, 1], max_moves=10)
    assert sorted(even.values()) == [0, 0, 1, 1]  # then no move helps: it stops at two
    # A single heavy source is never bounced between hosts.
    assert rebalance({"big": 0}, [load("big", 9)], [0, 1], max_moves=5) == {"big": 0}


def test_probe_load_reads_a_files_size_and_rate(samples):
    found = probe_load(SourceConfig(name="bikes", uri=str(samples.bikes)))
    assert (found.width, found.height, found.fps) == (640, 272, 25.0)
    paced = probe_load(SourceConfig(name="bikes", uri=str(samples.bikes), pace_fps=5.0))
    assert paced.fps == 5.0 and paced.load == 640 * 272 * 5
    camera = probe_load(SourceConfig(name="cam", uri="rtsp://10.0.0.1/stream"))
    assert (camera.width, camera.height, camera.fps) == (*CAMERA_SIZE, CAMERA_FPS)
