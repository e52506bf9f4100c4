"""pipeline.resume and the sink's resume: a source moved after its pipeline was killed
starts after its last complete record and appends to its records; a torn line goes."""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import av
import pytest
from structlog.testing import capture_logs

from pipeline.config import SourceConfig, parse_config
from pipeline.records import EndOfStream, Frame
from pipeline.resume import (
    RecordsSettings,
    check_settings,
    cut_files,
    cut_torn_line,
    next_tracker_id,
    resume_point,
    resumed_sources,
    stamp_settings,
)
from stages.decode import DecodeStage
from stages.sinks import SinkStage
from tests.support import read_frames
from tests.support.batches import batch_detections, grey_image, make_frame
from tests.support.ci import skip_unless_ci
from tests.support.harness import run_stage

RECORD = '{{"source":"cam","frame":{},"detections":[]}}\n'


@pytest.mark.parametrize("text, kept, last", [
    ("", "", None),
    ('{"fra', "", None),  # a torn first line: nothing complete
    (RECORD.format(0), RECORD.format(0), RECORD.format(0).strip()),
    (RECORD.format(0) + RECORD.format(1) + '{"source":"cam","fr',
     RECORD.format(0) + RECORD.format(1), RECORD.format(1).strip()),
])
def test_cut_torn_line_keeps_the_complete_lines(tmp_path, text, kept, last):
    path = tmp_path / "cam.partial.jsonl"
    path.write_text(text)
    found = cut_torn_line(path)
    assert path.read_text() == kept
    assert (found.decode() if found is not None else None) == last


def test_cut_torn_line_reads_across_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr("pipeline.resume.TAIL_CHUNK", 7)
    path = tmp_path / "cam.partial.jsonl"
    path.write_text("".join(RECORD.format(i) for i in range(50)) + '{"source": "cam", "fr')
    assert json.loads(cut_torn_line(path))["frame"] == 49
    assert path.read_text().count("\n") == 50


def test_resume_point_is_the_frame_after_the_last_complete_record(tmp_path):
    final = tmp_path / "cam.jsonl"
    assert resume_point(final) == 0  # no partial file: from the start
    (tmp_path / "cam.partial.jsonl").write_text(RECORD.format(0) + RECORD.format(1) + "{")
    assert resume_point(final) == 2
    (tmp_path / "cam.partial.jsonl").write_text("not a record\n")
    with pytest.raises(ValueError, match="not a frame record"):
        resume_point(final)


def tracked_record(frame: int, ids: list[int]) -> str:
    detections = [{"class_id": 0, "confidence": 0.9, "xyxy": [1, 2, 3, 4], "tracker_id": i}
                  for i in ids]
    return json.dumps({"source": "cam", "frame": frame, "detections": detections},
                      separators=(",", ":")) + "\n"


def test_next_tracker_id_is_one_past_the_largest_id_of_the_complete_records(tmp_path,
                                                                            monkeypatch):
    """Not the last record's: an ended track's id (12) counts; -1 (no track) is none; a
    torn last line (its 99) is not a record."""
    final = tmp_path / "cam.jsonl"
    assert next_tracker_id(final) == 0  # no partial file
    partial = tmp_path / "cam.partial.jsonl"
    partial.write_text(RECORD.format(0) + tracked_record(1, [-1]))
    assert next_tracker_id(final) == 0  # records without a confirmed track
    text = "".join(tracked_record(i, ids) for i, ids in enumerate(
        [[-1], [0, -1], [0, 3], [12, 3], [3], [], [4, 3, -1]]))
    partial.write_text(text + '{"source":"cam","frame":7,"detections":[{"tracker_id":99')
    assert next_tracker_id(final) == 13
    monkeypatch.setattr("pipeline.resume.SCAN_CHUNK", 7)  # ids split across reads
    assert next_tracker_id(final) == 13


