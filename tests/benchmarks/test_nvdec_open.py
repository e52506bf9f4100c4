"""benchmarks.nvdec_open: its CPU mode (``--cpu``, as CI runs it) measures each split."""

from __future__ import annotations

from benchmarks.nvdec_open import main, measure


def test_every_source_of_a_split_gives_its_first_frame_and_the_first_process_its_sleep(samples):
    one = measure(str(samples.bikes), gpu=False, sources=3, processes=1)
    assert 0.0 < one["min_s"] <= one["median_s"] <= one["max_s"] < 30.0
    assert one["longest_sleep_ms"] is not None and one["longest_sleep_ms"] >= 1.0
    split = measure(str(samples.bikes), gpu=False, sources=3, processes=2)  # 2 + 1 threads
    assert 0.0 < split["min_s"] <= split["max_s"] < 30.0


def test_it_prints_one_row_per_split(samples, capsys):
    assert main(["--clip", str(samples.bikes), "--sources", "2", "--processes", "1,2",
                 "--cpu"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows[1:]] == ["| 1 x 2", "| 2 x 1"], rows
