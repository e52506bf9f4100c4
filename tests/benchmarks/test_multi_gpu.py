"""benchmarks.multi_gpu: its small (CPU) mode end to end, as CI runs it, and its verdict."""

from __future__ import annotations

import pytest

from benchmarks.multi_gpu import Row, Totals, main, markdown


def test_paced_verdict_names_the_largest_count_held_per_gpu_count():
    rows = [Row(1, 16, True, offered=480, fps=478, dropped=0),
            Row(1, 32, True, offered=960, fps=920, dropped=158),
            Row(2, 32, True, offered=960, fps=955, dropped=0),
            Row(2, 64, True, offered=1920, fps=1800, dropped=0)]  # < 95% delivered: not held
    assert [r.held for r in rows] == [True, False, True, False]
    rows[0].within_100ms, rows[2].within_100ms = 0.995, 0.98  # p99 <= 100 ms: the first only
    table = markdown(rows, "header", 30)
    assert table.splitlines()[-2:] == [
        "Largest paced count held (cpu decode): 1 GPU(s): 16, 2 GPU(s): 32 (2.00x)",
        "Largest held with p99 <= 100 ms (cpu decode): 1 GPU(s): 16, 2 GPU(s): 0"]


def test_layouts_and_the_stage_profile_of_a_window():
    from pipeline.app.cluster_metrics import FamilySnapshot as Family

    def families(frames, work, blocked, sink_work, fast=0):
        stage = (("pipeline", "p"), ("stage", "infer"))
        sink = (("pipeline", "p"), ("stage", "sink:cam1"))
        bucket = "pipeline_frame_latency_seconds_bucket"
        return [Family("pipeline_frame_latency_seconds", "histogram", "",
                       ((bucket, (("source", "cam1"), ("le", "0.05")), fast / 2),
                        (bucket, (("source", "cam1"), ("le", "0.1")), fast),
                        (bucket, (("source", "cam1"), ("le", "+Inf")), frames))),
                Family("pipeline_source_frames", "counter", "",
                       (("pipeline_source_frames_total", (("source", "cam1"),), frames),)),
                Family("pipeline_stage_work_seconds", "counter", "",
                       (("pipeline_stage_work_seconds_total", stage, work),
                        ("pipeline_stage_work_seconds_total", sink, sink_work))),
                Family("pipeline_stage_blocked_seconds", "counter", "",
                       (("pipeline_stage_blocked_seconds_total", stage, blocked),)),
                Family("pipeline_stage_frames", "counter", "",
                       (("pipeline_stage_frames_total", stage, frames),
                        ("pipeline_stage_frames_total", sink, frames)))]

    totals = Totals()
    totals.update("gpu0", families(100, 0.1, 0.0, 0.05))
    start = totals.history["gpu0"][0].time
    totals.update("gpu0", families(1100, 0.6, 0.3, 0.55, fast=990))
    totals.history["gpu0"][1].time = start + 1.0  # one second later
    assert totals.window(start, start + 1.0) == (1000.0, 0)
    assert totals.profile(start, start + 1.0) == (
        "infer 0.50 ms/f, 0.3 s blocked; sinks 0.50 ms/f, 0.0 s blocked; busiest: gpu0 "
        "infer 50%")
    assert totals.within_100ms(start, start + 1.0) == 0.99  # 990 of the window's 1000 frames
    assert [Row(1, 100, False, 3).layout, Row(2, 100, False).layout] == ["1x3", "2"]
    assert Row(1, 100, False, 3).processes == 3


@pytest.mark.slow
def test_small_mode_runs_one_and_two_pipelines_and_prints_the_table(tmp_path, capsys):
    out = tmp_path / "multi.md"
    assert main(["--small", "--gpus", "1,2", "--cameras", "2", "--paced", "none",
                 "--seconds", "2.5", "--warmup-s", "0", "--out", str(out)]) == 0
    table = out.read_text()
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| cpu |")]
    assert [row[1] for row in rows] == ["1", "2"]  # the layouts: 1 and 2 processes
    assert all(float(row[4].replace(",", "")) > 0 for row in rows), table  # frames/s measured
    assert all("ms/f" in row[8] for row in rows), table  # the window's stage profile
    assert "failed" not in table and table in capsys.readouterr().out
