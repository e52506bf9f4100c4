"""What a resume checks and tells, through ``run.py`` on the sample clip: records made with
another model or other detection settings are not continued (exit 2, naming the setting),
records stamped without them resume with one warning, and a resume that writes no video
(``output.video: null``) keeps the earlier run's video as it was and says so at its start.

One run is stopped (Ctrl-C) after its first records, once for the module; each test works on
a copy of what it left (``shutil.copytree`` keeps the extended attributes it stamped)."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from pipeline.app.run import prepare
from pipeline.config import parse_config
from pipeline.resume import SETTINGS_ATTRIBUTE, stamp_origin
from tests.e2e.conftest import Run, pipeline_config, records
from tests.e2e.test_outputs import run_cli
from tests.support.ci import skip_unless_ci
from tests.support.harness import wait_for

CLIP_FRAMES = 100  # bikes.mp4's first frames: a stop after the first records is mid-file
STOPPED = 3  # pipeline.app.run.EXIT_STOPPED
UNCHECKED = "resuming records whose model and detection settings could not be checked"
EARLIER_VIDEO = ("an earlier run's video of this file is kept as it was and not continued: "
                 "output.video is null, so this run writes no video")


@pytest.fixture(scope="module")
def clip(make_clip) -> Path:
    return make_clip("bikes", CLIP_FRAMES, (640, 272))


def bikes(samples, out: Path, clip: Path, video: str | None = "{source}.mp4",
          model: Path | None = None, **nms: float) -> dict:
    """Source ``bikes`` (``clip``) on the CPU into ``out``; ``nms``: thresholds changed."""
    config = pipeline_config(samples, out, [{"name": "bikes", "uri": str(clip)}],
                             output={"video": video}, nms=nms)
    if model is not None:
        config["model"]["path"] = str(model)
    return config


@pytest.fixture(scope="module")
def stopped(samples, clip: Path, repo_root: Path, tmp_path_factory) -> Path:
    """The folder of a run stopped by Ctrl-C after bikes's first records: its
    ``bikes.partial.jsonl``, stamped by the run, and ``bikes.partial.mp4``."""
    out = tmp_path_factory.mktemp("stopped")
    run = Run(repo_root, bikes(samples, out, clip), out)
    try:
        wait_for(lambda: len(records(out / "bikes.partial.jsonl")) >= 10, "the first records",
                 90, run)
        run.signal(signal.SIGINT)
        assert run.wait() == STOPPED, run.stderr()[-3000:]
    finally:
        run.kill()
    assert {p.name for p in out.glob("bikes*")} == {"bikes.partial.jsonl", "bikes.partial.mp4"}
    return out


@pytest.fixture()
def copied(stopped: Path, tmp_path: Path) -> Path:
    """A copy of the stopped run's outputs (extended attributes kept), its own per test."""
    out = tmp_path / "out"
    shutil.copytree(stopped, out, ignore=shutil.ignore_patterns("config.yaml", "stderr.log"))
    return out


def keeps_attributes(folder: Path) -> bool:
    """Whether ``folder``'s file system keeps extended attributes (the stamps)."""
    probe = folder / "probe"
    probe.touch()
    try:
        return stamp_origin(probe, {})
    finally:
        probe.unlink()


@pytest.fixture()
def cut(copied: Path) -> Path:
    """``copied``, where the stamps are kept (else a skip: a failure in CI)."""
    if not keeps_attributes(copied):
        skip_unless_ci(f"{copied}'s file system keeps no extended attributes",
                       "resume settings")
    return copied


