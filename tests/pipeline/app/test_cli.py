"""pipeline.app.cli's steps before a run starts: the output folder made and written in, and
SIGINT heeded where it came in ignored. (Its messages and exit statuses for bad input, end
to end: tests/e2e/test_bad_inputs.py.)"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from pipeline.app.cli import main, make_output_dir
from pipeline.config import ConfigError


def test_the_output_folder_is_made_with_its_parents_before_the_run(tmp_path: Path) -> None:
    assert make_output_dir(tmp_path / "a" / "b") == [tmp_path / "a" / "b", tmp_path / "a"]
    assert (tmp_path / "a" / "b").is_dir() and not list((tmp_path / "a" / "b").iterdir())
    assert make_output_dir(tmp_path / "a" / "b") == []  # there already
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError) as info:
        make_output_dir(tmp_path / "file" / "out")
    assert str(info.value) == (f"output.dir: cannot create or write in "
                               f"{str(tmp_path / 'file' / 'out')!r}: Not a directory")


def test_a_run_started_with_sigint_ignored_heeds_it(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A script's background job starts with SIGINT ignored (a new user's `kill -INT` did
    nothing to a run starting so); the run turns Python's own handler back on."""
    monkeypatch.chdir(tmp_path)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        assert main(["--config", "absent.yaml"]) == 2
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_run_refused_before_it_begins_leaves_no_output_folder(samples, tmp_path: Path,
                                                                monkeypatch) -> None:
    """A model that is not one is found as the run builds, after the output folder was made:
    the folders made for it go again (a new user found an empty one left)."""
    import yaml

    monkeypatch.chdir(tmp_path)
    (tmp_path / "not.onnx").write_text("not a model")
    config = {"sources": [{"name": "bikes", "uri": str(samples.bikes)}],
              "model": {"path": "not.onnx", "class_names": str(samples.names)},
              "output": {"dir": "out/run1"}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    assert main(["--config", "c.yaml"]) == 2
    assert not (tmp_path / "out").exists()


def test_a_second_run_into_an_output_folder_in_use_is_refused(samples, tmp_path: Path,
                                                              monkeypatch, capsys) -> None:
    """Two runs into one folder (a new user's two terminals): the second took the first's
    .partial files, still being written, for files cut short and resumed them (frames twice,
    a torn line). Now the folder is locked (flock on it: no file is added) for a run's life."""
    import os

    import yaml

    from pipeline.app.cli import lock_output_dir

    monkeypatch.chdir(tmp_path)
    config = {"sources": [{"name": "bikes", "uri": str(samples.bikes)}],
              "model": {"path": str(samples.model), "class_names": str(samples.names)},
              "output": {"dir": "out"}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "out").mkdir()
    held = lock_output_dir(tmp_path / "out")  # the first run (a lock is per open descriptor)
    try:
        assert main(["--config", "c.yaml"]) == 2
        error = capsys.readouterr().err.strip()
        by = f"another run (pid {os.getpid()})" if Path("/proc/locks").exists() else "another run"
        assert error == (f"error: output.dir: 'out' is in use by {by}: "
                         "wait for it to end, or give this run another output.dir")
        assert list((tmp_path / "out").iterdir()) == []  # nothing of the refused run
    finally:
        os.close(held)
    monkeypatch.setattr("pipeline.app.cli.run", lambda *args, **kwargs: 0)
    assert main(["--config", "c.yaml"]) == 0  # free again once the first has ended
    os.close(lock_output_dir(tmp_path / "out"))  # and this one's run let it go


def test_the_lock_s_holder_is_read_from_proc_locks(tmp_path: Path) -> None:
    import os

    from pipeline.app.cli import lock_holder

    stat = tmp_path.stat()
    device = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}:{stat.st_ino}"
    locks = tmp_path / "locks"
    locks.write_text(f"1: POSIX  ADVISORY  WRITE 11 {device} 0 EOF\n"
                     f"2: FLOCK  ADVISORY  WRITE 4321 {device} 0 EOF\n")
    assert lock_holder(tmp_path, str(locks)) == 4321
    locks.write_text("2: FLOCK  ADVISORY  WRITE 4321 00:00:1 0 EOF\n")
    assert lock_holder(tmp_path, str(locks)) is None
    assert lock_holder(tmp_path, str(tmp_path / "absent")) is None


def test_build_engine_without_tensorrt_is_a_usage_error(samples, tmp_path: Path, capsys,
                                                        monkeypatch) -> None:
    """Exit 2 and one line, as a run whose backend this machine lacks (it was exit 1). No
    TensorRT flavour is looked for under these names (one may be installed here)."""
    import functools

    import yaml

    from stages.backends import tensorrt

    monkeypatch.setattr(tensorrt, "import_tensorrt", functools.partial(
        tensorrt.import_tensorrt, ("tensorrt_absent_a", "tensorrt_absent_b")))
    config = {"sources": [{"name": "bikes", "uri": str(samples.bikes)}],
              "model": {"path": str(samples.model), "class_names": str(samples.names)},
              "output": {"dir": str(tmp_path / "out")}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    assert main(["build-engine", "--config", str(tmp_path / "c.yaml")]) == 2
    assert capsys.readouterr().err.startswith("error: TensorRT is not installed (")
