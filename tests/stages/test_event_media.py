"""Event media on real frames of bikes.mp4 (no model): the snapshot's highlight lies on the
event's box, a clip from the in-memory ring spans the event +- its seconds, and a full queue
drops media (counted), never the event."""

from __future__ import annotations

import json
import time
from fractions import Fraction
from pathlib import Path

import av
import cv2
import numpy as np
import pytest
from structlog.testing import capture_logs

from pipeline.config import ClipConfig, EventMediaConfig
from pipeline.records import AnalyticsEvent
from stages.event_media import HIGHLIGHT_BGR, EventMedia, highlight_thickness, snapshot_jpeg
from tests.support.batches import batch_detections, make_frame

RATE = Fraction(25)
BOX = (200.0, 60.0, 330.0, 250.0)


@pytest.fixture(scope="module")
def bikes_i420(samples) -> list[np.ndarray]:
    """The first 120 frames of bikes.mp4 as (272 * 3 // 2, 640) uint8 I420 arrays."""
    with av.open(str(samples.bikes)) as video:
        return [frame.to_ndarray(format="yuv420p") for _, frame in
                zip(range(120), video.decode(video.streams.video[0]))]


def highlighted_share(jpeg: bytes, box: tuple[float, ...], origin: tuple[int, int] = (0, 0)
                      ) -> float:
    """The share of the pixels on the box's four edges (the highlight's middle line) that
    are within 60 of ``HIGHLIGHT_BGR`` in every channel."""
    picture = cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR)
    assert picture is not None, "not a JPEG"
    x1, y1, x2, y2 = (int(round(v)) - o for v, o in zip(box, origin * 2))
    edges = np.concatenate([picture[y1, x1:x2], picture[y2, x1:x2], picture[y1:y2, x1],
                            picture[y1:y2, x2]])
    near = (np.abs(edges.astype(int) - HIGHLIGHT_BGR) <= 60).all(axis=1)
    return float(near.mean())


def event_at(frame: int, box: tuple[float, ...] = BOX) -> AnalyticsEvent:
    return AnalyticsEvent("bikes", "enter", "kerb", frame, frame / 25, time.time(), 7, 0,
                          "person", 0.9, box)


@pytest.mark.parametrize("crop", [False, True])
def test_the_snapshot_highlights_the_box(bikes_i420, crop: bool) -> None:
    image = bikes_i420[30]
    before = image.copy()
    jpeg, origin = snapshot_jpeg(image, 640, 272, BOX, "enter kerb #7 person", crop=crop)
    assert np.array_equal(image, before)  # the frame is not drawn on
    picture = cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR)
    assert highlighted_share(jpeg, BOX, origin) > 0.95
    # Inside the box, away from the line, the frame's own pixels (not the highlight).
    x1, y1, x2, y2 = (int(v) - o for v, o in zip(BOX, origin * 2))
    pad = highlight_thickness(640, 272) + 2
    inner = picture[y1 + pad:y2 - pad, x1 + pad:x2 - pad].reshape(-1, 3).astype(int)
    assert (np.abs(inner - HIGHLIGHT_BGR) <= 60).all(axis=1).mean() < 0.05
    if crop:
        assert picture.shape[1] < 640 and origin[0] > 0
    else:
        assert picture.shape == (272, 640, 3) and origin == (0, 0)


def test_a_box_that_touches_the_frames_top_keeps_its_label_inside_it(bikes_i420) -> None:
    """The two line crossings of configs/analytics.yaml have boxes from y 2 and 5 to the
    frame's bottom: the label goes inside the box's top (it went below the frame)."""
    tall = (200.0, 2.0, 330.0, 270.0)
    jpeg, _ = snapshot_jpeg(bikes_i420[30], 640, 272, tall, "cross_out middle #3 person")
    picture = cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR)
    pad = highlight_thickness(640, 272) + 1
    under_top = picture[pad:pad + 8, 205:300].reshape(-1, 3).astype(int)  # the label's band
    assert (np.abs(under_top - HIGHLIGHT_BGR) <= 60).all(axis=1).mean() > 0.5


def feed(media: EventMedia, frames: list[np.ndarray], events: dict[int, AnalyticsEvent],
         batch: int = 4) -> list[AnalyticsEvent]:
    """``frames`` through ``media.observe`` in batches of ``batch``, the events on their
    frames; returns the events as the media gave them back."""
    out = []
    for start in range(0, len(frames), batch):
        rows = [(make_frame("bikes", i, frames[i], pts=i / 25, rate=RATE), [])
                for i in range(start, min(start + batch, len(frames)))]
        item = batch_detections(rows)
        out += media.observe(item, [e for i, e in events.items() if start <= i < start + batch])
    media.end("bikes")
    return out


