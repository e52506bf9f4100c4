"""pipeline.app.api: the pipeline from Python code, on the real sample model and video (CPU)."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from pipeline.app.api import Pipeline, SourceFailed
from pipeline.config import ConfigError
from tests.e2e.conftest import pipeline_config, records
from tests.support import free_port, read_frames

# Clips of the samples' first frames (bikes: 250 frames, carphone: 120): every frame runs
# through the detector on the CPU, and the checks need a few dozen.
BIKES_FRAMES, CAR_FRAMES = 48, 30


def test_results_are_every_frame_in_order_and_match_the_jsonl(samples, make_clip, tmp_path):
    out = tmp_path / "out"
    clip = make_clip("bikes", BIKES_FRAMES, (640, 272))
    config = pipeline_config(samples, out, [{"name": "bikes", "uri": str(clip)}])
    with Pipeline(config) as pipeline:
        results = list(pipeline.results())
    assert [r.index for r in results] == list(range(BIKES_FRAMES))
    assert {(r.source, r.width, r.height) for r in results} == {("bikes", 640, 272)}
    records = [json.loads(line) for line in (out / "bikes.jsonl").read_text().splitlines()]
    for result, record in zip(results, records):
        assert [d["class_name"] for d in record["detections"]] == list(result.class_names)
        np.testing.assert_allclose(result.detections.xyxy,
                                   np.array([d["xyxy"] for d in record["detections"]],
                                            np.float32).reshape(-1, 4), atol=0.01)
    # people, cars, bicycles: more than one a frame (89 in the first 48 frames)
    assert sum(len(r.detections.xyxy) for r in results) > BIKES_FRAMES
    assert "person" in {name for r in results for name in r.class_names}
    summary = pipeline.summary()
    assert summary.ok and summary.frames == {"bikes": BIKES_FRAMES}


def test_the_exits_made_when_a_file_ends_reach_its_last_result_and_the_callback(
        samples, make_clip, tmp_path):
    """Cars are inside a zone over the whole frame when the clip ends: their closing exits
    (``EndOfStream.events``, stamped on the last frame) come with the last frame's result,
    whose counts then have nobody inside, and to the callback as a last part of no frames;
    every event handed over is a line of the events file, in order."""
    zone = {"type": "zone", "name": "cars", "classes": ["car"],
            "polygon": [[0, 0], [640, 0], [640, 272], [0, 272]]}
    clip = make_clip("bikes", BIKES_FRAMES, (640, 272))
    config = pipeline_config(samples, tmp_path, [
        {"name": "bikes", "uri": str(clip), "tracker": "bytetrack", "analytics": [zone]}],
        output={"jsonl": None})
    parts = []  # (frames, events) of each part (a part's images are the ring's, not ours)
    with Pipeline(config, on_batch=lambda source, part: parts.append(
            (len(part), part.events))) as pipeline:
        results = list(pipeline.results())
    assert [r.index for r in results] == list(range(BIKES_FRAMES))
    frames, closing = parts[-1]
    assert frames == 0 and closing, [frames for frames, _ in parts]
    assert {(e.kind, e.frame) for e in closing} == {("exit", BIKES_FRAMES - 1)}
    last = results[-1]
    assert last.events[-len(closing):] == closing
    cars = last.counts["zones"]["cars"]
    assert cars["inside"] == {"car": 0} and cars["exited"] == cars["entered"], cars
    assert pipeline.counts() == {"bikes": last.counts}
    assert [e.to_json() for r in results for e in r.events] == records(
        tmp_path / "bikes.events.jsonl")


def test_a_callback_run_sees_every_frame_of_every_source(samples, make_clip, tmp_path):
    """With ``frames="i420"`` each part carries its frames' planes, bit for bit as decoded."""
    seen: dict[str, int] = {}
    pictures: dict[tuple[str, int], np.ndarray] = {}
    lock = threading.Lock()

    def count(source, part):
        with lock:
            seen[source] = seen.get(source, 0) + len(part)
            assert part.events == () and len(part.pictures) == len(part)
            pictures.update(((source, int(i)), p)
                            for i, p in zip(part.frames.index, part.pictures))

    clips = {"bikes": make_clip("bikes", BIKES_FRAMES, (640, 272)),
             "car": make_clip("carphone", CAR_FRAMES, (176, 144))}
    config = pipeline_config(samples, tmp_path / "out", [
        {"name": name, "uri": str(clip)} for name, clip in clips.items()],
        output={"jsonl": None})
    summary = Pipeline(config, on_batch=count, frames="i420").run()
    assert seen == {"bikes": BIKES_FRAMES, "car": CAR_FRAMES} == summary.frames
    assert summary.ok and summary.dropped == {"bikes": 0, "car": 0}
    for name, clip in clips.items():
        for index, frame in enumerate(read_frames(clip, 3)):
            picture = pictures[name, index]
            assert picture.dtype == np.uint8 and picture.flags.owndata
            assert np.array_equal(picture, frame.to_ndarray(format="yuv420p"))


