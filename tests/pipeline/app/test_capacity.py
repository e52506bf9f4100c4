"""pipeline.app.capacity and its report: the search with a fake measurement, the configuration
of a run, and the table's verdict from a window's numbers (the real runs:
tests/e2e/test_capacity.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.app.capacity import estimate, next_count, parse_counts, run_config, search
from pipeline.app.capacity_report import RunRow, held_text, largest_held, table
from pipeline.app.measurement import Window
from pipeline.config import ConfigError, parse_config


def fake_machine(holds_up_to: int) -> tuple[list[int], object]:
    """A measurement that holds up to ``holds_up_to`` cameras, and the counts it was asked."""
    asked: list[int] = []

    def measure(count: int) -> bool:
        asked.append(count)
        return count <= holds_up_to

    return asked, measure


@pytest.mark.parametrize(("holds_up_to", "start", "asked"), [
    (37, 10, [10, 20, 40, 30, 35, 37, 38]),  # double until not held, then bisect
    (37, 50, [50, 25, 37, 43, 40, 38]),  # halve until held, then bisect
    (1, 4, [4, 2, 1]),
    (0, 4, [4, 2, 1]),  # nothing holds: 0
    (64, 64, [64, 128, 96, 80, 72, 68, 66, 65]),
    (5000, 1000, [1000, 2000, 4000, 4096]),  # never past MAX_CAMERAS
])
def test_the_search_doubles_or_halves_then_bisects_to_one_camera(holds_up_to, start, asked):
    seen, measure = fake_machine(holds_up_to)
    tried = search(measure, start)
    assert seen == asked
    assert max((n for n, ok in tried.items() if ok), default=0) == min(holds_up_to, 4096)


def test_a_list_of_counts_is_tried_as_given_and_the_budget_stops_the_search():
    seen, measure = fake_machine(37)
    assert search(measure, 10, counts=[50, 10, 20]) == {50: False, 10: True, 20: True}
    assert seen == [50, 10, 20]
    seen, measure = fake_machine(37)
    assert search(measure, 10, fits=lambda count: len(seen) < 3) == {10: True, 20: True,
                                                                      40: False}


def test_a_count_that_did_not_hold_below_one_that_did_is_not_bisected_again():
    # a noisy machine: 20 did not hold, 30 did; the search goes on above 30 only
    assert next_count({20: False, 30: True}, 10) == 60
    assert next_count({20: False, 30: True, 60: False}, 10) == 45


@pytest.mark.parametrize(("ceilings", "fps", "start"), [
    ({"decode": {"fps": 4580.0}, "engine": {"images_s": 7300.0}}, 30.0, 76),
    ({"engine": {"images_s": 41.0}}, 2.0, 10),
    ({"decode": {"fps": 1.0}}, 30.0, 1),
    ({}, 30.0, 4),
])
def test_the_search_starts_at_half_of_the_slower_ceiling(ceilings, fps, start):
    assert estimate(ceilings, fps) == start


@pytest.mark.parametrize(("text", "counts"), [("50,100,150", [50, 100, 150]), ("2", [2]),
                                              ("1, 2,", [1, 2])])
def test_camera_counts(text, counts):
    assert parse_counts(text) == counts


@pytest.mark.parametrize("text", ["", "a,b", "0,1", "-3", "1.5"])
def test_bad_camera_counts_are_refused(text):
    with pytest.raises(ConfigError, match="--cameras: expected camera counts"):
        parse_counts(text)


def test_a_run_keeps_the_users_settings_and_replaces_sources_outputs_and_endpoints(samples,
                                                                                     tmp_path):
    user = {"sources": [{"name": "door", "uri": "rtsp://cam.invalid/1"}],
            "model": {"path": str(samples.model), "class_names": str(samples.names)},
            "inference": {"device": "cpu", "batch_size": 8, "batch_timeout_ms": 20},
            "output": {"dir": "/data/out", "jsonl": "{source}.jsonl",
                       "mqtt": {"host": "broker.invalid"}},
            "runtime": {"queue_size": 6, "metrics_port": 9090, "metrics_host": "0.0.0.0",
                        "metrics_token": "${TOKEN}", "http": {"host": "0.0.0.0", "port": 80,
                                                              "token": "${TOKEN}"}}}
    data = run_config(user, 3, samples.bikes, 30.0, tmp_path, 12345)
    assert [s["name"] for s in data["sources"]] == ["cam000", "cam001", "cam002"]
    assert data["sources"][0] == {"name": "cam000", "uri": str(samples.bikes), "live": True,
                                  "pace_fps": 30.0, "reconnect": False}
    assert data["inference"] == user["inference"]
    assert data["output"] == {"dir": str(tmp_path), "jsonl": "{source}.jsonl", "video": None}
    runtime = data["runtime"]
    assert (runtime["metrics_port"], runtime["metrics_host"]) == (12345, "127.0.0.1")
    assert "metrics_token" not in runtime and runtime["queue_size"] == 6
    assert runtime["http"]["host"] == "127.0.0.1" and runtime["http"]["port"] not in (80, 12345)
    assert (runtime["progress"], runtime["stop_when"]) == (False, "never")
    assert "pipelines" not in runtime and "workers" not in runtime
    assert user["sources"][0]["name"] == "door"  # the user's dict is left as it was
    runtime.pop("http")  # needs the live extra's token rules; the rest is a valid config
    assert len(parse_config(data).sources) == 3


def test_a_video_the_user_asks_for_is_written():
    data = run_config({"output": {"video": "{source}.mp4"}}, 1, Path("c.mp4"), 5.0,
                      Path("/tmp/r"), 1)
    assert data["output"]["video"] == "{source}.mp4"


def window(dropped: int, p99: tuple[float, float] | None, delivered: float) -> Window:
    return Window(offered=100.0, delivered=delivered, dropped=dropped, p50=(0.02, 0.05),
                  p99=p99, hosts=["pipeline0"], busiest=("pipeline0", "infer", 91.6),
                  stages={"infer": (27.5, 0.3), "batch": (0.1, 20.0)})


def test_the_table_has_a_row_per_count_in_order_with_the_verdict_and_the_bottleneck():
    rows = [RunRow(50, 2.0, window(0, (0.05, 0.1), 99.0)),
            RunRow(20, 5.0, window(3, (0.1, 0.2), 99.0)),
            RunRow(80, 1.25, None, error="run.py exited with 1 before every camera delivered")]
    lines = table(rows).splitlines()
    assert lines[0].startswith("| cameras | offered fps | delivered fps | dropped | p50")
    assert [line.split(" | ")[0] for line in lines[2:]] == ["| 20", "| 50", "| 80"]
    assert lines[3] == ("| 50 | 100.0 | 99.0 | 0 | <= 50 ms | <= 100 ms | yes | infer 92% "
                        "(27.5 s work, 0.3 s blocked) |")
    assert "| no: 3 dropped, p99 <= 200 ms |" in lines[2]
    assert "| no: failed (run.py exited with 1 before every camera delivered) |" in lines[4]
    assert largest_held(rows) == 50


def test_a_run_with_an_error_did_not_hold_whatever_its_numbers():
    row = RunRow(5, 2.0, window(0, (0.05, 0.1), 100.0), error="killed")
    assert not row.held and held_text(row) == "no: failed (killed)"
