"""The README's "From Python" examples, run as a user would: copied into a script and run
with the bundled configuration (in a scratch folder, so the repository's output/ is left);
the line counter also with the frames it saved, compared with the clip's own."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np

from tests.support import read_frames


def readme_example(repo_root: Path, after: str = "## From Python") -> str:
    text = (repo_root / "README.md").read_text()
    section = text[text.index(after):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_python_example_runs(samples, make_clip, repo_root: Path,
                                        tmp_path: Path) -> None:
    """The bundled configuration's video is the first 40 frames of bikes.mp4 here (each
    frame runs the CPU detector); its model is the sample model."""
    (tmp_path / "configs").mkdir()
    shutil.copy(repo_root / "configs" / "file.yaml", tmp_path / "configs" / "file.yaml")
    (tmp_path / "assets" / "video").mkdir(parents=True)
    (tmp_path / "assets" / "models").symlink_to(samples.model.parent)
    (tmp_path / "assets" / "video" / "bikes.mp4").symlink_to(
        make_clip("bikes", 40, (640, 272)))
    (tmp_path / "example.py").write_text(readme_example(repo_root))
    result = subprocess.run(
        [sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True,
        timeout=600, env={**os.environ, "PYTHONPATH": str(repo_root)})
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert sum(line.startswith("bikes ") for line in lines) == 40, result.stdout[-2000:]
    assert any(line.startswith("40 frames RunSummary(frames={'bikes': 40}") for line in lines)
    # The pipeline's log lines go to stderr, as with run.py, never among the script's output.
    assert "output written" not in result.stdout and "output written" in result.stderr
    assert (tmp_path / "output" / "bikes.jsonl").exists()


def test_the_readme_line_counter_prints_crossings_and_counts_and_saves_frames(
        samples, make_clip, repo_root: Path, tmp_path: Path) -> None:
    """The line counter on the first 50 frames of bikes.mp4 (tracked, CPU): a person
    crosses the middle line at frame 36; the frame it saved is that frame of the clip."""
    (tmp_path / "assets" / "video").mkdir(parents=True)
    (tmp_path / "assets" / "models").symlink_to(samples.model.parent)
    clip = make_clip("bikes", 50, (640, 272))
    (tmp_path / "assets" / "video" / "bikes.mp4").symlink_to(clip)
    (tmp_path / "example.py").write_text(
        readme_example(repo_root, "**A line counter, with the frames.**"))
    result = subprocess.run(
        [sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True,
        timeout=600, env={**os.environ, "PYTHONPATH": str(repo_root)})
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    crossings = [line.split() for line in lines if not line.startswith("counts ")]
    assert crossings and all(kind in ("cross_in", "cross_out") for _, kind, *_ in crossings), lines
    assert ["36", "cross_out", "person"] in [c[:3] for c in crossings], lines
    out = sum(c[1] == "cross_out" for c in crossings)
    assert lines[-1] == f"counts {{'in': {{'person': 0}}, 'out': {{'person': {out}}}}}", lines
    saved = cv2.imread(str(tmp_path / "cross-36.jpg"))
    decoded = read_frames(clip, 37)[36].to_ndarray(format="bgr24")
    assert saved.shape == decoded.shape == (272, 640, 3)
    # 1.4 here (JPEG); against the next frame 6.4, with R and B swapped 4.9
    assert np.abs(saved.astype(np.int16) - decoded.astype(np.int16)).mean() < 3