@pytest.mark.parametrize(("frames", "source", "message"), [
    ("rgb", {}, r"^frames: expected 'bgr', 'i420' or None, got 'rgb'$"),
    ("bgr", {"decode": "gpu"},
     r"^sources\[0\]\.decode: 'gpu' cannot be used with frames='bgr': the frames are handed "
     r"over from host memory \(use decode: cpu or auto\)$"),
])
def test_frames_asked_wrongly_is_a_one_line_error(samples, tmp_path, frames, source, message):
    config = pipeline_config(samples, tmp_path, [{"name": "bikes", "uri": str(samples.bikes),
                                                  **source}])
    with pytest.raises(ConfigError, match=message):
        Pipeline(config, frames=frames)


def test_leaving_the_loop_early_stops_and_keeps_the_cut_file_partial(samples, tmp_path):
    out = tmp_path / "out"
    config = pipeline_config(samples, out, [{"name": "bikes", "uri": str(samples.bikes)}])
    before = threading.active_count()
    pipeline = Pipeline(config)
    for result in pipeline.results():
        if result.index == 20:
            break
    assert not (out / "bikes.jsonl").exists()  # cut short: not under its final name
    lines = (out / "bikes.partial.jsonl").read_text().splitlines()  # closed, complete lines
    assert 21 <= len(lines) < 250
    assert [json.loads(line)["frame"] for line in lines] == list(range(len(lines)))
    assert threading.active_count() <= before


def test_a_bad_configuration_is_the_cli_s_one_line_error(samples, tmp_path):
    config = pipeline_config(samples, tmp_path, [{"name": "x", "uri": "missing.mp4"}])
    with pytest.raises(ConfigError, match=r"sources\[0\].uri \(source 'x'\): file not found"):
        Pipeline(config)


def test_a_failed_source_is_raised_after_the_other_sources_results(samples, make_clip, tmp_path):
    port = free_port()  # nothing listens: the camera fails at its first connection
    config = pipeline_config(samples, tmp_path / "out", [
        {"name": "good", "uri": str(make_clip("carphone", CAR_FRAMES, (176, 144)))},
        {"name": "bad", "uri": f"rtsp://127.0.0.1:{port}/cam", "reconnect": False,
         "open_timeout_s": 2}],
        output={"jsonl": None})
    results = []
    with pytest.raises(SourceFailed, match=rf"source bad: cannot open rtsp://127.0.0.1:{port}"):
        for result in Pipeline(config).results():
            results.append(result)
    assert [r.index for r in results if r.source == "good"] == list(range(CAR_FRAMES))


def test_an_unreadable_file_is_a_config_error_before_any_result(samples, tmp_path):
    bad = tmp_path / "notavideo.mp4"
    bad.write_text("not a video\n")
    config = pipeline_config(samples, tmp_path / "out", [
        {"name": "good", "uri": str(samples.carphone)}, {"name": "bad", "uri": str(bad)}],
        output={"jsonl": None})
    results = []
    with pytest.raises(ConfigError, match=r"sources\[1\].uri \(source 'bad'\): cannot read "
                                          r".*notavideo.mp4'"):
        for result in Pipeline(config).results():
            results.append(result)
    assert results == []


def test_per_frame_results_ask_for_the_one_pipeline_in_this_process(samples, tmp_path):
    """With several source workers (processes of their own) the batches do not come back to this
    process: ``results()`` says so at once, before anything starts."""
    config = pipeline_config(samples, tmp_path, [{"name": "a", "uri": str(samples.bikes)}],
                             runtime={"workers": 2})
    with pytest.raises(ConfigError, match=r"^runtime\.workers: the Python API's per-frame "
                                          r"results need the whole pipeline in this process"):
        next(Pipeline(config).results())
    assert not list(tmp_path.glob("*.partial.*"))  # nothing was started
