"""pipeline.resume and the sink's resume: a source moved after its pipeline was killed
starts after its last complete record and appends to its records; a torn line goes."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import av
import pytest

from pipeline.config import SourceConfig, parse_config
from pipeline.records import EndOfStream, Frame
from pipeline.resume import cut_torn_line, next_tracker_id, resume_point, resumed_sources
from stages.decode import DecodeStage
from stages.sinks import SinkStage
from tests.support import read_frames
from tests.support.batches import batch_detections, grey_image, make_frame
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
