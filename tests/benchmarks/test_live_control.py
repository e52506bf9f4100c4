"""benchmarks.live_control: its small (CPU) mode end to end through run.py, as CI runs it,
then benchmarks.render_page on what it saved (its numbers are pipeline.app.measurement's,
tested in tests/pipeline/app/test_measurement.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.live_control import Plan, Result, main, markdown, spread
from benchmarks.render_page import answer_for


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


@pytest.mark.parametrize(("gpu", "nvdec", "shown"), [
    (97.0, 81.0, {"GPU utilisation": "97%", "NVDEC utilisation": "81%"}),
    (97.0, None, {"GPU utilisation": "97%", "NVDEC utilisation": "-"}),  # no decoder figure
    (None, None, {}),  # not sampled: no NVML, no nvidia-smi (this machine)
])
def test_the_table_gives_the_gpu_and_its_decoders_utilisation_when_sampled(gpu, nvdec, shown):
    """The window's (GPU %, NVDEC %) as ``UtilisationSampler.mean`` gives them, in the table
    of a full (GPU) run."""
    plan = Plan(False, 100, None, 30.0, 10.0, 30.0, "auto", *[Path("x")] * 6, 1, 2, 420.0)
    result = Result(gpu_util=gpu, nvdec_util=nvdec)
    rows = table_rows(markdown(plan, result, "header"))
    assert {name: cells[0] for name, cells in rows.items() if "utilisation" in name} == shown


def test_a_stage_s_share_is_of_the_time_its_hosts_counters_cover():
    """Each host's counters cover its span (its two metrics reports), not the window."""
    plan = Plan(False, 100, None, 30.0, 10.0, 30.0, "auto", *[Path("x")] * 6, 1, 2, 420.0)
    result = Result(window_s=20.0, spans={"worker0": 19.0, "worker1": 21.0},
                    stages={"sinks": (30.0, 1.0)}, hosts=["worker0", "worker1"],
                    host_cameras={"worker0": 50, "worker1": 50})
    rows = table_rows(markdown(plan, result, "header"))
    assert rows["stage sinks"][1] == ("summed over 2 hosts; 150% of one thread over the 20.0 s "
                                      "its counters cover")
    result.spans = {"worker0": 15.0, "worker1": 15.0}
    assert "200% of one thread over the 15.0 s" in table_rows(
        markdown(plan, result, "header"))["stage sinks"][1]


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
def test_small_mode_adds_and_removes_a_camera_while_two_workers_run(small_run):
    out, status, table = small_run
    rows = table_rows(table)
    assert status == 0, table
    assert rows["offered"][0] == "4.0 fps"  # 2 cameras x 2 fps
    assert float(rows["delivered"][0].split()[0]) > 0, table
    assert rows["dropped"][0].isdigit(), table
    assert rows["p99 latency"][0].startswith(("<=", ">")), table
    assert {name for name in rows if name.startswith("p99 latency ")} == {
        "p99 latency worker0", "p99 latency worker1"}  # one row per source worker
    assert rows["POST /api/sources (added)"][0] == "201", table
    assert float(rows["added: first frame"][0].split()[0]) >= 0, table
    assert rows["DELETE /api/sources/added"][0] == "200", table
    assert "stage remote_infer" in rows and "busiest stage" in rows, table
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


@pytest.mark.parametrize(("workers", "runtime_workers"), [(None, "not set"), (2, 2)])
def test_runtime_workers_is_written_only_when_asked_for(tmp_path, workers, runtime_workers):
    from benchmarks.live_control import Plan

    plan = Plan(False, 3, workers, 30.0, 1.0, 5.0, "auto", tmp_path / "c.mp4",
                tmp_path / "m.onnx", tmp_path / "m.names", tmp_path, tmp_path, tmp_path,
                8080, 9090, 60.0)
    runtime = plan.config()["runtime"]
    assert runtime.get("workers", "not set") == runtime_workers
    assert "pipelines" not in runtime
    assert runtime["http"] == {"port": 8080} and runtime["metrics_port"] == 9090
