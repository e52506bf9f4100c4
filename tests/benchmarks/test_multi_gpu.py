"""benchmarks.multi_gpu: its small (CPU) mode end to end, as CI runs it, and its verdict."""

from __future__ import annotations

import pytest

from benchmarks.multi_gpu import Row, main, markdown


def test_paced_verdict_names_the_largest_count_held_per_gpu_count():
    rows = [Row(1, 16, True, offered=480, fps=478, dropped=0),
            Row(1, 32, True, offered=960, fps=920, dropped=158),
            Row(2, 32, True, offered=960, fps=955, dropped=0),
            Row(2, 64, True, offered=1920, fps=1800, dropped=0)]  # < 95% delivered: not held
    assert [r.held for r in rows] == [True, False, True, False]
    table = markdown(rows, "header", 30)
    assert table.splitlines()[-1] == "Largest paced count held: 1 GPU(s): 16, 2 GPU(s): 32 (2.00x)"


@pytest.mark.slow
def test_small_mode_runs_one_and_two_pipelines_and_prints_the_table(tmp_path, capsys):
    out = tmp_path / "multi.md"
    assert main(["--small", "--gpus", "1,2", "--cameras", "2", "--paced", "none",
                 "--seconds", "2.5", "--warmup-s", "0", "--out", str(out)]) == 0
    table = out.read_text()
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| 1 |")
            or line.startswith("| 2 |")]
    assert [row[0] for row in rows] == ["| 1", "| 2"]
    assert all(float(row[2].replace(",", "")) > 0 for row in rows), table  # frames/s measured
    assert "failed" not in table and table in capsys.readouterr().out
