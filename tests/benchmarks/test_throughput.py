"""benchmarks.throughput: its small (CPU) mode end to end, as CI runs it, and its parts."""

from __future__ import annotations

import pytest

from benchmarks.throughput import PacedRow, main, paced_verdict, steady_rate


@pytest.mark.parametrize("times, rate", [
    ([0.0, 1.0, 2.0, 3.0, 4.0], 1.0),
    ([4.0, 0.0, 2.0, 1.0, 3.0], 1.0),  # completions from several sinks arrive unordered
    ([float(t) / 100 for t in range(101)], 100.0),
])
def test_steady_rate_leaves_out_the_start(times, rate):
    assert steady_rate(times)[0] == pytest.approx(rate)


def test_steady_rate_counts_every_frame_of_a_batch_part():
    # 10 parts of 8 frames, one every 0.1 s: 80 frames/s; the first 10% (8 frames = the first
    # part) are left out, so the window runs from 0.1 s to 0.9 s and holds 71 intervals.
    times = [i / 10 for i in range(10)]
    rate, start, end = steady_rate(times, [8] * 10)
    assert (start, end) == (pytest.approx(0.1), pytest.approx(0.9))
    assert rate == pytest.approx((80 - 1 - 8) / 0.8)
    assert steady_rate([2.0, 0.0, 1.0], [1, 1, 1])[0] == pytest.approx(1.0)


@pytest.mark.parametrize("times, counts", [([], None), ([1.0], None), ([2.0, 2.0, 2.0], None),
                                           ([1.0], [64]), ([1.0, 2.0], [0, 0])])
def test_too_few_completions_are_an_error(times, counts):
    with pytest.raises(RuntimeError, match="too few completions"):
        steady_rate(times, counts)


def parse(table: str) -> list[list[list[str]]]:
    """The markdown tables of ``table``: rows of cells, header rows left out."""
    tables, current = [], None
    for line in table.splitlines():
        if not line.startswith("|"):
            current = None
            continue
        if current is None:
            current = []
            tables.append(current)
            continue  # the header
        if not line.startswith("|---"):
            current.append([cell.strip() for cell in line.strip("|").split("|")])
    return tables


@pytest.mark.slow  # every benchmark mode on the CPU
def test_small_mode_runs_on_the_cpu_and_writes_its_tables(samples, repo_root, tmp_path, capsys):
    # Both CPU decode modes, the paced run at a rate this (loaded) machine keeps up with.
    out = tmp_path / "table.md"
    assert main(["--small", "--cameras", "2", "--decode", "cpu,cpu-threads", "--seconds", "1",
                 "--paced", "2", "--pace-fps", "1", "--paced-warmup-s", "0.5", "--fresh-cache",
                 "--assets", str(repo_root / "assets"), "--out", str(out)]) == 0
    table = out.read_text()
    assert table in capsys.readouterr().out
    assert "decode workers of the cpu mode: auto (one per source" in table
    pipeline, paced, inference = parse(table)
    # decode, cameras, decode procs (auto on 2 cores: 1 worker process), batch
    assert [row[:4] for row in pipeline] == [["cpu", "2", "1", "4"],
                                             ["cpu-threads", "2", "threads", "4"],
                                             ["naive sequential", "1", "", "1"]]
    for row in pipeline:
        assert "failed" not in row[-1], row[-1]  # no measurement failed
        assert float(row[4].replace(",", "")) > 0  # pipeline fps
        assert float(row[6].replace(",", "")) >= float(row[5].replace(",", ""))  # p99 >= p50
    for row in pipeline[:2]:
        assert float(row[8].replace(",", "")) > 0  # decode alone (workers: the pool's pipes)
        assert row[10] in ("decode", "infer") and float(row[11]) > 0 and float(row[12]) > 0
        # Every stage's work and blocked time, the sinks summed, and the busiest of them.
        stages = [part.split()[0] for part in row[15].split("; ")]
        assert stages == ["batch", "infer", "postprocess", f"sinks({row[1]})"], row[15]
        assert row[13].split()[0] in stages and row[13].endswith("%")
    assert pipeline[0][14] == ""  # a worker process's slot waits are not seen from here
    [row] = paced
    assert row[:4] == ["cpu", "2", "1", "2"] and "failed" not in row[-1], row
    delivered, share, dropped = float(row[4]), float(row[5]), int(row[6])
    assert delivered > 0 and share > 0 and dropped == 0  # 2 frames/s: nothing dropped
    assert float(row[8].replace(",", "")) >= float(row[7].replace(",", ""))  # p99 >= p50
    assert row[13] in ("yes", "no")
    assert [part.split()[0] for part in row[15].split("; ")] == [
        "batch", "infer", "postprocess", "sinks(2)"]
    verdict = [line for line in table.splitlines() if line.startswith("largest camera count")]
    assert len(verdict) == 1
    expected = "2" if row[13] == "yes" else "none of those tried"
    assert verdict[0].startswith(
        f"largest camera count with zero drops and p99 <= 100 ms: {expected} (1 fps, cpu"), verdict
    [[batch, backend, images_s, warmup_s, notes]] = inference
    assert (batch, backend, notes) == ("4", "onnxruntime", "")
    assert float(images_s.replace(",", "")) > 0 and float(warmup_s) >= 0


