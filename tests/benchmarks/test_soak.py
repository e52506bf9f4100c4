"""benchmarks.soak: its arithmetic, its /proc sampling, and a short real soak."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from benchmarks.soak import (
    Sample,
    host_usage,
    main,
    p99_bound,
    process_tree,
    refit,
    slope_per_hour,
)
from tests.support import require_rtsp_server


def test_slope_is_per_hour():
    times = [0.0, 60.0, 120.0, 180.0]
    assert slope_per_hour(times, [100.0, 100.5, 101.0, 101.5]) == pytest.approx(30.0)
    assert slope_per_hour(times[:2], [1.0, 2.0]) is None


def sample(count: float, buckets: dict[float, float]) -> Sample:
    return Sample(0.0, 0.0, 0, 0, None, 0.0, 0.0, 0.0, count, buckets, 0.0)


def test_p99_is_the_bucket_holding_99_percent_of_the_interval():
    before = sample(100, {0.01: 50, 0.1: 100, float("inf"): 100})
    after = sample(300, {0.01: 50, 0.1: 299, float("inf"): 300})  # 200 more: 199 <= 0.1 s
    assert p99_bound(before, after) == 0.1
    assert p99_bound(after, after) is None


def test_process_tree_and_usage_cover_children():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        tree = process_tree(os.getpid())
        assert os.getpid() in tree and child.pid in tree
        rss, threads, fds = host_usage([os.getpid(), child.pid])
        assert rss > host_usage([os.getpid()])[0] > 0 and threads >= 2 and fds >= 3
    finally:
        child.kill()
        child.wait()


@pytest.mark.slow  # a real RTSP server, runs 24 s
def test_a_short_soak_runs_and_stops_cleanly(tmp_path, capsys):
    require_rtsp_server()
    out = tmp_path / "soak.md"
    # samples every 2 s up to 24 s: three rows once /metrics answers by 20 s (CI's fresh
    # clone, two test files at a time on 2 cores: not yet at 12 s once)
    assert main(["--minutes", "0.4", "--cameras", "1", "--fps", "10", "--interval-s", "2",
                 "--warmup-s", "0", "--out", str(out)]) == 0
    text = out.read_text()
    assert "pipeline exit code after SIGINT: 0" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) >= 3, text
    assert "RSS MB/h +" in text or "RSS MB/h -" in text


def test_refit_reads_a_printed_report():
    report = "\n".join(["| s | RSS MB | threads | fds |", "|---|---|---|---|"] + [
        f"| {t} | {100 + (10 if t >= 300 else 0) + t / 360:.2f} | 29 | 33 | | 9.0 |"
        for t in range(0, 1200, 60)])
    text = refit(report, 300)  # RSS printed to 0.01 MB: the slope to about 0.01 MB/h
    assert text.startswith("Least-squares slopes over the samples after 300 s (300-1140 s, "
                           "15 samples): RSS MB/h +10.0"), text
    assert text.endswith("threads/h +0.00, fds/h +0.00."), text


@pytest.mark.slow  # paced cameras, runs 16 s
def test_a_short_soak_of_a_looped_clip_played_as_cameras(tmp_path, samples):
    """--clip: no RTSP server; the clip (10 s) is looped to outlast the run and played live."""
    out = tmp_path / "soak.md"
    # samples at 4, 8, 12 and 16 s (the first sample past the 15 s ends the run)
    assert main(["--minutes", "0.25", "--cameras", "2", "--fps", "10", "--interval-s", "4",
                 "--warmup-s", "0", "--clip", str(samples.bikes), "--no-video",
                 "--out", str(out)]) == 0
    text = out.read_text()
    assert "2 simulated live cameras (bikes.mp4 looped, played at 10 fps)" in text
    assert "pipeline exit code after SIGINT: 0" in text
    rows = [line.split("|") for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) >= 3, text
    fps = [float(row[6]) for row in rows[1:] if row[6].strip()]
    assert fps and min(fps) > 0, text  # frames flow all along (how many: the CPU decides)
