"""pipeline.app.run: what is settled before the run starts (both decoders for decode: auto,
the warning of files read live without a pace), and what its end says of each source
(``finish``)."""

from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace

from structlog.testing import capture_logs

from pipeline.app.run import (
    EXIT_INTERRUPTED,
    EXIT_STOPPED,
    FILES_ENDED_WITHOUT_FILES,
    UNPACED_FILES,
    check_gpu_settings,
    finish,
    ignore_signals_while_closing,
    place_decoders,
    prepare,
    warn_files_ended_without_files,
    warn_unpaced_files,
)
from pipeline.app.supervisor import SourceRun
from pipeline.config import ConfigError, PipelineConfig, SourceConfig, parse_config


def cameras_config(samples, tmp_path, **sections):
    """Three paced cameras of bikes.mp4 (640x272 at 25 frames/s), ``decode: auto``."""
    data = {"model": {"path": str(samples.model)},
            "sources": [{"name": f"cam{i}", "uri": str(samples.bikes), "live": True,
                         "pace_fps": 25} for i in range(3)],
            "output": {"dir": str(tmp_path), "video": None},
            "runtime": {"nvdec_fps": 1.0, "cpu_decode_fps": 1000.0}}
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    return parse_config(data)


def test_auto_sources_past_nvdecs_capacity_are_decoded_on_the_cpu(samples, tmp_path):
    config = cameras_config(samples, tmp_path)
    asked = []
    place_decoders(config, 1, lambda: asked.append(1) or True)
    # each camera is 25 x 640 x 272 / 1080p = 2.1 frames/s of 1080p; NVDEC takes 0.8
    assert [s.decode for s in config.sources] == ["cpu", "cpu", "cpu"] and asked == [1]
    roomy = cameras_config(samples, tmp_path, runtime={"nvdec_fps": 100.0})
    place_decoders(roomy, 1, lambda: True)
    assert [s.decode for s in roomy.sources] == ["auto"] * 3


def test_decoders_are_left_alone_off_the_gpu_path(samples, tmp_path):
    config = cameras_config(samples, tmp_path)
    place_decoders(config, 1, lambda: False)  # no GPU here
    assert [s.decode for s in config.sources] == ["auto"] * 3
    on_cpu = cameras_config(samples, tmp_path, inference={"device": "cpu"})
    place_decoders(on_cpu, 1, lambda: True)
    assert [s.decode for s in on_cpu.sources] == ["auto"] * 3
    video = cameras_config(samples, tmp_path, output={"video": "{source}.mp4"})
    place_decoders(video, 1, lambda: True)  # frames go to the host for the video anyway
    assert [s.decode for s in video.sources] == ["auto"] * 3
    default = cameras_config(samples, tmp_path, runtime={"cpu_decode_fps": 0.0})
    place_decoders(default, 1, lambda: True)  # the default: NVDEC only
    assert [s.decode for s in default.sources] == ["auto"] * 3


def test_each_source_stopped_early_is_told_what_was_kept_and_what_resumes_it():
    """A config file's source cut short resumes on a rerun; one stopped before its first
    frame wrote nothing (a new user read "outputs kept as .partial" of no file); one added
    under a name used before writes NAME.N.* files, which no rerun resumes."""
    def cut(name: str, frames: int, added: bool = False, number: int | None = None) -> SourceRun:
        return SourceRun(SourceConfig(name=name, uri=f"{name}.mp4"), "sources[0]", added=added,
                         output_number=number, frames=frames, unended="stopped at frame 9")

    runs = [cut("a", 9), cut("b", 0), cut("c", 9, added=True), cut("c", 9, True, 2)]
    supervisor = SimpleNamespace(every_source=lambda: [(run, None) for run in runs],
                                 failure=None)
    with capture_logs() as logs:
        assert finish(supervisor, {}, 1, 1.0) == EXIT_STOPPED
    said = [(e["source"], e["event"]) for e in logs if e["log_level"] == "warning"]
    assert said == [
        ("a", "stopped early: outputs kept as .partial; run the same command again to resume "
              "(--restart: start over)"),
        ("b", "stopped before its first frame: nothing was written"),
        ("c", "stopped early: outputs kept as .partial (a source added while running: add it "
              "to the config file to resume it)"),
        ("c", "stopped early: outputs kept as .partial (c.2.partial.*; a source added while "
              "running under a name used before: no rerun resumes these)")]
    numbers = [e.get("output_number") for e in logs if e["event"] == "source summary"]
    assert numbers == [None, None, None, 2]


def test_a_ctrl_c_before_any_file_wrote_a_frame_is_an_interrupted_run():
    """Stopped while starting (a new user's Ctrl-C 3 s in): no file wrote a frame, so there
    is nothing to resume; the run once exited 3, whose meaning is "outputs are .partial"."""
    runs = [SourceRun(SourceConfig(name=name, uri=f"{name}.mp4"), "sources[0]", frames=0,
                      unended="stopped at frame 0") for name in ("a", "b")]
    supervisor = SimpleNamespace(every_source=lambda: [(run, None) for run in runs],
                                 failure=None)
    with capture_logs() as logs:
        assert finish(supervisor, {}, 1, 1.0) == EXIT_INTERRUPTED
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == [
        "stopped before its first frame: nothing was written"] * 2
    runs[1].frames = 3  # one wrote frames: those resume
    assert finish(supervisor, {}, 1, 1.0) == EXIT_STOPPED


