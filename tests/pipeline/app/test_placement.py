"""pipeline.app.placement: sources shared out over pipelines by load, and placed again after a
change (a source added or removed, a pipeline dead)."""

from __future__ import annotations

import pytest

from pipeline.app.placement import (
    CAMERA_FPS,
    CAMERA_SIZE,
    NVDEC_FILL,
    SourceLoad,
    assign,
    host_loads,
    plan_cpu_decode,
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
    assert not camera.cpu_decode
    assert probe_load(SourceConfig(name="c", uri="rtsp://h/s", decode="cpu")).cpu_decode


def test_cpu_decoded_sources_are_spread_evenly_over_the_workers():
    # Every third source decoded on the CPU: by load and name alone they would all land on
    # one of three workers; placed first, they go one to each.
    loads = [SourceLoad(f"cam{i:02d}", 1920, 1080, 30, cpu_decode=i % 3 == 2) for i in range(9)]
    placed = assign(loads, [0, 1, 2])
    on_cpu = [placed[item.name] for item in loads if item.cpu_decode]
    assert sorted(on_cpu) == [0, 1, 2]
    assert sorted(placed.values()) == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def cameras(count: int, fps: float = 30, **keys) -> tuple[list[SourceConfig], list[SourceLoad]]:
    """``count`` paced 1080p cameras at ``fps`` (``keys``: more of each source's keys)."""
    sources = [SourceConfig(name=f"cam{i:03d}", uri=f"rtsp://h/{i}", pace_fps=fps, **keys)
               for i in range(count)]
    return sources, [SourceLoad(s.name, 1920, 1080, fps, s.decode == "cpu") for s in sources]


def test_paced_cameras_stay_on_nvdec_until_it_is_80_percent_full():
    assert plan_cpu_decode(*cameras(100), nvdec_fps=4500, cpu_fps=1900) == []  # 3,000 < 3,600
    sources, loads = cameras(150)  # 4,500 frames/s: 900 past 80% of NVDEC go to the CPU
    chosen = plan_cpu_decode(sources, loads, nvdec_fps=4500, cpu_fps=1900)
    assert len(chosen) == 30
    on_nvdec = (150 - len(chosen)) * 30
    assert on_nvdec <= NVDEC_FILL * 4500 < on_nvdec + 30
    # evenly spaced in config order: no run of more than 5 NVDEC sources between two CPU ones
    picked = [int(name[3:]) for name in chosen]
    assert max(b - a for a, b in zip(picked, picked[1:])) <= 6
    # and the same on every run
    assert plan_cpu_decode(sources, loads, nvdec_fps=4500, cpu_fps=1900) == chosen


def test_past_both_decoders_cameras_are_shared_in_proportion_to_them():
    chosen = plan_cpu_decode(*cameras(300), nvdec_fps=4000, cpu_fps=2000)  # 9,000 > 6,000
    assert len(chosen) == 100  # a third: 2,000 of 6,000


def test_unpaced_files_are_always_shared_in_proportion_and_pins_are_kept():
    files = [SourceConfig(name=f"f{i}", uri=f"/v/{i}.mp4") for i in range(9)]
    pinned = [SourceConfig(name="g", uri="/v/g.mp4", decode="gpu"),
              SourceConfig(name="c", uri="/v/c.mp4", decode="cpu")]
    sources = [*files, *pinned]
    loads = [SourceLoad(s.name, 1920, 1080, 25) for s in sources]
    chosen = plan_cpu_decode(sources, loads, nvdec_fps=4000, cpu_fps=2000)
    assert len(chosen) == 3 and not {"g", "c"} & set(chosen)
    # a camera pinned to NVDEC counts against its capacity
    cams, cam_loads = cameras(100)
    pin = [SourceConfig(name="big", uri="rtsp://h/big", decode="gpu", pace_fps=60)]
    heavy = [SourceLoad("big", 7680, 4320, 60)]  # 16 x 1080p at 60: 960 frames/s
    # 3,000 + 960 = 3,960: 360 past 3,600, 12 cameras to the CPU
    assert len(plan_cpu_decode(cams + pin, cam_loads + heavy, 4500, 1900)) == 12


@pytest.mark.parametrize("nvdec, cpu", [(0, 1), (1, 0)])
def test_plan_cpu_decode_rejects_a_capacity_that_is_not_positive(nvdec, cpu):
    with pytest.raises(ValueError, match="must be > 0"):
        plan_cpu_decode(*cameras(2), nvdec_fps=nvdec, cpu_fps=cpu)
