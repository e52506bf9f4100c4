"""pipeline.app.ceilings: decode alone and engine alone on the CPU path, in process and as
the child process ``capacity`` starts."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import yaml

from pipeline.app.ceilings import (
    CpuDecoders,
    DecodeRate,
    clip_batch,
    decode_rate,
    engine_rate,
    measure_at_once,
    split_rates,
)
from pipeline.config import ConfigError, parse_config

PAD = np.float32(114 / 255)


def config_of(samples, clip, **inference) -> dict:
    return {"sources": [{"name": "cam000", "uri": str(clip), "live": True, "pace_fps": 5,
                         "reconnect": False}],
            "model": {"path": str(samples.model), "class_names": str(samples.names)},
            "inference": {"device": "cpu", "batch_size": 3, **inference},
            "output": {"video": None}}


def test_the_batch_is_the_clips_frames_letterboxed_and_repeated(samples):
    images = clip_batch(samples.carphone, 20, 416, 416, np.float16)  # 176x144: pads above
    assert images.shape == (20, 3, 416, 416) and images.dtype == np.float16
    assert np.all(images[:, :, 0, :] == np.float16(PAD))  # the letterbox's top rows
    assert 0.0 <= float(images.min()) and float(images.max()) <= 1.0
    assert np.array_equal(images[16], images[0]) and np.array_equal(images[19], images[3])
    assert not np.array_equal(images[0], images[15])  # 16 distinct frames of a moving clip


def test_engine_alone_runs_the_configured_backend_at_the_batch_size(samples):
    config = parse_config(config_of(samples, samples.bikes))
    rate = engine_rate(config, 0.5, samples.bikes)
    assert (rate.batch, rate.backend, rate.device) == (3, "onnxruntime", "cpu")
    assert rate.images_s > 0 and rate.warmup_s > 0


def test_decode_alone_restarts_a_short_clip_and_decodes_where_the_pipeline_would(samples):
    # carphone has 120 frames: two decoders pass its end many times in the window
    config = parse_config(config_of(samples, samples.carphone))
    rate = decode_rate(config, 2, 1.0)
    assert (rate.mode, rate.decoders) == ("cpu", 2)
    assert rate.fps > 120 and rate.processes >= 1


def test_groups_of_decoders_are_counted_in_the_same_window_each_on_its_own(samples):
    # what decode alone does with NVDEC's and the CPU's decoders on the GPU path; here two
    # groups of CPU decoders stand in for them
    one, two = CpuDecoders(samples.carphone, 1), CpuDecoders(samples.carphone, 2)
    rates = measure_at_once([one, two], 1.0)
    assert len(rates) == 2 and min(rates) > 0, rates
    assert one.cpu_s > 0 and two.cpu_s > 0
    both = DecodeRate(4580.0, 16, "gpu", both_nvdec_fps=4100.0, both_cpu_fps=1700.0)
    assert both.both_fps == 5800.0 and DecodeRate(1.0, 1, "cpu").both_fps is None


def test_cpu_decoders_pinned_to_cores_run_there(samples):
    # what split does with the CPU's decoders (and NVDEC's threads, on the GPU path)
    import os

    core = sorted(os.sched_getaffinity(0))[-1]
    pinned = CpuDecoders(samples.carphone, 1, [core])
    assert pinned._procs[0]._args[-1] == [core]  # its process pins itself to them
    (rate,) = measure_at_once([pinned], 0.5)
    assert rate > 0


def test_split_needs_nvdec(samples):
    config = parse_config(config_of(samples, samples.carphone))
    with pytest.raises(ConfigError, match="^split: sources\\[0\\] is not decoded on NVDEC"):
        split_rates(config, [1], 0.5)


def test_the_child_prints_one_json_line_or_one_error_line(samples, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config_of(samples, samples.bikes)))
    command = [sys.executable, "-m", "pipeline.app.ceilings", "engine", "--config", str(path),
               "--seconds", "0.5"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["backend"] == "onnxruntime"
    bad = config_of(samples, samples.bikes)
    bad["model"]["path"] = str(tmp_path / "missing.onnx")
    path.write_text(yaml.safe_dump(bad))
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith("error: model.path") and len(done.stderr.splitlines()) == 1
