"""Bad configurations, missing and corrupt media, bad URLs and unreachable cameras, through
the command line: each gives its one-line message and exit status, never a traceback, and
no output that looks complete unless it is."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import av
import numpy as np
import pytest
import yaml

from pipeline.app.cli import main
from tests.e2e.conftest import pipeline_config
from tests.support import free_port, read_frames

OK, FAILED, USAGE = 0, 1, 2


@pytest.fixture(scope="module")
def media(defect_clips: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
          ) -> dict[str, str]:
    """The clips with one defect each (``defect_clips``), a folder named like a video, a
    names file of five classes and a model of ten anchors (paths as strings, for configs)."""
    out = tmp_path_factory.mktemp("media")
    (out / "folder.mp4").mkdir()
    (out / "five.names").write_text("a\nb\nc\nd\ne\n")
    made = {
        **defect_clips,
        "folder": out / "folder.mp4",
        "five_names": out / "five.names",
        "ten_anchors": write_model(out / "ten_anchors.onnx", (1, 84, 10)),
    }
    return {name: str(path) for name, path in made.items()}


@dataclass
class Case:
    """One bad input: how to break a good config, and what the user must get."""

    id: str
    edit: Callable[[dict, dict[str, str]], Any]  # edits the config in place (or returns text)
    status: int
    message: str  # on one "error: ..." line, or a warning event when status is OK
    complete: dict[str, int] = field(default_factory=dict)  # source -> records when finished
    check: Callable[[Path], None] | None = None


def write_model(path: Path, output_shape: tuple[int, ...]) -> Path:
    """A valid ONNX model with a (1, 3, 640, 640) image input and a constant output of
    ``output_shape``: shaped like a detector, but not a YOLO head."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    value = numpy_helper.from_array(np.zeros(output_shape, np.float32), "value")
    graph = helper.make_graph(
        [helper.make_node("Constant", [], ["output0"], value=value)], "not_yolo",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, 640, 640])],
        [helper.make_tensor_value_info("output0", TensorProto.FLOAT, list(output_shape))])
    onnx.save(helper.make_model(graph), str(path))
    return path


def source(**keys: Any) -> Callable[[dict, dict[str, str]], None]:
    """An edit setting keys of the first source (a value naming a clip becomes its path)."""
    def edit(config: dict, media: dict[str, str]) -> None:
        config["sources"][0].update({k: media.get(v, v) if isinstance(v, str) else v
                                     for k, v in keys.items()})
    return edit


def section(name: str, **keys: Any) -> Callable[[dict, dict[str, str]], None]:
    return lambda config, _: config.setdefault(name, {}).update(keys)


REFUSED = free_port()


def boxes_are_in_each_frames_own_pixels(out: Path) -> None:
    """Size change: the MP4 keeps the first size; boxes use each frame's own size."""
    lines = [json.loads(line) for line in (out / "cam.jsonl").read_text().splitlines()]
    assert [r["frame"] for r in lines] == list(range(40))
    frames = read_frames(out / "cam.mp4")
    assert len(frames) == 40 and {(f.width, f.height) for f in frames} == {(176, 144)}
    wide = [d["xyxy"] for r in lines[20:] for d in r["detections"]]
    assert any(box[2] > 180 for box in wide)  # beyond 176: in the 320-wide frame's pixels
    assert all(box[2] <= 321 and box[3] <= 137 for box in wide)


