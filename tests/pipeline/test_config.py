"""Config validation: every bad key, type and value gives one line naming it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from pipeline.config import ConfigError, check_config, describe_schema, load_config, parse_config


@pytest.fixture()
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory holding a video, a model and class names (contents irrelevant)."""
    monkeypatch.chdir(tmp_path)
    for name in ("clip.mp4", "model.onnx", "names.txt"):
        (tmp_path / name).write_bytes(b"x")
    return tmp_path


def base() -> dict:
    return {
        "sources": [{"name": "cam1", "uri": "clip.mp4"}],
        "model": {"path": "model.onnx", "class_names": "names.txt"},
    }


def test_minimal_config_gets_defaults(files: Path) -> None:
    config = parse_config(base())
    assert config.inference.batch_size == 4
    assert config.nms.iou_threshold == 0.45
    assert config.sources[0].is_live is False
    assert config.output_path("{source}.mp4", "cam1") == Path("output/cam1.mp4")


@pytest.mark.parametrize(("batch_size", "buckets", "expected"), [
    (64, None, [2, 4, 8, 16, 24, 32, 40, 48, 56, 64]),
    (4, None, [2, 4]),
    (1, None, [1]),
    (37, None, [2, 4, 8, 16, 24, 32, 37]),
    (256, None, [2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256]),
    (64, [8, 1, 8, 37], [1, 8, 37, 64]),  # sorted, once each, batch_size added
])
def test_batch_buckets(files: Path, batch_size: int, buckets: list[int] | None,
                       expected: list[int]) -> None:
    data = base()
    data["inference"] = {"batch_size": batch_size, "batch_buckets": buckets}
    assert parse_config(data).inference.buckets() == expected


def test_rtsp_sources_are_live_by_default(files: Path) -> None:
    data = base()
    data["sources"] = [{"name": "door", "uri": "rtsp://user:pw@127.0.0.1:8554/door"},
                       {"name": "still", "uri": "rtsp://127.0.0.1/x", "live": False}]
    config = parse_config(data)
    assert [s.is_live for s in config.sources] == [True, False]


def test_int_is_accepted_for_float(files: Path) -> None:
    data = base()
    data["nms"] = {"conf_threshold": 1}
    assert parse_config(data).nms.conf_threshold == 1.0


def with_value(path: str, value: object) -> dict:
    data = base()
    *parents, last = path.split(".")
    node = data
    for part in parents:
        node = node[int(part)] if part.isdigit() else node.setdefault(part, {})
    node[last] = value
    return data