def test_resumed_sources_start_after_their_records(samples, tmp_path):
    config = parse_config({"sources": [{"name": n, "uri": str(samples.bikes)} for n in "ab"],
                           "output": {"dir": str(tmp_path)}})
    (tmp_path / "a.partial.jsonl").write_text(RECORD.format(0) + RECORD.format(1))
    assert [(s.name, s.start_frame) for s in resumed_sources(config, ["b", "a"])] == \
        [("b", 0), ("a", 2)]
    config.output.jsonl = None  # no records: nothing to resume from
    assert [s.start_frame for s in resumed_sources(config, ["a"])] == [0]


def test_a_file_resumed_at_a_frame_skips_the_frames_before_it_and_keeps_their_numbers(samples):
    source = DecodeStage(SourceConfig(name="car", uri=str(samples.carphone), start_frame=100))
    items = list(source.frames(threading.Event()))
    frames = [item for item in items if isinstance(item, Frame)]
    assert [f.index for f in frames] == list(range(100, 120))
    assert items[-1] == EndOfStream("car", 120)


def frames(indexes) -> list:
    return [make_frame("cam", i, grey_image(64, 48), capture_time=1000.0 + i) for i in indexes]


def write(sink: SinkStage, items: list, end: bool) -> None:
    """Run ``sink`` over ``items`` in parts of 4; without ``end``, a run killed before it."""
    batches = [batch_detections([(f, []) for f in items[start:start + 4]])
               for start in range(0, len(items), 4)]
    run_stage(sink, [*batches, *([EndOfStream("cam", len(items))] if end else [])], finish=end)


