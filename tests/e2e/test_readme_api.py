"""The README's "From Python" example, run as a user would: copied into a script and run
with the bundled configuration (in a scratch folder, so the repository's output/ is left)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path


def readme_example(repo_root: Path) -> str:
    text = (repo_root / "README.md").read_text()
    section = text[text.index("## From Python"):]
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