CASES = [
    # -- configuration: exit 2 before anything runs --------------------------------------
    Case("unknown top-level key", lambda c, m: c.update(inputs=[]), USAGE,
         "inputs: unknown key; allowed keys here: sources, model"),
    Case("source key typo", lambda c, m: c["sources"][0].update(url="x"), USAGE,
         "sources[0].url: unknown key; allowed keys here: name, uri, live"),
    Case("wrong type", section("inference", batch_size="four"), USAGE,
         "inference.batch_size: expected an integer, got 'four'"),
    Case("value out of range", source(read_timeout_s=0), USAGE,
         "sources[0].read_timeout_s: expected a value >= 0.1, got 0.0"),
    Case("missing file", source(uri="missing.mp4"), USAGE,
         "sources[0].uri (source 'cam'): file not found: 'missing.mp4'"),
    Case("unsupported URL scheme", source(uri="ftp://cam.local/live"), USAGE,
         "sources[0].uri (source 'cam'): unsupported URL scheme 'ftp' in 'ftp://cam.local/live'"),
    Case("URL without a host", source(uri="rtsp:///live"), USAGE,
         "sources[0].uri (source 'cam'): expected scheme://host[:port]/path, got 'rtsp:///live'"),
    Case("URL with a bad port", source(uri="rtsp://admin:hunter2@cam.local:99999/live"), USAGE,
         "sources[0].uri (source 'cam'): bad port in 'rtsp://***@cam.local:99999/live'"),
    Case("bad transport", source(uri="rtsp://cam.local/live", rtsp_transport="http"), USAGE,
         "sources[0].rtsp_transport: expected one of 'tcp', 'udp', got 'http'"),
    Case("reconnect on a file", source(reconnect=True), USAGE,
         "sources[0].reconnect: files never reconnect; only stream URLs can"),
    Case("backoff cap below its start",
         source(uri="rtsp://cam.local/live", reconnect_initial_s=5, reconnect_max_s=1), USAGE,
         "sources[0].reconnect_max_s: expected a value >= reconnect_initial_s (5.0), got 1.0"),
    Case("duplicate source names", lambda c, m: c["sources"].append(dict(c["sources"][0])),
         USAGE, "sources[1].name: duplicate source name 'cam'"),
    Case("model file missing", section("model", path="nope.onnx"), USAGE,
         "model.path: file not found: 'nope.onnx'"),
    Case("not YAML", lambda c, m: "sources: [", USAGE, "is not valid YAML at line"),
    Case("unset environment variable",
         source(uri="rtsp://admin:${STREAMDET_UNSET_PASSWORD}@cam.local/live"), USAGE,
         "sources[0].uri: environment variable STREAMDET_UNSET_PASSWORD is not set"),
    Case("a key given twice", lambda c, m: yaml.safe_dump(c) + "sources: []\n", USAGE,
         "duplicate key 'sources' at line"),
    Case("batch too large for memory", section("inference", batch_size=100000), USAGE,
         "inference.batch_size: expected a value between 1 and 512, got 100000"),
    Case("source name too long for a file name", source(name="c" * 250), USAGE,
         "sources[0].name: expected at most 100 characters, got 250"),
    Case("a folder as the video", source(uri="folder"), USAGE,
         "sources[0].uri (source 'cam'): '{folder}' is a folder, not a video file"),
    Case("output folder is a file", lambda c, m: c["output"].update(dir=m["text"]), USAGE,
         "output.dir: '{text}' exists and is not a folder"),
    Case("output folder cannot be created",
         lambda c, m: c["output"].update(dir=m["text"] + "/out"), USAGE,
         "output.dir: cannot create or write in '{text}/out': Not a directory"),
    Case("an output name that leaves the output folder",
         lambda c, m: c["output"].update(jsonl="../{source}.jsonl"), USAGE,
         "output.jsonl: '../{{source}}.jsonl' leaves output.dir"),
    Case("two outputs in one file",
         lambda c, m: c["output"].update(video="{source}.mp4", jsonl="{source}.mp4"), USAGE,
         "output.jsonl: output.jsonl of source 'cam' would be"),
    Case("two sources in one file",
         lambda c, m: c["sources"].append({"name": "cam2", "uri": m["clean"]})
         or c["output"].update(video="{source}/../same.mp4"), USAGE,
         "which is also output.video of source 'cam'"),
    Case("a source named like another's temporary file",
         lambda c, m: c["sources"].append({"name": "cam.partial", "uri": m["clean"]}), USAGE,
         "which is also the temporary file of output.jsonl of source 'cam'"),
    Case("not an ONNX model", lambda c, m: c["model"].update(path=m["text"]), USAGE,
         "model.path: '{text}' is not an ONNX model (DecodeError)"),
    Case("model output is not a YOLO head",
         lambda c, m: c["model"].update(path=m["ten_anchors"], class_names=None), USAGE,
         "output (batch, 84, 10) fits no layout; supported: (batch, 4 + classes, anchors)"),
    Case("class names of another model", lambda c, m: c["model"].update(
        class_names=m["five_names"]), USAGE,
         "model.class_names: 5 names in '{five_names}', but the model has 80 classes"),
    Case("class names that are not text", lambda c, m: c["model"].update(
        class_names=m["clean"]), USAGE,
         "model.class_names: '{clean}' is not a text file of class names (UTF-8, one per "
         "line): byte "),
    Case("no sources", lambda c, m: c.update(sources=[]), USAGE,
         "sources: expected at least one source, got an empty list"),
    # -- analytics: the frame size is known from the file (a camera's: at its first frame) --
    Case("a zone of two points", source(tracker="bytetrack", analytics=[
        {"type": "zone", "name": "dock", "polygon": [[0, 0], [10, 10]]}]), USAGE,
         "sources[0].analytics[0].polygon: zone 'dock' needs a polygon of at least 3 [x, y] "
         "points, got [[0.0, 0.0], [10.0, 10.0]]"),
    Case("a line of zero length", source(tracker="bytetrack", analytics=[
        {"type": "line", "name": "gate", "start": [10, 10], "end": [10, 10]}]), USAGE,
         "sources[0].analytics[0].end: line 'gate' has zero length (start and end are both "
         "[10.0, 10.0])"),
    Case("an unknown class in a zone", source(tracker="bytetrack", analytics=[
        {"type": "line", "name": "gate", "start": [0, 60], "end": [300, 60],
         "classes": ["car", "unicorn"]}]), USAGE,
         "sources[0].analytics[0].classes: the model has no class 'unicorn' (its classes: "
         "person, bicycle"),
    Case("a zone outside the frame", source(tracker="bytetrack", analytics=[
        {"type": "line", "name": "gate", "start": [0, 60], "end": [300, 60]},
        {"type": "zone", "name": "dock", "polygon": [[0, 0], [400, 0], [400, 100]]}]), USAGE,
         "sources[0].analytics[1].polygon: zone 'dock' has the point [400, 0] outside the "
         "320x136 frame of source 'cam'"),
    Case("analytics without tracking", source(analytics=[
        {"type": "line", "name": "gate", "start": [0, 60], "end": [300, 60]}]), USAGE,
         "sources[0].analytics: zones and lines count tracked objects; set "
         "sources[0].tracker: bytetrack"),
    # -- files that cannot be read: exit 2 before the model loads (each file's first frame
    #    is decoded at start), one line naming the source ------------------------------
    Case("not a video", source(uri="text"), USAGE,
         "error: sources[0].uri (source 'cam'): cannot read '{text}': Invalid data found when "
         "processing input"),
    Case("empty file", source(uri="empty"), USAGE,
         "error: sources[0].uri (source 'cam'): cannot read '{empty}': Invalid data found when "
         "processing input"),
    Case("MP4 cut before its index", source(uri="cut_index"), USAGE,
         "error: sources[0].uri (source 'cam'): cannot read '{cut_index}': Invalid data found "
         "when processing input"),
    Case("one bad file among good ones",
         lambda c, m: c["sources"].insert(0, {"name": "good", "uri": m["clean"]}) or
         c["sources"][1].update(uri=m["text"]), USAGE,
         "error: sources[1].uri (source 'cam'): cannot read '{text}': Invalid data found"),
    # -- cameras that cannot be reached: exit 1, one line naming the source; the others run
    Case("unreachable camera",
         source(uri=f"rtsp://admin:hunter2@127.0.0.1:{REFUSED}/live", reconnect=False), FAILED,
         f"error: source cam: cannot open rtsp://***@127.0.0.1:{REFUSED}/live: Connection refused"),
    Case("one unreachable camera among good files",
         lambda c, m: c["sources"].insert(0, {"name": "good", "uri": m["clean"]}) or
         c["sources"][1].update(uri=f"rtsp://127.0.0.1:{REFUSED}/live", reconnect=False), FAILED,
         f"error: source cam: cannot open rtsp://127.0.0.1:{REFUSED}/live: Connection refused",
         complete={"good": 40}),
    # -- damaged or unusual media: every decodable frame, a warning, exit 0 -------------
    Case("truncated file", source(uri="truncated"), OK,
         "file ended early (truncated or corrupt): kept every decodable frame", {"cam": 30}),
    Case("undecodable packets", source(uri="damaged"), OK, "skipped undecodable packets",
         {"cam": 38}),
    Case("audio and two video tracks", source(uri="multitrack"), OK, "", {"cam": 30}),
    Case("resolution change mid-stream",
         lambda c, m: source(uri="size_change")(c, m) or c["output"].update(video="{source}.mp4"),
         OK, "", {"cam": 40}, check=boxes_are_in_each_frames_own_pixels),
]


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_input_gives_a_clear_message_and_status(samples, media: dict[str, str],
                                                    tmp_path: Path, monkeypatch, capfd,
                                                    case: Case) -> None:
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    config = pipeline_config(samples, out, [{"name": "cam", "uri": media["clean"]}],
                             inference={"batch_size": 4})
    text = case.edit(config, media)
    path = tmp_path / "config.yaml"
    path.write_text(text if isinstance(text, str) else yaml.safe_dump(config))

    status = main(["--config", str(path), "--no-progress"])
    err = capfd.readouterr().err
    assert status == case.status, err[-3000:]
    assert "Traceback" not in err and "hunter2" not in err
    message = case.message.format(**media)
    if status == OK:
        warnings = [e for e in map(json.loads, err.splitlines()) if e["level"] == "warning"]
        assert (not message and not warnings) or any(e["event"] == message for e in warnings)
    else:
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and message in errors[0], err[-3000:]
    if status == USAGE:  # found before anything ran: the model was never loaded
        assert "model loaded" not in err
    # A file under its final name is complete: finished sources only, with every record.
    finished = {p.name for p in out.glob("*")} if out.exists() else set()
    assert finished == {f"{name}.jsonl" for name in case.complete} | (
        {"cam.mp4"} if case.check else set())
    for name, count in case.complete.items():
        assert len((out / f"{name}.jsonl").read_text().splitlines()) == count
    if case.check is not None:
        case.check(out)