def test_a_clip_from_the_ring_spans_the_event_and_its_seconds(bikes_i420, tmp_path: Path) -> None:
    """No recording: the clip is encoded from the ring; its frames are those from pre_s
    before to post_s after the event, as its metadata says, and its times span that."""
    media = EventMedia(EventMediaConfig(clip=ClipConfig(pre_s=1.0, post_s=1.5)))
    media.add_source("bikes", tmp_path / "bikes.events.jsonl", None)
    media.start()
    (event,) = feed(media, bikes_i420, {60: event_at(60)})
    media.close()
    assert event.snapshot and event.clip and event.snapshot.startswith("bikes.events/")
    assert highlighted_share((tmp_path / event.snapshot).read_bytes(), BOX) > 0.95
    with av.open(str(tmp_path / event.clip)) as clip:
        meta = json.loads(clip.metadata["comment"])
        times = [frame.time for frame in clip.decode(clip.streams.video[0])]
    assert meta["start_frame"] == 60 - 25 and meta["start_pts"] == pytest.approx(1.4)
    assert len(times) == 25 + 1 + 37  # frames 35..97: 3.88 s <= 2.4 s + 1.5 s < 3.92 s
    start, end = meta["start_pts"], meta["start_pts"] + times[-1] - times[0]
    assert start <= event.pts - 1.0 + 1e-6 and end >= event.pts + 1.5 - 1 / 25
    assert media.stats() == type(media.stats())(1, 1, 0, 0, 0)


def test_a_full_queue_drops_media_never_events(bikes_i420, tmp_path: Path) -> None:
    """queue_size 2 and a burst of 4 events on one frame: the first gets a snapshot and a
    clip (2 jobs), the others none, and all four events come back, counted as dropped."""
    media = EventMedia(EventMediaConfig(queue_size=2, clip=ClipConfig(pre_s=0.2, post_s=0.2)))
    media.add_source("bikes", tmp_path / "bikes.events.jsonl", None)
    media.start()
    frame = make_frame("bikes", 0, bikes_i420[0], pts=0.0, rate=RATE)
    burst = [AnalyticsEvent("bikes", "enter", "kerb", 0, 0.0, time.time(), k, 0, "person",
                            0.9, BOX) for k in range(4)]
    out = media.observe(batch_detections([(frame, [])]), burst)
    media.close()
    assert [e.tracker_id for e in out] == [0, 1, 2, 3]
    assert out[0].snapshot and out[0].clip
    assert all(e.snapshot is None and e.clip is None for e in out[1:])
    assert "snapshot" not in out[1].to_json()
    stats = media.stats()
    assert (stats.snapshots, stats.clips, stats.dropped) == (1, 1, 3)


def test_the_summary_is_logged_only_where_a_source_made_media(bikes_i420,
                                                               tmp_path: Path) -> None:
    """A source worker builds the event media whether or not it runs a source with analytics
    (``runtime.workers: 2``: the other worker and the spare never do): without a source it
    logs no ``event media summary`` (its zeros read as the run's count); with one, the line
    names its sources."""
    idle = EventMedia(EventMediaConfig(clip=None))
    idle.start()
    with capture_logs() as idle_logs:
        idle.close()
    assert not [e for e in idle_logs if e["event"] == "event media summary"]
    media = EventMedia(EventMediaConfig(clip=None))
    media.add_source("bikes", tmp_path / "bikes.events.jsonl", None)
    media.start()
    frame = make_frame("bikes", 0, bikes_i420[0], pts=0.0, rate=RATE)
    media.observe(batch_detections([(frame, [])]), [event_at(0)])
    with capture_logs() as logs:
        media.close()
    (summary,) = [e for e in logs if e["event"] == "event media summary"]
    assert (summary["snapshots"], summary["clips"], summary["sources"]) == (1, 0, ["bikes"])


