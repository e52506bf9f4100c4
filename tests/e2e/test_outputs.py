"""Outputs that survive every failure and say what they hold (issue 23): an older run's file
under the final name is replaced only by the rename at the end, a file source stopped before
its end keeps its ``.partial`` name and the next run resumes it, a clash of paths spelled
differently is a one-line exit 2 before anything is written, and a source removed before
its first frame leaves no file. Each through ``run.py`` or a real graph."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from pipeline.app.build import build_graph
from pipeline.config import ConfigError, parse_config
from tests.e2e.conftest import pipeline_config, records
from tests.support import free_port, read_frames
from tests.support.harness import wait_for
from tests.support.live_view import running

# The resume tests stop a run after its first records and run it again to the end: the
# first 100 frames of bikes.mp4 leave the stop mid-file (at the CPU detector's pace, 90
# frames to go) and the second run less to detect than the whole video.
CLIP_FRAMES = 100
STOPPED = 3  # pipeline.app.run.EXIT_STOPPED
OLDER = "an older run's complete output\n"


def bikes(samples, out: Path, uri: Path | None = None, **output) -> dict:
    """A configuration for source ``bikes``: ``uri``, by default bikes.mp4."""
    return pipeline_config(samples, out, [{"name": "bikes", "uri": str(uri or samples.bikes)}],
                           output=output)


@pytest.fixture(scope="module")
def clip(make_clip) -> Path:
    """The first ``CLIP_FRAMES`` frames of bikes.mp4, at its size."""
    return make_clip("bikes", CLIP_FRAMES, (640, 272))


def test_an_older_output_survives_a_killed_run(samples, tmp_path: Path, run_pipeline) -> None:
    (tmp_path / "bikes.jsonl").write_text(OLDER)
    run = run_pipeline(bikes(samples, tmp_path), tmp_path)
    wait_for(lambda: len(records(tmp_path / "bikes.partial.jsonl")) >= 10, "the first records",
             90, run)
    run.kill()  # SIGKILL: nothing is finalised
    assert (tmp_path / "bikes.jsonl").read_text() == OLDER
    assert len(records(tmp_path / "bikes.partial.jsonl")) >= 10  # its work, beside it


def test_an_older_output_survives_a_failed_source(samples, tmp_path: Path, run_pipeline) -> None:
    (tmp_path / "cam.jsonl").write_text(OLDER)
    camera = {"name": "cam", "uri": f"rtsp://127.0.0.1:{free_port()}/cam", "reconnect": False,
              "open_timeout_s": 2}
    run = run_pipeline(pipeline_config(samples, tmp_path, [camera]), tmp_path)
    assert run.wait(90) == 1, run.stderr()[-3000:]
    assert "Traceback" not in run.stderr()
    assert (tmp_path / "cam.jsonl").read_text() == OLDER
    # Its failure is told once (the source worker's decode and the supervisor each told it).
    (failed,) = run.events("source failed")
    assert failed["source"] == "cam" and failed["reason"].startswith(
        f"cannot open {camera['uri']}"), failed


@pytest.mark.slow  # the detector over a 100-frame video on the CPU, twice
def test_a_stopped_file_stays_partial_and_the_next_run_resumes_it(samples, clip: Path,
                                                                  tmp_path: Path,
                                                                  run_pipeline) -> None:
    config = bikes(samples, tmp_path, clip, video="{source}.mp4")
    config["sources"][0]["tracker"] = "bytetrack"  # its ids go on after the resume
    (tmp_path / "bikes.jsonl").write_text(OLDER)
    run = run_pipeline(config, tmp_path)
    wait_for(lambda: len(cut := records(tmp_path / "bikes.partial.jsonl")) >= 10
             and track_ids(cut), "the first records and a track", 90, run)
    run.signal(signal.SIGINT)
    assert run.wait() == STOPPED, run.stderr()[-3000:]
    cut = records(tmp_path / "bikes.partial.jsonl")
    assert 10 <= len(cut) < CLIP_FRAMES
    assert [r["frame"] for r in cut] == list(range(len(cut)))  # complete line by line
    assert (tmp_path / "bikes.jsonl").read_text() == OLDER  # not replaced by a cut file
    assert {p.name for p in tmp_path.glob("bikes*")} == {
        "bikes.jsonl", "bikes.partial.jsonl", "bikes.partial.mp4"}
    where = f"stopped at frame {len(cut)} of {CLIP_FRAMES}"
    (summary,) = [e for e in run.events("source summary") if e["source"] == "bikes"]
    assert summary["cut_short"] == where
    assert [e["at"] for e in run.events("stopped early: outputs kept as .partial; run the same "
                                        "command again to resume (--restart: start over)")] \
        == [where]
    assert "Traceback" not in run.stderr()

    # a part of an older finished run that was resumed elsewhere: superseded by this one's
    (tmp_path / "bikes.from-90.mp4").write_bytes(b"an older run's part")
    again = run_pipeline(config, tmp_path / "again")  # same config, same outputs
    assert again.wait(120) == 0, again.stderr()[-3000:]
    lines = records(tmp_path / "bikes.jsonl")
    assert [r["frame"] for r in lines] == list(range(CLIP_FRAMES))  # each frame once, in order
    assert not (tmp_path / "bikes.partial.jsonl").exists()
    (resumed,) = again.events("resuming a file cut short after its last record")
    assert resumed["from_frame"] == len(cut)
    # fresh tracks, numbered on after the cut's: an id names one object in the file
    before, after = track_ids(lines[:len(cut)]), track_ids(lines[len(cut):])
    assert before and after and min(after) == max(before) + 1, (before, after)
    # every video part of the finished file has a final name, and together they hold it all
    videos = sorted(p.name for p in tmp_path.glob("bikes*.mp4"))
    assert videos == ["bikes.from-0.mp4", f"bikes.from-{len(cut)}.mp4"]
    assert sum(len(read_frames(tmp_path / name)) for name in videos) == CLIP_FRAMES


def track_ids(lines: list[dict]) -> set[int]:
    """The ids of the confirmed tracks in records ``lines``."""
    return {d["tracker_id"] for line in lines for d in line["detections"]
            if d["tracker_id"] >= 0}


def test_a_cut_file_resumes_after_its_last_record_unless_restart(samples,
                                                                  tmp_path: Path) -> None:
    """The resume point is the frame after the last complete record (a torn line is cut);
    ``--restart`` skips resuming (the sink then starts the ``.partial`` files over)."""
    from pipeline.app.cli import parse_args
    from pipeline.app.run import prepare
    from pipeline.resume import resumed_sources

    (tmp_path / "bikes.partial.jsonl").write_text(
        "".join(f'{{"source":"bikes","frame":{i}}}\n' for i in range(3)) + '{"sou')
    config = parse_config(bikes(samples, tmp_path))
    assert prepare(config, restart=True) == ()
    assert prepare(config) == ("bikes",)
    assert [s.start_frame for s in resumed_sources(config, ["bikes"])] == [3]
    assert parse_args(["--config", "x.yaml", "--restart"]).restart
    assert not parse_args(["--config", "x.yaml"]).restart


def test_records_of_another_file_are_not_resumed(samples, repo_root: Path,
                                                 tmp_path: Path) -> None:
    """A new user resumed a stopped run with another ``uri``: one file then held frames 0-93
    of bikes.mp4 and 94-119 of carphone.mp4, exit 0. The records file carries its source's
    path, size and modification time (an extended attribute) and a resume checks them."""
    from pipeline.resume import ORIGIN_ATTRIBUTE, file_origin, stamp_origin
    from tests.support.ci import skip_unless_ci

    shutil.copy(samples.bikes, tmp_path / "clip.mp4")
    partial = tmp_path / "bikes.partial.jsonl"
    partial.write_text("".join(f'{{"source":"bikes","frame":{i}}}\n' for i in range(94)))
    if not stamp_origin(partial, file_origin(str(tmp_path / "clip.mp4"))):
        skip_unless_ci(f"{tmp_path}'s file system keeps no extended attributes",
                       "resume origin")
    assert prepare_cut(bikes(samples, tmp_path, tmp_path / "clip.mp4")) == ("bikes",)

    done = run_cli(repo_root, bikes(samples, tmp_path, samples.carphone), tmp_path / "cfg")
    assert done.returncode == 2, done.stderr
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith(f"error: output.jsonl: {str(partial)!r} holds records up to frame "
                            f"93 of {os.path.realpath(tmp_path / 'clip.mp4')!r} (")
    assert f"not of bikes's uri now, {os.path.realpath(samples.carphone)!r}" in error
    assert error.endswith("give that file again; run with --restart to start over")
    assert len(partial.read_text().splitlines()) == 94  # untouched
    assert os.getxattr(partial, ORIGIN_ATTRIBUTE)

    # The same file through a symlink resumes; the same file changed since does not.
    (tmp_path / "link.mp4").symlink_to(tmp_path / "clip.mp4")
    assert prepare_cut(bikes(samples, tmp_path, tmp_path / "link.mp4")) == ("bikes",)
    stat = (tmp_path / "clip.mp4").stat()
    os.utime(tmp_path / "clip.mp4", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.raises(ConfigError) as info:
        prepare_cut(bikes(samples, tmp_path, tmp_path / "clip.mp4"))
    assert str(info.value).startswith(
        f"output.jsonl: {str(partial)!r} holds records up to frame 93 of "
        f"{os.path.realpath(tmp_path / 'clip.mp4')!r} as it was then (")
    assert "and it has changed since (" in str(info.value)


def prepare_cut(config: dict) -> tuple[str, ...]:
    from pipeline.app.run import prepare

    return prepare(parse_config(config))


def test_a_new_records_file_is_stamped_with_its_source_file(samples, tmp_path: Path) -> None:
    """What the check above reads is written by a run's sink, as the run builds it."""
    from pipeline.app.build import build_sink
    from pipeline.resume import file_origin, read_origin
    from tests.support.ci import skip_unless_ci

    config = parse_config(bikes(samples, tmp_path, video=None))
    sink = build_sink(config, config.sources[0], None, None, keep_images=False, tracked=False,
                      has_analytics=False, preview=None)
    sink.open()
    try:
        stamped = read_origin(tmp_path / "bikes.partial.jsonl")
    finally:
        sink.close()
    if stamped is None:
        skip_unless_ci(f"{tmp_path}'s file system keeps no extended attributes",
                       "resume origin")
    assert stamped == file_origin(str(samples.bikes))


