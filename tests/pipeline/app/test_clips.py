"""pipeline.app.clips: a clip repeated by a stream copy, long enough for a measurement."""

from __future__ import annotations

import threading

import av
import pytest

from pipeline.app.clips import clip_for, clip_frames, make_looped_clip, repeats_for
from pipeline.config import SourceConfig
from pipeline.records import Frame
from stages.decode import DecodeStage


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


@pytest.mark.parametrize(("frames", "seconds", "fps", "repeats"), [
    (250, 10, 25, 1),  # exactly the clip
    (250, 10.1, 25, 2),
    (120, 60, 30, 15),
    (0, 1, 1, 1),  # an empty clip is never divided by
])
def test_repeats_cover_the_seconds_at_the_pace(frames, seconds, fps, repeats):
    assert repeats_for(frames, seconds, fps) == repeats


def test_a_long_enough_clip_is_used_as_it_is(samples, tmp_path):
    assert clip_for(samples.carphone, 3.0, 30.0, tmp_path) == samples.carphone  # 120 frames
    looped = clip_for(samples.carphone, 9.0, 30.0, tmp_path)
    assert looped.parent == tmp_path and clip_frames(looped) == 3 * 120