BAD = [
    # (key path, value, text the message must contain)
    ("inference.batch_size", 0, "inference.batch_size: expected a value between 1 and 512, got 0"),
    ("inference.batch_size", "four", "inference.batch_size: expected an integer, got 'four'"),
    ("inference.batch_size", True, "inference.batch_size: expected an integer, got True"),
    ("inference.batch_buckets", [0, 2], "inference.batch_buckets: expected batch sizes from 1 to "
                                         "inference.batch_size (4), got [0, 2]"),
    ("inference.batch_buckets", [2, 8], "inference.batch_buckets: expected batch sizes from 1 to "
                                        "inference.batch_size (4), got [2, 8]"),
    ("inference.batch_buckets", [], "inference.batch_buckets: expected batch sizes from 1"),
    ("inference.batch_buckets", ["x"], "inference.batch_buckets[0]: expected an integer, got 'x'"),
    ("inference.backend", "openvino", "inference.backend: expected one of 'auto', 'onnxruntime'"),
    ("inference.device", "gpu", "inference.device: expected one of 'auto', 'cpu', 'cuda'"),
    ("nms.iou_threshold", 1.5, "nms.iou_threshold: expected a value between 0.0 and 1.0, got 1.5"),
    ("nms.colour", 1, "nms.colour: unknown key; allowed keys here: conf_threshold"),
    ("nmss", {}, "nmss: unknown key; allowed keys here: sources, model"),
    ("nmss", {}, "output, runtime; did you mean 'nms'?"),  # the nearest key, last
    ("inference.batch_sise", 2, "engine_cache, compile; did you mean 'batch_size'?"),
    ("sources.0.uri", "missing.mp4", "sources[0].uri (source 'cam1'): file not found: 'missing.mp"),
    ("sources.0.uri", "ftp://h/x", "sources[0].uri (source 'cam1'): unsupported URL scheme 'ftp'"),
    ("sources.0.uri", "rtsp://", "sources[0].uri (source 'cam1'): expected scheme://host[:port]/path"),
    ("sources.0.uri", "rtsp://h:0/x", "sources[0].uri (source 'cam1'): bad port in 'rtsp://h:0/x'"),
    ("sources.0.uri", "rtsp://u:pw/x@h/s", "bad port in 'rtsp://***@h/s' (percent-encode"),
    ("sources.0.uri", "rtsp://h/a b", "expected scheme://host[:port]/path, got 'rtsp://h/a b'"),
    ("sources.0.reconnect", True, "sources[0].reconnect: files never reconnect"),
    ("sources.0.reconnect", "always", "sources[0].reconnect: expected true or false or null"),
    ("runtime.cuda_mps", "maybe", "runtime.cuda_mps: expected true or false or 'auto', got 'maybe'"),
    ("sources.0.reconnect_initial_s", 0, "reconnect_initial_s: expected a value >= 0.01, got 0"),
    ("sources.0.open_timeout_s", "10s", "sources[0].open_timeout_s: expected a number, got '10s'"),
    ("sources.0.name", "my cam", "sources[0].name: expected letters, digits"),
    ("sources.0.name", "cam/1", "sources[0].name: expected letters, digits"),
    # A name goes into file names: '..' wrote '...jsonl', '.' with "{source}/rec.jsonl" wrote
    # into output.dir itself.
    ("sources.0.name", "..", "sources[0].name: expected a name not starting with '.' (it goes "
                             "into file names: '.' and '..' are folders, '.x' a hidden file), "
                             "got '..'"),
    ("sources.0.name", ".", "sources[0].name: expected a name not starting with '.'"),
    ("sources.0.name", ".cam1", "sources[0].name: expected a name not starting with '.'"),
    ("sources.0.live", "yes", "sources[0].live: expected true or false or null, got 'yes'"),
    ("sources.0.loop", "yes", "sources[0].loop: expected true or false, got 'yes'"),
    ("sources.0.rtsp_transport", "http", "sources[0].rtsp_transport: expected one of 'tcp', 'udp'"),
    ("sources.0.max_lag_ms", 0, "sources[0].max_lag_ms: expected a value >= 1.0, got 0"),
    ("sources.0.max_lag_ms", -250, "sources[0].max_lag_ms: expected a value >= 1.0, got -250"),
    ("sources.0.max_lag_ms", "1s", "sources[0].max_lag_ms: expected a number or null, got '1s'"),
    ("sources.0.max_lag_ms", True, "sources[0].max_lag_ms: expected a number or null, got True"),
    ("sources", [], "sources: expected at least one source"),
    ("sources", "clip.mp4", "sources: expected a list, got 'clip.mp4'"),
    ("model.path", "nope.onnx", "model.path: file not found: 'nope.onnx' (looked for in /"),
    ("model.path", ".", "model.path: '.' is a folder, not a model file"),
    ("model.class_names", ".", "model.class_names: '.' is a folder, not a names file"),
    ("output.video_crf", 60, "output.video_crf: expected a value between 0 and 51, got 60"),
    ("output.trails", -1, "output.trails: expected a value between 0 and 1000, got -1"),
    ("sources.0.tracker_class_aware", "yes",
     "sources[0].tracker_class_aware: expected true or false, got 'yes'"),
    ("output.jsonl", "{camera}.jsonl", "output.jsonl: only {source} may be used"),
    ("output.segment_s", 5, "output.segment_s: expected a value >= 10.0, got 5"),
    ("output.segment_s", "15m", "output.segment_s: expected a number or null, got '15m'"),
    ("output.keep_hours", 24, "output.keep_hours: deletes old segments, so it needs "
                              "output.segment_s; got keep_hours 24 and segment_s null"),
    ("output.keep_hours", "1d", "output.keep_hours: expected a number or null, got '1d'"),
    ("runtime.queue_size", -1, "runtime.queue_size: expected a value >= 1, got -1"),
    ("runtime.log_format", "xml", "runtime.log_format: expected one of 'console', 'json'"),
]


@pytest.mark.parametrize(("key", "value", "message"), BAD,
                         ids=[b[0] + "=" + repr(b[1]) for b in BAD])