def test_a_spent_budget_skips_measurements_and_still_prints_the_table(samples, repo_root,
                                                                      tmp_path, capsys):
    assert main(["--small", "--cameras", "1", "--seconds", "1", "--budget-s", "0.001",
                 "--no-naive", "--decode-workers", "0", "--assets",
                 str(repo_root / "assets")]) == 0
    output = capsys.readouterr().out.split("Throughput,")[-1]
    assert "decode workers of the cpu mode: 0 (threads" in output
    pipeline, paced, inference = parse(output)
    assert [row[:4] for row in pipeline] == [["cpu", "1", "threads", "4"]]
    assert "pipeline skipped: time budget spent" in pipeline[0][-1]
    assert paced[0][:3] == ["cpu", "2", "threads"]
    assert paced[0][-1] == "paced skipped: time budget spent"
    assert "zero drops and p99 <= 100 ms: none of those tried (5 fps, cpu decode, tried 2 (not " \
        "measured)" in output
    assert inference[0][-1] == "inference skipped: time budget spent"


@pytest.mark.parametrize("argv, message", [
    (["--decode", "cpu,nvdec"], "--decode: expected some of cpu, cpu-threads, gpu"),
    (["--paced-decode", "threads"], "--paced-decode: expected some of"),
    (["--decode-workers", "-1"], "--decode-workers"),
    (["--decode-workers", "many"], "--decode-workers"),
    (["--paced", "0"], "--paced: camera counts must be >= 1"),
    (["--cameras", "1,x"], "--cameras: expected comma-separated camera counts"),
])
def test_bad_options_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--small", *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_the_verdict_names_the_largest_count_that_kept_up():
    def run(cameras, delivered, dropped, p99):
        row = PacedRow("cpu", cameras, 64, 30.0)
        row.delivered_fps, row.dropped, row.p99_ms = delivered, dropped, p99
        return row

    rows = [run(32, 960, 0, 40.0), run(64, 1915, 0, 99.0), run(100, 3000, 3, 50.0),
            run(128, 3840, 0, 150.0)]
    assert [r.kept_up for r in rows] == [True, True, False, False]
    assert paced_verdict(rows).startswith(
        "largest camera count with zero drops and p99 <= 100 ms: 64 (30 fps, cpu decode, "
        "tried 32,64,100,128;")
    # Falling behind without dropping (a decoder slower than real time) is not keeping up.
    assert not run(32, 900, 0, 40.0).kept_up
    unmeasured = PacedRow("cpu", 32, 64, 30.0)
    assert paced_verdict([rows[2], unmeasured]).startswith(
        "largest camera count with zero drops and p99 <= 100 ms: none of those tried "
        "(30 fps, cpu decode, tried 100,32 (not measured);")