def test_a_signal_once_the_run_has_ended_is_said_and_ignored():
    """A second Ctrl-C just after "run finished" (the processes closing) once made a run
    whose outputs were all final exit 130."""
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        ignore_signals_while_closing()
        with capture_logs() as logs:
            os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt
            os.kill(os.getpid(), signal.SIGTERM)  # and no exit
            time.sleep(0.05)
        assert [(e["event"], e["signal"]) for e in logs] == [
            ("signal ignored: the run has ended; closing its processes", "SIGINT"),
            ("signal ignored: the run has ended; closing its processes", "SIGTERM")]
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


def test_a_file_read_live_without_pace_fps_is_warned_once_at_start(samples, tmp_path):
    """A new user's file with live: true and no pace_fps read as fast as it decoded and
    dropped 218 of 250 frames without a word (only a looped one was warned)."""
    def config(*sources: dict) -> PipelineConfig:
        return parse_config({"model": {"path": str(samples.model)},
                             "sources": [{"uri": str(samples.bikes), **s} for s in sources],
                             "output": {"dir": str(tmp_path), "video": None}})

    def warnings(config: PipelineConfig) -> list[dict]:
        with capture_logs() as logs:
            warn_unpaced_files(config)
        return [{k: v for k, v in e.items() if k != "log_level"} for e in logs
                if e["log_level"] == "warning"]

    fine = [{"name": "paced", "live": True, "pace_fps": 25}, {"name": "file"},
            {"name": "camera", "uri": "rtsp://camera.invalid/1"},
            {"name": "demo", "loop": True, "pace_fps": 25}]
    with capture_logs() as logs:  # what run.py checks before it starts
        prepare(config(*fine, {"name": "fast", "live": True}), restart=True)
    assert [e for e in logs if e["log_level"] == "warning"] == [
        {"event": UNPACED_FILES, "log_level": "warning", "source": "fast",
         "key": "sources[4].pace_fps"}]
    assert UNPACED_FILES == (
        "a live file without pace_fps is read as fast as it decodes and drops the frames the "
        "pipeline is too slow to take: set pace_fps to the file's frame rate to play it as a "
        "camera, or drop live: true (and loop: true) to keep every frame")
    assert warnings(config({"name": "looped", "loop": True})) == [
        {"event": UNPACED_FILES, "source": "looped", "key": "sources[0].pace_fps"}]
    assert warnings(config(*fine)) == []
    # many at once (capacity's unpaced cameras): one line, how many and the first names
    many = config(*[{"name": f"cam{i:03d}", "live": True} for i in range(100)])
    assert warnings(many) == [{"event": UNPACED_FILES, "sources": 100,
                               "names": "cam000, cam001, cam002 and 97 more",
                               "key": "sources[].pace_fps"}]
    assert warnings(config({"name": "a", "live": True}, {"name": "b", "loop": True}))[0][
        "names"] == "a, b"


def test_files_ended_with_no_file_source_is_warned_at_start(samples, tmp_path):
    """A new user's only file had been set to a camera's URL: with stop_when files_ended the
    run went on beside a looped file for 10 minutes, nothing said."""
    def warnings(stop_when: str, *sources: dict) -> list[dict]:
        config = parse_config({"model": {"path": str(samples.model)},
                               "sources": [{"uri": str(samples.bikes), **s} for s in sources],
                               "output": {"dir": str(tmp_path), "video": None},
                               "runtime": {"stop_when": stop_when}})
        with capture_logs() as logs:
            warn_files_ended_without_files(config)
        return [e for e in logs if e["log_level"] == "warning"]

    camera = {"name": "camera", "uri": "rtsp://camera.invalid/1"}
    looped = {"name": "demo", "loop": True, "pace_fps": 25}
    assert warnings("files_ended", camera, looped) == [
        {"event": FILES_ENDED_WITHOUT_FILES, "log_level": "warning", "key": "runtime.stop_when"}]
    assert warnings("files_ended", camera, looped, {"name": "file"}) == []
    assert warnings("all_ended", camera, looped) == []


def test_runtime_gpus_may_name_only_the_gpus_this_machine_has(samples):
    """A new user's runtime.gpus: [3] said 'engine started device=3' (here on the CPU)."""
    import pytest

    config = parse_config({"model": {"path": str(samples.model)},
                           "sources": [{"name": "a", "uri": str(samples.bikes)}],
                           "runtime": {"gpus": [0, 3]}})
    with pytest.raises(ConfigError, match=r"^runtime\.gpus: \[0, 3\] names GPU 3; this "
                                          r"machine has 2 \(0 to 1\)$"):
        check_gpu_settings(config, lambda: (2, None))
    config.runtime.gpus = [0, 1]
    assert check_gpu_settings(config, lambda: (2, None)) == 2


def test_a_resumed_source_s_summary_says_where_this_run_began():
    """A new user read ``frames=56`` for a resumed file whose records held 250: the summary
    counts this run's frames, and now says it resumed at 194."""
    run = SourceRun(SourceConfig(name="f", uri="f.mp4"), "sources[0]", frames=56,
                    first_frame=194)
    fresh = SourceRun(SourceConfig(name="g", uri="g.mp4"), "sources[1]", frames=250,
                      first_frame=0)
    supervisor = SimpleNamespace(every_source=lambda: [(run, None), (fresh, None)],
                                 failure=None)
    with capture_logs() as logs:
        finish(supervisor, {}, 0, 1.0)
    summaries = {e["source"]: e for e in logs if e["event"] == "source summary"}
    assert (summaries["f"]["frames"], summaries["f"]["resumed_at"]) == (56, 194)
    assert "resumed_at" not in summaries["g"]