def run_cli(repo_root: Path, config: dict, out: Path) -> subprocess.CompletedProcess:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return subprocess.run([sys.executable, "run.py", "--config", str(path), "--no-progress"],
                          cwd=repo_root, capture_output=True, text=True, timeout=120)


@pytest.fixture()
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A folder on a 300 KiB tmpfs of its own (a disk that fills up; mounting needs root, as
    CI has), unmounted afterwards."""
    from tests.support.ci import skip_unless_ci

    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        skip_unless_ci(f"cannot mount a tmpfs: {mounted.stderr.strip()}", "full-disk")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_full_disk_fails_its_source_with_its_own_error(samples, small_disk: Path,
                                                          repo_root: Path) -> None:
    """The sink's writes fail mid-run (no space left): the source fails with that error and
    its outputs stay partial; it is not placed again on the failed pipeline (a new user's
    full disk once read "source name 'bikes' is in use in this run")."""
    import json

    path = small_disk.parent / "config.yaml"
    path.write_text(yaml.safe_dump(bikes(samples, small_disk, video="{source}.mp4")))
    result = subprocess.run([sys.executable, "run.py", "--config", str(path), "--no-progress",
                             "--log-format", "json"], cwd=repo_root, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.splitlines()[-1].startswith(
        "error: sink:bikes: OSError: [Errno 28] No space left on device"), result.stderr[-3000:]
    events = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    (summary,) = [e for e in events if e["event"] == "source summary"]
    assert summary["error"].startswith("pipeline failed: sink:bikes: OSError: [Errno 28] "
                                       "No space left on device"), summary
    assert 0 < summary["frames"] < 250, summary  # it filled up mid-run
    assert summary["frames"] == len(records(small_disk / "bikes.partial.jsonl")), summary
    assert [e["source"] for e in events if e["event"] == "source placed"] == ["bikes"]
    assert {p.name for p in small_disk.iterdir()} == {"bikes.partial.mp4", "bikes.partial.jsonl"}


# A child's sitecustomize: from its first video file on, no file the process writes grows past
# 100,000 bytes (RLIMIT_FSIZE; set then, not at start: the frame ring's shared memory is a
# file too). The write that would fails with EFBIG ('File too large'; Python ignores the
# SIGXFSZ that comes with it), in libav's muxer as a full disk's does, and again as the
# video is closed: a full disk, for the video only (bikes.mp4's passes it mid-run, its
# records never do), without root.
VIDEO_FILLS_THE_DISK = """
import resource