def test_bad_values_name_key_value_and_allowed(files: Path, key: str, value: object,
                                               message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(with_value(key, value))
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_a_missing_absolute_path_is_named_as_given() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(with_value("sources.0.uri", "/no/such.mp4"))
    assert str(info.value) == "sources[0].uri (source 'cam1'): file not found: '/no/such.mp4'"


def test_an_unknown_key_near_no_allowed_one_gets_no_guess(files: Path) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(with_value("nms.colour", 1))
    assert str(info.value).endswith("class_agnostic, max_detections")


@pytest.mark.parametrize(("output", "message"), [
    ({"segment_s": 900, "keep_hours": 0.1},
     "output.keep_hours: expected at least one segment (900 s = 0.25 h), got 0.1"),
    ({"segment_s": 900, "keep_hours": -1},
     "output.keep_hours: expected at least one segment (900 s = 0.25 h), got -1"),
    ({"segment_s": 900, "keep_hours": 0.25}, None),
    ({"segment_s": 10}, None),
])
def test_keep_hours_keeps_at_least_one_segment(files: Path, output: dict,
                                               message: str | None) -> None:
    data = {**base(), "output": output}
    if message is None:
        config = parse_config(data)
        assert (config.output.segment_s, config.output.keep_hours) == (
            output["segment_s"], output.get("keep_hours"))
        return
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert str(info.value) == message


def test_duplicate_source_names(files: Path) -> None:
    data = base()
    data["sources"].append({"name": "cam1", "uri": "clip.mp4"})
    with pytest.raises(ConfigError, match=r"sources\[1\].name: duplicate source name 'cam1'"):
        parse_config(data)


@pytest.mark.parametrize(("name", "output", "what"), [
    ("cam1.from-0", {}, "a resumed run's part of its video, NAME.from-FRAME.EXT"),
    ("cam1.from-0.partial", {}, "a resumed run's part of its video, NAME.from-FRAME.EXT"),
    ("cam1.older", {}, "its earlier run's video set aside, NAME.older.EXT"),
    ("cam1.20261130T231500Z", {"segment_s": 60},
     "its segment, NAME.YYYYMMDDTHHMMSSZ.EXT"),
    ("cam1.older", {"video": None}, None),  # no video: no video of cam1's set aside
    ("cam1.20261130T231500Z", {}, None),  # no segments
    ("cam1.from-x", {}, None),
])
def test_a_source_named_like_a_file_another_s_sink_makes_beside_its_output(
        files: Path, name: str, output: dict, what: str | None) -> None:
    """A source named ``cam1.older`` beside ``cam1`` had its finished video deleted as
    ``cam1``'s earlier one, and the run exited 0 (a new user's trial)."""
    data = {**base(), "output": output}
    data["sources"].append({"name": name, "uri": "clip.mp4"})
    if what is None:
        parse_config(data)
        return
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert str(info.value) == (f"output.video: output.video of source {name!r} would be "
                               f"'output/{name}.mp4', a name output.video of source 'cam1' "
                               f"uses for {what}: rename source {name!r}")


@pytest.mark.parametrize("name", ["..", "."])
def test_a_source_added_to_a_running_run_may_not_be_named_dot(files: Path, name: str) -> None:
    """An added source (the HTTP API's POST /api/sources) is checked as the file's are: '..'
    wrote '...jsonl', and '.' with output.jsonl "{source}/rec.jsonl" wrote into output.dir
    itself."""
    config = parse_config(with_value("output.jsonl", "{source}/rec.jsonl"))
    added = dataclasses.replace(config.sources[0], name=name)
    with pytest.raises(ConfigError) as info:
        check_config(dataclasses.replace(config, sources=[*config.sources, added]),
                     added_key="sources[7]")
    assert str(info.value).startswith("sources[7].name: expected a name not starting with "
                                      "'.' (it goes into file names")
    assert str(info.value).endswith(f"got {name!r}")


def test_several_sources_need_source_in_output_paths(files: Path) -> None:
    data = base()
    data["sources"].append({"name": "cam2", "uri": "clip.mp4"})
    data["output"] = {"video": "all.mp4"}
    with pytest.raises(ConfigError, match=r"output.video: with several sources"):
        parse_config(data)


def test_missing_required_key(files: Path) -> None:
    with pytest.raises(ConfigError, match=r"sources\[0\].uri: required key is missing"):
        parse_config({"sources": [{"name": "a"}], "model": base()["model"]})


@pytest.mark.parametrize(("text", "message"), [
    ("sources: [", "is not valid YAML at line"),
    ("- a\n- b\n", "expected a mapping at the top level"),
])
def test_unreadable_yaml(files: Path, text: str, message: str) -> None:
    path = files / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_a_binary_file_given_as_the_config_is_one_line(files: Path) -> None:
    path = files / "clip.mp4"  # a video given by mistake (once a UnicodeDecodeError traceback)
    path.write_bytes(b"\x00\x00\x00\x18ftypmp42\xb8\xff\x00")
    with pytest.raises(ConfigError, match=r"is not a text \(YAML\) file: not UTF-8 at byte 12$"):
        load_config(path)


def test_missing_config_file(files: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read 'absent.yaml'"):
        load_config("absent.yaml")


def test_schema_documents_every_section() -> None:
    text = "\n".join(describe_schema())
    for key in ("sources[]", "uri", "inference.batch_size", "nms.iou_threshold", "output.video"):
        assert key in text
    # defaults as YAML spells them, not Python
    assert "  sources[].pace_fps (a number or null; default null): " in text
    assert "  sources[].loop (true or false; default false): " in text
    assert "None" not in text and "False" not in text and "True" not in text


@pytest.mark.parametrize(("source", "live", "message"), [
    ({"loop": True}, True, None),  # a looped file is live: it never ends
    ({"loop": True, "live": True, "pace_fps": 25, "start_frame": 100}, True, None),
    ({"loop": False}, False, None),
    ({"loop": True, "live": False}, None,
     "sources[0].live: a looped file never ends, so it is live; drop live: false (or loop: true)"),
    ({"loop": True, "uri": "rtsp://user:pw@cam/x"}, None,
     "sources[0].loop: only a file loops; 'rtsp://***@cam/x' is a stream URL (it reconnects "
     "instead: reconnect)"),
    ({"loop": True, "uri": "udp://cam:5000"}, None, "sources[0].loop: only a file loops"),
    # a scheme that is no stream's is said first (a new user read "only a file loops" of it)
    ({"loop": True, "uri": "nope://x"}, None,
     "sources[0].uri (source 'cam1'): unsupported URL scheme 'nope'"),
    ({"loop": True, "reconnect": True}, None, "sources[0].reconnect: files never reconnect"),
])
def test_a_looped_file_is_live_and_only_files_loop(files: Path, source: dict, live: bool | None,
                                                   message: str | None) -> None:
    data = base()
    data["sources"][0].update(source)
    if message is None:
        assert parse_config(data).sources[0].is_live is live
        return
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


@pytest.mark.parametrize(("uri", "live", "reconnect", "expected"), [
    ("rtsp://cam/x", None, None, True),  # live streams reconnect by default
    ("rtsp://cam/x", None, False, False),
    ("rtsp://cam/x", False, None, False),  # a non-live stream ends like a file...
    ("rtsp://cam/x", False, True, True),  # ...unless asked to reconnect
    ("clip.mp4", True, None, False),  # files never reconnect, even read as if live
])
def test_which_sources_reconnect(files: Path, uri: str, live: bool | None,
                                 reconnect: bool | None, expected: bool) -> None:
    data = base()
    data["sources"][0].update(uri=uri, live=live, reconnect=reconnect)
    assert parse_config(data).sources[0].should_reconnect is expected


@pytest.mark.parametrize(("value", "expected"), [
    ("default", 500.0),  # a camera skips to a keyframe once half a second behind
    (250, 250.0),
    (0.5e3, 500.0),
    (None, None),  # never skips
])
def test_max_lag_ms_is_a_positive_number_or_null(files: Path, value: object,
                                                 expected: float | None) -> None:
    data = base()
    data["sources"][0]["uri"] = "rtsp://cam/x"
    if value != "default":
        data["sources"][0]["max_lag_ms"] = value
    assert parse_config(data).sources[0].max_lag_ms == expected
    assert "sources[].max_lag_ms (a number or null; default 500.0)" in "\n".join(describe_schema())


def test_backoff_cap_must_not_be_below_its_start(files: Path) -> None:
    data = base()
    data["sources"][0].update(uri="rtsp://cam/x", reconnect_initial_s=2, reconnect_max_s=1)
    with pytest.raises(ConfigError, match=r"sources\[0\].reconnect_max_s: expected a value >= "
                                          r"reconnect_initial_s \(2.0\), got 1.0"):
        parse_config(data)


def test_credentials_never_appear_in_config_errors(files: Path) -> None:
    data = base()
    data["sources"][0]["uri"] = "gopher://admin:hunter2@cam/x"
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert "hunter2" not in str(info.value) and "gopher://***@cam/x" in str(info.value)


# -- tracking and analytics ---------------------------------------------------------------

ZONE = {"type": "zone", "name": "dock", "polygon": [[0, 0], [100, 0], [100, 80]],
        "classes": ["person"]}
LINE = {"type": "line", "name": "gate", "start": [0, 50], "end": [200, 50]}


def with_analytics(*regions: dict, tracker: str = "bytetrack", **output: object) -> dict:
    data = base()
    data["sources"][0].update(tracker=tracker, analytics=[dict(r) for r in regions])
    if output:
        data["output"] = output
    return data


def test_analytics_regions_are_parsed_with_defaults(files: Path) -> None:
    config = parse_config(with_analytics(ZONE, LINE))
    source = config.sources[0]
    assert source.tracker == "bytetrack" and source.tracker_lost_s == 1.0
    zone, line = source.analytics
    assert (zone.type, zone.name, zone.polygon, zone.classes) == \
        ("zone", "dock", [[0.0, 0.0], [100.0, 0.0], [100.0, 80.0]], ["person"])
    assert (line.points, line.classes, line.min_track_frames, line.min_frames) == \
        ([[0.0, 50.0], [200.0, 50.0]], None, 3, 2)
    assert config.output.events == "{source}.events.jsonl" and config.output.mqtt is None
    assert parse_config(base()).sources[0].tracker == "none"


def test_mqtt_output_is_a_section(files: Path) -> None:
    config = parse_config(with_analytics(LINE, mqtt={"host": "broker", "port": 8883, "tls": True}))
    assert (config.output.mqtt.host, config.output.mqtt.port, config.output.mqtt.tls) == \
        ("broker", 8883, True)
    with pytest.raises(ConfigError, match=r"output.mqtt.hots: unknown key; allowed keys here: "
                                          r"host, port"):
        parse_config(with_analytics(LINE, mqtt={"hots": "broker"}))


BAD_REGIONS = [
    # (region, text the message must contain)
    ({**ZONE, "polygon": [[0, 0], [10, 10]]},
     "sources[0].analytics[0].polygon: zone 'dock' needs a polygon of at least 3 [x, y] points, "
     "got [[0.0, 0.0], [10.0, 10.0]]"),
    ({**ZONE, "polygon": [[0, 0], [10, 10], [20, 20]]},
     "sources[0].analytics[0].polygon: zone 'dock' encloses no area (its points lie on one "
     "line): [[0.0, 0.0], [10.0, 10.0], [20.0, 20.0]]"),
    ({**ZONE, "polygon": [[5, 5], [5, 5], [5, 5]]},
     "sources[0].analytics[0].polygon: zone 'dock' encloses no area (its points lie on one "
     "line)"),
    # A bow-tie (corners in the wrong order) encloses no net area, but its points are not on
    # one line: its edges cross.
    ({**ZONE, "polygon": [[0, 150], [640, 272], [640, 150], [0, 272]]},
     "sources[0].analytics[0].polygon: zone 'dock' has edges that cross (edge 1 [0,150]->"
     "[640,272] and edge 3 [640,150]->[0,272]); list its corners in order around it"),
    # A lopsided one has area, and was accepted (counting far fewer events).
    ({**ZONE, "polygon": [[0, 150], [640, 272], [640, 150], [0, 200]]},
     "sources[0].analytics[0].polygon: zone 'dock' has edges that cross (edge 1 [0,150]->"
     "[640,272] and edge 3 [640,150]->[0,200])"),
    ({**ZONE, "polygon": [[0, 0], [100, 0], [100, 100], [50.5, 100], [50.5, -50], [0, -50]]},
     "sources[0].analytics[0].polygon: zone 'dock' has edges that cross "
     "(edge 1 [0,0]->[100,0] and edge 4 [50.5,100]->[50.5,-50])"),
    # An edge doubling back over the one before it, edges over each other on one line, a
    # corner on another edge, a corner listed twice (a figure of eight).
    ({**ZONE, "polygon": [[0, 0], [100, 0], [50, 0], [50, 50]]},
     "sources[0].analytics[0].polygon: zone 'dock' has edges that overlap "
     "(edge 1 [0,0]->[100,0] and edge 2 [100,0]->[50,0])"),
    ({**ZONE, "polygon": [[20, 0], [80, 0], [50, -50], [100, 0], [0, 0]]},
     "sources[0].analytics[0].polygon: zone 'dock' has edges that overlap "
     "(edge 1 [20,0]->[80,0] and edge 4 [100,0]->[0,0])"),
    ({**ZONE, "polygon": [[0, 0], [100, 0], [100, 100], [50, 0], [0, 100]]},
     "sources[0].analytics[0].polygon: zone 'dock' has edges that touch "
     "(edge 1 [0,0]->[100,0] and edge 3 [100,100]->[50,0])"),
    ({**ZONE, "polygon": [[0, 0], [50, 50], [100, 0], [100, 100], [50, 50], [0, 100]]},
     "sources[0].analytics[0].polygon: zone 'dock' has edges that touch "
     "(edge 1 [0,0]->[50,50] and edge 4 [100,100]->[50,50])"),
    ({**ZONE, "polygon": None}, "sources[0].analytics[0].polygon: zone 'dock' needs a polygon"),
    ({**ZONE, "start": [0, 0]}, "sources[0].analytics[0].start: a zone has a polygon, not a start"),
    ({**LINE, "end": [0, 50]},
     "sources[0].analytics[0].end: line 'gate' has zero length (start and end are both "
     "[0.0, 50.0])"),
    ({**LINE, "end": None}, "sources[0].analytics[0].end: line 'gate' needs an [x, y] end point"),
    ({**LINE, "start": [1, 2, 3]}, "sources[0].analytics[0].start: line 'gate' needs an [x, y]"),
    ({**LINE, "polygon": [[0, 0], [1, 0], [1, 1]]},
     "sources[0].analytics[0].polygon: a line has a start and an end, not a polygon"),
    ({**LINE, "type": "circle"},
     "sources[0].analytics[0].type: expected one of 'zone', 'line', got 'circle'"),
    ({**LINE, "strat": [0, 0]}, "sources[0].analytics[0].strat: unknown key; allowed keys here: "
                                "type, name, polygon, start, end"),
    ({**LINE, "start": [0, "a"]}, "sources[0].analytics[0].start[1]: expected a number, got 'a'"),
    ({**LINE, "name": "my gate"}, "sources[0].analytics[0].name: expected letters, digits"),
    ({**LINE, "classes": []}, "sources[0].analytics[0].classes: expected class names or ids"),
    ({**LINE, "min_frames": 0}, "sources[0].analytics[0].min_frames: expected a value >= 1, got 0"),
    ({**LINE, "margin_px": -1}, "sources[0].analytics[0].margin_px: expected a value >= 0.0"),
]


@pytest.mark.parametrize(("region", "message"), BAD_REGIONS,
                         ids=[m.split(": ", 1)[1][:40] for _, m in BAD_REGIONS])
def test_bad_analytics_regions_name_key_and_value(files: Path, region: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(with_analytics(region))
    assert message in str(info.value)
    assert "\n" not in str(info.value)


HOOK = {"url": "https://hooks.example.com/streamdet"}


def test_webhooks_are_a_list_of_sections_with_defaults(files: Path) -> None:
    config = parse_config(with_analytics(LINE, webhooks=[
        HOOK, {"url": "http://10.0.0.9:8000/in", "events": ["cross_in"],
               "headers": {"Authorization": "Bearer t0k"}, "timeout_s": 2}]))
    first, second = config.output.webhooks
    assert (first.url, first.events, first.headers, first.timeout_s, first.queue_size) == \
        ("https://hooks.example.com/streamdet", None, None, 5.0, 10000)
    assert (second.events, second.headers, second.timeout_s) == \
        (["cross_in"], {"Authorization": "Bearer t0k"}, 2.0)
    assert "t0k" not in repr(second)  # headers carry secrets: never shown
    assert parse_config(with_analytics(LINE)).output.webhooks is None


BAD_WEBHOOKS = [
    # (webhooks, the whole message)
    ([{"url": "ftp://hooks.example.com/x"}],
     "output.webhooks[0].url: expected an http:// or https:// URL with a host, got "
     "'ftp://hooks.example.com/x'"),
    ([{"url": "hooks.example.com/x"}],
     "output.webhooks[0].url: expected an http:// or https:// URL with a host, got "
     "'hooks.example.com/x'"),
    ([{"url": "https://user:hunter2@/x"}],
     "output.webhooks[0].url: expected an http:// or https:// URL with a host, got "
     "'https://***@/x'"),
    ([HOOK, {**HOOK, "events": ["enter"], "timeout_s": 1}],
     "output.webhooks[1].url: the same URL as output.webhooks[0] (one entry per URL: list both "
     "entries' events in one)"),
    ([{**HOOK, "events": ["enter", "crossed"]}],
     "output.webhooks[0].events[1]: unknown event kind 'crossed'; expected one of enter, exit, "
     "cross_in, cross_out"),
    ([{**HOOK, "events": []}],
     "output.webhooks[0].events: expected event kinds (enter, exit, cross_in, cross_out), or "
     "null for all, got an empty list"),
    ([{**HOOK, "timeout_s": 0}],
     "output.webhooks[0].timeout_s: expected a number of seconds > 0, got 0.0"),
    ([{**HOOK, "timeout_s": -2.5}],
     "output.webhooks[0].timeout_s: expected a number of seconds > 0, got -2.5"),
    ([{**HOOK, "queue_size": 0}], "output.webhooks[0].queue_size: expected a value >= 1, got 0"),
    ([{**HOOK, "headers": {"X-Token": 5}}],
     "output.webhooks[0].headers.X-Token: expected a string, got 5"),
    ([{**HOOK, "headers": {"X Token": "a"}}],
     "output.webhooks[0].headers: 'X Token' is not an HTTP header name"),
    ([{**HOOK, "headers": ["X-Token: a"]}],
     "output.webhooks[0].headers: expected a mapping or null, got ['X-Token: a']"),
    ([{**HOOK, "method": "PUT"}],
     "output.webhooks[0].method: unknown key; allowed keys here: url, events, headers, "
     "timeout_s, queue_size"),
    ([{"events": ["enter"]}], "output.webhooks[0].url: required key is missing"),
    (HOOK, "output.webhooks: expected a list or null, got {'url': "),
]


@pytest.mark.parametrize(("webhooks", "message"), BAD_WEBHOOKS,
                         ids=[m.split(": ", 1)[1][:40] for _, m in BAD_WEBHOOKS])
def test_bad_webhooks_are_one_line_errors_naming_the_key(files: Path, webhooks: object,
                                                         message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(with_analytics(LINE, webhooks=webhooks))
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value) and "hunter2" not in str(info.value)


@pytest.mark.parametrize("polygon", [
    [[0, 150], [640, 150], [640, 272], [0, 272]],  # the README's kerb
    [[0, 272], [640, 272], [640, 150], [0, 150]],  # the other way round
    [[0, 0], [100, 0], [100, 80], [0, 0]],  # the first corner repeated at the end
    [[0, 0], [100, 0], [100, 0], [100, 80]],  # a corner repeated
    [[0, 0], [50, 0], [100, 0], [100, 80]],  # a corner on the straight between two
    [[0, 0], [100, 0], [100, 100], [50, 10], [0, 100]],  # concave
    [[0.5, 0.25], [99.5, 0.25], [50, 79.75]],
])
def test_zones_whose_edges_do_not_cross_are_accepted(files: Path, polygon: list) -> None:
    zone = parse_config(with_analytics({**ZONE, "polygon": polygon})).sources[0].analytics[0]
    assert zone.polygon == polygon


def test_analytics_need_a_tracker_and_unique_names(files: Path) -> None:
    with pytest.raises(ConfigError, match=r"^sources\[0\].analytics: zones and lines count "
                                          r"tracked objects; set sources\[0\].tracker: "
                                          r"bytetrack$"):
        parse_config(with_analytics(LINE, tracker="none"))
    with pytest.raises(ConfigError, match=r"sources\[0\].analytics\[1\].name: duplicate name "
                                          r"'gate' in this source's analytics"):
        parse_config(with_analytics(LINE, {**ZONE, "name": "gate"}))
    with pytest.raises(ConfigError, match=r"sources\[0\].tracker: expected one of 'none', "
                                          r"'bytetrack', got 'sort'"):
        parse_config(with_analytics(LINE, tracker="sort"))


def test_events_paths_take_part_in_the_collision_checks(files: Path) -> None:
    """Only sources with analytics write events; their files may not be another output."""
    data = with_analytics(LINE, events="{source}.jsonl")
    with pytest.raises(ConfigError, match=r"output.events: output.events of source 'cam1' "
                                          r"would be '.*cam1.jsonl', which is also output.jsonl"):
        parse_config(data)
    data = with_analytics(LINE, events="all-events.jsonl")
    data["sources"].append({"name": "cam2", "uri": "clip.mp4"})  # no analytics: no events
    assert parse_config(data).sources_writing("events") == [parse_config(data).sources[0]]
    data["sources"][1].update(tracker="bytetrack", analytics=[LINE])
    with pytest.raises(ConfigError, match=r"output.events: with several sources the path must "
                                          r"contain \{source\}"):
        parse_config(data)
    data = with_analytics(LINE)
    data["sources"].append({"name": "cam1.events", "uri": "clip.mp4"})  # its jsonl: cam1's events
    with pytest.raises(ConfigError, match=r"which is also output.events of source 'cam1'"):
        parse_config(data)


@pytest.mark.parametrize(("template", "written"), [
    ("../README.md", "README.md"),  # a new user's trial overwrote the project's README so
    ("/tmp/x/{source}.jsonl", "/tmp/x/cam1.jsonl"),
    ("sub/../../{source}.jsonl", "cam1.jsonl"),
])
def test_an_output_name_may_not_leave_output_dir(files: Path, template: str, written: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(with_value("output.jsonl", template))
    assert str(info.value) == (f"output.jsonl: {template!r} leaves output.dir ('output'): source "
                               f"'cam1' would write {written!r}; name a file inside it (a "
                               f"subfolder is fine)")


def test_an_output_may_go_into_a_subfolder_of_output_dir(files: Path) -> None:
    config = parse_config(with_value("output.jsonl", "jsonl/./{source}.jsonl"))
    assert config.output_path(config.output.jsonl, "cam1") == Path("output/jsonl/cam1.jsonl")


def test_an_output_over_the_config_file_being_run_is_refused(files: Path) -> None:
    data = {**base(), "output": {"dir": ".", "jsonl": "{source}.yaml"}}
    (files / "cam1.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as info:
        load_config("cam1.yaml")
    assert str(info.value) == ("output.jsonl: source 'cam1' would write 'cam1.yaml', which is "
                               "the config file being run")
    assert parse_config(data).output.dir == "."  # the same outputs from another config: fine


def test_schema_lists_the_keys_of_regions_and_mqtt() -> None:
    text = "\n".join(describe_schema())
    for key in ("sources[].analytics[]:", "sources[].analytics[].polygon", "sources[].tracker ",
                "output.events", "output.mqtt:", "output.mqtt.host", "output.mqtt.topic_prefix",
                "output.webhooks[]:", "output.webhooks[].url (a string; required)",
                "output.webhooks[].headers (a mapping or null"):
        assert key in text, key


def test_the_analytics_example_config_is_valid(samples, repo_root: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(repo_root)
    config = load_config("configs/analytics.yaml")
    (source,) = config.sources
    assert source.tracker == "bytetrack" and [r.type for r in source.analytics] == ["line", "zone"]
    assert source.tracker_class_aware and config.output.trails == 20


@pytest.mark.parametrize("uri", ["http://cam.local/live.mp4", "https://cam.local/x.m3u8",
                                 "srt://cam.local:9000", "rtmp://cam.local/live"])
def test_every_scheme_the_help_names_is_accepted_as_a_live_stream(files: Path, uri: str) -> None:
    """``--help-config`` names the schemes a source's uri may use; each of them is accepted
    (a live stream that reconnects by default) and any other is refused with the list."""
    (help_line,) = [line for line in describe_schema() if line.startswith("  sources[].uri ")]
    assert uri.split("://")[0] + "://" in help_line
    data = {**base(), "sources": [{"name": "cam1", "uri": uri}]}
    source = parse_config(data).sources[0]
    assert source.is_live and source.should_reconnect
    with pytest.raises(ConfigError, match="allowed: http, https, rtmp, rtmps, rtsp, rtsps, srt"):
        parse_config({**data, "sources": [{"name": "cam1", "uri": "gopher://cam.local/x"}]})


def test_event_media_needs_the_events_file_that_names_it(files: Path) -> None:
    data = {**base(), "output": {"events": None, "event_media": {"snapshot": True}}}
    with pytest.raises(ConfigError, match=r"^output.event_media: needs output.events "):
        parse_config(data)
    data["output"]["events"] = "{source}.events.jsonl"
    assert parse_config(data).output.event_media.queue_size == 128


@pytest.mark.parametrize(("roi", "message"), [
    ([[0, 150], [640, 272], [640, 150], [0, 272]],
     "sources[0].roi: the region of interest has edges that cross (edge 1 [0,150]->[640,272] "
     "and edge 3 [640,150]->[0,272]); list its corners in order around it"),
    ([[0, 0], [10, 10], [20, 20]],
     "sources[0].roi: the region of interest encloses no area (its points lie on one line): "
     "[[0.0, 0.0], [10.0, 10.0], [20.0, 20.0]]"),
    ([[0, 0], [10, 0]], "sources[0].roi: expected a polygon of at least 3 [x, y] points, got "
                        "[[0.0, 0.0], [10.0, 0.0]]"),
])
def test_a_region_of_interest_is_checked_as_a_zone_is(files: Path, roi, message) -> None:
    """A new user's bow-tie roi ran without a word (zones were refused the same shape)."""
    config = base()
    config["sources"][0]["roi"] = roi
    with pytest.raises(ConfigError) as info:
        parse_config(config)
    assert str(info.value) == message
    config["sources"][0]["roi"] = [[0, 150], [640, 150], [640, 272], [0, 272]]
    assert parse_config(config).sources[0].roi == [[0, 150], [640, 150], [640, 272], [0, 272]]
