"""benchmarks.live_control: its numbers from hand-made metrics pages, and its small (CPU)
mode end to end through run.py, as CI runs it, then benchmarks.render_page on what it saved."""

from __future__ import annotations

import math
import time

import pytest

from benchmarks.live_control import (
    MetricsPoller,
    Result,
    bucket_text,
    main,
    parse_metrics,
    percentile_bucket,
    spread,
    window_numbers,
)
from benchmarks.render_page import answer_for


def metrics_page(frames: int, fast: int, dropped: int = 0, work: float = 1.0) -> str:
    """A cluster /metrics page: cam0 on host p0 (``fast`` of its ``frames`` within 50 ms,
    the rest within 200 ms), ``added`` on p0 too (ignored), cam1 on p1 (all within 10 ms)."""
    lines = []
    for host, source, count, le in (("p0", "cam0", frames, None), ("p0", "added", 7, None),
                                    ("p1", "cam1", frames, 0.01)):
        lines.append(f'pipeline_source_frames_total{{pipeline="{host}",source="{source}"}} '
                     f'{count}')
        lines.append(f'pipeline_source_dropped_frames_total{{pipeline="{host}",'
                     f'source="{source}"}} {dropped if source == "cam0" else 0}')
        for bound in ("0.01", "0.05", "0.1", "0.2", "+Inf"):
            if le is not None:
                value = count
            else:
                value = fast if float(bound) <= 0.05 else count
                value = 0 if bound == "0.01" else value
            lines.append(f'pipeline_frame_latency_seconds_bucket{{le="{bound}",pipeline='
                         f'"{host}",source="{source}"}} {value}')
    for host in ("p0", "p1"):
        for stage, seconds in (("infer", work), ("sink:cam0", work / 4), ("sink:cam1", work / 4)):
            lines.append(f'pipeline_stage_work_seconds_total{{pipeline="{host}",'
                         f'stage="{stage}"}} {seconds}')
            lines.append(f'pipeline_stage_blocked_seconds_total{{pipeline="{host}",'
                         f'stage="{stage}"}} {seconds / 10}')
    return "\n".join(["# TYPE pipeline_source_frames_total counter", *lines]) + "\n"


@pytest.mark.parametrize(("buckets", "share", "expected"), [
    ({0.05: 0, 0.1: 99, math.inf: 100}, 0.99, (0.05, 0.1)),
    ({0.05: 0, 0.1: 98, math.inf: 100}, 0.99, (0.1, math.inf)),
    ({0.05: 50, 0.1: 100, math.inf: 100}, 0.5, (0.0, 0.05)),
    ({0.05: 0, math.inf: 0}, 0.99, None),
])
def test_a_percentile_is_the_bucket_it_falls_in(buckets, share, expected):
    assert percentile_bucket(buckets, share) == expected


def test_bucket_text_states_the_bounds():
    assert bucket_text((0.05, 0.1)) == "<= 100 ms (50-100)"
    assert bucket_text((30.0, math.inf)) == "> 30000 ms"
    assert bucket_text(None) == "-"


def test_window_numbers_count_the_configured_cameras_per_host_and_in_all():
    poller = MetricsPoller("http://unused")
    start = time.monotonic()
    for at, text in ((start, metrics_page(100, 100)),
                     (start + 2.0, metrics_page(300, 296, dropped=3, work=3.0))):
        for host, sample in parse_metrics(text).items():
            poller.history.setdefault(host, []).append((at, sample))
    result = Result()
    window_numbers(poller, start, start + 2.0, {"cam0", "cam1"}, result)
    assert result.delivered == pytest.approx(200.0)  # (200 + 200) frames in 2 s; added ignored
    assert result.dropped == 3
    # p0: 196 of its 200 frames <= 50 ms (98%), the rest <= 100 ms; p1: all <= 10 ms
    assert result.host_p99 == {"p0": (0.05, 0.1), "p1": (0.0, 0.01)}
    assert result.p99 == (0.01, 0.05)  # 396 of the 400 frames <= 50 ms: 99%
    assert result.stages["infer"] == pytest.approx((4.0, 0.4))  # 2 s of work on each host
    assert result.stages["sinks"] == pytest.approx((2.0, 0.2))
    assert result.busiest == ("p0", "infer", pytest.approx(100.0))
    assert result.host_cameras == {"p0": 1, "p1": 1}


