"""Ctrl-C and SIGTERM during a file run: the first drains and closes every output (a file cut
short keeps its ``.partial`` names; a looped file, live, gets its final names), the second
stops at once."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import check_killed_recording, pipeline_config, records
from tests.support import read_frames
from tests.support.harness import wait_for


def start_bikes(samples, tmp_path: Path, run_pipeline, queue_size: int = 4):
    config = pipeline_config(samples, tmp_path, [{"name": "bikes", "uri": str(samples.bikes)}],
                             output={"video": "{source}.mp4"}, runtime={"queue_size": queue_size})
    run = run_pipeline(config, tmp_path)
    wait_for(lambda: len(records(tmp_path / "bikes.partial.jsonl")) >= 10, "the first frames",
             90, run)
    return run


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_first_signal_drains_and_keeps_a_cut_file_partial(samples, tmp_path: Path, run_pipeline,
                                                          signum: int) -> None:
    """Everything read is written and closed (the MP4 plays), but a file stopped before its
    end keeps its ``.partial`` names, and the run exits 3 (stopped early)."""
    run = start_bikes(samples, tmp_path, run_pipeline)
    run.signal(signum)
    assert run.wait() == 3, run.stderr()[-3000:]

    assert {p.name for p in tmp_path.glob("bikes*")} == {"bikes.partial.mp4",
                                                         "bikes.partial.jsonl"}
    lines = records(tmp_path / "bikes.partial.jsonl")
    frames = read_frames(tmp_path / "bikes.partial.mp4")
    assert 10 <= len(lines) < 250
    assert [r["frame"] for r in lines] == list(range(len(lines)))
    assert len(frames) == len(lines)
    assert {(f.width, f.height) for f in frames} == {(640, 272)}
    stopping = run.events("stopping: finishing queued frames (signal again to abort)")
    assert [e["signal"] for e in stopping] == [signal.Signals(signum).name]
    assert "Traceback" not in run.stderr()


def test_second_signal_aborts_at_once_and_leaves_outputs_partial(samples, tmp_path: Path,
                                                                 run_pipeline) -> None:
    run = start_bikes(samples, tmp_path, run_pipeline, queue_size=8)
    run.signal()
    time.sleep(0.05)
    run.signal()
    aborted_at = time.monotonic()
    assert run.wait() == 130, run.stderr()[-3000:]
    assert time.monotonic() - aborted_at < 5
    assert not (tmp_path / "bikes.mp4").exists() and not (tmp_path / "bikes.jsonl").exists()
    assert len(records(tmp_path / "bikes.partial.jsonl")) >= 10
    assert run.events("aborting") and "Traceback" not in run.stderr()
    hint = run.events("aborted: outputs kept as .partial; run the same command again to resume "
                      "(--restart: start over)")
    assert [e["sources"] for e in hint] == [["bikes"]]


@pytest.mark.slow  # the detector over a whole video on the CPU
def test_a_killed_pipeline_leaves_a_file_source_s_video_playable(samples, tmp_path: Path,
                                                                  run_pipeline) -> None:
    """A file source's MP4 is fragmented too (a 2 s keyframe fragment, of video time):
    after ``kill -9`` mid-file, the .partial.mp4 decodes up to its last fragment and each
    decoded frame has its record."""
    config = pipeline_config(samples, tmp_path, [{"name": "bikes", "uri": str(samples.bikes)}],
                             output={"video": "{source}.mp4"})
    run = run_pipeline(config, tmp_path)
    wait_for(lambda: len(records(tmp_path / "bikes.partial.jsonl")) >= 120, "120 frames of the file",
             90, run)
    run.kill()  # SIGKILL: nothing is finalised
    assert not (tmp_path / "bikes.mp4").exists()
    decoded = check_killed_recording(tmp_path / "bikes.partial.mp4",
                                     tmp_path / "bikes.partial.jsonl", 25,
                                     config["inference"]["batch_size"])
    assert 50 <= decoded < 250
    lines = records(tmp_path / "bikes.partial.jsonl")
    assert [r["frame"] for r in lines] == list(range(len(lines)))  # a file drops no frame


def test_a_looped_file_plays_on_past_its_end_until_ctrl_c_then_ends_like_a_camera(
        samples, make_clip, tmp_path: Path, run_pipeline) -> None:
    """``loop: true`` (a simulated camera, decoded in a decode worker process): the records
    go on past the clip's length, frame numbers and pts rising; Ctrl-C stops it, the outputs
    get their final names (a live source has no end to be cut short of) and the run exits 0."""
    clip_frames = 12
    clip = make_clip("bikes", clip_frames, (320, 136))  # 25 fps, played at 40: 0.3 s a pass
    config = pipeline_config(samples, tmp_path, [{"name": "loop", "uri": str(clip), "loop": True,
                                                  "pace_fps": 40}],
                             output={"video": "{source}.mp4"},
                             runtime={"workers": 1, "decode_workers": 1})
    run = run_pipeline(config, tmp_path)
    wait_for(lambda: any(r["frame"] >= 2 * clip_frames + 5
                         for r in records(tmp_path / "loop.partial.jsonl")),
             "a third pass of the looped clip", 90, run)
    run.signal()
    assert run.wait() == 0, run.stderr()[-3000:]

    assert {p.name for p in tmp_path.glob("loop*")} == {"loop.mp4", "loop.jsonl"}
    lines = records(tmp_path / "loop.jsonl")
    frames, pts = [r["frame"] for r in lines], [r["pts"] for r in lines]
    assert frames[0] == 0 and frames[-1] >= 2 * clip_frames + 5
    assert all(b > a for a, b in zip(frames, frames[1:]))  # a live source may drop: gaps
    assert all(b > a for a, b in zip(pts, pts[1:]))
    assert min(p for f, p in zip(frames, pts) if f >= 2 * clip_frames) >= 2 * clip_frames / 25
    assert len(read_frames(tmp_path / "loop.mp4")) == len(lines)
    assert run.events("decode workers started") and "Traceback" not in run.stderr()


def test_a_run_whose_log_reader_goes_away_runs_to_its_end(samples, tmp_path: Path,
                                                          repo_root: Path) -> None:
    """``run.py ... 2>&1 | head -3``: once head exited, every log line failed (a broken pipe),
    a stage's thread died on one and the run hung with nothing written (a new user waited 10
    minutes). Its log lines now go nowhere and the run ends as it would have."""
    import subprocess
    import sys

    import yaml

    config = pipeline_config(samples, tmp_path, [{"name": "bikes", "uri": str(samples.bikes)}],
                             output={"video": "{source}.mp4"})
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    run = subprocess.Popen([sys.executable, "run.py", "--config", str(tmp_path / "c.yaml"),
                            "--no-progress"], cwd=repo_root, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT)
    try:
        for _ in range(3):  # as head -3 reads
            run.stdout.readline()
        run.stdout.close()
        assert run.wait(timeout=180) == 0
    finally:
        run.kill()
    assert len(records(tmp_path / "bikes.jsonl")) == 250
    assert len(read_frames(tmp_path / "bikes.mp4")) == 250
