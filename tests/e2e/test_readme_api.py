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


def test_the_readme_python_example_runs(samples, repo_root: Path, tmp_path: Path) -> None:
    (tmp_path / "configs").mkdir()
    shutil.copy(repo_root / "configs" / "file.yaml", tmp_path / "configs" / "file.yaml")
    (tmp_path / "assets").symlink_to(samples.bikes.parents[1])
    (tmp_path / "example.py").write_text(readme_example(repo_root))
    result = subprocess.run(
        [sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True,
        timeout=600, env={**os.environ, "PYTHONPATH": str(repo_root)})
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert sum(line.startswith("bikes ") for line in lines) == 250, result.stdout[-2000:]
    assert any(line.startswith("250 frames RunSummary(frames={'bikes': 250}") for line in lines)
    # The pipeline's log lines go to stderr, as with run.py, never among the script's output.
    assert "output written" not in result.stdout and "output written" in result.stderr
    assert (tmp_path / "output" / "bikes.jsonl").exists()