def test_a_resume_with_other_settings_or_another_model_is_refused(
        samples, clip: Path, cut: Path, repo_root: Path, tmp_path: Path) -> None:
    """A user resumed a stopped run with a higher threshold: the file held records of two
    thresholds. Now exit 2, naming the setting, with the records untouched; the same
    settings resume."""
    partial = cut / "bikes.partial.jsonl"
    before = partial.read_bytes()
    last = records(partial)[-1]["frame"]
    done = run_cli(repo_root, bikes(samples, cut, clip, conf_threshold=0.4), tmp_path / "a")
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: output.jsonl: {str(partial)!r} holds records up to frame {last} made with "
        "other settings (nms.conf_threshold was 0.25, now 0.4): set them back to continue "
        "it; run with --restart to start over")

    model = tmp_path / "other.onnx"
    shutil.copy(samples.model, model)
    done = run_cli(repo_root, bikes(samples, cut, clip, model=model), tmp_path / "b")
    assert done.returncode == 2, done.stderr[-3000:]
    error = done.stderr.strip().splitlines()[-1]
    assert f"made with other settings (model.path was {os.path.realpath(samples.model)!r} (" \
        in error
    assert f"now {str(model)!r} (" in error
    assert error.endswith("set them back to continue it; run with --restart to start over")
    assert partial.read_bytes() == before
    assert {p.name for p in cut.glob("bikes*")} == {"bikes.partial.jsonl", "bikes.partial.mp4"}

    with capture_logs() as logs:  # the settings as they were: resumed, nothing to warn of
        assert prepare(parse_config(bikes(samples, cut, clip))) == ("bikes",)
    assert not [e for e in logs if e["log_level"] == "warning"]


def test_records_stamped_without_settings_resume_with_one_warning(samples, clip: Path,
                                                                  cut: Path) -> None:
    """Records an earlier version wrote carry their source's stamp but no settings: they
    are not refused, and the run says once that it could not check them."""
    partial = cut / "bikes.partial.jsonl"
    os.removexattr(partial, SETTINGS_ATTRIBUTE)
    with capture_logs() as logs:
        assert prepare(parse_config(bikes(samples, cut, clip, conf_threshold=0.4))) == \
            ("bikes",)
    (warning,) = [e for e in logs if e["log_level"] == "warning"]
    assert warning["event"] == (
        f"{UNCHECKED}: they were not stamped on the records (an earlier version wrote them); "
        "if they changed, the file mixes records of both (--restart starts over)")
    assert warning["files"] == [str(partial)]


def test_a_resume_without_video_keeps_the_earlier_video_and_says_so(
        samples, clip: Path, copied: Path, repo_root: Path, tmp_path: Path) -> None:
    """A user resumed a stopped run with ``output.video: null``: its ``bikes.partial.mp4``
    stayed beside the finished records, unmentioned. Now the run warns at its start, naming
    it, and leaves it as it was (the records are resumed and finished as always). The whole
    ``bikes.mp4`` of a complete run before the stopped one, whose records these replace, is
    moved to ``bikes.older.mp4`` as it is when the resume writes video (a new user found it
    beside the new ``bikes.jsonl``)."""
    cut = copied
    video = cut / "bikes.partial.mp4"
    before = video.read_bytes()
    shutil.copyfile(clip, cut / "bikes.mp4")  # the earlier complete run's video
    run = Run(repo_root, bikes(samples, cut, clip, video=None), tmp_path / "again")
    assert run.wait(120) == 0, run.stderr()[-3000:]
    lines = [json.loads(line) for line in run.stderr().splitlines() if line.startswith("{")]
    names = [line["event"] for line in lines]
    (warning,) = [line for line in lines if line["event"] == EARLIER_VIDEO]
    assert warning["source"] == "bikes" and warning["paths"] == [str(video)]
    assert names.index(EARLIER_VIDEO) < names.index("output written")  # at the start
    if keeps_attributes(cut):  # the settings were checked: the same
        assert not [name for name in names if name.startswith(UNCHECKED)]
    assert video.read_bytes() == before
    assert [r["frame"] for r in records(cut / "bikes.jsonl")] == list(range(CLIP_FRAMES))
    assert {p.name for p in cut.glob("bikes*")} == {"bikes.jsonl", "bikes.partial.mp4",
                                                   "bikes.older.mp4"}
    assert (cut / "bikes.older.mp4").read_bytes() == clip.read_bytes()
    (moved,) = [line for line in lines if line["event"].startswith("bikes.mp4 is an earlier")]
    assert moved["earlier_video"] == str(cut / "bikes.older.mp4"), moved
