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


def test_capacity_s_empty_out_is_refused_not_taken_for_the_current_folder(
        samples, tmp_path: Path, monkeypatch, capsys) -> None:
    """``--out "$OUT"`` with OUT unset wrote results.md and a folder per count into the
    current folder (a new user's repository root)."""
    monkeypatch.chdir(tmp_path)
    assert main(["capacity", "--config", "c.yaml", "--clip", str(samples.bikes),
                 "--out", ""]) == 2
    assert capsys.readouterr().err == ("error: --out: an empty path (give a folder, or leave "
                                       "--out out for a new temporary folder)\n")
    assert list(tmp_path.iterdir()) == []


def test_a_run_that_fails_to_start_leaves_no_output_folder(samples, tmp_path: Path,
                                                           monkeypatch, capsys) -> None:
    """The live view's port is taken: exit 1 with its reason, and the output folder made for
    the run goes again (a new user found an empty one left)."""
    import socket

    import yaml

    monkeypatch.chdir(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        config = {"sources": [{"name": "bikes", "uri": str(samples.bikes)}],
                  "model": {"path": str(samples.model), "class_names": str(samples.names)},
                  "output": {"dir": "out/run1"},
                  "runtime": {"http": {"port": taken.getsockname()[1]}, "progress": False}}
        (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
        assert main(["--config", "c.yaml"]) == 1
    assert "error: failed to start: runtime.http: cannot serve on 127.0.0.1:" \
        in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_log_options_reach_the_engine_and_the_source_workers(samples, tmp_path: Path,
                                                                 repo_root: Path) -> None:
    """``--log-format json --log-level info`` over a config's console at debug: every
    process's lines are JSON at info and above (the engine's and two source workers' were
    console lines at the config's level)."""
    import json
    import subprocess
    import sys

    import yaml

    config = {"sources": [{"name": "bikes", "uri": str(samples.bikes)},
                          {"name": "car", "uri": str(samples.carphone)}],
              "model": {"path": str(samples.model), "class_names": str(samples.names)},
              "output": {"dir": str(tmp_path / "out"), "video": None},
              "runtime": {"workers": 2, "log_format": "console", "log_level": "debug"}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    result = subprocess.run([sys.executable, "run.py", "--config", str(tmp_path / "c.yaml"),
                             "--no-progress", "--log-format", "json", "--log-level", "info"],
                            cwd=repo_root, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    not_json = [line for line in result.stderr.splitlines() if not line.startswith("{")]
    assert not_json == [], not_json[:5]
    events = [json.loads(line) for line in result.stderr.splitlines()]
    names = {event["event"] for event in events}
    assert {"engine ready", "output written", "run finished"} <= names, sorted(names)
    assert {event["level"] for event in events} <= {"info", "warning", "error"}