@pytest.mark.parametrize("error, status, message", [
    (RuntimeError("out of memory allocating 6.2 GB"), FAILED,
     "error: failed to start: RuntimeError: out of memory allocating 6.2 GB"),
    (OSError(28, "No space left on device"), FAILED,
     "error: failed to start: OSError: [Errno 28] No space left on device"),
])
def test_a_fault_while_starting_is_not_called_a_bad_configuration(
        samples, media, tmp_path, monkeypatch, capfd, error, status, message):
    """Exit 2 means "fix your configuration": a fault of the machine while the pipeline is
    built (here raised in place of ``build_graph``) is exit 1 with its own words."""
    import pipeline.app.build

    def fail(*args: Any, **kwargs: Any) -> None:
        raise error

    monkeypatch.setattr(pipeline.app.build, "build_graph", fail)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(pipeline_config(
        samples, tmp_path / "out", [{"name": "cam", "uri": media["clean"]}])))
    assert main(["--config", str(path), "--no-progress"]) == status
    errors = [line for line in capfd.readouterr().err.splitlines() if line.startswith("error: ")]
    assert errors == [message]


def test_a_live_view_port_in_use_ends_the_run_before_it_begins_and_frees_its_engine(
        samples, media, tmp_path, monkeypatch, capfd):
    """The engine's shared ring and socket folder are made with the workers' executor, before
    the live view binds its port: a port in use ends the run (exit 1, one line) and frees
    them (the folder was left in the temporary folder)."""
    import socket
    import tempfile

    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))  # where the engine's folder goes
    monkeypatch.setattr(tempfile, "tempdir", None)  # (read again)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(pipeline_config(
        samples, tmp_path / "out", [{"name": "cam", "uri": media["clean"]}],
        runtime={"workers": 2, "http": {"port": port}})))
    try:
        assert main(["--config", str(path), "--no-progress"]) == FAILED
    finally:
        taken.close()
    errors = [line for line in capfd.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(
        f"error: failed to start: runtime.http: cannot serve on 127.0.0.1:{port}: "), errors
    assert list((tmp_path / "tmp").iterdir()) == []  # no streamdet-engine-* folder left


def write_lossless(path: Path, pictures: list[av.VideoFrame]) -> Path:
    """``pictures`` (yuv420p, any size) as an FFV1 MKV: decoded back bit for bit."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("ffv1", rate=25)
        stream.width, stream.height, stream.pix_fmt = pictures[0].width, pictures[0].height, \
            "yuv420p"
        for index, picture in enumerate(pictures):
            picture.pts = index
            container.mux(stream.encode(picture))
        container.mux(stream.encode(None))
    return path


def test_an_odd_sized_video_keeps_its_pixel_coordinates(samples, tmp_path, capfd):
    """641x273: I420 needs even sizes, so the last column and row are left out (a crop):
    the boxes are those of the same pixels as a 640x272 video, in the same coordinates, and
    a warning says so. A resize to 640x272 would move every pixel, and the boxes with them."""
    from pipeline.slots import copy_i420_planes

    odd = [frame.reformat(width=641, height=273, format="yuv420p")
           for frame in read_frames(samples.bikes, 12)]
    odd_path = write_lossless(tmp_path / "odd.mkv", odd)
    cropped = []
    for frame in read_frames(odd_path):
        i420 = np.empty((272 * 3 // 2, 640), np.uint8)
        copy_i420_planes(frame.planes, 640, 272, i420)
        cropped.append(av.VideoFrame.from_ndarray(i420, format="yuv420p"))
    even_path = write_lossless(tmp_path / "even.mkv", cropped)
    out = tmp_path / "out"
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(pipeline_config(samples, out, [
        {"name": "odd", "uri": str(odd_path)}, {"name": "even", "uri": str(even_path)}])))
    assert main(["--config", str(path), "--no-progress"]) == OK
    events = [json.loads(line) for line in capfd.readouterr().err.splitlines()]
    warned = [e for e in events if e["event"].startswith("odd frame size")]
    assert [(e["source"], e["size"], e["used"]) for e in warned] == [("odd", "641x273", "640x272")]
    records = {name: [json.loads(line) for line in (out / f"{name}.jsonl").read_text().splitlines()]
               for name in ("odd", "even")}
    assert len(records["odd"]) == len(records["even"]) == 12
    detections = [[d for r in records[name] for d in r["detections"]] for name in ("odd", "even")]
    assert detections[0] and detections[0] == detections[1]


def test_environment_variables_and_set_overrides(samples, media, tmp_path, monkeypatch, capfd):
    """``${VAR}`` fills any string (a file's path here); ``--set`` overrides keys, validated
    like the file: a bad value is exit 2 with the key's message."""
    monkeypatch.setenv("STREAMDET_CLIP", media["clean"])
    out = tmp_path / "out"
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(pipeline_config(
        samples, out, [{"name": "cam", "uri": "${STREAMDET_CLIP}"}])))
    assert main(["--config", str(path), "--no-progress", "--set", "output.jsonl=renamed.jsonl",
                 "--set", "inference.batch_size=3"]) == OK
    assert len((out / "renamed.jsonl").read_text().splitlines()) == 40
    assert not (out / "cam.jsonl").exists()
    capfd.readouterr()
    assert main(["--config", str(path), "--set", "inference.batch_size=0"]) == USAGE
    errors = [line for line in capfd.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == ["error: inference.batch_size: expected a value between 1 and 512, got 0"]
    assert main(["--config", str(path), "--set", "sources[3].uri=x"]) == USAGE
    assert "error: --set sources[3].uri=x: there is no item 3 there" in capfd.readouterr().err


def test_an_unreadable_file_stops_several_pipelines_before_any_starts(samples, media, tmp_path,
                                                                      capfd):
    """``runtime.workers: 2``: the same exit 2 and one line, before a host is spawned."""
    config = pipeline_config(samples, tmp_path / "out", [
        {"name": "good", "uri": media["clean"]}, {"name": "cam", "uri": media["empty"]}],
        runtime={"workers": 2})
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["--config", str(path), "--no-progress"]) == USAGE
    err = capfd.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: sources[1].uri (source 'cam'): cannot read {media['empty']!r}: "
                      "Invalid data found when processing input"]
    assert "Traceback" not in err and "model loaded" not in err and "host" not in err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