def i420_to_nv12(image: np.ndarray, width: int, height: int) -> np.ndarray:
    """The same picture with its U and V planes interleaved (NVDEC's layout):
    (height * 3 // 2, width) uint8."""
    u = image[height:height + height // 4].reshape(height // 2, width // 2)
    v = image[height + height // 4:].reshape(height // 2, width // 2)
    return np.concatenate([image[:height], np.stack([u, v], axis=2).reshape(height // 2, width)])


def test_an_nv12_frame_gives_the_i420_frames_snapshot(bikes_i420) -> None:
    """The same picture in NVDEC's layout: the same pixels, so the same JPEG."""
    image = bikes_i420[30]
    i420, _ = snapshot_jpeg(image, 640, 272, BOX, "enter kerb #7 person")
    nv12, _ = snapshot_jpeg(i420_to_nv12(image, 640, 272), 640, 272, BOX,
                            "enter kerb #7 person", pixel_format="nv12")
    assert nv12 == i420


def test_an_nvdec_frame_is_downloaded_once_for_its_snapshots(bikes_i420, tmp_path: Path,
                                                              monkeypatch) -> None:
    """A frame with no host pixels but its decoder's pictures kept (``device_pictures``):
    its two events' snapshots come from one download (a fake of the device copy, here on
    the CPU), the NV12 picture; the frame without events is never downloaded."""
    import stages.event_media as event_media
    from pipeline.records import BatchDetections, FrameBatch

    downloads = []

    def download(y: np.ndarray, uv: np.ndarray) -> np.ndarray:  # the D2H copy, on the host
        downloads.append(y)
        return np.concatenate([y, uv.reshape(uv.shape[0], -1)])

    monkeypatch.setattr(event_media, "download_nv12", download)
    planes = []
    for image in bikes_i420[:2]:
        nv12 = i420_to_nv12(image, 640, 272)
        planes.append((nv12[:272], nv12[272:].reshape(136, 320, 2)))
    frames = [make_frame("bikes", i, width=640, height=272, pts=i / 25, rate=RATE)
              for i in range(2)]
    for frame, picture in zip(frames, planes):
        frame.device_planes = picture
    letterbox = np.array([[1, 1, 0, 0, 640, 272]] * 2, np.float32)
    batch = FrameBatch.from_frames(frames, {"bikes": 0}, ("bikes",), letterbox,
                                   device_pictures=True)
    assert batch.images == [None, None] and batch.device_pictures == planes
    empty = (np.empty((0, 4), np.float32), np.empty(0, np.float32), np.empty(0, np.int32))
    item = BatchDetections.from_lists(batch, [empty, empty])
    media = EventMedia(EventMediaConfig(clip=None))
    media.add_source("bikes", tmp_path / "bikes.events.jsonl", None)
    media.start()
    first, second = event_at(1), replace_track(event_at(1), 8)
    out = media.observe(item, [first, second])
    media.close()
    assert len(downloads) == 1 and downloads[0] is planes[1][0]
    expected, _ = snapshot_jpeg(bikes_i420[1], 640, 272, BOX, "enter kerb #7 person")
    assert (tmp_path / out[0].snapshot).read_bytes() == expected
    assert out[1].snapshot != out[0].snapshot and (tmp_path / out[1].snapshot).exists()
    assert all(e.clip is None for e in out)


def replace_track(event: AnalyticsEvent, tracker_id: int) -> AnalyticsEvent:
    from dataclasses import replace

    return replace(event, tracker_id=tracker_id)


class OneRecording:
    """A source's sink as the media asks it (``RecordingSource``): one real ``VideoWriter``."""

    def __init__(self, writer) -> None:
        self.writer, self.video_path = writer, writer.path

    def recording_of(self, frame: int):
        return self.writer if self.writer.frames else None


@pytest.mark.parametrize("stalls", [False, True], ids=["moving", "stalled"])
def test_a_clip_waits_for_its_recording_while_it_takes_frames(bikes_i420, tmp_path: Path,
                                                               monkeypatch, stalls: bool) -> None:
    """A clip from the recording waits for its frames, its fragment (up to the next keyframe,
    then x264's held frames) written only after the wait (here 0.2 s) has passed: while the
    recording takes frames the clip keeps waiting and is made (before the recording's first
    fragment, FFmpeg cannot even seek in it: that too is "not there yet"); a recording that
    stops taking frames (its writer stuck) gives it up, counted as failed."""
    import stages.event_media as event_media
    from stages.sinks import VideoWriter

    monkeypatch.setattr(event_media, "RECORDING_WAIT_S", 0.2)
    monkeypatch.setattr(event_media, "RETRY_S", 0.02)
    writer = VideoWriter(tmp_path / "bikes.mp4", 23)
    media = EventMedia(EventMediaConfig(snapshot=False, clip=ClipConfig(pre_s=0.2, post_s=0.2)))
    media.add_source("bikes", tmp_path / "bikes.events.jsonl", OneRecording(writer))
    media.start()
    out = []
    for start in range(0, 120, 4):  # 25 fps: keyframes at frames 0, 50, 100 (or scene cuts)
        item = batch_detections([(make_frame("bikes", i, bikes_i420[i], pts=i / 25, rate=RATE),
                                  []) for i in range(start, start + 4)])
        out += media.observe(item, [event_at(10)] if start == 8 else [])
        if not (stalls and start >= 32):
            writer.write(item)
        time.sleep(0.08)  # 2.4 s of wall time in all: the wait passes about 12 times
    if stalls:
        time.sleep(0.5)  # stuck, not closed: past the wait with no frame taken
    media.close()
    writer.close(complete=True)
    (event,) = out
    assert event.clip == "bikes.events/" + Path(event.clip).name
    stats = media.stats()
    if stalls:
        assert (stats.clips, stats.failed) == (0, 1)
        assert not (tmp_path / event.clip).exists()
    else:
        assert (stats.clips, stats.failed) == (1, 0)
        with av.open(str(tmp_path / event.clip)) as clip:
            meta = json.loads(clip.metadata["comment"])
            frames = sum(1 for _ in clip.decode(clip.streams.video[0]))
        # whole GOPs (a keyframe every 50 frames, or at a scene cut) around frames 5..15
        assert meta["start_frame"] <= 5 and meta["start_frame"] + frames > 15, (meta, frames)
