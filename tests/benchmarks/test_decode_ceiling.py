"""benchmarks.decode_ceiling: both decode measurements side by side on a real clip."""

from __future__ import annotations

import re

from benchmarks.decode_ceiling import main
from pipeline.app.clips import make_looped_clip


def test_prints_isolated_and_pool_rates(samples, tmp_path, capsys):
    clip = make_looped_clip(samples.bikes, tmp_path / "bikes_x40.mp4", 40)
    assert main(["--cameras", "2", "--seconds", "1", "--clip", str(clip)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 2 |")]
    assert len(rows) == 1, rows
    cells = [cell.strip() for cell in rows[0].strip("|").split("|")]
    isolated, pool = (float(cells[i].replace(",", "")) for i in (2, 3))
    assert isolated > 0 and pool > 0
    # the ratio is of the unrounded rates: the printed, rounded ones give it to about 0.01
    assert abs(float(cells[4]) - pool / isolated) <= 0.011
    assert re.fullmatch(r"\d+\.\d{2}, \d+\.\d{2}", cells[6])
