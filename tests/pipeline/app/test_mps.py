"""runtime.cuda_mps's daemon (pipeline.app.mps: ``CudaMps``, and ``start_for_run``, which
reads the setting) with a FAKE nvidia-cuda-mps-control: the real one needs an NVIDIA driver
and GPU, which CI has not (the H200 runs the real one through run.py's capacity command). The
fake records what it is asked and answers as the real one does: -d starts (exit 0) or fails
with a message; on standard input, get_server_list prints server pids, quit ends."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from pipeline.app.mps import LOG_VARIABLE, PIPE_VARIABLE, CudaMps, start_for_run
from pipeline.config import ConfigError

FAKE = """#!{python}
import os, sys
calls = os.path.join({folder!r}, "calls")
with open(calls, "a") as out:
    if sys.argv[1:] == ["-d"]:
        out.write("start " + os.environ["CUDA_MPS_PIPE_DIRECTORY"] + "\\n")
        if {fail!r}:
            print("An instance of this daemon is already running", file=sys.stderr)
            sys.exit(1)
        sys.exit(0)
    command = sys.stdin.read().strip()
    out.write(command + " " + os.environ["CUDA_MPS_PIPE_DIRECTORY"] + "\\n")
    if command == "get_server_list":
        print("4242")
"""


def fake_control(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail: bool = False) -> Path:
    """A fake nvidia-cuda-mps-control first on PATH; returns the file of its calls."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "nvidia-cuda-mps-control"
    script.write_text(FAKE.format(python=sys.executable, folder=str(tmp_path), fail=fail))
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv(PIPE_VARIABLE, raising=False)
    monkeypatch.setenv(LOG_VARIABLE, "/machine/log")  # a value of the machine's, put back
    return tmp_path / "calls"


def test_the_daemon_gets_a_folder_of_its_own_that_spawned_processes_inherit(tmp_path, monkeypatch):
    calls = fake_control(tmp_path, monkeypatch)
    mps = CudaMps.start()
    pipe = os.environ[PIPE_VARIABLE]
    assert Path(pipe).parent == mps.folder and Path(pipe).is_dir()
    assert os.environ[LOG_VARIABLE] == str(mps.folder / "log")
    child = subprocess.run([sys.executable, "-c",
                            f"import os; print(os.environ[{PIPE_VARIABLE!r}])"],
                           capture_output=True, text=True, check=True)
    assert child.stdout.strip() == pipe  # a worker or engine started now connects to it
    assert mps.server_pids() == [4242]
    mps.quit([4242])
    assert calls.read_text().splitlines() == [f"start {pipe}", f"get_server_list {pipe}",
                                              f"quit {pipe}"]
    assert PIPE_VARIABLE not in os.environ and os.environ[LOG_VARIABLE] == "/machine/log"
    assert not mps.folder.exists()


def test_a_daemon_that_fails_to_start_is_a_one_line_error(tmp_path, monkeypatch):
    fake_control(tmp_path, monkeypatch, fail=True)
    folders = set(Path(tempfile.gettempdir()).glob("streamdet-mps-*"))
    with pytest.raises(ConfigError, match=r"^runtime.cuda_mps: nvidia-cuda-mps-control -d "
                       r"failed \(exit status 1\): An instance of this daemon is already "
                       r"running$"):
        CudaMps.start()
    assert PIPE_VARIABLE not in os.environ  # nothing of it is left
    assert set(Path(tempfile.gettempdir()).glob("streamdet-mps-*")) == folders


def test_without_the_control_program_the_error_says_how_to_run(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConfigError, match="nvidia-cuda-mps-control is not on PATH .* set "
                                          "runtime.cuda_mps: false"):
        CudaMps.start()


def test_auto_starts_the_run_s_daemon_on_the_gpu_path_only(tmp_path, monkeypatch):
    calls = fake_control(tmp_path, monkeypatch)
    assert start_for_run("auto", on_gpu=False) is None and not calls.exists()
    mps = start_for_run("auto", on_gpu=True)
    assert mps is not None and os.environ[PIPE_VARIABLE] == str(mps.folder / "pipe")
    mps.quit()
    assert calls.read_text().splitlines()[0] == f"start {mps.folder / 'pipe'}"
    assert start_for_run(False, on_gpu=True) is None


@pytest.mark.parametrize("why", ["missing", "fails", "machine's daemon"])
def test_auto_runs_on_without_a_daemon_and_says_why(tmp_path, monkeypatch, why):
    calls = fake_control(tmp_path, monkeypatch, fail=why == "fails")
    if why == "missing":
        monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    elif why == "machine's daemon":  # its control pipe is there
        (tmp_path / "machine-pipe").mkdir()
        (tmp_path / "machine-pipe" / "control").write_text("")
        monkeypatch.setenv(PIPE_VARIABLE, str(tmp_path / "machine-pipe"))
    with capture_logs() as logs:
        assert start_for_run("auto", on_gpu=True) is None
    said = [(e["log_level"], e["event"]) for e in logs]
    expected = {"missing": ("info", "not on PATH"), "fails": ("warning", "failed to start"),
                "machine's daemon": ("info", "the machine's is running")}[why]
    assert len(said) == 1 and said[0][0] == expected[0] and expected[1] in said[0][1]
    assert calls.exists() == (why == "fails")  # the machine's daemon is not even asked
    assert os.environ.get(PIPE_VARIABLE) == (str(tmp_path / "machine-pipe")
                                             if why == "machine's daemon" else None)


def test_auto_does_not_follow_a_variable_left_from_a_daemon_that_quit(tmp_path, monkeypatch):
    """CUDA_MPS_PIPE_DIRECTORY naming a folder without a control pipe (a daemon started by
    hand, then quit): the run once took it for the machine's daemon and started none."""
    calls = fake_control(tmp_path, monkeypatch)
    (tmp_path / "stale").mkdir()
    monkeypatch.setenv(PIPE_VARIABLE, str(tmp_path / "stale"))
    with capture_logs() as logs:
        mps = start_for_run("auto", on_gpu=True)
    assert mps is not None and os.environ[PIPE_VARIABLE] == str(mps.folder / "pipe")
    assert [e["event"] for e in logs][0].startswith("CUDA_MPS_PIPE_DIRECTORY names no running")
    mps.quit()
    assert calls.read_text().splitlines()[0] == f"start {mps.folder / 'pipe'}"
    assert os.environ[PIPE_VARIABLE] == str(tmp_path / "stale")  # put back as it was


def test_true_needs_the_daemon_and_warns_on_the_cpu_path(tmp_path, monkeypatch):
    fake_control(tmp_path, monkeypatch, fail=True)
    with pytest.raises(ConfigError, match="^runtime.cuda_mps: nvidia-cuda-mps-control -d"):
        start_for_run(True, on_gpu=True)
    with capture_logs() as logs:
        assert start_for_run(True, on_gpu=False) is None
    assert [e["event"] for e in logs] == ["runtime.cuda_mps: the CPU path: no MPS daemon started"]
