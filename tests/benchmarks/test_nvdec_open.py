"""benchmarks.nvdec_open: its CPU mode (``--cpu``, as CI runs it) measures each split."""

from __future__ import annotations

import pytest

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


def test_uneven_splits_show_their_threads_and_bad_arguments_are_one_line(samples, capsys):
    assert main(["--clip", str(samples.bikes), "--sources", "3", "--processes", "2",
                 "--cpu"]) == 0
    assert "| 2 x 2-1 |" in capsys.readouterr().out  # 3 sources: 2 in one process, 1 in the other
    for bad in (["--processes", "1,x"], ["--sources", "2", "--processes", "3"],
                ["--clip", "/no/such.mp4"]):
        args = bad if "--clip" in bad else ["--clip", str(samples.bikes), *bad]
        with pytest.raises(SystemExit) as stop:
            main([*args, "--cpu"])
        assert stop.value.code == 2
