"""benchmarks.throughput: its small (CPU) mode end to end, as CI runs it, and its parts."""

from __future__ import annotations

import threading

import pytest

from benchmarks.throughput import LoopingSource, main, steady_rate
from pipeline.config import SourceConfig
from pipeline.records import EndOfStream, Frame
from stages.decode import DecodeStage


@pytest.mark.parametrize("times, rate", [
    ([0.0, 1.0, 2.0, 3.0, 4.0], 1.0),
    ([4.0, 0.0, 2.0, 1.0, 3.0], 1.0),  # completions from several sinks arrive unordered
    ([float(t) / 100 for t in range(101)], 100.0),
])
def test_steady_rate_leaves_out_the_start(times, rate):
    assert steady_rate(times)[0] == pytest.approx(rate)


@pytest.mark.parametrize("times", [[], [1.0], [2.0, 2.0, 2.0]])
def test_too_few_completions_are_an_error(times):
    with pytest.raises(RuntimeError, match="too few completions"):
        steady_rate(times)


def test_a_synthetic_camera_loops_its_clip_until_stopped(samples):
    stop = threading.Event()
    camera = LoopingSource(DecodeStage(SourceConfig(name="car", uri=str(samples.carphone))))
    indices = []
    for item in camera.frames(stop):
        if isinstance(item, Frame):
            indices.append(item.index)
            if item.index == 300:  # the clip has 120 frames
                stop.set()
        else:
            end = item
    assert indices == list(range(301)) and end == EndOfStream("car", 301)


def test_a_synthetic_camera_of_a_missing_file_ends_with_its_error(tmp_path):
    camera = LoopingSource(DecodeStage(SourceConfig(name="gone", uri=str(tmp_path / "x.mp4"))))
    [end] = camera.frames(threading.Event())
    assert end.frames == 0 and "x.mp4" in end.error


def test_small_mode_runs_on_the_cpu_and_writes_one_table(samples, repo_root, tmp_path, capsys):
    out = tmp_path / "table.md"
    assert main(["--small", "--cameras", "1,2", "--seconds", "1",
                 "--assets", str(repo_root / "assets"), "--out", str(out)]) == 0
    table = out.read_text()
    assert table in capsys.readouterr().out
    rows = [[cell.strip() for cell in line.strip("|").split("|")]
            for line in table.splitlines() if line.startswith("| ")][1:]
    assert [row[:3] for row in rows] == [["cpu", "1", "4"], ["cpu", "2", "4"],
                                         ["naive sequential", "1", "1"]]
    for row in rows:
        assert "failed" not in row[-1], row[-1]  # no measurement failed
        assert float(row[3].replace(",", "")) > 0  # pipeline fps
        assert float(row[5].replace(",", "")) >= float(row[4].replace(",", ""))  # p99 >= p50
    for row in rows[:2]:
        assert row[9] in ("decode", "infer") and float(row[10]) > 0 and float(row[11]) > 0