def test_watched_cameras_are_spread_over_the_hosts():
    hosts = {"a": "p0", "b": "p0", "c": "p0", "d": "p1", "e": "p2"}
    assert spread(hosts, list("abcde"), 4) == ["a", "d", "e", "b"]


def test_the_saved_files_answer_the_page_requests(tmp_path):
    (tmp_path / "snapshots").mkdir()
    (tmp_path / "index.html").write_text("<html></html>")
    (tmp_path / "sources.json").write_text('{"sources": []}')
    (tmp_path / "snapshots" / "cam 1.jpg").write_bytes(b"\xff\xd8jpeg")
    assert answer_for(tmp_path, "/")[:2] == (200, "text/html; charset=utf-8")
    assert answer_for(tmp_path, "/api/sources") == (200, "application/json", b'{"sources": []}')
    assert answer_for(tmp_path, "/api/health")[0] == 404  # not saved
    assert answer_for(tmp_path, "/api/sources/cam%201/snapshot.jpg") == (
        200, "image/jpeg", b"\xff\xd8jpeg")
    assert answer_for(tmp_path, "/api/sources/cam%201/stream.mjpg")[0] == 200
    assert answer_for(tmp_path, "/api/sources/cam2/snapshot.jpg")[0] == 404
    assert answer_for(tmp_path, "/api/sources/../x/snapshot.jpg")[0] == 404


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """One ``--small`` run: (its --out folder, its exit status, the table it printed)."""
    out = tmp_path_factory.mktemp("live-control")
    status = main(["--small", "--seconds", "8", "--warmup-s", "1", "--out", str(out)])
    return out, status, (out / "results.md").read_text()


def table_rows(table: str) -> dict[str, list[str]]:
    """measurement -> [value, notes] of the markdown table."""
    rows = {}
    for line in table.splitlines():
        if line.startswith("| ") and not line.startswith(("| measurement", "|---")):
            cells = [cell.strip() for cell in line.strip("|").split(" | ")]
            assert len(cells) == 3, line
            rows[cells[0]] = cells[1:]
    return rows


@pytest.mark.slow
def test_small_mode_adds_and_removes_a_camera_while_two_pipelines_run(small_run):
    out, status, table = small_run
    rows = table_rows(table)
    assert status == 0, table
    assert rows["offered"][0] == "4.0 fps"  # 2 cameras x 2 fps
    assert float(rows["delivered"][0].split()[0]) > 0, table
    assert rows["dropped"][0].isdigit(), table
    assert rows["p99 latency"][0].startswith(("<=", ">")), table
    assert {name for name in rows if name.startswith("p99 latency ")} == {
        "p99 latency pipeline0", "p99 latency pipeline1"}  # one row per host
    assert rows["POST /api/sources (added)"][0] == "201", table
    assert float(rows["added: first frame"][0].split()[0]) >= 0, table
    assert rows["DELETE /api/sources/added"][0] == "200", table
    assert "stage infer" in rows and "busiest stage" in rows, table
    assert rows["exit status after SIGINT"][0] == "0", table
    assert table.splitlines()[-1].startswith("Verdict: "), table
    assert "add ok, remove ok" in table.splitlines()[-1], table
    assert sorted(p.name for p in (out / "snapshots").glob("*.jpg")) == ["cam000.jpg",
                                                                          "cam001.jpg"]
    for name in ("index.html", "sources.json", "health.json", "run.log", "config.yaml"):
        assert (out / name).stat().st_size > 0, name


@pytest.mark.slow
def test_the_saved_page_renders_with_its_pictures(small_run, capsys):
    from benchmarks.render_page import main as render
    from tests.support.browser import require_chromium

    executable = require_chromium()
    out, _, _ = small_run
    png = out / "page.png"
    assert render([str(out), "--png", str(png), "--chromium", executable]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "2 of 2 saved pictures shown" in capsys.readouterr().out
