"""pipeline.app.output_lock: one run at a time in each folder a run writes in, through
run.py and through the Python API (a real flock: a lock is per open descriptor, so a second
one in this process is refused as another process would be)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from pipeline.app.cli import main
from pipeline.app.output_lock import lock_folder, lock_holder, lock_outputs, output_folders
from pipeline.config import ConfigError, parse_config


def bikes_config(samples, out: str, **output) -> dict:
    return {"sources": [{"name": "bikes", "uri": str(samples.bikes)}],
            "model": {"path": str(samples.model), "class_names": str(samples.names)},
            "output": {"dir": out, **output}}


def by(pid: int) -> str:
    return f"another run (pid {pid})" if Path("/proc/locks").exists() else "another run"


def test_a_second_run_into_an_output_folder_in_use_is_refused(samples, tmp_path: Path,
                                                              monkeypatch, capsys) -> None:
    """Two runs into one folder (a new user's two terminals): the second took the first's
    .partial files, still being written, for files cut short and resumed them (frames twice,
    a torn line). Now the folder is locked (flock on it: no file is added) for a run's life."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(bikes_config(samples, "out")))
    (tmp_path / "out").mkdir()
    held = lock_folder(tmp_path / "out")  # the first run
    try:
        assert main(["--config", "c.yaml"]) == 2
        error = capsys.readouterr().err.strip()
        assert error == (f"error: output.dir: 'out' is in use by {by(os.getpid())}: "
                         "wait for it to end, or give this run another output.dir")
        assert list((tmp_path / "out").iterdir()) == []  # nothing of the refused run
    finally:
        os.close(held)
    monkeypatch.setattr("pipeline.app.cli.run", lambda *args, **kwargs: 0)
    assert main(["--config", "c.yaml"]) == 0  # free again once the first has ended
    os.close(lock_folder(tmp_path / "out"))  # and this one's run let it go


def test_a_folder_a_run_s_output_names_use_is_held_too(samples, tmp_path: Path) -> None:
    """A new user's first run wrote into out/sub (output names "sub/{source}.jsonl") while a
    second had output.dir out/sub: the second resumed the first's live records. Each run now
    holds every folder its outputs land in, made when missing."""
    nested = parse_config(bikes_config(samples, str(tmp_path / "out"),
                                       jsonl="sub/{source}.jsonl", video="sub/{source}.mp4"))
    assert output_folders(nested) == [tmp_path / "out", tmp_path / "out" / "sub"]
    inner = parse_config(bikes_config(samples, str(tmp_path / "out" / "sub")))
    first = lock_outputs(nested)
    try:
        assert first.made == [tmp_path / "out" / "sub", tmp_path / "out"]
        with pytest.raises(ConfigError) as info:
            lock_outputs(inner)
        assert str(info.value).startswith(f"output.dir: {str(tmp_path / 'out' / 'sub')!r} is "
                                          f"in use by {by(os.getpid())}")
    finally:
        first.release()
    second = lock_outputs(inner)  # the other way round
    try:
        with pytest.raises(ConfigError) as info:
            lock_outputs(nested)
        assert str(info.value).startswith(
            f"output (a folder this run writes in): {str(tmp_path / 'out' / 'sub')!r} is in "
            "use by")
    finally:
        second.release()
    lock_outputs(nested).release()  # every folder let go when refused


def test_the_python_api_holds_its_output_folder(samples, tmp_path: Path) -> None:
    """A script's Pipeline wrote into a folder run.py was writing in (332 lines for 250
    frames, run.py exiting 0): the API takes the same hold, refused as run.py is."""
    from pipeline.app.api import Pipeline

    config = parse_config(bikes_config(samples, str(tmp_path / "out"), video=None))
    (tmp_path / "out").mkdir()
    held = lock_folder(tmp_path / "out")
    try:
        with pytest.raises(ConfigError, match="is in use by another run"):
            Pipeline(config).run()
    finally:
        os.close(held)
    summary = Pipeline(config).run()  # free: it runs, then lets the folder go
    assert summary.frames["bikes"] == 250
    os.close(lock_folder(tmp_path / "out"))


def test_the_lock_s_holder_is_read_from_proc_locks(tmp_path: Path) -> None:
    stat = tmp_path.stat()
    device = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}:{stat.st_ino}"
    locks = tmp_path / "locks"
    locks.write_text(f"1: POSIX  ADVISORY  WRITE 11 {device} 0 EOF\n"
                     f"2: FLOCK  ADVISORY  WRITE 4321 {device} 0 EOF\n")
    assert lock_holder(tmp_path, str(locks)) == 4321
    locks.write_text("2: FLOCK  ADVISORY  WRITE 4321 00:00:1 0 EOF\n")
    assert lock_holder(tmp_path, str(locks)) is None
    assert lock_holder(tmp_path, str(tmp_path / "absent")) is None
