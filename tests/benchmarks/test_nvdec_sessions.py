import pytest

from benchmarks.nvdec_sessions import Row, deal, main, parse_rows, table


def test_rows_parse_sessions_processes_pace_and_load():
    assert parse_rows("16x1, 150x5@30+load,100x5+load") == [
        Row(16, 1, None, False), Row(150, 5, 30.0, True), Row(100, 5, None, True)]
    assert [r.label for r in parse_rows("150x5@29.97+load,16x1")] == ["150x5@29.97+load", "16x1"]
    assert parse_rows("0x0+load,100x5+load+copy") == [Row(0, 0, None, True),
                                                      Row(100, 5, None, True, True)]
    assert parse_rows("100x5+copy")[0].label == "100x5+copy"


@pytest.mark.parametrize("text", ["16", "16x0", "2x3", "16x1@", "16x1+lod", "", "0x0",
                                  "16x1+copy+load"])
def test_a_bad_row_is_refused(text):
    with pytest.raises(ValueError, match="--rows"):
        parse_rows(text)


def test_sessions_are_dealt_evenly_over_the_processes():
    parts = deal(152, 5)
    assert sorted(n for part in parts for n in part) == list(range(152))
    assert [len(p) for p in parts] == [31, 31, 30, 30, 30]
    assert deal(0, 0) == []


def test_the_table_shows_late_only_for_paced_rows():
    text = table([{"row": "100x5", "fps": 4098.12, "offered": None, "late": None,
                   "gpu": 99.0, "nvdec": 100.0, "cores": 10.96, "load": None},
                  {"row": "150x5@30", "fps": 4400.0, "offered": 4500.0, "late": 0.125,
                   "gpu": None, "nvdec": 95.4, "cores": 8.0, "load": 41.25}])
    assert "| 100x5 | 4,098.1 | - | - | 100% | 99% | 11.0 | - |" in text
    assert "| 150x5@30 | 4,400.0 | 4,500 | 12.5% | 95% | - | 8.0 | 41.2 |" in text


def test_bad_arguments_exit_2_with_one_line(tmp_path, capsys):
    assert main(["--clip", str(tmp_path / "missing.mp4")]) == 2
    assert capsys.readouterr().err.startswith("error: --clip: no file")
    (tmp_path / "c.mp4").write_bytes(b"x")
    assert main(["--clip", str(tmp_path / "c.mp4"), "--rows", "3x4"]) == 2