from stages import sinks

_open = sinks.VideoWriter._open


def _open_on_a_full_disk(self, *args):
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
    _open(self, *args)


sinks.VideoWriter._open = _open_on_a_full_disk
"""


def test_a_failed_video_write_leaves_records_that_the_summary_counts(
        samples, tmp_path: Path, repo_root: Path) -> None:
    """The video's write fails mid-run (a full disk: ``VIDEO_FILLS_THE_DISK``). A part's
    records are written before its video, so the records file holds the frames of the part
    whose video failed: the source summary once said ``frames=136`` beside ``output
    incomplete ... frames=138`` for that file (two counts of one source that disagreed).
    Both say the records it kept, the frames a rerun resumes after."""
    import json

    (tmp_path / "fault").mkdir()
    (tmp_path / "fault" / "sitecustomize.py").write_text(VIDEO_FILLS_THE_DISK)
    out = tmp_path / "out"
    path = write(tmp_path, bikes(samples, out, video="{source}.mp4"))
    result = subprocess.run(
        [sys.executable, "run.py", "--config", str(path), "--no-progress", "--log-format",
         "json"], cwd=repo_root, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(
            filter(None, [str(tmp_path / "fault"), os.environ.get("PYTHONPATH")]))})
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.splitlines()[-1].startswith(
        "error: sink:bikes: OSError: [Errno 27] File too large"), result.stderr[-3000:]
    events = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    (summary,) = [e for e in events if e["event"] == "source summary"]
    kept = records(out / "bikes.partial.jsonl")
    assert [r["frame"] for r in kept] == list(range(len(kept)))
    assert 0 < len(kept) < 250, summary  # it failed mid-run
    incomplete = {e["path"]: e for e in events if e["event"] == "output incomplete"}
    assert incomplete[str(out / "bikes.partial.jsonl")]["frames"] == summary["frames"] \
        == len(kept), (incomplete, summary)
    # The video's close failed too (its last write): it is told, not swallowed.
    video = incomplete[str(out / "bikes.partial.mp4")]
    assert video["error"].startswith("closing it failed: OSError: [Errno 27] File too large"), \
        video
    assert (out / "bikes.partial.mp4").exists()


def test_an_output_spelled_as_an_absolute_path_collides(samples, tmp_path: Path,
                                                        repo_root: Path) -> None:
    """``output.dir`` relative, ``output.video`` the same folder spelled absolute: the video
    would be the records' file."""
    out = tmp_path / "out"
    config = bikes(samples, out, video=str(out / "{source}.jsonl"), jsonl="{source}.jsonl")
    config["output"]["dir"] = "out"  # relative to the working folder, tmp_path
    result = subprocess.run(
        [sys.executable, str(repo_root / "run.py"), "--config", str(write(tmp_path, config)),
         "--no-progress"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith("error: output.jsonl: output.jsonl of source 'bikes' would "
                                    "be 'out/bikes.jsonl', which is also output.video of source "
                                    "'bikes'")
    assert not out.exists()  # nothing written


def write(folder: Path, config: dict) -> Path:
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_an_output_through_a_symlinked_folder_collides(samples, tmp_path: Path,
                                                       repo_root: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "link").symlink_to(out)
    (out / "bikes.jsonl").write_text(OLDER)
    config = bikes(samples, out, video=str(tmp_path / "link" / "{source}.jsonl"))
    result = run_cli(repo_root, config, tmp_path / "cfg")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1
    assert result.stderr.startswith("error: output.jsonl: output.jsonl of source 'bikes' would "
                                    f"be '{out / 'bikes.jsonl'}', which is also output.video "
                                    "of source 'bikes'")
    assert (out / "bikes.jsonl").read_text() == OLDER
    assert {p.name for p in out.iterdir()} == {"bikes.jsonl"}


def test_an_output_over_the_input_collides(samples, tmp_path: Path) -> None:
    """The records written over the video they are read from, reached through a symlinked
    folder (a copy of the sample: never the shared asset)."""
    from pipeline.app.cli import main

    (tmp_path / "real").mkdir()
    video = tmp_path / "real" / "bikes.mp4"
    shutil.copyfile(samples.bikes, video)
    (tmp_path / "media").symlink_to(tmp_path / "real")
    config = pipeline_config(samples, tmp_path, [{"name": "bikes", "uri": str(video)}],
                             output={"jsonl": str(tmp_path / "media" / "{source}.mp4")})
    assert main(["--config", str(write(tmp_path, config))]) == 2
    assert video.read_bytes() == Path(samples.bikes).read_bytes()


@pytest.mark.slow  # paced end to end
def test_a_source_removed_before_its_first_frame_leaves_no_file(samples, tmp_path: Path) -> None:
    """A camera that never connected (a closed port, retrying) removed from a running graph:
    no ``door.jsonl`` of 0 bytes, nothing at all."""
    data = pipeline_config(
        samples, tmp_path,
        [{"name": "street", "uri": str(samples.bikes), "pace_fps": 10},
         {"name": "door", "uri": f"rtsp://127.0.0.1:{free_port()}/door", "open_timeout_s": 1}],
        runtime={"stop_when": "never"})
    graph = build_graph(parse_config(data))
    with running(graph):
        wait_for(lambda: graph.ready.is_set(), "the model", 90)
        time.sleep(0.5)
        graph.remove_source("door")
        wait_for(lambda: graph.source_done("door"), "door's sink to end", 30)
        assert not list(tmp_path.glob("door*"))


@pytest.mark.slow  # paced end to end
def test_with_two_pipelines_a_stopped_file_stays_partial_and_the_next_run_resumes_it(
        samples, clip: Path, tmp_path: Path, run_pipeline) -> None:
    """``runtime.workers: 2``: the same exit 3, ``.partial`` names, and resume."""
    config = bikes(samples, tmp_path, clip)
    config["sources"][0]["pace_fps"] = 25  # a few seconds long: the signal comes mid-file
    config["runtime"] = {**config.get("runtime", {}), "workers": 2}
    run = run_pipeline(config, tmp_path)
    wait_for(lambda: len(records(tmp_path / "bikes.partial.jsonl")) >= 10, "the first records",
             120, run)
    run.signal(signal.SIGINT)
    assert run.wait(120) == STOPPED, run.stderr()[-3000:]
    cut = records(tmp_path / "bikes.partial.jsonl")
    assert 10 <= len(cut) < CLIP_FRAMES and not (tmp_path / "bikes.jsonl").exists()
    assert [e["source"] for e in run.events("stopped early: outputs kept as .partial; run the "
                                            "same command again to resume (--restart: start "
                                            "over)")] == ["bikes"]
    again = run_pipeline(config, tmp_path / "again")  # the same config
    assert again.wait(180) == 0, again.stderr()[-3000:]
    assert [r["frame"] for r in records(tmp_path / "bikes.jsonl")] == list(range(CLIP_FRAMES))
    assert not (tmp_path / "bikes.partial.jsonl").exists()


@pytest.mark.slow  # paced end to end
def test_a_source_added_while_running_and_cut_short_is_not_promised_a_resume(
        samples, tmp_path: Path, run_pipeline) -> None:
    """A rerun of the config resumes its own files only: a file added through the API and
    stopped early is told apart in the warning."""
    import httpx

    port = free_port()
    config = bikes(samples, tmp_path)
    config["sources"][0]["pace_fps"] = 25
    config["runtime"] = {**config.get("runtime", {}), "http": {"port": port}}
    run = run_pipeline(config, tmp_path)
    url = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        try:
            return httpx.get(f"{url}/api/health", timeout=2).json()["status"] != "starting"
        except httpx.HTTPError:
            return False

    wait_for(answers, "the live view", 90, run)
    added = httpx.post(f"{url}/api/sources", timeout=60, json={
        "name": "car", "uri": str(samples.carphone), "pace_fps": 10})
    assert added.status_code == 201, added.text
    wait_for(lambda: len(records(tmp_path / "car.partial.jsonl")) >= 3, "car's records", 60, run)
    run.signal(signal.SIGINT)
    assert run.wait(60) == STOPPED, run.stderr()[-3000:]
    rerun = "stopped early: outputs kept as .partial; run the same command again to resume " \
        "(--restart: start over)"
    added_hint = "stopped early: outputs kept as .partial (a source added while running: add " \
        "it to the config file to resume it)"
    assert [e["source"] for e in run.events(rerun)] == ["bikes"]
    assert [e["source"] for e in run.events(added_hint)] == ["car"]


def test_a_resumed_file_says_which_frames_have_no_video_and_sets_an_older_video_aside(
        samples, clip: Path, tmp_path: Path, run_pipeline) -> None:
    """What a killed run leaves (records of frames 0-69, an MP4 killed before its first
    fragment) beside a complete older run's ``bikes.mp4``, then resumed to the end: the
    warning names frames 0-69 and the older video, moved to ``bikes.older.mp4``; a new user
    once found that video beside the new records, and no word of the frames without video."""
    import json

    cut = 70
    (tmp_path / "bikes.mp4").write_text(OLDER)
    (tmp_path / "bikes.partial.jsonl").write_text("".join(
        json.dumps({"source": "bikes", "frame": i, "pts": i / 25, "capture_time": 1.0 + i,
                    "detections": []}) + "\n" for i in range(cut)))
    (tmp_path / "bikes.partial.mp4").write_bytes(b"")  # killed before its first fragment
    run = run_pipeline(bikes(samples, tmp_path, clip, video="{source}.mp4"), tmp_path / "run")
    assert run.wait(120) == 0, run.stderr()[-3000:]
    assert {p.name for p in tmp_path.glob("bikes*")} == {
        "bikes.jsonl", f"bikes.from-{cut}.mp4", "bikes.older.mp4"}
    assert (tmp_path / "bikes.older.mp4").read_text() == OLDER
    assert [r["frame"] for r in records(tmp_path / "bikes.jsonl")] == list(range(CLIP_FRAMES))
    (warning,) = [e for e in map(json.loads, (line for line in run.stderr().splitlines()
                                              if line.startswith("{")))
                  if e.get("frames_without_video") is not None]
    assert warning["level"] == "warning" and warning["frames_without_video"] == f"0-{cut - 1}"
    assert warning["earlier_video"] == str(tmp_path / "bikes.older.mp4")
    assert f"frames 0-{cut - 1} have records but no video" in warning["event"]
