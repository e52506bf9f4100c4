"""Settings that run on the GPU only (``inference.device: cuda``, ``inference.backend: torch``
or ``tensorrt``, a source's ``decode: gpu``, a list of ``runtime.gpus``), given on a machine
with no usable GPU, through the command line as users run it: the run stops before anything
starts, exit status 2, one ``error: ...`` line that names the key and says why there is no
GPU, and no other line (no source placed, no ``pipeline failed``, no summary), with any
number of workers.

Skipped where a GPU is usable (the settings run there)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.app.supervisor import gpu_probe
from tests.e2e.conftest import pipeline_config

USAGE = 2


@pytest.fixture(scope="module")
def no_gpu_reason() -> str:
    """Why this machine has no usable GPU, as the run's probe says (skips where it has one)."""
    count, reason = gpu_probe()
    if count > 0:
        pytest.skip("a GPU is usable here: these settings run")
    return reason


def run_cli(repo_root: Path, samples, tmp_path: Path, *settings: str,
            **sections: dict) -> subprocess.CompletedProcess:
    """``python run.py --config c.yaml --set ...`` on one file source, device and backend left
    at auto (``sections`` override the config's keys)."""
    out = tmp_path / "out"
    config = pipeline_config(samples, out, [{"name": "bikes", "uri": str(samples.bikes)}],
                             inference={"device": "auto", "backend": "auto"},
                             runtime={"log_format": "console", "progress": False}, **sections)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    args = [arg for setting in settings for arg in ("--set", setting)]
    return subprocess.run([sys.executable, "run.py", "--config", str(path), *args],
                          cwd=repo_root, capture_output=True, text=True, timeout=120)


def assert_one_error_line(result: subprocess.CompletedProcess, tmp_path: Path,
                          starts: str) -> str:
    assert result.returncode == USAGE, result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr  # no log line before or after it
    assert lines[0].startswith(f"error: {starts}"), lines[0]
    assert "pipeline failed" not in result.stderr
    assert not list(tmp_path.glob("out/*")), "nothing is written"
    return lines[0]


@pytest.mark.parametrize(("settings", "starts", "instead"), [
    (["inference.device=cuda"], "inference.device: 'cuda': no usable GPU here (",
     "leave it at auto or set cpu"),
    (["inference.backend=torch"],
     "inference.backend: 'torch' runs on the GPU only: no usable GPU here (",
     "leave it at auto or set onnxruntime"),
    (["inference.backend=tensorrt"],
     "inference.backend: 'tensorrt' runs on the GPU only: no usable GPU here (",
     "leave it at auto or set onnxruntime"),
    (["sources[0].decode=gpu"],
     "sources[0].decode: 'gpu' decodes on the GPU (NVDEC): no usable GPU here (",
     "leave it at auto or set cpu"),
    (["inference.device=cuda", "runtime.workers=2"],  # source workers and an engine process
     "inference.device: 'cuda': no usable GPU here (", "leave it at auto or set cpu"),
    # a list of GPUs once ran on the CPU, its engine said to be on device 0 (a new user)
    (["runtime.gpus=[0,1]"], "runtime.gpus: [0, 1] places an engine on each: no usable GPU "
     "here (", "leave runtime.gpus out to run on the CPU"),
], ids=["device-cuda", "backend-torch", "backend-tensorrt", "decode-gpu", "device-cuda-2-workers",
        "gpus-list"])
def test_a_gpu_only_setting_without_a_gpu_is_one_line_before_anything_starts(
        repo_root, samples, tmp_path, no_gpu_reason, settings, starts, instead):
    result = run_cli(repo_root, samples, tmp_path, *settings)
    line = assert_one_error_line(result, tmp_path, starts)
    # the true reason, as the probe gives it, and what to set instead
    assert line == f"error: {starts}{no_gpu_reason}): {instead}"


@pytest.mark.parametrize(("settings", "line"), [
    (["inference.device=cpu", "inference.backend=torch"],
     "error: inference.backend: 'torch' runs on the GPU only, and inference.device is cpu: "
     "leave it at auto or set onnxruntime"),
    (["inference.device=cpu", "sources[0].decode=gpu"],
     "error: sources[0].decode: 'gpu' decodes on the GPU (NVDEC), and inference.device is "
     "cpu: leave it at auto or set cpu"),
], ids=["backend-torch", "decode-gpu"])
def test_a_gpu_only_setting_with_device_cpu_is_one_line_on_any_machine(
        repo_root, samples, tmp_path, settings, line):
    result = run_cli(repo_root, samples, tmp_path, *settings)
    assert assert_one_error_line(result, tmp_path, "") == line


def test_the_reason_says_there_is_no_gpu_not_only_a_missing_package(no_gpu_reason):
    # a machine with neither a driver nor CuPy (this CI) is told both, the driver first
    import ctypes.util

    if ctypes.util.find_library("cuda") is None:
        assert no_gpu_reason.startswith("no NVIDIA driver: libcuda.so.1 not found; ")
