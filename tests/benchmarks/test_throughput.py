"""benchmarks.throughput: its small (CPU) mode end to end, as CI runs it, and its parts."""

from __future__ import annotations

import threading

import av
import pytest

from benchmarks.throughput import clip_frames, main, make_looped_clip, steady_rate
from pipeline.config import SourceConfig
from pipeline.records import Frame
from stages.decode import DecodeStage


@pytest.mark.parametrize("times, rate", [
    ([0.0, 1.0, 2.0, 3.0, 4.0], 1.0),
    ([4.0, 0.0, 2.0, 1.0, 3.0], 1.0),  # completions from several sinks arrive unordered
    ([float(t) / 100 for t in range(101)], 100.0),
])
def test_steady_rate_leaves_out_the_start(times, rate):
    assert steady_rate(times)[0] == pytest.approx(rate)


def test_steady_rate_counts_every_frame_of_a_batch_part():
    # 10 parts of 8 frames, one every 0.1 s: 80 frames/s; the first 10% (8 frames = the first
    # part) are left out, so the window runs from 0.1 s to 0.9 s and holds 71 intervals.
    times = [i / 10 for i in range(10)]
    rate, start, end = steady_rate(times, [8] * 10)
    assert (start, end) == (pytest.approx(0.1), pytest.approx(0.9))
    assert rate == pytest.approx((80 - 1 - 8) / 0.8)
    assert steady_rate([2.0, 0.0, 1.0], [1, 1, 1])[0] == pytest.approx(1.0)


@pytest.mark.parametrize("times, counts", [([], None), ([1.0], None), ([2.0, 2.0, 2.0], None),
                                           ([1.0], [64]), ([1.0, 2.0], [0, 0])])
def test_too_few_completions_are_an_error(times, counts):
    with pytest.raises(RuntimeError, match="too few completions"):
        steady_rate(times, counts)


def test_a_looped_clip_is_the_clip_repeated_with_rising_timestamps(samples, tmp_path):
    looped = make_looped_clip(samples.carphone, tmp_path / "car_x3.mp4", 3)
    assert clip_frames(looped) == 3 * clip_frames(samples.carphone) == 360
    with av.open(str(looped)) as container:
        stream = container.streams.video[0]
        dts = [p.dts for p in container.demux(stream) if p.dts is not None]
        assert stream.codec_context.name == "h264"
    assert dts == sorted(dts) and len(set(dts)) == len(dts)
    # A plain file source reads it through, every frame decodable, once.
    source = DecodeStage(SourceConfig(name="car", uri=str(looped)))
    items = list(source.frames(threading.Event()))
    frames = [item for item in items if isinstance(item, Frame)]
    assert [f.index for f in frames] == list(range(360)) and items[-1].error is None
    pts = [f.pts for f in frames]
    assert pts == sorted(pts) and len(set(pts)) == 360
    # Made once: a second call returns the cached file as it is.
    mtime = looped.stat().st_mtime_ns
    assert make_looped_clip(samples.carphone, looped, 3).stat().st_mtime_ns == mtime


def parse(table: str) -> list[list[list[str]]]:
    """The markdown tables of ``table``: rows of cells, header rows left out."""
    tables, current = [], None
    for line in table.splitlines():
        if not line.startswith("|"):
            current = None
            continue
        if current is None:
            current = []
            tables.append(current)
            continue  # the header
        if not line.startswith("|---"):
            current.append([cell.strip() for cell in line.strip("|").split("|")])
    return tables


def test_small_mode_runs_on_the_cpu_and_writes_one_table(samples, repo_root, tmp_path, capsys):
    out = tmp_path / "table.md"
    assert main(["--small", "--cameras", "1,2", "--seconds", "1", "--fresh-cache",
                 "--assets", str(repo_root / "assets"), "--out", str(out)]) == 0
    table = out.read_text()
    assert table in capsys.readouterr().out
    pipeline, inference = parse(table)
    assert [row[:3] for row in pipeline] == [["cpu", "1", "4"], ["cpu", "2", "4"],
                                             ["naive sequential", "1", "1"]]
    for row in pipeline:
        assert "failed" not in row[-1], row[-1]  # no measurement failed
        assert float(row[3].replace(",", "")) > 0  # pipeline fps
        assert float(row[5].replace(",", "")) >= float(row[4].replace(",", ""))  # p99 >= p50
    for row in pipeline[:2]:
        assert row[9] in ("decode", "infer") and float(row[10]) > 0 and float(row[11]) > 0
        # Every stage's work and blocked time, the sinks summed, and the busiest of them.
        stages = [part.split()[0] for part in row[14].split("; ")]
        assert stages == ["batch", "infer", "postprocess", f"sinks({row[1]})"], row[14]
        assert row[12].split()[0] in stages and row[12].endswith("%")
    [[batch, backend, images_s, warmup_s, notes]] = inference
    assert (batch, backend, notes) == ("4", "onnxruntime", "")
    assert float(images_s.replace(",", "")) > 0 and float(warmup_s) >= 0


def test_a_spent_budget_skips_measurements_and_still_prints_the_table(samples, repo_root,
                                                                      tmp_path, capsys):
    assert main(["--small", "--cameras", "1", "--seconds", "1", "--budget-s", "0.001",
                 "--no-naive", "--assets", str(repo_root / "assets")]) == 0
    pipeline, inference = parse(capsys.readouterr().out.split("Throughput,")[-1])
    assert [row[:3] for row in pipeline] == [["cpu", "1", "4"]]
    assert "pipeline skipped: time budget spent" in pipeline[0][-1]
    assert inference[0][-1] == "inference skipped: time budget spent"