def test_a_resumed_sink_appends_to_the_records_and_writes_its_video_anew(tmp_path: Path):
    video, jsonl = tmp_path / "cam.mp4", tmp_path / "cam.jsonl"
    write(SinkStage("sink:cam", video, jsonl, None), frames(range(10)), end=False)  # killed
    partial = tmp_path / "cam.partial.jsonl"
    partial.write_text(partial.read_text() + '{"source":"cam","frame":10,"det')  # torn
    assert resume_point(jsonl) == 10
    (tmp_path / "cam.from-3.mp4").write_bytes(b"an older run's resumed part")
    write(SinkStage("sink:cam", video, jsonl, None, resume_from=10), frames(range(10, 16)),
          end=True)
    assert [json.loads(line)["frame"] for line in jsonl.read_text().splitlines()] == \
        list(range(16))
    assert not partial.exists() and not video.exists()
    assert (tmp_path / "cam.from-10.mp4").stat().st_size > 0
    # the dead pipeline's part, complete up to its cut, gets a final name with the file
    assert not (tmp_path / "cam.partial.mp4").exists()
    assert len(read_frames(tmp_path / "cam.from-0.mp4")) == 10
    # A fresh start removes what resumed runs left.
    write(SinkStage("sink:cam", video, jsonl, None), frames(range(3)), end=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cam.jsonl", "cam.mp4"]
    assert len(jsonl.read_text().splitlines()) == 3


def header_only_mp4(path: Path) -> None:
    """The MP4 a process killed before its first fragment leaves: a header, no packet."""
    with av.open(str(path), "w", options={"movflags": "frag_keyframe+empty_moov"}) as out:
        stream = out.add_stream("libx264", rate=25)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        out.start_encoding()


@pytest.mark.parametrize("empty", ["header only", "no bytes"])
def test_a_part_killed_before_its_first_fragment_is_deleted_not_given_a_final_name(
        tmp_path: Path, empty: str):
    video, jsonl = tmp_path / "cam.mp4", tmp_path / "cam.jsonl"
    write(SinkStage("sink:cam", video, jsonl, None), frames(range(10)), end=False)  # killed
    write(SinkStage("sink:cam", video, jsonl, None, resume_from=10), frames(range(10, 14)),
          end=False)  # killed again
    cut = tmp_path / "cam.from-10.partial.mp4"
    if empty == "header only":
        header_only_mp4(cut)
    else:
        cut.write_bytes(b"")
    write(SinkStage("sink:cam", video, jsonl, None, resume_from=14), frames(range(14, 16)),
          end=True)
    assert sorted(p.name for p in tmp_path.glob("*.mp4")) == ["cam.from-0.mp4",
                                                              "cam.from-14.mp4"]
    assert len(read_frames(tmp_path / "cam.from-0.mp4")) == 10
    assert [json.loads(line)["frame"] for line in jsonl.read_text().splitlines()] == \
        list(range(16))


def settings_config(samples, tmp_path: Path, model: Path | None = None, **changes) -> Any:
    """A configuration of file source ``cam`` (bikes.mp4) writing into ``tmp_path``; ``model``:
    another model file; ``changes``: ``nms`` values, and the source's as ``source={...}``."""
    source = {"name": "cam", "uri": str(samples.bikes), **changes.pop("source", {})}
    return parse_config({"sources": [source],
                         "model": {"path": str(model or samples.model),
                                   "class_names": str(samples.names)},
                         "nms": changes, "output": {"dir": str(tmp_path), "video": None}})


def settings_changes(samples, tmp_path: Path, then: dict, now: dict) -> list[str]:
    was = RecordsSettings.of(c := settings_config(samples, tmp_path, **then), c.sources[0])
    return was.changes(RecordsSettings.of(c := settings_config(samples, tmp_path, **now),
                                          c.sources[0]), 0)


def test_records_settings_say_what_changed(samples, tmp_path):
    assert settings_changes(samples, tmp_path, {}, {}) == []
    assert settings_changes(samples, tmp_path, {}, {"conf_threshold": 0.4}) == \
        ["nms.conf_threshold was 0.25, now 0.4"]
    assert settings_changes(samples, tmp_path, {"source": {"classes": ["person"]}},
                            {"iou_threshold": 0.5, "source": {"classes": ["person", 2]}}) == \
        ["nms.iou_threshold was 0.45, now 0.5",
         'sources[0].classes was ["person"], now ["person", 2]']
    # a tracker's settings count with a tracker only; turning it on says so once
    assert settings_changes(samples, tmp_path, {"source": {"tracker_lost_s": 3.0}}, {}) == []
    assert settings_changes(samples, tmp_path, {}, {"source": {"tracker": "bytetrack"}}) == \
        ['sources[0].tracker was "none", now "bytetrack"']
    # a long value is stamped as a digest: compared, not shown
    roi = [[float(x), 10.0] for x in range(30)] + [[0.0, 200.0]]
    changed = [[x, y + 1] for x, y in roi]
    assert settings_changes(samples, tmp_path, {"source": {"roi": roi}},
                            {"source": {"roi": changed}}) == ["sources[0].roi has changed"]
    stamp = RecordsSettings.of(c := settings_config(samples, tmp_path, source={"roi": roi}),
                               c.sources[0]).to_bytes()
    assert len(stamp) < 1000, stamp


def test_records_settings_name_another_model_or_the_same_one_changed(samples, tmp_path):
    copy = tmp_path / "model.onnx"
    shutil.copy(samples.model, copy)
    then = RecordsSettings.of(c := settings_config(samples, tmp_path), c.sources[0])
    (text,) = then.changes(RecordsSettings.of(c := settings_config(samples, tmp_path, copy),
                                              c.sources[0]), 0)
    assert text.startswith(f"model.path was {os.path.realpath(samples.model)!r} (")
    assert f"now {str(copy)!r} (" in text
    then = RecordsSettings.of(c := settings_config(samples, tmp_path, copy), c.sources[0])
    stat = copy.stat()
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    (text,) = then.changes(RecordsSettings.of(c, c.sources[0]), 0)
    assert text.startswith(f"model.path {str(copy)!r} has changed since (")


def test_a_stamp_of_another_version_or_without_a_key_is_not_compared_for_it():
    assert RecordsSettings.from_bytes(b'{"version": 2, "settings": {}}') is None
    assert RecordsSettings.from_bytes(b"not ours") is None
    stamped = RecordsSettings.from_bytes(b'{"version": 1, "settings": {"nms.conf_threshold": 0.25}}')
    now = RecordsSettings({"nms.conf_threshold": 0.25, "nms.iou_threshold": 0.5})
    assert stamped is not None and stamped.changes(now, 0) == []


def cut_records(tmp_path: Path, name: str = "cam") -> Path:
    """A cut-short records file of ``name`` with frames 0-2."""
    partial = tmp_path / f"{name}.partial.jsonl"
    partial.write_text("".join(RECORD.format(i) for i in range(3)))
    return partial


def stamp_or_skip(partial: Path, settings: RecordsSettings) -> None:
    if not stamp_settings(partial, settings):
        skip_unless_ci(f"{partial.parent}'s file system keeps no extended attributes",
                       "resume settings")


def test_check_settings_refuses_other_settings_and_tells_why_it_could_not_check(
        samples, tmp_path, monkeypatch):
    config = settings_config(samples, tmp_path)
    partial = cut_records(tmp_path)
    jsonl = tmp_path / "cam.jsonl"
    assert check_settings(config, config.sources[0], jsonl, 3) == \
        "they were not stamped on the records (an earlier version wrote them)"
    stamp_or_skip(partial, RecordsSettings.of(config, config.sources[0]))
    assert check_settings(config, config.sources[0], jsonl, 3) is None
    config.nms.conf_threshold = 0.4
    with pytest.raises(ValueError) as info:
        check_settings(config, config.sources[0], jsonl, 3)
    assert str(info.value) == (f"{str(partial)!r} holds records up to frame 2 made with other "
                               "settings (nms.conf_threshold was 0.25, now 0.4): set them back "
                               "to continue it")

    def unsupported(*args):
        raise OSError(errno.ENOTSUP, "Operation not supported")

    monkeypatch.setattr("pipeline.resume.os.getxattr", unsupported)
    assert check_settings(config, config.sources[0], jsonl, 3) == \
        "their file system keeps no extended attributes"


def test_cut_files_warns_once_of_the_records_it_could_not_check(samples, tmp_path):
    config = parse_config({"sources": [{"name": n, "uri": str(samples.bikes)} for n in "ab"],
                           "output": {"dir": str(tmp_path), "video": None}})
    partials = [cut_records(tmp_path, name) for name in "ab"]
    with capture_logs() as logs:
        assert cut_files(config) == {"a": 3, "b": 3}
    (warning,) = [e for e in logs if e["log_level"] == "warning"]
    assert warning["event"].startswith("resuming records whose model and detection settings "
                                       "could not be checked: they were not stamped")
    assert warning["files"] == [str(p) for p in partials]


def test_cut_files_warns_of_the_earlier_video_a_run_without_video_does_not_continue(
        samples, tmp_path):
    config = parse_config({"sources": [{"name": "cam", "uri": str(samples.bikes)}],
                           "output": {"dir": str(tmp_path), "video": None}})
    cut_records(tmp_path)
    videos = [tmp_path / "cam.from-40.partial.mp4", tmp_path / "cam.partial.mp4"]
    for video in videos:
        video.write_bytes(b"an earlier run's video")
    (tmp_path / "cam.from-9.mp4").write_bytes(b"a finished part")  # not cut short
    (tmp_path / "camera.partial.mp4").write_bytes(b"another source's")
    with capture_logs() as logs:
        cut_files(config)
    (warning,) = [e for e in logs if e["event"].startswith("an earlier run's video")]
    assert warning["paths"] == [str(tmp_path / "cam.partial.mp4"),
                                str(tmp_path / "cam.from-40.partial.mp4")]
    assert all(video.read_bytes() == b"an earlier run's video" for video in videos)
    config.output.video = "{source}.mp4"  # its sink continues them: nothing to say
    with capture_logs() as logs:
        cut_files(config)
    assert not [e for e in logs if e["event"].startswith("an earlier run's video")]
